//! The memory store's own behaviour beyond the conformance suite.

use std::time::Duration;

use dedupe_core::{
    AcceptOptions, DedupeStore, Inbox, Key, MemoryStore, Retry, WhenDead, ORDER_SCAN,
};

fn key(id: &str) -> Key {
    Key::new("mem", id).expect("valid key")
}

/// Items their ordering key holds back do not stop the namespace (I15): with
/// three times `ORDER_SCAN` of them at the front, the take parks them and
/// hands out the free item behind them (a take that only read the first
/// `max + ORDER_SCAN` due items handed out nothing), and each item of the key
/// that leaves the queue (done, dead and skipped, forgotten) lets exactly the
/// next one go.
#[tokio::test]
async fn work_behind_a_burst_of_held_back_items_is_handed_out() {
    let store = MemoryStore::new();
    let lease = Duration::from_secs(60);
    let ordered = AcceptOptions::new()
        .ordering_key("cus_1")
        .when_dead(WhenDead::Skip);
    store
        .accept_with(&key("first"), b"{}", &ordered)
        .await
        .expect("accept");
    let first = store.take("mem", 1, lease).await.expect("take");
    assert_eq!(first.len(), 1);
    for i in 0..3 * ORDER_SCAN {
        store
            .accept_with(&key(&format!("behind-{i:04}")), b"{}", &ordered)
            .await
            .expect("accept");
    }
    store.accept(&key("free"), b"{}").await.expect("accept");
    let taken = store.take("mem", 1, lease).await.expect("take");
    assert_eq!(taken.len(), 1, "the free item behind the burst");
    assert_eq!(taken[0].lease.key.id(), "free");
    assert!(store.take("mem", 4, lease).await.expect("take").is_empty());

    store
        .complete(&first[0].lease, b"", Duration::from_secs(60))
        .await
        .expect("complete");
    let next = store.take("mem", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1, "one item of the key at a time");
    assert_eq!(next[0].lease.key.id(), "behind-0000");
    store
        .fail(&next[0].lease, "gone", Retry::dead())
        .await
        .expect("fail");
    assert!(store.forget(&key("behind-0001")).await.expect("forget"));
    let next = store.take("mem", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].lease.key.id(), "behind-0002");
}
