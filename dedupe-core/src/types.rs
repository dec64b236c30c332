//! The values a claim takes and gives back, the record as `get` shows it, and
//! retention settings.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::key::{ClaimId, Fingerprint, Key};

/// Shortest lease or retention a store accepts.
pub const MIN_TTL: Duration = Duration::from_millis(1);
/// Longest lease or retention a store accepts (10 years): beyond it, deadlines
/// stop being meaningful and arithmetic on them risks overflow.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Largest outcome a store keeps unless it documents another limit (256 KiB).
pub const DEFAULT_MAX_OUTCOME_BYTES: usize = 256 * 1024;

/// Checks a lease or retention duration against [`MIN_TTL`]..=[`MAX_TTL`].
pub fn check_ttl(what: &str, ttl: Duration) -> Result<()> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Error::config(format!(
            "{what} of {ttl:?} is outside {MIN_TTL:?}..={MAX_TTL:?}"
        )));
    }
    Ok(())
}

/// Milliseconds since the Unix epoch, the unit every store keeps deadlines in.
pub fn to_millis(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

/// The inverse of [`to_millis`].
pub fn from_millis(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

/// Milliseconds in a duration, saturating.
pub fn duration_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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

    /// Checks the lease TTL bounds; stores call this before writing anything.
    pub fn validate(&self) -> Result<()> {
        check_ttl("lease ttl", self.lease_ttl)
    }
}

impl Default for ClaimOptions {
    fn default() -> Self {
        Self::new(Self::DEFAULT_LEASE_TTL)
    }
}

/// A fencing token: no other claim of the same key is ever handed the same one.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LeaseToken(String);

impl LeaseToken {
    /// A fresh random token (128 bits from a UUIDv4, written as 32 hex digits).
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string())
    }

    /// Wraps a token read back from storage.
    pub fn from_stored(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The token as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", self.0)
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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

/// The two states a live record can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordStateKind {
    /// Claimed, work under way.
    InFlight,
    /// Completed, outcome stored.
    Done,
}

/// A record's state with the data that belongs to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed and not yet completed.
    InFlight {
        /// When the lease passes.
        lease_deadline: SystemTime,
    },
    /// Completed.
    Done {
        /// When it was completed.
        completed_at: SystemTime,
        /// When the record may be forgotten.
        retention_deadline: SystemTime,
        /// The stored outcome bytes.
        outcome: Vec<u8>,
    },
}

impl RecordState {
    /// The state without its data.
    pub fn kind(&self) -> RecordStateKind {
        match self {
            RecordState::InFlight { .. } => RecordStateKind::InFlight,
            RecordState::Done { .. } => RecordStateKind::Done,
        }
    }
}

/// A live record as [`DedupeStore::get`](crate::DedupeStore::get) shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Its key.
    pub key: Key,
    /// In flight or done, with the deadlines and outcome.
    pub state: RecordState,
    /// The token of the claim that won it last.
    pub token: LeaseToken,
    /// The claim id of that claim, if it carried one.
    pub claim_id: Option<ClaimId>,
    /// The payload fingerprint stored with it, if any.
    pub fingerprint: Option<Fingerprint>,
    /// How many claims have won it (takeovers count).
    pub attempts: u32,
    /// When it was first claimed.
    pub first_seen: SystemTime,
}

impl Record {
    /// Assembles a record (for store implementations).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: Key,
        state: RecordState,
        token: LeaseToken,
        claim_id: Option<ClaimId>,
        fingerprint: Option<Fingerprint>,
        attempts: u32,
        first_seen: SystemTime,
    ) -> Self {
        Self {
            key,
            state,
            token,
            claim_id,
            fingerprint,
            attempts,
            first_seen,
        }
    }
}

impl Record {
    /// The answer a claim with `opts` gets from this record when it is live (its
    /// deadline not passed): `Mismatch` when both sides carry fingerprints that
    /// differ, `Duplicate` when done, `Claimed` with the same lease when in flight
    /// and held by the same claim id, `InFlight` otherwise.
    ///
    /// Store implementations call this after their atomic claim found a live record,
    /// so every store answers losing claims by the same rule.
    pub fn into_claim_answer(self, opts: &ClaimOptions) -> ClaimOutcome {
        if let (Some(given), Some(stored)) = (&opts.fingerprint, &self.fingerprint) {
            if given != stored {
                return ClaimOutcome::Mismatch {
                    state: self.state.kind(),
                };
            }
        }
        match self.state {
            RecordState::Done {
                completed_at,
                outcome,
                ..
            } => ClaimOutcome::Duplicate {
                outcome,
                completed_at,
            },
            RecordState::InFlight { lease_deadline }
                if opts.claim_id.is_some() && opts.claim_id == self.claim_id =>
            {
                ClaimOutcome::Claimed(Lease {
                    key: self.key,
                    token: self.token,
                    deadline: lease_deadline,
                    attempt: self.attempts,
                    claim_id: self.claim_id,
                })
            }
            RecordState::InFlight { lease_deadline } => ClaimOutcome::InFlight {
                deadline: lease_deadline,
                attempt: self.attempts,
            },
        }
    }
}

/// How long done records are kept, with per-namespace overrides.
///
/// The default is [`Retention::DEFAULT`], 35 days: a done record must outlive the
/// longest window in which a provider can send the event again. Stripe retries
/// automatically for 3 days, lets an operator resend from the dashboard for 15 and
/// from its CLI for 30; GitHub redelivers for 3. Thirty days plus a margin for
/// clock skew and slow operators gives 35. A record kept too short turns a late
/// resend into a second charge; one kept too long costs a few bytes.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::Retention;
/// let retention = Retention::default().with_namespace("github", Duration::from_secs(7 * 86_400))?;
/// assert_eq!(retention.for_namespace("github"), Duration::from_secs(7 * 86_400));
/// assert_eq!(retention.for_namespace("stripe"), Retention::DEFAULT);
/// # Ok::<(), dedupe_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    default: Duration,
    per_namespace: BTreeMap<String, Duration>,
}

impl Retention {
    /// 35 days (see the type's docs for the reasoning).
    pub const DEFAULT: Duration = Duration::from_secs(35 * 24 * 3600);

    /// A policy with the given default and no overrides.
    pub fn new(default: Duration) -> Result<Self> {
        check_ttl("retention", default)?;
        Ok(Self {
            default,
            per_namespace: BTreeMap::new(),
        })
    }

    /// Overrides the retention of one namespace.
    pub fn with_namespace(mut self, namespace: impl Into<String>, keep: Duration) -> Result<Self> {
        check_ttl("retention", keep)?;
        self.per_namespace.insert(namespace.into(), keep);
        Ok(self)
    }

    /// The retention of a namespace.
    pub fn for_namespace(&self, namespace: &str) -> Duration {
        self.per_namespace
            .get(namespace)
            .copied()
            .unwrap_or(self.default)
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            default: Self::DEFAULT,
            per_namespace: BTreeMap::new(),
        }
    }
}

/// What a store can do, so the conformance suite runs what applies and skips the
/// rest visibly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// `expire()` physically removes expired records and counts them. False where
    /// the store expires natively and `expire()` answers 0.
    pub explicit_expire: bool,
    /// Largest outcome, in bytes, that `complete` accepts.
    pub max_outcome_bytes: usize,
}

impl Capabilities {
    /// A store with explicit expiry and the default outcome limit.
    pub const fn new() -> Self {
        Self {
            explicit_expire: true,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
        }
    }

    /// Sets [`Capabilities::explicit_expire`].
    pub const fn with_explicit_expire(mut self, yes: bool) -> Self {
        self.explicit_expire = yes;
        self
    }

    /// Sets [`Capabilities::max_outcome_bytes`].
    pub const fn with_max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Fails with [`Error::OutcomeTooLarge`] when `outcome` is over the limit.
    pub fn check_outcome(&self, outcome: &[u8]) -> Result<()> {
        if outcome.len() > self.max_outcome_bytes {
            return Err(Error::OutcomeTooLarge {
                size: outcome.len(),
                limit: self.max_outcome_bytes,
            });
        }
        Ok(())
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::new()
    }
}
