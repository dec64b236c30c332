//! The statement text of the store, built once per schema and table.

use std::sync::Arc;

use dedupe_core::backend::check_identifier;
use dedupe_core::{Result, ERROR_HISTORY, MAX_CLAIM_ID_BYTES, MAX_FINGERPRINT_BYTES};
use sqlx::AssertSqlSafe;

/// Milliseconds since the epoch of a timestamptz column, as int8.
fn ms(col: &str) -> String {
    format!("floor(extract(epoch FROM {col}) * 1000)::int8")
}

/// The record columns every read returns, in the order `decode` expects.
fn columns(prefix: &str) -> String {
    let p = |c: &str| format!("{prefix}{c}");
    // An inbox item never taken shows as attempt 1 (a record's count starts
    // there).
    let attempts = format!(
        "CASE WHEN {wait} IS NULL THEN {a} ELSE greatest({a}, 1) END AS attempts",
        wait = p("wait"),
        a = p("attempts")
    );
    format!(
        "{state}, {token}, {claim_id}, {fingerprint}, {expires} AS expires_ms, {completed} AS completed_ms, {outcome}, {attempts}, {first} AS first_seen_ms",
        state = p("state"),
        token = p("token"),
        claim_id = p("claim_id"),
        fingerprint = p("fingerprint"),
        expires = ms(&p("expires_at")),
        completed = ms(&p("completed_at")),
        outcome = p("outcome"),
        attempts = attempts,
        first = ms(&p("first_seen")),
    )
}

/// Whether row `t` is live: inside its lease or retention, or an inbox item
/// (an item is live until it is done, whatever its deadline).
fn live(t: &str) -> String {
    format!("({t}expires_at > now() OR {t}wait IS NOT NULL)")
}

/// Whether row `t` passes the checks of `StoredRecord::decode` that SQL can
/// make (state, completion, token, attempts, claim id and fingerprint
/// lengths), which are all the checks it makes on the columns this table
/// holds. The batch claim writes nothing while a key it reads has a live row
/// that fails them: the client then refuses that row as corrupt, and the call
/// has changed nothing. A live row committed after the statement's snapshot
/// meets them in the conflict arm instead (see [`UNDECODABLE`]).
fn decodable(t: &str) -> String {
    format!(
        "(({t}.state = 0 OR ({t}.state = 1 AND {t}.completed_at IS NOT NULL
                              AND {t}.outcome IS NOT NULL))
          AND {t}.token <> '' AND ({t}.attempts >= 1 OR {t}.wait IS NOT NULL)
          AND coalesce(octet_length({t}.claim_id) BETWEEN 1 AND {claim_id}, true)
          AND coalesce(octet_length({t}.fingerprint) BETWEEN 1 AND {fingerprint}, true))",
        claim_id = MAX_CLAIM_ID_BYTES,
        fingerprint = MAX_FINGERPRINT_BYTES,
    )
}

/// The claim statements fail on purpose when their conflict arm meets a live
/// record that would not decode: they cast this text, with the record's key
/// and [`UNDECODABLE_END`] after it, to a number, an error that ends the
/// statement and undoes everything it wrote. Plain SQL has no other way to
/// raise one. [`crate::error::map`] reads the key back out of the error.
pub(crate) const UNDECODABLE: &str = "dedupe: the live record of ";

/// What follows the key in the [`UNDECODABLE`] text.
pub(crate) const UNDECODABLE_END: &str = " does not decode";

/// The names [`columns`] gives, to select them again from a CTE.
const ALIASES: &str =
    "state, token, claim_id, fingerprint, expires_ms, completed_ms, outcome, attempts, first_seen_ms";

/// The schema's migrations, in order: `migrate()` applies every one of them
/// each time (each is safe to apply again; see the first file).
pub(crate) const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/0001_records.sql"),
    include_str!("../migrations/0002_inbox.sql"),
    include_str!("../migrations/0003_item_counts.sql"),
    include_str!("../migrations/0004_paused.sql"),
    include_str!("../migrations/0005_ordering.sql"),
    include_str!("../migrations/0006_dead_retention.sql"),
    include_str!("../migrations/0007_error_history.sql"),
    include_str!("../migrations/0008_order_park.sql"),
];

/// Rows deleted per `expire()` statement, at most.
pub(crate) const EXPIRE_BATCH: i64 = 1000;

/// Table pages one `expire()` statement reads, at most (2 MiB at the default
/// 8 KiB page, about 15,000 records).
pub(crate) const EXPIRE_PAGES: i64 = 256;

/// A statement's text, shared cheaply with every query that runs it. Only
/// [`Statements::new`] makes one, from validated identifiers and fixed text.
pub(crate) type Sql = Arc<str>;

/// The text as sqlx takes it: built from plain identifiers checked by
/// [`check_identifier`] and the fixed text below, never from input.
pub(crate) fn text(sql: &Sql) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(sql))
}

/// The batch statements' input: the distinct keys, bound as the arrays `$1`
/// (namespaces) and `$2` (ids) with `$3` (their tokens), as rows of `key`
/// (`namespace:id`) and `token`.
const INPUT: &str = "SELECT namespace || ':' || id AS key, token
                 FROM unnest($1::text[], $2::text[], $3::text[]) AS u(namespace, id, token)";

/// The key bound as `$1` (namespace) and `$2` (id), as the `key` column holds
/// it. A namespace never holds a `:` (see [`Key`](dedupe_core::Key)), so no two
/// keys join to the same string.
const BOUND: &str = "$1::text || ':' || $2::text";

/// The SQL of one store.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) migrate: Sql,
    pub(crate) claim: Sql,
    pub(crate) insert_new: Sql,
    pub(crate) claim_many: Sql,
    pub(crate) select_live: Sql,
    pub(crate) complete: Sql,
    pub(crate) complete_ordered: Sql,
    pub(crate) release: Sql,
    pub(crate) extend: Sql,
    pub(crate) table_pages: Sql,
    pub(crate) expire_batch: Sql,
    pub(crate) forget: Sql,
    pub(crate) forget_if: Sql,
    pub(crate) accept: Sql,
    pub(crate) select_item: Sql,
    pub(crate) take: Sql,
    pub(crate) park: Sql,
    pub(crate) snooze: Sql,
    pub(crate) fail: Sql,
    pub(crate) list: Sql,
    pub(crate) replay: Sql,
    pub(crate) counts: Sql,
    pub(crate) pause: Sql,
    pub(crate) resume: Sql,
    /// One notification of namespace $1 (I14), outside any other statement:
    /// the trailing one of accepts that left theirs out (`wake::Notices`).
    pub(crate) notify: Sql,
    pub(crate) paused: Sql,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Result<Self> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let t = format!("\"{schema}\".\"{table}\"");
        let p = format!("\"{schema}\".\"{table}_paused\"");
        // Wakes the workers of the namespace bound as $1 when the statement
        // commits (I14; see `wake.rs`). Schema and table are plain
        // identifiers (checked above), safe inside a literal.
        let notify = format!(
            "pg_notify('{channel}', '{prefix}' || $1::text)",
            channel = crate::wake::CHANNEL,
            prefix = crate::wake::topic_prefix(schema, table)
        );
        let cols = columns("");
        let kcols = "key";
        let bound = BOUND;
        let is_bound = format!("key = {BOUND}");
        let input = INPUT;
        let live_row = live("");
        // The statement's time in ms since the epoch (a failure's, in the
        // item's history).
        let now_ms = ms("now()");
        let item = format!(
            "key, wait, attempts, {first} AS first_seen_ms, {expires} AS expires_ms, last_error, payload,
             takeovers, max_attempts, order_key, errors::text AS errors",
            first = ms("first_seen"),
            expires = ms("expires_at")
        );
        // Whether item `c` of an ordering key is held back by another item
        // of its key (I15): another is held, or, unless `c` is held itself
        // (a takeover comes first), an earlier one (accept order, ties by
        // key) waits, or is dead and not to be skipped.
        let held_back = format!(
            "EXISTS (
                SELECT 1 FROM {t} o
                WHERE split_part(o.key, ':', 1) = $1::text AND o.order_key = c.order_key
                  AND o.wait IS NOT NULL AND o.key <> c.key
                  AND (o.wait = 0
                       OR (c.wait <> 0
                           AND (o.order_seq, o.key) < (c.order_seq, c.key)
                           AND (o.wait = 1 OR (o.wait = 2 AND NOT o.order_skip)))))"
        );
        // Makes the first waiting item of each ordering key that a row of
        // `from` (key, order_key) left the key's head, due again if a take
        // parked it (see migration 0008). Run in the statement that takes
        // the row out of the queue: a take that parked the head and has not
        // committed holds its row, and this update waits for it and then
        // writes over the park; a take that has not yet parked it finds it a
        // head and leaves it due.
        let promote = |from: &str| {
            format!(
                "UPDATE {t} n SET order_head = true, due_at = coalesce(n.due_at, n.expires_at)
                 WHERE n.key = ANY(ARRAY(
                    SELECT f.key
                    FROM (SELECT DISTINCT split_part(key, ':', 1) AS ns, order_key, key AS left_key
                          FROM {from} WHERE order_key IS NOT NULL) g
                    CROSS JOIN LATERAL (
                        SELECT o.key FROM {t} o
                        WHERE split_part(o.key, ':', 1) = g.ns AND o.order_key = g.order_key
                          AND o.wait = 1 AND o.key <> g.left_key
                        ORDER BY o.order_seq, o.key LIMIT 1) f))
                   AND n.wait = 1"
            )
        };
        // The conflict arm of both claim statements. An expired record is taken
        // over. A live one reaches it only when it was committed after the
        // statement's snapshot was taken (the statement's own read skips
        // every record it can see live): it is written back as it is and
        // returned, so the statement answers every key it was asked, and the
        // caller tells a win from a loss by the token. A live record there
        // that would not decode fails the whole statement (see
        // [`UNDECODABLE`]), so a batch never keeps the keys it won while it
        // answers an error.
        // Never an inbox item: the inbox owns its key until it is done.
        let taken = "(r.expires_at <= now() AND r.wait IS NULL)";
        let arm = |column: &str, new: &str| {
            format!("{column} = CASE WHEN {taken} THEN {new} ELSE r.{column} END")
        };
        let upsert_tail = format!(
            "ON CONFLICT ({kcols}) DO UPDATE SET
                state = CASE WHEN {taken} THEN 0::int2 WHEN {decodable} THEN r.state
                             ELSE ('{UNDECODABLE}' || r.key || '{UNDECODABLE_END}')::int2 END,
                {token}, {claim_id}, {fingerprint}, {expires}, {completed}, {outcome},
                attempts = CASE WHEN NOT {taken} THEN r.attempts
                                WHEN r.state = 0 THEN r.attempts + 1 ELSE 1 END,
                first_seen = CASE WHEN NOT {taken} OR r.state = 0 THEN r.first_seen
                                  ELSE excluded.first_seen END",
            decodable = decodable("r"),
            token = arm("token", "excluded.token"),
            claim_id = arm("claim_id", "excluded.claim_id"),
            fingerprint = arm("fingerprint", "excluded.fingerprint"),
            expires = arm("expires_at", "excluded.expires_at"),
            completed = arm("completed_at", "NULL"),
            outcome = arm("outcome", "NULL"),
        );
        Ok(Self {
            schema: schema.to_string(),
            table: table.to_string(),
            // One simple-query message, which Postgres runs as one implicit
            // transaction: the advisory lock is held to the end.
            migrate: std::iter::once(format!(
                "SELECT pg_advisory_xact_lock(hashtext('dedupe-migrate:' || '{schema}.{table}'));"
            ))
            .chain(MIGRATIONS.iter().map(|migration| {
                migration
                    .replace("{schema}", schema)
                    .replace("{table}", table)
            }))
            .collect::<Vec<_>>()
            .join("\n")
            .into(),
            // One statement, one round trip. `live` reads the key first: a live
            // record (a duplicate, or a claim in flight) is answered from it and the
            // insert gets no row to write, so the statement writes nothing, takes no
            // transaction id and no row lock. Otherwise the upsert inserts a fresh
            // record or takes over an expired one.
            claim: format!(
                "WITH live AS (
                    SELECT {cols} FROM {t}
                    WHERE {is_bound} AND {live_row}
                 ), claimed AS (
                    INSERT INTO {t} AS r ({kcols}, state, token, claim_id, fingerprint,
                                          expires_at, completed_at, outcome, attempts, first_seen)
                    SELECT {bound}, 0, $3::text, $4::text, $5::bytea, now() + $6::interval,
                           NULL, NULL, 1, now()
                    WHERE NOT EXISTS (SELECT 1 FROM live)
                    {upsert_tail}
                    RETURNING {cols}
                 )
                 SELECT token = $3::text AS won, {ALIASES} FROM claimed
                 UNION ALL
                 SELECT false AS won, {ALIASES} FROM live"
            )
            .into(),
            // The cheapest claim there is, for a key that has no record: the bare
            // insert. A key with a record (live, or expired to take over) conflicts,
            // and `DO NOTHING` leaves its row untouched, unlocked and unwritten; the
            // caller then runs `claim`. See `PgStore`'s claim for when it is tried.
            insert_new: format!(
                "INSERT INTO {t} ({kcols}, state, token, claim_id, fingerprint,
                                  expires_at, completed_at, outcome, attempts, first_seen)
                 VALUES ({bound}, 0, $3::text, $4::text, $5::bytea, now() + $6::interval,
                         NULL, NULL, 1, now())
                 ON CONFLICT ({kcols}) DO NOTHING
                 RETURNING {expires}",
                expires = ms("expires_at")
            )
            .into(),
            // The same for a batch of distinct keys, in one round trip. Each key is
            // looked up on the primary key (a lateral probe, so no plan can turn it
            // into a scan of the table); only the keys with no live record reach the
            // upsert, taken in key order so concurrent batches lock in the same order,
            // and none does while a live record among them would not decode.
            claim_many: format!(
                "WITH input AS ({input}),
                 live AS (
                    SELECT {ikey} AS key, l.* FROM input i
                    CROSS JOIN LATERAL (
                        SELECT {tcols}, {decodable} AS decodable FROM {t} t
                        WHERE {t_is_i} AND {live_t}
                    ) l
                 ), claimed AS (
                    INSERT INTO {t} AS r ({kcols}, state, token, claim_id, fingerprint,
                                          expires_at, completed_at, outcome, attempts, first_seen)
                    SELECT {kcols}, 0, token, $4::text, $5::bytea, now() + $6::interval,
                           NULL, NULL, 1, now()
                    FROM input i
                    WHERE NOT EXISTS (SELECT 1 FROM live v WHERE v.key = {ikey})
                      AND NOT EXISTS (SELECT 1 FROM live WHERE decodable IS NOT TRUE)
                    ORDER BY {kcols}
                    {upsert_tail}
                    RETURNING {rkey} AS key, {cols}
                 )
                 SELECT c.token = i.token AS won, c.key, {claimed} FROM claimed c
                 JOIN input i ON i.key = c.key
                 UNION ALL
                 SELECT false AS won, key, {ALIASES} FROM live",
                claimed = ALIASES
                    .split(", ")
                    .map(|column| format!("c.{column}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                ikey = "i.key",
                rkey = "r.key",
                tcols = columns("t."),
                t_is_i = "t.key = i.key",
                decodable = decodable("t"),
                live_t = live("t."),
            )
            .into(),
            select_live: format!("SELECT {cols} FROM {t} WHERE {is_bound} AND {live_row}").into(),
            // In flight under this token: done. Already done by this token with
            // this outcome (a complete asked again): written back as it is, so
            // the answer is the first one's.
            // Records and items without an ordering key: the statement as it
            // was before ordering keys (the one with `promote` cost the
            // claim-and-complete bench row 0.38-0.77 of raw against
            // 0.74-0.95, alternating runs, 2026-12-07).
            complete: format!(
                "UPDATE {t} SET state = 1,
                        expires_at = CASE WHEN state = 0 THEN now() + $4::interval ELSE expires_at END,
                        completed_at = CASE WHEN state = 0 THEN now() ELSE completed_at END,
                        outcome = $5, payload = NULL, wait = NULL, last_error = NULL, due_at = NULL
                 WHERE {is_bound} AND token = $3 AND expires_at > now()
                   AND (state = 0 OR outcome = $5) AND (wait IS NULL OR wait = 0)
                   AND order_key IS NULL"
            )
            .into(),
            // An item of an ordering key done leaves its key's queue: the
            // next one is the key's head, in the same statement.
            complete_ordered: format!(
                "WITH done AS (
                    UPDATE {t} SET state = 1,
                        expires_at = CASE WHEN state = 0 THEN now() + $4::interval ELSE expires_at END,
                        completed_at = CASE WHEN state = 0 THEN now() ELSE completed_at END,
                        outcome = $5, payload = NULL, wait = NULL, last_error = NULL, due_at = NULL
                    WHERE {is_bound} AND token = $3 AND expires_at > now()
                      AND (state = 0 OR outcome = $5) AND (wait IS NULL OR wait = 0)
                      AND order_key IS NOT NULL
                    RETURNING key, order_key
                 ), next AS ({next})
                 SELECT count(*) FROM done",
                next = promote("done")
            )
            .into(),
            // True when the lease's live record was removed, or when no live
            // record is under the key (the snapshot's: a record committed
            // since is a later claim's); false for a live record of another
            // lease, or a done one.
            // An item held by this lease is given back instead, due now,
            // the attempt its take counted taken back (I9).
            release: format!(
                "WITH gone AS (DELETE FROM {t}
                                WHERE {is_bound} AND token = $3 AND state = 0 AND expires_at > now()
                                  AND wait IS NULL
                                RETURNING 1),
                      given AS (UPDATE {t} SET wait = 1,
                                       attempts = CASE WHEN wait = 0 THEN attempts - 1 ELSE attempts END,
                                       expires_at = CASE WHEN wait = 0 THEN now() ELSE expires_at END,
                                       due_at = CASE WHEN wait = 0 THEN now() ELSE due_at END
                                WHERE {is_bound} AND token = $3
                                  AND ((wait = 0 AND expires_at > now())
                                       OR (wait = 1 AND expires_at <= now()))
                                RETURNING {notify})
                 SELECT EXISTS (SELECT 1 FROM gone) OR EXISTS (SELECT 1 FROM given)
                        OR NOT EXISTS (SELECT 1 FROM {t} WHERE {is_bound} AND {live_row})"
            )
            .into(),
            extend: format!(
                "UPDATE {t} SET expires_at = now() + $4::interval,
                        due_at = CASE WHEN wait = 0 THEN now() + $4::interval ELSE due_at END
                 WHERE {is_bound} AND token = $3 AND state = 0 AND expires_at > now()
                   AND (wait IS NULL OR wait = 0)
                 RETURNING {expires}",
                expires = ms("expires_at")
            )
            .into(),
            // How far the purge walks: the table's size in pages when it starts.
            table_pages: format!(
                "SELECT (pg_relation_size('{t}'::regclass)
                         / current_setting('block_size')::int8)::int8"
            )
            .into(),
            // One bounded step of the purge: the expired rows of pages [$1, $2),
            // at most $3 of them, skipping rows other transactions hold, so a purge
            // never waits on (or blocks) a claim. A TID range scan reads only those
            // pages; there is no index on `expires_at` to find them (see `migrate`).
            // A dead item removed leaves its ordering key's queue (I16).
            expire_batch: format!(
                "WITH gone AS (
                    DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM {t}
                        WHERE ctid >= format('(%s,0)', $1::int8)::tid
                          AND ctid < format('(%s,0)', $2::int8)::tid
                          AND ((expires_at <= now() AND wait IS NULL)
                               OR (wait = 2 AND dead_until <= now()))
                        LIMIT $3 FOR UPDATE SKIP LOCKED))
                    RETURNING key, CASE WHEN wait IS NOT NULL THEN order_key END AS order_key
                 ), next AS ({next})
                 SELECT count(*) FROM gone",
                next = promote("gone")
            )
            .into(),
            // A forgotten item leaves its ordering key's queue (I15).
            forget: format!(
                "WITH gone AS (
                    DELETE FROM {t} WHERE {is_bound}
                    RETURNING key, CASE WHEN wait IS NOT NULL THEN order_key END AS order_key,
                              {live_row} AS live
                 ), next AS ({next})
                 SELECT live FROM gone",
                next = promote("gone")
            )
            .into(),
            // The item only while in status $3 (as `list`'s) at attempt $4
            // (I17), leaving its ordering key's queue as a forget does.
            forget_if: format!(
                "WITH gone AS (
                    DELETE FROM {t} WHERE {is_bound} AND attempts = $4::int4
                      AND (($3::int4 = 0 AND wait = 1 AND last_error IS NULL)
                           OR ($3 = 1 AND wait = 0)
                           OR ($3 = 2 AND wait = 1 AND last_error IS NOT NULL)
                           OR ($3 = 3 AND wait = 2))
                    RETURNING key, order_key
                 ), next AS ({next})
                 SELECT count(*) FROM gone",
                next = promote("gone")
            )
            .into(),
            // A pending item, due after $5 ms (0, or until its `not_before`),
            // with its own attempt limit $6, for a key with nothing live (a
            // claim whose lease passed keeps its attempts and first sight). Like the
            // claim, a live record (read first, or committed since the
            // snapshot) is left as it is, and answered.
            accept: format!(
                "WITH live AS (
                    SELECT 1 FROM {t} WHERE {is_bound} AND {live_row}
                 )
                 INSERT INTO {t} AS r ({kcols}, state, token, claim_id, fingerprint, expires_at,
                                       completed_at, outcome, attempts, first_seen, payload, wait,
                                       last_error, due_at, takeovers, max_attempts, order_key,
                                       order_seq, order_skip)
                 SELECT {bound}, 0, $3::text, NULL, NULL, now() + $5::int8 * interval '1 ms', NULL,
                        NULL, 0, now(), $4::bytea, 1, NULL, now() + $5::int8 * interval '1 ms', 0,
                        $6::int4, $7::text,
                        CASE WHEN $7::text IS NULL THEN NULL
                             ELSE (SELECT coalesce(max(order_seq), 0) + 1 FROM {t}
                                   WHERE split_part(key, ':', 1) = $1::text
                                     AND order_key = $7::text AND wait IS NOT NULL) END,
                        $8::bool
                 WHERE NOT EXISTS (SELECT 1 FROM live)
                 ON CONFLICT ({kcols}) DO UPDATE SET
                    state = 0, token = excluded.token, claim_id = NULL, fingerprint = NULL,
                    expires_at = excluded.expires_at, completed_at = NULL, outcome = NULL,
                    attempts = CASE WHEN r.state = 0 THEN r.attempts ELSE 0 END,
                    first_seen = CASE WHEN r.state = 0 THEN r.first_seen ELSE excluded.first_seen END,
                    payload = excluded.payload, wait = 1, last_error = NULL, due_at = excluded.due_at,
                    takeovers = 0, max_attempts = excluded.max_attempts,
                    order_key = excluded.order_key, order_seq = excluded.order_seq,
                    order_skip = excluded.order_skip, errors = NULL, dead_until = NULL,
                    order_head = false
                 WHERE r.expires_at <= now() AND r.wait IS NULL
                 RETURNING token, CASE WHEN $5::int8 = 0 AND $9::bool THEN {notify}::text END AS woke"
            )
            .into(),
            select_item: format!(
                "SELECT {item} FROM {t} WHERE {is_bound} AND wait IS NOT NULL"
            )
            .into(),
            // Leases the oldest due items of a namespace, skipping rows other
            // takers hold: each goes to one taker, and takers never wait on
            // each other. An item its ordering key holds back (I15) is
            // parked instead (`due_at` NULL, see migration 0008), so the
            // pick reads at most `$2` rows besides the rows others hold and
            // a key's heads that are held back (made heads while an item of
            // their key ran out of turn: a replay). Two takers racing see
            // the first item of a key either waiting or held, so neither
            // hands out the second. One row more carries the number parked
            // (its key NULL): the caller runs `park` and takes again when
            // the pick parked items instead of filling the take.
            take: format!(
                "WITH picked AS (
                    SELECT key, due_at, (c.order_key IS NOT NULL AND {held_back}) AS blocked
                    FROM {t} c
                    WHERE split_part(key, ':', 1) = $1::text AND due_at <= now()
                      AND NOT EXISTS (SELECT 1 FROM {p} WHERE namespace = $1::text)
                      AND (c.order_key IS NULL OR NOT c.order_head OR NOT {held_back})
                    ORDER BY due_at
                    LIMIT $2 FOR UPDATE SKIP LOCKED
                 ), parked AS (
                    UPDATE {t} t SET due_at = NULL
                    WHERE t.key = ANY(ARRAY(SELECT key FROM picked WHERE blocked))
                      AND t.wait = 1 AND NOT t.order_head
                    RETURNING 1
                 ), taken AS (
                    UPDATE {t} t SET wait = 0,
                           token = md5(random()::text || clock_timestamp()::text || t.key),
                           expires_at = now() + $3::interval, due_at = now() + $3::interval,
                           attempts = t.attempts + 1,
                           takeovers = t.takeovers + (t.wait = 0)::int4
                    FROM picked WHERE t.key = picked.key AND NOT picked.blocked
                    RETURNING t.key, t.token, {expires} AS expires_ms, t.attempts, t.payload,
                              t.last_error, t.takeovers, t.max_attempts, {first} AS first_seen_ms,
                              t.order_key, picked.due_at AS was_due
                 )
                 SELECT key, token, expires_ms, attempts, payload, last_error, takeovers, max_attempts,
                        first_seen_ms, order_key, NULL::int8 AS parked, was_due
                 FROM taken
                 UNION ALL
                 SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, count(*), NULL
                 FROM parked
                 ORDER BY was_due NULLS LAST, key",
                expires = ms("t.expires_at"),
                first = ms("t.first_seen")
            )
            .into(),
            // Parks the items their ordering key holds back among the first
            // `$2` due items of a namespace, skipping rows others hold: the
            // take's help when its pick met held-back items, so that a burst
            // of them costs a take one statement per `$2` instead of one per
            // item. Heads are left due (see `promote`).
            park: format!(
                "WITH front AS MATERIALIZED (
                    SELECT key, wait, order_key, order_seq, order_head FROM {t}
                    WHERE split_part(key, ':', 1) = $1::text AND due_at <= now()
                    ORDER BY due_at LIMIT $2
                 ), held AS MATERIALIZED (
                    SELECT c.key FROM front c
                    WHERE c.order_key IS NOT NULL AND c.wait = 1 AND NOT c.order_head
                      AND {held_back}
                 )
                 UPDATE {t} t SET due_at = NULL
                 WHERE t.key = ANY(ARRAY(
                    SELECT l.key FROM {t} l
                    WHERE l.key = ANY(ARRAY(SELECT key FROM held))
                      AND l.wait = 1 AND NOT l.order_head AND l.due_at IS NOT NULL
                    FOR UPDATE SKIP LOCKED))
                   AND t.wait = 1 AND NOT t.order_head"
            )
            .into(),
            // An item snoozed: given back due $4 from now, the attempt its take
            // counted taken back (I12). One waiting under this token already
            // (the same snooze sent again) matches too, and is left as it is.
            snooze: format!(
                "UPDATE {t} SET wait = 1,
                        attempts = CASE WHEN wait = 0 THEN attempts - 1 ELSE attempts END,
                        expires_at = CASE WHEN wait = 0 THEN now() + $4::interval ELSE expires_at END,
                        due_at = CASE WHEN wait = 0 THEN now() + $4::interval ELSE due_at END
                 WHERE {is_bound} AND token = $3
                   AND ((wait = 0 AND expires_at > now()) OR wait = 1)"
            )
            .into(),
            // An item failed so under this token already (the same fail sent
            // again) matches too, and is left as it is.
            // An item dead and to be skipped leaves its ordering key's queue.
            fail: format!(
                "WITH failed AS (
                 UPDATE {t} SET wait = $4::int2, last_error = $6::text,
                        expires_at = CASE WHEN wait = 0 THEN now() + $5::interval ELSE expires_at END,
                        due_at = CASE WHEN wait <> 0 THEN due_at
                                      WHEN $4::int2 = 2 THEN NULL ELSE now() + $5::interval END,
                        dead_until = CASE WHEN wait <> 0 THEN dead_until
                                          WHEN $4::int2 = 2 THEN now() + $7::interval END,
                        errors = CASE WHEN wait <> 0 THEN errors
                            ELSE (CASE WHEN jsonb_array_length(coalesce(errors, '[]')) >= {ERROR_HISTORY}
                                       THEN errors - 0 ELSE coalesce(errors, '[]'::jsonb) END)
                                 || jsonb_build_array(jsonb_build_array(attempts, {now_ms}, $6::text))
                        END
                 WHERE {is_bound} AND token = $3
                   AND ((wait = 0 AND expires_at > now()) OR (wait = $4::int2 AND last_error = $6::text))
                 RETURNING key, CASE WHEN wait = 2 AND order_skip THEN order_key END AS order_key
                 ), next AS ({next})
                 SELECT count(*) FROM failed",
                next = promote("failed")
            )
            .into(),
            // $3: -1 every status, 0 pending, 1 running, 2 failed, 3 dead.
            list: format!(
                "SELECT {item} FROM {t}
                 WHERE key > $1::text || ':' || $2::text AND key < $1::text || ';'
                   AND wait IS NOT NULL
                   AND ($3::int4 = -1
                        OR ($3 = 0 AND wait = 1 AND last_error IS NULL)
                        OR ($3 = 1 AND wait = 0)
                        OR ($3 = 2 AND wait = 1 AND last_error IS NOT NULL)
                        OR ($3 = 3 AND wait = 2))
                 ORDER BY key LIMIT $4::int8"
            )
            .into(),
            replay: format!(
                "UPDATE {t} SET wait = 1, expires_at = now(), due_at = now(), dead_until = NULL
                 WHERE {is_bound} AND (wait = 2 OR (wait = 1 AND last_error IS NOT NULL
                                                   AND (due_at IS NULL OR due_at > clock_timestamp())))
                 RETURNING {notify}"
            )
            .into(),
            counts: format!(
                "SELECT count(*) FILTER (WHERE wait = 1 AND last_error IS NULL),
                        count(*) FILTER (WHERE wait = 0),
                        count(*) FILTER (WHERE wait = 1 AND last_error IS NOT NULL),
                        count(*) FILTER (WHERE wait = 2),
                        min({expires}) FILTER (WHERE wait = 1)
                 FROM {t} WHERE split_part(key, ':', 1) = $1::text AND wait IS NOT NULL",
                expires = ms("expires_at")
            )
            .into(),
            // A pause (I13) is a row; `take`'s pick reads it.
            pause: format!(
                "INSERT INTO {p} (namespace) VALUES ($1::text) ON CONFLICT (namespace) DO NOTHING"
            )
            .into(),
            notify: format!("SELECT {notify}").into(),
            resume: format!("DELETE FROM {p} WHERE namespace = $1::text RETURNING {notify}")
                .into(),
            paused: format!("SELECT EXISTS (SELECT 1 FROM {p} WHERE namespace = $1::text)").into(),
        })
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
