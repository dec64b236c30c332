//! The one error type every store returns.

use std::time::Duration;

use crate::key::KeyError;

/// A boxed error kept as the source of a store failure.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used across dedupe.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a store operation can fail with.
///
/// An error is never an answer: a store that could not read or write returns one of
/// these, never a `Claimed`, `InFlight` or `Duplicate` it did not read from storage.
/// [`Error::is_retryable`] tells whether the same call may succeed later.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key, claim id or fingerprint was refused before anything was written.
    #[error("invalid key: {0}")]
    InvalidKey(#[from] KeyError),

    /// A setting (lease TTL, retention, table or prefix name, URL...) was refused.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// What was wrong.
        reason: String,
    },

    /// The record no longer holds this lease's token (it was taken over after the
    /// deadline, released, completed or forgotten). Nothing was changed.
    #[error("lease lost on {key}: the record no longer holds this lease's token")]
    LeaseLost {
        /// The key as text (`namespace:id`).
        key: String,
    },

    /// The outcome is larger than the store keeps. Nothing was changed.
    #[error("outcome of {size} bytes is over this store's limit of {limit} bytes")]
    OutcomeTooLarge {
        /// Size given.
        size: usize,
        /// The store's limit.
        limit: usize,
    },

    /// The payload given to [`Inbox::accept`](crate::Inbox::accept) is larger
    /// than an inbox keeps. Nothing was written.
    #[error("payload of {size} bytes is over the inbox's limit of {limit} bytes")]
    PayloadTooLarge {
        /// Size given.
        size: usize,
        /// The limit.
        limit: usize,
    },

    /// `claim_many` was given more keys than [`MAX_BATCH_KEYS`](crate::MAX_BATCH_KEYS).
    /// Nothing was claimed; split the batch.
    #[error("batch of {size} keys is over the limit of {limit} keys")]
    BatchTooLarge {
        /// Keys given.
        size: usize,
        /// The limit.
        limit: usize,
    },

    /// The store could not be reached (connection refused or lost, server restarting,
    /// database locked). Retrying may help.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },

    /// The operation did not finish within its bound. Whether it took effect is
    /// unknown; retrying with the same claim id is safe.
    #[error("store operation timed out after {after:?}")]
    Timeout {
        /// The bound that passed.
        after: Duration,
        /// The driver's error, when it reported one.
        #[source]
        source: Option<BoxError>,
    },

    /// A stored record could not be decoded. The store did not guess an answer.
    #[error("corrupt stored record for {key}: {reason}")]
    CorruptRecord {
        /// The key as text.
        key: String,
        /// What was malformed.
        reason: String,
    },

    /// This process's clock is off from the database's clock by more than the
    /// store tolerates, as measured (never guessed) from the database's own
    /// answers. Nothing was written. Retrying helps once the clock is put right
    /// (NTP); a store whose deadlines are judged by the caller's clock refuses
    /// rather than take over a lease early or hand out one that ends early.
    #[error(
        "clock skew: this process's clock is {} the database's by at least {at_least:?}, over \
         the {tolerated:?} this store tolerates; nothing was written (fix the clock: NTP)",
        if *ahead { "ahead of" } else { "behind" }
    )]
    ClockSkew {
        /// How far off the clock is at the least, by the measurement.
        at_least: Duration,
        /// Whether this process's clock is ahead of the database's (else behind).
        ahead: bool,
        /// The largest skew the store lets claims through with.
        tolerated: Duration,
    },

    /// Any other failure of the backend.
    #[error("backend error: {message}")]
    Backend {
        /// What happened.
        message: String,
        /// Whether retrying may help.
        retryable: bool,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// Whether retrying the same call later may succeed.
    ///
    /// ```
    /// use dedupe_core::Error;
    /// assert!(Error::unavailable("connection refused", None).is_retryable());
    /// assert!(!Error::config("bad table name").is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Unavailable { .. } | Error::Timeout { .. } | Error::ClockSkew { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            Error::InvalidKey(_)
            | Error::InvalidConfig { .. }
            | Error::LeaseLost { .. }
            | Error::OutcomeTooLarge { .. }
            | Error::PayloadTooLarge { .. }
            | Error::BatchTooLarge { .. }
            | Error::CorruptRecord { .. } => false,
        }
    }

    /// An [`Error::InvalidConfig`].
    pub fn config(reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            reason: reason.into(),
        }
    }

    /// An [`Error::Unavailable`].
    pub fn unavailable(message: impl Into<String>, source: Option<BoxError>) -> Self {
        Error::Unavailable {
            message: message.into(),
            source,
        }
    }

    /// An [`Error::Backend`] a retry may get past (a deadlock, a
    /// serialization failure, a throttled request).
    ///
    /// ```
    /// use dedupe_core::Error;
    /// assert!(Error::retryable("deadlock found", None).is_retryable());
    /// assert!(!Error::fatal("no such table", None).is_retryable());
    /// ```
    pub fn retryable(message: impl Into<String>, source: impl Into<Option<BoxError>>) -> Self {
        Error::Backend {
            message: message.into(),
            retryable: true,
            source: source.into(),
        }
    }

    /// An [`Error::Backend`] no retry gets past (a missing table, a
    /// permission refused, an answer the store cannot read).
    pub fn fatal(message: impl Into<String>, source: impl Into<Option<BoxError>>) -> Self {
        Error::Backend {
            message: message.into(),
            retryable: false,
            source: source.into(),
        }
    }

    /// An [`Error::Timeout`] with no error of the driver's: the call did not
    /// finish within `after`.
    pub fn timeout(after: Duration) -> Self {
        Error::Timeout {
            after,
            source: None,
        }
    }

    /// An [`Error::CorruptRecord`].
    pub fn corrupt(key: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        Error::CorruptRecord {
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    /// An [`Error::LeaseLost`].
    pub fn lease_lost(key: impl std::fmt::Display) -> Self {
        Error::LeaseLost {
            key: key.to_string(),
        }
    }
}
