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
    // A handle outlives its opener; the directory goes with the last handle.
    let opener = Opener::new("sqlite:".parse().expect("url"))
        .await
        .expect("open");
    let dir = opener
        .sqlite_path()
        .and_then(|p| p.parent())
        .expect("a temporary file")
        .to_path_buf();
    let handle = opener.handle().await.expect("handle");
    drop(opener);
    assert!(handle
        .claim(&key, &ClaimOptions::default())
        .await
        .expect("claim after the opener dropped")
        .lease()
        .is_some());
    assert!(dir.exists());
    drop(handle);
    assert!(!dir.exists(), "{} outlived its last handle", dir.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    handles_share_records_and_namespaces_go(&url).await;
    // Without `?schema=` the store's table is in `public`: removing the
    // namespace drops that table and nothing else (a schema named `dedupe`,
    // which an earlier version dropped instead, stays).
    let admin = dedupe_postgres::sqlx::PgPool::connect(&url)
        .await
        .expect("admin");
    dedupe_postgres::sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS dedupe; CREATE TABLE IF NOT EXISTS dedupe.canary (n int)",
    )
    .execute(&admin)
    .await
    .expect("canary");
    let opener = Opener::new(url.parse().expect("url")).await.expect("open");
    let store = opener.handle().await.expect("handle");
    let key = Key::new("url", "public").expect("key");
    assert!(store
        .claim(&key, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .is_some());
    opener.remove_namespace().await.expect("remove");
    let exists = |what: &'static str| {
        let admin = admin.clone();
        async move {
            dedupe_postgres::sqlx::query_scalar::<_, bool>(dedupe_postgres::sqlx::AssertSqlSafe(
                format!("SELECT to_regclass('{what}') IS NOT NULL"),
            ))
            .fetch_one(&admin)
            .await
            .expect("catalog")
        }
    };
    assert!(
        exists("dedupe.canary").await,
        "an unrelated schema was dropped"
    );
    assert!(
        !exists("public.dedupe_records").await,
        "the store's table was kept"
    );
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

/// A port nothing listens on.
fn refused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A listener that accepts connections and never says a word (a server hung
/// in its accept loop, or a firewall that swallows packets), kept open while
/// the returned guard lives.
async fn silent_port() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listener");
    let port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (port, task)
}

/// Opens `url` and makes one claim: the error that ends it, and how long it took.
async fn first_error(url: &str) -> (String, bool, Duration) {
    let started = std::time::Instant::now();
    let result = match open_store(url).await {
        Err(e) => Err(e.to_string()),
        Ok(store) => store
            .claim(
                &Key::new("cfg", "k").expect("key"),
                &ClaimOptions::default(),
            )
            .await
            .map_err(|e| {
                assert!(e.is_retryable(), "{url}: {e:?} is not retryable");
                e.to_string()
            }),
    };
    let took = started.elapsed();
    match result {
        Err(message) => (message, true, took),
        Ok(answer) => (format!("{answer:?}"), false, took),
    }
}

/// An unreachable server fails fast with a message that says so, and a server
/// that accepts but never answers fails at the URL's timeout, for every
/// server-backed store; never a hang, never a panic, never an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_and_silent_servers_fail_fast_and_say_so() {
    let (silent, _guard) = silent_port().await;
    let refused = refused_port();
    for port_of in [refused, silent] {
        for url in [
            format!("postgres://app@127.0.0.1:{port_of}/db?timeout=1s"),
            format!("redis://127.0.0.1:{port_of}?timeout=1s"),
            format!("dynamodb://events?endpoint=http://127.0.0.1:{port_of}&timeout=1s"),
        ] {
            let (message, failed, took) = first_error(&url).await;
            eprintln!("{url}: {took:?}: {message}");
            assert!(failed, "{url} answered {message}");
            assert!(took < Duration::from_millis(4500), "{url} took {took:?}");
            // DynamoDB's SDK retries a refused connection, and reports either
            // the refusal (its retries ran out first) or its operation timeout.
            let says = if port_of == refused && url.starts_with("dynamodb") {
                ["refused", "timed out", "timeout"]
                    .iter()
                    .any(|w| message.to_lowercase().contains(w))
            } else if port_of == refused {
                ["refused"]
                    .iter()
                    .any(|w| message.to_lowercase().contains(w))
            } else {
                ["timed out", "timeout"]
                    .iter()
                    .any(|w| message.to_lowercase().contains(w))
            };
            assert!(
                says,
                "{url}: the message does not say what happened: {message}"
            );
        }
    }
}
