//! The statement text of the store, built once per schema and table.

use std::sync::atomic::Ordering;
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

/// How a table holds its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// One column, `key`: the namespace and the id joined by `:`. A namespace
    /// never holds a `:` (see [`Key`](dedupe_core::Key)), so no two keys join
    /// to the same string. Tables made by this version.
    Joined,
    /// Two columns, `namespace` and `id`: tables made by earlier versions.
    Split,
}

impl Layout {
    /// The key's columns in the primary key's order; the batch statements'
    /// input rows name their key columns the same.
    fn columns(self) -> &'static str {
        match self {
            Layout::Joined => "key",
            Layout::Split => "namespace, id",
        }
    }

    /// The key columns of row `r`.
    fn columns_of(self, r: &str) -> String {
        match self {
            Layout::Joined => format!("{r}.key"),
            Layout::Split => format!("{r}.namespace, {r}.id"),
        }
    }

    /// The values of the key columns for the key bound as `$1` (namespace) and
    /// `$2` (id).
    fn bound(self) -> &'static str {
        match self {
            Layout::Joined => "$1::text || ':' || $2::text",
            Layout::Split => "$1, $2",
        }
    }

    /// A row holds the key bound as `$1` and `$2`.
    fn is_bound(self) -> &'static str {
        match self {
            Layout::Joined => "key = $1::text || ':' || $2::text",
            Layout::Split => "namespace = $1 AND id = $2",
        }
    }

    /// Rows `a` and `b` hold the same key.
    fn same(self, a: &str, b: &str) -> String {
        match self {
            Layout::Joined => format!("{a}.key = {b}.key"),
            Layout::Split => format!("{a}.namespace = {b}.namespace AND {a}.id = {b}.id"),
        }
    }

    /// The key of row `r` as one string, `namespace:id`, as the batch
    /// statements return it.
    fn joined(self, r: &str) -> String {
        match self {
            Layout::Joined => format!("{r}.key"),
            Layout::Split => format!("{r}.namespace || ':' || {r}.id"),
        }
    }

    /// The batch statements' input: the distinct keys, bound as the arrays `$1`
    /// (namespaces) and `$2` (ids) with `$3` (their tokens), as rows of the key
    /// columns and `token`.
    fn input(self) -> &'static str {
        match self {
            Layout::Joined => {
                "SELECT namespace || ':' || id AS key, token
                 FROM unnest($1::text[], $2::text[], $3::text[]) AS u(namespace, id, token)"
            }
            Layout::Split => {
                "SELECT namespace, id, token
                 FROM unnest($1::text[], $2::text[], $3::text[]) AS u(namespace, id, token)"
            }
        }
    }
}

/// The statements for both layouts, and which one the store's table has, once
/// a look at the catalog told (the first call, or `migrate`).
#[derive(Debug)]
pub(crate) struct Tables {
    pub(crate) joined: Statements,
    pub(crate) split: Statements,
    /// `SELECT present, split`: whether the table exists and whether it has the
    /// two key columns.
    pub(crate) probe: Sql,
    /// Converts a `Split` table to `Joined` in place (see
    /// `PgStore::upgrade_table`); run inside a transaction that holds the
    /// migrate lock.
    pub(crate) join_key_columns: Sql,
    /// The layout the catalog last showed, and how many times the store has
    /// forgotten it: `generation << 2 | code`, where code 0 is not known, 1
    /// [`Layout::Joined`], 2 [`Layout::Split`].
    known: std::sync::atomic::AtomicU64,
}

impl Tables {
    pub(crate) fn new(schema: &str, table: &str) -> Result<Self> {
        let joined = Statements::new(schema, table, Layout::Joined)?;
        let split = Statements::new(schema, table, Layout::Split)?;
        let probe = format!(
            "SELECT to_regclass('\"{schema}\".\"{table}\"') IS NOT NULL AS present,
                    EXISTS (SELECT 1 FROM pg_attribute
                            WHERE attrelid = to_regclass('\"{schema}\".\"{table}\"')
                              AND attname = 'namespace' AND attnum > 0 AND NOT attisdropped)
                    AS split"
        )
        .into();
        let t = format!("\"{schema}\".\"{table}\"");
        // `id` becomes the joined key in one rewrite of the table (which also
        // rebuilds its indexes); dropping `namespace` drops the two-column
        // primary key with it, and the new one is built on `key`. A namespace
        // never holds ':', so the joined keys are as distinct as the pairs.
        let join_key_columns = format!(
            "LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE;
             ALTER TABLE {t} ALTER COLUMN id TYPE text COLLATE \"C\" USING namespace || ':' || id;
             ALTER TABLE {t} DROP COLUMN namespace;
             ALTER TABLE {t} RENAME COLUMN id TO key;
             ALTER TABLE {t} ADD PRIMARY KEY (key);"
        )
        .into();
        Ok(Self {
            joined,
            split,
            probe,
            join_key_columns,
            known: Default::default(),
        })
    }

    /// The statements for the table's layout, if it is known.
    pub(crate) fn known(&self) -> Option<&Statements> {
        match self.known.load(Ordering::Acquire) & 3 {
            1 => Some(&self.joined),
            2 => Some(&self.split),
            _ => None,
        }
    }

    /// How many times the layout has been forgotten: read it before reading
    /// the catalog, and hand it to [`learn`](Self::learn).
    pub(crate) fn generation(&self) -> u64 {
        self.known.load(Ordering::Acquire) >> 2
    }

    /// Forgets the layout: the next call reads it from the catalog again (a
    /// statement named a column or table that is not there, so the table was
    /// converted, or dropped and made again, under the store).
    pub(crate) fn forget(&self) {
        let _ = self
            .known
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(((v >> 2) + 1) << 2)
            });
    }

    /// Records the layout the catalog showed, read in `generation`, and
    /// answers its statements. A read made before a later `forget` records
    /// nothing: the table may have been converted since (a probe that read
    /// the earlier layout just before `upgrade_table` committed must not undo
    /// the forget of a call that met the converted table).
    pub(crate) fn learn(&self, layout: Layout, generation: u64) -> &Statements {
        let _ = self.known.compare_exchange(
            generation << 2,
            generation << 2 | Self::code(layout),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.statements(layout)
    }

    /// Records a layout this store has just made the table have
    /// (`upgrade_table`), whatever was known before.
    pub(crate) fn replace(&self, layout: Layout) {
        let _ = self
            .known
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(((v >> 2) + 1) << 2 | Self::code(layout))
            });
    }

    fn code(layout: Layout) -> u64 {
        match layout {
            Layout::Joined => 1,
            Layout::Split => 2,
        }
    }

    fn statements(&self, layout: Layout) -> &Statements {
        match layout {
            Layout::Joined => &self.joined,
            Layout::Split => &self.split,
        }
    }
}

/// The SQL of one store for one table layout.
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
    fn new(schema: &str, table: &str, layout: Layout) -> Result<Self> {
        check_identifier("schema", schema)?;
        check_identifier("table", table)?;
        let t = format!("\"{schema}\".\"{table}\"");
        let cols = columns("");
        let kcols = layout.columns();
        let bound = layout.bound();
        let is_bound = layout.is_bound();
        let input = layout.input();
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
            // - one key column, `namespace:id`: against the two columns of
            //   earlier versions, a new key's insert takes about 10% less server
            //   time, and a batch of 16 about 14% less (the unique index compares
            //   and stores one string instead of two);
            // - the key compares bytes (`COLLATE "C"`): a key is an opaque
            //   string, the primary key needs no locale rules, and its order can
            //   never change under an operating-system upgrade;
            // - no index on `expires_at`: a completion rewrites the deadline, and
            //   with that index no completion could be a HOT update and every claim
            //   would write two index entries; `expire()` walks the table instead;
            // - no CHECK on `state`: the decoder refuses any state it does not know
            //   (Error::CorruptRecord), and a CHECK is evaluated anew on every insert
            //   and update.
            // A table made by an earlier version (two key columns, and perhaps the
            // default collation, the index, the CHECK) is left as it is: the
            // store finds its layout in the catalog and runs the `Split`
            // statements on it.
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
                rkey = layout.joined("r"),
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
                rcols = layout.columns_of("r"),
                tcols = layout.columns_of("t"),
                t_is_i = layout.same("t", "i"),
                r_is_m = layout.same("r", "m"),
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
                ikey = layout.joined("i"),
                rkey = layout.joined("r"),
                tcols = columns("t."),
                t_is_i = layout.same("t", "i"),
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

#[cfg(test)]
mod tests {
    use super::{Layout, Tables};

    fn is(known: Option<&super::Statements>, expected: &super::Statements) -> bool {
        known.is_some_and(|s| std::ptr::eq(s, expected))
    }

    /// A catalog read made before a `forget` records nothing, so a probe that
    /// saw the earlier layout just before a conversion cannot undo the forget
    /// of a call that met the converted table; a read made after it does.
    #[test]
    fn a_probe_older_than_a_forget_records_nothing() {
        let tables = Tables::new("public", "dedupe_records").expect("names");
        assert!(tables.known().is_none());
        let before = tables.generation();
        tables.learn(Layout::Split, before);
        assert!(is(tables.known(), &tables.split));

        let stale = tables.generation();
        tables.forget();
        assert!(tables.known().is_none());
        tables.learn(Layout::Split, stale);
        assert!(tables.known().is_none(), "a read older than the forget");

        let fresh = tables.generation();
        tables.learn(Layout::Joined, fresh);
        assert!(is(tables.known(), &tables.joined));

        tables.replace(Layout::Split);
        assert!(is(tables.known(), &tables.split));
        tables.learn(Layout::Joined, fresh);
        assert!(
            is(tables.known(), &tables.split),
            "replace starts a new generation too"
        );
    }
}
