//! Running `expire()` on a period, in the background.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{select, Either};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::store::DedupeStore;

/// A Tokio task that calls [`DedupeStore::expire`] every `period`, started by
/// [`spawn_expire_task`]. [`stop`](Self::stop) ends it after the pass under way;
/// dropping the handle ends it too (without waiting).
#[derive(Debug)]
pub struct ExpireTask {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ExpireTask {
    /// Stops the task and waits until it has ended; a pass under way finishes
    /// first, so nothing is left half done.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ExpireTask {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Spawns a task on the current Tokio runtime that removes expired records every
/// `period` (the first pass right away), for stores that need `expire()` called
/// (SQL stores; [`Capabilities::explicit_expire`](crate::Capabilities)). Failures
/// are logged and retried at the next tick; claims never depend on the purge,
/// since expiry is logical.
///
/// Panics when called outside a Tokio runtime, as `tokio::spawn` does.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use dedupe_core::{spawn_expire_task, MemoryStore};
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let purge = spawn_expire_task(Arc::new(MemoryStore::new()), Duration::from_secs(3600));
/// // ... serve ...
/// purge.stop().await;
/// # });
/// ```
pub fn spawn_expire_task<S>(store: Arc<S>, period: Duration) -> ExpireTask
where
    S: DedupeStore + ?Sized,
{
    let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
    let period = period.max(Duration::from_millis(1));
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let tick = std::pin::pin!(ticks.tick());
            match select(tick, &mut stop_rx).await {
                Either::Left(_) => match store.expire().await {
                    Ok(removed) => tracing::debug!(removed, "expired records removed"),
                    Err(error) => {
                        tracing::warn!(%error, "expire pass failed; retrying next period")
                    }
                },
                Either::Right(_) => return,
            }
        }
    });
    ExpireTask {
        stop: Some(stop_tx),
        task: Some(task),
    }
}
