//! The layer on an axum router, driven in process (`oneshot`), on the memory
//! store and on a SQLite file: every answer of the receiving path, counted in
//! handler runs, not only status codes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use dedupe_core::{DedupeStore, Deduper, MemoryStore};
use dedupe_webhook::{Answer, KeyRule, Scheme, Verifier, Webhook, WebhookEvent};
use http::{Request, StatusCode};
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Counts {
    runs: Arc<AtomicUsize>,
    fail_next: Arc<AtomicUsize>,
    delay_ms: Arc<AtomicUsize>,
}

async fn handler(State(counts): State<Counts>, event: WebhookEvent) -> Response {
    let delay = counts.delay_ms.load(Ordering::SeqCst) as u64;
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if counts
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return (StatusCode::INTERNAL_SERVER_ERROR, "business step failed").into_response();
    }
    let run = counts.runs.fetch_add(1, Ordering::SeqCst) + 1;
    Json(serde_json::json!({
        "processed": true,
        "key": event.key.to_string(),
        "delivery": event.delivery_id,
        "run": run,
    }))
    .into_response()
}

fn app(store: Arc<dyn DedupeStore>, verifier: Option<Verifier>, counts: &Counts) -> Router {
    let mut hook = Webhook::new(Deduper::new(store), KeyRule::body_id("hooks")).body_limit(4096);
    if let Some(v) = verifier {
        hook = hook.verifier(v);
    }
    Router::new()
        .route("/hooks", post(handler).route_layer(hook.layer()))
        .with_state(counts.clone())
}

fn post_json(body: &str, delivery: &str) -> Request<Body> {
    Request::post("/hooks")
        .header("content-type", "application/json")
        .header("x-delivery-id", delivery)
        .body(Body::from(body.to_string()))
        .expect("request")
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

async fn every_answer(store: Arc<dyn DedupeStore>) {
    let counts = Counts::default();
    let app = app(store, None, &counts);
    let event = r#"{"id":"evt_9f3","amount":2500}"#;

    // First delivery, then a retry with a new delivery id: one run.
    let (status, headers, body) = send(&app, post_json(event, "del_a1")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, replay) = send(&app, post_json(event, "del_b2")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(
        replay, body,
        "the replay is the stored response, byte for byte"
    );
    assert_eq!(counts.runs.load(Ordering::SeqCst), 1);

    // Same key, other payload.
    let (status, _, _) = send(&app, post_json(r#"{"id":"evt_9f3","amount":1}"#, "del_c3")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // Not JSON, too large.
    let (status, _, _) = send(&app, post_json("{not json", "del_d4")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let big = format!(r#"{{"id":"evt_big","pad":"{}"}}"#, "x".repeat(5000));
    let (status, _, _) = send(&app, post_json(&big, "del_e5")).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    // Chunked, with no content-length: still bounded.
    let stream =
        futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1000])));
    let req = Request::post("/hooks")
        .body(Body::from_stream(stream))
        .expect("request");
    let (status, _, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(counts.runs.load(Ordering::SeqCst), 1);

    // No id: the body hash; sent twice, processed once.
    let anonymous = r#"{"type":"ping","n":7}"#;
    let (first, _, _) = send(&app, post_json(anonymous, "del_f6")).await;
    let (_, headers, _) = send(&app, post_json(anonymous, "del_g7")).await;
    assert_eq!(first, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(counts.runs.load(Ordering::SeqCst), 2);

    // A failing business step releases the claim: the retry runs it.
    counts.fail_next.store(1, Ordering::SeqCst);
    let other = r#"{"id":"evt_fail"}"#;
    let (status, _, _) = send(&app, post_json(other, "del_h8")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(counts.runs.load(Ordering::SeqCst), 2);
    let (status, headers, _) = send(&app, post_json(other, "del_i9")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(counts.runs.load(Ordering::SeqCst), 3);

    // 64 copies at the same instant, 20 rounds: one run per round, the rest
    // in flight (409 with Retry-After) or replays.
    counts.delay_ms.store(20, Ordering::SeqCst);
    for round in 0..20 {
        let before = counts.runs.load(Ordering::SeqCst);
        let body = format!(r#"{{"id":"evt_race_{round}"}}"#);
        let replies = futures_util::future::join_all((0..64).map(|i| {
            let app = app.clone();
            let req = post_json(&body, &format!("del_{round}_{i}"));
            async move { send(&app, req).await }
        }))
        .await;
        assert_eq!(
            counts.runs.load(Ordering::SeqCst),
            before + 1,
            "round {round}"
        );
        let processed = replies
            .iter()
            .filter(|(s, h, _)| *s == StatusCode::OK && h.get("idempotent-replayed").is_none())
            .count();
        assert_eq!(processed, 1, "round {round}");
        for (status, headers, _) in &replies {
            match *status {
                StatusCode::OK => {}
                StatusCode::CONFLICT => assert!(headers.contains_key("retry-after")),
                other => panic!("round {round}: a copy answered {other}"),
            }
        }
    }
    counts.delay_ms.store(0, Ordering::SeqCst);

    // A delivery dropped mid-handler (the provider gave up): the handler goes
    // on under its claim; a copy meanwhile is told to come back, and a copy
    // after it finished gets the first delivery's response. One run.
    counts.delay_ms.store(600, Ordering::SeqCst);
    let before = counts.runs.load(Ordering::SeqCst);
    let dropped = r#"{"id":"evt_dropped"}"#;
    let call = app.clone().oneshot(post_json(dropped, "del_j1"));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err(),
        "the slow handler answered"
    );
    counts.delay_ms.store(0, Ordering::SeqCst);
    let (status, headers, _) = send(&app, post_json(dropped, "del_j2")).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a copy ran beside the abandoned handler"
    );
    assert!(headers.contains_key("retry-after"));
    let (status, headers, body) = {
        let mut answered = send(&app, post_json(dropped, "del_j3")).await;
        for _ in 0..200 {
            if answered.0 != StatusCode::CONFLICT {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            answered = send(&app, post_json(dropped, "del_j3")).await;
        }
        answered
    };
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["idempotent-replayed"], "true");
    let replayed: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        replayed["delivery"], "del_j1",
        "the stored response is not the first delivery's"
    );
    assert_eq!(counts.runs.load(Ordering::SeqCst), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_on_memory() {
    every_answer(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let store = dedupe_sqlite::SqliteStore::open(dir.path().join("hooks.db"))
        .await
        .expect("open");
    every_answer(Arc::new(store)).await;
}

#[tokio::test]
async fn signatures_are_checked_before_anything_is_claimed() {
    let counts = Counts::default();
    let store: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let verifier = Verifier::new(Scheme::StandardWebhooks, ["whsec_c2VjcmV0LWtleQ=="]).expect("s");
    let app = app(Arc::clone(&store), Some(verifier.clone()), &counts);
    let body = r#"{"id":"evt_signed"}"#;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let signed = |at: u64, body: &str| {
        let mut req = post_json(body, "del");
        for (k, v) in verifier.sign("msg_1", at, body.as_bytes()) {
            req.headers_mut().insert(k, v.parse().expect("value"));
        }
        req
    };
    // Missing, forged (a signature over another body), stale.
    let (missing, _, _) = send(&app, post_json(body, "del")).await;
    let mut forged = signed(now, r#"{"id":"evt_other"}"#);
    *forged.body_mut() = Body::from(body);
    let (forged, _, _) = send(&app, forged).await;
    let (stale, _, _) = send(&app, signed(now - 600, body)).await;
    for status in [missing, forged, stale] {
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let key = dedupe_core::Key::new("hooks", "evt_signed").expect("key");
    assert!(
        store.get(&key).await.expect("get").is_none(),
        "a refused request claimed"
    );
    assert_eq!(counts.runs.load(Ordering::SeqCst), 0);
    // A good one runs.
    let response = app.clone().oneshot(signed(now, body)).await.expect("call");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.extensions().get::<Answer>(),
        Some(&Answer::Processed)
    );
    assert_eq!(counts.runs.load(Ordering::SeqCst), 1);
}

/// The check-then-write receiver of the seeds: it reads the key, waits on a
/// round trip, then writes. Sequential retries look fine through it; copies at
/// the same instant all win.
#[derive(Debug)]
struct CheckThenWrite(MemoryStore);

// A wrapper forwards every method: one it forgets would silently fall back
// to the trait's default instead of the wrapped store's.
#[deny(clippy::missing_trait_methods)]
#[dedupe_core::async_trait]
impl DedupeStore for CheckThenWrite {
    async fn claim(
        &self,
        key: &dedupe_core::Key,
        opts: &dedupe_core::ClaimOptions,
    ) -> dedupe_core::Result<dedupe_core::ClaimOutcome> {
        let seen = self.0.get(key).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
        if seen.is_none() {
            self.0.forget(key).await?;
        }
        self.0.claim(key, opts).await
    }
    async fn complete(
        &self,
        lease: &dedupe_core::Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> dedupe_core::Result<()> {
        self.0.complete(lease, outcome, retention).await
    }
    async fn release(&self, lease: &dedupe_core::Lease) -> dedupe_core::Result<()> {
        self.0.release(lease).await
    }
    async fn extend(
        &self,
        lease: &dedupe_core::Lease,
        ttl: Duration,
    ) -> dedupe_core::Result<dedupe_core::Lease> {
        self.0.extend(lease, ttl).await
    }
    async fn expire(&self) -> dedupe_core::Result<u64> {
        self.0.expire().await
    }
    async fn get(
        &self,
        key: &dedupe_core::Key,
    ) -> dedupe_core::Result<Option<dedupe_core::Record>> {
        self.0.get(key).await
    }
    async fn forget(&self, key: &dedupe_core::Key) -> dedupe_core::Result<bool> {
        self.0.forget(key).await
    }
    async fn claim_many(
        &self,
        keys: &[dedupe_core::Key],
        opts: &dedupe_core::ClaimOptions,
    ) -> dedupe_core::Result<Vec<dedupe_core::ClaimOutcome>> {
        // The same flaw, key by key.
        let mut answers = Vec::with_capacity(keys.len());
        for key in keys {
            answers.push(self.claim(key, opts).await?);
        }
        Ok(answers)
    }
    fn capabilities(&self) -> dedupe_core::Capabilities {
        self.0.capabilities()
    }
}

/// The checks above can fail: through a check-then-write store they catch the
/// copies that ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_then_write_store_is_caught() {
    use futures_util::FutureExt;
    let outcome =
        std::panic::AssertUnwindSafe(every_answer(Arc::new(CheckThenWrite(MemoryStore::new()))))
            .catch_unwind()
            .await;
    let message = match outcome {
        Ok(()) => panic!("a check-then-write store passed"),
        Err(panic) => panic.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(message.contains("round"), "failed elsewhere: {message}");
}

/// A handler slower than its lease keeps the claim (the lease is extended while
/// it runs): copies arriving meanwhile are told to come back, none runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_keeps_its_claim() {
    let counts = Counts::default();
    counts.delay_ms.store(1200, Ordering::SeqCst);
    let store: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let hook = Webhook::new(
        Deduper::new(store).with_lease_ttl(Duration::from_millis(300)),
        KeyRule::body_id("hooks"),
    );
    let app = Router::new()
        .route("/hooks", post(handler).route_layer(hook.layer()))
        .with_state(counts.clone());
    let body = r#"{"id":"evt_slow"}"#;
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_json(body, "del_1")).await }
    });
    let mut copies = Vec::new();
    for i in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        copies.push(
            send(&app, post_json(body, &format!("del_copy_{i}")))
                .await
                .0,
        );
    }
    let (status, _, _) = first.await.expect("first");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(counts.runs.load(Ordering::SeqCst), 1, "copies: {copies:?}");
    assert!(
        copies.iter().all(|s| *s == StatusCode::CONFLICT),
        "{copies:?}"
    );
}

/// `max_concurrency(1)`: a provider that gives up while its handler runs does
/// not free the slot; the handler keeps it to its end, so a second delivery
/// meanwhile is answered 503 `busy` and runs nothing, and once the first
/// handler ends the slot serves again. Fails when the slot lives in the
/// request's future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_gone_mid_handler_does_not_free_its_slot() {
    let release = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(AtomicUsize::new(0));
    let hook = Webhook::new(Deduper::new(MemoryStore::new()), KeyRule::body_id("hooks"))
        .max_concurrency(1);
    let app = Router::new().route(
        "/hooks",
        post({
            let (release, started) = (Arc::clone(&release), Arc::clone(&started));
            move || async move {
                if started.fetch_add(1, Ordering::SeqCst) == 0 {
                    release.notified().await;
                }
                "processed"
            }
        })
        .route_layer(hook.layer()),
    );
    let first = tokio::spawn(
        app.clone()
            .oneshot(post_json(r#"{"id":"evt_slow"}"#, "d-1")),
    );
    while started.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The provider gives up: its request goes, its handler runs on.
    first.abort();
    let _ = first.await;
    let second = app
        .clone()
        .oneshot(post_json(r#"{"id":"evt_other"}"#, "d-2"))
        .await
        .expect("answered");
    assert_eq!(second.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(second.extensions().get::<Answer>(), Some(&Answer::Busy));
    assert_eq!(started.load(Ordering::SeqCst), 1, "the second handler ran");
    release.notify_one();
    let third = async {
        loop {
            let response = app
                .clone()
                .oneshot(post_json(r#"{"id":"evt_other"}"#, "d-3"))
                .await
                .expect("answered");
            if response.status() == StatusCode::OK {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the slot serves again once the first handler ended");
}
