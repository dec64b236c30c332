//! What the front doors cost: requests per second through dedupe-http's
//! `Idempotency` layer and through the webhook receiver, against the same
//! handler without either, over real HTTP on loopback, in one run.
//!
//! ```text
//! cargo run --release -p dedupe-webhook --example front_doors_bench -- \
//!     --store sqlite:///tmp/bench.db --store redis://127.0.0.1:6379 \
//!     --connections 1,16,64 --duration 3s
//! ```
//!
//! Every request carries a new key (the costly path: a claim, the handler, a
//! completion with the response); a `replay` row sends one key again and
//! again (a claim answered with the stored response). The handler answers a
//! small JSON 201 at once, so the figures are the layer's and the store's
//! cost, not the handler's. Client and server share the machine.
//!
//! The same through dedupe-webhook's receiver (`webhook` columns): the key
//! is the body's `id` (`KeyRule::body_id`, no signature), and from the claim
//! on the delivery runs on the same engine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use dedupe_core::Deduper;
use dedupe_http::{Idempotency, KeyPolicy};
use dedupe_webhook::{KeyRule, Webhook};
use serde_json::json;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Bare,
    NewKeys,
    Replay,
}

async fn create(Json(body): Json<serde_json::Value>) -> impl IntoResponse {
    (
        StatusCode::CREATED,
        Json(json!({ "id": 1, "item": body["item"] })),
    )
}

async fn listen(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}/orders", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// Requests per second and the p99 in microseconds. `by_body`: the key goes
/// in the body's `id` (the webhook receiver's), else in the header.
async fn drive(
    url: &str,
    mode: Mode,
    connections: usize,
    duration: Duration,
    by_body: bool,
) -> (f64, u64) {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::SeqCst);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()
        .expect("client");
    if mode == Mode::Replay {
        // The key's first request, so that every timed one is a replay.
        let key = format!("replay-{run}");
        let first = client
            .post(url)
            .header("idempotency-key", &key)
            .json(&json!({ "item": "book", "id": key }))
            .send()
            .await
            .expect("request");
        assert_eq!(first.status(), StatusCode::CREATED);
    }
    let stop = Instant::now() + duration;
    let tasks: Vec<_> = (0..connections)
        .map(|task| {
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0u64;
                while Instant::now() < stop {
                    let key = match mode {
                        Mode::Replay => format!("replay-{run}"),
                        _ => format!("k-{run}-{task}-{n}"),
                    };
                    n += 1;
                    let started = Instant::now();
                    let mut req = client
                        .post(&url)
                        .json(&json!({ "item": "book", "id": key }));
                    if mode != Mode::Bare && !by_body {
                        req = req.header("idempotency-key", key);
                    }
                    let response = req.send().await.expect("request");
                    assert_eq!(response.status(), StatusCode::CREATED);
                    response.bytes().await.expect("body");
                    latencies.push(started.elapsed().as_micros() as u64);
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("task"));
    }
    all.sort_unstable();
    let p99 = all.get(all.len() * 99 / 100).copied().unwrap_or(0);
    (all.len() as f64 / duration.as_secs_f64(), p99)
}

fn parse_duration(s: &str) -> Duration {
    if let Some(ms) = s.strip_suffix("ms") {
        Duration::from_millis(ms.parse().expect("--duration"))
    } else {
        Duration::from_secs_f64(s.trim_end_matches('s').parse().expect("--duration"))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut stores = Vec::new();
    let mut connections = vec![1, 16, 64];
    let mut duration = Duration::from_secs(3);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--store" => stores.push(args.next().ok_or("--store takes a URL")?),
            "--connections" => {
                connections = args
                    .next()
                    .ok_or("--connections takes a list")?
                    .split(',')
                    .map(|n| n.parse())
                    .collect::<Result<_, _>>()?
            }
            "--duration" => duration = parse_duration(&args.next().ok_or("--duration")?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if stores.is_empty() {
        stores.push("memory:".into());
    }
    let bare = listen(Router::new().route("/orders", post(create))).await;
    println!("| store | connections | bare req/s | new keys req/s (÷ bare) | replays req/s (÷ bare) | webhook new (÷ bare) | webhook replays (÷ bare) | p99 µs bare / new / replay / webhook new / webhook replay |");
    println!("|---|---|---|---|---|---|---|---|");
    for url in &stores {
        let store = dedupe_url::open_store(url).await?;
        let layer = Idempotency::single_caller(Deduper::new(store.clone()))
            .namespace("bench")
            .policy(|_| KeyPolicy::Required)
            .layer();
        let guarded = listen(Router::new().route("/orders", post(create)).layer(layer)).await;
        let hook = Webhook::new(Deduper::new(store), KeyRule::body_id("hooks"));
        let received =
            listen(Router::new().route("/orders", post(create).route_layer(hook.layer()))).await;
        let shown = url.split('?').next().unwrap_or(url);
        for &n in &connections {
            // A short warm-up: connections opened, caches filled.
            drive(
                &guarded,
                Mode::NewKeys,
                n,
                Duration::from_millis(300),
                false,
            )
            .await;
            drive(
                &received,
                Mode::NewKeys,
                n,
                Duration::from_millis(300),
                true,
            )
            .await;
            let (b, bp) = drive(&bare, Mode::Bare, n, duration, false).await;
            let (k, kp) = drive(&guarded, Mode::NewKeys, n, duration, false).await;
            let (r, rp) = drive(&guarded, Mode::Replay, n, duration, false).await;
            let (wk, wkp) = drive(&received, Mode::NewKeys, n, duration, true).await;
            let (wr, wrp) = drive(&received, Mode::Replay, n, duration, true).await;
            println!(
                "| {shown} | {n} | {b:.0} | {k:.0} ({:.2}) | {r:.0} ({:.2}) | {wk:.0} ({:.2}) | {wr:.0} ({:.2}) | {bp} / {kp} / {rp} / {wkp} / {wrp} |",
                k / b,
                r / b,
                wk / b,
                wr / b
            );
        }
    }
    Ok(())
}
