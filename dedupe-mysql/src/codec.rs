//! Rows into records: every column checked, anything malformed refused as
//! corrupt, never read as absent.

use dedupe_core::backend::StoredRecord;
use dedupe_core::{Error, Key, Record, Result};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

/// A row as read: the record, and whether it is live at the server's time
/// the statement read it at.
#[derive(Debug)]
pub(crate) struct Read {
    pub(crate) record: Record,
    pub(crate) live: bool,
}

/// A record read with `sql::COLUMNS` from column `at` on, and the server's
/// time in milliseconds after them.
pub(crate) fn read(key: &Key, row: &MySqlRow, at: usize) -> Result<Read> {
    let corrupt = |e: sqlx::Error| Error::corrupt(key, format!("undecodable column: {e}"));
    let text = |bytes: Vec<u8>, what: &str| {
        String::from_utf8(bytes).map_err(|_| Error::corrupt(key, format!("{what} is not UTF-8")))
    };
    let token: Vec<u8> = row.try_get(at + 1).map_err(corrupt)?;
    let claim_id: Option<Vec<u8>> = row.try_get(at + 2).map_err(corrupt)?;
    let stored = StoredRecord {
        state: i64::from(row.try_get::<i8, _>(at).map_err(corrupt)?),
        token: text(token, "the token")?,
        claim_id: claim_id.map(|c| text(c, "the claim id")).transpose()?,
        fingerprint: row.try_get(at + 3).map_err(corrupt)?,
        expires_ms: row.try_get(at + 4).map_err(corrupt)?,
        completed_ms: row.try_get(at + 5).map_err(corrupt)?,
        outcome: row.try_get(at + 6).map_err(corrupt)?,
        attempts: i64::from(row.try_get::<i32, _>(at + 7).map_err(corrupt)?),
        first_seen_ms: row.try_get(at + 8).map_err(corrupt)?,
    };
    let now: i64 = row.try_get(at + 9).map_err(corrupt)?;
    let live = stored.expires_ms > now;
    Ok(Read {
        record: stored.decode(key)?,
        live,
    })
}
