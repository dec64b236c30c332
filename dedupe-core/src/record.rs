//! A record as `get` shows it.

use std::time::SystemTime;

use crate::key::{ClaimId, Fingerprint, Key, LeaseToken};

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
    /// Assembles a record. Store authors build records through
    /// [`backend::StoredRecord::decode`](crate::backend::StoredRecord::decode).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
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
