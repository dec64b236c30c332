//! What runs beside the listeners: in inbox mode a worker per served
//! namespace running the business step on each taken item, and the ledger's
//! pruner.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_core::{Deduper, Error, Inbox, InboxWorker};

use super::app::{inbox_step, App};
use super::args::ServeArgs;

/// An inbox worker and its running task.
pub(super) type Running = (InboxWorker, tokio::task::JoinHandle<Result<(), Error>>);

/// Inbox mode: a worker per served route's namespace (/hooks/standard is
/// /hooks), on `deduper`, running the business step on each taken item;
/// none without an inbox.
pub(super) fn spawn(
    app: &Arc<App>,
    deduper: &Deduper,
    inbox: Option<&Arc<dyn Inbox>>,
    args: &ServeArgs,
) -> Result<Vec<Running>, Error> {
    Ok(if let Some(inbox) = inbox {
        if args.retry_backoff_ms == 0 {
            return Err(Error::config(
                "--retry-backoff-ms 0: a delay is at least 1 ms",
            ));
        }
        served_namespaces(app)
            .into_iter()
            .map(|namespace| {
                let mut worker = InboxWorker::new(deduper, Arc::clone(inbox), &namespace)
                    .with_concurrency(args.workers)
                    .with_max_attempts(args.max_attempts)
                    .with_max_snooze(Duration::from_secs(args.max_snooze_secs))
                    .with_dead_retention(
                        (args.dead_retention_secs > 0)
                            .then(|| Duration::from_secs(args.dead_retention_secs)),
                    )
                    .with_backoff(dedupe_core::Backoff {
                        first: Duration::from_millis(args.retry_backoff_ms),
                        max: Duration::from_secs(600),
                    });
                if let Some(poll) = args.poll_ms {
                    worker = worker.with_poll_interval(Duration::from_millis(poll));
                }
                let running = tokio::spawn({
                    let (worker, app) = (worker.clone(), Arc::clone(app));
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
    })
}

/// Inbox mode: the queue's gauges of every served namespace, read from the
/// store every `every` ([`record_inbox_gauges`](dedupe_core::record_inbox_gauges)).
pub(super) fn spawn_gauges(
    inbox: Arc<dyn Inbox>,
    namespaces: Vec<String>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            for namespace in &namespaces {
                if let Err(e) = dedupe_core::record_inbox_gauges(inbox.as_ref(), namespace).await {
                    tracing::warn!(namespace, error = %e, "the queue's gauges were not read");
                }
            }
            tokio::time::sleep(every).await;
        }
    })
}

/// The namespaces of the served routes (/hooks/standard is /hooks), sorted.
pub(super) fn served_namespaces(app: &App) -> Vec<String> {
    let mut served: Vec<String> = app
        .routes
        .iter()
        .filter(|(name, hook)| hook.is_some() && name.as_str() != "standard")
        .map(|(name, _)| name.clone())
        .collect();
    served.sort_unstable();
    served
}

/// Prunes the ledger with the store's retention: rows of events whose
/// records are gone go too. Every half retention, at most every minute.
pub(super) fn spawn_pruner(app: Arc<App>, retention: Duration) -> tokio::task::JoinHandle<()> {
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
