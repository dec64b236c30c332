//! The state every route and worker shares, and the business step: the
//! effect a processed event has (a ledger row, committed with the
//! completion).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dedupe_core::{Error, Taken, WorkFailure};
use dedupe_webhook::{Webhook, WebhookEvent};
use http::{header, Request, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;

use super::ledger::Ledger;
use super::throughput::Throughput;

pub(super) struct App {
    pub(super) ledger: Ledger,
    /// Route name (`hooks`, `standard`, a provider, a --route name) to its
    /// receiver; `None` when secrets are configured but none for it (the route
    /// is then not served, so nothing unsigned gets in by a side door).
    pub(super) routes: HashMap<String, Option<Webhook>>,
    pub(super) work: Duration,
    pub(super) fail_on: Option<http::HeaderName>,
    /// The `--healed-when` file: once it exists, `fail_on` fails nothing.
    pub(super) healed_when: Option<std::path::PathBuf>,
    pub(super) effect_log: Option<std::path::PathBuf>,
    pub(super) metrics: PrometheusHandle,
    pub(super) retention: Duration,
    /// Items the workers of this process finished, per minute (the
    /// dashboard's "last minutes").
    pub(super) throughput: Arc<Throughput>,
}

/// Why the business step did not record an event.
enum StepError {
    /// The request carried `--fail-on-header` (a test hook), with its
    /// value.
    Refused(String),
    /// The ledger write and completion did not commit.
    NotRecorded(Error),
}

/// The business step: note the effect (test hook), wait `--work-ms`, then
/// append the ledger row and complete the lease together. Answers the
/// response body and the outcome stored.
async fn business(
    app: &App,
    event: &WebhookEvent,
    headers: &http::HeaderMap,
) -> Result<Vec<u8>, StepError> {
    if let Some(path) = &app.effect_log {
        let line = format!(
            "{} {}\n",
            event.key,
            event.delivery_id.as_deref().unwrap_or("-")
        );
        let path = path.clone();
        let written = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(line.as_bytes()))
        })
        .await;
        if !matches!(written, Ok(Ok(()))) {
            tracing::warn!("could not write the effect log");
        }
    }
    if !app.work.is_zero() {
        tokio::time::sleep(app.work).await;
    }
    let healed = match &app.healed_when {
        Some(path) => tokio::fs::try_exists(path).await.unwrap_or(false),
        None => false,
    };
    if let (Some(name), false) = (&app.fail_on, healed) {
        if let Some(value) = headers.get(name) {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            return Err(StepError::Refused(value));
        }
    }
    let body = serde_json::json!({
        "processed": true,
        "key": event.key.to_string(),
        "event_id": event.event_id,
        "delivery_id": event.delivery_id,
    });
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let outcome = WebhookEvent::outcome_for(StatusCode::OK, Some("application/json"), &bytes);
    match app.ledger.record(event, &outcome).await {
        Ok(()) => Ok(bytes),
        Err(e) => {
            // Nothing committed. The store's text stays in the log: it can
            // name hosts and tables.
            tracing::warn!(key = %event.key, error = %e, "ledger write and completion failed");
            Err(StepError::NotRecorded(e))
        }
    }
}

/// The business step in the request: answers what a provider expects.
pub(super) async fn business_step(app: Arc<App>, req: Request<Body>) -> Response {
    let Some(event) = WebhookEvent::of(req.extensions()) else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "no claimed event").into_response();
    };
    match business(&app, &event, req.headers()).await {
        Ok(bytes) => {
            // The ledger row and the completion committed together.
            event.completed();
            ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
        }
        Err(StepError::Refused(_)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(
                serde_json::json!({"error": "business step failed", "key": event.key.to_string()}),
            ),
        )
            .into_response(),
        Err(StepError::NotRecorded(e)) => {
            // The receiver releases the claim, and the provider's retry
            // processes the event.
            let status = if e.is_retryable() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            let mut response = (
                status,
                Json(serde_json::json!({"error": "not recorded", "message": "the event was not recorded; retry"})),
            )
                .into_response();
            if e.is_retryable() {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, http::HeaderValue::from(1));
            }
            response
        }
    }
}

/// The business step on an inbox worker: the stored delivery, run as in the
/// request. The ledger completes the item with the row; the worker's own
/// completion with the same outcome then answers Ok (asked twice, answered
/// once). A failure is the item's failure: due again after the backoff, or
/// as the `--fail-on-header` value says: `permanent` (dead now),
/// `retry-after=SECS` (due that long after) or `snooze=SECS` (due that long
/// after without spending an attempt, within `--max-snooze-secs`).
pub(super) async fn inbox_step(app: Arc<App>, taken: Taken) -> Result<Vec<u8>, WorkFailure> {
    let (event, headers) = WebhookEvent::from_item(&taken, app.retention)?;
    let span = crate::trace::process_span(
        &headers,
        taken.lease.key.namespace(),
        taken.lease.key.id(),
        taken.lease.attempt,
    );
    use tracing::Instrument;
    match business(&app, &event, &headers).instrument(span).await {
        Ok(bytes) => Ok({
            app.throughput.finished(taken.lease.key.namespace());
            WebhookEvent::outcome_for(StatusCode::OK, Some("application/json"), &bytes)
        }),
        Err(StepError::Refused(value)) => {
            let error = format!("business step failed (--fail-on-header: {value})");
            let value = value.trim();
            let secs = |prefix: &str| {
                value
                    .strip_prefix(prefix)
                    .and_then(|secs| secs.trim().parse::<u64>().ok())
                    .map(Duration::from_secs)
            };
            Err(if value == "permanent" {
                WorkFailure::permanent(error)
            } else if let Some(delay) = secs("retry-after=") {
                WorkFailure::retry_after(delay, error)
            } else if let Some(delay) = secs("snooze=") {
                WorkFailure::snooze(delay, error)
            } else {
                WorkFailure::retry(error)
            })
        }
        Err(StepError::NotRecorded(_)) => Err(WorkFailure::retry(
            "the ledger write and completion failed (see the log)",
        )),
    }
}
