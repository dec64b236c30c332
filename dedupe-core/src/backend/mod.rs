//! What a store author needs, and nothing an application does.
//!
//! An application holds a store through [`DedupeStore`](crate::DedupeStore) and
//! never calls these. A store crate (ours or a third party's) uses them so that
//! every store validates, decodes and answers by the same rules:
//!
//! - **time**: [`to_millis`], [`from_millis`], [`duration_millis`], [`now_millis`]:
//!   milliseconds since the Unix epoch, the unit stores keep deadlines in;
//! - **input**: [`check_ttl`] for leases and retentions, [`check_identifier`] for
//!   table, schema and prefix names that go into SQL or keys;
//! - **records**: [`StoredRecord`], a record field by field as storage keeps it,
//!   and [`StoredRecord::decode`], which refuses anything malformed with
//!   `CorruptRecord`; [`new_token`] and [`stored_token`] for lease tokens;
//! - **answers**: [`won_claim`] turns the record a winning claim wrote into
//!   `Claimed`, [`losing_claim`] turns the live record that stopped a claim into
//!   `InFlight`, `Duplicate`, `Mismatch` or a re-entrant `Claimed`;
//!   [`one_row_changed`] turns a conditional write's count into `Ok` or `LeaseLost`;
//! - **batches**: [`BatchKeys`] sends each distinct key of a `claim_many` to the
//!   store once and answers repeats inside the batch as the contract says;
//! - **administration**: [`Admin`], the store-wide operations the tools run
//!   (migrate, remove a namespace, durability), implemented by each store;
//! - **claim modes**: [`FirstStatement`] counts whether a store's recent claims
//!   met records, for a store that picks its first statement by that;
//! - **wake-ups**: [`Wakeups`], the per-namespace signals an inbox raises so
//!   idle workers take new work at once ([`Inbox::wake`](crate::Inbox::wake)).
//!
//! ```
//! use std::time::Duration;
//! use dedupe_core::backend::{self, StoredRecord};
//! use dedupe_core::{ClaimOptions, ClaimOutcome, Key};
//!
//! // A row as a store read it back after its conditional insert lost.
//! let key = Key::new("stripe", "evt_1")?;
//! let row = StoredRecord {
//!     state: StoredRecord::DONE,
//!     token: backend::new_token().to_string(),
//!     expires_ms: backend::now_millis() + 60_000,
//!     completed_ms: Some(backend::now_millis()),
//!     outcome: Some(b"charged".to_vec()),
//!     attempts: 1,
//!     first_seen_ms: backend::now_millis(),
//!     ..StoredRecord::default()
//! };
//! let record = row.decode(&key)?;
//! let answer = backend::losing_claim(record, &ClaimOptions::default());
//! assert!(matches!(answer, ClaimOutcome::Duplicate { ref outcome, .. } if outcome == b"charged"));
//! # Ok::<(), dedupe_core::Error>(())
//! ```

mod admin;
mod first;
mod item;
mod stored;
mod time;

pub use crate::batch::BatchKeys;
pub use crate::claim::{check_batch, check_ttl};
pub use crate::wake::{Subscription, Wakeups};
pub use admin::{
    key_cursor, missing, parse_key_cursor, Admin, KeyPage, RecordQuery, MAX_RECORD_PAGE,
};
pub use first::FirstStatement;
pub use item::{
    accept_columns, accepted_over, check_accept, check_namespace, check_payload, check_take,
    cut_error, decode_errors, errors_json, push_error, status_code, stored_counts, StoredCounts,
    StoredItem, StoredTaken,
};
pub use stored::{check_identifier, StoredRecord};
pub use time::{duration_millis, from_millis, now_millis, to_millis};

use crate::claim::{ClaimOptions, ClaimOutcome, Lease};
use crate::error::{Error, Result};
use crate::key::{Key, LeaseToken};
use crate::record::{Record, RecordState};

/// Runs `op`, or answers [`Error::Timeout`] once `bound` has passed without
/// its answer (`op` is dropped: whether it took effect is unknown, as the
/// error says). Every store bounds its calls with it.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{backend::within, Error};
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let never = std::future::pending::<Result<(), Error>>();
/// let answer = within(Duration::from_millis(5), never).await;
/// assert!(matches!(answer, Err(Error::Timeout { after, .. }) if after == Duration::from_millis(5)));
/// # });
/// ```
pub async fn within<T>(
    bound: std::time::Duration,
    op: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(bound, op)
        .await
        .unwrap_or(Err(Error::timeout(bound)))
}

/// A fresh lease token: 128 random bits, never handed to two claims.
pub fn new_token() -> LeaseToken {
    LeaseToken::generate()
}

/// `n` fresh lease tokens, as [`new_token`] makes them, from one read of the
/// operating system's random source instead of one read each: for a batch,
/// where a read each (a system call) was about a twentieth of the client's
/// time.
///
/// ```
/// let tokens = dedupe_core::backend::new_tokens(16);
/// assert_eq!(tokens.len(), 16);
/// let distinct: std::collections::HashSet<&str> = tokens.iter().map(|t| t.as_str()).collect();
/// assert_eq!(distinct.len(), 16);
/// ```
pub fn new_tokens(n: usize) -> Vec<LeaseToken> {
    LeaseToken::generate_many(n)
}

/// A lease token as read back from storage.
pub fn stored_token(token: impl Into<String>) -> LeaseToken {
    LeaseToken::from_stored(token)
}

/// The answer a claim gets from the live record that stopped it: `Mismatch` when
/// both sides carry fingerprints that differ, `Duplicate` with the stored outcome
/// when done, `Claimed` with the stored lease (token, deadline, attempt) when in
/// flight and held by the claim's own claim id, `InFlight` otherwise. Every store
/// (the memory store too) answers a losing claim through this one rule.
pub fn losing_claim(record: Record, opts: &ClaimOptions) -> ClaimOutcome {
    if let (Some(given), Some(stored)) = (&opts.fingerprint, &record.fingerprint) {
        if given != stored {
            return ClaimOutcome::Mismatch {
                state: record.state.kind(),
            };
        }
    }
    match record.state {
        RecordState::Done {
            completed_at,
            outcome,
            ..
        } => ClaimOutcome::Duplicate {
            outcome,
            completed_at,
        },
        RecordState::InFlight { lease_deadline }
            if opts.claim_id.is_some() && opts.claim_id == record.claim_id =>
        {
            ClaimOutcome::Claimed(Lease {
                key: record.key,
                token: record.token,
                deadline: lease_deadline,
                attempt: record.attempts,
                claim_id: record.claim_id,
            })
        }
        RecordState::InFlight { lease_deadline } => ClaimOutcome::InFlight {
            deadline: lease_deadline,
            attempt: record.attempts,
        },
    }
}

/// The `Claimed` answer of a claim that wrote `record` (read back from the same
/// atomic write). A done record there means storage is not what the store wrote:
/// `CorruptRecord`, never a guess.
pub fn won_claim(record: Record) -> Result<ClaimOutcome> {
    let RecordState::InFlight { lease_deadline } = record.state else {
        return Err(Error::corrupt(
            &record.key,
            "a winning claim read back a done record",
        ));
    };
    Ok(ClaimOutcome::Claimed(Lease {
        key: record.key,
        token: record.token,
        deadline: lease_deadline,
        attempt: record.attempts,
        claim_id: record.claim_id,
    }))
}

/// Turns the count of records a conditional complete, release or extend changed
/// into its answer: exactly one is success; none means the record no longer
/// holds the lease (`LeaseLost`); more than one means the key is not unique in
/// storage (`CorruptRecord`).
///
/// ```
/// use dedupe_core::{backend::one_row_changed, Error, Key};
/// let key = Key::new("stripe", "evt_1")?;
/// assert!(one_row_changed(1, &key).is_ok());
/// assert!(matches!(one_row_changed(0, &key), Err(Error::LeaseLost { .. })));
/// # Ok::<(), Error>(())
/// ```
pub fn one_row_changed(changed: u64, key: &Key) -> Result<()> {
    match changed {
        1 => Ok(()),
        0 => Err(Error::lease_lost(key)),
        n => Err(Error::corrupt(
            key,
            format!("{n} records changed for one key"),
        )),
    }
}
