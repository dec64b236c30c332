//! The worker side of an [`Inbox`]: take due items, run the handler under
//! each item's lease with a heartbeat, complete it or fail it with a backoff,
//! dead after the last attempt.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::claim::Lease;
use crate::deduper::Deduper;
use crate::error::{Error, Result};
use crate::inbox::{Inbox, InboxCounts, Retry, Taken, MAX_TAKE};
use crate::store::DedupeStore;
use crate::wake::Wake;
use crate::work::{Drained, Settle};

/// The retry delays of failed items: `first`, doubling per attempt, at most
/// `max`, each drawn between half and all of that (jitter, so that items that
/// failed together do not come back together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub first: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    /// 1 s, doubling, at most 10 minutes.
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(600),
        }
    }
}

impl Backoff {
    /// The delay after the failure of attempt `attempt` (1 for the first).
    pub fn delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        let full = self
            .first
            .saturating_mul(1u32 << doublings)
            .min(self.max)
            .max(crate::claim::MIN_TTL);
        (full / 2 + full.mul_f64(draw() / 2.0)).max(crate::claim::MIN_TTL)
    }
}

/// A uniform draw in `[0, 1]` from the system's randomness (1 where there
/// is none to read).
fn draw() -> f64 {
    let mut bytes = [0u8; 4];
    if getrandom::fill(&mut bytes).is_ok() {
        f64::from(u32::from_le_bytes(bytes)) / f64::from(u32::MAX)
    } else {
        1.0
    }
}

/// One wait of a worker that found nothing: drawn between half and all of
/// `poll`, so workers started together drift apart instead of polling in
/// step, and no wait is longer than the interval (a missed wake-up still
/// costs at most `poll`). Sixteen workers of one process polling in step,
/// all asleep at once, waited as long as one: a 142-153 ms median from
/// accept to start on Postgres, MariaDB and Redis; drawn, about 10 ms
/// (bench/README.md).
fn poll_wait(poll: Duration) -> Duration {
    poll / 2 + poll.mul_f64(draw() / 2.0)
}

/// The poll interval of a worker whose store wakes it only for changes made
/// in this process, or not at all.
const DEFAULT_POLL: Duration = Duration::from_millis(250);

/// The poll interval of a worker whose store pushes every process's changes
/// ([`Wake::everywhere`]): the poll only finds what no signal announces (a
/// signal lost with its connection, an item whose lease passed, an item due
/// later that another process scheduled), so it can be rare.
const DEFAULT_PUSHED_POLL: Duration = Duration::from_secs(2);

/// How many times longer than its interval an idle worker on a store with
/// [`Wake::idle_backoff`] waits at most.
const MAX_IDLE_BACKOFF: u32 = 8;

/// How many due times of its own retries and snoozes a worker remembers.
const MAX_SCHEDULED: usize = 256;

/// The due times of the items this worker (and its clones) failed or
/// snoozed, so that an idle worker looks again when the soonest is due
/// rather than at its next poll. Bounded: past [`MAX_SCHEDULED`], the
/// latest are forgotten and found by the poll.
#[derive(Debug, Default)]
struct Scheduled {
    due: Mutex<BTreeSet<Instant>>,
    /// Raised when a due time sooner than every other is added.
    sooner: Notify,
}

impl Scheduled {
    fn add(&self, delay: Duration) {
        let at = Instant::now() + delay;
        let sooner = {
            let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
            let sooner = due.first().is_none_or(|first| at < *first);
            due.insert(at);
            if due.len() > MAX_SCHEDULED {
                due.pop_last();
            }
            sooner
        };
        if sooner {
            self.sooner.notify_waiters();
        }
    }

    /// How long until the soonest due time still ahead (those passed are
    /// dropped: the take that follows this wait looks for them).
    fn next(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        while due.first().is_some_and(|first| *first <= now) {
            due.pop_first();
        }
        due.first().map(|first| *first - now)
    }
}

/// Runs a handler over the due items of one namespace of an [`Inbox`], in
/// any number of processes at once (each item is leased to one of them).
///
/// The lifecycle of each item is its [`Deduper`]'s, as for every front door:
/// the item runs in a task of the deduper under its lease (the deduper's
/// lease TTL), extended beside it by the heartbeat, and bounded by the
/// deduper's [`max_work_time`](Deduper::with_max_work_time) (10 minutes by
/// default): a handler hung past it is dropped and its item given back, due
/// again, for the next take. A handler that returns `Ok` completes the item
/// with its outcome (a done record, kept for the deduper's retention of the
/// namespace); one that returns `Err` fails it: due again after the
/// [`Backoff`], or dead when it fails at attempt `max_attempts` or later (so
/// a replayed dead item gets one more run). The error may say otherwise
/// ([`WorkFailure`]): due again after a delay of its own (an API's
/// `Retry-After`), or dead at once (a failure no attempt will get past). A
/// panic, or a run past the time bound, is a failure of its attempt (the
/// panic's message or the bound is the error); a worker that dies mid-item
/// leaves it to be taken over at its lease's end (the attempt counted), and
/// an item taken over [`max_takeovers`](Self::with_max_takeovers) times is
/// quarantined: dead, with an error saying so, without another run. A
/// handler may also snooze its item ([`WorkFailure::snooze`]): due again
/// after a delay, no attempt spent, within the item's
/// [`max_snooze`](Self::with_max_snooze) window from its accept. An
/// item's own attempt limit, set when it was accepted, wins over the
/// worker's `max_attempts`. An
/// item given back at shutdown spends no attempt (CONTRACT.md I9): deploys
/// do not send healthy items to the dead letters.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{Deduper, Inbox, InboxWorker, Key, MemoryStore};
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("in the test").block_on(async {
/// let inbox = MemoryStore::new();
/// inbox.accept(&Key::new("stripe", "evt_1")?, b"{}").await?;
/// let deduper = Deduper::new(inbox.clone());
/// let worker = InboxWorker::new(&deduper, inbox.clone(), "stripe")
///     .with_poll_interval(Duration::from_millis(10));
/// let running = tokio::spawn({
///     let worker = worker.clone();
///     async move {
///         worker
///             .run(|taken| async move { Ok::<_, std::io::Error>(taken.payload) })
///             .await
///     }
/// });
/// while inbox.counts("stripe").await?.pending > 0 {
///     tokio::time::sleep(Duration::from_millis(5)).await;
/// }
/// worker.shutdown(Duration::from_secs(1)).await;
/// running.await.expect("in the test")?;
/// # Ok::<(), dedupe_core::Error>(()) }).expect("in the test");
/// ```
///
/// Clones share the deduper's running tasks and the worker's stop signal;
/// a setting changed on a clone is that clone's.
#[derive(Debug, Clone)]
pub struct InboxWorker {
    deduper: Deduper,
    inbox: Arc<dyn Inbox>,
    namespace: String,
    max_attempts: u32,
    max_takeovers: u32,
    max_snooze: Duration,
    dead_retention: Option<Duration>,
    backoff: Backoff,
    concurrency: usize,
    /// Set by [`with_poll_interval`](Self::with_poll_interval); otherwise
    /// chosen by how the store wakes workers.
    poll: Option<Duration>,
    scheduled: Arc<Scheduled>,
    stop: CancellationToken,
}

impl InboxWorker {
    /// Default attempts before an item is dead.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 8;
    /// Default takeovers (workers that died holding an item) before the item
    /// is quarantined: dead without another run.
    pub const DEFAULT_MAX_TAKEOVERS: u32 = 3;
    /// Default window, from an item's accept, within which a snooze spends
    /// no attempt: a day.
    pub const DEFAULT_MAX_SNOOZE: Duration = Duration::from_secs(24 * 3600);
    /// Default items run at once by one worker.
    pub const DEFAULT_CONCURRENCY: usize = 8;

    /// A worker over `namespace` of `inbox` (any inbox, an `Arc` of one
    /// included), with its lifecycle from `deduper` (lease, heartbeat, time
    /// bound, retention, and the tasks [`Deduper::shutdown`] drains) and the
    /// defaults above. The inbox's calls go through a
    /// [`TracedStore`](crate::TracedStore): each is a span and a metric.
    pub fn new<I: Inbox + 'static>(
        deduper: &Deduper,
        inbox: I,
        namespace: impl Into<String>,
    ) -> Self {
        Self {
            deduper: deduper.clone(),
            inbox: Arc::new(crate::TracedStore::new(inbox)),
            namespace: namespace.into(),
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            max_takeovers: Self::DEFAULT_MAX_TAKEOVERS,
            max_snooze: Self::DEFAULT_MAX_SNOOZE,
            dead_retention: Some(crate::DEAD_RETENTION),
            backoff: Backoff::default(),
            concurrency: Self::DEFAULT_CONCURRENCY,
            poll: None,
            scheduled: Arc::default(),
            stop: CancellationToken::new(),
        }
    }

    /// Attempts before an item is dead (default 8, at least 1), for items
    /// accepted without a limit of their own
    /// ([`AcceptOptions::max_attempts`](crate::AcceptOptions::max_attempts)
    /// wins over this).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Takeovers before an item is quarantined (default 3, at least 1): an
    /// item whose workers died holding it this many times (a panic across
    /// FFI, an OOM kill, a segfault in a native library) is failed dead as
    /// it is taken, without running again, instead of killing worker after
    /// worker.
    pub fn with_max_takeovers(mut self, takeovers: u32) -> Self {
        self.max_takeovers = takeovers.max(1);
        self
    }

    /// How long after its accept an item may still be snoozed (default a
    /// day): a [`WorkFailure::snooze`] whose delay ends within the window
    /// gives the item back for that long without spending an attempt; one
    /// that would end past it is a failure instead (the attempt spent, the
    /// item due after the delay, or dead at its last attempt), so a handler
    /// that snoozes forever still ends in the dead letters.
    pub fn with_max_snooze(mut self, window: Duration) -> Self {
        self.max_snooze = window;
        self
    }

    /// How long the items this worker fails dead are kept before `expire()`
    /// may remove them (default [`DEAD_RETENTION`](crate::DEAD_RETENTION),
    /// 35 days; `None`: until replayed or forgotten). A retention outside
    /// [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL) is refused
    /// by the store at the fail (the item then stays held and is taken over
    /// when its lease passes), so set it within.
    pub fn with_dead_retention(mut self, keep: Option<Duration>) -> Self {
        self.dead_retention = keep;
        self
    }

    /// The retry delays (default 1 s doubling to 10 minutes).
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Items run at once (default 8, at least 1).
    pub fn with_concurrency(mut self, items: usize) -> Self {
        self.concurrency = items.max(1);
        self
    }

    /// The longest the worker waits before looking again when nothing was
    /// due and nothing woke it ([`Inbox::wake`]): the most a missed wake-up
    /// costs. By default 2 s on a store that pushes every process's changes
    /// (Postgres, Redis), 250 ms otherwise (SQLite and memory wake only the
    /// workers of the process that made the change; MySQL polls; DynamoDB
    /// polls backing off to 8 times the interval while idle). Each wait is
    /// drawn between half and all of it, so workers started together do not
    /// poll in step. An item this worker failed or snoozed is looked for
    /// when it is due, whatever the interval.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = Some(poll);
        self
    }

    /// Takes and runs due items until [`shutdown`](Self::shutdown). Errors
    /// the store may recover from, and corrupt items a take met, are logged
    /// and the take retried after the poll interval; any other error of a
    /// take (a configuration error) ends the run with it.
    pub async fn run<H, Fut, E>(&self, handler: H) -> Result<()>
    where
        H: Fn(Taken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<Vec<u8>, E>> + Send + 'static,
        E: Into<WorkFailure> + Send + 'static,
    {
        self.deduper.validate()?;
        self.deduper.start_expiry();
        let lease_ttl = self.deduper.lease_ttl();
        let handler = Arc::new(handler);
        let slots = Arc::new(Semaphore::new(self.concurrency));
        let wake = match self.inbox.wake(&self.namespace).await {
            Ok(wake) => wake,
            Err(e) if e.is_retryable() => {
                tracing::warn!(namespace = %self.namespace, error = %e, "the store's wake-ups could not be set up; polling only");
                Wake::poll()
            }
            Err(e) => return Err(e),
        };
        let poll = self.poll.unwrap_or(if wake.everywhere {
            DEFAULT_PUSHED_POLL
        } else {
            DEFAULT_POLL
        });
        // Takes in a row that found nothing, for the idle backoff.
        let mut idle = 0u32;
        loop {
            let free = tokio::select! {
                biased;
                () = self.stop.cancelled() => return Ok(()),
                permit = Arc::clone(&slots).acquire_owned() => match permit {
                    Ok(permit) => {
                        // One slot is ours; take as many items as slots are free.
                        let extra = slots.available_permits();
                        (permit, extra)
                    }
                    Err(_) => return Ok(()),
                },
            };
            let (first, extra) = free;
            let want = (1 + extra).min(MAX_TAKE);
            // Listening before the take: an item accepted after it found
            // nothing wakes the wait below (`notify_waiters` reaches only
            // listeners already registered).
            let mut woken = wake.signal.as_deref().map(|s| Box::pin(s.notified()));
            if let Some(woken) = woken.as_mut() {
                woken.as_mut().enable();
            }
            let sooner = self.scheduled.sooner.notified();
            tokio::pin!(sooner);
            sooner.as_mut().enable();
            let taken = match self.inbox.take(&self.namespace, want, lease_ttl).await {
                Ok(taken) => taken,
                // A corrupt item is the store's to report, not a reason to stop
                // working the namespace's other items.
                Err(e) if e.is_retryable() || matches!(e, Error::CorruptRecord { .. }) => {
                    tracing::warn!(namespace = %self.namespace, error = %e, "take failed; trying again");
                    drop(first);
                    self.pause(poll).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if taken.is_empty() {
                drop(first);
                idle = idle.saturating_add(1);
                let mut wait = if wake.idle_backoff {
                    poll.saturating_mul(1u32 << (idle - 1).min(MAX_IDLE_BACKOFF.ilog2()))
                } else {
                    poll
                };
                if let Some(next) = self.scheduled.next() {
                    wait = wait.min(next);
                }
                let signalled = async {
                    match woken {
                        Some(woken) => woken.await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = signalled => idle = 0,
                    () = &mut sooner => {}
                    () = self.pause(wait) => {}
                }
                continue;
            }
            idle = 0;
            if taken.len() == want {
                // There may be more: the next waiting worker looks too.
                if let Some(signal) = &wake.signal {
                    signal.notify_one();
                }
            }
            let mut first = Some(first);
            for item in taken {
                let permit = match first.take() {
                    Some(permit) => permit,
                    // Taken for the free slots counted above.
                    None => match Arc::clone(&slots).try_acquire_owned() {
                        Ok(permit) => permit,
                        Err(_) => Arc::clone(&slots)
                            .acquire_owned()
                            .await
                            .map_err(|_| Error::unavailable("the worker stopped", None))?,
                    },
                };
                let lease = item.lease.clone();
                let (this, handler) = (self.clone(), Arc::clone(&handler));
                let spawned = self.deduper.spawn(async move {
                    // The next item of its ordering key falls due as this one
                    // settles (I15), with no wake-up of the store's: look now.
                    let ordered = item.ordering_key.is_some();
                    this.process(&*handler, item).await;
                    drop(permit);
                    if ordered {
                        this.scheduled.add(Duration::ZERO);
                    }
                });
                if spawned.is_err() {
                    // Shutdown began while the take was on its way: give the
                    // item back at once, due now, rather than hold it for
                    // its whole lease unrun.
                    if let Err(e) = self.inbox.release(&lease).await {
                        tracing::warn!(key = %lease.key, error = %e, "an item taken as shutdown began could not be given back; it is due again when its lease passes");
                    }
                }
            }
        }
    }

    /// Waits between half and all of `wait`, or less if shutdown begins.
    async fn pause(&self, wait: Duration) {
        tokio::select! {
            () = tokio::time::sleep(poll_wait(wait)) => {}
            () = self.stop.cancelled() => {}
        }
    }

    /// Runs one item to its settlement.
    async fn process<H, Fut, E>(&self, handler: &H, item: Taken)
    where
        H: Fn(Taken) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<u8>, E>>,
        E: Into<WorkFailure>,
    {
        let lease = item.lease.clone();
        let attempt = lease.attempt;
        let snooze_until = item.accepted_at + self.max_snooze;
        let max_attempts = item.max_attempts.unwrap_or(self.max_attempts);
        if item.takeovers >= self.max_takeovers {
            let error = format!(
                "quarantined: its workers died holding it {} times (max_takeovers {})",
                item.takeovers, self.max_takeovers
            );
            match self.inbox.fail(&lease, &error, self.dead()).await {
                Ok(()) => {
                    count_inbox_outcome(&self.namespace, "quarantined");
                    tracing::error!(key = %lease.key, attempt, error, "item quarantined")
                }
                Err(e) => {
                    tracing::error!(key = %lease.key, error = %e, "could not quarantine an item; it is due again when its lease passes")
                }
            }
            return;
        }
        if attempt == 1 && item.takeovers == 0 {
            let waited = SystemTime::now()
                .duration_since(item.accepted_at)
                .unwrap_or_default();
            metrics::histogram!("dedupe_inbox_wait_seconds", "namespace" => self.namespace.clone())
                .record(waited.as_secs_f64());
        }
        let store: Arc<dyn DedupeStore> = Arc::clone(&self.inbox) as Arc<dyn DedupeStore>;
        let mut holder = self.deduper.holder_on(store, self.deduper.lease_ttl());
        // A panic or a run past the time bound is a failure of the attempt
        // (a release would hand it back, free: CONTRACT.md I9).
        let this = self.clone();
        holder.on_failure = Some(Arc::new(move |lease: Lease, what: String| {
            let this = this.clone();
            Box::pin(async move {
                let retry = this.retry(lease.attempt, max_attempts, Then::Backoff);
                this.inbox.fail(&lease, &what, retry).await?;
                this.failed(&lease, &what, retry);
                Ok(())
            })
        }));
        let retention = self.deduper.retention().for_namespace(&self.namespace);
        let span = tracing::info_span!("dedupe.inbox.item", key = %lease.key, attempt);
        let work = async {
            let started = std::time::Instant::now();
            let ran = handler(item).await;
            metrics::histogram!("dedupe_inbox_processing_seconds", "namespace" => self.namespace.clone())
                .record(started.elapsed().as_secs_f64());
            match ran {
                Ok(outcome) => {
                    count_inbox_outcome(&self.namespace, "completed");
                    ((), Settle::Complete { outcome, retention })
                }
                Err(e) => {
                    let mut failure: WorkFailure = e.into();
                    if let Then::Snooze(delay) = failure.then {
                        if SystemTime::now() + delay <= snooze_until {
                            self.snooze(&lease, delay, &failure.error).await;
                            return ((), Settle::Settled);
                        }
                        failure = WorkFailure::retry_after(
                            delay,
                            format!(
                                "snoozed past its window (max_snooze {:?} from its accept): {}",
                                self.max_snooze, failure.error
                            ),
                        );
                    }
                    let retry = self.retry(attempt, max_attempts, failure.then);
                    self.fail(&lease, &failure.error, retry).await;
                    ((), Settle::Settled)
                }
            }
        };
        use tracing::Instrument;
        let _worked = holder
            .hold(self.deduper.tasks(), lease.clone(), work)
            .instrument(span)
            .await;
    }

    /// What a failure of attempt `attempt` of an item allowed `max_attempts`
    /// that asks for `then` does.
    fn retry(&self, attempt: u32, max_attempts: u32, then: Then) -> Retry {
        match then {
            Then::Dead => self.dead(),
            _ if attempt >= max_attempts => self.dead(),
            Then::Backoff => Retry::After(self.backoff.delay(attempt)),
            Then::After(delay) | Then::Snooze(delay) => Retry::After(delay),
        }
    }

    /// Dead, kept for this worker's retention.
    fn dead(&self) -> Retry {
        Retry::Dead {
            keep: self.dead_retention,
        }
    }

    /// Logs a failure the store recorded, and remembers when its item is
    /// due again.
    fn failed(&self, lease: &Lease, error: &str, retry: Retry) {
        match retry {
            Retry::Dead { .. } => {
                count_inbox_outcome(&self.namespace, "dead");
                tracing::error!(key = %lease.key, attempt = lease.attempt, error, "item dead")
            }
            Retry::After(delay) => {
                count_inbox_outcome(&self.namespace, "retried");
                self.scheduled.add(delay);
                tracing::warn!(key = %lease.key, attempt = lease.attempt, error, ?delay, "item failed; due again")
            }
        }
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) {
        match self.inbox.fail(lease, error, retry).await {
            Ok(()) => self.failed(lease, error, retry),
            Err(e) => {
                tracing::error!(key = %lease.key, error = %e, "could not record an item's failure; it is due again when its lease passes")
            }
        }
    }

    async fn snooze(&self, lease: &Lease, delay: Duration, why: &str) {
        match self.inbox.snooze(lease, delay).await {
            Ok(()) => {
                count_inbox_outcome(&self.namespace, "snoozed");
                self.scheduled.add(delay);
                tracing::info!(key = %lease.key, attempt = lease.attempt, why, ?delay, "item snoozed")
            }
            Err(e) => {
                tracing::error!(key = %lease.key, error = %e, "could not snooze an item; it is due again when its lease passes")
            }
        }
    }

    /// Stops taking items and waits up to `grace` for the running ones; past
    /// it, they are dropped mid-way and given back (due again now, the
    /// attempt not spent). This is the deduper's [`shutdown`](Deduper::shutdown): work
    /// of other front doors on the same deduper (or its clones) is drained
    /// too, and none starts afterwards; give a worker a `Deduper` of its own
    /// to stop it apart.
    pub async fn shutdown(&self, grace: Duration) -> Drained {
        self.stop();
        self.deduper.shutdown(grace).await
    }

    /// Stops taking items (this worker and its clones); the running ones go
    /// on. For several workers on one deduper: stop each, then drain them
    /// all with one [`Deduper::shutdown`].
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

/// Reads `namespace`'s counts ([`Inbox::counts`], [`Inbox::paused`]) and
/// sets the gauges `dedupe_inbox_items{namespace, state}` (pending, running,
/// failed, dead), `dedupe_inbox_oldest_due_age_seconds{namespace}` (0 when
/// nothing waits), `dedupe_inbox_paused{namespace}` (0 or 1) and
/// `dedupe_inbox_counts_seconds{namespace}` (what this read took), through
/// the `metrics` facade. Call it on an interval, not per scrape: on most
/// stores a count reads the namespace's index (`dedupe serve` does it every
/// `--gauges-every-ms`).
pub async fn record_inbox_gauges(inbox: &dyn Inbox, namespace: &str) -> Result<InboxCounts> {
    let started = Instant::now();
    let counts = inbox.counts(namespace).await?;
    let paused = inbox.paused(namespace).await?;
    let ns = namespace.to_string();
    for (state, n) in [
        ("pending", counts.pending),
        ("running", counts.running),
        ("failed", counts.failed),
        ("dead", counts.dead),
    ] {
        metrics::gauge!("dedupe_inbox_items", "namespace" => ns.clone(), "state" => state)
            .set(n as f64);
    }
    let age = counts
        .oldest_due
        .and_then(|due| SystemTime::now().duration_since(due).ok())
        .unwrap_or_default();
    metrics::gauge!("dedupe_inbox_oldest_due_age_seconds", "namespace" => ns.clone())
        .set(age.as_secs_f64());
    metrics::gauge!("dedupe_inbox_paused", "namespace" => ns.clone())
        .set(f64::from(u8::from(paused)));
    metrics::gauge!("dedupe_inbox_counts_seconds", "namespace" => ns)
        .set(started.elapsed().as_secs_f64());
    Ok(counts)
}

/// Counts one outcome of an inbox item in `dedupe_inbox_outcomes_total`
/// (labels `namespace`, `outcome`), as [`InboxWorker`] does for `completed`,
/// `retried`, `snoozed`, `dead` and `quarantined`, and [`Bulk`](crate::Bulk)
/// for `replayed`: for an operator surface that replays an item itself.
/// Through the `metrics` facade: nothing without a recorder.
pub fn count_inbox_outcome(namespace: &str, outcome: &'static str) {
    metrics::counter!("dedupe_inbox_outcomes_total", "namespace" => namespace.to_string(), "outcome" => outcome)
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::ItemStatus;
    use crate::{ClaimOptions, ClaimOutcome, Deduper, Key, MemoryStore};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::SystemTime;

    /// A worker running on a task of its own.
    struct Running {
        worker: InboxWorker,
        task: tokio::task::JoinHandle<Result<()>>,
    }

    impl Running {
        fn start<H, Fut, E>(worker: &InboxWorker, handler: H) -> Self
        where
            H: Fn(Taken) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = std::result::Result<Vec<u8>, E>> + Send + 'static,
            E: Into<WorkFailure> + Send + 'static,
        {
            let worker = worker.clone();
            let task = tokio::spawn({
                let worker = worker.clone();
                async move { worker.run(handler).await }
            });
            Self { worker, task }
        }

        /// Shuts the worker down with `grace`; its run must end Ok.
        async fn stop(self, grace: Duration) -> Drained {
            let drained = self.worker.shutdown(grace).await;
            self.task
                .await
                .expect("the worker's task")
                .expect("the worker's run");
            drained
        }
    }

    /// The item under `key` once `until` holds for it; panics with the item
    /// after 10 s.
    async fn item_when(
        inbox: &MemoryStore,
        key: &Key,
        until: impl Fn(&crate::Item) -> bool,
    ) -> crate::Item {
        let started = std::time::Instant::now();
        loop {
            let item = inbox.item(key).await.expect("in the test");
            match item {
                Some(item) if until(&item) => return item,
                item => assert!(started.elapsed() < Duration::from_secs(10), "{item:?}"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// 20 items, four at a time: the good ones run once each and are done
    /// records; the poison ones fail three times (a backoff between) and are
    /// dead with their last error; nothing runs after shutdown.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn items_run_once_and_poison_dies_after_its_attempts() {
        let inbox = MemoryStore::new();
        for i in 0..20 {
            let payload: &[u8] = if i % 5 == 0 { b"poison" } else { b"good" };
            inbox
                .accept(
                    &Key::new("w", format!("evt_{i:02}")).expect("in the test"),
                    payload,
                )
                .await
                .expect("in the test");
        }
        let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..20).map(|_| AtomicUsize::new(0)).collect());
        let deduper = Deduper::new(inbox.clone()).with_lease_ttl(Duration::from_secs(5));
        let worker = InboxWorker::new(&deduper, inbox.clone(), "w")
            .with_concurrency(4)
            .with_max_attempts(3)
            .with_backoff(Backoff {
                first: Duration::from_millis(10),
                max: Duration::from_millis(40),
            })
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&worker, {
            let runs = Arc::clone(&runs);
            move |taken| {
                let runs = Arc::clone(&runs);
                async move {
                    let i: usize = taken.lease.key.id()[4..].parse().expect("in the test");
                    runs[i].fetch_add(1, Ordering::SeqCst);
                    if taken.payload == b"poison" {
                        Err(format!("poisoned at attempt {}", taken.lease.attempt))
                    } else {
                        Ok(format!("done {i}").into_bytes())
                    }
                }
            }
        });
        let started = std::time::Instant::now();
        loop {
            let c = inbox.counts("w").await.expect("in the test");
            if c.pending + c.running + c.failed == 0 {
                assert_eq!(c.dead, 4, "{c:?}");
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "{c:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let drained = running.stop(Duration::from_secs(1)).await;
        assert_eq!(drained.aborted, 0);
        for i in 0..20 {
            let key = Key::new("w", format!("evt_{i:02}")).expect("in the test");
            let ran = runs[i].load(Ordering::SeqCst);
            if i % 5 == 0 {
                assert_eq!(ran, 3, "poison {i} ran {ran} times");
                let item = inbox
                    .item(&key)
                    .await
                    .expect("in the test")
                    .expect("dead item");
                assert_eq!(item.status, ItemStatus::Dead);
                assert_eq!(item.attempts, 3);
                assert_eq!(item.last_error.as_deref(), Some("poisoned at attempt 3"));
            } else {
                assert_eq!(ran, 1, "item {i} ran {ran} times");
                match inbox
                    .claim(&key, &ClaimOptions::default())
                    .await
                    .expect("in the test")
                {
                    ClaimOutcome::Duplicate { outcome, .. } => {
                        assert_eq!(outcome, format!("done {i}").into_bytes())
                    }
                    other => panic!("item {i}: {other:?}"),
                }
            }
        }
    }

    /// A dead item replayed by an operator runs once more (and, failing
    /// again, is dead again at its new attempt).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replayed_dead_item_runs_again() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "poison").expect("in the test");
        inbox.accept(&key, b"x").await.expect("in the test");
        let runs = Arc::new(AtomicUsize::new(0));
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_max_attempts(2)
            .with_backoff(Backoff {
                first: Duration::from_millis(5),
                max: Duration::from_millis(5),
            })
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&worker, {
            let runs = Arc::clone(&runs);
            move |_| {
                let runs = Arc::clone(&runs);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Err::<Vec<u8>, _>("still broken")
                }
            }
        });
        let dead = || async {
            inbox
                .item(&key)
                .await
                .expect("in the test")
                .is_some_and(|i| i.status == ItemStatus::Dead)
        };
        while !dead().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(inbox.replay(&key).await.expect("in the test"));
        while runs.load(Ordering::SeqCst) < 3 || !dead().await {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.stop(Duration::from_secs(1)).await;
        let item = inbox.item(&key).await.expect("in the test").expect("dead");
        assert_eq!(
            (item.status, item.attempts, runs.load(Ordering::SeqCst)),
            (ItemStatus::Dead, 3, 3)
        );
    }

    /// A handler that never ends: shutdown's grace runs out, the item is
    /// given back (due again, no attempt spent), and a second worker
    /// finishes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_item_cut_off_by_shutdown_is_given_back() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "slow").expect("in the test");
        inbox.accept(&key, b"x").await.expect("in the test");
        let stuck = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&stuck, |_| async {
            std::future::pending::<()>().await;
            Ok::<Vec<u8>, String>(Vec::new())
        });
        while inbox.counts("w").await.expect("in the test").running == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let drained = running.stop(Duration::from_millis(50)).await;
        assert_eq!(drained.aborted, 1);
        let item = inbox
            .item(&key)
            .await
            .expect("in the test")
            .expect("given back");
        // Given back free: shutdown spends no attempt (CONTRACT.md I9).
        assert_eq!((item.status, item.attempts), (ItemStatus::Pending, 0));

        let second = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_poll_interval(Duration::from_millis(5));
        let finishing = Running::start(&second, |_| async { Ok::<_, String>(b"ok".to_vec()) });
        while inbox.item(&key).await.expect("in the test").is_some() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        finishing.stop(Duration::from_secs(1)).await;
        assert!(matches!(
            inbox
                .claim(&key, &ClaimOptions::default())
                .await
                .expect("in the test"),
            ClaimOutcome::Duplicate { .. }
        ));
    }

    /// An item whose workers died holding it three times is quarantined by
    /// the worker that takes it over next: dead, with an error saying so, and
    /// the handler never runs it. (Without the check the handler runs it.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_item_that_kills_its_workers_is_quarantined() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "kills-workers").expect("in the test");
        inbox.accept(&key, b"x").await.expect("in the test");
        // Three workers take it and die: their leases pass.
        for _ in 0..3 {
            let taken = inbox
                .take("w", 1, Duration::from_millis(20))
                .await
                .expect("in the test");
            assert_eq!(taken.len(), 1);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let runs = Arc::new(AtomicUsize::new(0));
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&worker, {
            let runs = Arc::clone(&runs);
            move |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, String>(b"ran".to_vec()) }
            }
        });
        let dead = item_when(&inbox, &key, |i| i.status == ItemStatus::Dead).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0, "a quarantined item ran");
        assert_eq!((dead.takeovers, dead.attempts), (3, 4));
        assert_eq!(
            dead.last_error.as_deref(),
            Some("quarantined: its workers died holding it 3 times (max_takeovers 3)")
        );
        running.stop(Duration::from_secs(1)).await;
    }

    /// An item's own attempt limit, set at accept, wins over the worker's: a
    /// worker allowing 8 attempts leaves an item accepted with 1 dead after
    /// its first failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_items_own_limit_wins_over_the_workers() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "one-try").expect("in the test");
        inbox
            .accept_with(&key, b"x", &crate::AcceptOptions::new().max_attempts(1))
            .await
            .expect("in the test");
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_max_attempts(8)
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&worker, |_| async {
            Err::<Vec<u8>, _>("refused".to_string())
        });
        let item = item_when(&inbox, &key, |i| {
            i.status != ItemStatus::Pending && i.status != ItemStatus::Running
        })
        .await;
        assert_eq!((item.status, item.attempts), (ItemStatus::Dead, 1));
        running.stop(Duration::from_secs(1)).await;
    }

    /// A handler that panics fails its attempt with the panic's message: with
    /// one attempt allowed the item is dead after one run. (Were a panic a
    /// hand-back, free, the item would run forever and this fails.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_fails_its_attempt() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "panics").expect("in the test");
        inbox.accept(&key, b"x").await.expect("in the test");
        let runs = Arc::new(AtomicUsize::new(0));
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w")
            .with_max_attempts(1)
            .with_poll_interval(Duration::from_millis(5));
        let running = Running::start(&worker, {
            let runs = Arc::clone(&runs);
            move |_| {
                let ran = runs.fetch_add(1, Ordering::SeqCst);
                async move {
                    if ran < usize::MAX {
                        panic!("boom in the handler");
                    }
                    Ok::<Vec<u8>, String>(Vec::new())
                }
            }
        });
        let dead = item_when(&inbox, &key, |i| i.status == ItemStatus::Dead).await;
        assert_eq!(dead.attempts, 1);
        assert_eq!(
            dead.last_error.as_deref(),
            Some("the work panicked: boom in the handler")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "a dead item ran again");
        running.stop(Duration::from_secs(1)).await;
    }

    /// A handler hung on its first attempt, with the default settings: the
    /// item stays running nine minutes in, then the default bound fails the
    /// attempt (counted, the bound as its error) and the retry completes it.
    /// Without the bound the item is held for as long as the process lives
    /// and this fails.
    #[tokio::test(start_paused = true)]
    async fn a_hung_item_fails_at_the_default_bound() {
        let inbox = MemoryStore::new();
        let key = Key::new("w", "hung").expect("in the test");
        inbox.accept(&key, b"x").await.expect("in the test");
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "w");
        let running = Running::start(&worker, |taken| async move {
            if taken.lease.attempt == 1 {
                std::future::pending::<()>().await;
            }
            Ok::<_, String>(b"second".to_vec())
        });
        tokio::time::sleep(Duration::from_secs(9 * 60)).await;
        let item = inbox.item(&key).await.expect("in the test").expect("held");
        assert_eq!((item.status, item.attempts), (ItemStatus::Running, 1));
        let mut failed = None;
        tokio::time::timeout(Duration::from_secs(2 * 60), async {
            while let Some(item) = inbox.item(&key).await.expect("in the test") {
                if item.status == ItemStatus::Failed {
                    // Its retry is due on the wall clock, which a paused
                    // runtime does not move.
                    std::thread::sleep(Duration::from_millis(20));
                    failed = Some(item);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the default bound did not end the hung attempt: {:?}",
                futures_util::FutureExt::now_or_never(inbox.item(&key))
            )
        });
        match inbox
            .claim(&key, &ClaimOptions::default())
            .await
            .expect("in the test")
        {
            ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"second"),
            other => panic!("{other:?}"),
        }
        let failed = failed.expect("the hung attempt failed before the retry");
        assert_eq!(failed.attempts, 1);
        assert_eq!(
            failed.last_error.as_deref(),
            Some("the work ran past its time bound of 600s")
        );
        running.stop(Duration::from_secs(1)).await;
    }

    /// A worker polling every 30 s takes an item accepted while it waits at
    /// once: the inbox's accepted signal wakes it (test fails without it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_accepted_item_wakes_an_idle_worker() {
        let inbox = MemoryStore::new();
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "wake")
            .with_poll_interval(Duration::from_secs(30));
        let running = Running::start(&worker, |_| async { Ok::<_, String>(b"done".to_vec()) });
        // The worker found nothing and waits out its poll.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let key = Key::new("wake", "evt_1").expect("in the test");
        let accepted = std::time::Instant::now();
        inbox.accept(&key, b"{}").await.expect("in the test");
        while inbox.item(&key).await.expect("in the test").is_some() {
            assert!(
                accepted.elapsed() < Duration::from_secs(5),
                "the item waited for the poll"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.stop(Duration::from_secs(1)).await;
    }

    /// A memory inbox whose wake-ups are what the test says (a pushed signal
    /// nothing ever raises: every notification dropped; or a poll with idle
    /// backoff), counting its takes.
    #[derive(Debug, Clone)]
    struct Muted {
        inner: MemoryStore,
        wake: Wake,
        takes: Arc<AtomicUsize>,
    }

    impl Muted {
        fn new(wake: Wake) -> Self {
            Self {
                inner: MemoryStore::new(),
                wake,
                takes: Arc::default(),
            }
        }
    }

    #[async_trait::async_trait]
    impl DedupeStore for Muted {
        async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
            self.inner.claim(key, opts).await
        }
        async fn complete(&self, lease: &Lease, outcome: &[u8], keep: Duration) -> Result<()> {
            self.inner.complete(lease, outcome, keep).await
        }
        async fn release(&self, lease: &Lease) -> Result<()> {
            self.inner.release(lease).await
        }
        async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
            self.inner.extend(lease, ttl).await
        }
        async fn expire(&self) -> Result<u64> {
            self.inner.expire().await
        }
        async fn get(&self, key: &Key) -> Result<Option<crate::Record>> {
            self.inner.get(key).await
        }
        async fn forget(&self, key: &Key) -> Result<bool> {
            self.inner.forget(key).await
        }
    }

    #[async_trait::async_trait]
    impl Inbox for Muted {
        async fn accept_with(
            &self,
            key: &Key,
            payload: &[u8],
            options: &crate::AcceptOptions,
        ) -> Result<crate::Accepted> {
            self.inner.accept_with(key, payload, options).await
        }
        async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
            self.takes.fetch_add(1, Ordering::SeqCst);
            self.inner.take(namespace, max, lease).await
        }
        async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
            self.inner.snooze(lease, delay).await
        }
        async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
            self.inner.fail(lease, error, retry).await
        }
        async fn item(&self, key: &Key) -> Result<Option<crate::Item>> {
            self.inner.item(key).await
        }
        async fn list(&self, query: &crate::ItemQuery) -> Result<crate::ItemPage> {
            self.inner.list(query).await
        }
        async fn forget_if(
            &self,
            key: &Key,
            status: crate::ItemStatus,
            attempts: u32,
        ) -> Result<bool> {
            self.inner.forget_if(key, status, attempts).await
        }
        async fn replay(&self, key: &Key) -> Result<bool> {
            self.inner.replay(key).await
        }
        async fn counts(&self, namespace: &str) -> Result<crate::InboxCounts> {
            self.inner.counts(namespace).await
        }
        async fn pause(&self, namespace: &str) -> Result<bool> {
            self.inner.pause(namespace).await
        }
        async fn resume(&self, namespace: &str) -> Result<bool> {
            self.inner.resume(namespace).await
        }
        async fn paused(&self, namespace: &str) -> Result<bool> {
            self.inner.paused(namespace).await
        }
        async fn wake(&self, _namespace: &str) -> Result<Wake> {
            Ok(self.wake.clone())
        }
    }

    /// Every notification dropped (a store that says it pushes, and never
    /// does): an item accepted while the worker waits is still taken, at the
    /// poll. The test fails when the worker waits on the signal alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_wake_up_costs_at_most_the_poll() {
        let inbox = Muted::new(Wake::pushed(Arc::default()));
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "muted")
            .with_poll_interval(Duration::from_millis(300));
        let running = Running::start(&worker, |_| async { Ok::<_, String>(b"done".to_vec()) });
        while inbox.takes.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let key = Key::new("muted", "evt_1").expect("in the test");
        let accepted = Instant::now();
        inbox.accept(&key, b"{}").await.expect("in the test");
        // Muted, the accept wakes no one: the item waits for the next poll
        // (between 150 and 300 ms after the last look), never for more.
        while inbox.item(&key).await.expect("in the test").is_some() {
            assert!(
                accepted.elapsed() < Duration::from_millis(1500),
                "the item waited {:?}, more than the 300 ms poll allows",
                accepted.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.stop(Duration::from_secs(1)).await;
    }

    /// A store that pushes gets a rare poll (2 s), yet an item this worker
    /// failed with a short delay runs again when due: the worker looks for
    /// the due times it set itself. The test fails when the retry waits for
    /// the poll (or for a poll of 30 s here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retry_this_worker_set_runs_when_due_not_at_the_poll() {
        let inbox = Muted::new(Wake::pushed(Arc::default()));
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "soon")
            .with_poll_interval(Duration::from_secs(30));
        let key = Key::new("soon", "evt_1").expect("in the test");
        inbox.accept(&key, b"{}").await.expect("in the test");
        let runs = Arc::new(AtomicUsize::new(0));
        let first_failed = Arc::new(Mutex::new(None));
        let running = Running::start(&worker, {
            let (runs, first_failed) = (Arc::clone(&runs), Arc::clone(&first_failed));
            move |_| {
                let (runs, first_failed) = (Arc::clone(&runs), Arc::clone(&first_failed));
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        *first_failed.lock().expect("in the test") = Some(Instant::now());
                        return Err(WorkFailure::retry_after(
                            Duration::from_millis(300),
                            "429 Too Many Requests",
                        ));
                    }
                    Ok(b"done".to_vec())
                }
            }
        });
        let started = Instant::now();
        while inbox.item(&key).await.expect("in the test").is_some() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the retry waited for the poll: {} runs",
                runs.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let failed = first_failed
            .lock()
            .expect("in the test")
            .expect("the first run failed");
        assert!(failed.elapsed() >= Duration::from_millis(300));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        running.stop(Duration::from_secs(1)).await;
    }

    /// On a store with idle backoff, an idle worker's waits grow to eight
    /// times its interval: over 1.2 s at a 20 ms interval it takes far fewer
    /// than the 60-120 times it would without backoff (the test fails
    /// without it); an item found then resets the wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_worker_backs_off_where_reads_are_billed() {
        let inbox = Muted::new(Wake::poll().with_idle_backoff(true));
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "idle")
            .with_poll_interval(Duration::from_millis(20));
        let running = Running::start(&worker, |_| async { Ok::<_, String>(b"done".to_vec()) });
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let takes = inbox.takes.load(Ordering::SeqCst);
        // 20 + 40 + 80 ms, then 160 ms each (drawn between half and all).
        assert!((4..=20).contains(&takes), "{takes} takes in 1.2 s");
        let key = Key::new("idle", "evt_1").expect("in the test");
        inbox.accept(&key, b"{}").await.expect("in the test");
        let accepted = Instant::now();
        while inbox.item(&key).await.expect("in the test").is_some() {
            assert!(accepted.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.stop(Duration::from_secs(1)).await;
    }

    /// A handler's failure says what comes next: `permanent` is dead after
    /// one attempt (of five), `retry_after` is due the delay from its
    /// failure (not on the 10 ms backoff), and a plain error is due on the
    /// backoff; each keeps its error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_says_when_the_item_runs_again() {
        let inbox = MemoryStore::new();
        for id in ["gone", "later", "plain"] {
            inbox
                .accept(&Key::new("f", id).expect("in the test"), id.as_bytes())
                .await
                .expect("in the test");
        }
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "f")
            .with_max_attempts(5)
            .with_backoff(Backoff {
                first: Duration::from_millis(10),
                max: Duration::from_millis(10),
            })
            .with_poll_interval(Duration::from_millis(5));
        let started = SystemTime::now();
        let running = Running::start(&worker, |taken| async move {
            match &taken.payload[..] {
                b"gone" => Err(WorkFailure::permanent("404: the customer is gone")),
                b"later" => Err(WorkFailure::retry_after(
                    Duration::from_secs(3600),
                    "429: come back in an hour",
                )),
                _ => Err(WorkFailure::from("500: try again")),
            }
        });
        let item = |id: &'static str| {
            let inbox = inbox.clone();
            async move {
                inbox
                    .item(&Key::new("f", id).expect("in the test"))
                    .await
                    .expect("in the test")
                    .expect("an item")
            }
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while item("plain").await.attempts < 3 || item("gone").await.status != ItemStatus::Dead {
            assert!(
                std::time::Instant::now() < deadline,
                "the items never failed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        running.stop(Duration::from_secs(1)).await;
        let gone = item("gone").await;
        assert_eq!((gone.status, gone.attempts), (ItemStatus::Dead, 1));
        assert_eq!(
            gone.last_error.as_deref(),
            Some("404: the customer is gone")
        );
        let later = item("later").await;
        assert_eq!((later.status, later.attempts), (ItemStatus::Failed, 1));
        assert!(
            later.due_at >= started + Duration::from_secs(3590),
            "due {:?} after the start, not in an hour",
            later.due_at.duration_since(started)
        );
        let plain = item("plain").await;
        assert!(plain.attempts >= 3, "the backoff's retries ran");
        assert_eq!(plain.last_error.as_deref(), Some("500: try again"));
    }

    /// The items of one ordering key run one after the other without
    /// waiting for the poll: each completion makes the next due, and the
    /// worker looks for it at once (a 30 s poll would take 30 s an item).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_item_of_an_ordering_key_runs_without_waiting_for_the_poll() {
        let inbox = MemoryStore::new();
        for i in 0..5 {
            inbox
                .accept_with(
                    &Key::new("o", format!("evt_{i}")).expect("in the test"),
                    b"x",
                    &crate::AcceptOptions::new().ordering_key("cus_1"),
                )
                .await
                .expect("in the test");
        }
        let deduper = Deduper::new(inbox.clone());
        let worker = InboxWorker::new(&deduper, inbox.clone(), "o")
            .with_poll_interval(Duration::from_secs(30));
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let running = Running::start(&worker, {
            let order = Arc::clone(&order);
            move |taken: Taken| {
                let order = Arc::clone(&order);
                async move {
                    order
                        .lock()
                        .expect("in the test")
                        .push(taken.lease.key.id().to_string());
                    Ok::<_, WorkFailure>(b"done".to_vec())
                }
            }
        });
        let started = std::time::Instant::now();
        while order.lock().expect("in the test").len() < 5 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "ran {:?} in 5 s",
                order.lock().expect("in the test")
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.stop(Duration::from_secs(1)).await;
        assert_eq!(
            *order.lock().expect("in the test"),
            ["evt_0", "evt_1", "evt_2", "evt_3", "evt_4"]
        );
    }

    /// The dead letters a worker leaves get its `dead_retention`: those of
    /// a worker set to 1.5 s are removed by the `expire()` after it (not by
    /// one before), those of a worker keeping them are not, and the default
    /// is [`DEAD_RETENTION`](crate::DEAD_RETENTION).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_items_keep_the_workers_retention() {
        let inbox = MemoryStore::new();
        for ns in ["short", "kept", "default"] {
            inbox
                .accept(&Key::new(ns, "poison").expect("in the test"), b"x")
                .await
                .expect("in the test");
        }
        let deduper = Deduper::new(inbox.clone());
        let base = |ns: &str| {
            InboxWorker::new(&deduper, inbox.clone(), ns)
                .with_poll_interval(Duration::from_millis(5))
        };
        assert_eq!(base("x").dead_retention, Some(crate::DEAD_RETENTION));
        // Long enough that the check before it passes is made well before.
        const KEEP: Duration = Duration::from_millis(1500);
        let workers = [
            base("short").with_dead_retention(Some(KEEP)),
            base("kept").with_dead_retention(None),
            base("default"),
        ];
        let mut running = Vec::new();
        for worker in &workers {
            running.push(Running::start(worker, |_| async {
                Err::<Vec<u8>, _>(WorkFailure::permanent("never"))
            }));
        }
        let there = |ns: &'static str| {
            let inbox = inbox.clone();
            async move {
                inbox
                    .item(&Key::new(ns, "poison").expect("in the test"))
                    .await
                    .expect("in the test")
                    .is_some()
            }
        };
        let short = Key::new("short", "poison").expect("in the test");
        let died = item_when(&inbox, &short, |i| i.status == ItemStatus::Dead)
            .await
            .due_at;
        assert_eq!(inbox.expire().await.expect("in the test"), 0);
        assert!(there("short").await, "removed before its retention");
        for ns in ["kept", "default"] {
            let key = Key::new(ns, "poison").expect("in the test");
            item_when(&inbox, &key, |i| i.status == ItemStatus::Dead).await;
        }
        for r in running {
            r.stop(Duration::from_secs(1)).await;
        }
        let past = (died + KEEP + Duration::from_millis(20))
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        tokio::time::sleep(past).await;
        assert_eq!(inbox.expire().await.expect("in the test"), 1);
        assert!(!there("short").await, "kept past its retention");
        assert!(there("kept").await && there("default").await);
    }

    /// A snooze spends no attempt: an item allowed two attempts snoozes five
    /// times and then completes. An item that snoozes on and on runs out of
    /// its window (`max_snooze` from its accept): its snoozes then count as
    /// failures and it ends dead, saying why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snooze_spends_no_attempt_within_its_window() {
        let inbox = MemoryStore::new();
        let patient = Key::new("s", "patient").expect("in the test");
        let restless = Key::new("s", "restless").expect("in the test");
        for key in [&patient, &restless] {
            inbox
                .accept(key, key.id().as_bytes())
                .await
                .expect("in the test");
        }
        let worker = InboxWorker::new(&Deduper::new(inbox.clone()), inbox.clone(), "s")
            .with_max_attempts(2)
            .with_max_snooze(Duration::from_millis(400))
            .with_backoff(Backoff {
                first: Duration::from_millis(5),
                max: Duration::from_millis(5),
            })
            .with_poll_interval(Duration::from_millis(5));
        let runs = Arc::new(AtomicUsize::new(0));
        let running = Running::start(&worker, {
            let runs = runs.clone();
            move |taken| {
                let runs = runs.clone();
                async move {
                    let patient = &taken.payload[..] == b"patient";
                    if patient && runs.fetch_add(1, Ordering::SeqCst) >= 5 {
                        return Ok(b"done".to_vec());
                    }
                    Err(WorkFailure::snooze(
                        Duration::from_millis(20),
                        "the order it follows is not in yet",
                    ))
                }
            }
        });
        let dead = item_when(&inbox, &restless, |i| i.status == ItemStatus::Dead).await;
        assert_eq!(dead.attempts, 2);
        let error = dead.last_error.expect("an error");
        assert!(
            error.starts_with("snoozed past its window") && error.contains("not in yet"),
            "{error}"
        );
        let started = std::time::Instant::now();
        while inbox.item(&patient).await.expect("in the test").is_some() {
            assert!(started.elapsed() < Duration::from_secs(10), "never done");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 6);
        let record = inbox.get(&patient).await.expect("in the test");
        assert!(
            matches!(
                record.map(|r| r.state),
                Some(crate::RecordState::Done { .. })
            ),
            "the patient item is not done"
        );
        running.stop(Duration::from_secs(1)).await;
    }

    #[test]
    fn poll_waits_are_spread_around_the_interval() {
        let poll = Duration::from_millis(250);
        let waits: Vec<Duration> = (0..400).map(|_| poll_wait(poll)).collect();
        assert!(
            waits.iter().all(|w| *w >= poll / 2 && *w <= poll),
            "{waits:?}"
        );
        let spread: std::collections::HashSet<_> = waits.iter().collect();
        assert!(spread.len() > 100, "no jitter: {spread:?}");
        let mean = waits.iter().sum::<Duration>() / 400;
        assert!(
            mean > poll * 65 / 100 && mean < poll * 85 / 100,
            "the mean wait {mean:?} is not three quarters of the interval"
        );
    }

    #[test]
    fn backoff_doubles_within_its_bounds_with_jitter() {
        let b = Backoff {
            first: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for (attempt, full) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            let full = Duration::from_millis(full);
            for _ in 0..50 {
                let d = b.delay(attempt);
                assert!(
                    d >= full / 2 && d <= full,
                    "attempt {attempt}: {d:?} of {full:?}"
                );
            }
        }
        let spread: std::collections::HashSet<Duration> = (0..50).map(|_| b.delay(3)).collect();
        assert!(spread.len() > 10, "no jitter: {spread:?}");
    }
}

/// What a handler's failure asks of the worker: any error (anything
/// `Display`) is retried on the worker's [`Backoff`]; a `WorkFailure` can
/// instead say when to try again ([`retry_after`](Self::retry_after): an
/// API's `Retry-After` passed on) or that no attempt will ever succeed
/// ([`permanent`](Self::permanent): dead now, with its error, instead of
/// burning every attempt over hours of backoff). Every failure spends an
/// attempt, and an item out of attempts is dead whatever it asked.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::WorkFailure;
///
/// fn answer(status: u16) -> Result<Vec<u8>, WorkFailure> {
///     match status {
///         200 => Ok(b"sent".to_vec()),
///         404 => Err(WorkFailure::permanent("the customer is gone (404)")),
///         429 => Err(WorkFailure::retry_after(Duration::from_secs(30), "rate limited (429)")),
///         _ => Err(format!("the API answered {status}").into()), // the backoff
///     }
/// }
/// assert!(answer(404).is_err());
/// ```
#[derive(Debug)]
pub struct WorkFailure {
    error: String,
    then: Then,
}

/// When a failed item runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Backoff,
    After(Duration),
    Snooze(Duration),
    Dead,
}

impl WorkFailure {
    /// Retried on the worker's backoff (what any other error does).
    pub fn retry(error: impl Display) -> Self {
        Self {
            error: error.to_string(),
            then: Then::Backoff,
        }
    }

    /// Retried `delay` from now, not on the backoff (a `Retry-After`),
    /// cut to 1 ms to [`MAX_TTL`](crate::MAX_TTL).
    pub fn retry_after(delay: Duration, error: impl Display) -> Self {
        Self {
            error: error.to_string(),
            then: Then::After(delay.clamp(Duration::from_millis(1), crate::MAX_TTL)),
        }
    }

    /// Given back for `delay` (cut to 1 ms to [`MAX_TTL`](crate::MAX_TTL))
    /// without spending an attempt: the work could not start yet and no
    /// failure happened (the resource it waits for is not there yet, a
    /// quota window is full). `why` is logged. Bounded: a snooze that would
    /// end past the worker's
    /// [`max_snooze`](InboxWorker::with_max_snooze) window from the item's
    /// accept is a failure after `delay` instead, the attempt spent.
    pub fn snooze(delay: Duration, why: impl Display) -> Self {
        Self {
            error: why.to_string(),
            then: Then::Snooze(delay.clamp(Duration::from_millis(1), crate::MAX_TTL)),
        }
    }

    /// Dead now: no attempt will succeed (a 404, a payload that can never be
    /// processed). `dedupe inbox replay` runs it again.
    pub fn permanent(error: impl Display) -> Self {
        Self {
            error: error.to_string(),
            then: Then::Dead,
        }
    }

    /// The error, as the item keeps it.
    pub fn error(&self) -> &str {
        &self.error
    }
}

/// Any error is a failure retried on the backoff. (`WorkFailure` is not
/// `Display` itself, so that this conversion can take every error.)
impl<E: Display> From<E> for WorkFailure {
    fn from(error: E) -> Self {
        Self::retry(error)
    }
}
