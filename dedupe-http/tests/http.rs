//! The layer over real HTTP (axum on a loopback port, reqwest as the client)
//! on every store: memory, SQLite, Postgres, Redis and DynamoDB Local, each
//! server started once for its test. The orders example's own app answers the
//! API cases; a second app, whose handler sleeps and fails as each request
//! asks and counts its runs (a side effect the test owns), answers the
//! lifecycle cases: concurrency, 5xx, disconnects, outages.

#[allow(dead_code)]
#[path = "../examples/orders.rs"]
mod orders;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait_free::Counting;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use dedupe_core::{DedupeStore, Deduper};
use dedupe_http::{Idempotency, KeyPolicy};
use serde_json::{json, Value};

/// A store that counts the claims it is asked, over a real one; with a
/// gate, each claim waits for a permit first.
mod async_trait_free {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use dedupe_core::{
        ClaimOptions, ClaimOutcome, DedupeStore, Key, Lease, Record, Result as StoreResult,
    };

    #[derive(Debug, Clone)]
    pub struct Counting {
        pub inner: Arc<dyn DedupeStore>,
        pub claims: Arc<AtomicUsize>,
        pub gate: Option<Arc<tokio::sync::Semaphore>>,
    }

    #[async_trait::async_trait]
    impl DedupeStore for Counting {
        async fn claim(&self, key: &Key, opts: &ClaimOptions) -> StoreResult<ClaimOutcome> {
            self.claims.fetch_add(1, Ordering::SeqCst);
            if let Some(gate) = &self.gate {
                let _permit = gate.acquire().await;
            }
            self.inner.claim(key, opts).await
        }
        async fn complete(&self, lease: &Lease, outcome: &[u8], keep: Duration) -> StoreResult<()> {
            self.inner.complete(lease, outcome, keep).await
        }
        async fn release(&self, lease: &Lease) -> StoreResult<()> {
            self.inner.release(lease).await
        }
        async fn extend(&self, lease: &Lease, ttl: Duration) -> StoreResult<Lease> {
            self.inner.extend(lease, ttl).await
        }
        async fn expire(&self) -> StoreResult<u64> {
            self.inner.expire().await
        }
        async fn get(&self, key: &Key) -> StoreResult<Option<Record>> {
            self.inner.get(key).await
        }
        async fn forget(&self, key: &Key) -> StoreResult<bool> {
            self.inner.forget(key).await
        }
    }
}

async fn listen(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// The lifecycle app: `POST /work` runs for the body's `sleep_ms`, answers
/// its `status` (200 by default) with `run <n>`.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

async fn work(State(runs): State<Runs>, Json(body): Json<Value>) -> Response {
    let run = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(Duration::from_millis(
        body["sleep_ms"].as_u64().unwrap_or(0),
    ))
    .await;
    if body["panic"] == true {
        panic!("a handler bug");
    }
    if let Some(pad) = body["pad"].as_u64() {
        return format!("run {run} {}", "x".repeat(pad as usize)).into_response();
    }
    let status = StatusCode::from_u16(body["status"].as_u64().unwrap_or(200) as u16)
        .unwrap_or(StatusCode::OK);
    (status, format!("run {run}")).into_response()
}

fn work_app(
    store: Arc<dyn DedupeStore>,
    configure: impl FnOnce(Idempotency) -> Idempotency,
) -> (Router, Runs) {
    work_app_on(
        Deduper::new(store).with_lease_ttl(Duration::from_secs(10)),
        configure,
    )
}

fn work_app_on(
    deduper: Deduper,
    configure: impl FnOnce(Idempotency) -> Idempotency,
) -> (Router, Runs) {
    let runs = Runs::default();
    let idempotency = configure(Idempotency::single_caller(deduper).namespace("work"));
    let router = Router::new()
        .route("/work", post(work))
        .layer(idempotency.layer())
        .with_state(runs.clone());
    (router, runs)
}

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    fn new(base: String) -> Self {
        Self {
            http: reqwest::Client::new(),
            base,
        }
    }

    async fn post(
        &self,
        path: &str,
        caller: &str,
        key: Option<&str>,
        body: &Value,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(caller)
            .json(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send().await.expect("request")
    }
}

/// A unique suffix for this run's keys (stores outlive a run where they are
/// the caller's own servers).
fn run_id() -> String {
    format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos()
    )
}

async fn problem_of(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "a {status} from the layer is a problem document"
    );
    (status, response.json().await.expect("problem json"))
}

/// The API cases on the orders example.
async fn orders_cases(store: Arc<dyn DedupeStore>) {
    let claims = Arc::new(AtomicUsize::new(0));
    let counted: Arc<dyn DedupeStore> = Arc::new(Counting {
        gate: None,
        inner: store,
        claims: Arc::clone(&claims),
    });
    let (router, orders) = orders::app(counted);
    let api = Client::new(listen(router).await);
    let run = run_id();
    let mine = |who: &str| {
        orders
            .all()
            .into_iter()
            .filter(|o| o["owner"] == who)
            .count()
    };

    // A retry after success replays byte for byte, and creates nothing.
    let alice = format!("alice-{run}");
    let key = format!("k1-{run}");
    let first = api
        .post("/orders", &alice, Some(&key), &json!({"item": "book"}))
        .await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers().get("location").cloned();
    let content_type = first.headers().get("content-type").cloned();
    let first_body = first.bytes().await.expect("body");
    let again = api
        .post("/orders", &alice, Some(&key), &json!({"item": "book"}))
        .await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(again.headers().get("location").cloned(), location);
    assert_eq!(again.headers().get("content-type").cloned(), content_type);
    assert_eq!(again.bytes().await.expect("body"), first_body);
    assert_eq!(mine(&alice), 1, "a replay created an order");

    // The same key with another body: 422, nothing created.
    let reused = api
        .post("/orders", &alice, Some(&key), &json!({"item": "lamp"}))
        .await;
    let (status, problem) = problem_of(reused).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#mismatch")),
        "{problem}"
    );
    assert_eq!(mine(&alice), 1);

    // No key where one is required: 400, nothing run.
    let (status, problem) = problem_of(
        api.post("/orders", &alice, None, &json!({"item": "pen"}))
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("requires an Idempotency-Key")),
        "{problem}"
    );
    assert_eq!(mine(&alice), 1);

    // Two callers with one key are two requests.
    let carol = format!("carol-{run}");
    let theirs = api
        .post("/orders", &carol, Some(&key), &json!({"item": "book"}))
        .await;
    assert_eq!(theirs.status(), StatusCode::CREATED);
    assert!(theirs.headers().get("idempotent-replayed").is_none());
    assert_ne!(theirs.bytes().await.expect("body"), first_body);
    assert_eq!((mine(&alice), mine(&carol)), (1, 1));

    // 32 concurrent copies of a new key create one order; every answer is
    // the 201 (first or replayed) or a 409 with Retry-After.
    let bob = format!("bob-{run}");
    let key = format!("k32-{run}");
    let api = Arc::new(api);
    let copies: Vec<_> = (0..32)
        .map(|_| {
            let (api, bob, key) = (Arc::clone(&api), bob.clone(), key.clone());
            tokio::spawn(async move {
                let r = api
                    .post("/orders", &bob, Some(&key), &json!({"item": "desk"}))
                    .await;
                let retry_after = r.headers().get("retry-after").is_some();
                (r.status(), retry_after, r.bytes().await.expect("body"))
            })
        })
        .collect();
    let mut created = Vec::new();
    for copy in copies {
        let (status, retry_after, body) = copy.await.expect("copy");
        match status {
            StatusCode::CREATED => created.push(body),
            StatusCode::CONFLICT => assert!(retry_after, "a 409 without Retry-After"),
            other => panic!(
                "a concurrent copy answered {other}: {}",
                String::from_utf8_lossy(&body)
            ),
        }
    }
    assert_eq!(
        mine(&bob),
        1,
        "32 concurrent copies of one key created {} orders",
        mine(&bob)
    );
    assert!(created.windows(2).all(|w| w[0] == w[1]), "the 201s differ");

    // Malformed and oversized keys: 400, and the store is never asked.
    let before = claims.load(Ordering::SeqCst);
    let long = "k".repeat(dedupe_http::MAX_KEY_BYTES + 1);
    for bad in [
        "",
        "\"unterminated",
        "a b",
        "\"x\";param=1",
        "\"\"",
        long.as_str(),
    ] {
        let r = api
            .http
            .post(format!("{}/orders", api.base))
            .bearer_auth(&bob)
            .header("idempotency-key", bad)
            .json(&json!({"item": "x"}))
            .send()
            .await
            .expect("request");
        let (status, problem) = problem_of(r).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "key {bad:?}");
        assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("#bad-key")),
            "{problem}"
        );
    }
    let obs = reqwest::header::HeaderValue::from_bytes(b"caf\xe9").expect("obs-text value");
    let r = api
        .http
        .post(format!("{}/orders", api.base))
        .bearer_auth(&bob)
        .header("idempotency-key", obs)
        .json(&json!({"item": "x"}))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        claims.load(Ordering::SeqCst),
        before,
        "a refused key reached the store"
    );
    assert_eq!(mine(&bob), 1);

    // GET passes through.
    let listed: Value = api
        .http
        .get(format!("{}/orders", api.base))
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert!(
        listed["orders"].as_array().is_some_and(|o| o.len() >= 3),
        "{listed}"
    );
}

/// The lifecycle cases on the work app.
async fn lifecycle_cases(store: Arc<dyn DedupeStore>) {
    let (router, runs) = work_app(store, |i| i);
    let api = Arc::new(Client::new(listen(router).await));
    let run = run_id();
    let count = || runs.0.load(Ordering::SeqCst);

    // 32 copies while the first runs: one run, the rest 409.
    let key = format!("slow-{run}");
    let copies: Vec<_> = (0..32)
        .map(|_| {
            let (api, key) = (Arc::clone(&api), key.clone());
            tokio::spawn(async move {
                api.post("/work", "dana", Some(&key), &json!({"sleep_ms": 400}))
                    .await
                    .status()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for copy in copies {
        statuses.push(copy.await.expect("copy"));
    }
    assert_eq!(count(), 1, "32 copies ran the handler {} times", count());
    assert!(statuses.contains(&StatusCode::CONFLICT), "{statuses:?}");
    assert!(
        statuses
            .iter()
            .all(|s| matches!(*s, StatusCode::OK | StatusCode::CONFLICT)),
        "{statuses:?}"
    );

    // A 5xx is not kept: the retry runs again.
    let key = format!("fails-{run}");
    let before = count();
    let failing = json!({"status": 503});
    assert_eq!(
        api.post("/work", "dana", Some(&key), &failing)
            .await
            .status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        api.post("/work", "dana", Some(&key), &failing)
            .await
            .status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(count(), before + 2, "a 5xx was kept and replayed");
    // A 4xx is kept.
    let key = format!("refused-{run}");
    let refused = json!({"status": 402});
    let first = api.post("/work", "dana", Some(&key), &refused).await;
    assert_eq!(first.status(), StatusCode::PAYMENT_REQUIRED);
    let again = api.post("/work", "dana", Some(&key), &refused).await;
    assert_eq!(again.status(), StatusCode::PAYMENT_REQUIRED);
    assert!(again.headers().get("idempotent-replayed").is_some());
    assert_eq!(count(), before + 3);

    // A client that disconnects mid-handler: the handler finishes once, and
    // the retry gets its response.
    let key = format!("gone-{run}");
    let before = count();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .expect("client");
    let cut = impatient
        .post(format!("{}/work", api.base))
        .bearer_auth("dana")
        .header("idempotency-key", &key)
        .json(&json!({"sleep_ms": 600}))
        .send()
        .await;
    assert!(cut.is_err(), "the client was meant to give up");
    let started = std::time::Instant::now();
    let replay = loop {
        let r = api
            .post("/work", "dana", Some(&key), &json!({"sleep_ms": 600}))
            .await;
        if r.status() != StatusCode::CONFLICT || started.elapsed() > Duration::from_secs(10) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(replay.status(), StatusCode::OK);
    assert!(replay.headers().get("idempotent-replayed").is_some());
    assert_eq!(
        replay.text().await.expect("body"),
        format!("run {}", before + 1)
    );
    assert_eq!(count(), before + 1, "the disconnect caused a second run");
}

async fn every_case(store: Arc<dyn DedupeStore>) {
    orders_cases(Arc::clone(&store)).await;
    lifecycle_cases(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_memory() {
    every_case(dedupe_url::open_store("memory:").await.expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("http.db").display());
    every_case(dedupe_url::open_store(&url).await.expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    let schema = dedupe_testkit::unique_schema("http");
    let url = format!("{url}?schema={schema}");
    every_case(dedupe_url::open_store(&url).await.expect("store")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_redis_and_through_an_outage() {
    let mut server = dedupe_testkit::redis::RedisServer::start();
    let prefix = dedupe_testkit::redis::unique_prefix("http");
    let url = format!("{}?prefix={prefix}&timeout=1s", server.url());
    let store = dedupe_url::open_store(&url).await.expect("store");
    every_case(Arc::clone(&store)).await;

    // The store unreachable: 503 with Retry-After, nothing run.
    let (router, runs) = work_app(store, |i| i);
    let api = Client::new(listen(router).await);
    server.stop();
    let r = api.post("/work", "erin", Some("outage"), &json!({})).await;
    assert!(r.headers().get("retry-after").is_some());
    let (status, problem) = problem_of(r).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        0,
        "the handler ran without a claim"
    );
    server.start_again();
    let started = std::time::Instant::now();
    loop {
        let r = api.post("/work", "erin", Some("outage"), &json!({})).await;
        if r.status() == StatusCode::OK {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the store did not come back: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(runs.0.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_dynamodb_local() {
    use dedupe_testkit::dynamo::{dynamo_server, unique_table, Emulator};
    let (_server, endpoint) = dynamo_server(Emulator::DynamoDbLocal);
    let url = format!("dynamodb://{}?endpoint={endpoint}", unique_table("http"));
    every_case(dedupe_url::open_store(&url).await.expect("store")).await;
}

/// Opt-in waiting: a copy sent while the first runs gets the first's
/// response instead of 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_copy_gets_the_first_response() {
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app(store, |i| i.wait_for_in_flight(Duration::from_secs(5)));
    let api = Arc::new(Client::new(listen(router).await));
    let first = {
        let api = Arc::clone(&api);
        tokio::spawn(async move {
            api.post("/work", "fay", Some("w"), &json!({"sleep_ms": 500}))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let copy = api
        .post("/work", "fay", Some("w"), &json!({"sleep_ms": 500}))
        .await;
    assert_eq!(copy.status(), StatusCode::OK);
    assert!(copy.headers().get("idempotent-replayed").is_some());
    assert_eq!(copy.text().await.expect("body"), "run 1");
    assert_eq!(first.await.expect("first").status(), StatusCode::OK);
    assert_eq!(runs.0.load(Ordering::SeqCst), 1);
}

/// A panicking handler: 500, nothing kept, the retry runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_is_not_kept() {
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app(store, |i| i);
    let api = Client::new(listen(router).await);
    let (status, problem) = problem_of(
        api.post("/work", "gus", Some("p"), &json!({"panic": true}))
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{problem}");
    let (status, _) = problem_of(
        api.post("/work", "gus", Some("p"), &json!({"panic": true}))
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        2,
        "the retry after a panic did not run"
    );
}

/// A response over the kept size: refused (a 500 kept in its place, never
/// run again), or sent and released (the retry runs again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn responses_over_the_limit() {
    use dedupe_http::LargeResponse;
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app(Arc::clone(&store), |i| {
        i.max_response_bytes(64, LargeResponse::Refuse)
    });
    let api = Client::new(listen(router).await);
    let big = json!({"pad": 100});
    let small = api
        .post("/work", "hal", Some("small"), &json!({"pad": 10}))
        .await;
    assert_eq!(small.status(), StatusCode::OK);
    let (status, problem) = problem_of(api.post("/work", "hal", Some("big"), &big).await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#response-too-large")),
        "{problem}"
    );
    let again = api.post("/work", "hal", Some("big"), &big).await;
    assert!(again.headers().get("idempotent-replayed").is_some());
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        2,
        "a refused response ran twice"
    );

    let (router, runs) = work_app(store, |i| {
        i.max_response_bytes(64, LargeResponse::PassAndRelease)
    });
    let api = Client::new(listen(router).await);
    for _ in 0..2 {
        let r = api.post("/work", "hal", Some("passed"), &big).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().get("idempotent-replayed").is_none());
        assert_eq!(r.text().await.expect("body").len(), "run 1 ".len() + 100);
    }
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        2,
        "a released response was kept"
    );
}

/// A handler slower than its lease: the layer beats the lease beside it, so
/// a retry after the first lease would have passed is answered in flight,
/// then replayed, and the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_its_lease_runs_once() {
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app_on(
        Deduper::new(store).with_lease_ttl(Duration::from_millis(600)),
        |i| i,
    );
    let api = Arc::new(Client::new(listen(router).await));
    let slow = json!({"sleep_ms": 2000});
    let first = {
        let (api, slow) = (Arc::clone(&api), slow.clone());
        tokio::spawn(async move { api.post("/work", "jon", Some("slow"), &slow).await })
    };
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let retry = api.post("/work", "jon", Some("slow"), &slow).await;
    assert_eq!(
        retry.status(),
        StatusCode::CONFLICT,
        "the retry took the key over"
    );
    assert_eq!(first.await.expect("first").status(), StatusCode::OK);
    assert_eq!(runs.0.load(Ordering::SeqCst), 1, "the handler ran twice");
}

/// A body at the layer's limit whose headers take the stored response past
/// the store's own limit (256 KiB on memory): refused and kept as a problem,
/// never left in flight for a retry to run again once the lease passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_fits_with_headers_that_do_not() {
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app(store, |i| i);
    let api = Client::new(listen(router).await);
    let limit = dedupe_core::DEFAULT_MAX_OUTCOME_BYTES;
    let body = json!({"pad": limit - "run 1 ".len()});
    let (status, problem) = problem_of(api.post("/work", "ivy", Some("edge"), &body).await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{problem}");
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#response-too-large")),
        "{problem}"
    );
    let again = api.post("/work", "ivy", Some("edge"), &body).await;
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(again.headers().get("idempotent-replayed").is_some());
    assert_eq!(runs.0.load(Ordering::SeqCst), 1, "the handler ran twice");
}

/// A handler that completes inside its own Postgres transaction: its order
/// and the kept response commit together; rolled back, neither is there and
/// the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completes_inside_the_handlers_transaction() {
    use axum::extract::Extension;
    use dedupe_http::{Idempotent, StoredResponse};
    use dedupe_postgres::sqlx::{self, AssertSqlSafe};
    use dedupe_postgres::PgStore;

    let (_server, url) = dedupe_testkit::postgres_server();
    let schema = dedupe_testkit::unique_schema("http_tx");
    let pool = PgStore::connect_pool(&url, 8, Duration::from_secs(5))
        .await
        .expect("pool");
    let store = PgStore::builder(pool.clone())
        .schema(&schema)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let orders = format!("\"{schema}\".orders");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, item text NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("orders table");

    #[derive(Clone)]
    struct Shop {
        store: PgStore,
        orders: String,
    }
    async fn create(
        State(shop): State<Shop>,
        Extension(idem): Extension<Idempotent>,
        Json(body): Json<Value>,
    ) -> Response {
        let mut tx = shop.store.pool().begin().await.expect("begin");
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} (item) VALUES ($1) RETURNING id",
            shop.orders
        )))
        .bind(body["item"].as_str().unwrap_or("?"))
        .fetch_one(&mut *tx)
        .await
        .expect("insert");
        if body["rollback"] == true {
            drop(tx);
            return (StatusCode::INTERNAL_SERVER_ERROR, "rolled back").into_response();
        }
        let response = StoredResponse::new(StatusCode::CREATED)
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .body(json!({ "id": id }).to_string());
        shop.store
            .complete_in(&mut tx, idem.lease(), &response.encode(), idem.retention())
            .await
            .expect("complete in the transaction");
        tx.commit().await.expect("commit");
        idem.completed();
        response.into_http()
    }

    let idempotency =
        Idempotency::single_caller(Deduper::new(store.clone())).policy(|_| KeyPolicy::Required);
    let router = Router::new()
        .route("/orders", post(create))
        .layer(idempotency.layer())
        .with_state(Shop {
            store: store.clone(),
            orders: orders.clone(),
        });
    let api = Client::new(listen(router).await);
    let count = || async {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("SELECT count(*) FROM {orders}")))
            .fetch_one(&pool)
            .await
            .expect("count")
    };

    let first = api
        .post("/orders", "ivy", Some("tx-1"), &json!({"item": "book"}))
        .await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = first.bytes().await.expect("body");
    let again = api
        .post("/orders", "ivy", Some("tx-1"), &json!({"item": "book"}))
        .await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_some());
    assert_eq!(again.bytes().await.expect("body"), body);
    assert_eq!(count().await, 1);

    let rolled = json!({"item": "lamp", "rollback": true});
    let r = api.post("/orders", "ivy", Some("tx-2"), &rolled).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count().await, 1, "a rolled-back order is there");
    let r = api
        .post("/orders", "ivy", Some("tx-2"), &json!({"item": "lamp"}))
        .await;
    assert_eq!(
        r.status(),
        StatusCode::CREATED,
        "the retry after a rollback did not run"
    );
    assert_eq!(count().await, 2);
}

/// A request whose client goes away while its claim is on its way to the
/// store: the claim, the handler and the completion still run to their end
/// (the request is a task of the deduper's from the claim on), so the key is
/// done, not left claimed until its lease passes, and the retry is a replay.
/// Fails when the claim runs in the request's own future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_the_claim_leaves_the_request_done() {
    use std::sync::atomic::AtomicUsize;
    use tower::ServiceExt;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let claims = Arc::new(AtomicUsize::new(0));
    let store: Arc<dyn DedupeStore> = Arc::new(Counting {
        inner: Arc::new(dedupe_core::MemoryStore::new()),
        claims: Arc::clone(&claims),
        gate: Some(Arc::clone(&gate)),
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/pay",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "paid")
                }
            }),
        )
        .layer(Idempotency::single_caller(Deduper::new(Arc::clone(&store))).layer());
    let request = || {
        axum::http::Request::post("/pay")
            .header("idempotency-key", "gone-1")
            .body(axum::body::Body::from("{}"))
            .expect("request")
    };
    let first = tokio::spawn(app.clone().oneshot(request()));
    while claims.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The client leaves while its claim waits at the gate.
    first.abort();
    let _ = first.await;
    gate.add_permits(100);
    let key = Idempotency::single_caller(Deduper::new(dedupe_core::MemoryStore::new()))
        .store_key(
            None,
            &Method::POST,
            "/pay",
            &dedupe_http::IdempotencyKey::parse(b"gone-1").expect("a key"),
        )
        .expect("a store key");
    let done = async {
        loop {
            if let Some(record) = store.get(&key).await.expect("get") {
                if matches!(record.state, dedupe_core::RecordState::Done { .. }) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), done)
        .await
        .expect("the request ran to its end without its client");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let retry = app.oneshot(request()).await.expect("answered");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the retry ran the handler again"
    );
}

/// `wait_for_in_flight(Duration::MAX)`: a copy sent while the first runs
/// waits for its outcome (the bound capped, not overflowed), and gets the
/// first's response replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unbounded_wait_for_in_flight_waits() {
    let store = dedupe_url::open_store("memory:").await.expect("store");
    let (router, runs) = work_app(store, |i| i.wait_for_in_flight(Duration::MAX));
    let api = Arc::new(Client::new(listen(router).await));
    let slow = json!({"sleep_ms": 300});
    let first = {
        let (api, slow) = (Arc::clone(&api), slow.clone());
        tokio::spawn(async move { api.post("/work", "ann", Some("wait"), &slow).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let copy = api.post("/work", "ann", Some("wait"), &slow).await;
    assert_eq!(copy.status(), StatusCode::OK);
    assert_eq!(copy.headers()["idempotent-replayed"], "true");
    assert_eq!(first.await.expect("first").status(), StatusCode::OK);
    assert_eq!(runs.0.load(Ordering::SeqCst), 1);
}

/// The defaults protect: a POST or PATCH without a key is refused (400,
/// nothing run) and a GET runs without one; `keys_optional()` lets the POST
/// through unprotected. Keys are per caller with `scoped`: two callers
/// sending the same key and body each run once; with `single_caller` they
/// share one key space, and the second gets the first's response.
#[tokio::test]
async fn the_defaults_require_a_key_and_a_scope() {
    let scope = |req: &http::request::Parts| {
        let auth = req.headers.get("authorization")?;
        auth.to_str().ok().map(String::from)
    };
    let runs = Runs::default();
    let router = |idempotency: Idempotency| {
        Router::new()
            .route("/work", post(work).patch(work).get(|| async { "read" }))
            .layer(idempotency.layer())
            .with_state(runs.clone())
    };
    let strict = Client::new(
        listen(router(Idempotency::scoped(
            Deduper::new(dedupe_core::MemoryStore::new()),
            scope,
        )))
        .await,
    );
    let body = json!({});
    let (status, problem) = problem_of(strict.post("/work", "a", None, &body).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or("")
            .contains("requires an Idempotency-Key"),
        "{problem}"
    );
    let patch = strict
        .http
        .patch(format!("{}/work", strict.base))
        .json(&body)
        .send()
        .await
        .expect("patch");
    assert_eq!(patch.status(), StatusCode::BAD_REQUEST);
    let get = strict
        .http
        .get(format!("{}/work", strict.base))
        .send()
        .await
        .expect("get");
    assert_eq!(get.status(), StatusCode::OK);
    assert_eq!(runs.0.load(Ordering::SeqCst), 0, "a refused request ran");

    // Two callers, one key: each runs once.
    for caller in ["a", "b", "a"] {
        let answer = strict.post("/work", caller, Some("same"), &body).await;
        assert_eq!(answer.status(), StatusCode::OK);
    }
    assert_eq!(runs.0.load(Ordering::SeqCst), 2, "scoped keys met");

    let shared = Client::new(
        listen(router(Idempotency::single_caller(Deduper::new(
            dedupe_core::MemoryStore::new(),
        ))))
        .await,
    );
    let first = shared.post("/work", "a", Some("same"), &body).await;
    let first = first.text().await.expect("body");
    let second = shared.post("/work", "b", Some("same"), &body).await;
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(second.text().await.expect("body"), first);
    assert_eq!(runs.0.load(Ordering::SeqCst), 3);

    let lenient = Client::new(
        listen(router(
            Idempotency::single_caller(Deduper::new(dedupe_core::MemoryStore::new()))
                .keys_optional(),
        ))
        .await,
    );
    let answer = lenient.post("/work", "a", None, &body).await;
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(runs.0.load(Ordering::SeqCst), 4, "keys_optional let it run");
}
