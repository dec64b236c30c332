//! The public listener: deliveries, the health check, and (a local demo
//! without secrets) the ledger and the metrics; the admin listener is
//! `admin/`.

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dedupe_core::Error;
use http::{header, StatusCode};

use super::app::{business_step, App};

/// The public listener's routes: deliveries, the health check, and while
/// every route is `open` (no secret: a local demo) the ledger and metrics.
pub(super) fn public(app: &Arc<App>, open: bool) -> Router {
    let mut public = Router::new()
        .route("/hooks", post(receive))
        .route("/hooks/{route}", post(receive_on))
        .route("/healthz", get(healthz));
    if open {
        public = public
            .route("/hooks", get(ledger_rows))
            .route("/metrics", get(metrics_text));
    }
    public
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(app),
            traced,
        ))
        .with_state(Arc::clone(app))
}

/// Each delivery in its accept span, the child of the sender's
/// `traceparent`, which the stored delivery then carries (`trace.rs`).
async fn traced(
    State(app): State<Arc<App>>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    use tracing::Instrument;
    let route = match req.uri().path() {
        _ if req.method() != http::Method::POST => return next.run(req).await,
        "/hooks" => "hooks",
        path => match path.strip_prefix("/hooks/") {
            Some(route) => route,
            None => return next.run(req).await,
        },
    }
    .to_string();
    // A served route's name, never whatever a sender put in the path.
    let route = if app.routes.contains_key(&route) {
        route
    } else {
        "unknown".to_string()
    };
    let span = crate::trace::accept_span(req.headers_mut(), &route);
    next.run(req).instrument(span).await
}

fn not_served(what: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(serde_json::json!({
            "error": "not_served",
            "message": format!("{what} is not served: unknown route, or no secret for it"),
        })),
    )
        .into_response()
}

async fn receive(State(app): State<Arc<App>>, req: Request) -> Response {
    route(app, "hooks", req).await
}

async fn receive_on(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    route(app, &name, req).await
}

async fn route(app: Arc<App>, name: &str, req: Request) -> Response {
    match app.routes.get(name) {
        Some(Some(hook)) => {
            let a = Arc::clone(&app);
            hook.handle(req, move |req| business_step(a, req)).await
        }
        _ if name == "hooks" => not_served("/hooks"),
        _ => not_served(&format!("/hooks/{name}")),
    }
}

#[derive(serde::Deserialize)]
struct Page {
    limit: Option<usize>,
    after: Option<String>,
}

/// A page of the ledger, oldest first: `?limit=` rows (default 1000, at most
/// 10000) after the cursor `?after=` (a row's `seq`); `next` is the cursor of
/// the following page, `null` on the last.
async fn ledger_rows(State(app): State<Arc<App>>, Query(page): Query<Page>) -> Response {
    ledger_page(&app, page.limit, page.after).await
}

/// A page of the ledger (as `GET /hooks` and the admin API answer it).
pub(crate) async fn ledger_page(
    app: &App,
    limit: Option<usize>,
    after: Option<String>,
) -> Response {
    let limit = limit.unwrap_or(1000).clamp(1, 10_000);
    match app.ledger.page(after.as_deref(), limit).await {
        Ok((rows, next)) => {
            Json(serde_json::json!({"rows": rows.len(), "ledger": rows, "next": next}))
                .into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "ledger read failed");
            let status = if matches!(e, Error::InvalidConfig { .. }) {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (
                status,
                [(header::RETRY_AFTER, "1")],
                Json(serde_json::json!({"error": "ledger unavailable", "message": "the ledger could not be read"})),
            )
                .into_response()
        }
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    metrics_page(&app)
}

/// The metrics in Prometheus's text format.
pub(crate) fn metrics_page(app: &App) -> Response {
    app.metrics.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}
