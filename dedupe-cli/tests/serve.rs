//! `dedupe serve` end to end, over real HTTP, on every store: retries, copies at
//! the same instant, bodies without ids, mismatched payloads, bad and oversized
//! bodies, forged, missing and stale signatures, a failing business step, and
//! the store stopped mid-run. Every check counts ledger rows, not only status
//! codes.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_testkit as support;
use dedupe_webhook::{Scheme, Verifier};
use reqwest::StatusCode;
use serde_json::Value;

const STRIPE_SECRET: &str = "whsec_serve_test_secret";

/// A running `dedupe serve`, killed on drop.
struct Serve {
    child: Child,
    base: String,
}

impl Serve {
    fn start(store: &str, work_ms: u64) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dedupe"))
            .args([
                "serve",
                "--store",
                store,
                "--listen",
                "127.0.0.1:0",
                "--work-ms",
                &work_ms.to_string(),
                "--secret",
                &format!("stripe={STRIPE_SECRET}"),
                "--unsigned",
                "hooks",
                "--fail-on-header",
                "x-test-fail",
                "--body-limit",
                "65536",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start dedupe serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("first line");
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        Self { child, base }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn deliver(
    http: &reqwest::Client,
    url: &str,
    body: &str,
    delivery: &str,
    extra: &[(&str, String)],
) -> (StatusCode, reqwest::header::HeaderMap, String) {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("x-delivery-id", delivery)
        .body(body.to_string());
    for (k, v) in extra {
        req = req.header(*k, v);
    }
    let response = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url} ({delivery}): {e}"));
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap_or_default())
}

/// Ledger rows for `key` (all rows when `None`), read through `GET /hooks`.
async fn rows(http: &reqwest::Client, base: &str, key: Option<&str>) -> Vec<Value> {
    let ledger: Value = http
        .get(format!("{base}/hooks"))
        .send()
        .await
        .expect("GET /hooks")
        .json()
        .await
        .expect("ledger JSON");
    let all = ledger["ledger"].as_array().cloned().unwrap_or_default();
    assert_eq!(ledger["rows"].as_u64(), Some(all.len() as u64));
    all.into_iter()
        .filter(|r| key.is_none_or(|k| r["key"] == k))
        .collect()
}

fn unique(label: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("evt_{label}_{nanos}")
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// Every answer of the receiver, counted in ledger rows.
async fn whole_path(serve: &Serve, rounds: usize) {
    let http = client();
    let base = &serve.base;
    let hooks = format!("{base}/hooks");

    // A retry with a new delivery id: one row, the replay marked and identical.
    let id = unique("retry");
    let body = format!(r#"{{"id":"{id}","type":"payment_intent.succeeded","amount":2500}}"#);
    let (status, headers, first) = deliver(&http, &hooks, &body, "del_a1", &[]).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(headers.get("idempotent-replay").is_none());
    let first: Value = serde_json::from_str(&first).expect("json");
    assert_eq!(first["processed"], true);
    let key = first["key"].as_str().expect("key").to_string();
    assert_eq!(key, format!("hooks:{id}"));
    let (status, headers, second) = deliver(&http, &hooks, &body, "del_b2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replay"], "true");
    assert_eq!(serde_json::from_str::<Value>(&second).expect("json"), first);
    let ledger = rows(&http, base, Some(&key)).await;
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(ledger[0]["delivery_id"], "del_a1");
    assert_eq!(ledger[0]["event_id"], id.as_str());

    // 64 copies at the same instant, distinct delivery ids: one row per event.
    for round in 0..rounds {
        let id = unique(&format!("burst{round}"));
        let body = format!(r#"{{"id":"{id}","amount":1}}"#);
        let replies = futures_util::future::join_all((0..64).map(|i| {
            let (http, hooks, body) = (http.clone(), hooks.clone(), body.clone());
            async move { deliver(&http, &hooks, &body, &format!("del_{round}_{i}"), &[]).await }
        }))
        .await;
        let processed = replies
            .iter()
            .filter(|(s, h, _)| *s == StatusCode::OK && h.get("idempotent-replay").is_none())
            .count();
        for (status, headers, text) in &replies {
            match *status {
                StatusCode::OK => {}
                StatusCode::CONFLICT => assert!(headers.contains_key("retry-after"), "{text}"),
                other => panic!("round {round}: a copy answered {other}: {text}"),
            }
        }
        assert_eq!(processed, 1, "round {round}: {processed} copies processed");
        let ledger = rows(&http, base, Some(&format!("hooks:{id}"))).await;
        assert_eq!(ledger.len(), 1, "round {round}: {ledger:?}");
    }

    // No id: the body hash; sent twice, one row.
    let anonymous = format!(r#"{{"type":"ping","nonce":"{}"}}"#, unique("anon"));
    let (status, _, text) = deliver(&http, &hooks, &anonymous, "del_n1", &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let key = serde_json::from_str::<Value>(&text).expect("json")["key"]
        .as_str()
        .expect("key")
        .to_string();
    assert!(key.starts_with("hooks:sha256:"), "{key}");
    let (status, headers, _) = deliver(&http, &hooks, &anonymous, "del_n2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replay"], "true");
    assert_eq!(rows(&http, base, Some(&key)).await.len(), 1);

    // The same id with another payload: 422, no row.
    let id = unique("mismatch");
    let (status, _, _) = deliver(
        &http,
        &hooks,
        &format!(r#"{{"id":"{id}","amount":1}}"#),
        "d1",
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, text) = deliver(
        &http,
        &hooks,
        &format!(r#"{{"id":"{id}","amount":999}}"#),
        "d2",
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert_eq!(
        rows(&http, base, Some(&format!("hooks:{id}"))).await.len(),
        1
    );

    // Not JSON, and over the size limit: 400 and 413, nothing written.
    let before = rows(&http, base, None).await.len();
    let (status, _, _) = deliver(&http, &hooks, "{\"id\": \"evt_broken\"", "d3", &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let big = format!(
        r#"{{"id":"{}","pad":"{}"}}"#,
        unique("big"),
        "x".repeat(70_000)
    );
    let (status, _, _) = deliver(&http, &hooks, &big, "d4", &[]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    // Signatures on /hooks/stripe: missing, forged, stale -> 401; good -> 200.
    let stripe = format!("{base}/hooks/stripe");
    let signer = Verifier::new(Scheme::Stripe, [STRIPE_SECRET]).expect("secret");
    let forger = Verifier::new(Scheme::Stripe, ["whsec_not_the_secret"]).expect("secret");
    let id = unique("signed");
    let body = format!(r#"{{"id":"{id}","object":"event"}}"#);
    let sign = |v: &Verifier, at: u64| -> Vec<(&str, String)> { v.sign("", at, body.as_bytes()) };
    for (what, headers) in [
        ("missing", vec![]),
        ("forged", sign(&forger, now_secs())),
        ("stale", sign(&signer, now_secs() - 3600)),
    ] {
        let (status, _, text) = deliver(&http, &stripe, &body, "s1", &headers).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {text}");
    }
    assert_eq!(
        rows(&http, base, None).await.len(),
        before,
        "a refused request wrote a row"
    );
    let (status, _, text) = deliver(&http, &stripe, &body, "s2", &sign(&signer, now_secs())).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        rows(&http, base, Some(&format!("stripe:{id}"))).await.len(),
        1
    );

    // Routes with no secret while others have one are not served, nor are
    // unknown sources: nothing unsigned gets in by a side door.
    for route in ["github", "shopify", "nowhere"] {
        let (status, _, text) = deliver(
            &http,
            &format!("{base}/hooks/{route}"),
            r#"{"id":"evt_side_door"}"#,
            "x1",
            &[("x-github-delivery", "gh-1".into())],
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{route}: {text}");
    }

    // A failing business step: 500, claim released, the retry processes it.
    let id = unique("fails");
    let body = format!(r#"{{"id":"{id}"}}"#);
    let fail = [("x-test-fail", "1".to_string())];
    let (status, _, _) = deliver(&http, &hooks, &body, "f1", &fail).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        rows(&http, base, Some(&format!("hooks:{id}"))).await.len(),
        0
    );
    let (status, headers, _) = deliver(&http, &hooks, &body, "f2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replay").is_none());
    let ledger = rows(&http, base, Some(&format!("hooks:{id}"))).await;
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0]["delivery_id"], "f2");

    // Health and metrics.
    let health = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), StatusCode::OK);
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for answer in [
        "processed",
        "replayed",
        "in_flight",
        "mismatch",
        "unauthorized",
        "failed",
    ] {
        assert!(
            metrics.contains(&format!("answer=\"{answer}\"")),
            "no {answer} in metrics:\n{metrics}"
        );
    }
}

/// With the store stopped: 503 with Retry-After and no row; after it returns,
/// the same delivery is processed once.
async fn store_stopped(serve: &Serve, mut down: impl FnMut(bool)) {
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    let id = unique("outage");
    let body = format!(r#"{{"id":"{id}"}}"#);
    down(true);
    let (status, headers, text) = deliver(&http, &hooks, &body, "o1", &[]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(headers.contains_key("retry-after"));
    down(false);
    let mut processed = false;
    for _ in 0..100 {
        let (status, _, _) = deliver(&http, &hooks, &body, "o2", &[]).await;
        if status == StatusCode::OK {
            processed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(processed, "the receiver did not recover");
    let ledger = rows(&http, &serve.base, Some(&format!("hooks:{id}"))).await;
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(ledger[0]["delivery_id"], "o2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let serve = Serve::start(&url, 30);
    whole_path(&serve, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_memory() {
    let serve = Serve::start("memory:", 30);
    whole_path(&serve, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_postgres() {
    let cluster = support::PgCluster::start();
    let url = format!("{}?timeout=2s", cluster.url("postgres"));
    let serve = Serve::start(&url, 30);
    whole_path(&serve, 10).await;
    store_stopped(&serve, |down| {
        if down {
            cluster.stop()
        } else {
            cluster.restart()
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_redis() {
    let mut server = support::redis::RedisServer::start();
    let url = format!("{}?timeout=1s", server.url());
    let serve = Serve::start(&url, 30);
    whole_path(&serve, 10).await;
    store_stopped(&serve, |down| {
        if down {
            server.stop()
        } else {
            server.start_again()
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_dynamodb() {
    // The emulator keeps its tables in memory: the outage is a cut connection
    // (a loopback proxy between the receiver and the emulator), not a restart.
    let emulator = support::dynamo::DynamoServer::start(support::dynamo::Emulator::DynamoDbLocal);
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], emulator.port));
    let proxy = support::TcpProxy::start(upstream).await.expect("proxy");
    let table = support::dynamo::unique_table("serve");
    let url = format!(
        "dynamodb://{table}?endpoint=http://{}&timeout=10s",
        proxy.addr()
    );
    let serve = Serve::start(&url, 30);
    whole_path(&serve, 5).await;
    store_stopped(&serve, |down| if down { proxy.cut() } else { proxy.heal() }).await;
}

/// SIGTERM while a delivery is being processed: the server stops accepting,
/// the in-flight delivery finishes (200, its row committed), and a receiver
/// started again on the same file replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_deliveries() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let serve = Serve::start(&url, 1500);
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    let body = r#"{"id":"evt_shutdown"}"#;
    let in_flight = {
        let (http, hooks) = (http.clone(), hooks.clone());
        tokio::spawn(async move { deliver(&http, &hooks, body, "del_1", &[]).await })
    };
    // Wait until the delivery holds its claim (`dedupe inspect` finds the record).
    let mut held = false;
    for _ in 0..200 {
        let inspect = Command::new(env!("CARGO_BIN_EXE_dedupe"))
            .args(["inspect", "--store", &url, "hooks", "evt_shutdown"])
            .output()
            .expect("dedupe inspect");
        if inspect.status.success() {
            held = String::from_utf8_lossy(&inspect.stdout).contains("in_flight");
            assert!(held, "{}", String::from_utf8_lossy(&inspect.stdout));
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(held, "the first delivery never held its claim");
    let pid = serve.child.id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(term.is_ok_and(|s| s.success()), "kill -TERM failed");
    let (status, headers, text) = in_flight.await.expect("delivery task");
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(headers.get("idempotent-replay").is_none());
    let mut serve = serve;
    let exited = serve.child.wait().expect("wait");
    assert!(exited.success(), "dedupe serve exited with {exited}");

    let again = Serve::start(&url, 0);
    let (status, headers, _) =
        deliver(&http, &format!("{}/hooks", again.base), body, "del_2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replay"], "true");
    let ledger = rows(&http, &again.base, Some("hooks:evt_shutdown")).await;
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(ledger[0]["delivery_id"], "del_1");
}
