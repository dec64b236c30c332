//! The layer behind a real HTTP server (axum on a loopback port) and a real
//! client: the seeds' opening case (the handler is slower than the sender's
//! timeout), Svix senders, re-rendered resends, GitHub hooks sharing a
//! delivery GUID, form-encoded and 10 MB GitHub bodies, the handler time
//! bound, the concurrency limit, a panicking handler and shutdown. Every check
//! counts the handler's runs (a side effect the test owns, bumped at the
//! handler's start), not only status codes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use dedupe_core::{DedupeStore, Deduper, MemoryStore};
use dedupe_webhook::{KeyRule, Scheme, Verifier, Webhook, WebhookEvent};
use reqwest::StatusCode;

#[derive(Clone, Default)]
struct Effects {
    runs: Arc<AtomicUsize>,
    work_ms: Arc<AtomicUsize>,
}

async fn handler(State(effects): State<Effects>, event: WebhookEvent) -> Response {
    let run = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let work = effects.work_ms.load(Ordering::SeqCst) as u64;
    tokio::time::sleep(Duration::from_millis(work)).await;
    if event.payload.starts_with(b"{\"panic\"") {
        panic!("handler bug");
    }
    let json: serde_json::Value = serde_json::from_slice(&event.payload).unwrap_or_default();
    Json(serde_json::json!({
        "key": event.key.to_string(),
        "delivery": event.delivery_id,
        "run": run,
        "payload_type": json["type"],
    }))
    .into_response()
}

struct Server {
    base: String,
    effects: Effects,
    hook: Webhook,
}

async fn serve(hook: Webhook) -> Server {
    let effects = Effects::default();
    let app = Router::new()
        .route(
            "/hooks",
            axum::routing::post(handler).route_layer(hook.clone().layer()),
        )
        .with_state(effects.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server {
        base,
        effects,
        hook,
    }
}

fn store() -> Arc<dyn DedupeStore> {
    Arc::new(MemoryStore::new())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

async fn post(
    client: &reqwest::Client,
    server: &Server,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, String)],
) -> Result<(StatusCode, reqwest::header::HeaderMap, String), reqwest::Error> {
    let mut req = client
        .post(format!("{}/hooks", server.base))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let response = req.send().await?;
    let status = response.status();
    let headers = response.headers().clone();
    Ok((status, headers, response.text().await?))
}

async fn ok(
    client: &reqwest::Client,
    server: &Server,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, String)],
) -> (StatusCode, reqwest::header::HeaderMap, String) {
    post(client, server, body, headers).await.expect("POST")
}

/// The seeds' opening case: processing takes longer than the sender waits. A
/// 2.5 s handler, a client that gives up after 1 s, a retry 0.2 s later: the
/// retry is told the event is in flight (409), not run again; a retry after
/// the handler finished replays the first delivery's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_gives_up_mid_handler_does_not_get_the_work_run_twice() {
    let server = serve(Webhook::new(
        Deduper::new(store()),
        KeyRule::body_id("hooks"),
    ))
    .await;
    server.effects.work_ms.store(2500, Ordering::SeqCst);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("client");
    let body = r#"{"id":"evt_abc123","type":"payment.succeeded"}"#;
    let gave_up = post(
        &impatient,
        &server,
        body,
        &[("x-delivery-id", "del_1".into())],
    )
    .await;
    assert!(
        gave_up.is_err_and(|e| e.is_timeout()),
        "the client did not give up"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = reqwest::Client::new();
    let (status, headers, text) =
        ok(&client, &server, body, &[("x-delivery-id", "del_2".into())]).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the retry was processed again: {text}"
    );
    assert!(headers.contains_key("retry-after"));
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let (status, headers, text) =
        ok(&client, &server, body, &[("x-delivery-id", "del_3".into())]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(headers["idempotent-replayed"], "true");
    let replayed: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        replayed["delivery"], "del_1",
        "not the first delivery's response: {text}"
    );
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 1);
}

/// Svix's header names on a Standard Webhooks secret: accepted, and keyed by
/// the signed `svix-id`; an unsigned `webhook-id` beside it does not choose
/// the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn svix_senders_are_accepted_and_keyed_by_the_signed_id() {
    let verifier =
        Verifier::new(Scheme::StandardWebhooks, ["whsec_c3ZpeC10ZXN0LWtleQ=="]).expect("secret");
    let server = serve(
        Webhook::new(
            Deduper::new(store()),
            KeyRule::standard_webhooks("svix-app"),
        )
        .verifier(verifier.clone()),
    )
    .await;
    let client = reqwest::Client::new();
    let svix = |id: &str, body: &str, extra: Option<(&'static str, &str)>| {
        let mut headers: Vec<(&'static str, String)> = verifier
            .sign(id, now(), body.as_bytes())
            .into_iter()
            .map(|(k, v)| {
                let name = match k {
                    "webhook-id" => "svix-id",
                    "webhook-timestamp" => "svix-timestamp",
                    _ => "svix-signature",
                };
                (name, v)
            })
            .collect();
        if let Some((k, v)) = extra {
            headers.push((k, v.to_string()));
        }
        headers
    };
    let body = r#"{"type":"invoice.paid","data":{"n":1}}"#;
    let (status, _, text) = ok(&client, &server, body, &svix("msg_1", body, None)).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let first: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(first["key"], "svix-app:msg_1");
    // A resend of msg_1 with a forged webhook-id header beside the signed set:
    // still msg_1, a replay.
    let (status, headers, _) = ok(
        &client,
        &server,
        body,
        &svix("msg_1", body, Some(("webhook-id", "msg_other"))),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    // Unsigned: refused.
    let (status, _, _) = ok(&client, &server, body, &[("svix-id", "msg_2".into())]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 1);
}

/// A signed resend whose body was re-rendered (an attempt counter, a live
/// field) is a duplicate, not a 422: the stored response is replayed. On an
/// unsigned route the same is a 422. With pointers as the fingerprint, the
/// re-render is not even a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_resend_with_a_re_rendered_body_is_a_duplicate() {
    let verifier = Verifier::new(Scheme::Stripe, ["whsec_rerender"]).expect("secret");
    let server = serve(
        Webhook::new(Deduper::new(store()), KeyRule::stripe("billing")).verifier(verifier.clone()),
    )
    .await;
    let client = reqwest::Client::new();
    let first = r#"{"id":"evt_1","type":"charge.succeeded","pending_webhooks":2}"#;
    let resend = r#"{"id":"evt_1","type":"charge.succeeded","pending_webhooks":1}"#;
    let sign = |body: &str| verifier.sign("", now(), body.as_bytes());
    let (status, _, original) = ok(&client, &server, first, &sign(first)).await;
    assert_eq!(status, StatusCode::OK);
    let (status, headers, replayed) = ok(&client, &server, resend, &sign(resend)).await;
    assert_eq!(status, StatusCode::OK, "{replayed}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, original);
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 1);

    let unsigned = serve(Webhook::new(
        Deduper::new(store()),
        KeyRule::stripe("billing"),
    ))
    .await;
    assert_eq!(ok(&client, &unsigned, first, &[]).await.0, StatusCode::OK);
    assert_eq!(
        ok(&client, &unsigned, resend, &[]).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let pointers = serve(Webhook::new(
        Deduper::new(store()),
        KeyRule::stripe("billing").fingerprint(dedupe_webhook::PayloadFingerprint::JsonPointers(
            vec!["/type".into(), "/data".into()],
        )),
    ))
    .await;
    assert_eq!(ok(&client, &pointers, first, &[]).await.0, StatusCode::OK);
    let (status, headers, _) = ok(&client, &pointers, resend, &[]).await;
    assert_eq!(
        (status, headers.contains_key("idempotent-replayed")),
        (StatusCode::OK, true)
    );
    let changed = r#"{"id":"evt_1","type":"charge.refunded"}"#;
    assert_eq!(
        ok(&client, &pointers, changed, &[]).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
}

/// GitHub: two hooks receive one event under one delivery GUID (different
/// payloads): both run. A redelivery to one of them is a replay. A
/// form-encoded delivery is accepted (the handler gets the JSON), and a 10 MB
/// body is within GitHub's default limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_hooks_sharing_a_guid_form_bodies_and_big_bodies() {
    let verifier = Verifier::new(Scheme::GitHub, ["gh-secret"]).expect("secret");
    let server = serve(
        Webhook::new(Deduper::new(store()), KeyRule::github("repo-events"))
            .verifier(verifier.clone()),
    )
    .await;
    let client = reqwest::Client::new();
    let gh = |hook: &str, guid: &str, body: &[u8]| {
        let mut h = verifier.sign("", 0, body);
        h.push(("x-github-hook-id", hook.to_string()));
        h.push(("x-github-delivery", guid.to_string()));
        h
    };
    let a = r#"{"action":"opened","hook":"a"}"#;
    let b = r#"{"action":"opened","hook":"b"}"#;
    let guid = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    assert_eq!(
        ok(&client, &server, a, &gh("1001", guid, a.as_bytes()))
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        ok(&client, &server, b, &gh("1002", guid, b.as_bytes()))
            .await
            .0,
        StatusCode::OK
    );
    let (status, headers, _) = ok(&client, &server, a, &gh("1001", guid, a.as_bytes())).await;
    assert_eq!(
        (status, headers.contains_key("idempotent-replayed")),
        (StatusCode::OK, true)
    );
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 2);

    // Form-encoded: `payload=<url-encoded JSON>`, signed over the raw form.
    let json = r#"{"type":"push","ref":"refs/heads/main"}"#;
    let form: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("payload", json)
        .finish();
    let mut headers = gh("1001", "form-guid", form.as_bytes());
    headers.push(("content-type", "application/x-www-form-urlencoded".into()));
    let response = client
        .post(format!("{}/hooks", server.base))
        .headers(to_map(&headers))
        .body(form.clone())
        .send()
        .await
        .expect("form POST");
    assert_eq!(response.status(), StatusCode::OK);
    let answered: serde_json::Value = response.json().await.expect("json");
    assert_eq!(
        answered["payload_type"], "push",
        "the handler did not get the JSON payload"
    );
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 3);

    // 10 MB: GitHub sends up to 25 MB and never retries a 413.
    let big = format!(
        r#"{{"action":"big","pad":"{}"}}"#,
        "x".repeat(10 * 1024 * 1024)
    );
    let (status, _, text) = ok(
        &client,
        &server,
        big.clone(),
        &gh("1001", "big-guid", big.as_bytes()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", &text[..text.len().min(300)]);
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 4);
    assert_eq!(server.hook.body_limit_bytes(), 25 * 1024 * 1024);
}

fn to_map(headers: &[(&str, String)]) -> reqwest::header::HeaderMap {
    let mut map = reqwest::header::HeaderMap::new();
    for (k, v) in headers {
        map.insert(
            reqwest::header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
            v.parse().expect("value"),
        );
    }
    map
}

/// A handler past the deduper's `max_work_time` is aborted and its claim released (503,
/// the retry runs it); past `max_concurrency` a delivery gets 503 before
/// anything is claimed; a panicking handler releases its claim (500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_bound_concurrency_limit_and_panics() {
    let server = serve(
        Webhook::new(
            Deduper::new(store()).with_max_work_time(Duration::from_millis(300)),
            KeyRule::body_id("hooks"),
        )
        .max_concurrency(1),
    )
    .await;
    let client = reqwest::Client::new();
    server.effects.work_ms.store(1000, Ordering::SeqCst);
    let slow = r#"{"id":"evt_slow"}"#;
    let first = {
        let (client, base) = (client.clone(), server.base.clone());
        tokio::spawn(async move {
            client
                .post(format!("{base}/hooks"))
                .body(slow)
                .send()
                .await
                .expect("POST")
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, headers, _) = ok(&client, &server, r#"{"id":"evt_other"}"#, &[]).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "past the concurrency limit"
    );
    assert!(headers.contains_key("retry-after"));
    let first = first.await.expect("join");
    assert_eq!(
        first.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "past the time bound"
    );
    assert!(first.headers().contains_key("retry-after"));
    server.effects.work_ms.store(0, Ordering::SeqCst);
    let (status, headers, _) = ok(&client, &server, slow, &[]).await;
    assert_eq!(
        (status, headers.contains_key("idempotent-replayed")),
        (StatusCode::OK, false)
    );
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 2);

    let panics = r#"{"panic":true,"id":"evt_panic"}"#;
    assert_eq!(
        ok(&client, &server, panics, &[]).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        ok(&client, &server, panics, &[]).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        server.effects.runs.load(Ordering::SeqCst),
        4,
        "the panicked claim was kept"
    );
}

/// Shutdown drains a running handler (its response goes out, its outcome is
/// stored), and refuses new deliveries with 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_running_handlers() {
    let shared = store();
    let server = serve(Webhook::new(
        Deduper::new(Arc::clone(&shared)),
        KeyRule::body_id("hooks"),
    ))
    .await;
    server.effects.work_ms.store(500, Ordering::SeqCst);
    let client = reqwest::Client::new();
    let body = r#"{"id":"evt_draining"}"#;
    let running = {
        let (client, base) = (client.clone(), server.base.clone());
        tokio::spawn(async move {
            client
                .post(format!("{base}/hooks"))
                .body(body)
                .send()
                .await
                .expect("POST")
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let drained = server.hook.shutdown(Duration::from_secs(5)).await;
    assert_eq!((drained.running, drained.aborted), (1, 0));
    assert_eq!(running.await.expect("join"), StatusCode::OK);
    let (status, _, _) = ok(&client, &server, r#"{"id":"evt_late"}"#, &[]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let key = dedupe_core::Key::new("hooks", "evt_draining").expect("key");
    let record = shared.get(&key).await.expect("get").expect("record");
    assert!(matches!(
        record.state,
        dedupe_core::RecordState::Done { .. }
    ));
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 1);
}

/// A signed JSON body relabelled as a form (the content type is not signed)
/// cannot be reread as a payload of the sender's text: on Stripe's rule the
/// content type is ignored, on GitHub's the body must be exactly one
/// `payload` field. And a GitHub key comes from unsigned headers, so a
/// mismatch there is refused, not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relabelled_signed_body_is_never_mined_for_a_payload() {
    let client = reqwest::Client::new();
    let evil = form_urlencoded::byte_serialize(br#"{"id":"evt_evil","type":"charge.succeeded"}"#)
        .collect::<String>();
    let body =
        format!(r#"{{"id":"evt_real","type":"customer.updated","note":"x&payload={evil}&y"}}"#);

    let stripe = Verifier::new(Scheme::Stripe, ["whsec_relabel"]).expect("secret");
    let server = serve(
        Webhook::new(Deduper::new(store()), KeyRule::stripe("billing")).verifier(stripe.clone()),
    )
    .await;
    let mut headers = stripe.sign("", now(), body.as_bytes());
    headers.push(("content-type", "application/x-www-form-urlencoded".into()));
    let response = client
        .post(format!("{}/hooks", server.base))
        .headers(to_map(&headers))
        .body(body.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), StatusCode::OK);
    let answered: serde_json::Value = response.json().await.expect("json");
    assert_eq!(
        answered["key"], "billing:evt_real",
        "the key came from text inside the body"
    );
    assert_eq!(answered["payload_type"], "customer.updated");

    let github = Verifier::new(Scheme::GitHub, ["gh-relabel"]).expect("secret");
    let server = serve(
        Webhook::new(Deduper::new(store()), KeyRule::github("repo")).verifier(github.clone()),
    )
    .await;
    let mut headers = github.sign("", 0, body.as_bytes());
    headers.push(("x-github-hook-id", "7".into()));
    headers.push(("x-github-delivery", "g-1".into()));
    let mut relabelled = headers.clone();
    relabelled.push(("content-type", "application/x-www-form-urlencoded".into()));
    let response = client
        .post(format!("{}/hooks", server.base))
        .headers(to_map(&relabelled))
        .body(body.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.effects.runs.load(Ordering::SeqCst), 0);

    // The real delivery, then an old signed body under the same (unsigned)
    // hook id and delivery: refused, not answered as a duplicate.
    assert_eq!(
        ok(&client, &server, body.clone(), &headers).await.0,
        StatusCode::OK
    );
    let other = r#"{"action":"closed"}"#;
    let mut replayed = github.sign("", 0, other.as_bytes());
    replayed.push(("x-github-hook-id", "7".into()));
    replayed.push(("x-github-delivery", "g-1".into()));
    assert_eq!(
        ok(&client, &server, other, &replayed).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
}
