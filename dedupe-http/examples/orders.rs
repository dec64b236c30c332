//! An orders API behind `Idempotency-Key`:
//!
//! ```text
//! cargo run -p dedupe-http --example orders -- --store sqlite:///tmp/orders.db --listen 127.0.0.1:3000
//! curl -i -X POST localhost:3000/orders -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: 7f8e' -H 'Content-Type: application/json' -d '{"item":"book"}'
//! ```
//!
//! `POST /orders` (a JSON body) creates an order and answers 201 with its
//! id; it requires a key, scoped by the caller's bearer token. The same
//! request again answers the same 201 (`Idempotent-Replayed: true`), and
//! creates nothing. `GET /orders` answers `{"orders": [...]}`. `--store`
//! takes any dedupe store URL (`memory:`, `sqlite://`, `postgres://`,
//! `redis://`, `dynamodb://`).

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use dedupe_core::{DedupeStore, Deduper};
use dedupe_http::Idempotency;
use serde_json::{json, Value};

/// The orders created, in memory (the store keeps only the responses).
#[derive(Clone, Debug, Default)]
pub struct Orders(Arc<Mutex<Vec<Value>>>);

impl Orders {
    /// Every order so far.
    pub fn all(&self) -> Vec<Value> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The caller, from `Authorization: Bearer <token>`.
fn caller(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::to_string)
}

async fn create(
    State(orders): State<Orders>,
    headers: HeaderMap,
    Json(order): Json<Value>,
) -> Response {
    let mut all = orders.0.lock().unwrap_or_else(|e| e.into_inner());
    let id = format!("ord_{}", all.len() + 1);
    all.push(json!({ "id": id, "owner": caller(&headers), "order": order }));
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        Json(json!({ "id": id })),
    )
        .into_response()
}

async fn list(State(orders): State<Orders>) -> Json<Value> {
    Json(json!({ "orders": orders.all() }))
}

/// The app over `store`, and its orders.
pub fn app(store: Arc<dyn DedupeStore>) -> (Router, Orders) {
    let orders = Orders::default();
    // A key required on POST (the default), keys per caller.
    let idempotency =
        Idempotency::scoped(Deduper::new(store), |req| caller(&req.headers)).namespace("orders");
    let router = Router::new()
        .route("/orders", get(list).post(create))
        .layer(idempotency.layer())
        .with_state(orders.clone());
    (router, orders)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut store = "memory:".to_string();
    let mut listen = "127.0.0.1:3000".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--store" => store = args.next().ok_or("--store takes a URL")?,
            "--listen" => listen = args.next().ok_or("--listen takes an address")?,
            other => {
                return Err(
                    format!("unknown argument {other:?} (--store URL, --listen ADDR)").into(),
                )
            }
        }
    }
    let (router, _) = app(dedupe_url::open_store(&store).await?);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}
