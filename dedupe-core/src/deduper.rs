//! The high-level helper: claim, run the caller's work, then complete or release.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::FutureExt;

use crate::claim::{check_ttl, ClaimOptions, ClaimOutcome, Lease, MIN_TTL};
use crate::error::Error;
use crate::key::Key;
use crate::retention::Retention;
use crate::store::DedupeStore;
use crate::traced::TracedStore;

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
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for HandleError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HandleError::Store(e) | HandleError::NotRecorded { source: e, .. } => Some(e),
            HandleError::Work { error, .. } => Some(error),
        }
    }
}

/// Releases a lease when dropped while still armed: the work's future was dropped
/// (request cancelled, timeout) before it settled the claim.
struct ReleaseOnDrop {
    store: Arc<dyn DedupeStore>,
    lease: Option<Lease>,
}

impl ReleaseOnDrop {
    fn disarm(&mut self) -> Option<Lease> {
        self.lease.take()
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let store = Arc::clone(&self.store);
                runtime.spawn(async move {
                    if let Err(error) = store.release(&lease).await {
                        tracing::warn!(key = %lease.key, %error, "release after cancelled work failed; the lease passes at its deadline");
                    }
                });
            }
            Err(_) => tracing::warn!(
                key = %lease.key,
                "work dropped outside a Tokio runtime; the lease passes at its deadline"
            ),
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
/// If the work panics, the claim is released before the panic carries on. If the
/// future returned by `run` is dropped mid-work, the claim is released on a task
/// spawned on the current Tokio runtime.
#[derive(Debug, Clone)]
pub struct Deduper {
    store: Arc<dyn DedupeStore>,
    lease_ttl: Duration,
    retention: Retention,
    on_failure: OnFailure,
    heartbeat: bool,
}

impl Deduper {
    /// A helper over `store` (any store, an `Arc` of one included) with the
    /// default lease, retention and failure policy.
    pub fn new<S: DedupeStore>(store: S) -> Self {
        Self {
            store: Arc::new(TracedStore::new(store)),
            lease_ttl: ClaimOptions::DEFAULT_LEASE_TTL,
            retention: Retention::default(),
            on_failure: OnFailure::default(),
            heartbeat: false,
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

    /// Checks the settings: `Ok` when every run can use them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dedupe_core::{Deduper, MemoryStore};
    /// assert!(Deduper::new(MemoryStore::new()).validate().is_ok());
    /// assert!(Deduper::new(MemoryStore::new()).with_lease_ttl(Duration::ZERO).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        check_ttl("lease ttl", self.lease_ttl)
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

    /// Keeps the lease alive while the work runs: every third of the lease TTL it
    /// is extended by a full TTL, so work longer than the lease is not taken over.
    /// Off by default: a heartbeat also keeps a hung worker's lease alive for as
    /// long as its process lives. If an extension finds the lease lost, the work
    /// goes on and its completion reports [`HandleError::NotRecorded`].
    pub fn with_heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// The store underneath, behind its [`TracedStore`].
    pub fn store(&self) -> &Arc<dyn DedupeStore> {
        &self.store
    }

    /// Runs `work` once for `key`, with the default claim options.
    pub async fn run<F, Fut, E>(&self, key: &Key, work: F) -> Result<Handled, HandleError<E>>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
        E: fmt::Display,
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
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
        E: fmt::Display,
    {
        opts.validate().map_err(HandleError::Store)?;
        let lease = match self.store.claim(key, &opts).await {
            Ok(ClaimOutcome::Claimed(lease)) => lease,
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => {
                return unframe(key, outcome).map_err(HandleError::Store)
            }
            Ok(ClaimOutcome::InFlight { deadline, .. }) => {
                return Ok(Handled::InFlight { deadline })
            }
            Ok(ClaimOutcome::Mismatch { .. }) => return Ok(Handled::Mismatch),
            Err(e) => return Err(HandleError::Store(e)),
        };
        let attempt = lease.attempt;
        let mut guard = ReleaseOnDrop {
            store: Arc::clone(&self.store),
            lease: Some(lease.clone()),
        };
        let running = AssertUnwindSafe(work(lease.clone())).catch_unwind();
        let result = if self.heartbeat {
            self.with_heartbeat_on(&lease, opts.lease_ttl, running)
                .await
        } else {
            running.await
        };
        guard.disarm();
        let retention = self.retention.for_namespace(key.namespace());
        match result {
            Err(panic) => {
                if let Err(error) = self.store.release(&lease).await {
                    tracing::warn!(%error, "release after a panic in the work failed");
                }
                std::panic::resume_unwind(panic)
            }
            Ok(Ok(outcome)) => match self
                .store
                .complete(&lease, &framed(SUCCEEDED, &outcome), retention)
                .await
            {
                Ok(()) => Ok(Handled::Ran { outcome, attempt }),
                Err(source) => Err(HandleError::NotRecorded { outcome, source }),
            },
            Ok(Err(error)) => {
                let claim = match self.on_failure {
                    OnFailure::Release => self
                        .store
                        .release(&lease)
                        .await
                        .map(|()| OnFailure::Release),
                    OnFailure::Keep => {
                        // A long error message is cut to what the store keeps, so
                        // the failure is always stored and never run again.
                        let limit = self
                            .store
                            .capabilities()
                            .max_outcome_bytes
                            .saturating_sub(1);
                        let text = error.to_string();
                        let mut end = text.len().min(limit);
                        while !text.is_char_boundary(end) {
                            end -= 1;
                        }
                        self.store
                            .complete(&lease, &framed(FAILED, &text.as_bytes()[..end]), retention)
                            .await
                            .map(|()| OnFailure::Keep)
                    }
                };
                Err(HandleError::Work { error, claim })
            }
        }
    }
}

impl Deduper {
    /// Drives `running` to its end, extending `lease` every third of `ttl`.
    async fn with_heartbeat_on<T>(
        &self,
        lease: &Lease,
        ttl: Duration,
        running: impl Future<Output = T>,
    ) -> T {
        let mut running = std::pin::pin!(running);
        let every = (ttl / 3).max(MIN_TTL);
        let mut current = lease.clone();
        loop {
            let beat = std::pin::pin!(tokio::time::sleep(every));
            match futures_util::future::select(running.as_mut(), beat).await {
                futures_util::future::Either::Left((done, _)) => return done,
                futures_util::future::Either::Right(((), _)) => {
                    match self.store.extend(&current, ttl).await {
                        Ok(extended) => current = extended,
                        Err(error) if error.is_retryable() => {
                            // The store is briefly away: beat again next time, the
                            // lease may still be ours.
                            tracing::warn!(key = %lease.key, %error, "heartbeat failed; trying again next beat");
                        }
                        Err(error) => {
                            // Lost: stop beating, let the work finish; its
                            // completion tells the caller what happened.
                            tracing::warn!(key = %lease.key, %error, "heartbeat could not extend the lease");
                            return running.await;
                        }
                    }
                }
            }
        }
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
