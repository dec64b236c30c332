//! `dedupe serve`: a webhook receiver on any store, the whole path of
//! dedupe-webhook (verify, derive the key, claim, work, complete) with a
//! business step that appends one ledger row per processed event.
//!
//! Two surfaces: the public listener takes deliveries (`POST /hooks`,
//! `/hooks/{route}`); the ledger (`GET /hooks`) and the metrics
//! (`GET /metrics`) are served there only while no secret is configured (a
//! local demo), and on `--admin-listen` always.
//!
//! `serve` below is the order of things: the flags (`args.rs`), the store
//! and its ledger (`ledger.rs`), the routes' receivers on one deduper
//! (`setup.rs`, secrets from `secrets.rs`), the state and the business step
//! (`app.rs`), the HTTP surfaces (`routes.rs`), the inbox workers and the
//! pruner (`workers.rs`), then the listeners until a signal
//! (`shutdown.rs`), and the drain.

mod admin;
mod app;
mod args;
mod ledger;
mod routes;
mod secrets;
mod setup;
mod shutdown;
mod throughput;
mod workers;

pub use args::ServeArgs;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{Error, Retention};
use dedupe_url::Opener;
use metrics_exporter_prometheus::PrometheusBuilder;

use app::App;
use ledger::Ledger;

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

    let setup::Receivers {
        routes: receivers,
        open,
        deduper,
    } = setup::receivers(&args, &opener, &store, inbox.as_ref())?;
    let retention = opener.url().retention().unwrap_or(Retention::DEFAULT);
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
        healed_when: args.healed_when.clone(),
        effect_log: args.effect_log.clone(),
        metrics,
        retention,
        throughput: Arc::default(),
    });
    let workers = workers::spawn(&app, &deduper, inbox.as_ref(), &args)?;
    // The demo's ledger and metrics on the public listener only while there is
    // no secret and no admin listener: with one, the admin surface is there.
    let public = routes::public(&app, open && args.admin_listen.is_none());
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::config(format!("--listen {}: {e}", args.listen)))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::unavailable("listener address", Some(Box::new(e))))?;
    let admin_task = match args.admin_listen {
        Some(addr) => {
            let auth = admin::Auth::new(admin::token(args.admin_token_file.as_deref())?, addr)?;
            let admin = admin::router(
                &app,
                inbox.clone(),
                workers::served_namespaces(&app),
                auth,
                Arc::clone(&app.throughput),
            );
            let admin_listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::config(format!("--admin-listen {addr}: {e}")))?;
            let admin_local = admin_listener
                .local_addr()
                .map_err(|e| Error::unavailable("admin listener address", Some(Box::new(e))))?;
            eprintln!("admin on http://{admin_local} (dashboard /ui, API /api, ledger, metrics)");
            Some((
                admin_local,
                tokio::spawn(async move { axum::serve(admin_listener, admin).await }),
            ))
        }
        None => None,
    };
    let pruner = workers::spawn_pruner(Arc::clone(&app), retention);
    let gauges = inbox.as_ref().map(|inbox| {
        workers::spawn_gauges(
            Arc::clone(inbox),
            workers::served_namespaces(&app),
            Duration::from_millis(args.gauges_every_ms),
        )
    });
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
    let grace = setup::secs_arg("--shutdown-grace-secs", args.shutdown_grace_secs)?;
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
        () = shutdown::signal() => {
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
    if let Some(gauges) = gauges {
        gauges.abort();
    }
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
