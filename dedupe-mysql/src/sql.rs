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

/// The server's time in milliseconds when the row is read, not when the
/// statement started: `NOW_MS` plus the time since (`SYSDATE(3)` is read at
/// each use, `NOW(3)` at the start, both in the session's zone, so their
/// difference is the elapsed time). For a condition that must see a write
/// committed while the statement waited for its row lock as in the past: a
/// replay that waited behind another would otherwise find that one's due
/// time ahead of its own start, and replay again.
pub(crate) const NOW_READ_MS: &str =
    "((TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) \
      + TIMESTAMPDIFF(MICROSECOND, NOW(3), SYSDATE(3))) DIV 1000)";

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
    include_str!("../migrations/0009_order_park.sql"),
];

/// For each migration after the first, in the order of [`MIGRATIONS`]: the
/// column whose absence says it has not run (MySQL's `ALTER TABLE` has no
/// `IF NOT EXISTS`) and its name; `None` for one that creates only what is
/// missing, and runs every time.
pub(crate) const GATES: [Option<(&str, &str)>; 8] = [
    Some(("due_at", "0002_inbox")),
    Some(("takeovers", "0003_item_counts")),
    None,
    Some(("order_key", "0005_ordering")),
    Some(("dead_until", "0006_dead_retention")),
    Some(("errors", "0007_error_history")),
    Some(("accept_token", "0008_accept_token")),
    Some(("order_head", "0009_order_park")),
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
    pub(crate) promote: String,
    pub(crate) complete_ordered: String,
    pub(crate) order_key_of: String,
    pub(crate) skipped_key: String,
    pub(crate) park_front: String,
    pub(crate) expire_dead_ordered: String,
    pub(crate) expire_dead_one: String,
    pub(crate) forget_read: String,
    pub(crate) forget_if_read: String,
    pub(crate) forget_if: String,
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
        let now_read = NOW_READ_MS;
        // The takeover test, judged on the row as it was: every assignment
        // below reads only `expires_at` and `state`, and those two are
        // assigned last (`state`, then `expires_at`), because MySQL and
        // MariaDB evaluate `ON DUPLICATE KEY UPDATE` assignments left to
        // right, each seeing the columns assigned before it.
        // Never an inbox item: the inbox owns its key until it is done (I7).
        let gone = format!("(expires_at <= {now} AND wait IS NULL)");
        // A row of a live lease: a claim's, or an item's held by a worker.
        let held = format!("state = 0 AND expires_at > {now} AND (wait IS NULL OR wait = 0)");
        // Whether item `c` of an ordering key is held back by another item
        // of its key (I15): another is held, or, unless `c` is held itself
        // (a takeover comes first), an earlier one (accept order, ties by
        // id) waits, or is dead and not to be skipped.
        let held_back = format!(
            "EXISTS (
                SELECT 1 FROM {t} AS o
                WHERE o.namespace = c.namespace AND o.order_key = c.order_key
                  AND o.wait IN (0, 1, 2) AND o.id <> c.id
                  AND (o.wait = 0
                       OR (c.wait <> 0
                           AND (o.order_seq < c.order_seq
                                OR (o.order_seq = c.order_seq AND o.id < c.id))
                           AND (o.wait = 1 OR (o.wait = 2 AND o.order_skip = 0)))))"
        );
        // The first waiting item of the ordering key of the rows of
        // `leaving` (namespace, id, order_key) other than that row, made the
        // key's head and due again if a take parked it (see migration 0009).
        // Run in the statement or transaction that takes the row out of the
        // queue: a take that parked the head and has not committed holds
        // its row, and this waits for it and then writes over the park; a
        // take that has not yet parked it finds it a head and leaves it due.
        let next = |leaving: &str| {
            format!(
                "(SELECT n.namespace, n.id FROM {t} AS n
                  JOIN ({leaving}) AS k
                    ON n.namespace = k.namespace AND n.order_key = k.order_key AND n.id <> k.id
                  WHERE n.wait = 1
                  ORDER BY n.order_seq, n.id LIMIT 1) AS m"
            )
        };
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
            // Not an item of an ordering key: that one is `complete_ordered`.
            complete: format!(
                "UPDATE {t} SET outcome = ?, completed_at = {now}, state = 1, expires_at = {now} + ?,
                        payload = NULL, last_error = NULL, due_at = NULL, wait = NULL
                 WHERE namespace = ? AND id = ? AND token = ? AND {held} AND order_key IS NULL"
            ),
            // An item of an ordering key, completed in a transaction that
            // then makes the next item of its key the key's head (`promote`).
            complete_ordered: format!(
                "UPDATE {t} SET outcome = ?, completed_at = {now}, state = 1, expires_at = {now} + ?,
                        payload = NULL, last_error = NULL, due_at = NULL, wait = NULL
                 WHERE namespace = ? AND id = ? AND token = ? AND {held} AND order_key IS NOT NULL"
            ),
            order_key_of: format!("SELECT order_key FROM {t} WHERE namespace = ? AND id = ?"),
            // The next item of an ordering key bound as (namespace, key) made
            // its head, in the transaction that took an item of the key out
            // of its queue (done, dead and skipped, forgotten, expired).
            promote: format!(
                "UPDATE {t} AS b JOIN {m} ON b.namespace = m.namespace AND b.id = m.id
                 SET b.order_head = 1, b.due_at = COALESCE(b.due_at, b.expires_at)
                 WHERE b.wait = 1",
                m = next("SELECT ? AS namespace, '' AS id, ? AS order_key")
            ),
            // The ordering key of an item dead and to be skipped, read in the
            // transaction that failed it so.
            skipped_key: format!(
                "SELECT order_key FROM {t}
                 WHERE namespace = ? AND id = ? AND wait = 2 AND order_skip = 1
                   AND order_key IS NOT NULL"
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
            // Dead items past their retention (I16), by the `dead` index;
            // those of an ordering key go one at a time, each with its key's
            // next item (`expire_dead_ordered`).
            expire_dead_batch: format!(
                "DELETE FROM {t} WHERE dead_until <= {now} AND wait = 2 AND order_key IS NULL
                 ORDER BY dead_until LIMIT {EXPIRE_BATCH}"
            ),
            expire_dead_ordered: format!(
                "SELECT namespace, id, order_key FROM {t}
                 WHERE dead_until <= {now} AND wait = 2 AND order_key IS NOT NULL
                 ORDER BY dead_until LIMIT {EXPIRE_BATCH}"
            ),
            // One of those, unless replayed since.
            expire_dead_one: format!(
                "DELETE FROM {t} WHERE namespace = ? AND id = ? AND wait = 2 AND dead_until <= {now}"
            ),
            forget: format!("DELETE FROM {t} WHERE namespace = ? AND id = ? AND token = ?"),
            // The token and whether the row is live, undecoded: a record
            // that does not decode is forgotten too.
            forget_read: format!(
                "SELECT token, expires_at > {now} OR wait IS NOT NULL, IF(wait IS NULL, NULL, order_key)
                 FROM {t}
                 WHERE namespace = ? AND id = ?"
            ),
            // The item's ordering key, locked, while it is in status ? (as
            // `list`'s codes) at attempt ? (I17); then removed by its key in
            // the same transaction.
            forget_if_read: format!(
                "SELECT order_key FROM {t}
                 WHERE namespace = ? AND id = ? AND wait IS NOT NULL AND attempts = ?
                   AND CASE WHEN wait = 0 THEN 1 WHEN wait = 2 THEN 3
                            WHEN wait = 1 AND last_error IS NULL THEN 0
                            WHEN wait = 1 THEN 2 END = ?
                 FOR UPDATE"
            ),
            forget_if: format!("DELETE FROM {t} WHERE namespace = ? AND id = ?"),
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
                    order_head   = IF({ours}, 0, order_head),
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
            // An item its ordering key holds back is picked too, marked
            // (the last column), and the caller parks it (see migration
            // 0009) instead of leasing it; a head held back (made one while
            // an item of its key ran out of turn: a replay) is passed over.
            // So a pick reads at most its limit of rows besides the rows
            // others hold and those heads.
            pick: format!(
                "SELECT id, attempts, payload, last_error, {now}, wait, takeovers, max_attempts, first_seen,
                        order_key, c.order_key IS NOT NULL AND {held_back} AS blocked
                 FROM {t} AS c FORCE INDEX (due)
                 WHERE namespace = ? AND due_at <= {now}
                   AND NOT EXISTS (SELECT 1 FROM {p} WHERE namespace = ?)
                   AND (c.order_key IS NULL OR c.order_head = 0 OR NOT {held_back})
                 ORDER BY due_at LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            // The items their ordering key holds back among the first `?`
            // due items of a namespace, locked for parking, skipping rows
            // others hold: the take's help when its pick met held-back items,
            // so that a burst of them costs a take one statement per `?`
            // instead of one per item. Heads are left due.
            park_front: format!(
                "SELECT id FROM {t} AS c FORCE INDEX (due)
                 WHERE namespace = ?
                   AND due_at <= COALESCE(
                       (SELECT due_at FROM {t} FORCE INDEX (due)
                        WHERE namespace = ? AND due_at <= {now}
                        ORDER BY due_at LIMIT 1 OFFSET ?),
                       {now})
                   AND c.order_key IS NOT NULL AND c.wait = 1 AND c.order_head = 0 AND {held_back}
                 FOR UPDATE SKIP LOCKED"
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
                 WHERE namespace = ? AND id = ?
                   AND (wait = 2 OR (wait = 1 AND last_error IS NOT NULL
                                     AND (due_at IS NULL OR due_at > {now_read})))"
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
        close_list(sql, rows, "?")
    }

    /// Parks `rows` items a take locked (see migration 0009): the namespace
    /// then the ids. A head is left due.
    pub(crate) fn park_ids(&self, rows: usize) -> String {
        let sql = format!(
            "UPDATE `{}` SET due_at = NULL \
             WHERE namespace = ? AND wait = 1 AND order_head = 0 AND id IN (",
            self.table
        );
        close_list(sql, rows, "?")
    }

    /// Reads `rows` keys back: `(namespace, id)` then the columns.
    pub(crate) fn select_many(&self, rows: usize) -> String {
        let sql = format!(
            "SELECT namespace, id, {COLUMNS}, {NOW_MS} FROM `{}` WHERE (namespace, id) IN (",
            self.table
        );
        close_list(sql, rows, "(?, ?)")
    }
}

/// `sql` with `rows` copies of `item`, comma-separated, and the closing
/// parenthesis of the list it ends with.
fn close_list(mut sql: String, rows: usize, item: &str) -> String {
    for i in 0..rows {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str(item);
    }
    sql.push(')');
    sql
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
