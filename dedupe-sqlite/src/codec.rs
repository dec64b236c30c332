//! A row as the store keeps it, read into the fields `dedupe_core::backend`
//! decodes (every field checked there: `CorruptRecord`, never a guess).

use dedupe_core::backend::{StoredCounts, StoredItem, StoredRecord};
use rusqlite::Row;

/// Reads a row of [`COLUMNS`](crate::sql::COLUMNS); [`StoredRecord::decode`] then refuses anything
/// malformed.
pub(crate) fn read_row(row: &Row<'_>) -> rusqlite::Result<StoredRecord> {
    Ok(StoredRecord {
        state: row.get(0)?,
        token: row.get(1)?,
        claim_id: row.get(2)?,
        fingerprint: row.get(3)?,
        expires_ms: row.get(4)?,
        completed_ms: row.get(5)?,
        outcome: row.get(6)?,
        attempts: row.get(7)?,
        first_seen_ms: row.get(8)?,
    })
}

/// An item row of [`ITEM_COLUMNS`](crate::sql::ITEM_COLUMNS), as read.
pub(crate) fn read_item(row: &Row<'_>) -> rusqlite::Result<StoredItem> {
    Ok(StoredItem {
        id: row.get(0)?,
        wait: row.get(1)?,
        attempts: row.get(2)?,
        accepted_ms: row.get(3)?,
        due_ms: row.get(4)?,
        last_error: row.get(5)?,
        payload: row.get(6)?,
        counts: StoredCounts {
            takeovers: row.get(7)?,
            max_attempts: row.get(8)?,
        },
        ordering_key: row.get(9)?,
        errors: row.get(10)?,
    })
}
