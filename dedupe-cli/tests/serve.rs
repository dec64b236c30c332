//! `dedupe serve` end to end, over real HTTP, on every store: retries, copies at
//! the same instant, bodies without ids, mismatched payloads, bad and oversized
//! bodies, forged, missing and stale signatures, a failing business step, and
//! the store stopped mid-run. Every check counts ledger rows, not only status
//! codes.

use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_testkit as support;
use dedupe_webhook::{Scheme, Verifier};
use harness::{client, sample, Serve};
use reqwest::StatusCode;
use serde_json::Value;

mod harness;

use harness::STRIPE_SECRET;

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

/// Ledger rows for `key` (all rows when `None`), read page by page through
/// `GET /hooks` on the admin listener.
async fn rows(http: &reqwest::Client, admin: &str, key: Option<&str>) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut url = format!("{admin}/hooks?limit=50");
        if let Some(a) = &after {
            url.push_str(&format!("&after={a}"));
        }
        let page: Value = http
            .get(url)
            .send()
            .await
            .expect("GET /hooks")
            .json()
            .await
            .expect("ledger JSON");
        let rows = page["ledger"].as_array().cloned().unwrap_or_default();
        assert_eq!(page["rows"].as_u64(), Some(rows.len() as u64));
        all.extend(rows);
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => break,
        }
    }
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

/// The live record of `namespace:id` as `dedupe inspect` prints it (JSON), or
/// `None` when there is none.
fn inspect(url: &str, namespace: &str, id: &str) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .args(["inspect", "--store", url, namespace, id])
        .output()
        .expect("dedupe inspect");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Waits (at most 2 s) until `namespace:id` is held by a delivery in flight.
async fn wait_until_in_flight(url: &str, namespace: &str, id: &str) {
    for _ in 0..200 {
        if let Some(record) = inspect(url, namespace, id) {
            assert!(record.contains("in_flight"), "{record}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{namespace}:{id} was never held by a delivery");
}

/// The Prometheus text of the admin listener.
async fn metrics(http: &reqwest::Client, admin: &str) -> String {
    http.get(format!("{admin}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text")
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
    assert!(headers.get("idempotent-replayed").is_none());
    let first: Value = serde_json::from_str(&first).expect("json");
    assert_eq!(first["processed"], true);
    let key = first["key"].as_str().expect("key").to_string();
    assert_eq!(key, format!("hooks:{id}"));
    let (status, headers, second) = deliver(&http, &hooks, &body, "del_b2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(serde_json::from_str::<Value>(&second).expect("json"), first);
    let ledger = rows(&http, &serve.admin, Some(&key)).await;
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
            .filter(|(s, h, _)| *s == StatusCode::OK && h.get("idempotent-replayed").is_none())
            .count();
        for (status, headers, text) in &replies {
            match *status {
                StatusCode::OK => {}
                StatusCode::CONFLICT => assert!(headers.contains_key("retry-after"), "{text}"),
                other => panic!("round {round}: a copy answered {other}: {text}"),
            }
        }
        assert_eq!(processed, 1, "round {round}: {processed} copies processed");
        let ledger = rows(&http, &serve.admin, Some(&format!("hooks:{id}"))).await;
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
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(rows(&http, &serve.admin, Some(&key)).await.len(), 1);

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
        rows(&http, &serve.admin, Some(&format!("hooks:{id}")))
            .await
            .len(),
        1
    );

    // Not JSON, and over the size limit: 400 and 413, nothing written.
    let before = rows(&http, &serve.admin, None).await.len();
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
        rows(&http, &serve.admin, None).await.len(),
        before,
        "a refused request wrote a row"
    );
    let (status, _, text) = deliver(&http, &stripe, &body, "s2", &sign(&signer, now_secs())).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        rows(&http, &serve.admin, Some(&format!("stripe:{id}")))
            .await
            .len(),
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
        rows(&http, &serve.admin, Some(&format!("hooks:{id}")))
            .await
            .len(),
        0
    );
    let (status, headers, _) = deliver(&http, &hooks, &body, "f2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
    let ledger = rows(&http, &serve.admin, Some(&format!("hooks:{id}"))).await;
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0]["delivery_id"], "f2");

    // Health and metrics.
    let health = http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), StatusCode::OK);
    let metrics = metrics(&http, &serve.admin).await;
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
    let ledger = rows(&http, &serve.admin, Some(&format!("hooks:{id}"))).await;
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
async fn serve_on_mariadb() {
    let mut server = support::MariaDbServer::start();
    let url = format!("{}?timeout=2s", server.url("test"));
    let serve = Serve::start(&url, 30);
    whole_path(&serve, 10).await;
    store_stopped(&serve, |down| {
        if down {
            server.stop()
        } else {
            server.restart()
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
    wait_until_in_flight(&url, "hooks", "evt_shutdown").await;
    let pid = serve.child.id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(term.is_ok_and(|s| s.success()), "kill -TERM failed");
    let (status, headers, text) = in_flight.await.expect("delivery task");
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(headers.get("idempotent-replayed").is_none());
    let mut serve = serve;
    let exited = serve.child.wait().expect("wait");
    assert!(exited.success(), "dedupe serve exited with {exited}");

    let again = Serve::start(&url, 0);
    let (status, headers, _) =
        deliver(&http, &format!("{}/hooks", again.base), body, "del_2", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    let ledger = rows(&http, &again.admin, Some("hooks:evt_shutdown")).await;
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(ledger[0]["delivery_id"], "del_1");
}

/// Lines of the effect log (the business step's side effect, written when it
/// starts) for `key`.
fn effects(log: &std::path::Path, key: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').next() == Some(key))
        .count()
}

async fn wait_for_exit(serve: &mut Serve) {
    for _ in 0..300 {
        if let Some(status) = serve.child.try_wait().expect("try_wait") {
            assert!(status.success(), "dedupe serve exited with {status}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("dedupe serve did not exit after SIGTERM");
}

/// A side effect outside the store (a line in a file, written when the
/// handler starts) happens once per event across: the seeds' case (the
/// sender gives up before a slow handler ends, and retries 0.2 s later), a
/// retry after the work, a burst of 64 copies, and a shutdown mid-handler
/// whose provider already gave up, followed by a new process and a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_side_effect_runs_once_per_event_across_timeouts_bursts_and_restarts() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let log = dir.path().join("effects.log");
    let log_arg = log.display().to_string();
    let args = ["--effect-log", log_arg.as_str()];
    let mut serve = Serve::with(&url, 2500, &args, &[]);
    let http = client();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("client");
    let hooks = format!("{}/hooks", serve.base);

    // The seeds' case: 2.5 s of work, a sender that waits 1 s.
    let slow = r#"{"id":"evt_abc123","type":"payment.succeeded"}"#;
    let gave_up = impatient
        .post(&hooks)
        .header("x-delivery-id", "del_1")
        .body(slow)
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, headers, text) = deliver(&http, &hooks, slow, "del_2", &[]).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the retry ran the work again: {text}"
    );
    assert!(headers.contains_key("retry-after"));

    // 64 copies of another event at once, while the first still works.
    let burst = r#"{"id":"evt_burst"}"#;
    let replies = futures_util::future::join_all((0..64).map(|i| {
        let (http, hooks) = (http.clone(), hooks.clone());
        async move { deliver(&http, &hooks, burst, &format!("b{i}"), &[]).await }
    }))
    .await;
    let processed = replies
        .iter()
        .filter(|(s, h, _)| *s == StatusCode::OK && h.get("idempotent-replayed").is_none())
        .count();
    assert_eq!(processed, 1);

    // After the first event's work: its first delivery's response.
    let (status, headers, text) = deliver(&http, &hooks, slow, "del_3", &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(headers["idempotent-replayed"], "true");
    let replayed: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(replayed["delivery_id"], "del_1");

    // Shutdown mid-handler, the sender gone: the handler finishes in the
    // drain, a new process replays it.
    let last = r#"{"id":"evt_restart"}"#;
    let gave_up = impatient
        .post(&hooks)
        .header("x-delivery-id", "r1")
        .body(last)
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    let pid = serve.child.id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(term.is_ok_and(|s| s.success()));
    wait_for_exit(&mut serve).await;
    let again = Serve::with(&url, 0, &args, &[]);
    let (status, headers, text) =
        deliver(&http, &format!("{}/hooks", again.base), last, "r2", &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        headers["idempotent-replayed"], "true",
        "the drained handler's outcome was lost"
    );

    for key in ["hooks:evt_abc123", "hooks:evt_burst", "hooks:evt_restart"] {
        assert_eq!(
            effects(&log, key),
            1,
            "{key}: {:?}",
            std::fs::read_to_string(&log)
        );
        assert_eq!(rows(&http, &again.admin, Some(key)).await.len(), 1, "{key}");
    }
}

/// Two named routes of one provider are two consumers: one Stripe event sent
/// to both runs both handlers (two namespaces), each secret its own (from a
/// file and from the environment, never argv); a resend to one is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_routes_of_one_provider_are_two_consumers() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let file = dir.path().join("secrets");
    std::fs::write(&file, "# billing's endpoint\nbilling=whsec_billing\n").expect("write");
    let file_arg = file.display().to_string();
    let serve = Serve::with(
        &url,
        0,
        &[
            "--route",
            "billing=stripe",
            "--route",
            "fulfilment=stripe",
            "--secret-file",
            &file_arg,
        ],
        &[("DEDUPE_SECRET_FULFILMENT", "whsec_fulfilment")],
    );
    let http = client();
    let body = r#"{"id":"evt_both","type":"checkout.session.completed"}"#;
    for (route, secret) in [
        ("billing", "whsec_billing"),
        ("fulfilment", "whsec_fulfilment"),
    ] {
        let signer = Verifier::new(Scheme::Stripe, [secret]).expect("secret");
        let signed = signer.sign("", now_secs(), body.as_bytes());
        let url = format!("{}/hooks/{route}", serve.base);
        let (status, headers, text) = deliver(&http, &url, body, "d1", &signed).await;
        assert_eq!(status, StatusCode::OK, "{route}: {text}");
        assert!(
            headers.get("idempotent-replayed").is_none(),
            "{route} did not run"
        );
        let (status, headers, _) = deliver(&http, &url, body, "d2", &signed).await;
        assert_eq!(
            (status, headers.contains_key("idempotent-replayed")),
            (StatusCode::OK, true)
        );
        // The other route's secret does not sign for this one.
        let wrong = Verifier::new(Scheme::Stripe, ["whsec_other"]).expect("secret");
        let (status, _, _) = deliver(
            &http,
            &url,
            body,
            "d3",
            &wrong.sign("", now_secs(), body.as_bytes()),
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        rows(&http, &serve.admin, Some("billing:evt_both"))
            .await
            .len(),
        1
    );
    assert_eq!(
        rows(&http, &serve.admin, Some("fulfilment:evt_both"))
            .await
            .len(),
        1
    );
    // Not in argv: `ps` shows no secret.
    let cmdline =
        std::fs::read_to_string(format!("/proc/{}/cmdline", serve.child.id())).unwrap_or_default();
    assert!(!cmdline.contains("whsec_"), "{cmdline}");
}

/// With a secret configured, the ledger and the metrics are not served on
/// the public listener; the admin listener serves them, the ledger a page at
/// a time. Without any secret and no admin listener (the seeds' demo) the
/// public listener serves the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_surface_is_apart_from_the_public_listener() {
    let serve = Serve::start("memory:", 0);
    let http = client();
    for path in ["/hooks", "/metrics"] {
        let response = http
            .get(format!("{}{path}", serve.base))
            .send()
            .await
            .expect("GET");
        assert_ne!(
            response.status(),
            StatusCode::OK,
            "{path} on the public listener"
        );
        assert!(!response.text().await.unwrap_or_default().contains("ledger"));
    }
    let hooks = format!("{}/hooks", serve.base);
    for i in 0..5 {
        let (status, _, _) = deliver(
            &http,
            &hooks,
            &format!(r#"{{"id":"evt_page_{i}"}}"#),
            "d",
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    let page: Value = http
        .get(format!("{}/hooks?limit=2", serve.admin))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    assert_eq!(page["rows"], 2);
    let next = page["next"].as_str().expect("a next cursor").to_string();
    let rest: Value = http
        .get(format!("{}/hooks?limit=10&after={next}", serve.admin))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    assert_eq!(rest["rows"], 3);
    assert!(rest["next"].is_null());
    let keys: std::collections::BTreeSet<String> = page["ledger"]
        .as_array()
        .into_iter()
        .chain(rest["ledger"].as_array())
        .flatten()
        .map(|r| r["key"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    let bad = http
        .get(format!("{}/hooks?after=not-a-cursor", serve.admin))
        .send()
        .await
        .expect("GET");
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);

    // The seeds' demo: no secret, no admin listener, the ledger on the
    // public listener.
    let demo = Serve::demo("memory:");
    let (status, _, _) = deliver(
        &http,
        &format!("{}/hooks", demo.base),
        r#"{"id":"evt_9f3"}"#,
        "del_b2",
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ledger: Value = http
        .get(format!("{}/hooks", demo.base))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    assert_eq!(ledger["rows"], 1);
}

/// After a scripted sequence, every counter says what happened: deliveries
/// by answer, store calls by answer, settled work by outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_every_answer() {
    let serve = Serve::with("memory:", 300, &["--max-handler-secs", "1"], &[]);
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    // Two processed, one replayed, one mismatch, one failed (released), one
    // in flight (a copy while the first runs).
    deliver(&http, &hooks, r#"{"id":"m1"}"#, "a", &[]).await;
    deliver(&http, &hooks, r#"{"id":"m1"}"#, "b", &[]).await;
    deliver(&http, &hooks, r#"{"id":"m1","x":1}"#, "c", &[]).await;
    deliver(
        &http,
        &hooks,
        r#"{"id":"m2"}"#,
        "d",
        &[("x-test-fail", "1".into())],
    )
    .await;
    let (first, copy) = tokio::join!(deliver(&http, &hooks, r#"{"id":"m3"}"#, "e", &[]), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        deliver(&http, &hooks, r#"{"id":"m3"}"#, "f", &[]).await
    });
    assert_eq!((first.0, copy.0), (StatusCode::OK, StatusCode::CONFLICT));
    let text = metrics(&http, &serve.admin).await;
    let deliveries = |answer| {
        sample(
            &text,
            "dedupe_requests_total",
            &[("namespace", "hooks"), ("answer", answer)],
        )
    };
    assert_eq!(deliveries("processed"), 2.0, "{text}");
    assert_eq!(deliveries("replayed"), 1.0, "{text}");
    assert_eq!(deliveries("mismatch"), 1.0, "{text}");
    assert_eq!(deliveries("failed"), 1.0, "{text}");
    assert_eq!(deliveries("in_flight"), 1.0, "{text}");
    let calls = |operation, answer| {
        sample(
            &text,
            "dedupe_store_calls_total",
            &[("operation", operation), ("answer", answer)],
        )
    };
    assert_eq!(calls("claim", "claimed"), 3.0, "{text}");
    assert_eq!(calls("claim", "duplicate"), 1.0, "{text}");
    assert_eq!(calls("claim", "mismatch"), 1.0, "{text}");
    assert_eq!(calls("claim", "in_flight"), 1.0, "{text}");
    assert_eq!(calls("release", "ok"), 1.0, "{text}");
    assert_eq!(
        sample(&text, "dedupe_work_total", &[("outcome", "released")]),
        1.0,
        "{text}"
    );
    assert!(text.contains("dedupe_store_call_seconds"), "{text}");

    // A handler past --max-handler-secs: aborted, released, counted.
    let bounded = Serve::with("memory:", 1000, &["--max-handler-secs", "0.2"], &[]);
    let (status, headers, _) = deliver(
        &http,
        &format!("{}/hooks", bounded.base),
        r#"{"id":"m4"}"#,
        "g",
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    let text = metrics(&http, &bounded.admin).await;
    assert_eq!(
        sample(
            &text,
            "dedupe_requests_total",
            &[("answer", "handler_timeout")]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "dedupe_work_total", &[("outcome", "timed_out")]),
        1.0,
        "{text}"
    );
}

/// The ledger is pruned with the store's retention: a row outlives its
/// event's record by at most a prune period. `url` ends in `retention=1s`.
async fn pruned_with_the_retention(url: &str) {
    let serve = Serve::with(url, 0, &[], &[]);
    let http = client();
    let (status, _, _) = deliver(
        &http,
        &format!("{}/hooks", serve.base),
        r#"{"id":"evt_old"}"#,
        "d",
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        rows(&http, &serve.admin, Some("hooks:evt_old")).await.len(),
        1
    );
    let since = std::time::Instant::now();
    while !rows(&http, &serve.admin, Some("hooks:evt_old"))
        .await
        .is_empty()
    {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the row outlived its retention"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        since.elapsed() >= Duration::from_millis(500),
        "pruned before its retention"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_is_pruned_with_the_retention_on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("hooks.db");
    pruned_with_the_retention(&format!("sqlite://{}?retention=1s", file.display())).await;
}

/// Postgres and MariaDB share the ledger's code (over `Transactional`): its
/// insert, page and prune each run on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_is_pruned_with_the_retention_on_postgres_and_mariadb() {
    let cluster = support::PgCluster::start();
    pruned_with_the_retention(&format!("{}?retention=1s", cluster.url("postgres"))).await;
    let server = support::MariaDbServer::start();
    pruned_with_the_retention(&format!("{}?retention=1s", server.url("test"))).await;
}

/// SIGTERM with a handler that outlasts the grace while its sender still
/// waits: the handler is aborted at the grace (503 with Retry-After, claim
/// released, so a retry runs it at once), and the process exits, instead of
/// waiting on the open connection until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_past_the_grace_aborts_releases_and_exits() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let mut serve = Serve::with(&url, 20_000, &["--shutdown-grace-secs", "1"], &[]);
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    let waiting = {
        let (http, hooks) = (http.clone(), hooks.clone());
        tokio::spawn(async move { deliver(&http, &hooks, r#"{"id":"evt_long"}"#, "l1", &[]).await })
    };
    wait_until_in_flight(&url, "hooks", "evt_long").await;
    let signalled = std::time::Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &serve.child.id().to_string()])
        .status();
    assert!(term.is_ok_and(|s| s.success()));
    let (status, headers, text) = waiting.await.expect("join");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(headers.contains_key("retry-after"));
    wait_for_exit(&mut serve).await;
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "took {:?} to stop",
        signalled.elapsed()
    );
    let kept = inspect(&url, "hooks", "evt_long");
    assert!(kept.is_none(), "the aborted claim was kept: {kept:?}");
}

/// `dedupe inbox ...` on `url`: its exit status and stdout.
fn inbox_cli(url: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .arg("inbox")
        .args(&args[..1])
        .args(["--store", url])
        .args(&args[1..])
        .output()
        .expect("dedupe inbox");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The items `dedupe inbox list --json` shows for `namespace`.
fn listed(url: &str, namespace: &str, state: Option<&str>) -> Vec<Value> {
    let mut args = vec!["list", "--namespace", namespace, "--json"];
    if let Some(state) = state {
        args.extend(["--state", state]);
    }
    let (ok, out) = inbox_cli(url, &args);
    assert!(ok, "{out}");
    serde_json::from_str::<Value>(&out)
        .unwrap_or_else(|e| panic!("{e}: {out}"))
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..1000 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}");
}

/// `dedupe serve --inbox` and `dedupe inbox`, the business step's side
/// effect counted in a file outside the store:
/// - a delivery whose step takes 1.5 s is answered 202 within 0.5 s, and its
///   resend 200 from the inbox;
/// - the server is SIGKILLed mid-step; a new process (no new delivery)
///   takes the item over when its lease passes and finishes it, once: one
///   ledger row, two starts of the step (the killed one and the finishing
///   one), a later resend answered "done" with no third start;
/// - a delivery whose stored header fails the step on every attempt is dead
///   after `--max-attempts` 3, listed by `dedupe inbox list --state dead
///   --json` with its attempts and error and counted by `stats`; replayed on
///   a healthy server (no failure hook) it is processed once.
async fn inbox_path(url: &str) {
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("effects.log");
    let log_arg = log.display().to_string();
    let inbox_args = |fail: bool| {
        let mut args = vec![
            "--secret".to_string(),
            format!("stripe={STRIPE_SECRET}"),
            "--unsigned".into(),
            "hooks".into(),
            "--inbox".into(),
            "--workers".into(),
            "4".into(),
            "--lease-ms".into(),
            "1000".into(),
            "--max-attempts".into(),
            "3".into(),
            "--retry-backoff-ms".into(),
            "20".into(),
            "--poll-ms".into(),
            "50".into(),
            "--effect-log".into(),
            log_arg.clone(),
        ];
        if fail {
            args.extend(["--fail-on-header".into(), "x-test-fail".into()]);
        }
        args
    };
    let start = |work_ms: u64, fail: bool| {
        let args = inbox_args(fail);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Serve::spawn(url, work_ms, &args, &[])
    };
    let http = client();
    let mut serve = start(1500, false);
    let stripe = format!("{}/hooks/stripe", serve.base);
    let id = unique("inbox");
    let key = format!("stripe:{id}");
    let body = format!(r#"{{"id":"{id}","type":"charge.succeeded"}}"#);
    let signed = Verifier::new(Scheme::Stripe, [STRIPE_SECRET])
        .expect("verifier")
        .sign("unused", now_secs(), body.as_bytes());
    let started = std::time::Instant::now();
    let (status, _, text) = deliver(&http, &stripe, &body, "del_i1", &signed).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "202 took {:?}; the step takes 1.5 s",
        started.elapsed()
    );
    let (status, _, text) = deliver(&http, &stripe, &body, "del_i2", &signed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let state = serde_json::from_str::<Value>(&text).expect("json")["state"].clone();
    assert!(state == "pending" || state == "running", "{text}");
    eventually("the step never started", async || effects(&log, &key) == 1).await;
    serve.child.kill().expect("SIGKILL");
    serve.child.wait().expect("reaped");
    drop(serve);

    let serve = start(200, false);
    let stripe = format!("{}/hooks/stripe", serve.base);
    eventually("the new process never finished the item", async || {
        rows(&http, &serve.admin, Some(&key)).await.len() == 1
    })
    .await;
    eventually("the item was never done", async || {
        listed(url, "stripe", None).is_empty()
    })
    .await;
    let (status, _, text) = deliver(&http, &stripe, &body, "del_i3", &signed).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).expect("json")["state"],
        "done"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        effects(&log, &key),
        2,
        "the killed start and the finishing one"
    );
    assert_eq!(rows(&http, &serve.admin, Some(&key)).await.len(), 1);
    drop(serve);

    // A poison delivery: its stored header fails the step on every attempt.
    let serve = start(0, true);
    let poison_id = unique("poison");
    let poison_key = format!("hooks:{poison_id}");
    let poison = format!(r#"{{"id":"{poison_id}","type":"x"}}"#);
    let hooks = format!("{}/hooks", serve.base);
    let fail = [("x-test-fail", "1".to_string())];
    let (status, _, text) = deliver(&http, &hooks, &poison, "del_p1", &fail).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    eventually("the poison item never died", async || {
        listed(url, "hooks", Some("dead")).len() == 1
    })
    .await;
    let shown = listed(url, "hooks", Some("dead"));
    let item = &shown[0];
    assert_eq!(
        (item["namespace"].as_str(), item["id"].as_str()),
        (Some("hooks"), Some(poison_id.as_str())),
        "{item}"
    );
    assert_eq!(
        (&item["state"], &item["attempts"]),
        (&"dead".into(), &3.into()),
        "{item}"
    );
    // The server's --max-attempts is stored with the item (CONTRACT.md I11),
    // and no worker died holding it.
    assert_eq!(
        (&item["max_attempts"], &item["takeovers"]),
        (&3.into(), &0.into()),
        "{item}"
    );
    assert!(
        item["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("fail-on-header")),
        "{item}"
    );
    assert!(
        item["due_at"].as_str().is_some_and(|d| d.ends_with('Z')),
        "{item}"
    );
    assert_eq!(effects(&log, &poison_key), 3);
    let (ok, out) = inbox_cli(url, &["stats", "--namespace", "hooks", "--json"]);
    assert!(ok, "{out}");
    let stats: Value = serde_json::from_str(&out).expect("stats json");
    assert_eq!(
        (&stats[0]["dead"], &stats[0]["pending"]),
        (&1.into(), &0.into()),
        "{stats}"
    );
    drop(serve);

    // On a healthy server the replayed item is processed, once; not while
    // another process has paused its namespace (the workers poll every
    // 50 ms: ten polls pass), and at once after the resume.
    let serve = start(0, false);
    let (ok, out) = inbox_cli(url, &["pause", "hooks", "--json"]);
    assert!(ok, "{out}");
    let paused: Value = serde_json::from_str(&out).expect("pause json");
    assert_eq!(
        (&paused["paused"], &paused["changed"]),
        (&true.into(), &true.into()),
        "{paused}"
    );
    let (ok, out) = inbox_cli(url, &["replay", "hooks", &poison_id]);
    assert!(ok, "{out}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(effects(&log, &poison_key), 3, "an item ran while paused");
    // Replayed: due now, its last error kept.
    assert_eq!(listed(url, "hooks", Some("failed")).len(), 1);
    let (ok, out) = inbox_cli(url, &["stats", "--namespace", "hooks", "--json"]);
    assert!(ok, "{out}");
    let stats: Value = serde_json::from_str(&out).expect("stats json");
    assert_eq!(stats[0]["paused"], true, "{stats}");
    let (ok, out) = inbox_cli(url, &["resume", "hooks"]);
    assert!(ok && out.contains("hooks is running"), "{out}");
    eventually("the replayed item was never processed", async || {
        rows(&http, &serve.admin, Some(&poison_key)).await.len() == 1
    })
    .await;
    eventually("the replayed item was never done", async || {
        listed(url, "hooks", None).is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(effects(&log, &poison_key), 4);
    assert_eq!(rows(&http, &serve.admin, Some(&poison_key)).await.len(), 1);
    let (ok, out) = inbox_cli(url, &["replay", "hooks", &poison_id]);
    assert!(!ok, "a done item replayed: {out}");
    let (ok, out) = inbox_cli(url, &["forget", "hooks", "evt_none"]);
    assert!(!ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_inbox_on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    inbox_path(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_inbox_on_mariadb() {
    let server = support::MariaDbServer::start();
    inbox_path(&server.url("test")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_inbox_on_redis() {
    let server = support::redis::RedisServer::start();
    inbox_path(&server.url()).await;
}

/// `dedupe serve --inbox` over HTTP: a delivery whose business step answers
/// "permanent" is dead after one attempt (of five), and one that answers
/// "retry after 2 s" runs again no sooner than 2 s later (the backoff is
/// 20 ms), and one that answers "snooze 1 s" waits a second without
/// spending an attempt until `--max-snooze-secs` (2) from its accept has
/// passed, then spends one, on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_inbox_takes_the_business_steps_failure_answer() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let log = dir.path().join("effects.log");
    let log_arg = log.display().to_string();
    let serve = Serve::with(
        &url,
        0,
        &[
            "--unsigned",
            "hooks",
            "--inbox",
            "--max-attempts",
            "5",
            "--retry-backoff-ms",
            "20",
            "--max-snooze-secs",
            "2",
            "--effect-log",
            &log_arg,
        ],
        &[],
    );
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    let (gone, later, sleepy) = (unique("gone"), unique("later"), unique("sleepy"));
    let failing = |value: &str| [("x-test-fail", value.to_string())];
    let body = |id: &str| format!(r#"{{"id":"{id}","type":"x"}}"#);
    let (status, _, text) = deliver(&http, &hooks, &body(&gone), "d1", &failing("permanent")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    let sent = std::time::Instant::now();
    let (status, _, text) = deliver(
        &http,
        &hooks,
        &body(&later),
        "d2",
        &failing("retry-after=2"),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");

    let later_key = format!("hooks:{later}");
    eventually("the retry-after item never ran", async || {
        effects(&log, &later_key) == 1
    })
    .await;
    eventually("the permanent item never died", async || {
        listed(&url, "hooks", Some("dead"))
            .iter()
            .any(|item| item["id"] == gone.as_str())
    })
    .await;
    let dead = listed(&url, "hooks", Some("dead"));
    let item = dead
        .iter()
        .find(|item| item["id"] == gone.as_str())
        .expect("dead");
    assert_eq!(item["attempts"], 1, "{item}");
    assert!(
        item["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("permanent")),
        "{item}"
    );
    eventually("the retry-after item never ran again", async || {
        effects(&log, &later_key) >= 2
    })
    .await;
    assert!(
        sent.elapsed() >= Duration::from_secs(2),
        "ran again {:?} after its delivery, before its 2 s",
        sent.elapsed()
    );
    assert_eq!(effects(&log, &format!("hooks:{gone}")), 1);

    let sleepy_key = format!("hooks:{sleepy}");
    let sent = std::time::Instant::now();
    let (status, _, text) =
        deliver(&http, &hooks, &body(&sleepy), "d3", &failing("snooze=1")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    let shown = |url: &str| {
        listed(url, "hooks", None)
            .into_iter()
            .find(|item| item["id"] == sleepy.as_str())
    };
    eventually("the snoozed item never waited", async || {
        effects(&log, &sleepy_key) == 1
            && shown(&url).is_some_and(|i| i["state"] == "pending" && i["attempts"] == 0)
    })
    .await;
    eventually("the item never snoozed past its window", async || {
        shown(&url).is_some_and(|i| i["attempts"] == 1)
    })
    .await;
    let item = shown(&url).expect("listed");
    assert!(
        item["last_error"]
            .as_str()
            .is_some_and(|e| e.starts_with("snoozed past its window")),
        "{item}"
    );
    let runs = effects(&log, &sleepy_key);
    assert!(
        runs >= 2 && sent.elapsed() >= Duration::from_secs(1),
        "{runs} runs in {:?}: the snooze did not wait its second",
        sent.elapsed()
    );
}

/// `dedupe serve --inbox --order-by /data/object/id` over HTTP, on SQLite:
/// two events of one Stripe object run one at a time, in the order they
/// were accepted (the later event delivered first runs first: no guess at
/// the provider's order), while an event of another object runs beside
/// them. Each step takes 800 ms; while the first runs, the second of its
/// object is pending and never started, and the other object's is running
/// (the test fails without `--order-by`: all three run at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_inbox_runs_one_objects_events_in_accept_order() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("hooks.db").display());
    let log = dir.path().join("effects.log");
    let log_arg = log.display().to_string();
    let serve = Serve::with(
        &url,
        800,
        &[
            "--unsigned",
            "hooks",
            "--inbox",
            "--workers",
            "4",
            "--poll-ms",
            "50",
            "--order-by",
            "/data/object/id",
            "--effect-log",
            &log_arg,
        ],
        &[],
    );
    let http = client();
    let hooks = format!("{}/hooks", serve.base);
    let customer = unique("cus");
    let (updated, created, other) = (unique("evt_upd"), unique("evt_new"), unique("evt_other"));
    let body = |id: &str, object: &str| {
        format!(r#"{{"id":"{id}","type":"customer.x","data":{{"object":{{"id":"{object}"}}}}}}"#)
    };
    for (id, object, delivery) in [
        (&updated, customer.as_str(), "d1"),
        (&created, customer.as_str(), "d2"),
        (&other, "cus_elsewhere", "d3"),
    ] {
        let (status, _, text) = deliver(&http, &hooks, &body(id, object), delivery, &[]).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{text}");
    }
    let key = |id: &str| format!("hooks:{id}");
    eventually(
        "the first event of the object and the other object's never ran together",
        async || effects(&log, &key(&updated)) == 1 && effects(&log, &key(&other)) == 1,
    )
    .await;
    // Both are inside their 800 ms: the second event of the object waits.
    let items = listed(&url, "hooks", None);
    let state = |id: &str| {
        items
            .iter()
            .find(|item| item["id"] == id)
            .map(|item| item["state"].clone())
    };
    assert_eq!(state(&created), Some("pending".into()), "{items:?}");
    assert_eq!(
        effects(&log, &key(&created)),
        0,
        "the later event ran beside the first"
    );
    assert_eq!(
        items
            .iter()
            .find(|item| item["id"] == created.as_str())
            .map(|item| item["ordering_key"].clone()),
        Some(Value::from(customer.as_str())),
        "{items:?}"
    );
    eventually("the second event of the object never ran", async || {
        effects(&log, &key(&created)) == 1
    })
    .await;
    let order: Vec<String> = std::fs::read_to_string(&log)
        .expect("effect log")
        .lines()
        .filter_map(|l| l.split(' ').next().map(str::to_string))
        .filter(|k| *k == key(&updated) || *k == key(&created))
        .collect();
    assert_eq!(order, vec![key(&updated), key(&created)]);
    eventually("the items were never all done", async || {
        listed(&url, "hooks", None).is_empty()
    })
    .await;
}
