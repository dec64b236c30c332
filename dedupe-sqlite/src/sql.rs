//! The statements the store sends, and decoding of its rows. Each function runs on
//! a connection the caller already holds (the store's own, or the caller's
//! transaction), so the async store and the transactional API share one code path.

use std::time::{Duration, SystemTime};

use dedupe_core::{
    check_identifier, check_ttl, duration_millis, from_millis, to_millis, Capabilities, ClaimId,
    ClaimOptions, ClaimOutcome, Error, Fingerprint, Key, Lease, LeaseToken, Record, Result,
    StoredRecord,
};
use rusqlite::{named_params, Connection, OptionalExtension, Row};

/// The statements for one table, built once.
#[derive(Debug)]
pub(crate) struct Statements {
    table: String,
    pub(crate) create: String,
    claim: String,
    select_live: String,
    complete: String,
    release: String,
    extend: String,
    expire_batch: String,
    forget: String,
}

/// Rows deleted per `expire()` transaction, so a large purge never holds the write
/// lock for long.
pub(crate) const EXPIRE_BATCH: i64 = 1000;

const COLUMNS: &str =
    "state, token, claim_id, fingerprint, expires_at, completed_at, outcome, attempts, first_seen";

impl Statements {
    pub(crate) fn new(table: &str) -> Result<Self> {
        check_identifier("table", table)?;
        let t = format!("\"{table}\"");
        Ok(Self {
            table: table.to_string(),
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace    TEXT    NOT NULL,
                    id           TEXT    NOT NULL,
                    state        INTEGER NOT NULL,  -- 0 in flight, 1 done
                    token        TEXT    NOT NULL,
                    claim_id     TEXT,
                    fingerprint  BLOB,
                    expires_at   INTEGER NOT NULL,  -- ms since epoch: lease deadline, or retention deadline once done
                    completed_at INTEGER,
                    outcome      BLOB,
                    attempts     INTEGER NOT NULL,
                    first_seen   INTEGER NOT NULL,
                    PRIMARY KEY (namespace, id)
                ) WITHOUT ROWID;
                CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON {t} (expires_at);"
            ),
            // Inserts a fresh record, or takes over one whose deadline has passed, in one
            // statement. A live record is left alone and no row comes back.
            claim: format!(
                "INSERT INTO {t} AS r (namespace, id, state, token, claim_id, fingerprint,
                                       expires_at, completed_at, outcome, attempts, first_seen)
                 VALUES (:ns, :id, 0, :token, :claim_id, :fingerprint, :deadline, NULL, NULL, 1, :now)
                 ON CONFLICT (namespace, id) DO UPDATE SET
                    state = 0,
                    token = excluded.token,
                    claim_id = excluded.claim_id,
                    fingerprint = excluded.fingerprint,
                    expires_at = excluded.expires_at,
                    completed_at = NULL,
                    outcome = NULL,
                    attempts = CASE WHEN r.state = 0 THEN r.attempts + 1 ELSE 1 END,
                    first_seen = CASE WHEN r.state = 0 THEN r.first_seen ELSE excluded.first_seen END
                 WHERE r.expires_at <= :now
                 RETURNING token, attempts"
            ),
            select_live: format!(
                "SELECT {COLUMNS} FROM {t} WHERE namespace = :ns AND id = :id AND expires_at > :now"
            ),
            complete: format!(
                "UPDATE {t} SET state = 1, expires_at = :until, completed_at = :now, outcome = :outcome
                 WHERE namespace = :ns AND id = :id AND token = :token AND state = 0 AND expires_at > :now"
            ),
            release: format!(
                "DELETE FROM {t}
                 WHERE namespace = :ns AND id = :id AND token = :token AND state = 0 AND expires_at > :now"
            ),
            extend: format!(
                "UPDATE {t} SET expires_at = :until
                 WHERE namespace = :ns AND id = :id AND token = :token AND state = 0 AND expires_at > :now"
            ),
            expire_batch: format!(
                "DELETE FROM {t} WHERE (namespace, id) IN
                    (SELECT namespace, id FROM {t} WHERE expires_at <= :now LIMIT :batch)"
            ),
            forget: format!(
                "DELETE FROM {t} WHERE namespace = :ns AND id = :id RETURNING expires_at > :now"
            ),
        })
    }
}

impl Statements {
    pub(crate) fn table(&self) -> &str {
        &self.table
    }
}

fn now_ms() -> i64 {
    to_millis(SystemTime::now())
}

fn deadline(now: i64, ttl: Duration) -> i64 {
    now.saturating_add(duration_millis(ttl))
}

/// Reads a row of [`COLUMNS`]; [`StoredRecord::decode`] then refuses anything
/// malformed.
fn read_row(row: &Row<'_>) -> rusqlite::Result<StoredRecord> {
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

/// Work on one connection, with the table's statements and the error mapping.
#[derive(Debug)]
pub(crate) struct Ops<'a> {
    pub(crate) sql: &'a Statements,
    pub(crate) busy_timeout: Duration,
    pub(crate) caps: Capabilities,
}

impl Ops<'_> {
    fn err(&self, e: rusqlite::Error) -> Error {
        crate::error::map(e, self.busy_timeout)
    }

    /// The claim: one upsert decides; when it leaves a live record alone, that
    /// record is read back (in the same transaction) to answer.
    pub(crate) fn claim(
        &self,
        conn: &Connection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        let now = now_ms();
        let token = LeaseToken::generate();
        let until = deadline(now, opts.lease_ttl);
        let won: Option<(String, i64)> = conn
            .prepare_cached(&self.sql.claim)
            .and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {
                        ":ns": key.namespace(),
                        ":id": key.id(),
                        ":token": token.as_str(),
                        ":claim_id": opts.claim_id.as_ref().map(ClaimId::as_str),
                        ":fingerprint": opts.fingerprint.as_ref().map(Fingerprint::as_bytes),
                        ":deadline": until,
                        ":now": now,
                    },
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            })
            .map_err(|e| self.err(e))?;
        match won {
            Some((stored, attempts)) if stored == token.as_str() => {
                let attempt = u32::try_from(attempts)
                    .map_err(|_| Error::corrupt(key, format!("attempt count {attempts}")))?;
                Ok(ClaimOutcome::Claimed(Lease {
                    key: key.clone(),
                    token,
                    deadline: from_millis(until),
                    attempt,
                    claim_id: opts.claim_id.clone(),
                }))
            }
            Some(_) => Err(Error::corrupt(key, "claim returned another token")),
            None => match self.get_at(conn, key, now)? {
                Some(record) => Ok(record.into_claim_answer(opts)),
                None => Err(Error::backend(
                    "claim left a record in place but found none live",
                    true,
                    None,
                )),
            },
        }
    }

    pub(crate) fn complete(
        &self,
        conn: &Connection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let now = now_ms();
        let changed = conn
            .prepare_cached(&self.sql.complete)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": lease.key.namespace(),
                    ":id": lease.key.id(),
                    ":token": lease.token.as_str(),
                    ":until": deadline(now, retention),
                    ":now": now,
                    ":outcome": outcome,
                })
            })
            .map_err(|e| self.err(e))?;
        if changed == 1 {
            Ok(())
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    pub(crate) fn release(&self, conn: &Connection, lease: &Lease) -> Result<()> {
        let changed = conn
            .prepare_cached(&self.sql.release)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": lease.key.namespace(),
                    ":id": lease.key.id(),
                    ":token": lease.token.as_str(),
                    ":now": now_ms(),
                })
            })
            .map_err(|e| self.err(e))?;
        if changed == 1 {
            Ok(())
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    pub(crate) fn extend(&self, conn: &Connection, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let now = now_ms();
        let until = deadline(now, ttl);
        let changed = conn
            .prepare_cached(&self.sql.extend)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": lease.key.namespace(),
                    ":id": lease.key.id(),
                    ":token": lease.token.as_str(),
                    ":until": until,
                    ":now": now,
                })
            })
            .map_err(|e| self.err(e))?;
        if changed == 1 {
            Ok(Lease {
                deadline: from_millis(until),
                ..lease.clone()
            })
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    /// Deletes one batch of expired rows; answers how many.
    pub(crate) fn expire_batch(&self, conn: &Connection, now: i64) -> Result<u64> {
        conn.prepare_cached(&self.sql.expire_batch)
            .and_then(|mut stmt| stmt.execute(named_params! {":now": now, ":batch": EXPIRE_BATCH}))
            .map(|n| n as u64)
            .map_err(|e| self.err(e))
    }

    pub(crate) fn get(&self, conn: &Connection, key: &Key) -> Result<Option<Record>> {
        self.get_at(conn, key, now_ms())
    }

    fn get_at(&self, conn: &Connection, key: &Key, now: i64) -> Result<Option<Record>> {
        conn.prepare_cached(&self.sql.select_live)
            .and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {":ns": key.namespace(), ":id": key.id(), ":now": now},
                    read_row,
                )
                .optional()
            })
            .map_err(|e| self.err(e))?
            .map(|stored| stored.decode(key))
            .transpose()
    }

    pub(crate) fn forget(&self, conn: &Connection, key: &Key) -> Result<bool> {
        let live: Option<bool> = conn
            .prepare_cached(&self.sql.forget)
            .and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {":ns": key.namespace(), ":id": key.id(), ":now": now_ms()},
                    |row| row.get(0),
                )
                .optional()
            })
            .map_err(|e| self.err(e))?;
        Ok(live.unwrap_or(false))
    }
}
