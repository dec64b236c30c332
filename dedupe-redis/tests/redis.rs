//! The Redis store on real servers that each test starts: races across OS
//! processes, a Cluster spreading keys and moving slots under load, a server
//! killed, paused and restarted, AOF durability, TLS, and values that are not
//! records.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_conformance::processes::{race_across_processes, run_race_child};
use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key};
use dedupe_redis::{Durability, RedisStore};
use dedupe_testkit::redis::{RedisCluster, RedisOptions, RedisServer, TlsFiles};

fn key(id: &str) -> Key {
    Key::new("redis", id).expect("valid key")
}

fn opts() -> ClaimOptions {
    ClaimOptions::new(Duration::from_secs(600))
}

async fn store(url: &str, timeout: Duration) -> RedisStore {
    RedisStore::builder(url)
        .timeout(timeout)
        .connect()
        .await
        .expect("connect")
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Four OS processes, eight connections each, race on the same 100 keys of one
/// server: each key is Claimed exactly once.
#[test]
fn single_winner_across_processes() {
    let server = RedisServer::start();
    race_across_processes(
        "child_racer",
        4,
        8,
        100,
        &[("DEDUPE_CHILD_REDIS", server.url())],
    )
    .unwrap_or_else(|failure| panic!("{failure}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by single_winner_across_processes in a child process"]
async fn child_racer() {
    let url = std::env::var("DEDUPE_CHILD_REDIS").expect("child job");
    let mut handles: Vec<Arc<dyn DedupeStore>> = Vec::new();
    for _ in 0..8 {
        handles.push(Arc::new(store(&url, Duration::from_secs(10)).await));
    }
    run_race_child(handles).await;
}

/// Keys spread over all three masters, and a slot range moved from one master
/// to another (`redis-cli --cluster reshard`) while two handles race on every
/// key: the client follows MOVED and ASK, every key has exactly one winner, and
/// no claim fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_spreads_keys_and_survives_a_reshard() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("cluster");
    let urls = cluster.urls();
    let open = || async {
        RedisStore::cluster_builder(urls.clone())
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .expect("connect")
    };
    let (a, b) = (open().await, open().await);
    assert!(a.is_cluster());
    let first: Vec<Key> = (0..300).map(|i| key(&format!("spread-{i}"))).collect();
    for answer in a.claim_many(&first, &opts()).await.expect("batch") {
        assert!(answer.lease().is_some(), "{answer:?}");
    }
    let counts = cluster.key_counts();
    assert!(
        counts.iter().all(|n| *n > 0),
        "keys did not spread over every master: {counts:?}"
    );
    // Without hash tags a namespace's records spread over the slots, and an
    // inbox index could not share a slot with them: the inbox is refused.
    use dedupe_core::Inbox;
    let refused = a.accept(&key("inbox-1"), b"body").await;
    assert!(
        matches!(refused, Err(dedupe_core::Error::InvalidConfig { .. })),
        "{refused:?}"
    );
    assert!(a.get(&key("inbox-1")).await.expect("get").is_none());

    let cluster = Arc::new(cluster);
    let mover = {
        let cluster = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || cluster.reshard(2000))
    };
    let started = Instant::now();
    let mut round = 0;
    let mut raced = 0;
    while !mover.is_finished() || round < 3 {
        let keys: Vec<Key> = (0..200)
            .map(|i| key(&format!("reshard-{round}-{i}")))
            .collect();
        let (x, y) = tokio::join!(futures_claims(&a, &keys), futures_claims(&b, &keys));
        for (i, (x, y)) in x.into_iter().zip(y).enumerate() {
            let winners = [&x, &y].iter().filter(|r| r.lease().is_some()).count();
            assert_eq!(winners, 1, "{}: {x:?} / {y:?}", keys[i]);
        }
        raced += keys.len();
        round += 1;
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "reshard took too long"
        );
    }
    mover.await.expect("reshard");
    assert!(raced >= 600);
    // Everything claimed before the move is still there, wherever it lives now.
    for k in &first {
        assert!(
            a.get(k).await.expect("get").is_some(),
            "{k} lost in the reshard"
        );
    }

    // `wait_for_replicas` on a Cluster: each write and its WAIT go to the
    // key's node in one pipeline. These primaries have no replicas, so every
    // write that wins answers a retryable error naming the shortfall (a
    // write without its WAIT would not), and still stands.
    let waiting = RedisStore::cluster_builder(urls.clone())
        .wait_for_replicas(1, Duration::from_millis(50))
        .connect()
        .await
        .expect("connect with waits");
    for i in 0..6 {
        let k = key(&format!("waited-{i}"));
        match waiting.claim(&k, &opts()).await {
            Err(e) => assert!(
                e.is_retryable() && e.to_string().contains("0 of 1 replicas"),
                "{e}"
            ),
            Ok(answer) => panic!("{k} answered {answer:?} with no replica to reach"),
        }
        assert!(a.get(&k).await.expect("get").is_some(), "{k} did not stand");
    }

    // One primary that may evict: the store refuses to open, naming it and
    // its policy (every primary is asked).
    let evicting = cluster.nodes[2].port;
    for (name, value) in [("maxmemory", "64mb"), ("maxmemory-policy", "allkeys-lru")] {
        assert_eq!(redis_cli(evicting, &["CONFIG", "SET", name, value]), "OK");
    }
    match RedisStore::cluster_builder(urls.clone()).connect().await {
        Err(Error::InvalidConfig { reason }) => assert!(
            reason.contains("allkeys-lru") && reason.contains(&evicting.to_string()),
            "{reason}"
        ),
        other => panic!("a Cluster with an evicting primary answered {other:?}"),
    }
    assert_eq!(
        redis_cli(
            evicting,
            &["CONFIG", "SET", "maxmemory-policy", "noeviction"]
        ),
        "OK"
    );
    RedisStore::cluster_builder(urls.clone())
        .connect()
        .await
        .expect("noeviction everywhere opens");
}

/// A frozen Cluster primary (`SIGSTOP`: its connections stay open and
/// nothing answers) whose slots fail over to its replica. Calls for its keys
/// time out at first; each timeout makes the store open a new Cluster
/// connection in the background, which reads the slot map afresh; within a
/// bound the same store claims on the promoted replica. (Without the
/// rebuild, redis-rs retries the frozen node's connection on every call for
/// as long as the socket lives.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_cluster_primary_is_left_for_its_promoted_replica() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start_with_replicas)
        .await
        .expect("cluster");
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    let k = key("frozen");
    let record = "dedupe:redis:frozen";
    let first = cluster.nodes[0].port;
    let frozen = cluster.master_of(record, first).expect("a master");
    let healthy = cluster
        .nodes
        .iter()
        .map(|n| n.port)
        .find(|p| *p != frozen && cluster.master_of(record, *p) == Some(frozen))
        .expect("another node");
    assert!(store.get(&k).await.expect("get").is_none());

    cluster.node(frozen).expect("node").pause();
    let paused = Instant::now();
    let promoted = loop {
        match cluster.master_of(record, healthy) {
            Some(port) if port != frozen => break port,
            _ => {
                assert!(
                    paused.elapsed() < Duration::from_secs(30),
                    "the replica was never promoted"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let failed_over = Instant::now();
    let answer = loop {
        match store.claim(&k, &opts()).await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                assert!(
                    failed_over.elapsed() < Duration::from_secs(15),
                    "still failing {:?} after the failover to port {promoted}: {e}",
                    failed_over.elapsed()
                );
            }
        }
    };
    assert!(answer.lease().is_some(), "{answer:?}");
    cluster.node(frozen).expect("node").resume();
}

async fn futures_claims(store: &RedisStore, keys: &[Key]) -> Vec<ClaimOutcome> {
    let mut answers = Vec::with_capacity(keys.len());
    for k in keys {
        answers.push(store.claim(k, &opts()).await.expect("claim during reshard"));
    }
    answers
}

/// A server killed mid-run: calls during the outage fail fast with retryable
/// errors; the same store object works once it is back on the same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_server_gives_retryable_errors_then_the_store_recovers() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(500);
    let store = store(&server.url(), timeout).await;
    let before = store.claim(&key("before"), &opts()).await.expect("claim");
    assert!(before.lease().is_some(), "{before:?}");
    server.kill();
    for i in 0..5 {
        let started = Instant::now();
        match store.claim(&key(&format!("during-{i}")), &opts()).await {
            Err(e) => assert!(e.is_retryable(), "not retryable: {e:?}"),
            Ok(answer) => panic!("answered {answer:?} with the server down"),
        }
        assert!(
            started.elapsed() <= timeout * 2 + Duration::from_millis(200),
            "a call during the outage took {:?}",
            started.elapsed()
        );
    }
    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.claim(&key("after"), &opts()).await {
            Ok(answer) => {
                assert!(answer.lease().is_some(), "{answer:?}");
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                assert!(Instant::now() < deadline, "the store never recovered: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// With `appendonly yes` and `appendfsync always`, done records survive a
/// `kill -9` and restart: the event is a duplicate afterwards, never run again.
/// Without persistence the store says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aof_keeps_done_records_across_a_crash_and_durability_says_so() {
    let plain = RedisServer::start();
    assert_eq!(
        store(&plain.url(), Duration::from_secs(2))
            .await
            .durability()
            .await,
        Durability::NotPersistent
    );

    let mut server = RedisServer::start_with(RedisOptions {
        aof: true,
        ..RedisOptions::default()
    });
    let store = store(&server.url(), Duration::from_millis(500)).await;
    assert_eq!(
        store.durability().await,
        Durability::AppendOnly {
            fsync: "always".into()
        }
    );
    let k = key("kept");
    let lease = store.claim(&k, &opts()).await.expect("claim");
    let lease = lease.lease().cloned().expect("claimed");
    store
        .complete(&lease, b"charged once", Duration::from_secs(3600))
        .await
        .expect("complete");
    server.kill();
    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        match store.claim(&k, &opts()).await {
            Ok(answer) => break answer,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    match answer {
        ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"charged once"),
        other => panic!("after a crash with AOF the record answered {other:?}"),
    }
}

/// A claim whose answer was lost (the server froze with SIGSTOP after or before
/// running it) fails with a retryable timeout; retried with the same claim id
/// once the server is back, it is Claimed with one lease, never InFlight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timed_out_claim_retried_with_its_claim_id_gets_the_lease() {
    let server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let store = store(&server.url(), timeout).await;
    let k = key("lost-answer");
    let id = ClaimId::new("request-7").expect("claim id");
    let with_id = opts().with_claim_id(id);
    server.pause();
    let lost = store.claim(&k, &with_id).await;
    server.resume();
    match lost {
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
        Ok(answer) => panic!("a frozen server answered {answer:?}"),
    }
    // The frozen server runs the queued claim when it wakes, or never got it:
    // either way the retry is Claimed, and twice the same lease.
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = loop {
        match store.claim(&k, &with_id).await {
            Ok(answer) => break answer,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    let first = first
        .lease()
        .cloned()
        .unwrap_or_else(|| panic!("{first:?}"));
    let again = store.claim(&k, &with_id).await.expect("retry");
    assert_eq!(again.lease(), Some(&first), "{again:?}");
    assert!(matches!(
        store.claim(&k, &opts()).await.expect("other"),
        ClaimOutcome::InFlight { .. }
    ));
}

/// `rediss://` against a TLS-only server whose certificate is signed by a test
/// CA: the store connects through rustls and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rediss_with_a_private_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tls = TlsFiles::generate(dir.path());
    let server = RedisServer::start_with(RedisOptions {
        tls: Some(tls.clone()),
        ..RedisOptions::default()
    });
    let pem = std::fs::read(&tls.ca_cert).expect("ca");
    let store = RedisStore::builder(server.url())
        .tls_root_certificate(pem)
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("rediss connect");
    let answer = store.claim(&key("tls"), &opts()).await.expect("claim");
    assert!(answer.lease().is_some(), "{answer:?}");
    // Without the CA the server is not trusted.
    let untrusted = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .connect()
        .await;
    let refused = match untrusted {
        Err(_) => true,
        Ok(s) => s.claim(&key("tls-2"), &opts()).await.is_err(),
    };
    assert!(refused, "a server signed by an unknown CA was trusted");
}

/// Whatever else sits at a record's key (another format, another type) is a
/// corrupt record: never a fresh claim, never a guess, and forget leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn values_that_are_not_records_are_corrupt_not_claimable() {
    let server = RedisServer::start();
    let store = store(&server.url(), Duration::from_secs(2)).await;
    let cli = |args: &[&str]| redis_cli(server.port, args);
    cli(&["SET", "dedupe:redis:garbage", "not a record"]);
    cli(&["SET", "dedupe:redis:cut", "d1:0:1:-:1:1:3:ab"]);
    // A live header (deadline far ahead) over a body that does not decode.
    cli(&[
        "SET",
        "dedupe:redis:live-cut",
        "d1:0:99999999999999:-:1:1:3:ab",
    ]);
    cli(&["HSET", "dedupe:redis:hash", "state", "0"]);
    for id in ["garbage", "cut", "live-cut", "hash"] {
        let k = key(id);
        match store.claim(&k, &opts()).await {
            Err(Error::CorruptRecord { .. }) => {}
            other => panic!("claim of {id} answered {other:?}"),
        }
        assert!(
            matches!(store.get(&k).await, Err(Error::CorruptRecord { .. })),
            "{id}"
        );
        assert!(
            matches!(store.forget(&k).await, Err(Error::CorruptRecord { .. })),
            "{id}"
        );
    }
    // A batch meeting one of them, expired or live, claims none of its keys:
    // the batch script reads and decodes every key before it writes any.
    for corrupt in ["cut", "live-cut"] {
        let batch = [
            key(&format!("before-{corrupt}")),
            key(corrupt),
            key(&format!("after-{corrupt}")),
        ];
        match store.claim_many(&batch, &opts()).await {
            Err(Error::CorruptRecord { key, .. }) => assert!(key.ends_with(corrupt), "{key}"),
            other => panic!("a batch with the corrupt record {corrupt} answered {other:?}"),
        }
        for k in [&batch[0], &batch[2]] {
            assert_eq!(store.get(k).await.expect("get"), None, "{k} was claimed");
        }
    }
    assert_eq!(cli(&["GET", "dedupe:redis:garbage"]), "not a record");
    assert_eq!(cli(&["HGET", "dedupe:redis:hash", "state"]), "0");

    // The inbox: an item whose value was broken is left in place and named
    // in the log, and the namespace's other items are still handed out; a
    // replay of a value that is no record is corrupt, not "no such item".
    use dedupe_core::Inbox;
    for id in ["item-a", "item-b", "item-c"] {
        assert!(store
            .accept(&key(id), b"body")
            .await
            .expect("accept")
            .is_new());
    }
    cli(&["SET", "dedupe:redis:item-a", "i1:1:not an item"]);
    let taken = store
        .take("redis", 10, Duration::from_secs(30))
        .await
        .expect("a take past the broken item");
    let ids: Vec<&str> = taken.iter().map(|t| t.lease.key.id()).collect();
    assert_eq!(ids, ["item-b", "item-c"]);
    assert_eq!(cli(&["GET", "dedupe:redis:item-a"]), "i1:1:not an item");
    assert!(
        matches!(
            store.replay(&key("garbage")).await,
            Err(Error::CorruptRecord { .. })
        ),
        "a replay of a value that is no record"
    );
}

/// Prefixes that are not plain, and prefixes under which two stores could
/// share a record key (empty, no closing `:`, a `:` inside: `a:` and `a:b:`
/// would meet at namespace `b`), are refused before anything connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unsafe_prefixes_are_refused() {
    let long = format!("{}:", "p".repeat(64));
    for bad in [
        "a b:", "x\"y:", "p;DEL *:", "tab\t:", &long, "", ":", "dedupe", "a:b:", "{tag}:",
    ] {
        match RedisStore::builder("redis://127.0.0.1:1")
            .prefix(bad)
            .connect()
            .await
        {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("prefix {bad:?} answered {other:?}"),
        }
    }
}

/// `wait_for_replicas`: with one replica attached, a claim waits until the
/// replica has it (and the replica holds the record); asking for two replicas
/// where there is one answers a retryable error, and the claim still stands
/// for a retry with the same claim id. Settings that would wait forever or
/// never are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_can_wait_for_replicas() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_with(RedisOptions {
        replica_of: Some(primary.port),
        ..RedisOptions::default()
    });
    let port = primary.port;
    tokio::task::spawn_blocking(move || dedupe_testkit::redis::wait_for_replicas(port, 1))
        .await
        .expect("replica");
    let one = RedisStore::builder(primary.url())
        .timeout(Duration::from_secs(5))
        .wait_for_replicas(1, Duration::from_secs(2))
        .connect()
        .await
        .expect("connect");
    let answer = one.claim(&key("replicated"), &opts()).await.expect("claim");
    assert!(answer.lease().is_some(), "{answer:?}");
    let on_replica = redis_cli(replica.port, &["GET", "dedupe:redis:replicated"]);
    assert!(
        on_replica.starts_with("d1:0:"),
        "the replica has {on_replica:?}"
    );

    let two = RedisStore::builder(primary.url())
        .wait_for_replicas(2, Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let id = ClaimId::new("needs-two").expect("claim id");
    let with_id = opts().with_claim_id(id);
    match two.claim(&key("under-replicated"), &with_id).await {
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
        Ok(answer) => panic!("one replica of two answered {answer:?}"),
    }
    let stored = two.get(&key("under-replicated")).await.expect("get");
    assert!(stored.is_some(), "the claim did not stand on the primary");

    for (replicas, wait) in [
        (0, Duration::from_millis(100)),
        (1, Duration::ZERO),
        (1, Duration::from_micros(999)),
        (1, Duration::from_secs(2)),
    ] {
        match RedisStore::builder(primary.url())
            .wait_for_replicas(replicas, wait)
            .connect()
            .await
        {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("wait_for_replicas({replicas}, {wait:?}) answered {other:?}"),
        }
    }
}

/// A failover after a completion: the primary is killed once its replica
/// stopped hearing from it (the replication link black-holed by a proxy),
/// and the replica is promoted. A completion answered Ok with
/// `wait_for_replicas` had reached the replica before it was answered, and
/// survives; with the replica unreachable, a waiting store answers the
/// completion with a retryable error instead of Ok. A store without waits
/// answers Ok to a completion that only the dead primary had: after the
/// failover the record is in flight again and the event would run twice, the
/// loss the README states for stores without `wait_for_replicas`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completions_answered_with_waits_survive_a_failover() {
    use dedupe_core::{RecordState, RecordStateKind};
    use dedupe_testkit::proxy::TcpProxy;

    fn outcome(state: &RecordState) -> Option<&[u8]> {
        match state {
            RecordState::Done { outcome, .. } => Some(outcome),
            RecordState::InFlight { .. } => None,
        }
    }

    let mut primary = RedisServer::start();
    let link = TcpProxy::start(format!("127.0.0.1:{}", primary.port).parse().expect("addr"))
        .await
        .expect("proxy");
    let replica = RedisServer::start_with(RedisOptions {
        replica_of: Some(link.addr().port()),
        ..RedisOptions::default()
    });
    let port = primary.port;
    tokio::task::spawn_blocking(move || dedupe_testkit::redis::wait_for_replicas(port, 1))
        .await
        .expect("replica");
    let waiting = RedisStore::builder(primary.url())
        .wait_for_replicas(1, Duration::from_millis(300))
        .connect()
        .await
        .expect("connect");
    let plain = store(&primary.url(), Duration::from_secs(2)).await;
    let lease = |answer: ClaimOutcome| answer.lease().cloned().expect("claimed");
    let day = Duration::from_secs(86_400);
    // The replica is connected; on a loaded machine its first sync may still
    // run: a fresh key's claim that replicates within the wait says it is done.
    let mut tries = 0;
    let synced = dedupe_testkit::eventually(Duration::from_secs(20), || {
        tries += 1;
        let k = key(&format!("warm-up-{tries}"));
        let waiting = &waiting;
        async move { waiting.claim(&k, &opts()).await.is_ok() }
    })
    .await;
    assert!(synced, "no claim replicated within 20 s");

    let replicated = lease(waiting.claim(&key("a"), &opts()).await.expect("claim a"));
    waiting
        .complete(&replicated, b"done a", day)
        .await
        .expect("complete a");
    let unwaited = lease(waiting.claim(&key("b"), &opts()).await.expect("claim b"));
    let refused = lease(waiting.claim(&key("c"), &opts()).await.expect("claim c"));

    link.blackhole();
    plain
        .complete(&unwaited, b"done b", day)
        .await
        .expect("a store without waits answers Ok");
    match waiting.complete(&refused, b"done c", day).await {
        Err(e) => assert!(
            e.is_retryable() && e.to_string().contains("0 of 1 replicas"),
            "{e}"
        ),
        Ok(()) => panic!("a completion no replica had was answered Ok"),
    }
    // Both completions are on the primary, and only there.
    for (k, outcome_bytes) in [("b", b"done b"), ("c", b"done c")] {
        let record = plain.get(&key(k)).await.expect("get").expect("record");
        assert_eq!(outcome(&record.state), Some(&outcome_bytes[..]), "{k}");
    }

    primary.kill();
    assert_eq!(redis_cli(replica.port, &["REPLICAOF", "NO", "ONE"]), "OK");
    let promoted = store(&replica.url(), Duration::from_secs(2)).await;
    let a = promoted.get(&key("a")).await.expect("get a").expect("a");
    assert_eq!(outcome(&a.state), Some(&b"done a"[..]), "{a:?}");
    for k in ["b", "c"] {
        let record = promoted.get(&key(k)).await.expect("get").expect("record");
        assert_eq!(
            record.state.kind(),
            RecordStateKind::InFlight,
            "{k}: {record:?}"
        );
    }
}

/// The server's count of changes since the last save (`INFO persistence`).
fn dirty(port: u16) -> u64 {
    redis_cli(port, &["INFO", "persistence"])
        .lines()
        .find_map(|l| l.strip_prefix("rdb_changes_since_last_save:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("rdb_changes_since_last_save")
}

/// A duplicate or in-flight claim changes nothing on the server: the script
/// only reads the live record, so Redis's own change counter stands still
/// across rounds of them (and moves for a claim that wins).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_change_nothing_on_the_server() {
    let server = RedisServer::start();
    let store = store(&server.url(), Duration::from_secs(2)).await;
    let keys: Vec<Key> = (0..40).map(|i| key(&format!("dup{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        let lease = store.claim(k, &opts()).await.expect("claim");
        let lease = lease.lease().cloned().expect("won");
        if i.is_multiple_of(2) {
            store
                .complete(&lease, b"kept", Duration::from_secs(600))
                .await
                .expect("complete");
        }
    }
    let before = dirty(server.port);
    for _ in 0..5 {
        for (i, k) in keys.iter().enumerate() {
            match store.claim(k, &opts()).await.expect("claim") {
                ClaimOutcome::Duplicate { outcome, .. } if i.is_multiple_of(2) => {
                    assert_eq!(outcome, b"kept")
                }
                ClaimOutcome::InFlight { .. } if !i.is_multiple_of(2) => {}
                other => panic!("key {i} answered {other:?}"),
            }
        }
        let batch = store.claim_many(&keys, &opts()).await.expect("claim_many");
        assert!(batch.iter().all(|a| a.lease().is_none()), "{batch:?}");
    }
    assert_eq!(
        dirty(server.port),
        before,
        "duplicate claims changed the data set"
    );
    let fresh = store.claim(&key("fresh"), &opts()).await.expect("claim");
    assert!(fresh.lease().is_some());
    assert!(
        dirty(server.port) > before,
        "the counter does not see a winning claim"
    );
}

/// Eight workers claim, complete and release through a loopback proxy that
/// cuts every connection every 150 ms for 2.5 s; every answer is recorded and
/// the whole history is checked against the contract. Every failure is a
/// retryable error (or a lease lost), and once healed the store answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_connections_under_load_keep_the_history_valid() {
    use dedupe_testkit::faults::{cut_repeatedly, FaultRun};
    let server = RedisServer::start();
    let (proxy, via) = dedupe_testkit::proxied(&server.url()).await.expect("proxy");
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn DedupeStore> = Arc::new(store(&via, timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    cut_repeatedly(&proxy, 16, Duration::from_millis(150)).await;
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    let won = verdict.history.claims_won();
    assert!(won > 20, "too little work got through: {won} claims won");
    let healed = dedupe_testkit::eventually(Duration::from_secs(10), || {
        let store = Arc::clone(&store);
        async move { store.claim(&key("after-the-cuts"), &opts()).await.is_ok() }
    })
    .await;
    assert!(healed, "the store did not answer again after the cuts");
}

/// The bound on any one call in the fault runs below: the store's own bound
/// (twice its timeout) and room for a loaded two-core machine.
fn fault_bound(timeout: Duration) -> Duration {
    timeout * 2 + Duration::from_millis(1500)
}

/// Killed with SIGKILL under eight recorded workers and started again on its
/// append-only file (`appendfsync always`): every error typed and retryable
/// within the bound, the same store object works again, the history valid, and
/// every completion acknowledged before the kill is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_aof_server_under_load_loses_nothing() {
    use dedupe_testkit::faults::FaultRun;
    let mut server = RedisServer::start_with(RedisOptions {
        aof: true,
        ..RedisOptions::default()
    });
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn DedupeStore> = Arc::new(store(&server.url(), timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    tokio::task::block_in_place(|| {
        server.kill();
        std::thread::sleep(Duration::from_millis(300));
        server.start_again();
    });
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// The same kill on a server that keeps nothing on disk: the fault checks
/// must see the loss. Rechecking the completions acknowledged before the kill
/// finds them claimable again, and the history check calls it a lost record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_server_without_aof_is_caught_losing_records() {
    use dedupe_conformance::history::recheck_completed;
    use dedupe_testkit::faults::FaultRun;
    let mut server = RedisServer::start();
    let store: Arc<dyn DedupeStore> = Arc::new(store(&server.url(), Duration::from_secs(1)).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    tokio::task::block_in_place(|| {
        server.kill();
        server.start_again();
    });
    let verdict = run.finish().await;
    let lost = recheck_completed(store, &verdict.history, Duration::from_secs(30)).await;
    assert!(!lost.is_empty(), "a server without AOF lost nothing?");
    let problems = verdict
        .history
        .check()
        .expect_err("lost records passed the history check");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("the done record was lost")),
        "{problems:?}"
    );
}

/// Through a proxy, the network swallows every byte (blackhole), then holds
/// every byte and delivers it late (stall), each for longer than the timeout,
/// under eight recorded workers: calls end in retryable errors within the
/// bound, no answer is matched to the wrong command, and the history is valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackholed_and_stalled_connections_time_out_and_recover() {
    use dedupe_testkit::faults::FaultRun;
    let server = RedisServer::start();
    let (proxy, via) = dedupe_testkit::proxied(&server.url()).await.expect("proxy");
    let timeout = Duration::from_millis(800);
    let store: Arc<dyn DedupeStore> = Arc::new(store(&via, timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    dedupe_testkit::faults::blackhole_then_stall(&proxy, Duration::from_millis(2500)).await;
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// One Cluster node's connections black-holed, then stalled (every node
/// reached through a proxy of its own), under a load of racing claims,
/// completions and releases on keys of every node: calls for that node's
/// slots fail with retryable errors within the bound (the store replaces the
/// Cluster connection after a timeout, so no reply that comes late is read as
/// another call's), the others go on, and the history checker finds the
/// whole run sound, with nothing acknowledged lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blackholed_cluster_node_times_out_and_recovers() {
    use dedupe_testkit::faults::FaultRun;
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .expect("cluster");
    let (map, initial, proxies) = dedupe_testkit::redis::proxy_every_node(&cluster.urls())
        .await
        .expect("proxies");
    let timeout = Duration::from_millis(800);
    let store: Arc<dyn DedupeStore> = Arc::new(
        RedisStore::cluster_builder(initial)
            .cluster_address_map(map)
            .timeout(timeout)
            .connect()
            .await
            .expect("connect"),
    );
    let run = FaultRun::start(Arc::clone(&store)).await;
    dedupe_testkit::faults::blackhole_then_stall(&proxies[1], Duration::from_millis(2500)).await;
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// The server runs a claim and the connection dies before the client reads the
/// answer: a retryable error, and the retry with the same claim id is Claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_answer_is_reclaimed_by_its_claim_id() {
    let server = RedisServer::start();
    let (proxy, via) = dedupe_testkit::proxied(&server.url()).await.expect("proxy");
    let timeout = Duration::from_secs(1);
    let store = store(&via, timeout).await;
    dedupe_testkit::faults::lost_answer_is_reclaimed_by_its_claim_id(
        &store,
        &proxy,
        &key("lost-answer"),
        fault_bound(timeout),
    )
    .await;
}

dedupe_testkit::crash_tests! {
    // An append-only file fsynced on every write, as a deployment that must
    // not lose a completion runs.
    setup: || {
        let server = RedisServer::start_with(dedupe_testkit::redis::RedisOptions {
            aof: true,
            ..dedupe_testkit::redis::RedisOptions::default()
        });
        let env = vec![("DEDUPE_CHILD_REDIS", server.url())];
        (server, env)
    },
    worker: || async {
        let url = std::env::var("DEDUPE_CHILD_REDIS").expect("child job");
        Arc::new(store(&url, Duration::from_secs(5)).await) as Arc<dyn DedupeStore>
    },
    inbox_worker: || async {
        let url = std::env::var("DEDUPE_CHILD_REDIS").expect("child job");
        Arc::new(store(&url, Duration::from_secs(5)).await) as Arc<dyn dedupe_core::Inbox>
    },
    ordering_keys: true,
}

/// A full `noeviction` server (the setting the store requires): a claim that
/// would write is refused by the server with `OOM`, and the store answers a
/// retryable error, writing nothing; a duplicate, which writes nothing, is
/// still answered; once memory is freed, claims win again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_noeviction_server_answers_retryable_errors() {
    let server = RedisServer::start();
    let store = store(&server.url(), Duration::from_secs(2)).await;
    let done = store
        .claim(&key("before"), &opts())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    store
        .complete(&done, b"kept", Duration::from_secs(600))
        .await
        .expect("complete");
    let used: u64 = redis_cli(server.port, &["INFO", "memory"])
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory");
    // A limit just under what the server already uses: every write is refused.
    assert_eq!(
        redis_cli(
            server.port,
            &["CONFIG", "SET", "maxmemory", &(used / 2).to_string()]
        ),
        "OK"
    );
    assert_eq!(
        redis_cli(
            server.port,
            &["CONFIG", "SET", "maxmemory-policy", "noeviction"]
        ),
        "OK"
    );
    let k = key("while-full");
    match store.claim(&k, &opts()).await {
        Err(e) => assert!(e.is_retryable() && e.to_string().contains("OOM"), "{e}"),
        Ok(answer) => panic!("a full server answered {answer:?}"),
    }
    assert!(
        matches!(
            store.claim(&key("before"), &opts()).await.expect("claim"),
            ClaimOutcome::Duplicate { .. }
        ),
        "a duplicate needs no memory"
    );
    assert_eq!(
        redis_cli(server.port, &["CONFIG", "SET", "maxmemory", "0"]),
        "OK"
    );
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "written while full"
    );
    assert!(store
        .claim(&k, &opts())
        .await
        .expect("claim")
        .lease()
        .is_some());
}

/// Push wake-ups outlive their connection: with the pub/sub connection
/// killed (`CLIENT KILL TYPE pubsub`), the store subscribes again and
/// accepts made through another store wake its workers as before. Three
/// rounds after the kill, so the one wake-up a reconnection raises on its
/// own cannot pass for them (the test fails when the store does not
/// subscribe again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_ups_come_back_after_the_subscriber_is_killed() {
    use dedupe_core::Inbox;
    let server = RedisServer::start();
    let listening = store(&server.url(), Duration::from_secs(2)).await;
    let accepting = store(&server.url(), Duration::from_secs(2)).await;
    let wake = listening.wake("redis").await.expect("wake");
    assert!(wake.everywhere, "Redis pushes its wake-ups");
    let signal = wake.signal.expect("a signal");
    assert!(
        dedupe_testkit::wakes(
            &signal,
            Duration::from_secs(5),
            accepting.accept(&key("before"), b"{}")
        )
        .await,
        "another store's accept did not wake the listening store"
    );
    assert_eq!(
        redis_cli(server.port, &["CLIENT", "KILL", "TYPE", "pubsub"]),
        "1"
    );
    let subscribed_again = dedupe_testkit::eventually(Duration::from_secs(20), || async {
        redis_cli(server.port, &["PUBSUB", "NUMSUB", "dedupe:wake"]).ends_with('1')
    })
    .await;
    assert!(subscribed_again, "the store did not subscribe again");
    for round in 0..3 {
        assert!(
            dedupe_testkit::wakes(
                &signal,
                Duration::from_secs(5),
                accepting.accept(&key(&format!("after-{round}")), b"{}")
            )
            .await,
            "round {round}: an accept after the kill did not wake the listening store"
        );
    }
}

/// Bulk replay and forget by filter over 10,000 dead items, two operators at
/// once (each on its own connection) beside a worker: every matching item
/// replayed and run exactly once, every forgotten one gone (see
/// `dedupe_conformance::bulk`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_replay_and_forget_by_filter() {
    use std::sync::Arc;
    let server = RedisServer::start();
    let a = store(&server.url(), Duration::from_secs(10)).await;
    let b = store(&server.url(), Duration::from_secs(10)).await;
    let report = dedupe_conformance::bulk::bulk_by_filter(Arc::new(a), Arc::new(b), 10_000)
        .await
        .unwrap_or_else(|failure| panic!("{failure}"));
    eprintln!("{report}");
}
