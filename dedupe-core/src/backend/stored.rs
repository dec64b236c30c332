//! Helpers for store implementations: decoding a stored row into a [`Record`]
//! with every field checked, and validating names that go into SQL or keys.

use super::time::from_millis;
use crate::error::{Error, Result};
use crate::key::LeaseToken;
use crate::key::{ClaimId, Fingerprint, Key};
use crate::record::{Record, RecordState};

/// A record as a store keeps it, field by field, before validation. Stores that
/// keep rows (SQL, hashes, items) read into this and call [`StoredRecord::decode`],
/// so every store refuses a malformed record by the same rules.
#[derive(Debug, Clone, Default)]
pub struct StoredRecord {
    /// 0 in flight, 1 done.
    pub state: i64,
    /// The lease token.
    pub token: String,
    /// The claim id, if the claim carried one.
    pub claim_id: Option<String>,
    /// The payload fingerprint, if any.
    pub fingerprint: Option<Vec<u8>>,
    /// Lease deadline (in flight) or retention deadline (done), ms since the epoch.
    pub expires_ms: i64,
    /// When it was completed, ms since the epoch (done only).
    pub completed_ms: Option<i64>,
    /// The stored outcome (done only).
    pub outcome: Option<Vec<u8>>,
    /// How many claims won it.
    pub attempts: i64,
    /// When it was first claimed, ms since the epoch.
    pub first_seen_ms: i64,
}

impl StoredRecord {
    /// State code of an in-flight record.
    pub const IN_FLIGHT: i64 = 0;
    /// State code of a done record.
    pub const DONE: i64 = 1;

    /// Checks every field and builds the record of `key`; anything malformed is an
    /// [`Error::CorruptRecord`] naming the key and the field, never a guess.
    pub fn decode(self, key: &Key) -> Result<Record> {
        let corrupt = |why: String| Error::corrupt(key, why);
        let state = match (self.state, self.completed_ms, self.outcome) {
            (Self::IN_FLIGHT, _, _) => RecordState::InFlight {
                lease_deadline: from_millis(self.expires_ms),
            },
            (Self::DONE, Some(completed), Some(outcome)) => RecordState::Done {
                completed_at: from_millis(completed),
                retention_deadline: from_millis(self.expires_ms),
                outcome,
            },
            (Self::DONE, _, _) => {
                return Err(corrupt(
                    "done record without completion time or outcome".into(),
                ))
            }
            (other, _, _) => return Err(corrupt(format!("unknown state {other}"))),
        };
        if self.token.is_empty() {
            return Err(corrupt("empty lease token".into()));
        }
        let attempts = u32::try_from(self.attempts)
            .ok()
            .filter(|a| *a >= 1)
            .ok_or_else(|| corrupt(format!("attempt count {}", self.attempts)))?;
        let claim_id = self
            .claim_id
            .map(ClaimId::new)
            .transpose()
            .map_err(|e| corrupt(format!("claim id: {e}")))?;
        let fingerprint = self
            .fingerprint
            .map(Fingerprint::from_bytes)
            .transpose()
            .map_err(|e| corrupt(format!("fingerprint: {e}")))?;
        Ok(Record::new(
            key.clone(),
            state,
            LeaseToken::from_stored(self.token),
            claim_id,
            fingerprint,
            attempts,
            from_millis(self.first_seen_ms),
        ))
    }
}

/// Checks a name a store puts into SQL or key prefixes (a table, a schema): a
/// letter or `_`, then letters, digits or `_`, at most 63 bytes. Anything else is
/// an [`Error::InvalidConfig`], so a name can never carry SQL.
///
/// ```
/// use dedupe_core::backend::check_identifier;
/// assert!(check_identifier("table", "dedupe_records").is_ok());
/// assert!(check_identifier("table", "x; DROP TABLE y").is_err());
/// ```
pub fn check_identifier(what: &str, name: &str) -> Result<()> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || name.len() > 63 || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(Error::config(format!(
            "{what} name {name:?} is not a plain identifier (a letter or '_', then letters, digits or '_', at most 63)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::new("t", "k").expect("key")
    }

    fn good() -> StoredRecord {
        StoredRecord {
            state: StoredRecord::IN_FLIGHT,
            token: "abc".into(),
            attempts: 1,
            ..StoredRecord::default()
        }
    }

    #[test]
    fn decodes_valid_and_refuses_each_malformed_field() {
        assert!(good().decode(&key()).is_ok());
        let cases = [
            StoredRecord { state: 7, ..good() },
            StoredRecord {
                state: StoredRecord::DONE,
                ..good()
            },
            StoredRecord {
                token: String::new(),
                ..good()
            },
            StoredRecord {
                attempts: 0,
                ..good()
            },
            StoredRecord {
                attempts: i64::from(u32::MAX) + 1,
                ..good()
            },
            StoredRecord {
                claim_id: Some(String::new()),
                ..good()
            },
            StoredRecord {
                fingerprint: Some(vec![0; 65]),
                ..good()
            },
        ];
        for case in cases {
            let shown = format!("{case:?}");
            assert!(
                matches!(case.decode(&key()), Err(Error::CorruptRecord { .. })),
                "accepted {shown}"
            );
        }
    }

    #[test]
    fn identifiers() {
        for ok in ["a", "_x", "Webhook_Events_2", &"a".repeat(63)] {
            assert!(check_identifier("t", ok).is_ok(), "{ok}");
        }
        for bad in ["", "1a", "a-b", "a\"b", "dédupe", "a b", &"a".repeat(64)] {
            assert!(check_identifier("t", bad).is_err(), "{bad}");
        }
    }
}
