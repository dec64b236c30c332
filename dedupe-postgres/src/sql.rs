//! The statement text of the store, built once per schema and table.

use std::sync::Arc;

use dedupe_core::backend::check_identifier;
use dedupe_core::{Result, MAX_CLAIM_ID_BYTES, MAX_FINGERPRINT_BYTES};
use sqlx::AssertSqlSafe;

/// Milliseconds since the epoch of a timestamptz column, as int8.
fn ms(col: &str) -> String {
    format!("floor(extract(epoch FROM {col}) * 1000)::int8")
}

/// The record columns every read returns, in the order `decode` expects.
fn columns(prefix: &str) -> String {
    let p = |c: &str| format!("{prefix}{c}");
    format!(
        "{state}, {token}, {claim_id}, {fingerprint}, {expires} AS expires_ms, {completed} AS completed_ms, {outcome}, {attempts}, {first} AS first_seen_ms",
        state = p("state"),
        token = p("token"),
        claim_id = p("claim_id"),
        fingerprint = p("fingerprint"),
        expires = ms(&p("expires_at")),
        completed = ms(&p("completed_at")),
        outcome = p("outcome"),
        attempts = p("attempts"),
        first = ms(&p("first_seen")),
    )
}

/// Whether row `t` passes the checks of `StoredRecord::decode` that SQL can
/// make (state, completion, token, attempts, claim id and fingerprint
/// lengths). The batch claim writes nothing while a key it reads has a live
/// row that fails them: the client then refuses that row as corrupt, and the
/// call has changed nothing. A row these checks let through and the decoder
/// refuses still fails the call, after its writes (see `Ops::give_back`).
fn decodable(t: &str) -> String {
    format!(
        "(({t}.state = 0 OR ({t}.state = 1 AND {t}.completed_at IS NOT NULL
                              AND {t}.outcome IS NOT NULL))
          AND {t}.token <> '' AND {t}.attempts >= 1
          AND coalesce(octet_length({t}.claim_id) BETWEEN 1 AND {claim_id}, true)
          AND coalesce(octet_length({t}.fingerprint) BETWEEN 1 AND {fingerprint}, true))",
        claim_id = MAX_CLAIM_ID_BYTES,
        fingerprint = MAX_FINGERPRINT_BYTES,
    )
}

/// The names [`columns`] gives, to select them again from a CTE.
const ALIASES: &str =
    "state, token, claim_id, fingerprint, expires_ms, completed_ms, outcome, attempts, first_seen_ms";

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
    pub(crate) insert_new_many: Sql,
    pub(crate) release_many: Sql,
    pub(crate) claim_many: Sql,
    pub(crate) select_live: Sql,
    pub(crate) complete: Sql,
    pub(crate) release: Sql,
    pub(crate) extend: Sql,
    pub(crate) table_pages: Sql,
    pub(crate) expire_batch: Sql,
    pub(crate) forget: Sql,
}

impl Statements {
    pub(crate) fn new(schema: &str, table: &str) -> Result<Self> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let t = format!("\"{schema}\".\"{table}\"");
        let cols = columns("");
        let kcols = "key";
        let bound = BOUND;
        let is_bound = format!("key = {BOUND}");
        let input = INPUT;
        let upsert_tail = format!(
            "ON CONFLICT ({kcols}) DO UPDATE SET
                state = 0,
                token = excluded.token,
                claim_id = excluded.claim_id,
                fingerprint = excluded.fingerprint,
                expires_at = excluded.expires_at,
                completed_at = NULL,
                outcome = NULL,
                attempts = CASE WHEN r.state = 0 THEN r.attempts + 1 ELSE 1 END,
                first_seen = CASE WHEN r.state = 0 THEN r.first_seen ELSE excluded.first_seen END
            WHERE r.expires_at <= now()"
        );
        Ok(Self {
            schema: schema.to_string(),
            table: table.to_string(),
            // The table is kept as cheap to write as the contract allows; each point
            // was measured with pgbench (server time per statement, see the
            // README):
            // - one key column, `namespace:id`: against two columns (namespace,
            //   id), a new key's insert takes about 10% less server time, and a
            //   batch of 16 about 14% less (the unique index compares and stores
            //   one string instead of two);
            // - the key compares bytes (`COLLATE "C"`): a key is an opaque
            //   string, the primary key needs no locale rules, and its order can
            //   never change under an operating-system upgrade;
            // - no index on `expires_at`: a completion rewrites the deadline, and
            //   with that index no completion could be a HOT update and every claim
            //   would write two index entries; `expire()` walks the table instead;
            // - no CHECK on `state`: the decoder refuses any state it does not know
            //   (Error::CorruptRecord), and a CHECK is evaluated anew on every insert
            //   and update.
            migrate: format!(
                "SELECT pg_advisory_xact_lock(hashtext('dedupe-migrate:' || '{schema}.{table}'));
                 CREATE SCHEMA IF NOT EXISTS \"{schema}\";
                 CREATE TABLE IF NOT EXISTS {t} (
                     key          text COLLATE \"C\" NOT NULL PRIMARY KEY, -- namespace:id
                     state        smallint    NOT NULL, -- 0 in flight, 1 done
                     token        text        NOT NULL,
                     claim_id     text,
                     fingerprint  bytea,
                     expires_at   timestamptz NOT NULL, -- lease deadline, or retention deadline once done
                     completed_at timestamptz,
                     outcome      bytea,
                     attempts     integer     NOT NULL,
                     first_seen   timestamptz NOT NULL
                 );"
            )
            .into(),
            // One statement, one round trip. `live` reads the key first: a live
            // record (a duplicate, or a claim in flight) is answered from it and the
            // insert gets no row to write, so the statement writes nothing, takes no
            // transaction id and no row lock. Otherwise the upsert inserts a fresh
            // record or takes over an expired one.
            claim: format!(
                "WITH live AS (
                    SELECT {cols} FROM {t}
                    WHERE {is_bound} AND expires_at > now()
                 ), claimed AS (
                    INSERT INTO {t} AS r ({kcols}, state, token, claim_id, fingerprint,
                                          expires_at, completed_at, outcome, attempts, first_seen)
                    SELECT {bound}, 0, $3::text, $4::text, $5::bytea, now() + $6::interval,
                           NULL, NULL, 1, now()
                    WHERE NOT EXISTS (SELECT 1 FROM live)
                    {upsert_tail}
                    RETURNING {cols}
                 )
                 SELECT true AS won, {ALIASES} FROM claimed
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
            // The bare insert for a batch of distinct keys, in key order (so
            // concurrent batches meet each other's new keys in the same order).
            insert_new_many: format!(
                "INSERT INTO {t} AS r ({kcols}, state, token, claim_id, fingerprint,
                                       expires_at, completed_at, outcome, attempts, first_seen)
                 SELECT {kcols}, 0, token, $4::text, $5::bytea, now() + $6::interval,
                        NULL, NULL, 1, now()
                 FROM ({input}) AS i
                 ORDER BY {kcols}
                 ON CONFLICT ({kcols}) DO NOTHING
                 RETURNING {rkey} AS key, {expires} AS expires_ms",
                rkey = "r.key",
                expires = ms("r.expires_at")
            )
            .into(),
            // Gives back the keys a batch won when the rest of it failed (see
            // `Ops::give_back`): a fresh record goes, a taken-over one has its
            // lease ended. Each key is probed on the primary key, in the key
            // order the claim statements lock in, so a give-back and a
            // concurrent batch never wait on each other in a cycle.
            release_many: format!(
                "WITH mine AS (
                    SELECT {rcols}, r.attempts
                    FROM (SELECT * FROM ({input}) AS u ORDER BY {kcols}) AS i
                    CROSS JOIN LATERAL (
                        SELECT {tcols}, t.attempts FROM {t} t
                        WHERE {t_is_i} AND t.token = i.token AND t.state = 0
                        FOR UPDATE
                    ) r
                 ), fresh AS (
                    DELETE FROM {t} AS r USING mine m
                    WHERE {r_is_m} AND m.attempts = 1
                 )
                 UPDATE {t} AS r SET expires_at = now()
                 FROM mine m
                 WHERE {r_is_m} AND m.attempts > 1",
                rcols = "r.key",
                tcols = "t.key",
                t_is_i = "t.key = i.key",
                r_is_m = "r.key = m.key",
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
                        WHERE {t_is_i} AND t.expires_at > now()
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
                 SELECT true AS won, key, {ALIASES} FROM claimed
                 UNION ALL
                 SELECT false AS won, key, {ALIASES} FROM live",
                ikey = "i.key",
                rkey = "r.key",
                tcols = columns("t."),
                t_is_i = "t.key = i.key",
                decodable = decodable("t"),
            )
            .into(),
            select_live: format!(
                "SELECT {cols} FROM {t} WHERE {is_bound} AND expires_at > now()"
            )
            .into(),
            complete: format!(
                "UPDATE {t} SET state = 1, expires_at = now() + $4::interval,
                                completed_at = now(), outcome = $5
                 WHERE {is_bound} AND token = $3 AND state = 0 AND expires_at > now()"
            )
            .into(),
            release: format!(
                "DELETE FROM {t}
                 WHERE {is_bound} AND token = $3 AND state = 0 AND expires_at > now()"
            )
            .into(),
            extend: format!(
                "UPDATE {t} SET expires_at = now() + $4::interval
                 WHERE {is_bound} AND token = $3 AND state = 0 AND expires_at > now()
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
            expire_batch: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                    SELECT ctid FROM {t}
                    WHERE ctid >= format('(%s,0)', $1::int8)::tid
                      AND ctid < format('(%s,0)', $2::int8)::tid
                      AND expires_at <= now()
                    LIMIT $3 FOR UPDATE SKIP LOCKED))"
            )
            .into(),
            forget: format!("DELETE FROM {t} WHERE {is_bound} RETURNING expires_at > now()")
                .into(),
        })
    }
}
