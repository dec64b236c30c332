//! The statement text of the store, built once per table name.
//!
//! Times are milliseconds since the Unix epoch in `BIGINT` columns, always
//! from the server's clock (`NOW_MS`, one value for the whole statement), so
//! no session time zone, DST hour or 2038 limit can shift a deadline.

use dedupe_core::backend::check_identifier;
use dedupe_core::Result;

/// The server's time in milliseconds: `UTC_TIMESTAMP(3)` is the statement's
/// start, the same at every use in one statement, and in UTC whatever the
/// session's `time_zone` (no DST hour repeats). Not `UNIX_TIMESTAMP(NOW(3))`:
/// that reads the session's zone, and MariaDB before 11.5 answers NULL for it
/// past 2038-01-19 (seen on 10.11); `DATETIME` arithmetic runs to year 9999.
pub(crate) const NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)";

/// The record columns every read returns, in the order `codec::read` expects,
/// and the server's time.
pub(crate) const COLUMNS: &str = "state, token, claim_id, fingerprint, expires_at, completed_at, \
     outcome, attempts, first_seen";

/// Rows deleted per `expire()` statement: each a short transaction of its
/// own, so a purge never holds many row locks against claims.
pub(crate) const EXPIRE_BATCH: u64 = 500;

/// The schema, one file a change (`migrations/NNNN_what.sql`), applied in
/// order by `migrate()`; `{table}` is the store's table.
pub(crate) const MIGRATIONS: &[&str] = &[include_str!("../migrations/0001_records.sql")];

/// The statements for one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) migrations: Vec<String>,
    pub(crate) select: String,
    pub(crate) select_locking: String,
    pub(crate) complete: String,
    pub(crate) release: String,
    pub(crate) extend: String,
    pub(crate) expire_batch: String,
    pub(crate) forget: String,
    pub(crate) forget_read: String,
    upsert_head: String,
    upsert_tail: String,
}

impl Statements {
    pub(crate) fn new(table: &str) -> Result<Self> {
        check_identifier("table", table)?;
        let t = format!("`{table}`");
        let now = NOW_MS;
        // The takeover test, judged on the row as it was: every assignment
        // below reads only `expires_at` and `state`, and those two are
        // assigned last (`state`, then `expires_at`), because MySQL and
        // MariaDB evaluate `ON DUPLICATE KEY UPDATE` assignments left to
        // right, each seeing the columns assigned before it.
        let gone = format!("expires_at <= {now}");
        Ok(Self {
            table: table.to_string(),
            // The numbered files of `migrations/`, in order: each is one
            // statement, safe to apply again.
            migrations: MIGRATIONS
                .iter()
                .map(|migration| migration.replace("{table}", table))
                .collect(),
            select: format!("SELECT {COLUMNS}, {now} FROM {t} WHERE namespace = ? AND id = ?"),
            select_locking: format!(
                "SELECT {COLUMNS}, {now} FROM {t} WHERE namespace = ? AND id = ? FOR UPDATE"
            ),
            upsert_head: format!(
                "INSERT INTO {t} (namespace, id, state, token, claim_id, fingerprint, expires_at,
                                  completed_at, outcome, attempts, first_seen) VALUES "
            ),
            upsert_tail: format!(
                " ON DUPLICATE KEY UPDATE
                    attempts     = IF({gone}, IF(state = 0, attempts + 1, 1), attempts),
                    first_seen   = IF({gone}, IF(state = 0, first_seen, VALUES(first_seen)), first_seen),
                    token        = IF({gone}, VALUES(token), token),
                    claim_id     = IF({gone}, VALUES(claim_id), claim_id),
                    fingerprint  = IF({gone}, VALUES(fingerprint), fingerprint),
                    completed_at = IF({gone}, NULL, completed_at),
                    outcome      = IF({gone}, NULL, outcome),
                    state        = IF({gone}, 0, state),
                    expires_at   = IF({gone}, VALUES(expires_at), expires_at)"
            ),
            complete: format!(
                "UPDATE {t} SET outcome = ?, completed_at = {now}, state = 1, expires_at = {now} + ?
                 WHERE namespace = ? AND id = ? AND token = ? AND state = 0 AND expires_at > {now}"
            ),
            release: format!(
                "DELETE FROM {t}
                 WHERE namespace = ? AND id = ? AND token = ? AND state = 0 AND expires_at > {now}"
            ),
            extend: format!(
                "UPDATE {t} SET expires_at = {now} + ?
                 WHERE namespace = ? AND id = ? AND token = ? AND state = 0 AND expires_at > {now}"
            ),
            expire_batch: format!(
                "DELETE FROM {t} WHERE expires_at <= {now} ORDER BY expires_at LIMIT {EXPIRE_BATCH}"
            ),
            forget: format!("DELETE FROM {t} WHERE namespace = ? AND id = ? AND token = ?"),
            // The token and whether the row is live, undecoded: a record
            // that does not decode is forgotten too.
            forget_read: format!(
                "SELECT token, expires_at > {now} FROM {t} WHERE namespace = ? AND id = ?"
            ),
        })
    }

    /// The claim upsert for `rows` keys: each row `(ns, id, 0, token,
    /// claim id, fingerprint, now + lease, NULL, NULL, 1, now)`.
    pub(crate) fn upsert(&self, rows: usize) -> String {
        let row = format!("(?, ?, 0, ?, ?, ?, {NOW_MS} + ?, NULL, NULL, 1, {NOW_MS})");
        let mut sql = String::with_capacity(
            self.upsert_head.len() + rows * (row.len() + 2) + self.upsert_tail.len(),
        );
        sql.push_str(&self.upsert_head);
        for i in 0..rows {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&row);
        }
        sql.push_str(&self.upsert_tail);
        sql
    }

    /// Reads `rows` keys back: `(namespace, id)` then the columns.
    pub(crate) fn select_many(&self, rows: usize) -> String {
        let mut sql = format!(
            "SELECT namespace, id, {COLUMNS}, {NOW_MS} FROM `{}` WHERE (namespace, id) IN (",
            self.table
        );
        for i in 0..rows {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str("(?, ?)");
        }
        sql.push(')');
        sql
    }
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// Every file of `migrations/` is applied, in the order of its number.
    #[test]
    fn every_migration_file_is_applied_in_order() {
        dedupe_testkit::assert_migrations_applied(
            concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"),
            MIGRATIONS,
        );
    }
}
