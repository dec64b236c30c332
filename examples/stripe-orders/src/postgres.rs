//! On Postgres: the order and the completion in one transaction.

// readme-begin
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{routing::post, Json, Router};
use dedupe_core::Deduper;
use dedupe_postgres::{sqlx, PgStore};
use dedupe_webhook::{KeyRule, Scheme, Verifier, Webhook, WebhookEvent};

/// The receiver: Stripe's signature checked, the event id claimed, then the handler.
pub fn router(store: PgStore, secret: &str) -> Result<Router, Box<dyn std::error::Error>> {
    let deduper = Deduper::new(store.clone()); // lease, heartbeat, 10-minute bound, 35-day retention
    let stripe = Webhook::new(deduper, KeyRule::stripe("stripe"))
        .verifier(Verifier::new(Scheme::Stripe, [secret])?);
    Ok(Router::new()
        .route(
            "/hooks/stripe",
            post(payment_succeeded).route_layer(stripe.layer()),
        )
        .with_state(store))
}

/// Runs once per Stripe event id; a retry or a concurrent copy gets this answer again.
async fn payment_succeeded(
    State(store): State<PgStore>,
    event: WebhookEvent,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let amount = body["data"]["object"]["amount"].as_i64().unwrap_or(0);
    match record_order(&store, &event, amount).await {
        Ok(answer) => {
            event.completed(); // committed with the order: the receiver settles nothing more
            let json = [(header::CONTENT_TYPE, "application/json")];
            (StatusCode::OK, json, answer).into_response()
        }
        Err(e) => {
            // Nothing committed: the claim is released, and Stripe's retry runs this again.
            tracing::warn!(error = %e, "order not recorded");
            let status = match e.is_retryable() {
                true => StatusCode::SERVICE_UNAVAILABLE,
                false => StatusCode::INTERNAL_SERVER_ERROR,
            };
            (status, "not recorded; retry").into_response()
        }
    }
}

/// The order row and the event's completion commit together, or neither does.
async fn record_order(
    store: &PgStore,
    event: &WebhookEvent,
    amount: i64,
) -> dedupe_core::Result<Vec<u8>> {
    // The cause in the message, so the log says what failed.
    let db = |e: sqlx::Error| {
        dedupe_core::Error::retryable(format!("orders: {e}"), Some(Box::new(e) as _))
    };
    let mut tx = store.pool().begin().await.map_err(db)?;
    let order: i64 = sqlx::query_scalar(
        "INSERT INTO orders (event_id, amount_cents) VALUES ($1, $2) RETURNING id",
    )
    .bind(event.key.id())
    .bind(amount)
    .fetch_one(&mut *tx)
    .await
    .map_err(db)?;
    let answer = serde_json::json!({ "order": order })
        .to_string()
        .into_bytes();
    let outcome = WebhookEvent::outcome_for(StatusCode::OK, Some("application/json"), &answer);
    store
        .complete_in(&mut tx, &event.lease, &outcome, event.retention)
        .await?;
    tx.commit().await.map_err(db)?;
    Ok(answer)
}
// readme-end

/// Makes the store's table and the orders table, if missing.
pub async fn setup(store: &PgStore) -> dedupe_core::Result<()> {
    store.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (
             id bigserial PRIMARY KEY,
             event_id text NOT NULL,
             amount_cents bigint NOT NULL
         )",
    )
    .execute(store.pool())
    .await
    .map_err(|e| dedupe_core::Error::fatal("creating the orders table", Some(Box::new(e) as _)))?;
    Ok(())
}

/// How many orders `event_id` has.
pub async fn orders(store: &PgStore, event_id: &str) -> dedupe_core::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(store.pool())
        .await
        .map_err(|e| dedupe_core::Error::retryable("counting orders", Some(Box::new(e) as _)))
}
