//! Running the store's statements on a connection the caller already holds (the
//! store's own, or the caller's transaction), so the async store and the
//! transactional API share one code path.

use std::time::Duration;

use dedupe_core::backend::{self, check_ttl, duration_millis, from_millis, one_row_changed};
use dedupe_core::{
    Capabilities, ClaimId, ClaimOptions, ClaimOutcome, Error, Fingerprint, ItemStatus, Key, Lease,
    Record, Result,
};
use rusqlite::{named_params, Connection, OptionalExtension};

use crate::codec::read_row;
use crate::sql::{Statements, EXPIRE_BATCH};

pub(crate) fn deadline(now: i64, ttl: Duration) -> i64 {
    now.saturating_add(duration_millis(ttl))
}

/// What every call of a handle needs, shared by its connection threads.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) sql: Statements,
    pub(crate) path: std::path::PathBuf,
    pub(crate) busy_timeout: Duration,
    pub(crate) caps: Capabilities,
    /// This process's turn to write to the file (its writer's, shared by every
    /// handle of the process on the file).
    pub(crate) turn: std::sync::Arc<parking_lot::Mutex<()>>,
}

impl Settings {
    /// The statements, for the store's own connections (they take the turn).
    pub(crate) fn ops(&self) -> Ops<'_> {
        Ops {
            sql: &self.sql,
            busy_timeout: self.busy_timeout,
            caps: self.caps,
            writer: Some(&self.turn),
        }
    }
}

/// Work on one connection, with the table's statements and the error mapping.
#[derive(Debug)]
pub(crate) struct Ops<'a> {
    pub(crate) sql: &'a Statements,
    pub(crate) busy_timeout: Duration,
    pub(crate) caps: Capabilities,
    /// The process-wide turn for writers to this file (the store's own
    /// connections only; a caller's transaction does not take it).
    pub(crate) writer: Option<&'a parking_lot::Mutex<()>>,
}

impl Ops<'_> {
    pub(crate) fn err(&self, e: rusqlite::Error) -> Error {
        crate::error::map(e, self.busy_timeout)
    }

    /// Waits for this process's turn to write to the file, at most until the
    /// running job's deadline. Connections of one process then queue here in
    /// order instead of polling SQLite's lock with sleeps; other processes
    /// still meet them at SQLite's own lock.
    pub(crate) fn turn(&self) -> Result<Option<parking_lot::MutexGuard<'_, ()>>> {
        let Some(writer) = self.writer else {
            return Ok(None);
        };
        let deadline = crate::workers::busy_deadline()
            .unwrap_or_else(|| std::time::Instant::now() + self.busy_timeout);
        writer
            .try_lock_until(deadline)
            .map(Some)
            .ok_or(Error::timeout(self.busy_timeout))
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
        let now = backend::now_millis();
        let token = backend::new_token();
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
                Some(record) => Ok(backend::losing_claim(record, opts)),
                None => Err(Error::retryable(
                    "claim left a record in place but found none live",
                    None,
                )),
            },
        }
    }

    /// The answer of a live record, read without the write lock: a duplicate or a
    /// claim in flight costs one read and writes nothing. `None` when no record is
    /// live, so the claim has to write (and decide again under the write lock).
    pub(crate) fn answer_if_live(
        &self,
        conn: &Connection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<Option<ClaimOutcome>> {
        Ok(self
            .get(conn, key)?
            .map(|record| backend::losing_claim(record, opts)))
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
        let now = backend::now_millis();
        // An item's ordering key comes back: its next item is made the
        // key's head.
        let done: Vec<Option<String>> = conn
            .prepare_cached(&self.sql.complete)
            .and_then(|mut stmt| {
                stmt.query_map(
                    named_params! {
                        ":ns": lease.key.namespace(),
                        ":id": lease.key.id(),
                        ":token": lease.token.as_str(),
                        ":until": deadline(now, retention),
                        ":now": now,
                        ":outcome": outcome,
                    },
                    |row| row.get(0),
                )?
                .collect()
            })
            .map_err(|e| self.err(e))?;
        one_row_changed(done.len() as u64, &lease.key)?;
        if let Some(Some(order_key)) = done.first() {
            self.promote(conn, &lease.key, order_key)?;
        }
        Ok(())
    }

    /// Makes the first waiting item of ordering key `order_key` other than
    /// `left` the key's head, unparked (migration 0009), in the write
    /// transaction that took `left` out of the key's queue.
    pub(crate) fn promote(&self, conn: &Connection, left: &Key, order_key: &str) -> Result<()> {
        conn.prepare_cached(&self.sql.promote)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": left.namespace(),
                    ":id": left.id(),
                    ":order": order_key,
                })
            })
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Removes the lease's live record; with none, `Ok` unless a live record
    /// of another lease, or a done one, is under the key. Both statements run
    /// in the caller's write transaction.
    pub(crate) fn release(&self, conn: &Connection, lease: &Lease) -> Result<()> {
        let now = backend::now_millis();
        let (ns, id) = (lease.key.namespace(), lease.key.id());
        let changed = conn
            .prepare_cached(&self.sql.release)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": ns,
                    ":id": id,
                    ":token": lease.token.as_str(),
                    ":now": now,
                })
            })
            .map_err(|e| self.err(e))?;
        if changed > 0 {
            return one_row_changed(changed as u64, &lease.key);
        }
        let given_back = conn
            .prepare_cached(&self.sql.release_item)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": ns,
                    ":id": id,
                    ":token": lease.token.as_str(),
                    ":now": now,
                })
            })
            .map_err(|e| self.err(e))?;
        if given_back > 0 {
            return one_row_changed(given_back as u64, &lease.key);
        }
        let live: bool = conn
            .prepare_cached(&self.sql.any_live)
            .and_then(|mut stmt| {
                stmt.query_row(named_params! { ":ns": ns, ":id": id, ":now": now }, |row| {
                    row.get(0)
                })
            })
            .map_err(|e| self.err(e))?;
        if live {
            Err(Error::lease_lost(&lease.key))
        } else {
            Ok(())
        }
    }

    pub(crate) fn extend(&self, conn: &Connection, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let now = backend::now_millis();
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
        one_row_changed(changed as u64, &lease.key)?;
        Ok(Lease {
            deadline: from_millis(until),
            ..lease.clone()
        })
    }

    /// Deletes one batch of expired rows (records past their deadline, or
    /// with `dead` dead items past their retention); answers how many.
    pub(crate) fn expire_batch(&self, conn: &Connection, now: i64, dead: bool) -> Result<u64> {
        let sql = if dead {
            &self.sql.expire_dead_batch
        } else {
            &self.sql.expire_batch
        };
        if !dead {
            return conn
                .prepare_cached(sql)
                .and_then(|mut stmt| {
                    stmt.execute(named_params! {":now": now, ":batch": EXPIRE_BATCH})
                })
                .map(|n| n as u64)
                .map_err(|e| self.err(e));
        }
        // A dead item of an ordering key removed moves its key on (I16).
        let gone: Vec<(String, String, Option<String>)> = conn
            .prepare_cached(sql)
            .and_then(|mut stmt| {
                stmt.query_map(named_params! {":now": now, ":batch": EXPIRE_BATCH}, |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?))
                })?
                .collect()
            })
            .map_err(|e| self.err(e))?;
        for (namespace, id, order_key) in &gone {
            if let Some(order_key) = order_key {
                self.promote(conn, &Key::new(namespace, id)?, order_key)?;
            }
        }
        Ok(gone.len() as u64)
    }

    pub(crate) fn get(&self, conn: &Connection, key: &Key) -> Result<Option<Record>> {
        self.get_at(conn, key, backend::now_millis())
    }

    pub(crate) fn get_at(&self, conn: &Connection, key: &Key, now: i64) -> Result<Option<Record>> {
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
        self.forget_where(conn, key, None)
    }

    /// Removes the item while it is in `status` at `attempts` (CONTRACT.md
    /// I17), or, `seen` none, the record whatever it is.
    pub(crate) fn forget_where(
        &self,
        conn: &Connection,
        key: &Key,
        seen: Option<(ItemStatus, u32)>,
    ) -> Result<bool> {
        let gone: Option<(bool, Option<String>)> = match seen {
            None => conn.prepare_cached(&self.sql.forget).and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {":ns": key.namespace(), ":id": key.id(), ":now": backend::now_millis()},
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            }),
            Some((status, attempts)) => conn.prepare_cached(&self.sql.forget_if).and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {
                        ":ns": key.namespace(),
                        ":id": key.id(),
                        ":st": backend::status_code(Some(status)),
                        ":at": attempts,
                    },
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            }),
        }
        .map_err(|e| self.err(e))?;
        let Some((live, order_key)) = gone else {
            return Ok(false);
        };
        // A forgotten item leaves its ordering key's queue.
        if let Some(order_key) = order_key {
            self.promote(conn, key, &order_key)?;
        }
        Ok(live)
    }
}
