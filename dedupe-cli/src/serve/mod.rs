//! `dedupe serve`: a webhook receiver on any store, the whole path of
//! dedupe-webhook (verify, derive the key, claim, work, complete) with a
//! business step that appends one ledger row per processed event.
//!
//! Two surfaces: the public listener takes deliveries (`POST /hooks`,
//! `/hooks/{route}`); the ledger (`GET /hooks`) and the metrics
//! (`GET /metrics`) are served there only while no secret is configured (a
//! local demo), and on `--admin-listen` always.

mod ledger;
mod secrets;

use std::collections::HashMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dedupe_core::{Error, InboxWorker, Retention, Taken};
use dedupe_url::Opener;
use dedupe_webhook::{KeyRule, Scheme, Webhook, WebhookEvent};
use http::{header, StatusCode};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use ledger::Ledger;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The store, as a URL (default: a SQLite file dedupe-serve.db here).
    #[arg(long, value_name = "URL", default_value = "sqlite://dedupe-serve.db")]
    store: String,
    /// Address to listen on for deliveries (port 0: any free port; the
    /// address is printed).
    #[arg(long, default_value = "127.0.0.1:8471")]
    listen: SocketAddr,
    /// Address of the admin surface: `GET /hooks` (the ledger, paginated with
    /// `?limit=&after=`), `GET /metrics` (Prometheus) and `GET /healthz`. Once
    /// any secret is configured these are served only here. Keep it private.
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<SocketAddr>,
    /// A named route: `NAME=PROVIDER` (stripe, github, shopify, standard)
    /// serves `/hooks/NAME` with that provider's key rule and signature
    /// scheme, keyed in its own namespace NAME: two routes of one provider are
    /// two consumers, and each runs its own handler for every event.
    #[arg(long = "route", value_name = "NAME=PROVIDER")]
    routes: Vec<String>,
    /// How long the business step takes, to widen race windows (in inbox
    /// mode: on the worker).
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Inbox mode: each verified delivery is stored in the store's inbox and
    /// answered 202 at once (a resend of a known event 200, nothing run); the
    /// business step runs on workers in this process, retried with a backoff
    /// and dead after --max-attempts (see `dedupe inbox`).
    #[arg(long)]
    inbox: bool,
    /// Inbox mode: items worked at once, per route.
    #[arg(long, value_name = "N", default_value_t = 8, requires = "inbox")]
    workers: usize,
    /// The lease of a claim (or, in inbox mode, of a taken item), in
    /// milliseconds, extended while the step runs (default: the URL's
    /// `lease=`, else 60 s).
    #[arg(long, value_name = "MS")]
    lease_ms: Option<u64>,
    /// Inbox mode: attempts before an item is dead.
    #[arg(long, value_name = "N", default_value_t = 8, requires = "inbox")]
    max_attempts: u32,
    /// Inbox mode: the delay after an item's first failure, in milliseconds;
    /// it doubles per attempt (jittered, at most 10 minutes).
    #[arg(long, value_name = "MS", default_value_t = 1000, requires = "inbox")]
    retry_backoff_ms: u64,
    /// A signing secret: `ROUTE=SECRET`, where ROUTE is `stripe`, `github`,
    /// `shopify`, `standard` (for /hooks and /hooks/standard) or a --route
    /// name (which otherwise takes its provider's secret); a bare secret is a
    /// Standard Webhooks one. Repeat for rotation. Visible to `ps`: prefer
    /// --secret-file or DEDUPE_SECRET_{ROUTE} variables.
    #[arg(long = "secret", value_name = "[ROUTE=]SECRET")]
    secrets: Vec<String>,
    /// A file of secrets, one `[ROUTE=]SECRET` a line (`#` starts a comment).
    /// Secrets are also read from the environment: DEDUPE_SECRET_{ROUTE}
    /// (upper case, `-` and `.` as `_`), several separated by white space.
    #[arg(long, value_name = "PATH")]
    secret_file: Vec<std::path::PathBuf>,
    /// Largest body accepted, in bytes (default: each provider's own need:
    /// GitHub 25 MB, the others 1 MiB).
    #[arg(long)]
    body_limit: Option<usize>,
    /// Replay tolerance of signed timestamps, in seconds.
    #[arg(long, default_value_t = 300)]
    tolerance_secs: u64,
    /// Serve this route without a signature check even though other routes
    /// have secrets: `hooks` (for /hooks and /hooks/standard), `stripe`,
    /// `github`, `shopify` or a --route name. Without any secret every route
    /// is unsigned.
    #[arg(long = "unsigned", value_name = "ROUTE")]
    unsigned: Vec<String>,
    /// Longest a handler may run, in seconds: past it the handler is aborted,
    /// its claim released and the delivery answered 503 (default 600).
    #[arg(long, value_name = "SECS")]
    max_handler_secs: Option<f64>,
    /// Most deliveries processed at once, all routes together; past it a
    /// delivery gets 503 with Retry-After instead of queueing (unlimited by
    /// default).
    #[arg(long, value_name = "N")]
    max_concurrency: Option<usize>,
    /// On SIGTERM or Ctrl-C: how long running handlers may take to finish
    /// before they are aborted and their claims released.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    shutdown_grace_secs: f64,
    /// Test hook, not for production: a request carrying this header fails in
    /// its business step (500), as a crashing handler would; in inbox mode
    /// the stored delivery keeps the header, so it fails on every attempt.
    #[arg(long, value_name = "HEADER")]
    fail_on_header: Option<String>,
    /// Test hook, not for production: the business step appends a line
    /// `<key> <delivery id>` to this file when it starts, before any wait: a
    /// side effect outside the store, counted by tests across processes.
    #[arg(long, value_name = "PATH")]
    effect_log: Option<std::path::PathBuf>,
}

/// A provider a route can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Provider {
    Standard,
    Stripe,
    GitHub,
    Shopify,
}

impl Provider {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "standard" | "svix" => Provider::Standard,
            "stripe" => Provider::Stripe,
            "github" => Provider::GitHub,
            "shopify" => Provider::Shopify,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        self.scheme().name()
    }

    fn scheme(self) -> Scheme {
        match self {
            Provider::Standard => Scheme::StandardWebhooks,
            Provider::Stripe => Scheme::Stripe,
            Provider::GitHub => Scheme::GitHub,
            Provider::Shopify => Scheme::Shopify,
        }
    }

    fn rule(self, namespace: &str) -> KeyRule {
        match self {
            Provider::Standard => KeyRule::generic(namespace),
            Provider::Stripe => KeyRule::stripe(namespace),
            Provider::GitHub => KeyRule::github(namespace),
            Provider::Shopify => KeyRule::shopify(namespace),
        }
    }
}

struct App {
    ledger: Ledger,
    /// Route name (`hooks`, `standard`, a provider, a --route name) to its
    /// receiver; `None` when secrets are configured but none for it (the route
    /// is then not served, so nothing unsigned gets in by a side door).
    routes: HashMap<String, Option<Webhook>>,
    work: Duration,
    fail_on: Option<http::HeaderName>,
    effect_log: Option<std::path::PathBuf>,
    metrics: PrometheusHandle,
    retention: Duration,
}

pub async fn serve(args: ServeArgs) -> Result<bool, Error> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| Error::config(format!("metrics recorder: {e}")))?;
    let url = crate::store_url(&args.store)?;
    let shown = url.to_string();
    let opener = Opener::new(url).await?;
    let ledger::Opened {
        store,
        inbox,
        ledger,
    } = Ledger::open(&opener).await?;
    // Inbox mode's inbox, or None when serving claims.
    let inbox = match (args.inbox, inbox) {
        (true, None) => {
            return Err(Error::config(format!(
                "--inbox: {} stores have no inbox; serve without it",
                opener.url().scheme()
            )))
        }
        (true, inbox) => inbox,
        (false, _) => None,
    };

    // Routes: the built-in ones, then the named ones.
    let mut routes: Vec<(String, Provider)> = vec![
        ("hooks".into(), Provider::Standard),
        ("stripe".into(), Provider::Stripe),
        ("github".into(), Provider::GitHub),
        ("shopify".into(), Provider::Shopify),
    ];
    for spec in &args.routes {
        let (name, provider) = spec
            .split_once('=')
            .ok_or_else(|| Error::config(format!("--route {spec}: expected NAME=PROVIDER")))?;
        let provider = Provider::parse(provider).ok_or_else(|| {
            Error::config(format!(
                "--route {spec}: providers are stripe, github, shopify, standard"
            ))
        })?;
        dedupe_core::Key::new(name, "x")
            .map_err(|e| Error::config(format!("--route {spec}: {e}")))?;
        if routes.iter().any(|(n, _)| n == name) || name == "standard" {
            return Err(Error::config(format!(
                "--route {spec}: /hooks/{name} is already a route"
            )));
        }
        routes.push((name.to_string(), provider));
    }
    let route_names: Vec<&str> = routes.iter().map(|(n, _)| n.as_str()).collect();
    let secrets = secrets::collect(&args.secrets, &args.secret_file, &route_names)?;
    if let Some(bad) = args
        .unsigned
        .iter()
        .find(|r| !route_names.contains(&r.as_str()))
    {
        return Err(Error::config(format!(
            "--unsigned {bad}: routes are {}",
            route_names.join(", ")
        )));
    }
    // With no secret at all every route is open (a local demo); once secrets
    // are given, a route without one is not served unless --unsigned says so.
    let open = secrets.is_empty();
    if open {
        eprintln!("warning: no secret given: signatures are not checked on any route");
    }
    // One lifecycle for every route and worker: the URL's lease and
    // retention, then the flags.
    let mut deduper = opener.url().deduper(Arc::clone(&store))?;
    match args.lease_ms {
        Some(0) => return Err(Error::config("--lease-ms 0: a lease is at least 1 ms")),
        Some(ms) => deduper = deduper.with_lease_ttl(Duration::from_millis(ms)),
        None => {}
    }
    if let Some(secs) = args.max_handler_secs {
        deduper = deduper.with_max_work_time(secs_arg("--max-handler-secs", secs)?);
    }
    let retention = opener.url().retention().unwrap_or(Retention::DEFAULT);
    let limit = args
        .max_concurrency
        .map(dedupe_webhook::ConcurrencyLimit::new);
    let mut receivers = HashMap::new();
    for (name, provider) in &routes {
        let mut hook = if let Some(inbox) = &inbox {
            Webhook::inbox(Arc::clone(inbox), provider.rule(name))
        } else {
            Webhook::new(deduper.clone(), provider.rule(name))
        };
        if let Some(limit) = args.body_limit {
            hook = hook.body_limit(limit);
        }
        if let Some(limit) = &limit {
            hook = hook.concurrency_limit(limit.clone());
        }
        // A named route's own secrets, else its provider's.
        let own = secrets.get(name.as_str()).or_else(|| match name.as_str() {
            "hooks" => secrets.get("standard"),
            _ => secrets.get(provider.name()),
        });
        let hook = match own {
            Some(list) => {
                let verifier = dedupe_webhook::Verifier::new(provider.scheme(), list)
                    .map_err(|e| Error::config(format!("secret for {name}: {e}")))?
                    .with_tolerance(Duration::from_secs(args.tolerance_secs));
                Some(hook.verifier(verifier))
            }
            None if open || args.unsigned.contains(name) => Some(hook),
            None => None,
        };
        receivers.insert(name.clone(), hook);
    }
    // /hooks/standard is /hooks under another name: one namespace, so a signed
    // message replayed on the other route is the same key.
    let generic = receivers.get("hooks").cloned().flatten();
    receivers.insert("standard".into(), generic);

    let app = Arc::new(App {
        ledger,
        routes: receivers,
        work: Duration::from_millis(args.work_ms),
        fail_on: match &args.fail_on_header {
            Some(name) => Some(
                http::HeaderName::try_from(name.as_str())
                    .map_err(|e| Error::config(format!("--fail-on-header: {e}")))?,
            ),
            None => None,
        },
        effect_log: args.effect_log.clone(),
        metrics,
        retention,
    });
    // Inbox mode: a worker per served route's namespace (/hooks/standard is
    // /hooks), running the business step on each taken item.
    let workers: Vec<(InboxWorker, tokio::task::JoinHandle<Result<(), Error>>)> =
        if let Some(inbox) = &inbox {
            if args.retry_backoff_ms == 0 {
                return Err(Error::config(
                    "--retry-backoff-ms 0: a delay is at least 1 ms",
                ));
            }
            let mut served: Vec<&str> = app
                .routes
                .iter()
                .filter(|(name, hook)| hook.is_some() && name.as_str() != "standard")
                .map(|(name, _)| name.as_str())
                .collect();
            served.sort_unstable();
            served
                .into_iter()
                .map(|namespace| {
                    let worker = InboxWorker::new(&deduper, Arc::clone(inbox), namespace)
                        .with_concurrency(args.workers)
                        .with_max_attempts(args.max_attempts)
                        .with_backoff(dedupe_core::Backoff {
                            first: Duration::from_millis(args.retry_backoff_ms),
                            max: Duration::from_secs(600),
                        })
                        .with_poll_interval(Duration::from_millis(50));
                    let running = tokio::spawn({
                        let (worker, app) = (worker.clone(), Arc::clone(&app));
                        async move {
                            worker
                                .run(move |taken| {
                                    let app = Arc::clone(&app);
                                    async move { inbox_step(app, taken).await }
                                })
                                .await
                        }
                    });
                    (worker, running)
                })
                .collect()
        } else {
            Vec::new()
        };
    let admin = Router::new()
        .route("/hooks", get(ledger_rows))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .with_state(Arc::clone(&app));
    let mut public = Router::new()
        .route("/hooks", post(receive))
        .route("/hooks/{route}", post(receive_on))
        .route("/healthz", get(healthz));
    if open {
        public = public
            .route("/hooks", get(ledger_rows))
            .route("/metrics", get(metrics_text));
    }
    let public = public.with_state(Arc::clone(&app));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::config(format!("--listen {}: {e}", args.listen)))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::unavailable("listener address", Some(Box::new(e))))?;
    let admin_task = match args.admin_listen {
        Some(addr) => {
            let admin_listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::config(format!("--admin-listen {addr}: {e}")))?;
            let admin_local = admin_listener
                .local_addr()
                .map_err(|e| Error::unavailable("admin listener address", Some(Box::new(e))))?;
            eprintln!("admin on http://{admin_local} (ledger, metrics)");
            Some((
                admin_local,
                tokio::spawn(async move { axum::serve(admin_listener, admin).await }),
            ))
        }
        None => None,
    };
    let pruner = spawn_pruner(Arc::clone(&app), retention);
    // The recorder drains its histograms only on upkeep: without a scrape (no
    // admin listener) they would grow with every delivery.
    let upkeep = {
        let handle = app.metrics.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                handle.run_upkeep();
            }
        })
    };
    // The first line of output: tests and scripts read the address(es) from it.
    match &admin_task {
        Some((admin, _)) => {
            println!("listening on http://{local} (store {shown}) admin http://{admin}")
        }
        None => println!("listening on http://{local} (store {shown})"),
    }
    let grace = secs_arg("--shutdown-grace-secs", args.shutdown_grace_secs)?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let server = axum::serve(listener, public)
        .with_graceful_shutdown({
            let stop = Arc::clone(&stop);
            async move { stop.notified().await }
        })
        .into_future();
    tokio::pin!(server);
    let aborted = tokio::select! {
        served = &mut server => {
            served.map_err(|e| Error::unavailable("server", Some(Box::new(e))))?;
            0
        }
        () = shutdown_signal() => {
            // Stop accepting and, at the same time, drain the handlers: those
            // whose provider already gave up run on without a connection. At
            // the grace they are aborted (their requests then answer 503), so
            // the connections close; the server's own drain is capped too.
            stop.notify_one();
            // Every route's handlers and every worker's items are tasks of
            // the one deduper: stop the workers taking, then drain it once.
            for (worker, _) in &workers {
                worker.stop();
            }
            let (drained, served) = tokio::join!(
                deduper.shutdown(grace),
                tokio::time::timeout(grace + Duration::from_secs(1), &mut server),
            );
            if served.is_err() {
                eprintln!("connections still open past the grace; closing them");
            }
            drained.aborted
        }
    };
    pruner.abort();
    upkeep.abort();
    for (_, running) in workers {
        running.abort();
    }
    if let Some((_, task)) = admin_task {
        task.abort();
    }
    if aborted > 0 {
        eprintln!(
            "stopped: {aborted} handler(s) ran past the grace; aborted, their claims released"
        );
    } else {
        eprintln!("stopped: every handler finished");
    }
    Ok(true)
}

fn secs_arg(flag: &str, secs: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::config(format!("{flag} {secs}: a positive number of seconds")))
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

/// Why the business step did not record an event.
enum StepError {
    /// The request carried `--fail-on-header` (a test hook).
    Refused,
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
    if let Some(name) = &app.fail_on {
        if headers.contains_key(name) {
            return Err(StepError::Refused);
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
async fn business_step(app: Arc<App>, req: Request<Body>) -> Response {
    let Some(event) = WebhookEvent::of(req.extensions()) else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "no claimed event").into_response();
    };
    match business(&app, &event, req.headers()).await {
        Ok(bytes) => {
            // The ledger row and the completion committed together.
            event.completed();
            ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
        }
        Err(StepError::Refused) => (
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
/// once). A failure is the item's failure: due again after the backoff.
async fn inbox_step(app: Arc<App>, taken: Taken) -> Result<Vec<u8>, String> {
    let (event, headers) =
        WebhookEvent::from_item(&taken, app.retention).map_err(|e| e.to_string())?;
    match business(&app, &event, &headers).await {
        Ok(bytes) => Ok(WebhookEvent::outcome_for(
            StatusCode::OK,
            Some("application/json"),
            &bytes,
        )),
        Err(StepError::Refused) => Err("business step failed (--fail-on-header)".to_string()),
        Err(StepError::NotRecorded(_)) => {
            Err("the ledger write and completion failed (see the log)".to_string())
        }
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
    let limit = page.limit.unwrap_or(1000).clamp(1, 10_000);
    match app.ledger.page(page.after.as_deref(), limit).await {
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

/// Prunes the ledger with the store's retention: rows of events whose
/// records are gone go too. Every half retention, at most every minute.
fn spawn_pruner(app: Arc<App>, retention: Duration) -> tokio::task::JoinHandle<()> {
    let every = (retention / 2).clamp(Duration::from_millis(100), Duration::from_secs(60));
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let cutoff = SystemTime::now()
                .checked_sub(retention)
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0);
            match app.ledger.prune(cutoff).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "ledger pruned"),
                Err(e) => tracing::warn!(error = %e, "ledger prune failed"),
            }
        }
    })
}
