//! The high-level helper: claim, run the caller's work, then complete or release.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::claim::{check_ttl, ClaimOptions, ClaimOutcome, Lease};
use crate::error::Error;
use crate::expire_task::{spawn_expire_task, ExpireTask};
use crate::key::Key;
use crate::retention::Retention;
use crate::store::DedupeStore;
use crate::traced::TracedStore;
use crate::work::{Drained, Holder, Settle, Tasks, Worked};

/// First byte of an outcome the [`Deduper`] stored for work that succeeded.
const SUCCEEDED: u8 = 0x01;
/// First byte of an outcome the [`Deduper`] stored for a failure kept with
/// [`OnFailure::Keep`]; the error's text follows.
const FAILED: u8 = 0x02;

/// The stored form of an outcome: one tag byte, then the bytes.
fn framed(tag: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 1);
    out.push(tag);
    out.extend_from_slice(bytes);
    out
}

/// What to do with the claim when the work returns an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFailure {
    /// Release the claim, so the provider's next delivery runs the work again.
    /// The right choice when failures are transient (the default).
    #[default]
    Release,
    /// Complete the claim with the error's text stored as a failure, so later
    /// deliveries are answered [`Handled::Failed`] (never as a success) and the
    /// work never runs again. For work that must not be retried (a payment call
    /// whose result is unknown).
    Keep,
}

/// How a delivery was handled, when nothing failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// This delivery won the claim, ran the work and recorded its outcome.
    Ran {
        /// The outcome the work returned, now stored.
        outcome: Vec<u8>,
        /// Which attempt this was (above 1 after a takeover of a dead worker's lease).
        attempt: u32,
    },
    /// The event was processed before and succeeded: the work did not run.
    Duplicate {
        /// The outcome stored by the run that did the work.
        outcome: Vec<u8>,
    },
    /// The event was processed before and its work failed, and that failure was
    /// kept ([`OnFailure::Keep`]): the work did not run again. Do not answer this
    /// as a success.
    Failed {
        /// The text of the error the work returned.
        error: String,
    },
    /// Another delivery is processing the event right now: the work did not run.
    /// Answer the provider with a retryable status so it comes back later.
    InFlight {
        /// When the other delivery's lease passes.
        deadline: SystemTime,
    },
    /// The key was seen with a different payload: the work did not run.
    Mismatch,
}

/// What a failed [`Deduper::run`] tells the caller.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandleError<E> {
    /// The store failed before the work ran; the work did not run.
    Store(Error),
    /// The work ran and failed.
    Work {
        /// The work's error.
        error: E,
        /// What became of the claim: `Ok(OnFailure::Release)` when it was released,
        /// `Ok(OnFailure::Keep)` when the failure was stored, `Err` when the store
        /// refused (the lease then passes at its deadline and nothing is lost).
        claim: Result<OnFailure, Error>,
    },
    /// The work ran and succeeded, but its completion could not be recorded (lease
    /// lost, store down). The event may be delivered and processed again.
    NotRecorded {
        /// The outcome the work returned.
        outcome: Vec<u8>,
        /// Why it was not recorded.
        source: Error,
    },
    /// The work ran past [`Deduper::with_max_work_time`]: it was dropped mid-way
    /// and its claim released (`released` is the store's answer), so the next
    /// delivery runs it again.
    TimedOut {
        /// The bound it ran past.
        limit: Duration,
        /// The store's answer to the release.
        released: Result<(), Error>,
    },
    /// [`Deduper::shutdown`] ran out of grace while the work ran: it was dropped
    /// mid-way and its claim released.
    Aborted {
        /// The store's answer to the release.
        released: Result<(), Error>,
    },
}

impl<E: fmt::Display> fmt::Display for HandleError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandleError::Store(e) => write!(f, "claim failed, work not run: {e}"),
            HandleError::Work { error, claim } => match claim {
                Ok(OnFailure::Release) => write!(f, "work failed (claim released): {error}"),
                Ok(OnFailure::Keep) => write!(f, "work failed (failure stored): {error}"),
                Err(e) => write!(
                    f,
                    "work failed: {error}; and the claim could not be settled: {e}"
                ),
            },
            HandleError::NotRecorded { source, .. } => {
                write!(f, "work succeeded but was not recorded: {source}")
            }
            HandleError::TimedOut { limit, .. } => {
                write!(
                    f,
                    "work ran past its bound of {limit:?}; dropped, claim released"
                )
            }
            HandleError::Aborted { .. } => {
                write!(f, "work aborted by shutdown; claim released")
            }
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for HandleError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HandleError::Store(e) | HandleError::NotRecorded { source: e, .. } => Some(e),
            HandleError::Work { error, .. } => Some(error),
            HandleError::TimedOut { .. } | HandleError::Aborted { .. } => None,
        }
    }
}

/// Claims, runs the caller's work, then completes with its output or releases.
///
/// The outcome is stored with one leading tag byte that tells a success from a
/// failure kept with [`OnFailure::Keep`] (so the work's outcome may be at most
/// the store's limit minus one byte; a kept failure's text is cut to fit); a record of the same namespace completed
/// by other code than a `Deduper` is answered with `CorruptRecord` rather than
/// guessed at. Every store call goes through a [`TracedStore`], so each is a
/// `dedupe.<operation>` span.
///
/// ```
/// use std::sync::Arc;
/// use dedupe_core::{Deduper, Handled, Key, MemoryStore};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let deduper = Deduper::new(MemoryStore::new());
/// let key = Key::new("stripe", "evt_1")?;
/// let first = deduper
///     .run(&key, |_lease| async { Ok::<_, std::io::Error>(b"order 17".to_vec()) })
///     .await?;
/// assert!(matches!(first, Handled::Ran { .. }));
/// let again = deduper
///     .run(&key, |_lease| async { Ok::<_, std::io::Error>(b"order 18".to_vec()) })
///     .await?;
/// assert_eq!(again, Handled::Duplicate { outcome: b"order 17".to_vec() });
/// # Ok::<(), Box<dyn std::error::Error>>(()) }).unwrap();
/// ```
///
/// # What happens when
///
/// The claim and the work run in a Tokio task of their own; the future `run`
/// returns only awaits that task. So:
///
/// - **The caller's future is dropped** (client gone, timeout, a `select!`
///   that took another branch): the work goes on to its end and settles its
///   claim as if nothing happened. Nothing frees the claim while the work may
///   still be running, so no second delivery runs it meanwhile: copies are
///   answered [`Handled::InFlight`] until it is done, then
///   [`Handled::Duplicate`].
/// - **The work panics**: the claim is released, then the panic carries on in
///   the caller (`run` resumes it).
/// - **The work fails**: released, or kept as a failure ([`OnFailure`]).
/// - **The work runs past [`with_max_work_time`](Self::with_max_work_time)**:
///   it is dropped and its claim released: [`HandleError::TimedOut`].
/// - **[`shutdown`](Self::shutdown)**: no new work starts; running work is
///   waited for up to the grace, then dropped and its claim released
///   ([`HandleError::Aborted`]).
/// - **The process crashes**: nothing is released; the lease passes at its
///   deadline and the next delivery takes the event over (attempt 2). Work with
///   effects outside the store should pass the key downstream as that call's
///   own idempotency key, so the takeover's repeat is a no-op there too (see
///   the example on [`run`](Self::run)).
///
/// Clones share the store, the settings and the set of running tasks.
#[derive(Debug, Clone)]
pub struct Deduper {
    store: Arc<dyn DedupeStore>,
    lease_ttl: Duration,
    retention: Retention,
    on_failure: OnFailure,
    heartbeat: bool,
    max_work_time: Duration,
    tasks: Arc<Tasks>,
    /// How often the store's expired records are removed (`None`: never,
    /// by this deduper).
    expiry: Option<Duration>,
    /// The expiry task, started by the first work (shared by the clones).
    expire_task: Arc<std::sync::Mutex<Expiry>>,
}

/// Where the deduper's expiry task is.
#[derive(Debug, Default)]
enum Expiry {
    #[default]
    NotStarted,
    /// Kept for its `Drop`, which stops the task.
    Running {
        _task: ExpireTask,
    },
    Stopped,
}

impl Deduper {
    /// Default lease of a claim: longer than a webhook provider waits for an
    /// answer. The heartbeat extends a running claim every third of it, so
    /// this bounds how long a crashed process holds a key, not how long work
    /// may run.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
    /// Default bound on the work's run. The heartbeat keeps a running
    /// claim, so without a bound work hung on a call with no timeout would
    /// hold its key (every copy answered in flight) for as long as the
    /// process lives. Ten minutes is far past any provider's wait.
    pub const DEFAULT_MAX_WORK_TIME: Duration = Duration::from_secs(600);
    /// Default period of the expiry task: how often records past their
    /// retention are deleted (the first pass when the first work starts).
    pub const DEFAULT_EXPIRY_PERIOD: Duration = Duration::from_secs(3600);

    /// A helper over `store` (any store, an `Arc` of one included) with the
    /// default policy: a lease of [`DEFAULT_LEASE`](Self::DEFAULT_LEASE)
    /// kept alive by the heartbeat, work bounded by
    /// [`DEFAULT_MAX_WORK_TIME`](Self::DEFAULT_MAX_WORK_TIME), done records
    /// kept for [`Retention::default`], failures released, and the store's
    /// expired records deleted every
    /// [`DEFAULT_EXPIRY_PERIOD`](Self::DEFAULT_EXPIRY_PERIOD) by a task the
    /// first work starts ([`with_expiry`](Self::with_expiry)). Every front
    /// door (the webhook receiver, the `Idempotency-Key` layer, the inbox
    /// worker) takes its lifecycle from a `Deduper`, so these are theirs too.
    pub fn new<S: DedupeStore>(store: S) -> Self {
        Self {
            store: Arc::new(TracedStore::new(store)),
            lease_ttl: Self::DEFAULT_LEASE,
            retention: Retention::default(),
            on_failure: OnFailure::default(),
            heartbeat: true,
            max_work_time: Self::DEFAULT_MAX_WORK_TIME,
            tasks: Arc::default(),
            expiry: Some(Self::DEFAULT_EXPIRY_PERIOD),
            expire_task: Arc::default(),
        }
    }

    /// How often the store's records past their retention are deleted
    /// (`expire()`), by a Tokio task that the first work of this deduper
    /// (or of a front door over it) starts and [`shutdown`](Self::shutdown)
    /// stops; the clones share it. `None` turns it off: for a process that
    /// leaves the deletion to another (`dedupe purge` from cron,
    /// [`spawn_expire_task`](crate::spawn_expire_task) of its own). A store
    /// that expires records itself (Redis, DynamoDB's TTL:
    /// [`Capabilities::expires_by_itself`](crate::Capabilities)) gets no
    /// task. Shutdown stops it without waiting for a pass under way (each
    /// of its statements is whole; the next pass finishes the work).
    pub fn with_expiry(mut self, period: Option<Duration>) -> Self {
        self.expiry = period.map(|p| p.max(Duration::from_millis(1)));
        self
    }

    /// Starts the expiry task if it is due to run and is not running: on
    /// the first work, inside the runtime the work runs on.
    pub(crate) fn start_expiry(&self) {
        let Some(period) = self.expiry else { return };
        let caps = self.store.capabilities();
        if !caps.explicit_expire
            || caps.expires_by_itself
            || tokio::runtime::Handle::try_current().is_err()
        {
            return;
        }
        let mut state = self
            .expire_task
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if matches!(*state, Expiry::NotStarted) {
            *state = Expiry::Running {
                _task: spawn_expire_task(Arc::clone(&self.store), period),
            };
        }
    }

    /// Sets the lease TTL of each claim. A TTL outside
    /// [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL) is reported by
    /// [`validate`](Self::validate), and by every run as
    /// [`HandleError::Store`] before anything is claimed.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// The lease TTL of each claim.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Checks the settings: `Ok` when every run can use them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dedupe_core::{Deduper, MemoryStore};
    /// assert!(Deduper::new(MemoryStore::new()).validate().is_ok());
    /// assert!(Deduper::new(MemoryStore::new()).with_lease_ttl(Duration::ZERO).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        check_ttl("lease ttl", self.lease_ttl)?;
        check_ttl("max work time", self.max_work_time)?;
        Ok(())
    }

    /// Sets how long done records are kept, per namespace.
    pub fn with_retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// Sets what happens to the claim when the work fails.
    pub fn with_on_failure(mut self, on_failure: OnFailure) -> Self {
        self.on_failure = on_failure;
        self
    }

    /// Whether the lease is kept alive while the work runs (on by default):
    /// every third of the lease TTL it is extended by a full TTL, so work
    /// longer than the lease is not taken over. The extension runs beside
    /// the work, which goes on meanwhile. The work is bounded either way
    /// ([`with_max_work_time`](Self::with_max_work_time)), so a hung worker
    /// never holds its key for longer than the bound. Off, work longer than
    /// the lease is taken over by the next delivery. If an extension finds
    /// the lease lost, the work goes on and its completion reports
    /// [`HandleError::NotRecorded`].
    pub fn with_heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// Bounds how long the work may run (default
    /// [`DEFAULT_MAX_WORK_TIME`](Self::DEFAULT_MAX_WORK_TIME), 10 minutes):
    /// past `limit` it is dropped, its claim released (the next delivery
    /// runs it again), and the run answers [`HandleError::TimedOut`]; this
    /// is logged at `ERROR` and counted
    /// (`dedupe_work_total{outcome="timed_out"}`). A limit outside
    /// [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL) is
    /// reported by [`validate`](Self::validate).
    pub fn with_max_work_time(mut self, limit: Duration) -> Self {
        self.max_work_time = limit;
        self
    }

    /// The bound on the work's run.
    pub fn max_work_time(&self) -> Duration {
        self.max_work_time
    }

    /// Whether the heartbeat is on.
    pub fn heartbeat(&self) -> bool {
        self.heartbeat
    }

    /// How long done records are kept.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// What happens to the claim when the work fails.
    pub fn on_failure(&self) -> OnFailure {
        self.on_failure
    }

    /// The store underneath, behind its [`TracedStore`].
    pub fn store(&self) -> &Arc<dyn DedupeStore> {
        &self.store
    }

    /// Runs `work` once for `key`, with the default claim options.
    ///
    /// The work's lease is its own, and so is its key: pass the key on to the
    /// services the work calls as their idempotency key, so that the one case
    /// where the work can run twice (the process crashed mid-work and a later
    /// delivery took the event over) is a no-op downstream too:
    ///
    /// ```
    /// use dedupe_core::{Deduper, Handled, Key, MemoryStore};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let deduper = Deduper::new(MemoryStore::new());
    /// let key = Key::new("stripe", "evt_1P9x")?;
    /// let handled = deduper
    ///     .run(&key, |lease| async move {
    ///         // e.g. POST /v1/refunds with `Idempotency-Key: <key>`: Stripe
    ///         // answers a repeat with the first refund instead of a second.
    ///         let idempotency_key = lease.key.to_string();
    ///         Ok::<_, std::io::Error>(format!("refund under {idempotency_key}").into_bytes())
    ///     })
    ///     .await?;
    /// assert!(matches!(handled, Handled::Ran { attempt: 1, .. }));
    /// # Ok::<(), Box<dyn std::error::Error>>(()) }).unwrap();
    /// ```
    pub async fn run<F, Fut, E>(&self, key: &Key, work: F) -> Result<Handled, HandleError<E>>
    where
        F: FnOnce(Lease) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<u8>, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_with(key, ClaimOptions::new(self.lease_ttl), work)
            .await
    }

    /// Runs `work` once for `key`, with claim options of the caller's (fingerprint,
    /// claim id, lease TTL).
    #[tracing::instrument(name = "dedupe.run", skip_all, fields(key = %key))]
    pub async fn run_with<F, Fut, E>(
        &self,
        key: &Key,
        opts: ClaimOptions,
        work: F,
    ) -> Result<Handled, HandleError<E>>
    where
        F: FnOnce(Lease) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<u8>, E>> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        opts.validate().map_err(HandleError::Store)?;
        check_ttl("max work time", self.max_work_time).map_err(HandleError::Store)?;
        let this = self.clone();
        let key = key.clone();
        let task = self
            .spawn(async move { this.claim_and_run(key, opts, work).await }.in_current_span())
            .map_err(HandleError::Store)?;
        match task.await {
            Ok(Ok(handled)) => handled,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(join) => Err(HandleError::Store(Error::unavailable(
                format!("the run's task ended early: {join}"),
                None,
            ))),
        }
    }

    /// Spawns `fut` as a task of this `Deduper` (and its clones): one that
    /// [`shutdown`](Self::shutdown) waits for. Dropping the handle detaches it;
    /// the task goes on. For integrations that claim and [`hold`](Self::hold)
    /// in a task of their own (the webhook receiver); refused once shutdown
    /// has begun.
    pub fn spawn<F>(&self, fut: F) -> Result<JoinHandle<F::Output>, Error>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.start_expiry();
        self.tasks.spawn(fut)
    }

    /// Runs `work` under `lease` in the calling task: the heartbeat (when on)
    /// beside it, the time bound, the shutdown deadline; then settles the claim
    /// as the work says ([`Settle`]). This is the lifecycle [`run`](Self::run)
    /// uses; call it from a task of [`spawn`](Self::spawn), never from a future
    /// someone else may drop.
    pub async fn hold<T, W>(&self, lease: Lease, work: W) -> Worked<T>
    where
        W: Future<Output = (T, Settle)>,
    {
        self.holder(self.lease_ttl)
            .hold(&self.tasks, lease, work)
            .await
    }

    /// Stops starting work and waits up to `grace` for the running work of
    /// this `Deduper` and its clones to finish; work still running then is
    /// dropped and its claims released. Runs started afterwards answer
    /// [`HandleError::Store`] with a retryable error.
    pub async fn shutdown(&self, grace: Duration) -> Drained {
        let expiry = std::mem::replace(
            &mut *self
                .expire_task
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
            Expiry::Stopped,
        );
        // Dropping the task's handle stops it before its next pass; a pass
        // under way is not waited for, so it never holds the grace.
        drop(expiry);
        self.tasks.shutdown(grace).await
    }

    fn holder(&self, ttl: Duration) -> Holder {
        self.holder_on(Arc::clone(&self.store), ttl)
    }

    /// This deduper's lifecycle policy over another handle of the store (the
    /// inbox worker's, which settles items through its inbox).
    pub(crate) fn holder_on(&self, store: Arc<dyn DedupeStore>, ttl: Duration) -> Holder {
        Holder {
            store,
            ttl,
            heartbeat: self.heartbeat,
            max_time: self.max_work_time,
            on_failure: None,
        }
    }

    /// The running tasks this deduper and its clones share.
    pub(crate) fn tasks(&self) -> &Tasks {
        &self.tasks
    }

    /// The run's task: claim, hold the work, and say what happened (a panic
    /// of the work comes back as its payload, its claim released).
    async fn claim_and_run<F, Fut, E>(
        self,
        key: Key,
        opts: ClaimOptions,
        work: F,
    ) -> Result<Result<Handled, HandleError<E>>, Box<dyn std::any::Any + Send>>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
        E: fmt::Display,
    {
        let lease = match self.store.claim(&key, &opts).await {
            Ok(ClaimOutcome::Claimed(lease)) => lease,
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => {
                return Ok(unframe(&key, outcome).map_err(HandleError::Store))
            }
            Ok(ClaimOutcome::InFlight { deadline, .. }) => {
                return Ok(Ok(Handled::InFlight { deadline }))
            }
            Ok(ClaimOutcome::Mismatch { .. }) => return Ok(Ok(Handled::Mismatch)),
            Err(e) => return Ok(Err(HandleError::Store(e))),
        };
        let attempt = lease.attempt;
        let retention = self.retention.for_namespace(key.namespace());
        let on_failure = self.on_failure;
        let limit = self
            .store
            .capabilities()
            .max_outcome_bytes
            .saturating_sub(1);
        let worked = self
            .holder(opts.lease_ttl)
            .hold(&self.tasks, lease.clone(), async move {
                // The closure is called here, inside the hold: a panic in it
                // releases the claim like a panic in the future it returns.
                let result = work(lease).await;
                let settle = match (&result, on_failure) {
                    (Ok(outcome), _) => Settle::Complete {
                        outcome: framed(SUCCEEDED, outcome),
                        retention,
                    },
                    (Err(_), OnFailure::Release) => Settle::Release,
                    (Err(error), OnFailure::Keep) => {
                        // A long error message is cut to what the store keeps, so
                        // the failure is always stored and never run again.
                        let text = error.to_string();
                        let mut end = text.len().min(limit);
                        while !text.is_char_boundary(end) {
                            end -= 1;
                        }
                        Settle::Complete {
                            outcome: framed(FAILED, &text.as_bytes()[..end]),
                            retention,
                        }
                    }
                };
                (result, settle)
            })
            .await;
        Ok(match worked {
            Worked::Returned {
                value: Ok(outcome),
                settled,
            } => match settled {
                Ok(()) => Ok(Handled::Ran { outcome, attempt }),
                Err(source) => Err(HandleError::NotRecorded { outcome, source }),
            },
            Worked::Returned {
                value: Err(error),
                settled,
            } => Err(HandleError::Work {
                error,
                claim: settled.map(|()| on_failure),
            }),
            Worked::Panicked { payload, released } => {
                if let Err(error) = released {
                    tracing::warn!(%error, "release after a panic in the work failed");
                }
                return Err(payload);
            }
            Worked::TimedOut { limit, released } => Err(HandleError::TimedOut { limit, released }),
            Worked::Aborted { released } => Err(HandleError::Aborted { released }),
            Worked::AlreadyRunning { deadline } => Ok(Handled::InFlight { deadline }),
        })
    }
}

/// What a stored outcome says: a success with its bytes, or a kept failure.
fn unframe(key: &Key, mut stored: Vec<u8>) -> Result<Handled, Error> {
    match stored.first().copied() {
        Some(SUCCEEDED) => {
            stored.remove(0);
            Ok(Handled::Duplicate { outcome: stored })
        }
        Some(FAILED) => Ok(Handled::Failed {
            error: String::from_utf8_lossy(&stored[1..]).into_owned(),
        }),
        _ => Err(Error::corrupt(
            key,
            "the stored outcome was not written by a Deduper (no success or failure tag)",
        )),
    }
}
