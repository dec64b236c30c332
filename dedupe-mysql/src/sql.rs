//! The statement text of the store, built once per table name.
//!
//! Times are milliseconds since the Unix epoch in `BIGINT` columns, always
//! from the server's clock (`NOW_MS`, one value for the whole statement), so
//! no session time zone, DST hour or 2038 limit can shift a deadline.

use dedupe_core::backend::check_identifier;
use dedupe_core::{Result, ERROR_HISTORY};

/// The server's time in milliseconds: `UTC_TIMESTAMP(3)` is the statement's
/// start, the same at every use in one statement, and in UTC whatever the
/// session's `time_zone` (no DST hour repeats). Not `UNIX_TIMESTAMP(NOW(3))`:
/// that reads the session's zone, and MariaDB before 11.5 answers NULL for it
/// past 2038-01-19 (seen on 10.11); `DATETIME` arithmetic runs to year 9999.
pub(crate) const NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)";

/// The record columns every read returns, in the order `codec::read` expects
/// (the server's time follows them). An inbox item reads as a record in
/// flight, live whatever its deadline (rule I7), and one never taken shows
/// as attempt 1, where a record's count starts.
pub(crate) const COLUMNS: &str = "state, token, claim_id, fingerprint, expires_at, completed_at, \
     outcome, IF(wait IS NULL, attempts, GREATEST(attempts, 1)), first_seen, wait IS NOT NULL";

/// An inbox item's columns, in the order `inbox::decode_item` reads them.
pub(crate) const ITEM: &str =
    "id, wait, attempts, first_seen, expires_at, last_error, payload, takeovers, max_attempts, \
     order_key, CAST(errors AS CHAR) AS errors";

/// Rows deleted per `expire()` statement: each a short transaction of its
/// own, so a purge never holds many row locks against claims.
pub(crate) const EXPIRE_BATCH: u64 = 500;

/// The schema, one file a change (`migrations/NNNN_what.sql`), applied in
/// order by `migrate()`; `{table}` is the store's table.
pub(crate) const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/0001_records.sql"),
    include_str!("../migrations/0002_inbox.sql"),
    include_str!("../migrations/0003_item_counts.sql"),
    include_str!("../migrations/0004_paused.sql"),
    include_str!("../migrations/0005_ordering.sql"),
    include_str!("../migrations/0006_dead_retention.sql"),
    include_str!("../migrations/0007_error_history.sql"),
    include_str!("../migrations/0008_accept_token.sql"),
];

/// For each migration after the first, in the order of [`MIGRATIONS`]: the
/// column whose absence says it has not run (MySQL's `ALTER TABLE` has no
/// `IF NOT EXISTS`) and its name; `None` for one that creates only what is
/// missing, and runs every time.
pub(crate) const GATES: [Option<(&str, &str)>; 7] = [
    Some(("due_at", "0002_inbox")),
    Some(("takeovers", "0003_item_counts")),
    None,
    Some(("order_key", "0005_ordering")),
    Some(("dead_until", "0006_dead_retention")),
    Some(("errors", "0007_error_history")),
    Some(("accept_token", "0008_accept_token")),
];

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
    pub(crate) expire_dead_batch: String,
    pub(crate) forget: String,
    pub(crate) forget_read: String,
    pub(crate) has_column: String,
    pub(crate) accept: String,
    pub(crate) select_item: String,
    pub(crate) accepted: String,
    pub(crate) give_back: String,
    pub(crate) snooze: String,
    pub(crate) pick: String,
    pub(crate) pause: String,
    pub(crate) resume: String,
    pub(crate) paused: String,
    pub(crate) fail: String,
    pub(crate) list: String,
    pub(crate) replay: String,
    pub(crate) counts: String,
    upsert_head: String,
    upsert_tail: String,
}

impl Statements {
    pub(crate) fn new(table: &str) -> Result<Self> {
        check_identifier("table", table)?;
        let t = format!("`{table}`");
        let p = format!("`{table}_paused`");
        let now = NOW_MS;
        // The takeover test, judged on the row as it was: every assignment
        // below reads only `expires_at` and `state`, and those two are
        // assigned last (`state`, then `expires_at`), because MySQL and
        // MariaDB evaluate `ON DUPLICATE KEY UPDATE` assignments left to
        // right, each seeing the columns assigned before it.
        // Never an inbox item: the inbox owns its key until it is done (I7).
        let gone = format!("(expires_at <= {now} AND wait IS NULL)");
        // A row of a live lease: a claim's, or an item's held by a worker.
        let held = format!("state = 0 AND expires_at > {now} AND (wait IS NULL OR wait = 0)");
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
            // A completed item is a done record (I4): its inbox columns go.
            complete: format!(
                "UPDATE {t} SET outcome = ?, completed_at = {now}, state = 1, expires_at = {now} + ?,
                        payload = NULL, last_error = NULL, due_at = NULL, wait = NULL
                 WHERE namespace = ? AND id = ? AND token = ? AND {held}"
            ),
            // A claim's release; an item held by the lease is given back
            // instead (`give_back`).
            release: format!(
                "DELETE FROM {t}
                 WHERE namespace = ? AND id = ? AND token = ? AND state = 0 AND expires_at > {now}
                   AND wait IS NULL"
            ),
            extend: format!(
                "UPDATE {t} SET due_at = IF(wait = 0, {now} + ?, due_at), expires_at = {now} + ?
                 WHERE namespace = ? AND id = ? AND token = ? AND {held}"
            ),
            expire_batch: format!(
                "DELETE FROM {t} WHERE expires_at <= {now} AND wait IS NULL
                 ORDER BY expires_at LIMIT {EXPIRE_BATCH}"
            ),
            // Dead items past their retention (I16), by the `dead` index.
            expire_dead_batch: format!(
                "DELETE FROM {t} WHERE dead_until <= {now} AND wait = 2
                 ORDER BY dead_until LIMIT {EXPIRE_BATCH}"
            ),
            forget: format!("DELETE FROM {t} WHERE namespace = ? AND id = ? AND token = ?"),
            // The token and whether the row is live, undecoded: a record
            // that does not decode is forgotten too.
            forget_read: format!(
                "SELECT token, expires_at > {now} OR wait IS NOT NULL FROM {t}
                 WHERE namespace = ? AND id = ?"
            ),
            has_column: format!(
                "SELECT COUNT(*) FROM information_schema.COLUMNS
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table}' AND COLUMN_NAME = ?"
            ),
            // A pending item, due after the delay bound twice (0, or until
            // its `not_before`), with its own attempt limit, for a key with
            // nothing live; an expired claim taken over keeps its attempts
            // and first sight. A live row is left as it is (the read-back's
            // token says which happened). Assignments run left to right, each
            // seeing the ones before it: `token` is decided on `gone` first,
            // and every assignment after it asks whether the token is this
            // accept's (`ours`), which the columns `gone` reads changing
            // cannot upset.
            accept: format!(
                "INSERT INTO {t} (namespace, id, state, token, claim_id, fingerprint, expires_at,
                                  completed_at, outcome, attempts, first_seen, payload, wait,
                                  last_error, due_at, takeovers, max_attempts, order_key,
                                  order_seq, order_skip, accept_token)
                 VALUES (?, ?, 0, ?, NULL, NULL, {now} + ?, NULL, NULL, 0, {now}, ?, 1, NULL,
                         {now} + ?, 0, ?, ?,
                         IF(? IS NULL, NULL,
                            (SELECT coalesce(max(s.order_seq), 0) + 1
                             FROM (SELECT order_seq FROM {t}
                                   WHERE namespace = ? AND order_key = ?
                                     AND wait IN (0, 1, 2)) AS s)),
                         ?, ?)
                 ON DUPLICATE KEY UPDATE
                    attempts     = IF({gone}, IF(state = 0, attempts, 0), attempts),
                    first_seen   = IF({gone}, IF(state = 0, first_seen, VALUES(first_seen)), first_seen),
                    token        = IF({gone}, VALUES(token), token),
                    claim_id     = IF({ours}, NULL, claim_id),
                    fingerprint  = IF({ours}, NULL, fingerprint),
                    completed_at = IF({ours}, NULL, completed_at),
                    outcome      = IF({ours}, NULL, outcome),
                    payload      = IF({ours}, VALUES(payload), payload),
                    last_error   = IF({ours}, NULL, last_error),
                    due_at       = IF({ours}, VALUES(due_at), due_at),
                    takeovers    = IF({ours}, 0, takeovers),
                    max_attempts = IF({ours}, VALUES(max_attempts), max_attempts),
                    order_key    = IF({ours}, VALUES(order_key), order_key),
                    order_seq    = IF({ours}, VALUES(order_seq), order_seq),
                    order_skip   = IF({ours}, VALUES(order_skip), order_skip),
                    accept_token = IF({ours}, VALUES(accept_token), accept_token),
                    errors       = IF({ours}, NULL, errors),
                    dead_until   = IF({ours}, NULL, dead_until),
                    state        = IF({ours}, 0, state),
                    expires_at   = IF({ours}, VALUES(expires_at), expires_at),
                    wait         = IF({ours}, 1, wait)",
                ours = "token = VALUES(token)"
            ),
            select_item: format!(
                "SELECT {ITEM} FROM {t} WHERE namespace = ? AND id = ? AND wait IS NOT NULL"
            ),
            // The item under a key after an accept, and whether the accept
            // (its token, bound first) wrote it.
            accepted: format!(
                "SELECT COALESCE(accept_token = ?, FALSE), {ITEM} FROM {t}
                 WHERE namespace = ? AND id = ? AND wait IS NOT NULL"
            ),
            // An item held by the lease, due now, the attempt its take counted
            // taken back (I9); an item given back so already under this token
            // (the same release sent again) matches too and is left as it is.
            // `wait` last: the assignments before it read the old one.
            give_back: format!(
                "UPDATE {t} SET attempts = IF(wait = 0, attempts - 1, attempts),
                                expires_at = IF(wait = 0, {now}, expires_at),
                                due_at = IF(wait = 0, {now}, due_at), wait = 1
                 WHERE namespace = ? AND id = ? AND token = ?
                   AND ((wait = 0 AND expires_at > {now}) OR (wait = 1 AND expires_at <= {now}))"
            ),
            // An item held by the lease snoozed: due the delay (bound first)
            // from now, the attempt its take counted taken back (I12); one
            // waiting under this token already (the same snooze sent again)
            // matches too and is left as it is. `wait` last.
            snooze: format!(
                "UPDATE {t} SET attempts = IF(wait = 0, attempts - 1, attempts),
                                expires_at = IF(wait = 0, {now} + ?, expires_at),
                                due_at = IF(wait = 0, {now} + ?, due_at), wait = 1
                 WHERE namespace = ? AND id = ? AND token = ?
                   AND ((wait = 0 AND expires_at > {now}) OR wait = 1)"
            ),
            // The oldest due items of a namespace, locked as the index hands
            // them out, skipping rows other takers hold: each goes to one
            // taker, and takers never wait on each other. The caller leases
            // them in the same transaction.
            // An item an item of its ordering key holds back is passed
            // over (I15): another of the key is held, or an earlier one
            // (accept order, ties by id) waits, or is dead and not to be
            // skipped. The look is a plain read of the snapshot: an item it
            // sees waiting or held holds the next one back either way.
            pick: format!(
                "SELECT id, attempts, payload, last_error, {now}, wait, takeovers, max_attempts, first_seen,
                        order_key
                 FROM {t} AS c FORCE INDEX (due)
                 WHERE namespace = ? AND due_at <= {now}
                   AND NOT EXISTS (SELECT 1 FROM {p} WHERE namespace = ?)
                   AND (c.order_key IS NULL OR NOT EXISTS (
                     SELECT 1 FROM {t} AS o
                     WHERE o.namespace = c.namespace AND o.order_key = c.order_key
                       AND o.wait IN (0, 1, 2) AND o.id <> c.id
                       AND (o.wait = 0
                            OR (c.wait <> 0
                                AND (o.order_seq < c.order_seq
                                     OR (o.order_seq = c.order_seq AND o.id < c.id))
                                AND (o.wait = 1 OR (o.wait = 2 AND o.order_skip = 0))))))
                 ORDER BY due_at LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            // An item failed so under this token already (the same fail sent
            // again) matches too, and is left as it is. `wait` last: the
            // others read the old one.
            fail: format!(
                "UPDATE {t} SET last_error = ?,
                        expires_at = IF(wait = 0, {now} + ?, expires_at),
                        due_at = IF(wait <> 0, due_at, IF(? = 2, NULL, {now} + ?)),
                        dead_until = IF(wait <> 0, dead_until, {now} + ?),
                        errors = IF(wait <> 0, errors,
                            JSON_ARRAY_APPEND(
                                IF(JSON_LENGTH(COALESCE(errors, '[]')) >= {ERROR_HISTORY},
                                   JSON_REMOVE(errors, '$[0]'), COALESCE(errors, '[]')),
                                '$', JSON_ARRAY(attempts, {now}, ?))),
                        wait = ?
                 WHERE namespace = ? AND id = ? AND token = ?
                   AND ((wait = 0 AND expires_at > {now}) OR (wait = ? AND last_error = ?))"
            ),
            // The status filter: -1 every status, 0 pending, 1 running, 2
            // failed, 3 dead.
            list: format!(
                "SELECT {ITEM} FROM {t}
                 WHERE namespace = ? AND id > ? AND wait IS NOT NULL
                   AND (? = -1
                        OR (? = 0 AND wait = 1 AND last_error IS NULL)
                        OR (? = 1 AND wait = 0)
                        OR (? = 2 AND wait = 1 AND last_error IS NOT NULL)
                        OR (? = 3 AND wait = 2))
                 ORDER BY id LIMIT ?"
            ),
            replay: format!(
                "UPDATE {t} SET expires_at = {now}, due_at = {now}, dead_until = NULL, wait = 1
                 WHERE namespace = ? AND id = ? AND (wait = 2 OR (wait = 1 AND last_error IS NOT NULL))"
            ),
            counts: format!(
                "SELECT CAST(COALESCE(SUM(wait = 1 AND last_error IS NULL), 0) AS SIGNED),
                        CAST(COALESCE(SUM(wait = 0), 0) AS SIGNED),
                        CAST(COALESCE(SUM(wait = 1 AND last_error IS NOT NULL), 0) AS SIGNED),
                        CAST(COALESCE(SUM(wait = 2), 0) AS SIGNED),
                        MIN(IF(wait = 1, expires_at, NULL))
                 FROM {t} WHERE namespace = ? AND wait IS NOT NULL"
            ),
            // A pause (I13) is a row; `take`'s pick reads it.
            pause: format!("INSERT IGNORE INTO {p} (namespace, paused_at) VALUES (?, {now})"),
            resume: format!("DELETE FROM {p} WHERE namespace = ?"),
            paused: format!("SELECT EXISTS (SELECT 1 FROM {p} WHERE namespace = ?)"),
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

    /// Leases `rows` items a take picked, in one statement: each its own
    /// token (`CASE id WHEN ? THEN ? ...`), one more attempt, one more
    /// takeover when it was held (before `wait` changes: assignments run
    /// left to right), and the deadline; then the namespace and the `rows`
    /// ids.
    pub(crate) fn lease_taken(&self, rows: usize) -> String {
        let mut sql = format!(
            "UPDATE `{}` SET takeovers = takeovers + (wait = 0), wait = 0, attempts = attempts + 1, \
             expires_at = ?, due_at = ?, token = CASE id",
            self.table
        );
        for _ in 0..rows {
            sql.push_str(" WHEN ? THEN ?");
        }
        sql.push_str(" END WHERE namespace = ? AND id IN (");
        for i in 0..rows {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push('?');
        }
        sql.push(')');
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
