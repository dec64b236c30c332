//! On SQLite: the same receiver, the order and the completion in one
//! `BEGIN IMMEDIATE` transaction on a connection of the handler's own (a
//! blocking task: rusqlite is synchronous).

use std::path::Path;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Json, Router};
use dedupe_core::Deduper;
use dedupe_sqlite::rusqlite::{self, TransactionBehavior};
use dedupe_sqlite::SqliteStore;
use dedupe_webhook::{KeyRule, Scheme, Verifier, Webhook, WebhookEvent};

/// The receiver: Stripe's signature checked, the event id claimed, then the
/// handler.
pub fn router(store: SqliteStore, secret: &str) -> Result<Router, Box<dyn std::error::Error>> {
    let deduper = Deduper::new(store.clone());
    let stripe = Webhook::new(deduper, KeyRule::stripe("stripe"))
        .verifier(Verifier::new(Scheme::Stripe, [secret])?);
    Ok(Router::new()
        .route(
            "/hooks/stripe",
            post(payment_succeeded).route_layer(stripe.layer()),
        )
        .with_state(store))
}

async fn payment_succeeded(
    State(store): State<SqliteStore>,
    event: WebhookEvent,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let amount = body["data"]["object"]["amount"].as_i64().unwrap_or(0);
    let (for_task, claimed) = (store.clone(), event.clone());
    let recorded =
        tokio::task::spawn_blocking(move || record_order(&for_task, &claimed, amount)).await;
    match recorded {
        Ok(Ok(answer)) => {
            event.completed();
            let json = [(header::CONTENT_TYPE, "application/json")];
            (StatusCode::OK, json, answer).into_response()
        }
        Ok(Err(e)) => not_recorded(e.is_retryable(), e),
        Err(e) => not_recorded(false, e),
    }
}

/// The order row and the event's completion commit together, or neither does.
fn record_order(
    store: &SqliteStore,
    event: &WebhookEvent,
    amount: i64,
) -> dedupe_core::Result<Vec<u8>> {
    let db = |e: rusqlite::Error| {
        dedupe_core::Error::retryable(format!("orders: {e}"), Some(Box::new(e) as _))
    };
    let mut conn = connection(store.path()).map_err(db)?;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db)?;
    let order: i64 = tx
        .query_row(
            "INSERT INTO orders (event_id, amount_cents) VALUES (?1, ?2) RETURNING id",
            (event.key.id(), amount),
            |row| row.get(0),
        )
        .map_err(db)?;
    let answer = serde_json::json!({ "order": order })
        .to_string()
        .into_bytes();
    let outcome = WebhookEvent::outcome_for(StatusCode::OK, Some("application/json"), &answer);
    store.complete_in(&tx, &event.lease, &outcome, event.retention)?;
    tx.commit().map_err(db)?;
    Ok(answer)
}

/// Nothing committed: the claim is released, and Stripe's retry runs the
/// handler again (503 for what is down for now, 500 otherwise).
fn not_recorded(retryable: bool, error: impl std::fmt::Display) -> Response {
    tracing::warn!(%error, "order not recorded");
    let status = match retryable {
        true => StatusCode::SERVICE_UNAVAILABLE,
        false => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, "not recorded; retry").into_response()
}

fn connection(path: &Path) -> rusqlite::Result<rusqlite::Connection> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

/// Makes the orders table beside the store's, if missing.
pub async fn setup(store: &SqliteStore) -> dedupe_core::Result<()> {
    let path = store.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        connection(&path)?.execute_batch(
            "CREATE TABLE IF NOT EXISTS orders (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 event_id TEXT NOT NULL,
                 amount_cents INTEGER NOT NULL
             )",
        )
    })
    .await
    .map_err(|e| dedupe_core::Error::fatal("setup task", Some(Box::new(e) as _)))?
    .map_err(|e| dedupe_core::Error::fatal("creating the orders table", Some(Box::new(e) as _)))
}

/// How many orders `event_id` has.
pub async fn orders(store: &SqliteStore, event_id: &str) -> dedupe_core::Result<i64> {
    let (path, event_id) = (store.path().to_path_buf(), event_id.to_string());
    tokio::task::spawn_blocking(move || {
        connection(&path)?.query_row(
            "SELECT count(*) FROM orders WHERE event_id = ?1",
            [event_id],
            |row| row.get(0),
        )
    })
    .await
    .map_err(|e| dedupe_core::Error::fatal("count task", Some(Box::new(e) as _)))?
    .map_err(|e| dedupe_core::Error::retryable("counting orders", Some(Box::new(e) as _)))
}
