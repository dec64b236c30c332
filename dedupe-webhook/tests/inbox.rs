//! Inbox mode over real HTTP on a SQLite file: the receiver answers 202 at
//! once while the handler runs on an `InboxWorker` (slower than the
//! sender's timeout), resends are answered from the inbox without a second
//! run, a failing delivery (its stored headers make it fail on every
//! attempt) ends dead after its last attempt and runs again when replayed,
//! and refused deliveries (bad signature, too large) store nothing. Runs are
//! counted by the handler itself.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use dedupe_core::{Backoff, DedupeStore, Deduper, Inbox, InboxWorker, ItemQuery, ItemStatus, Key};
use dedupe_sqlite::SqliteStore;
use dedupe_webhook::{KeyRule, Scheme, Verifier, Webhook, WebhookEvent};
use reqwest::StatusCode;

const SECRET: &str = "whsec_inbox_test";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

struct Setup {
    _dir: tempfile::TempDir,
    inbox: Arc<dyn Inbox>,
    base: String,
    runs: Arc<AtomicUsize>,
    worker: InboxWorker,
}

/// A Stripe route in inbox mode, and a worker over its namespace whose
/// handler takes `work`, fails a delivery that carried `x-fail`, and counts
/// its runs.
async fn setup(work: Duration) -> Setup {
    let dir = tempfile::tempdir().expect("dir");
    let store = SqliteStore::open(dir.path().join("inbox.db"))
        .await
        .expect("store");
    let inbox: Arc<dyn Inbox> = Arc::new(store);
    let hook = Webhook::inbox(Arc::clone(&inbox), KeyRule::stripe("stripe"))
        .verifier(Verifier::new(Scheme::Stripe, [SECRET]).expect("verifier"));
    assert!(hook.is_inbox());
    let app = Router::new().route(
        "/hooks",
        axum::routing::post(|| async { "never called in inbox mode" }).route_layer(hook.layer()),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let runs = Arc::new(AtomicUsize::new(0));
    let deduper = Deduper::new(Arc::clone(&inbox)).with_lease_ttl(Duration::from_secs(5));
    let worker = InboxWorker::new(&deduper, Arc::clone(&inbox), "stripe")
        .with_max_attempts(3)
        .with_backoff(Backoff {
            first: Duration::from_millis(20),
            max: Duration::from_millis(40),
        })
        .with_poll_interval(Duration::from_millis(10));
    {
        let (worker, runs) = (worker.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            worker
                .run(move |taken| {
                    let runs = Arc::clone(&runs);
                    async move {
                        let (event, headers) =
                            WebhookEvent::from_item(&taken, Duration::from_secs(3600))
                                .map_err(|e| e.to_string())?;
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(work).await;
                        if headers.contains_key("x-fail") {
                            return Err(format!("refused {}", event.key));
                        }
                        Ok(format!("done {}", event.event_id.unwrap_or_default()).into_bytes())
                    }
                })
                .await
        });
    }
    Setup {
        _dir: dir,
        inbox,
        base,
        runs,
        worker,
    }
}

fn signed(body: &str) -> Vec<(&'static str, String)> {
    Verifier::new(Scheme::Stripe, [SECRET])
        .expect("verifier")
        .sign("unused", now(), body.as_bytes())
}

async fn post(
    setup: &Setup,
    body: &str,
    headers: &[(&'static str, String)],
) -> (StatusCode, serde_json::Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/hooks", setup.base))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let response = req.send().await.expect("POST");
    let status = response.status();
    (status, response.json().await.unwrap_or_default())
}

async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < Duration::from_secs(20), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A 1.5 s handler: the delivery is answered 202 well before it ends (a
/// provider with a 1 s timeout is satisfied); a resend while it runs and one
/// after it finished are 200, "known", and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_are_answered_at_once_and_run_once_on_the_worker() {
    let setup = setup(Duration::from_millis(1500)).await;
    let body = r#"{"id":"evt_slow","type":"charge.succeeded"}"#;
    let started = Instant::now();
    let (status, json) = post(&setup, body, &signed(body)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{json}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(json["accepted"], true);
    let key = Key::new("stripe", "evt_slow").expect("key");
    until("the worker did not start", async || {
        setup.runs.load(Ordering::SeqCst) == 1
    })
    .await;
    let (status, json) = post(&setup, body, &signed(body)).await;
    assert_eq!(
        (status, json["state"].as_str()),
        (StatusCode::OK, Some("running")),
        "{json}"
    );
    until("the item was not completed", async || {
        setup.inbox.item(&key).await.expect("item").is_none()
    })
    .await;
    let (status, json) = post(&setup, body, &signed(body)).await;
    assert_eq!(
        (status, json["state"].as_str()),
        (StatusCode::OK, Some("done")),
        "{json}"
    );
    assert_eq!(setup.runs.load(Ordering::SeqCst), 1);
    let record = setup.inbox.get(&key).await.expect("get").expect("done");
    assert!(matches!(
        record.state,
        dedupe_core::RecordState::Done { ref outcome, .. } if outcome == b"done evt_slow"
    ));
    setup.worker.shutdown(Duration::from_secs(1)).await;
}

/// A delivery whose stored headers make the handler fail: three attempts
/// (the limit), then dead with its error, listed; a replay runs it once more
/// (dead again). Refused deliveries store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_end_dead_replay_runs_again_and_refusals_store_nothing() {
    let setup = setup(Duration::ZERO).await;
    let body = r#"{"id":"evt_poison","type":"charge.failed"}"#;
    let mut headers = signed(body);
    headers.push(("x-fail", "1".into()));
    let (status, _) = post(&setup, body, &headers).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let key = Key::new("stripe", "evt_poison").expect("key");
    let dead = async || {
        setup
            .inbox
            .item(&key)
            .await
            .expect("item")
            .is_some_and(|i| i.status == ItemStatus::Dead)
    };
    until("the item did not die", dead).await;
    assert_eq!(setup.runs.load(Ordering::SeqCst), 3);
    let page = setup
        .inbox
        .list(&ItemQuery::new("stripe").status(ItemStatus::Dead))
        .await
        .expect("list");
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].attempts, 3);
    assert_eq!(
        page.items[0].last_error.as_deref(),
        Some("refused stripe:evt_poison")
    );
    assert!(setup.inbox.replay(&key).await.expect("replay"));
    until("the replayed item did not run", async || {
        setup.runs.load(Ordering::SeqCst) == 4
    })
    .await;
    until("the replayed item did not die again", dead).await;

    // A bad signature and an oversized body: refused, nothing stored.
    let forged = r#"{"id":"evt_forged","type":"x"}"#;
    let (status, _) = post(&setup, forged, &signed("another body")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let big = format!(
        r#"{{"id":"evt_big","pad":"{}"}}"#,
        "x".repeat(dedupe_core::MAX_PAYLOAD_BYTES)
    );
    let (status, json) = post(&setup, &big, &signed(&big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{json}");
    for id in ["evt_forged", "evt_big"] {
        let key = Key::new("stripe", id).expect("key");
        assert!(setup.inbox.get(&key).await.expect("get").is_none(), "{id}");
    }
    setup.worker.shutdown(Duration::from_secs(1)).await;
}
