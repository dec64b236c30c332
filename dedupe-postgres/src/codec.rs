//! A row of the table as a record: every column read and checked
//! ([`StoredRecord::decode`]), `CorruptRecord` for anything that does not fit.

use dedupe_core::backend::StoredRecord;
use dedupe_core::{Error, Key, Record, Result};
use sqlx::postgres::PgRow;
use sqlx::Row;

/// The record of `key` in `row`, which holds the columns `sql::columns` names.
pub(crate) fn decode_record(key: &Key, row: &PgRow) -> Result<Record> {
    let read = || -> std::result::Result<StoredRecord, sqlx::Error> {
        Ok(StoredRecord {
            state: i64::from(row.try_get::<i16, _>("state")?),
            token: row.try_get("token")?,
            claim_id: row.try_get("claim_id")?,
            fingerprint: row.try_get("fingerprint")?,
            expires_ms: row.try_get("expires_ms")?,
            completed_ms: row.try_get("completed_ms")?,
            outcome: row.try_get("outcome")?,
            attempts: i64::from(row.try_get::<i32, _>("attempts")?),
            first_seen_ms: row.try_get("first_seen_ms")?,
        })
    };
    read()
        .map_err(|e| Error::corrupt(key, format!("undecodable column: {e}")))?
        .decode(key)
}
