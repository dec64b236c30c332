//! What a claim takes (options) and gives back (a lease, or why not).

use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::key::{ClaimId, Fingerprint, Key, LeaseToken};
use crate::record::RecordStateKind;

/// Shortest lease or retention a store accepts.
pub const MIN_TTL: Duration = Duration::from_millis(1);
/// Longest lease or retention a store accepts (10 years): beyond it, deadlines
/// stop being meaningful and arithmetic on them risks overflow.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Most keys one `claim_many` call takes. A larger batch is refused with
/// [`Error::BatchTooLarge`](crate::Error::BatchTooLarge) before anything is
/// sent, so one call never holds a statement, a pipeline or a fan-out of
/// unbounded size.
pub const MAX_BATCH_KEYS: usize = 10_000;

/// Refuses a `claim_many` batch over [`MAX_BATCH_KEYS`]; stores call it before
/// anything reaches storage.
///
/// ```
/// use dedupe_core::{backend::check_batch, Key, MAX_BATCH_KEYS};
/// let keys = vec![Key::new("s", "k").unwrap(); MAX_BATCH_KEYS + 1];
/// assert!(check_batch(&keys[..MAX_BATCH_KEYS]).is_ok());
/// assert!(check_batch(&keys).is_err());
/// ```
pub fn check_batch(keys: &[crate::Key]) -> Result<()> {
    if keys.len() > MAX_BATCH_KEYS {
        return Err(crate::Error::BatchTooLarge {
            size: keys.len(),
            limit: MAX_BATCH_KEYS,
        });
    }
    Ok(())
}

/// Checks a lease or retention duration against [`MIN_TTL`]..=[`MAX_TTL`].
pub fn check_ttl(what: &str, ttl: Duration) -> Result<()> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Error::config(format!(
            "{what} of {ttl:?} is outside {MIN_TTL:?}..={MAX_TTL:?}"
        )));
    }
    Ok(())
}

/// How a claim is made.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{ClaimId, ClaimOptions, Fingerprint};
/// let opts = ClaimOptions::new(Duration::from_secs(30))
///     .with_fingerprint(Fingerprint::sha256(b"{\"id\":\"evt_1\"}"))
///     .with_claim_id(ClaimId::new("req-42")?);
/// assert_eq!(opts.lease_ttl, Duration::from_secs(30));
/// # Ok::<(), dedupe_core::KeyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimOptions {
    /// How long the winner holds the event before another delivery may take it over.
    /// Choose it longer than the work takes, or heartbeat with `extend`.
    pub lease_ttl: Duration,
    /// Digest of the payload; a stored record with another digest answers `Mismatch`.
    pub fingerprint: Option<Fingerprint>,
    /// Caller-chosen id that makes a retried claim re-entrant.
    pub claim_id: Option<ClaimId>,
}

impl ClaimOptions {
    /// Default lease: five minutes, longer than any webhook handler should run.
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(300);

    /// Options with the given lease TTL and nothing else.
    pub fn new(lease_ttl: Duration) -> Self {
        Self {
            lease_ttl,
            fingerprint: None,
            claim_id: None,
        }
    }

    /// Sets the payload fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// Sets the claim id.
    pub fn with_claim_id(mut self, claim_id: ClaimId) -> Self {
        self.claim_id = Some(claim_id);
        self
    }

    /// Checks the lease TTL against [`MIN_TTL`]`..=`[`MAX_TTL`]; stores call this
    /// before writing anything.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dedupe_core::ClaimOptions;
    /// assert!(ClaimOptions::new(Duration::ZERO).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        check_ttl("lease ttl", self.lease_ttl)
    }
}

impl Default for ClaimOptions {
    fn default() -> Self {
        Self::new(Self::DEFAULT_LEASE_TTL)
    }
}

/// What a winning claim hands back: the right to process the event until `deadline`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The key claimed.
    pub key: Key,
    /// The fencing token: only its holder may complete, release or extend.
    pub token: LeaseToken,
    /// When the lease passes and another delivery may take over.
    pub deadline: SystemTime,
    /// Which winning claim of this record this is: 1 for the first, 2 after one
    /// takeover of an expired lease, and so on.
    pub attempt: u32,
    /// The claim id the claim carried, if any.
    pub claim_id: Option<ClaimId>,
}

impl Lease {
    /// Whether this claim took over an in-flight record whose lease had passed
    /// (a worker died or stalled).
    pub fn is_takeover(&self) -> bool {
        self.attempt > 1
    }
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum ClaimOutcome {
    /// This caller won: process the event, then complete or release the lease.
    Claimed(Lease),
    /// Another caller holds a live lease on the event. Answer the provider with a
    /// retryable status (or wait) and do not process it.
    InFlight {
        /// When that lease passes.
        deadline: SystemTime,
        /// Which attempt holds it.
        attempt: u32,
    },
    /// The event was processed already, inside its retention.
    Duplicate {
        /// The outcome the winner stored, byte for byte.
        outcome: Vec<u8>,
        /// When it was completed.
        completed_at: SystemTime,
    },
    /// A record exists for this key with a different payload fingerprint.
    Mismatch {
        /// The state of that record.
        state: RecordStateKind,
    },
}

impl ClaimOutcome {
    /// The lease, when this caller won.
    pub fn lease(&self) -> Option<&Lease> {
        match self {
            ClaimOutcome::Claimed(lease) => Some(lease),
            _ => None,
        }
    }

    /// A short name of the answer, for logs and reports.
    pub fn kind(&self) -> &'static str {
        match self {
            ClaimOutcome::Claimed(_) => "claimed",
            ClaimOutcome::InFlight { .. } => "in-flight",
            ClaimOutcome::Duplicate { .. } => "duplicate",
            ClaimOutcome::Mismatch { .. } => "mismatch",
        }
    }
}
