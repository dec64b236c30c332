//! The store's statements on a connection the caller holds (one of the
//! store's pool, or the caller's transaction), so the trait methods and the
//! transactional `*_in` methods share one code path.

use std::collections::HashMap;
use std::time::Duration;

use dedupe_core::backend::{
    self, check_batch, check_ttl, duration_millis, new_token, new_tokens, BatchKeys, FirstStatement,
};
use dedupe_core::{
    Capabilities, ClaimId, ClaimOptions, ClaimOutcome, Error, Fingerprint, Key, Lease, Record,
    RecordState, Result,
};
use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::query::Query;
use sqlx::{Connection, MySql, MySqlConnection, Row};

use crate::codec;
use crate::error::{is_deadlock, map};
use crate::sql::{Statements, EXPIRE_BATCH};

/// How often a statement a deadlock rolled back is sent again (the store's
/// own connections only: in a caller's transaction a deadlock rolled the
/// whole transaction back, which only the caller can redo).
pub(crate) const DEADLOCK_RETRIES: usize = 5;

/// How often a claim goes round when the record its upsert met was gone or
/// expired by the time it was read back (a release or a lease passing in
/// between): each time is a fresh claim.
const CLAIM_ROUNDS: usize = 16;

/// Why a statement in a transaction failed: a deadlock (the server rolled
/// the transaction back; it may run again) or anything else.
#[derive(Debug)]
pub(crate) enum TxError {
    Deadlock(sqlx::Error),
    Other(Error),
}

impl From<Error> for TxError {
    fn from(e: Error) -> Self {
        TxError::Other(e)
    }
}

// Whether a claim on the store's own connections reads the key first
// (`dedupe_core::backend::FirstStatement` counts whether recent claims met
// a record already there). While most did (a retry storm, a redelivered
// backlog), a claim first runs a plain `SELECT`, and a live record answers
// it in that one round trip, locking and writing nothing; the upsert and
// its read-back run only for a key with no live record. While most claims
// are of new keys, the upsert goes first. Either way the upsert decides
// every win on its own. Measured with `dedupe bench` on MariaDB 10.11
// (README): duplicates from 1 / 16 / 64 tasks 4,767 / 17,981 / 19,944 a
// second upsert-first, 7,558 / 43,576 / 40,158 reading first; claims of new
// keys unchanged (0.40 / 0.37 / 0.31 of raw, against 0.42 / 0.36 / 0.32).

/// The statements of one store with its error mapping and limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ops<'a> {
    pub(crate) sql: &'a Statements,
    pub(crate) timeout: Duration,
    pub(crate) caps: Capabilities,
    /// On the store's own connections: whether claims read first.
    pub(crate) first: Option<&'a FirstStatement>,
    /// On a caller's transaction: reads lock (`FOR UPDATE`, the row as it is
    /// now, not the transaction's snapshot) and deadlocks are not retried.
    pub(crate) in_transaction: bool,
}

impl Ops<'_> {
    pub(crate) fn err(&self, e: sqlx::Error) -> Error {
        map(e, self.timeout)
    }

    /// Counts whether a claim met a record (store's own connections only).
    fn note(&self, had_record: bool) {
        if let Some(first) = self.first {
            first.note(had_record);
        }
    }

    pub(crate) fn tx_err(&self, e: sqlx::Error) -> TxError {
        if is_deadlock(&e) {
            TxError::Deadlock(e)
        } else {
            TxError::Other(self.err(e))
        }
    }

    /// Runs a statement fenced by `lease` (its last three parameters: the
    /// key's namespace and id, the lease's token) and answers the rows it
    /// changed.
    pub(crate) async fn fenced<'q>(
        &self,
        conn: &mut MySqlConnection,
        statement: Query<'q, MySql, MySqlArguments>,
        lease: &'q Lease,
    ) -> Result<u64> {
        statement
            .bind(lease.key.namespace().as_bytes())
            .bind(lease.key.id().as_bytes())
            .bind(lease.token.as_str().as_bytes())
            .execute(conn)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| self.err(e))
    }

    /// The record under `key`, live or not; in a caller's transaction read
    /// as it is now (`FOR UPDATE`), not as the transaction's snapshot has it.
    pub(crate) async fn read(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
    ) -> Result<Option<Record>> {
        let sql = if self.in_transaction {
            &self.sql.select_locking
        } else {
            &self.sql.select
        };
        self.read_with(conn, key, sql).await
    }

    /// The record under `key`, read without a lock.
    async fn read_plain(&self, conn: &mut MySqlConnection, key: &Key) -> Result<Option<Record>> {
        self.read_with(conn, key, &self.sql.select).await
    }

    async fn read_with(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        sql: &str,
    ) -> Result<Option<Record>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(row
            .map(|row| codec::read(key, &row, 0))
            .transpose()?
            .flatten())
    }

    /// Runs the upsert of `rows` keys, sending it again after a deadlock
    /// (which rolled it back whole) on the store's own connections.
    async fn upsert(
        &self,
        conn: &mut MySqlConnection,
        keys: &[&Key],
        tokens: &[String],
        opts: &ClaimOptions,
    ) -> Result<()> {
        let mut tries = 0;
        loop {
            match self.upsert_once(conn, keys, tokens, opts).await {
                Ok(()) => return Ok(()),
                Err(TxError::Deadlock(_)) if !self.in_transaction && tries < DEADLOCK_RETRIES => {
                    tries += 1;
                    tracing::debug!(tries, "claim upsert deadlocked; sending it again");
                }
                Err(TxError::Deadlock(e)) => return Err(self.err(e)),
                Err(TxError::Other(e)) => return Err(e),
            }
        }
    }

    /// The upsert of `rows` keys, once.
    async fn upsert_once(
        &self,
        conn: &mut MySqlConnection,
        keys: &[&Key],
        tokens: &[String],
        opts: &ClaimOptions,
    ) -> std::result::Result<(), TxError> {
        let sql = self.sql.upsert(keys.len());
        let lease = duration_millis(opts.lease_ttl);
        let claim_id = opts.claim_id.as_ref().map(ClaimId::as_str);
        let fingerprint = opts.fingerprint.as_ref().map(Fingerprint::as_bytes);
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
        for (key, token) in keys.iter().zip(tokens) {
            query = query
                .bind(key.namespace().as_bytes())
                .bind(key.id().as_bytes())
                .bind(token.as_bytes())
                .bind(claim_id.map(str::as_bytes))
                .bind(fingerprint)
                .bind(lease);
        }
        query
            .execute(&mut *conn)
            .await
            .map_err(|e| self.tx_err(e))?;
        Ok(())
    }

    /// The answer of a claim sending `token` from the live record read back
    /// after its upsert: `None` when it was gone or expired by then.
    fn answer(
        read: Option<Record>,
        token: &str,
        opts: &ClaimOptions,
    ) -> Result<Option<ClaimOutcome>> {
        match read {
            Some(record) if record.token.as_str() == token => backend::won_claim(record).map(Some),
            Some(record) => Ok(Some(backend::losing_claim(record, opts))),
            None => Ok(None),
        }
    }

    /// One upsert that inserts a new record or takes over one whose deadline
    /// passed, on the primary key, judged by the server's clock; then the row
    /// read back says who won.
    pub(crate) async fn claim(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        // In a caller's transaction a live record is always answered from a
        // plain read, which locks nothing: the upsert would lock the
        // holder's row (even changing nothing) until the caller's
        // transaction ends, and the holder's complete would wait for it.
        let read_first = self.in_transaction || self.first.is_some_and(|f| f.expect_records());
        if read_first {
            if let Some(record) = self.read_plain(conn, key).await? {
                self.note(true);
                return Ok(backend::losing_claim(record, opts));
            }
        }
        for _ in 0..CLAIM_ROUNDS {
            let token = new_token().to_string();
            self.upsert(conn, &[key], std::slice::from_ref(&token), opts)
                .await?;
            let read = self.read(conn, key).await?;
            if let Some(answer) = Self::answer(read, &token, opts)? {
                self.note(!matches!(answer, ClaimOutcome::Claimed(_)));
                return Ok(answer);
            }
        }
        Err(Error::retryable(
            "the key's record kept changing between the claim and its read-back",
            None,
        ))
    }

    /// Every distinct key of the batch in one upsert (in key order, so racing
    /// batches lock rows in one order), then one read of them all, in one
    /// transaction: a batch that meets a live record that does not decode
    /// rolls back and answers the error, with nothing of it written. On the
    /// store's own connections a deadlock (which rolled the transaction back)
    /// runs the batch again.
    pub(crate) async fn claim_many(
        &self,
        conn: &mut MySqlConnection,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        check_batch(keys)?;
        opts.validate()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // Inside the transaction: no statement retried on its own.
        let inner = Ops {
            in_transaction: true,
            first: None,
            ..*self
        };
        let mut tries = 0;
        loop {
            let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
            let answer = inner.claim_batch(&mut tx, keys, opts).await;
            match answer {
                Ok(answers) => {
                    tx.commit().await.map_err(|e| self.err(e))?;
                    return Ok(answers);
                }
                Err(e) => {
                    // Undone whole. A rollback that fails is the connection's
                    // failure: answered as such, so the connection is not kept
                    // (the caller's retry then meets the error again).
                    tx.rollback().await.map_err(|e| self.err(e))?;
                    match e {
                        TxError::Deadlock(_)
                            if !self.in_transaction && tries < DEADLOCK_RETRIES =>
                        {
                            tries += 1;
                            tracing::debug!(tries, "claim batch deadlocked; running it again");
                        }
                        TxError::Deadlock(e) => return Err(self.err(e)),
                        TxError::Other(e) => return Err(e),
                    }
                }
            }
        }
    }

    /// The batch on a transaction: the upsert, the read-back, the answers.
    async fn claim_batch(
        &self,
        conn: &mut MySqlConnection,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> std::result::Result<Vec<ClaimOutcome>, TxError> {
        let batch = BatchKeys::new(keys);
        let distinct = batch.distinct();
        let mut order: Vec<usize> = (0..distinct.len()).collect();
        order.sort_by(|&a, &b| {
            (distinct[a].namespace(), distinct[a].id())
                .cmp(&(distinct[b].namespace(), distinct[b].id()))
        });
        let sorted: Vec<&Key> = order.iter().map(|&i| distinct[i]).collect();
        let tokens: Vec<String> = new_tokens(sorted.len())
            .into_iter()
            .map(|t| t.to_string())
            .collect();
        self.upsert_once(conn, &sorted, &tokens, opts).await?;
        let sql = self.sql.select_many(sorted.len());
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
        for key in &sorted {
            query = query
                .bind(key.namespace().as_bytes())
                .bind(key.id().as_bytes());
        }
        let rows: Vec<MySqlRow> = query
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.tx_err(e))?;
        let mut by_key: HashMap<(Vec<u8>, Vec<u8>), MySqlRow> = HashMap::with_capacity(rows.len());
        for row in rows {
            let ns: Vec<u8> = row.try_get(0).map_err(|e| self.err(e))?;
            let id: Vec<u8> = row.try_get(1).map_err(|e| self.err(e))?;
            by_key.insert((ns, id), row);
        }
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; distinct.len()];
        for (&at, (key, token)) in order.iter().zip(sorted.iter().zip(&tokens)) {
            let row = by_key.remove(&(
                key.namespace().as_bytes().to_vec(),
                key.id().as_bytes().to_vec(),
            ));
            let read = row
                .map(|row| codec::read(key, &row, 2))
                .transpose()?
                .flatten();
            answers[at] = match Self::answer(read, token, opts)? {
                Some(answer) => Some(answer),
                // Expired since the upsert (the read-back is a later
                // statement, with a later `NOW`): claimed again on its own.
                None => Some(self.claim(conn, key, opts).await?),
            };
        }
        let first = answers
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::fatal("a batch key went unanswered", None))?;
        Ok(batch.answers(first, opts)?)
    }

    pub(crate) async fn complete(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let statement = sqlx::query(sqlx::AssertSqlSafe(self.sql.complete.as_str()))
            .bind(outcome)
            .bind(duration_millis(retention));
        let changed = self.fenced(conn, statement, lease).await?;
        if changed > 0 {
            return backend::one_row_changed(changed, &lease.key);
        }
        if self
            .complete_ordered(conn, lease, outcome, retention)
            .await?
        {
            return Ok(());
        }
        // The same complete sent again finds its outcome under its token.
        match self.read(conn, &lease.key).await? {
            Some(Record {
                state: RecordState::Done {
                    outcome: stored, ..
                },
                token,
                ..
            }) if token == lease.token && stored == outcome => Ok(()),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    /// Completes an item of an ordering key held by `lease` and makes the
    /// next item of its key the key's head, in one transaction; answers
    /// whether the lease held such an item.
    async fn complete_ordered(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<bool> {
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let statement = sqlx::query(sqlx::AssertSqlSafe(self.sql.complete_ordered.as_str()))
            .bind(outcome)
            .bind(duration_millis(retention));
        if self.fenced(&mut tx, statement, lease).await? == 0 {
            return Ok(false);
        }
        let order_key: Option<Vec<u8>> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(self.sql.order_key_of.as_str()))
                .bind(lease.key.namespace().as_bytes())
                .bind(lease.key.id().as_bytes())
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.err(e))?
                .flatten();
        if let Some(order_key) = order_key {
            self.promote(&mut tx, lease.key.namespace(), &order_key)
                .await?;
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(true)
    }

    /// A claim's record is removed; an inbox item held by the lease is
    /// given back, due now (I5).
    pub(crate) async fn release(&self, conn: &mut MySqlConnection, lease: &Lease) -> Result<()> {
        for sql in [&self.sql.release, &self.sql.give_back] {
            let statement = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
            let changed = self.fenced(conn, statement, lease).await?;
            if changed > 0 {
                return backend::one_row_changed(changed, &lease.key);
            }
        }
        match self.read(conn, &lease.key).await? {
            Some(_) => Err(Error::lease_lost(&lease.key)),
            // Nothing live holds the key: what release asks for.
            _ => Ok(()),
        }
    }

    pub(crate) async fn extend(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let statement = sqlx::query(sqlx::AssertSqlSafe(self.sql.extend.as_str()))
            .bind(duration_millis(ttl))
            .bind(duration_millis(ttl));
        let changed = self.fenced(conn, statement, lease).await?;
        backend::one_row_changed(changed, &lease.key)?;
        match self.read(conn, &lease.key).await? {
            Some(Record {
                state: RecordState::InFlight { lease_deadline },
                token,
                attempts,
                ..
            }) if token == lease.token => Ok(Lease {
                deadline: lease_deadline,
                attempt: attempts,
                ..lease.clone()
            }),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    /// Records past their deadline, then dead items past their retention
    /// (I16), a batch a statement; dead items of an ordering key one at a
    /// time, each forgotten with its key moved on (see `forget`).
    pub(crate) async fn expire(&self, conn: &mut MySqlConnection) -> Result<u64> {
        let mut removed = 0;
        loop {
            let ordered: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> =
                sqlx::query_as(sqlx::AssertSqlSafe(self.sql.expire_dead_ordered.as_str()))
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
            let batch = ordered.len();
            for (namespace, id, order_key) in ordered {
                let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
                let gone = sqlx::query(sqlx::AssertSqlSafe(self.sql.expire_dead_one.as_str()))
                    .bind(namespace.as_slice())
                    .bind(id.as_slice())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| self.err(e))?
                    .rows_affected();
                if gone > 0 {
                    let namespace = String::from_utf8(namespace).map_err(|_| {
                        Error::fatal("an inbox item's namespace is not UTF-8", None)
                    })?;
                    self.promote(&mut tx, &namespace, &order_key).await?;
                    removed += gone;
                }
                tx.commit().await.map_err(|e| self.err(e))?;
            }
            if (batch as u64) < EXPIRE_BATCH {
                break;
            }
        }
        for statement in [&self.sql.expire_batch, &self.sql.expire_dead_batch] {
            loop {
                let n = sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?
                    .rows_affected();
                removed += n;
                if n < EXPIRE_BATCH {
                    break;
                }
            }
        }
        Ok(removed)
    }

    pub(crate) async fn get(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
    ) -> Result<Option<Record>> {
        self.read(conn, key).await
    }

    /// Removes the record it read, by that record's token, and answers
    /// whether it removed a live one. A record written since the read (a
    /// takeover, a release and a new claim) has another token: it is left
    /// alone, and the call answers `false`, removing nothing it did not read.
    /// The row is not decoded: a corrupt record is forgotten like any other.
    ///
    /// An inbox item leaves its ordering key's queue: in the same
    /// transaction, the key's next item is made its head (see `promote`).
    pub(crate) async fn forget(&self, conn: &mut MySqlConnection, key: &Key) -> Result<bool> {
        let read: Option<(Vec<u8>, bool, Option<Vec<u8>>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql.forget_read.as_str()))
                .bind(key.namespace().as_bytes())
                .bind(key.id().as_bytes())
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
        let Some((token, live, order_key)) = read else {
            return Ok(false);
        };
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let removed = sqlx::query(sqlx::AssertSqlSafe(self.sql.forget.as_str()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .bind(token)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        if let (true, Some(order_key)) = (removed > 0, order_key) {
            self.promote(&mut tx, key.namespace(), &order_key).await?;
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(removed > 0 && live)
    }

    /// Removes the item while it is in `status` at `attempts` (I17): read and
    /// locked, then removed, in one transaction.
    pub(crate) async fn forget_if(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        status: dedupe_core::ItemStatus,
        attempts: u32,
    ) -> Result<bool> {
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let seen: Option<(Option<Vec<u8>>,)> =
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql.forget_if_read.as_str()))
                .bind(key.namespace().as_bytes())
                .bind(key.id().as_bytes())
                .bind(attempts)
                .bind(dedupe_core::backend::status_code(Some(status)))
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
        let Some((order_key,)) = seen else {
            tx.rollback().await.map_err(|e| self.err(e))?;
            return Ok(false);
        };
        sqlx::query(sqlx::AssertSqlSafe(self.sql.forget_if.as_str()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        if let Some(order_key) = order_key {
            self.promote(&mut tx, key.namespace(), &order_key).await?;
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(true)
    }

    /// Makes the first waiting item of ordering key `order_key` its head,
    /// due again if a take parked it, in the caller's transaction that took
    /// an item of the key out of its queue.
    pub(crate) async fn promote(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
        order_key: &[u8],
    ) -> Result<()> {
        sqlx::query(sqlx::AssertSqlSafe(self.sql.promote.as_str()))
            .bind(namespace.as_bytes())
            .bind(order_key)
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }
}
