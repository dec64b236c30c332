//! Running the store's statements on a connection the caller already holds (one
//! of the store's pool, or the caller's transaction), so the trait methods and the
//! transactional `*_in` methods share one code path.

use std::time::Duration;

use dedupe_core::backend::{self, check_ttl, from_millis, one_row_changed, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimId, ClaimOptions, ClaimOutcome, Error, Fingerprint, Key, Lease, LeaseToken,
    Record, Result,
};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use crate::codec::decode_record;
use crate::sql::{text, Sql, Statements, EXPIRE_BATCH};

// Which statement a claim on the store's own connections runs first
// (`Ops::claim_new_first` or `Ops::claim_read_first`), picked by whether
// the store's recent claims met records already there (duplicates, claims in
// flight, expired leases to take over). Both ways decide the same claim by the same
// statements; they differ in cost, and in one wait (below):
// - a key with no record costs least as the bare insert (`ON CONFLICT DO
//   NOTHING`, the raw driver's own statement), and a key with a record then
//   takes a second statement;
// - a key with a live record costs least as a plain `SELECT` of it, which
//   answers the claim; a key with none then takes the deciding statement.
//
// So while most recent claims were of new keys (the usual traffic) a claim
// tries the insert first, and while most met records (a retry storm, a
// redelivered backlog) it reads first: `dedupe_core::backend::FirstStatement` counts which.
//
// It earns its lines on the VM's disk as on tmpfs: store/raw at 1 / 16 / 64
// tasks, claims 1.04 / 0.92 / 0.95 against 0.85 / 0.90 / 0.57 with every
// claim pinned to the deciding statement, duplicates 0.84 / 0.78 / 0.84
// against 0.67 / 0.46 / 0.37 (`dedupe bench --repeat 3`, 2026-12-02; the
// crate README has the rest).
//
// The wait: the bare insert's conflict check waits for a transaction that is
// changing the key's row right now (a `complete_in` inside a long business
// transaction), up to the statement timeout, where a read answers InFlight
// from its snapshot.

/// The statements of one store with its error mapping and limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ops<'a> {
    pub(crate) sql: &'a Statements,
    pub(crate) timeout: Duration,
    pub(crate) caps: Capabilities,
}

/// A claim statement (`claim`, `insert_new`, `claim_many`)
/// with its six parameters bound, in the order each of them takes: the keys'
/// namespaces and ids and the tokens (one each, or arrays of them), then the
/// claim id, the fingerprint and the lease.
fn claim_query<'q, T>(
    sql: &Sql,
    namespaces: T,
    ids: T,
    tokens: T,
    opts: &'q ClaimOptions,
) -> Query<'q, Postgres, PgArguments>
where
    T: 'q + for<'t> sqlx::Encode<'t, Postgres> + sqlx::Type<Postgres>,
{
    sqlx::query(text(sql))
        .bind(namespaces)
        .bind(ids)
        .bind(tokens)
        .bind(opts.claim_id.as_ref().map(ClaimId::as_str))
        .bind(opts.fingerprint.as_ref().map(Fingerprint::as_bytes))
        .bind(opts.lease_ttl)
}

/// The answer carried by one row of the claim statements: a win when the row
/// holds the token the statement was given (its `won`).
fn answer_from_row(key: &Key, row: &PgRow, opts: &ClaimOptions) -> Result<ClaimOutcome> {
    let won: bool = row
        .try_get("won")
        .map_err(|e| Error::corrupt(key, format!("undecodable column: {e}")))?;
    let record = decode_record(key, row)?;
    if won {
        backend::won_claim(record)
    } else {
        Ok(backend::losing_claim(record, opts))
    }
}

/// Which of a batch's distinct keys a row of a batch statement is about, from
/// the row's `key` column (`namespace:id`). A row about a key the batch did
/// not ask for fails to decode.
fn position(batch: &BatchKeys<'_>, row: &PgRow) -> std::result::Result<usize, sqlx::Error> {
    let joined: &str = row.try_get("key")?;
    batch.position_of(joined).ok_or_else(|| {
        sqlx::Error::Decode(
            format!("the batch statement returned a key it was not asked: {joined:?}").into(),
        )
    })
}

impl Ops<'_> {
    pub(crate) fn err(&self, e: sqlx::Error) -> Error {
        crate::error::map(e, self.timeout)
    }

    /// Creates the schema and the table under an advisory lock.
    pub(crate) async fn migrate(&self, conn: &mut PgConnection) -> Result<()> {
        // One simple-query message: Postgres runs its statements as one implicit
        // transaction, which holds the advisory lock to the end.
        sqlx::raw_sql(text(&self.sql.migrate))
            .execute(conn)
            .await
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Runs a one-key claim statement (`claim` or `insert_new`) with `token`.
    async fn claim_row(
        &self,
        conn: &mut PgConnection,
        sql: &Sql,
        key: &Key,
        token: &LeaseToken,
        opts: &ClaimOptions,
    ) -> Result<Option<PgRow>> {
        claim_query(sql, key.namespace(), key.id(), token.as_str(), opts)
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))
    }

    /// The deciding statement: it answers every claim in one round trip,
    /// whatever it meets (see `Statements::claim`).
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        let token = backend::new_token();
        let row = self
            .claim_row(conn, &self.sql.claim, key, &token, opts)
            .await?
            .ok_or_else(|| Error::fatal("the claim statement answered no row", None))?;
        answer_from_row(key, &row, opts)
    }

    /// A claim that first tries the bare insert (the cheapest statement for a key
    /// with no record) and runs [`claim_read_first`](Self::claim_read_first)
    /// only when the key has a record. Answers whether the key had one (more
    /// statements ran).
    ///
    /// Only on the store's own connections: each statement commits on its own,
    /// and the insert keeps nothing unless it wins, so the chain decides as the
    /// one statement does. `claim_in` keeps the one statement: inside a
    /// caller's transaction a second statement is one more round trip the
    /// transaction holds its locks for.
    pub(crate) async fn claim_new_first(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<(ClaimOutcome, bool)> {
        opts.validate()?;
        let token = backend::new_token();
        let row = self
            .claim_row(conn, &self.sql.insert_new, key, &token, opts)
            .await?;
        let deadline: Option<i64> = row
            .map(|row| row.try_get(0))
            .transpose()
            .map_err(|e| self.err(e))?;
        match deadline {
            Some(deadline) => Ok((
                ClaimOutcome::Claimed(Lease {
                    key: key.clone(),
                    token,
                    deadline: from_millis(deadline),
                    attempt: 1,
                    claim_id: opts.claim_id.clone(),
                }),
                false,
            )),
            None => Ok((self.claim_read_first(conn, key, opts).await?, true)),
        }
    }

    /// A claim that first reads the key with a plain `SELECT`: a live record (a
    /// duplicate, a claim in flight) is answered from it, and only a key with
    /// no live record runs [`claim`](Self::claim).
    ///
    /// A duplicate is then the cheapest statement there is that still returns
    /// the record: one round trip, no transaction id, no lock, no WAL, and no
    /// data-modifying statement for the server to set up (`claim` runs its
    /// read as part of an upsert, which costs the server about 1.5 times this
    /// `SELECT` even when the upsert writes nothing; measured with pgbench).
    /// A live record answers as it would answer `claim`'s own read (the same
    /// `SELECT`, one statement earlier): the answer was true at an instant of
    /// this call. Everything else is left to `claim`, which decides on its own.
    pub(crate) async fn claim_read_first(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        match self.get(conn, key).await? {
            Some(record) => Ok(backend::losing_claim(record, opts)),
            None => self.claim(conn, key, opts).await,
        }
    }

    /// The whole batch in one statement over `unnest` of arrays, which answers
    /// every distinct key; repeats inside the batch are answered by
    /// [`BatchKeys`]. The statement writes nothing unless it answers (a live
    /// record that would not decode fails it whole, see `Statements`), so a
    /// batch that fails has changed nothing.
    pub(crate) async fn claim_many(
        &self,
        conn: &mut PgConnection,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        let batch = BatchKeys::new(keys);
        let distinct = batch.distinct();
        let namespaces: Vec<&str> = distinct.iter().map(|k| k.namespace()).collect();
        let ids: Vec<&str> = distinct.iter().map(|k| k.id()).collect();
        let tokens = backend::new_tokens(distinct.len());
        let token_text: Vec<&str> = tokens.iter().map(LeaseToken::as_str).collect();
        let rows = claim_query(&self.sql.claim_many, &namespaces, &ids, &token_text, opts)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; distinct.len()];
        for row in &rows {
            let index = position(&batch, row).map_err(|e| self.err(e))?;
            answers[index] = Some(answer_from_row(distinct[index], row, opts)?);
        }
        let answers = answers
            .into_iter()
            .map(|answer| {
                answer
                    .ok_or_else(|| Error::fatal("the batch statement left a key unanswered", None))
            })
            .collect::<Result<Vec<_>>>()?;
        batch.answers(answers, opts)
    }

    pub(crate) async fn complete(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let done = sqlx::query(text(&self.sql.complete))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(retention)
            .bind(outcome)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        if done > 0 {
            return one_row_changed(done, &lease.key);
        }
        // Not a record nor an unordered item: an item of an ordering key, or
        // a lease lost.
        let done: i64 = sqlx::query_scalar(text(&self.sql.complete_ordered))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(retention)
            .bind(outcome)
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))?;
        one_row_changed(done.unsigned_abs(), &lease.key)
    }

    pub(crate) async fn release(&self, conn: &mut PgConnection, lease: &Lease) -> Result<()> {
        let freed: bool = sqlx::query_scalar(text(&self.sql.release))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))?;
        if freed {
            Ok(())
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    pub(crate) async fn extend(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let deadline: Option<i64> = sqlx::query_scalar(text(&self.sql.extend))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(ttl)
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        one_row_changed(u64::from(deadline.is_some()), &lease.key)?;
        Ok(Lease {
            deadline: from_millis(deadline.unwrap_or_default()),
            ..lease.clone()
        })
    }

    /// The table's size in pages, where the purge stops.
    pub(crate) async fn table_pages(&self, conn: &mut PgConnection) -> Result<i64> {
        sqlx::query_scalar(text(&self.sql.table_pages))
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))
    }

    /// Deletes at most [`EXPIRE_BATCH`] expired rows stored in pages
    /// `[from, to)`, skipping rows other transactions hold.
    pub(crate) async fn expire_batch(
        &self,
        conn: &mut PgConnection,
        from: i64,
        to: i64,
    ) -> Result<u64> {
        sqlx::query_scalar::<_, i64>(text(&self.sql.expire_batch))
            .bind(from)
            .bind(to)
            .bind(EXPIRE_BATCH)
            .fetch_one(conn)
            .await
            .map(i64::unsigned_abs)
            .map_err(|e| self.err(e))
    }

    pub(crate) async fn get(&self, conn: &mut PgConnection, key: &Key) -> Result<Option<Record>> {
        let row = sqlx::query(text(&self.sql.select_live))
            .bind(key.namespace())
            .bind(key.id())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| decode_record(key, &row)).transpose()
    }

    pub(crate) async fn forget(&self, conn: &mut PgConnection, key: &Key) -> Result<bool> {
        let live: Option<bool> = sqlx::query_scalar(text(&self.sql.forget))
            .bind(key.namespace())
            .bind(key.id())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(live.unwrap_or(false))
    }

    /// Removes the item while it is in `status` at `attempts` (I17).
    pub(crate) async fn forget_if(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        status: dedupe_core::ItemStatus,
        attempts: u32,
    ) -> Result<bool> {
        // No item was taken more times than the column holds.
        let Ok(attempts) = i32::try_from(attempts) else {
            return Ok(false);
        };
        let gone: i64 = sqlx::query_scalar(text(&self.sql.forget_if))
            .bind(key.namespace())
            .bind(key.id())
            .bind(dedupe_core::backend::status_code(Some(status)) as i32)
            .bind(attempts)
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(gone > 0)
    }
}
