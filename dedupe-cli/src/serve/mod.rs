//! `dedupe serve`: a webhook receiver on any store, the whole path of
//! dedupe-webhook (verify, derive the key, claim, work, complete) with a
//! business step that appends one ledger row per processed event.

mod ledger;
mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dedupe_core::Error;
use dedupe_url::Opener;
use dedupe_webhook::{Completed, KeyRule, Scheme, Verifier, Webhook, WebhookEvent};
use http::{header, StatusCode};

use ledger::Ledger;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The store, as a URL (default: a SQLite file dedupe-serve.db here).
    #[arg(long, value_name = "URL", default_value = "sqlite://dedupe-serve.db")]
    store: String,
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8471")]
    listen: SocketAddr,
    /// How long the business step takes, to widen race windows.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// A signing secret: `stripe=whsec_...`, `github=...`, `shopify=...`, or
    /// `standard=whsec_...`; a bare secret is a Standard Webhooks secret for
    /// /hooks and /hooks/{source}. Repeat a scheme for rotation.
    #[arg(long = "secret", value_name = "[SCHEME=]SECRET")]
    secrets: Vec<String>,
    /// Largest body accepted, in bytes.
    #[arg(long, default_value_t = Webhook::DEFAULT_BODY_LIMIT)]
    body_limit: usize,
    /// Replay tolerance of signed timestamps, in seconds.
    #[arg(long, default_value_t = 300)]
    tolerance_secs: u64,
    /// Serve this route without a signature check even though other routes
    /// have secrets: `hooks` (for /hooks and /hooks/standard), `stripe`,
    /// `github` or `shopify`. Without any --secret every route is unsigned.
    #[arg(long = "unsigned", value_name = "ROUTE")]
    unsigned: Vec<String>,
    /// Test hook: a request carrying this header fails in its business step
    /// (500), as a crashing handler would.
    #[arg(long, value_name = "HEADER")]
    fail_on_header: Option<String>,
}

struct App {
    ledger: Ledger,
    /// `/hooks` and `/hooks/standard`; `None` when secrets are given but none
    /// for Standard Webhooks (the route is then not served).
    generic: Option<Webhook>,
    /// `/hooks/{source}` for the other providers, likewise.
    providers: Vec<(&'static str, Option<Webhook>)>,
    work: Duration,
    fail_on: Option<http::HeaderName>,
    metrics: metrics::Metrics,
}

/// Splits the `--secret` flags by scheme; a bare secret is Standard Webhooks.
fn verifiers(args: &ServeArgs) -> Result<Vec<(Scheme, Verifier)>, Error> {
    let schemes = [
        Scheme::StandardWebhooks,
        Scheme::Stripe,
        Scheme::GitHub,
        Scheme::Shopify,
    ];
    let mut by_scheme: Vec<(Scheme, Vec<&str>)> = schemes.iter().map(|s| (*s, vec![])).collect();
    for secret in &args.secrets {
        let (scheme, value) = match secret.split_once('=') {
            Some((name, value)) if schemes.iter().any(|s| s.name() == name) => {
                (schemes.iter().find(|s| s.name() == name).copied(), value)
            }
            _ => (Some(Scheme::StandardWebhooks), secret.as_str()),
        };
        if let Some(entry) = by_scheme.iter_mut().find(|(s, _)| Some(*s) == scheme) {
            entry.1.push(value);
        }
    }
    let mut out = Vec::new();
    for (scheme, secrets) in by_scheme {
        if secrets.is_empty() {
            continue;
        }
        let verifier = Verifier::new(scheme, secrets)
            .map_err(|e| Error::config(format!("--secret: {e}")))?
            .with_tolerance(Duration::from_secs(args.tolerance_secs));
        out.push((scheme, verifier));
    }
    Ok(out)
}

pub async fn serve(args: ServeArgs) -> Result<bool, Error> {
    let url = crate::store_url(&args.store)?;
    let shown = url.to_string();
    let opener = Opener::new(url).await?;
    let (store, ledger) = Ledger::open(&opener).await?;
    let verifiers = verifiers(&args)?;
    let verifier_for = |scheme: Scheme| {
        verifiers
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, v)| v.clone())
    };
    let lease = opener.url().lease().unwrap_or(Webhook::DEFAULT_LEASE);
    let retention = opener
        .url()
        .retention()
        .unwrap_or(Webhook::DEFAULT_RETENTION);
    // With no secret at all every route is open (a local demo); once secrets
    // are given, a route whose scheme has none is not served, so no route
    // silently accepts unsigned requests.
    let open = verifiers.is_empty();
    if open {
        eprintln!("warning: no --secret given: signatures are not checked on any route");
    }
    const ROUTES: [&str; 4] = ["hooks", "stripe", "github", "shopify"];
    if let Some(bad) = args.unsigned.iter().find(|r| !ROUTES.contains(&r.as_str())) {
        return Err(Error::config(format!(
            "--unsigned {bad}: routes are {}",
            ROUTES.join(", ")
        )));
    }
    let hook = |route: &str, rule: KeyRule, scheme: Scheme| -> Option<Webhook> {
        let hook = Webhook::new(Arc::clone(&store), rule)
            .body_limit(args.body_limit)
            .lease(lease)
            .retention(retention);
        match verifier_for(scheme) {
            Some(v) => Some(hook.verifier(v)),
            None if open || args.unsigned.iter().any(|r| r == route) => Some(hook),
            None => None,
        }
    };
    let app = Arc::new(App {
        ledger,
        // One namespace for /hooks and /hooks/standard, so a signed message
        // replayed on the other route is the same key.
        generic: hook("hooks", KeyRule::generic("hooks"), Scheme::StandardWebhooks),
        providers: vec![
            ("stripe", hook("stripe", KeyRule::stripe(), Scheme::Stripe)),
            ("github", hook("github", KeyRule::github(), Scheme::GitHub)),
            (
                "shopify",
                hook("shopify", KeyRule::shopify(), Scheme::Shopify),
            ),
        ],
        work: Duration::from_millis(args.work_ms),
        fail_on: match &args.fail_on_header {
            Some(name) => Some(
                http::HeaderName::try_from(name.as_str())
                    .map_err(|e| Error::config(format!("--fail-on-header: {e}")))?,
            ),
            None => None,
        },
        metrics: metrics::Metrics::new(),
    });
    let router = Router::new()
        .route("/hooks", post(receive).get(ledger_rows))
        .route("/hooks/{source}", post(receive_from))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&app),
            measure,
        ))
        .with_state(Arc::clone(&app));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::config(format!("--listen {}: {e}", args.listen)))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::unavailable("listener address", Some(Box::new(e))))?;
    // The first line of output: tests and scripts read the address from it.
    println!("listening on http://{local} (store {shown})");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(|e| Error::unavailable("server", Some(Box::new(e))))?;
    eprintln!("stopped: in-flight requests finished or released their claims");
    Ok(true)
}

/// Ctrl-C or SIGTERM: stop accepting, let in-flight requests finish.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

fn not_served(what: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(serde_json::json!({
            "error": "not_served",
            "message": format!("{what} is not served: unknown source, or no --secret for its scheme"),
        })),
    )
        .into_response()
}

async fn receive(State(app): State<Arc<App>>, req: Request) -> Response {
    let a = Arc::clone(&app);
    match &app.generic {
        Some(hook) => hook.handle(req, move |req| business_step(a, req)).await,
        None => not_served("/hooks"),
    }
}

async fn receive_from(
    State(app): State<Arc<App>>,
    Path(source): Path<String>,
    req: Request,
) -> Response {
    let a = Arc::clone(&app);
    let hook = if source == "standard" {
        app.generic.as_ref()
    } else {
        app.providers
            .iter()
            .find(|(name, _)| *name == source)
            .and_then(|(_, hook)| hook.as_ref())
    };
    match hook {
        Some(hook) => hook.handle(req, move |req| business_step(a, req)).await,
        None => not_served(&format!("/hooks/{source}")),
    }
}

/// The business step: wait `--work-ms`, then append the ledger row and
/// complete the claim together; answer what a provider expects.
async fn business_step(app: Arc<App>, req: Request<Body>) -> Response {
    let Some(event) = req.extensions().get::<WebhookEvent>().cloned() else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "no claimed event").into_response();
    };
    if !app.work.is_zero() {
        tokio::time::sleep(app.work).await;
    }
    if let Some(name) = &app.fail_on {
        if req.headers().contains_key(name) {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(serde_json::json!({"error": "business step failed", "key": event.key.to_string()})),
            )
                .into_response();
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
    match app.ledger.record(&event, &outcome).await {
        Ok(()) => (
            Completed,
            [(header::CONTENT_TYPE, "application/json")],
            bytes,
        )
            .into_response(),
        Err(e) => {
            // Nothing committed: the receiver releases the claim, and the
            // provider's retry processes the event.
            tracing::warn!(key = %event.key, error = %e, "ledger write and completion failed");
            let status = if e.is_retryable() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            let mut response = (
                status,
                Json(serde_json::json!({"error": "not recorded", "message": e.to_string()})),
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

async fn ledger_rows(State(app): State<Arc<App>>) -> Response {
    match app.ledger.rows().await {
        Ok(rows) => Json(serde_json::json!({"rows": rows.len(), "ledger": rows})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            Json(serde_json::json!({"error": "ledger unavailable", "message": e.to_string()})),
        )
            .into_response(),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

/// Counts every webhook answer and its latency.
async fn measure(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let response = next.run(req).await;
    if let Some(answer) = response.extensions().get::<dedupe_webhook::Answer>() {
        app.metrics.observe(*answer, started.elapsed());
    }
    response
}
