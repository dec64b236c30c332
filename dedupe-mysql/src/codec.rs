//! Rows into records: every column checked, anything malformed refused as
//! corrupt, never read as absent.

use dedupe_core::backend::StoredRecord;
use dedupe_core::{Error, Key, Record, Result};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

/// The live record read with `sql::COLUMNS` from column `at` on, and the
/// server's time in milliseconds after them; `None` when it has expired. An
/// expired record is absent to every operation (rule 5), whatever its other
/// columns hold: only a live one is decoded, and refused as corrupt. An
/// inbox item is live whatever its deadline (rule I7).
pub(crate) fn read(key: &Key, row: &MySqlRow, at: usize) -> Result<Option<Record>> {
    let corrupt = |e: sqlx::Error| Error::corrupt(key, format!("undecodable column: {e}"));
    let text = |bytes: Vec<u8>, what: &str| {
        String::from_utf8(bytes).map_err(|_| Error::corrupt(key, format!("{what} is not UTF-8")))
    };
    let expires_ms: i64 = row.try_get(at + 4).map_err(corrupt)?;
    let item: bool = row.try_get(at + 9).map_err(corrupt)?;
    let now: i64 = row.try_get(at + 10).map_err(corrupt)?;
    if expires_ms <= now && !item {
        return Ok(None);
    }
    let token: Vec<u8> = row.try_get(at + 1).map_err(corrupt)?;
    let claim_id: Option<Vec<u8>> = row.try_get(at + 2).map_err(corrupt)?;
    let stored = StoredRecord {
        state: i64::from(row.try_get::<i8, _>(at).map_err(corrupt)?),
        token: text(token, "the token")?,
        claim_id: claim_id.map(|c| text(c, "the claim id")).transpose()?,
        fingerprint: row.try_get(at + 3).map_err(corrupt)?,
        expires_ms,
        completed_ms: row.try_get(at + 5).map_err(corrupt)?,
        outcome: row.try_get(at + 6).map_err(corrupt)?,
        attempts: row.try_get(at + 7).map_err(corrupt)?,
        first_seen_ms: row.try_get(at + 8).map_err(corrupt)?,
    };
    stored.decode(key).map(Some)
}
