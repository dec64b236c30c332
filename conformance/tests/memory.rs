//! The reference store passes the whole suite.

dedupe_conformance::suite!(dedupe_conformance::MemoryFactory);

/// Bulk replay and forget by filter, two operators at once beside a worker
/// (`dedupe_conformance::bulk`), over 10,000 dead items.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_replay_and_forget_by_filter() {
    use std::sync::Arc;
    let store = dedupe_core::MemoryStore::new();
    let report =
        dedupe_conformance::bulk::bulk_by_filter(Arc::new(store.clone()), Arc::new(store), 10_000)
            .await
            .unwrap_or_else(|failure| panic!("{failure}"));
    eprintln!("{report}");
}
