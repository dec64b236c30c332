//! What a store can do.

use crate::error::{Error, Result};

/// Largest outcome a store keeps unless it documents another limit (256 KiB).
pub const DEFAULT_MAX_OUTCOME_BYTES: usize = 256 * 1024;

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
    /// The store deletes expired records by itself, in time (Redis' key
    /// expiry, DynamoDB's TTL): a `Deduper` runs no expiry task of its own
    /// over it, whatever `expire()` can do besides.
    pub expires_by_itself: bool,
}

impl Capabilities {
    /// A store with explicit expiry and the default outcome limit.
    pub const fn new() -> Self {
        Self {
            explicit_expire: true,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            expires_by_itself: false,
        }
    }

    /// Sets [`Capabilities::expires_by_itself`].
    pub const fn with_expires_by_itself(mut self, yes: bool) -> Self {
        self.expires_by_itself = yes;
        self
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
