//! The async Postgres store.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dedupe_core::backend::{check_ttl, duration_millis};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

pub use crate::builder::PgBuilder;
use crate::ops::Ops;
use crate::sql::{Statements, EXPIRE_BATCH, EXPIRE_PAGES};
use dedupe_core::backend::FirstStatement;
use dedupe_sqlx::{Checkout, Kept};

/// The Postgres store: records in one table, every decision made by single
/// statements on the server, with the server's clock.
///
/// - **Atomic primitive**: a claim is one `INSERT ... ON CONFLICT (key) DO
///   UPDATE ... WHERE expires_at <= now() RETURNING`, in a statement that first
///   reads the key: a live record (a duplicate, a claim in flight) is answered
///   from that read and nothing is written, no transaction id, no row lock, no
///   WAL; otherwise the upsert inserts a fresh record or takes over an expired
///   one. One statement, one round trip; `claim_in` always runs it. On the
///   store's own connections a cheaper statement goes first: while most of a
///   store's recent claims were of new keys, the bare `INSERT ... ON CONFLICT
///   DO NOTHING RETURNING` (which wins a key with no record, and leaves a
///   committed row untouched, unlocked and unwritten); while most met records,
///   a plain `SELECT` of the live record, which answers a duplicate on its own
///   (a claim the record could have been answered by at that instant). The
///   statement above runs only when the first one did not settle the claim,
///   and decides on its own whatever the first one read: no write ever
///   depends on a read made before it. Complete, release and extend are single
///   statements conditional on the lease token and `expires_at > now()`.
///   Every statement must reach the primary: do not put the store behind a
///   pooler that sends plain `SELECT`s to standbys (pgpool-II load balancing,
///   a read/write-splitting proxy), or a claim could be answered from a
///   standby's stale copy.
/// - **Time**: every deadline is computed and judged by the server's `now()`; the
///   caller's clock plays no part. Inside a caller's transaction `now()` is the
///   transaction's start, so keep such transactions short.
/// - **Table**: one row per key, the key in one column (`namespace:id`).
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
    pub(crate) pool: PgPool,
    pub(crate) kept: Arc<Kept<sqlx::Postgres>>,
    /// Picks a claim's first statement from what recent claims met.
    pub(crate) first: Arc<FirstStatement>,
    /// The statements, built once for the schema and table.
    pub(crate) sql: Arc<Statements>,
    pub(crate) timeout: Duration,
    pub(crate) caps: Capabilities,
    /// The `LISTEN` connection that wakes this process's workers (I14).
    pub(crate) wake: dedupe_core::backend::Subscription,
    /// When this process's accepts into the table last notified each
    /// namespace (shared by the handles of one table).
    pub(crate) notices: Arc<crate::wake::Notices>,
}

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
    /// How long a connection of a pool from [`connect_pool`](Self::connect_pool)
    /// lives before the pool replaces it.
    pub const MAX_CONNECTION_LIFETIME: Duration = dedupe_sqlx::MAX_CONNECTION_LIFETIME;

    /// Settings for a store on a pool the caller already has.
    pub fn builder(pool: PgPool) -> PgBuilder {
        PgBuilder {
            pool,
            schema: Self::DEFAULT_SCHEMA.to_string(),
            table: Self::DEFAULT_TABLE.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            keep: 0,
        }
    }

    /// A store with default settings on a pool the caller already has.
    pub fn new(pool: PgPool) -> Result<Self> {
        Self::builder(pool).build()
    }

    /// Connects a pool to `url` (with a server-side `statement_timeout` equal to the
    /// default operation timeout) and builds a store with default settings on it.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::builder(Self::connect_pool(url, 10, Self::DEFAULT_TIMEOUT).await?)
            .keep_connections(5)
            .build()
    }

    /// Connects a pool suited to this store: at most `max_connections`, acquiring a
    /// connection bounded by `timeout`, and a server-side `statement_timeout` of
    /// `timeout` so a statement the client gave up on does not run on.
    ///
    /// The pool does not ping a connection before handing it out (sqlx's
    /// `test_before_acquire(false)`): that ping is a round trip on every
    /// operation. A connection that broke while idle fails its next statement with
    /// a retryable error and is replaced. On a pool of your own, set the same
    /// options for the same speed.
    pub async fn connect_pool(
        url: &str,
        max_connections: u32,
        timeout: Duration,
    ) -> Result<PgPool> {
        if timeout < Duration::from_millis(1) {
            return Err(Error::config("timeout must be at least 1 ms"));
        }
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e| Error::config(format!("postgres URL: {e}")))?;
        let options = options.options([(
            "statement_timeout",
            format!("{}ms", duration_millis(timeout)),
        )]);
        // One direct connection first: the pool retries a refused or failing
        // connection until its acquire timeout and then reports only that it
        // timed out, hiding why (refused, unknown host, bad password, no such
        // database). This one fails with the reason.
        let probe = tokio::time::timeout(timeout, sqlx::ConnectOptions::connect(&options))
            .await
            .map_err(|_| Error::timeout(timeout))?
            .map_err(|e| crate::error::map(e, timeout))?;
        let _ = sqlx::Connection::close(probe).await;
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(timeout)
            // No ping before each checkout: a broken connection fails its statement
            // with a retryable error and is dropped, and the next checkout opens a
            // new one. Connections are renewed every half hour instead.
            .test_before_acquire(false)
            .max_lifetime(Self::MAX_CONNECTION_LIFETIME)
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

    /// Runs `op` bounded by the store's timeout plus the backstop margin, so the
    /// server's `statement_timeout` (which cancels cleanly) fires first.
    async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        dedupe_core::backend::within(self.timeout + Self::BACKSTOP, op).await
    }

    async fn acquire(&self) -> Result<Checkout<sqlx::Postgres>> {
        Checkout::take(&self.pool, &self.kept, self.timeout, crate::error::map).await
    }

    pub(crate) fn ops(&self) -> Ops<'_> {
        Ops {
            sql: &self.sql,
            timeout: self.timeout,
            caps: self.caps,
        }
    }

    /// Runs one call on a connection of the store's, bounded by its timeout.
    pub(crate) async fn call<T>(
        &self,
        op: impl AsyncFnOnce(Ops<'_>, &mut PgConnection) -> Result<T>,
    ) -> Result<T> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            let result = op(self.ops(), &mut conn).await;
            conn.finish(&result);
            result
        })
        .await
    }

    /// Creates the schema and the table if they are missing. Safe to run
    /// from several processes at once (it takes an advisory lock).
    #[tracing::instrument(name = "dedupe.migrate", skip_all, fields(store = "postgres"), err)]
    pub async fn migrate(&self) -> Result<()> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            let result = self.ops().migrate(&mut conn).await;
            conn.finish(&result);
            result
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
        self.ops().claim(conn, key, opts).await
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
        self.ops().complete(conn, lease, outcome, retention).await
    }

    /// Releases a lease on the caller's connection or transaction.
    #[tracing::instrument(name = "dedupe.release_in", skip_all, fields(store = "postgres", key = %lease.key), err)]
    pub async fn release_in(&self, conn: &mut PgConnection, lease: &Lease) -> Result<()> {
        self.ops().release(conn, lease).await
    }
}

#[async_trait]
impl dedupe_sqlx::Transactional for PgStore {
    type Database = sqlx::Postgres;

    fn pool(&self) -> &sqlx::Pool<sqlx::Postgres> {
        PgStore::pool(self)
    }

    async fn claim_in(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        PgStore::claim_in(self, conn, key, opts).await
    }

    async fn complete_in(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        PgStore::complete_in(self, conn, lease, outcome, retention).await
    }

    async fn release_in(&self, conn: &mut PgConnection, lease: &Lease) -> Result<()> {
        PgStore::release_in(self, conn, lease).await
    }

    async fn accept_in(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        payload: &[u8],
        options: &dedupe_core::AcceptOptions,
    ) -> Result<dedupe_core::Accepted> {
        PgStore::accept_in(self, conn, key, payload, options).await
    }
}

#[async_trait]
impl DedupeStore for PgStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        let (outcome, had_record) = self
            .call(async |ops, conn| {
                if self.first.expect_records() {
                    let outcome = ops.claim_read_first(conn, key, opts).await?;
                    let had_record =
                        !matches!(&outcome, ClaimOutcome::Claimed(l) if l.attempt == 1);
                    Ok((outcome, had_record))
                } else {
                    ops.claim_new_first(conn, key, opts).await
                }
            })
            .await?;
        self.first.note(had_record);
        Ok(outcome)
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        self.call(async |ops, conn| ops.complete(conn, lease, outcome, retention).await)
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.call(async |ops, conn| ops.release(conn, lease).await)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        self.call(async |ops, conn| ops.extend(conn, lease, ttl).await)
            .await
    }

    /// Walks the table once, 256 pages (2 MiB) per statement, deleting the
    /// expired rows of each step (at most 1,000 per statement, the step repeated
    /// until it comes back short) and skipping rows other transactions hold. Each
    /// statement is short, so the purge never holds many locks and never waits on a
    /// claim. After a step that deleted rows it rests as long as the step took,
    /// so claims running beside a purge keep their latency. The walk reads the
    /// whole table: there is no index on the deadline,
    /// which keeps claims and completions cheaper (see the crate README). Run it
    /// on a period (for example hourly, with [`dedupe_core::spawn_expire_task`]);
    /// claims never depend on it, since expiry is judged by `now()`.
    async fn expire(&self) -> Result<u64> {
        let pages = self
            .call(async |ops, conn| ops.table_pages(conn).await)
            .await?;
        let mut removed = 0;
        let mut from = 0;
        while from < pages {
            let to = from + EXPIRE_PAGES;
            let started = Instant::now();
            let n = self
                .call(async |ops, conn| ops.expire_batch(conn, from, to).await)
                .await?;
            removed += n;
            // Rest as long as the step took: the purge takes at most half of one
            // connection's time, so claims beside it keep their latency (16 tasks
            // claiming during a purge of 10^5 records: p99 1.3x, not 2.0-2.7x).
            if n > 0 {
                tokio::time::sleep(started.elapsed()).await;
            }
            // A full batch may have left more expired rows in these pages.
            if n < EXPIRE_BATCH as u64 {
                from = to;
            }
        }
        Ok(removed)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.call(async |ops, conn| ops.get(conn, key).await).await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        self.call(async |ops, conn| ops.forget(conn, key).await)
            .await
    }

    /// The whole batch in one statement (`unnest` of arrays), one round trip,
    /// which writes nothing unless it answers every key.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.call(async |ops, conn| ops.claim_many(conn, keys, opts).await)
            .await
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
