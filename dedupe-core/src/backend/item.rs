//! Inbox items as a store keeps them in a row (the columns every SQL store
//! reads back, decoded and checked in one place), and the input checks and
//! answers every store's inbox shares.

use std::time::Duration;

use super::time::{duration_millis, from_millis};
use crate::claim::Lease;
use crate::error::{Error, Result};
use crate::inbox::{
    AcceptOptions, Accepted, FailedAttempt, InboxCounts, Item, ItemStatus, Taken, MAX_ERROR_BYTES,
    MAX_PAYLOAD_BYTES, MAX_TAKE,
};
use crate::key::{Key, LeaseToken};
use crate::record::{Record, RecordState};

/// An item's columns as read: `wait` is 0 held by a worker, 1 due, 2 dead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredItem {
    /// The key's id (the namespace is the caller's).
    pub id: String,
    /// 0 held by a worker, 1 due, 2 dead.
    pub wait: i64,
    /// Times taken.
    pub attempts: i64,
    /// When it was accepted, in ms since the epoch.
    pub accepted_ms: i64,
    /// When it is due (held: its lease's deadline), in ms since the epoch.
    pub due_ms: i64,
    /// Its last failure.
    pub last_error: Option<String>,
    /// The delivery.
    pub payload: Option<Vec<u8>>,
    /// Its takeovers and its own attempt limit.
    pub counts: StoredCounts,
    /// Its ordering key (I15), if it has one.
    pub ordering_key: Option<String>,
    /// Its failure history as the store wrote it: a JSON array of `[attempt,
    /// ms since the epoch, error]`, oldest first (see [`errors_json`]);
    /// `None` when it never failed since the store kept one.
    pub errors: Option<String>,
}

/// An item's counters as stored (a row from before they existed reads as
/// the default: no takeovers, the worker's limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoredCounts {
    /// Takeovers of workers that died holding it.
    pub takeovers: i64,
    /// Its own attempt limit, set at accept.
    pub max_attempts: Option<i64>,
}

impl StoredCounts {
    fn decode(self, key: &Key) -> Result<(u32, Option<u32>)> {
        let takeovers = u32::try_from(self.takeovers)
            .map_err(|_| Error::corrupt(key, format!("takeover count {}", self.takeovers)))?;
        let max_attempts = self
            .max_attempts
            .map(|m| match u32::try_from(m) {
                Ok(m) if m > 0 => Ok(m),
                _ => Err(Error::corrupt(key, format!("attempt limit {m}"))),
            })
            .transpose()?;
        Ok((takeovers, max_attempts))
    }
}

impl StoredItem {
    /// The item, or `CorruptRecord` for a row that is not one.
    pub fn decode(self, namespace: &str) -> Result<Item> {
        let key = Key::new(namespace, &self.id)?;
        let status = match (self.wait, &self.last_error) {
            (0, _) => ItemStatus::Running,
            (1, None) => ItemStatus::Pending,
            (1, Some(_)) => ItemStatus::Failed,
            (2, _) => ItemStatus::Dead,
            (other, _) => return Err(Error::corrupt(&key, format!("inbox wait state {other}"))),
        };
        let attempts = attempts(&key, self.attempts)?;
        let payload = payload(&key, self.payload)?;
        let (takeovers, max_attempts) = self.counts.decode(&key)?;
        let errors = decode_errors(&key, self.errors.as_deref())?;
        Ok(Item::new(
            key,
            status,
            attempts,
            from_millis(self.accepted_ms),
            from_millis(self.due_ms),
            self.last_error,
            payload,
        )
        .with_counts(takeovers, max_attempts)
        .with_ordering_key(self.ordering_key)
        .with_errors(errors))
    }
}

/// An item's failure history as stores write it: a JSON array of `[attempt,
/// ms since the epoch, error]`, oldest first, at most
/// [`ERROR_HISTORY`](crate::ERROR_HISTORY) entries. SQL stores build it with
/// their JSON functions in the fail statement, Redis with `cjson` in its
/// script; a store that builds it in Rust uses [`push_error`].
pub fn errors_json(errors: &[FailedAttempt]) -> String {
    serde_json::Value::Array(
        errors
            .iter()
            .map(|e| serde_json::json!([e.attempt, super::time::to_millis(e.at), e.error.as_str()]))
            .collect(),
    )
    .to_string()
}

/// `errors` (as [`errors_json`] writes them) with one more failure, the
/// oldest dropped past [`ERROR_HISTORY`](crate::ERROR_HISTORY).
pub fn push_error(key: &Key, errors: Option<&str>, failed: FailedAttempt) -> Result<String> {
    let mut errors = decode_errors(key, errors)?;
    errors.push(failed);
    let over = errors.len().saturating_sub(crate::ERROR_HISTORY);
    errors.drain(..over);
    Ok(errors_json(&errors))
}

/// Reads a failure history written as [`errors_json`] writes it; a text that
/// is not one is `CorruptRecord`, never an empty history.
pub fn decode_errors(key: &Key, errors: Option<&str>) -> Result<Vec<FailedAttempt>> {
    let Some(text) = errors else {
        return Ok(Vec::new());
    };
    let corrupt = |why: &str| Error::corrupt(key, format!("an item's failure history: {why}"));
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| corrupt(&e.to_string()))?;
    let entries = value.as_array().ok_or_else(|| corrupt("not an array"))?;
    entries
        .iter()
        .map(|entry| match entry.as_array().map(Vec::as_slice) {
            Some([attempt, at, error]) => {
                let attempt = attempt
                    .as_u64()
                    .and_then(|a| u32::try_from(a).ok())
                    .ok_or_else(|| corrupt("an attempt that is not a count"))?;
                // Lua's cjson writes whole numbers as floats past 10^14.
                let at = at
                    .as_i64()
                    .or_else(|| at.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                    .ok_or_else(|| corrupt("a time that is not ms since the epoch"))?;
                let error = error
                    .as_str()
                    .ok_or_else(|| corrupt("an error that is not text"))?;
                Ok(FailedAttempt::new(attempt, from_millis(at), error))
            }
            _ => Err(corrupt("an entry that is not [attempt, time, error]")),
        })
        .collect()
}

fn attempts(key: &Key, attempts: i64) -> Result<u32> {
    u32::try_from(attempts).map_err(|_| Error::corrupt(key, format!("attempt count {attempts}")))
}

fn payload(key: &Key, payload: Option<Vec<u8>>) -> Result<Vec<u8>> {
    payload.ok_or_else(|| Error::corrupt(key, "an inbox item without its payload"))
}

/// The columns a take wrote back for the item it leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTaken {
    /// The new lease's token.
    pub token: String,
    /// The new lease's deadline, in ms since the epoch.
    pub deadline_ms: i64,
    /// This take's attempt number.
    pub attempt: i64,
    /// When the item was accepted, in ms since the epoch.
    pub accepted_ms: i64,
    /// Its last failure.
    pub last_error: Option<String>,
    /// The delivery.
    pub payload: Option<Vec<u8>>,
    /// Its takeovers and its own attempt limit.
    pub counts: StoredCounts,
    /// Its ordering key (I15), if it has one.
    pub ordering_key: Option<String>,
}

impl StoredTaken {
    /// The leased item, or `CorruptRecord` for columns that are not one.
    pub fn decode(self, key: Key) -> Result<Taken> {
        let attempt = attempts(&key, self.attempt)?;
        let payload = payload(&key, self.payload)?;
        let (takeovers, max_attempts) = self.counts.decode(&key)?;
        Ok(Taken::new(
            Lease {
                key,
                token: LeaseToken::from_stored(self.token),
                deadline: from_millis(self.deadline_ms),
                attempt,
                claim_id: None,
            },
            payload,
            self.last_error,
            from_millis(self.accepted_ms),
        )
        .with_counts(takeovers, max_attempts)
        .with_ordering_key(self.ordering_key))
    }
}

/// A status filter as a number for SQL: -1 every status, 0 pending, 1
/// running, 2 failed, 3 dead.
pub fn status_code(status: Option<ItemStatus>) -> i64 {
    match status {
        None => -1,
        Some(ItemStatus::Pending) => 0,
        Some(ItemStatus::Running) => 1,
        Some(ItemStatus::Failed) => 2,
        Some(ItemStatus::Dead) => 3,
    }
}

/// Counts as a store's query returns them (negative ones read as 0).
pub fn stored_counts(
    pending: i64,
    running: i64,
    failed: i64,
    dead: i64,
    oldest_due_ms: Option<i64>,
) -> InboxCounts {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    InboxCounts {
        pending: count(pending),
        running: count(running),
        failed: count(failed),
        dead: count(dead),
        oldest_due: oldest_due_ms.map(from_millis),
    }
}

/// What an inbox accept answers about a live record that is not an item:
/// its outcome when done, the claim holding it when in flight.
pub fn accepted_over(record: Record) -> Accepted {
    match record.state {
        RecordState::Done {
            outcome,
            completed_at,
            ..
        } => Accepted::Done {
            outcome,
            completed_at,
        },
        RecordState::InFlight { lease_deadline } => Accepted::InFlight {
            deadline: lease_deadline,
            attempt: record.attempts,
        },
    }
}

/// An accept's checks: the payload against [`MAX_PAYLOAD_BYTES`], and the
/// options.
pub fn check_accept(payload: &[u8], options: &AcceptOptions) -> Result<()> {
    check_payload(payload)?;
    options.validate()
}

/// An accept's due time and attempt limit as a store keeps them: ms from
/// now until it is due (0: now), and the limit (`None`: the worker's).
pub fn accept_columns(options: &AcceptOptions) -> (i64, Option<i64>) {
    (
        duration_millis(options.delay()),
        options.max_attempts.map(i64::from),
    )
}

/// Checks the namespace of a pause, resume or paused as a [`Key`] would:
/// `InvalidKey` for one no key can have.
pub fn check_namespace(namespace: &str) -> Result<()> {
    Key::new(namespace, "-")?;
    Ok(())
}

/// Checks a payload against [`MAX_PAYLOAD_BYTES`].
pub fn check_payload(payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Error::PayloadTooLarge {
            size: payload.len(),
            limit: MAX_PAYLOAD_BYTES,
        });
    }
    Ok(())
}

/// Checks how many items a take asks for (1 to [`MAX_TAKE`]) and its lease.
pub fn check_take(max: usize, lease: Duration) -> Result<()> {
    if !(1..=MAX_TAKE).contains(&max) {
        return Err(Error::config(format!(
            "a take hands out 1 to {MAX_TAKE} items, {max} asked"
        )));
    }
    crate::claim::check_ttl("lease ttl", lease)
}

/// `error` cut to [`MAX_ERROR_BYTES`] at a character boundary.
pub fn cut_error(error: &str) -> String {
    if error.len() <= MAX_ERROR_BYTES {
        return error.to_string();
    }
    let mut end = MAX_ERROR_BYTES;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    error[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = cut_error(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(cut_error("short"), "short");
    }
}
