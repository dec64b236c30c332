//! The async Postgres store.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::{
    check_ttl, duration_millis, from_millis, Capabilities, ClaimId, ClaimOptions, ClaimOutcome,
    DedupeStore, Error, Fingerprint, Key, Lease, LeaseToken, Record, RecordState, Result,
    StoredRecord, DEFAULT_MAX_OUTCOME_BYTES,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{PgConnection, PgPool, Row};

use crate::sql::{Statements, EXPIRE_BATCH};

/// Settings of a [`PgStore`]; start with [`PgStore::builder`].
#[derive(Debug, Clone)]
pub struct PgBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    timeout: Duration,
    max_outcome_bytes: usize,
}

impl PgBuilder {
    /// Schema of the table (default `public`); a plain identifier.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Table name (default `dedupe_records`); a plain identifier.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Bound on each operation (default 5 s). Past it the operation fails with a
    /// retryable [`Error::Timeout`].
    ///
    /// On a pool from [`PgStore::connect_pool`] the server enforces it as
    /// `statement_timeout`: it cancels the statement, so a timed-out operation has
    /// changed nothing. The client gives up only [`PgStore::BACKSTOP`] later, when
    /// the server did not answer at all; only then is the effect unknown (retry
    /// with the same claim id). On a pool of your own, set `statement_timeout` on
    /// its connections to get the same guarantee.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Validates the names and builds the store. No I/O: call
    /// [`PgStore::migrate`] to create the table.
    pub fn build(self) -> Result<PgStore> {
        let sql = Statements::new(&self.schema, &self.table)?;
        if self.timeout.is_zero() {
            return Err(Error::config("timeout must be above zero"));
        }
        Ok(PgStore {
            pool: self.pool,
            sql: Arc::new(sql),
            timeout: self.timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
        })
    }
}

/// The Postgres store: records in one table, every decision made by one statement
/// on the server, with the server's clock.
///
/// - **Atomic primitive**: a claim is one `INSERT ... ON CONFLICT (namespace, id) DO
///   UPDATE ... WHERE expires_at <= now() RETURNING`, wrapped in a CTE that also
///   returns the live record when there is one, so the new and the duplicate case
///   both take one round trip. Complete, release and extend are single statements
///   conditional on the lease token and `expires_at > now()`. There is no
///   check-then-write anywhere.
/// - **Time**: every deadline is computed and judged by the server's `now()`; the
///   caller's clock plays no part. Inside a caller's transaction `now()` is the
///   transaction's start, so keep such transactions short.
/// - **Failures**: connection loss, a restarting server and timeouts surface as
///   retryable errors; the pool reconnects on its own once the server is back.
///
/// ```no_run
/// use std::time::Duration;
/// use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
/// use dedupe_postgres::PgStore;
///
/// # async fn run() -> Result<(), dedupe_core::Error> {
/// let store = PgStore::connect("postgres://app@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let key = Key::new("stripe", "evt_1P9x")?;
/// if let ClaimOutcome::Claimed(lease) = store.claim(&key, &ClaimOptions::default()).await? {
///     // ... do the work ...
///     store.complete(&lease, b"order 17", Duration::from_secs(35 * 86_400)).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    sql: Arc<Statements>,
    timeout: Duration,
    caps: Capabilities,
}

fn decode_record(key: &Key, row: &PgRow) -> Result<Record> {
    let read = || -> std::result::Result<StoredRecord, sqlx::Error> {
        Ok(StoredRecord {
            state: i64::from(row.try_get::<i16, _>("state")?),
            token: row.try_get("token")?,
            claim_id: row.try_get("claim_id")?,
            fingerprint: row.try_get("fingerprint")?,
            expires_ms: row.try_get("expires_ms")?,
            completed_ms: row.try_get("completed_ms")?,
            outcome: row.try_get("outcome")?,
            attempts: i64::from(row.try_get::<i32, _>("attempts")?),
            first_seen_ms: row.try_get("first_seen_ms")?,
        })
    };
    read()
        .map_err(|e| Error::corrupt(key, format!("undecodable column: {e}")))?
        .decode(key)
}

/// The answer carried by one row of the claim statements.
fn answer_from_row(key: &Key, row: &PgRow, opts: &ClaimOptions) -> Result<ClaimOutcome> {
    let won: bool = row
        .try_get("won")
        .map_err(|e| Error::corrupt(key, format!("undecodable column: {e}")))?;
    let record = decode_record(key, row)?;
    if !won {
        return Ok(record.into_claim_answer(opts));
    }
    let RecordState::InFlight { lease_deadline } = record.state else {
        return Err(Error::corrupt(key, "a won claim returned a done record"));
    };
    Ok(ClaimOutcome::Claimed(Lease {
        key: key.clone(),
        token: record.token,
        deadline: lease_deadline,
        attempt: record.attempts,
        claim_id: record.claim_id,
    }))
}

/// How often a claim is retried when its record vanished between the upsert and
/// the read that answers it (a concurrent release, forget or expire).
const CLAIM_ROUNDS: usize = 3;

impl PgStore {
    /// Default table name.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";
    /// Default schema.
    pub const DEFAULT_SCHEMA: &'static str = "public";
    /// Default bound on each operation.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
    /// How long after the timeout the client stops waiting for a server that does
    /// not answer (a hung connection, a partitioned network).
    pub const BACKSTOP: Duration = Duration::from_secs(1);

    /// Settings for a store on a pool the caller already has.
    pub fn builder(pool: PgPool) -> PgBuilder {
        PgBuilder {
            pool,
            schema: Self::DEFAULT_SCHEMA.to_string(),
            table: Self::DEFAULT_TABLE.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
        }
    }

    /// A store with default settings on a pool the caller already has.
    pub fn new(pool: PgPool) -> Result<Self> {
        Self::builder(pool).build()
    }

    /// Connects a pool to `url` (with a server-side `statement_timeout` equal to the
    /// default operation timeout) and builds a store with default settings on it.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::builder(Self::connect_pool(url, 10, Self::DEFAULT_TIMEOUT).await?).build()
    }

    /// Connects a pool suited to this store: at most `max_connections`, acquiring a
    /// connection bounded by `timeout`, and a server-side `statement_timeout` of
    /// `timeout` so a statement the client gave up on does not run on.
    pub async fn connect_pool(
        url: &str,
        max_connections: u32,
        timeout: Duration,
    ) -> Result<PgPool> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e| Error::config(format!("postgres URL: {e}")))?;
        let options = options.options([(
            "statement_timeout",
            format!("{}ms", duration_millis(timeout)),
        )]);
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(timeout)
            .connect_with(options)
            .await
            .map_err(|e| crate::error::map(e, timeout))
    }

    /// The pool underneath.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema-qualified table name.
    pub fn table_name(&self) -> String {
        format!("{}.{}", self.sql.schema, self.sql.table)
    }

    fn err(&self, e: sqlx::Error) -> Error {
        crate::error::map(e, self.timeout)
    }

    /// Runs `op` bounded by the store's timeout plus the backstop margin, so the
    /// server's `statement_timeout` (which cancels cleanly) fires first.
    async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        let bound = self.timeout + Self::BACKSTOP;
        tokio::time::timeout(bound, op)
            .await
            .unwrap_or(Err(Error::Timeout {
                after: bound,
                source: None,
            }))
    }

    async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        self.pool.acquire().await.map_err(|e| self.err(e))
    }

    /// Creates the schema, table and expiry index if they are missing. Safe to run
    /// from several processes at once (it takes an advisory lock).
    #[tracing::instrument(name = "dedupe.migrate", skip_all, fields(store = "postgres"), err)]
    pub async fn migrate(&self) -> Result<()> {
        // One simple-query message: Postgres runs its statements as one implicit
        // transaction, which holds the advisory lock to the end.
        self.bounded(async {
            sqlx::raw_sql(&self.sql.migrate)
                .execute(&self.pool)
                .await
                .map(|_| ())
                .map_err(|e| self.err(e))
        })
        .await
    }

    /// Claims `key` on the caller's connection or transaction (`&mut *tx`), so the
    /// claim, the caller's own writes and [`complete_in`](Self::complete_in)
    /// commit together or not at all. A concurrent transaction claiming the same
    /// key waits on the row until this one ends, then sees it done (commit) or
    /// claims it (rollback). Not bounded by the store's timeout: the caller owns
    /// the transaction.
    #[tracing::instrument(name = "dedupe.claim_in", skip_all, fields(store = "postgres", key = %key), err)]
    pub async fn claim_in(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        for _ in 0..CLAIM_ROUNDS {
            let token = LeaseToken::generate();
            let row = sqlx::query(&self.sql.claim)
                .bind(key.namespace())
                .bind(key.id())
                .bind(token.as_str())
                .bind(opts.claim_id.as_ref().map(ClaimId::as_str))
                .bind(opts.fingerprint.as_ref().map(Fingerprint::as_bytes))
                .bind(duration_millis(opts.lease_ttl) as f64)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            if let Some(row) = row {
                return answer_from_row(key, &row, opts);
            }
            // The upsert found a live record committed after this statement's
            // snapshot began, so the same statement could not read it: read it now.
            if let Some(record) = self.get_on(conn, key).await? {
                return Ok(record.into_claim_answer(opts));
            }
        }
        Err(Error::backend(
            "the record kept changing under the claim; retry",
            true,
            None,
        ))
    }

    /// Completes a lease on the caller's connection or transaction.
    #[tracing::instrument(name = "dedupe.complete_in", skip_all, fields(store = "postgres", key = %lease.key), err)]
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let done = sqlx::query(&self.sql.complete)
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(duration_millis(retention) as f64)
            .bind(outcome)
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    /// Releases a lease on the caller's connection or transaction.
    #[tracing::instrument(name = "dedupe.release_in", skip_all, fields(store = "postgres", key = %lease.key), err)]
    pub async fn release_in(&self, conn: &mut PgConnection, lease: &Lease) -> Result<()> {
        let done = sqlx::query(&self.sql.release)
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(Error::lease_lost(&lease.key))
        }
    }

    async fn get_on(&self, conn: &mut PgConnection, key: &Key) -> Result<Option<Record>> {
        let row = sqlx::query(&self.sql.select_live)
            .bind(key.namespace())
            .bind(key.id())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| decode_record(key, &row)).transpose()
    }

    async fn claim_batch(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        // Distinct keys go to the server; a key repeated in the batch is answered
        // as a claim right after the first would be.
        let mut first_index: HashMap<&Key, usize> = HashMap::new();
        let mut distinct: Vec<&Key> = Vec::new();
        for key in keys {
            first_index.entry(key).or_insert_with(|| {
                distinct.push(key);
                distinct.len() - 1
            });
        }
        let namespaces: Vec<&str> = distinct.iter().map(|k| k.namespace()).collect();
        let ids: Vec<&str> = distinct.iter().map(|k| k.id()).collect();
        let tokens: Vec<String> = distinct
            .iter()
            .map(|_| LeaseToken::generate().as_str().to_string())
            .collect();
        let mut conn = self.acquire().await?;
        let rows = sqlx::query(&self.sql.claim_many)
            .bind(&namespaces)
            .bind(&ids)
            .bind(&tokens)
            .bind(opts.claim_id.as_ref().map(ClaimId::as_str))
            .bind(opts.fingerprint.as_ref().map(Fingerprint::as_bytes))
            .bind(duration_millis(opts.lease_ttl) as f64)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        let by_key: HashMap<&Key, usize> =
            distinct.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; distinct.len()];
        for row in &rows {
            let namespace: String = row.try_get("namespace").map_err(|e| self.err(e))?;
            let id: String = row.try_get("id").map_err(|e| self.err(e))?;
            let key =
                Key::new(namespace, id).map_err(|e| Error::corrupt("claim_many", e.to_string()))?;
            let index = *by_key.get(&key).ok_or_else(|| {
                Error::corrupt(&key, "claim_many returned a key it was not asked")
            })?;
            answers[index] = Some(answer_from_row(&key, row, opts)?);
        }
        let mut distinct_answers = Vec::with_capacity(distinct.len());
        for (key, answer) in distinct.iter().zip(answers) {
            distinct_answers.push(match answer {
                Some(answer) => answer,
                // Committed after the statement's snapshot: claim it on its own.
                None => self.claim_in(&mut conn, key, opts).await?,
            });
        }
        let mut seen = vec![false; distinct.len()];
        Ok(keys
            .iter()
            .map(|key| {
                let i = first_index[key];
                let first = &distinct_answers[i];
                if std::mem::replace(&mut seen[i], true) {
                    repeat_answer(first, opts)
                } else {
                    first.clone()
                }
            })
            .collect())
    }
}

/// What a second claim of a key in the same batch answers, given the first one's
/// answer: the record the first left behind, seen again.
fn repeat_answer(first: &ClaimOutcome, opts: &ClaimOptions) -> ClaimOutcome {
    match first {
        ClaimOutcome::Claimed(lease) if opts.claim_id.is_none() => ClaimOutcome::InFlight {
            deadline: lease.deadline,
            attempt: lease.attempt,
        },
        other => other.clone(),
    }
}

#[async_trait]
impl DedupeStore for PgStore {
    #[tracing::instrument(name = "dedupe.claim", skip_all, fields(store = "postgres", key = %key), err)]
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        self.bounded(async {
            let mut conn = self.acquire().await?;
            self.claim_in(&mut conn, key, opts).await
        })
        .await
    }

    #[tracing::instrument(name = "dedupe.complete", skip_all, fields(store = "postgres", key = %lease.key), err)]
    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        self.bounded(async {
            let mut conn = self.acquire().await?;
            self.complete_in(&mut conn, lease, outcome, retention).await
        })
        .await
    }

    #[tracing::instrument(name = "dedupe.release", skip_all, fields(store = "postgres", key = %lease.key), err)]
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            self.release_in(&mut conn, lease).await
        })
        .await
    }

    #[tracing::instrument(name = "dedupe.extend", skip_all, fields(store = "postgres", key = %lease.key), err)]
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        self.bounded(async {
            let deadline: Option<i64> = sqlx::query_scalar(&self.sql.extend)
                .bind(lease.key.namespace())
                .bind(lease.key.id())
                .bind(lease.token.as_str())
                .bind(duration_millis(ttl) as f64)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
            match deadline {
                Some(ms) => Ok(Lease {
                    deadline: from_millis(ms),
                    ..lease.clone()
                }),
                None => Err(Error::lease_lost(&lease.key)),
            }
        })
        .await
    }

    /// Deletes expired rows in batches of 1,000, each its own statement, skipping
    /// rows other transactions hold. Run it from cron (or a timer task), for example
    /// hourly; claims never depend on it, since expiry is judged by `now()`.
    #[tracing::instrument(name = "dedupe.expire", skip_all, fields(store = "postgres"), err)]
    async fn expire(&self) -> Result<u64> {
        let mut removed = 0;
        loop {
            let n = self
                .bounded(async {
                    sqlx::query(&self.sql.expire_batch)
                        .bind(EXPIRE_BATCH)
                        .execute(&self.pool)
                        .await
                        .map(|done| done.rows_affected())
                        .map_err(|e| self.err(e))
                })
                .await?;
            removed += n;
            if n < EXPIRE_BATCH as u64 {
                return Ok(removed);
            }
        }
    }

    #[tracing::instrument(name = "dedupe.get", skip_all, fields(store = "postgres", key = %key), err)]
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            self.get_on(&mut conn, key).await
        })
        .await
    }

    #[tracing::instrument(name = "dedupe.forget", skip_all, fields(store = "postgres", key = %key), err)]
    async fn forget(&self, key: &Key) -> Result<bool> {
        self.bounded(async {
            let live: Option<bool> = sqlx::query_scalar(&self.sql.forget)
                .bind(key.namespace())
                .bind(key.id())
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
            Ok(live.unwrap_or(false))
        })
        .await
    }

    /// The whole batch in one statement (`unnest` of arrays), one round trip.
    #[tracing::instrument(name = "dedupe.claim_many", skip_all, fields(store = "postgres", keys = keys.len()), err)]
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.bounded(self.claim_batch(keys, opts)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
