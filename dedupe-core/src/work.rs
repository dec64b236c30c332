//! Work held under a lease: the one lifecycle the [`Deduper`](crate::Deduper)
//! and the webhook receiver share.
//!
//! Work runs in a Tokio task of its own, never inside the caller's future, so
//! a caller that goes away (a client that disconnects, a provider that times
//! out, a cancelled `select!`) cannot stop the work half way and free its claim
//! for a second run while the first may still be going on. While the work
//! runs, a heartbeat extends the lease beside it (the work is polled all the
//! while); a time bound and a shutdown deadline may end it early, and then the
//! claim is released. When the work returns, its claim is settled as the work
//! says: completed with an outcome, released, or left as the work settled it
//! itself.

use std::any::Any;
use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::claim::{Lease, MIN_TTL};
use crate::error::Error;
use crate::key::LeaseToken;
use crate::store::DedupeStore;

/// What to do with a claim once its work has returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// Complete the claim with this outcome, kept for `retention`: later
    /// claims are answered `Duplicate` with it.
    Complete {
        /// The outcome bytes to store.
        outcome: Vec<u8>,
        /// How long the done record answers duplicates.
        retention: Duration,
    },
    /// Release the claim: the next delivery runs the work again.
    Release,
    /// The work completed or released the lease itself (in the transaction of
    /// its own writes, say): nothing more to do.
    Settled,
}

/// How held work ended, and what became of its claim.
#[derive(Debug)]
#[non_exhaustive]
pub enum Worked<T> {
    /// The work returned `value`; `settled` is what the store said to the
    /// settlement the work asked for (`Err(LeaseLost)` when the lease was
    /// taken over meanwhile).
    Returned {
        /// What the work returned.
        value: T,
        /// The store's answer to the completion or release.
        settled: Result<(), Error>,
    },
    /// The work panicked; its claim was released, or its inbox item failed
    /// (`released` says whether the store took it). `payload` is the panic's,
    /// to resume it.
    Panicked {
        /// The panic payload.
        payload: Box<dyn Any + Send>,
        /// The store's answer to the release.
        released: Result<(), Error>,
    },
    /// The work ran past its time bound: it was dropped mid-way and its claim
    /// released, or its inbox item failed.
    TimedOut {
        /// The bound it ran past.
        limit: Duration,
        /// The store's answer to the release.
        released: Result<(), Error>,
    },
    /// Shutdown's grace ran out while the work ran: it was dropped mid-way and
    /// its claim released.
    Aborted {
        /// The store's answer to the release.
        released: Result<(), Error>,
    },
    /// Work under this very lease already runs in this `Deduper` (a claim
    /// with a claim id asked again while the first run goes on, and the store
    /// answered it the same lease): the work was not run a second time, and
    /// the claim is left to the first run.
    AlreadyRunning {
        /// The lease's deadline.
        deadline: SystemTime,
    },
}

/// What [`Deduper::shutdown`](crate::Deduper::shutdown) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Tasks running when shutdown began.
    pub running: usize,
    /// Of those, how many were still running when the grace ran out and were
    /// aborted (their claims released).
    pub aborted: usize,
}

/// The tasks of a `Deduper` and its clones: tracked so shutdown can wait for
/// them, and cancellable so it can end them past its grace.
#[derive(Debug, Default)]
pub(crate) struct Tasks {
    tracker: TaskTracker,
    abort: CancellationToken,
    /// The tokens of the leases whose work runs now.
    held: Mutex<HashSet<LeaseToken>>,
}

/// A lease's token in [`Tasks::held`] while its work runs.
struct HeldToken<'a> {
    tasks: &'a Tasks,
    token: LeaseToken,
}

impl Drop for HeldToken<'_> {
    fn drop(&mut self) {
        self.tasks
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.token);
    }
}

impl Tasks {
    pub(crate) fn spawn<F>(&self, fut: F) -> Result<JoinHandle<F::Output>, Error>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        if self.tracker.is_closed() {
            return Err(Error::unavailable(
                "shutting down: no new work is started",
                None,
            ));
        }
        Ok(self.tracker.spawn(fut))
    }

    pub(crate) async fn shutdown(&self, grace: Duration) -> Drained {
        self.tracker.close();
        let running = self.tracker.len();
        let aborted = match tokio::time::timeout(grace, self.tracker.wait()).await {
            Ok(()) => 0,
            Err(_) => {
                let left = self.tracker.len();
                tracing::warn!(
                    left,
                    ?grace,
                    "shutdown grace ran out: aborting held work and releasing its claims"
                );
                self.abort.cancel();
                self.tracker.wait().await;
                left
            }
        };
        Drained { running, aborted }
    }

    pub(crate) fn cancelled(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.abort.cancelled()
    }

    /// Marks `token` as running; `None` when it already is.
    fn hold_token(&self, token: &LeaseToken) -> Option<HeldToken<'_>> {
        let fresh = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(token.clone());
        fresh.then(|| HeldToken {
            tasks: self,
            token: token.clone(),
        })
    }
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Counts one settled piece of work (`dedupe_work_total`, by outcome).
fn count(outcome: &'static str) {
    metrics::counter!("dedupe_work_total", "outcome" => outcome).increment(1);
}

/// What a holder does with the lease of work that panicked or ran past its
/// time bound, given the lease and what went wrong.
pub(crate) type OnFailure =
    Arc<dyn Fn(Lease, String) -> BoxFuture<'static, Result<(), Error>> + Send + Sync>;

/// The lifecycle itself, on a store the caller has behind a `TracedStore`.
#[derive(Clone)]
pub(crate) struct Holder {
    pub(crate) store: Arc<dyn DedupeStore>,
    pub(crate) ttl: Duration,
    pub(crate) heartbeat: bool,
    pub(crate) max_time: Duration,
    /// Work that panicked or ran past its bound: `None` releases its claim
    /// (the next delivery runs it again); the inbox worker fails its item
    /// instead, the attempt spent (CONTRACT.md I9: a release of an item is a
    /// hand-back and spends none).
    pub(crate) on_failure: Option<OnFailure>,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holder")
            .field("store", &self.store)
            .field("ttl", &self.ttl)
            .field("heartbeat", &self.heartbeat)
            .field("max_time", &self.max_time)
            .field("on_failure", &self.on_failure.is_some())
            .finish()
    }
}

/// A panic's message, when it has one.
fn panic_text(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

impl Holder {
    /// Runs `work` to its end (or its bound), beating the lease beside it when
    /// asked, then settles the claim. Runs in the caller's task: callers spawn
    /// it (see `Tasks::spawn`) so nothing outside can drop it half way.
    pub(crate) async fn hold<T, W>(&self, tasks: &Tasks, lease: Lease, work: W) -> Worked<T>
    where
        W: Future<Output = (T, Settle)>,
    {
        let Some(_held) = tasks.hold_token(&lease.token) else {
            tracing::warn!(key = %lease.key, "a claim id asked again while its first run goes on: not run twice");
            return Worked::AlreadyRunning {
                deadline: lease.deadline,
            };
        };
        let current = Arc::new(Mutex::new(lease));
        // The heartbeat is a task of its own: work that blocks its thread (a
        // synchronous call, a long computation) does not stop the lease from
        // being extended.
        let _beating = self.heartbeat.then(|| {
            let this = self.clone();
            let current = Arc::clone(&current);
            AbortOnDrop(tokio::spawn(async move { this.beat(&current).await }))
        });
        if _beating.is_some() {
            // Let the beat start (and arm its timer) before the work: a task
            // just spawned waits in this worker's slot that no other worker
            // may steal, behind work that might block this thread.
            tokio::task::yield_now().await;
        }
        let running = AssertUnwindSafe(work).catch_unwind();
        let limit = self.max_time;
        let bounded = async {
            tokio::time::timeout(limit, running)
                .await
                .map_err(|_| limit)
        };
        // Biased: work that has ended is settled even if shutdown's grace runs
        // out on the same poll.
        let ended = tokio::select! {
            biased;
            ended = bounded => Some(ended),
            () = tasks.cancelled() => None,
        };
        drop(_beating);
        let lease = current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        match ended {
            Some(Ok(Ok((value, settle)))) => {
                let settled = self.settle(&lease, settle).await;
                Worked::Returned { value, settled }
            }
            Some(Ok(Err(payload))) => {
                tracing::error!(key = %lease.key, "the work panicked; settling its claim");
                count("panicked");
                let what = format!("the work panicked: {}", panic_text(&*payload));
                let released = self.failed(&lease, what).await;
                Worked::Panicked { payload, released }
            }
            Some(Err(limit)) => {
                tracing::error!(key = %lease.key, ?limit, "the work ran past its time bound; dropped it and settling its claim");
                count("timed_out");
                let what = format!("the work ran past its time bound of {limit:?}");
                let released = self.failed(&lease, what).await;
                Worked::TimedOut { limit, released }
            }
            None => {
                count("aborted");
                let released = self.store.release(&lease).await;
                Worked::Aborted { released }
            }
        }
    }

    /// Settles the lease of work that panicked or ran past its bound.
    async fn failed(&self, lease: &Lease, what: String) -> Result<(), Error> {
        match &self.on_failure {
            Some(on_failure) => on_failure(lease.clone(), what).await,
            None => self.store.release(lease).await,
        }
    }

    /// Extends the lease every third of the TTL, for as long as it runs;
    /// after a failure the store may recover from, tries again sooner (a
    /// quarter second, doubling) while the lease lasts. Stops once the store
    /// says the lease is lost.
    async fn beat(&self, current: &Mutex<Lease>) {
        let every = (self.ttl / 3).max(MIN_TTL);
        let mut wait = every;
        loop {
            tokio::time::sleep(wait).await;
            let lease = current
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            match self.store.extend(&lease, self.ttl).await {
                Ok(extended) => {
                    *current
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = extended;
                    wait = every;
                }
                Err(error) if error.is_retryable() => {
                    // The store is briefly away: the lease may still be ours.
                    let retry = if wait == every {
                        Duration::from_millis(250)
                    } else {
                        wait * 2
                    };
                    wait = retry.min(every);
                    tracing::warn!(key = %lease.key, %error, ?wait, "heartbeat failed; trying again");
                }
                Err(error) => {
                    // Lost: let the work finish; its settlement says what happened.
                    tracing::warn!(key = %lease.key, %error, "heartbeat could not extend the lease");
                    count("heartbeat_lost");
                    return;
                }
            }
        }
    }

    async fn settle(&self, lease: &Lease, settle: Settle) -> Result<(), Error> {
        let (result, outcome) = match settle {
            Settle::Settled => (Ok(()), "settled"),
            Settle::Release => (self.store.release(lease).await, "released"),
            Settle::Complete { outcome, retention } => {
                (self.complete(lease, &outcome, retention).await, "completed")
            }
        };
        match &result {
            Ok(()) => count(outcome),
            Err(Error::LeaseLost { .. }) => {
                tracing::error!(key = %lease.key, "the work finished after its lease was taken over: the event may have been processed twice");
                count("lease_lost");
            }
            Err(error) => {
                tracing::error!(key = %lease.key, %error, "the work finished but its claim could not be settled; the lease passes at its deadline");
                count("not_settled");
            }
        }
        result
    }

    /// Completes, retrying a store that is briefly away while the lease lasts.
    /// A retry after a first attempt that did store the outcome (its answer was
    /// lost) is answered `Ok`: a store answers a complete asked again with the
    /// same lease and outcome as the first.
    async fn complete(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<(), Error> {
        let mut wait = Duration::from_millis(50);
        let started = Instant::now();
        loop {
            match self.store.complete(lease, outcome, retention).await {
                Err(e) if e.is_retryable() && SystemTime::now() + wait < lease.deadline => {
                    tracing::warn!(key = %lease.key, error = %e, elapsed = ?started.elapsed(), "completion failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                other => return other,
            }
        }
    }
}
