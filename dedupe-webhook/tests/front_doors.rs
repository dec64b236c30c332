//! One table, two front doors: every case below runs against an
//! `Idempotency-Key` route (dedupe-http's layer, the key in the header) and a
//! webhook route (the receiver, the key from the body's `id`), behind a real
//! HTTP server with a real client, and both must give the same answers: the
//! same status, the same problem `type`, `Retry-After` and
//! `Idempotent-Replayed` alike, and the same count of handler runs (a side
//! effect the test owns). A delivery and a request take one code path after
//! verification; this is where a drift between them shows. A second test
//! hangs a handler behind each door with the default settings, on paused
//! time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Router;
use dedupe_core::{
    async_trait, Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Deduper, Error, Key, Lease,
    MemoryStore, Record, Result as StoreResult,
};
use dedupe_http::{Idempotency, KeyPolicy, PROBLEM_BASE};
use dedupe_webhook::{Answer, KeyRule, Webhook};
use reqwest::StatusCode;
use tower::ServiceExt;

/// Runs of the handler, by the request's `id`.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, usize>>>);

impl Runs {
    fn of(&self, id: &str) -> usize {
        self.0.lock().expect("runs").get(id).copied().unwrap_or(0)
    }
}

/// The one handler both doors run: counts its run, then sleeps, panics or
/// answers a large body as the request's JSON asks.
async fn handler(State(runs): State<Runs>, body: Bytes) -> Response {
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = json["id"].as_str().unwrap_or_default().to_string();
    *runs.0.lock().expect("runs").entry(id.clone()).or_default() += 1;
    if let Some(ms) = json["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if json["panic"].as_bool() == Some(true) {
        panic!("handler bug");
    }
    if let Some(bytes) = json["big"].as_u64() {
        return "x".repeat(bytes as usize).into_response();
    }
    (StatusCode::OK, format!("done {id}")).into_response()
}

/// A store whose every call fails as an unreachable server's would.
#[derive(Debug)]
struct Down {
    /// Claims answer a refusal no retry gets past (a permission denied),
    /// not an outage.
    refuses: bool,
}

#[async_trait]
impl DedupeStore for Down {
    async fn claim(&self, _: &Key, _: &ClaimOptions) -> StoreResult<ClaimOutcome> {
        Err(if self.refuses {
            Error::fatal("permission denied for table dedupe_records", None)
        } else {
            Error::unavailable("connection refused", None)
        })
    }
    async fn complete(&self, _: &Lease, _: &[u8], _: Duration) -> StoreResult<()> {
        Err(Error::unavailable("connection refused", None))
    }
    async fn release(&self, _: &Lease) -> StoreResult<()> {
        Err(Error::unavailable("connection refused", None))
    }
    async fn extend(&self, _: &Lease, _: Duration) -> StoreResult<Lease> {
        Err(Error::unavailable("connection refused", None))
    }
    async fn expire(&self) -> StoreResult<u64> {
        Err(Error::unavailable("connection refused", None))
    }
    async fn get(&self, _: &Key) -> StoreResult<Option<Record>> {
        Err(Error::unavailable("connection refused", None))
    }
    async fn forget(&self, _: &Key) -> StoreResult<bool> {
        Err(Error::unavailable("connection refused", None))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    /// `POST /http` with `Idempotency-Key: <id>`.
    Http,
    /// `POST /hooks` keyed by the body's `id`.
    Webhook,
}

/// Both doors on one server: each on a store of its own (`store()` makes
/// them), with the same default deduper policy.
async fn serve(store: impl Fn() -> Arc<dyn DedupeStore>) -> (String, Runs) {
    let runs = Runs::default();
    let http = Idempotency::single_caller(Deduper::new(store())).policy(|_| KeyPolicy::Required);
    let hook = Webhook::new(Deduper::new(store()), KeyRule::body_id("hooks"));
    let app = Router::new()
        .route("/http", axum::routing::post(handler).layer(http.layer()))
        .route(
            "/hooks",
            axum::routing::post(handler).route_layer(hook.layer()),
        )
        .with_state(runs.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (base, runs)
}

/// What a client saw, in the terms both doors must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    status: u16,
    /// The problem's `type` past [`PROBLEM_BASE`], for a problem body.
    problem: Option<String>,
    retry_after: bool,
    replayed: bool,
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    door: Door,
    body: &serde_json::Value,
    timeout: Option<Duration>,
) -> Option<Seen> {
    let id = body["id"].as_str().expect("an id");
    let mut req = match door {
        Door::Http => client
            .post(format!("{base}/http"))
            .header("idempotency-key", id),
        Door::Webhook => client.post(format!("{base}/hooks")),
    }
    .header("content-type", "application/json")
    .body(body.to_string());
    if let Some(timeout) = timeout {
        req = req.timeout(timeout);
    }
    let response = req.send().await.ok()?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.ok()?;
    let problem = headers
        .get("content-type")
        .is_some_and(|c| c == "application/problem+json")
        .then(|| {
            let json: serde_json::Value = serde_json::from_str(&text).expect("a problem body");
            json["type"]
                .as_str()
                .and_then(|t| t.strip_prefix(PROBLEM_BASE))
                .expect("a problem type under the base")
                .to_string()
        });
    Some(Seen {
        status,
        problem,
        retry_after: headers.contains_key("retry-after"),
        replayed: headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
    })
}

fn seen(status: u16, problem: Option<&str>, retry_after: bool, replayed: bool) -> Seen {
    Seen {
        status,
        problem: problem.map(str::to_string),
        retry_after,
        replayed,
    }
}

/// One case: what it sends and when, the answers it expects, and how many
/// times the handler ran.
async fn case(
    name: &str,
    client: &reqwest::Client,
    base: &str,
    runs: &Runs,
    door: Door,
) -> (Vec<Seen>, usize) {
    let id = format!("{name}-{door:?}");
    let body = |extra: serde_json::Value| {
        let mut body = serde_json::json!({ "id": id });
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    let mut answers = Vec::new();
    match name {
        "replay" => {
            let plain = body(serde_json::json!({}));
            for _ in 0..2 {
                answers.push(
                    send(client, base, door, &plain, None)
                        .await
                        .expect("answered"),
                );
            }
        }
        "in_flight" => {
            let slow = body(serde_json::json!({ "sleep_ms": 800 }));
            let first = {
                let (client, base, slow) = (client.clone(), base.to_string(), slow.clone());
                tokio::spawn(async move { send(&client, &base, door, &slow, None).await })
            };
            tokio::time::sleep(Duration::from_millis(200)).await;
            answers.push(
                send(client, base, door, &slow, None)
                    .await
                    .expect("answered"),
            );
            answers.push(first.await.expect("joined").expect("answered"));
        }
        "mismatch" => {
            answers.push(
                send(
                    client,
                    base,
                    door,
                    &body(serde_json::json!({ "n": 1 })),
                    None,
                )
                .await
                .expect("answered"),
            );
            answers.push(
                send(
                    client,
                    base,
                    door,
                    &body(serde_json::json!({ "n": 2 })),
                    None,
                )
                .await
                .expect("answered"),
            );
        }
        "response_over_the_limit" => {
            let big = body(serde_json::json!({ "big": 300 * 1024 }));
            for _ in 0..2 {
                answers.push(
                    send(client, base, door, &big, None)
                        .await
                        .expect("answered"),
                );
            }
        }
        "panic" => {
            let panics = body(serde_json::json!({ "panic": true }));
            for _ in 0..2 {
                answers.push(
                    send(client, base, door, &panics, None)
                        .await
                        .expect("answered"),
                );
            }
        }
        "client_disconnect" => {
            let slow = body(serde_json::json!({ "sleep_ms": 600 }));
            let gone = send(client, base, door, &slow, Some(Duration::from_millis(150))).await;
            assert!(gone.is_none(), "the client was to give up first: {gone:?}");
            // The handler goes on without its client; its response is kept.
            tokio::time::sleep(Duration::from_millis(900)).await;
            answers.push(
                send(client, base, door, &slow, None)
                    .await
                    .expect("answered"),
            );
        }
        "store_down" | "store_refuses" => {
            answers.push(
                send(client, base, door, &body(serde_json::json!({})), None)
                    .await
                    .expect("answered"),
            );
        }
        other => panic!("no case {other}"),
    }
    (answers, runs.of(&id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_front_doors_give_the_same_answers() {
    let client = reqwest::Client::new();
    let (up, up_runs) = serve(|| Arc::new(MemoryStore::new())).await;
    let (down, down_runs) = serve(|| Arc::new(Down { refuses: false })).await;
    let (refusing, refusing_runs) = serve(|| Arc::new(Down { refuses: true })).await;
    let table: Vec<(&str, Vec<Seen>, usize)> = vec![
        (
            "replay",
            vec![seen(200, None, false, false), seen(200, None, false, true)],
            1,
        ),
        (
            "in_flight",
            vec![
                seen(409, Some("in-flight"), true, false),
                seen(200, None, false, false),
            ],
            1,
        ),
        (
            "mismatch",
            vec![
                seen(200, None, false, false),
                seen(422, Some("mismatch"), false, false),
            ],
            1,
        ),
        (
            "response_over_the_limit",
            vec![
                seen(500, Some("response-too-large"), false, false),
                seen(500, Some("response-too-large"), false, true),
            ],
            1,
        ),
        (
            "panic",
            vec![
                seen(500, Some("panicked"), false, false),
                seen(500, Some("panicked"), false, false),
            ],
            2,
        ),
        ("client_disconnect", vec![seen(200, None, false, true)], 1),
        (
            "store_down",
            vec![seen(503, Some("unavailable"), true, false)],
            0,
        ),
        (
            "store_refuses",
            vec![seen(500, Some("error"), false, false)],
            0,
        ),
    ];
    for (name, expected, expected_runs) in table {
        let (base, runs) = match name {
            "store_down" => (&down, &down_runs),
            "store_refuses" => (&refusing, &refusing_runs),
            _ => (&up, &up_runs),
        };
        let mut by_door = Vec::new();
        for door in [Door::Http, Door::Webhook] {
            let got = case(name, &client, base, runs, door).await;
            assert_eq!(
                got,
                (expected.clone(), expected_runs),
                "{name} through the {door:?} door"
            );
            by_door.push(got);
        }
        assert_eq!(by_door[0], by_door[1], "{name}: the two doors differ");
    }
}

/// A handler that hangs on its first run, behind each HTTP front door with
/// the default settings: a copy nine minutes in is answered 409; at the
/// deduper's default bound (10 minutes) the handler is dropped and its claim
/// released, the first request answers 503 `handler-timeout`, and the next
/// copy runs the handler. Without the bound the key is held for as long as
/// the process lives and this fails. In process (`oneshot`), on paused time.
#[tokio::test(start_paused = true)]
async fn a_hung_handler_loses_its_claim_at_the_default_bound() {
    for door in [Door::Http, Door::Webhook] {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let hangs_once = {
            let runs = Arc::clone(&runs);
            move || async move {
                if runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                "done"
            }
        };
        let deduper = Deduper::new(MemoryStore::new());
        let app = match door {
            Door::Http => Router::new().route(
                "/",
                axum::routing::post(hangs_once).layer(Idempotency::single_caller(deduper).layer()),
            ),
            Door::Webhook => Router::new().route(
                "/",
                axum::routing::post(hangs_once)
                    .route_layer(Webhook::new(deduper, KeyRule::body_id("hooks")).layer()),
            ),
        };
        let request = || {
            http::Request::post("/")
                .header("idempotency-key", "evt_hung")
                .header("content-type", "application/json")
                .body(axum::body::Body::from(r#"{"id":"evt_hung"}"#))
                .expect("a request")
        };
        let first = tokio::spawn(app.clone().oneshot(request()));
        tokio::time::sleep(Duration::from_secs(9 * 60)).await;
        let copy = app.clone().oneshot(request()).await.expect("answered");
        assert_eq!(copy.status(), StatusCode::CONFLICT, "{door:?}");
        let first = tokio::time::timeout(Duration::from_secs(2 * 60), first)
            .await
            .unwrap_or_else(|_| panic!("{door:?}: the default bound did not end the hung handler"))
            .expect("joined")
            .expect("answered");
        assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE, "{door:?}");
        assert_eq!(
            first.extensions().get::<Answer>(),
            Some(&Answer::HandlerTimeout),
            "{door:?}"
        );
        let next = app.oneshot(request()).await.expect("answered");
        assert_eq!(next.status(), StatusCode::OK, "{door:?}");
        assert_eq!(
            runs.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "{door:?}"
        );
    }
}

/// A key completed by other code (here a bare claim and completion with
/// bytes that are no kept response) is where the doors differ by their
/// settings: the webhook receiver (`acknowledge_foreign_outcomes`) answers
/// the sender 200 `{"duplicate": true}`, marked replayed, so a provider stops
/// resending; the `Idempotency-Key` layer answers 500
/// `corrupt-stored-response`. Neither runs the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_completed_by_other_code() {
    let store: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let complete_by_hand = |key: Key| {
        let store = Arc::clone(&store);
        async move {
            let lease = store
                .claim(&key, &ClaimOptions::default())
                .await
                .expect("claim")
                .lease()
                .cloned()
                .expect("won");
            store
                .complete(&lease, b"not a kept response", Duration::from_secs(60))
                .await
                .expect("complete");
        }
    };
    complete_by_hand(Key::new("hooks", "evt_foreign").expect("key")).await;
    let http = Idempotency::single_caller(Deduper::new(Arc::clone(&store)))
        .policy(|_| KeyPolicy::Required);
    complete_by_hand(
        http.store_key(
            None,
            &http::Method::POST,
            "/http",
            &dedupe_http::IdempotencyKey::parse(b"evt_foreign").expect("a key"),
        )
        .expect("a store key"),
    )
    .await;
    let runs = Runs::default();
    let hook = Webhook::new(Deduper::new(Arc::clone(&store)), KeyRule::body_id("hooks"));
    let app = Router::new()
        .route("/http", axum::routing::post(handler).layer(http.layer()))
        .route(
            "/hooks",
            axum::routing::post(handler).route_layer(hook.layer()),
        )
        .with_state(runs.clone());
    let request = |path: &str| {
        http::Request::post(path)
            .header("idempotency-key", "evt_foreign")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(r#"{"id":"evt_foreign"}"#))
            .expect("a request")
    };
    let delivery = app
        .clone()
        .oneshot(request("/hooks"))
        .await
        .expect("answered");
    assert_eq!(delivery.status(), StatusCode::OK);
    assert_eq!(delivery.headers()["idempotent-replayed"], "true");
    let body = axum::body::to_bytes(delivery.into_body(), 1024)
        .await
        .expect("body");
    let json: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(json["duplicate"], true, "{json}");
    let api = app.oneshot(request("/http")).await.expect("answered");
    assert_eq!(api.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        api.extensions().get::<Answer>(),
        Some(&Answer::CorruptStored)
    );
    assert_eq!(runs.of("evt_foreign"), 0, "the handler ran");
}
