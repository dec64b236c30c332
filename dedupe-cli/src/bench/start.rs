//! The `start` workload: how long an accepted item waits before a worker
//! starts it, on an idle inbox.
//!
//! The row's tasks are [`InboxWorker`]s with the library's defaults, waiting
//! on an empty namespace, on one store handle (its default pool) shared with
//! the producer, as a service that receives and works in one process has. One producer accepts
//! an item, waits until a worker's handler has started it, pauses a drawn
//! 0 to 300 ms, and accepts the next. The pause is what makes the figure
//! honest: a worker that found nothing sleeps its poll interval (250 ms by
//! default), so an accept sent right after the last item started would
//! always land early in that sleep and wait nearly all of it; drawn over
//! more than a whole interval, accepts land at every phase of the workers'
//! polls, as deliveries do. Rows are therefore slow (about 5 items a
//! second): give them 30 s for a p99 of 150 items. An item's latency is from
//! its accept's answer to its handler's first line, both read on this
//! process's monotonic clock; a handler that starts before the accept has
//! answered (a worker woken by the write itself) counts as 1 µs. There is
//! no raw row: no single statement does what a worker's wake-up does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupe_core::{Deduper, Error, Inbox, InboxWorker, Key};
use dedupe_url::Opener;
use hdrhistogram::Histogram;
use tokio::sync::oneshot;

use super::args::Limits;
use super::run::{splitmix, Measured};

/// The namespace the row's items are accepted in.
const NAMESPACE: &str = "bench";

/// Longest wait for one item to start: past it the item counts as an error.
const START_TIMEOUT: Duration = Duration::from_secs(5);

/// The handlers' side: the instant each item's handler started, sent to the
/// producer waiting for it.
type Starts = Arc<Mutex<HashMap<String, oneshot::Sender<Instant>>>>;

/// Runs `workers` workers and one producer for the warm-up, then measures
/// until `limits` is reached; the workers are shut down before it answers.
pub(crate) async fn measure(
    opener: &Opener,
    workers: usize,
    label: &str,
    warmup: Limits,
    limits: Limits,
) -> Result<(Measured, Duration), Error> {
    let producer = opener
        .inbox_handle()
        .await?
        .ok_or_else(|| Error::config("this store has no inbox"))?;
    let starts: Starts = Arc::default();
    let deduper = Deduper::new(Arc::clone(&producer));
    let mut running = Vec::with_capacity(workers);
    let mut handles = Vec::with_capacity(workers);
    for _ in 0..workers {
        let worker = InboxWorker::new(&deduper, Arc::clone(&producer), NAMESPACE);
        let starts = Arc::clone(&starts);
        running.push(tokio::spawn({
            let worker = worker.clone();
            async move {
                worker
                    .run(move |taken| {
                        let started = Instant::now();
                        let waiting = starts
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(taken.lease.key.id());
                        async move {
                            if let Some(tx) = waiting {
                                let _ = tx.send(started);
                            }
                            Ok::<_, std::io::Error>(Vec::new())
                        }
                    })
                    .await
            }
        }));
        handles.push(worker);
    }
    let result = async {
        produce(&*producer, &starts, &format!("{label}warm"), warmup).await?;
        let started = Instant::now();
        let measured = produce(&*producer, &starts, label, limits).await?;
        Ok((measured, started.elapsed()))
    }
    .await;
    for worker in &handles {
        worker.stop();
    }
    deduper.shutdown(Duration::from_secs(5)).await;
    for task in running {
        if let Ok(Err(e)) = task.await {
            return Err(e);
        }
    }
    result
}

/// Accepts items one at a time until `limits` is reached, each after the
/// one before has started.
async fn produce(
    inbox: &dyn Inbox,
    starts: &Starts,
    label: &str,
    limits: Limits,
) -> Result<Measured, Error> {
    let mut m = Measured {
        latency: Histogram::new_with_bounds(1, 60_000_000, 3).ok(),
        ..Measured::default()
    };
    let began = Instant::now();
    // The pauses' draw: its only job is to spread accepts over every phase
    // of the workers' polls.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::from(d.subsec_nanos()));
    for i in 0u64.. {
        match limits.ops {
            Some(n) if i >= n => break,
            None if began.elapsed() >= limits.period => break,
            _ => {}
        }
        let key = Key::new(NAMESPACE, format!("{label}-{i}"))?;
        let (tx, rx) = oneshot::channel();
        starts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.id().to_string(), tx);
        let accepted = match inbox.accept(&key, b"{}").await {
            Ok(_) => Instant::now(),
            Err(e) => {
                m.errors += 1;
                m.first_error.get_or_insert_with(|| e.to_string());
                continue;
            }
        };
        match tokio::time::timeout(START_TIMEOUT, rx).await {
            Ok(Ok(started)) => {
                let waited = started.saturating_duration_since(accepted);
                if let Some(h) = m.latency.as_mut() {
                    let _ = h.record((waited.as_micros() as u64).max(1));
                }
                m.ops += 1;
            }
            _ => {
                m.errors += 1;
                m.first_error
                    .get_or_insert_with(|| format!("{key} did not start within {START_TIMEOUT:?}"));
            }
        }
        let pause = splitmix(seed ^ i) % 300_000;
        tokio::time::sleep(Duration::from_micros(pause)).await;
    }
    Ok(m)
}
