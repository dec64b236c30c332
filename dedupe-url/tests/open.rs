//! Every scheme opened on a real store the test starts: handles with their own
//! connections see the same records, and a namespace removed is gone.

use std::time::Duration;

use dedupe_core::{ClaimOptions, ClaimOutcome, Key};
use dedupe_testkit::dynamo::{dynamo_server, Emulator};
use dedupe_url::{open_store, Opener, StoreUrl};

async fn handles_share_records_and_namespaces_go(url: &str) {
    let base: StoreUrl = url.parse().expect(url);
    let url = base.in_namespace(&dedupe_testkit::unique_schema("url"));
    let key = Key::new("url", "evt_1").expect("key");
    let opts = ClaimOptions::new(Duration::from_secs(60));
    {
        let opener = Opener::new(url.clone()).await.expect("open");
        let (a, b) = (
            opener.handle().await.expect("handle"),
            opener.handle().await.expect("handle"),
        );
        assert!(matches!(
            a.claim(&key, &opts).await.expect("claim"),
            ClaimOutcome::Claimed(_)
        ));
        assert!(
            matches!(
                b.claim(&key, &opts).await.expect("claim"),
                ClaimOutcome::InFlight { .. }
            ),
            "{}: the second handle sees the first's claim",
            url.scheme()
        );
        opener.remove_namespace().await.expect("remove");
    }
    let again = Opener::new(url.clone()).await.expect("reopen");
    let store = again.handle().await.expect("handle");
    assert!(
        store.get(&key).await.expect("get").is_none(),
        "{}: the removed namespace kept its records",
        url.scheme()
    );
    again.remove_namespace().await.expect("remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_files_named_and_temporary() {
    let dir = tempfile::tempdir().expect("dir");
    handles_share_records_and_namespaces_go(&format!(
        "sqlite://{}",
        dir.path().join("open.db").display()
    ))
    .await;
    handles_share_records_and_namespaces_go("sqlite:").await;
    // One handle from a string: its temporary file lives as long as it does.
    let store = open_store("sqlite:?timeout=2s").await.expect("open");
    let key = Key::new("url", "one").expect("key");
    assert!(store
        .claim(&key, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    handles_share_records_and_namespaces_go(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_standalone_and_cluster() {
    let (_server, url) = dedupe_testkit::redis::server();
    handles_share_records_and_namespaces_go(&url).await;
    let cluster = tokio::task::spawn_blocking(dedupe_testkit::redis::RedisCluster::start)
        .await
        .expect("cluster");
    let hosts: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| u.trim_start_matches("redis://").to_string())
        .collect();
    handles_share_records_and_namespaces_go(&format!("redis+cluster://{}", hosts.join(","))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb() {
    let (_server, endpoint) = tokio::task::spawn_blocking(|| dynamo_server(Emulator::Moto))
        .await
        .expect("moto");
    handles_share_records_and_namespaces_go(&format!("dynamodb://events?endpoint={endpoint}"))
        .await;
}
