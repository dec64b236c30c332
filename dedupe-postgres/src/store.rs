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

use crate::ops::{FirstStatement, Ops};
use crate::sql::{Statements, EXPIRE_BATCH, EXPIRE_PAGES};

type PooledConn = sqlx::pool::PoolConnection<sqlx::Postgres>;

/// Connections the store keeps checked out between its calls, with when each
/// was first taken from the pool.
///
/// sqlx tests every connection as it goes back to its pool with a round trip
/// (`Sync`, unconditionally in 0.9) before the next caller may have it: with
/// one connection per worker, every call waited for a second round trip. A
/// connection whose call went well is kept here instead and handed to the next
/// call as it is (a connection that broke while idle fails that call with a
/// retryable error and is not kept). At most `keep` of them
/// ([`PgBuilder::hold_connections`]); each goes back to the pool after
/// [`PgStore::MAX_CONNECTION_LIFETIME`], and all of them when the last clone
/// of the store is dropped.
#[derive(Debug)]
struct Held {
    /// Connections, when each was first taken from the pool, and when it was
    /// parked here.
    idle: parking_lot::Mutex<Vec<(PooledConn, Instant, Instant)>>,
    keep: usize,
}

impl Held {
    /// A held connection idle longer than this goes back to the pool (whose
    /// return check finds one a firewall or `idle_session_timeout` cut)
    /// instead of to the next call.
    const IDLE_FOR: Duration = Duration::from_secs(30);
}

impl Drop for Held {
    fn drop(&mut self) {
        // Outside a runtime sqlx cannot run its return task (it would panic):
        // let the connections go without it (their sockets close, their pool
        // slots free).
        if tokio::runtime::Handle::try_current().is_err() {
            for (conn, _, _) in self.idle.get_mut().drain(..) {
                drop(conn.detach());
            }
        }
    }
}

/// A connection for one call: taken from [`Held`] or the pool, and given back
/// by [`settle`](Checkout::settle) and drop.
///
/// A connection whose call failed in a way that may have left it out of step
/// (a lost connection, a timeout, a call dropped half way) goes back to the
/// pool through sqlx's return check, in a task of its own bounded by the
/// store's timeout: a connection whose network went silent (blackholed,
/// half-open) never answers that check, and unbounded it would hold its pool
/// slot until the kernel gave up on the socket, minutes later, leaving a pool
/// that answers nothing but acquire timeouts long after the network healed
/// (seen under a blackholing proxy). Past the bound it is dropped instead.
struct Checkout {
    conn: Option<PooledConn>,
    since: Instant,
    bound: Duration,
    held: Arc<Held>,
    clean: bool,
}

impl Checkout {
    /// Records whether the call left the connection clean: it answered, or the
    /// server refused the statement's effect (a lost lease, a corrupt row)
    /// with the connection ready for the next one.
    fn settle<T>(&mut self, result: &Result<T>) {
        self.clean = match result {
            Ok(_) => true,
            Err(e) => matches!(
                e,
                Error::LeaseLost { .. } | Error::CorruptRecord { .. } | Error::InvalidKey(_)
            ),
        };
    }
}

impl std::ops::Deref for Checkout {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_deref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_deref_mut().expect("present until dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if self.clean && self.since.elapsed() < PgStore::MAX_CONNECTION_LIFETIME {
            let mut idle = self.held.idle.lock();
            if idle.len() < self.held.keep {
                idle.push((conn, self.since, Instant::now()));
                return;
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            drop(conn.detach()); // no runtime: let it go without sqlx's return task
            return;
        };
        let back = conn.return_to_pool();
        let bound = self.bound;
        runtime.spawn(async move {
            if tokio::time::timeout(bound, back).await.is_err() {
                tracing::warn!(
                    ?bound,
                    "a Postgres connection did not answer its return check; dropped it"
                );
            }
        });
    }
}

/// Settings of a [`PgStore`]; start with [`PgStore::builder`].
#[derive(Debug, Clone)]
pub struct PgBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    timeout: Duration,
    max_outcome_bytes: usize,
    hold: usize,
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
    /// `statement_timeout`: it cancels the statement, so a timed-out statement has
    /// changed nothing. The client gives up only [`PgStore::BACKSTOP`] later, when
    /// the server did not answer at all; only then is the effect unknown (retry
    /// with the same claim id). A claim that takes more than one statement (see
    /// [`PgStore`]) is bounded as a whole: should it time out after its first
    /// statement, that statement has committed or changed nothing on its own,
    /// and the last one may have won the key unanswered; retry with the same
    /// claim id to get such a lease back. On a pool of your own, set `statement_timeout` on
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

    /// Keeps up to `n` connections checked out of the pool between calls
    /// (default 0 on a pool you bring; [`PgStore::connect`] holds half of its
    /// ten, leaving the rest to transactions on [`PgStore::pool`]). Drop the
    /// store before closing its pool: `close()` waits for held connections. sqlx tests each connection with a round trip as it goes back to
    /// the pool, before anyone may take it again; a held connection skips that
    /// and goes to the next call directly, which makes a call one round trip
    /// instead of two (measured by `dedupe bench`). Held connections are not
    /// available to other users of the pool: hold only what the pool can
    /// spare, all of them on a pool the store has to itself. A connection
    /// whose call failed is never held.
    pub fn hold_connections(mut self, n: usize) -> Self {
        self.hold = n;
        self
    }

    /// Validates the names and builds the store. No I/O: call
    /// [`PgStore::migrate`] to create the table.
    pub fn build(self) -> Result<PgStore> {
        let sql = Statements::new(&self.schema, &self.table)?;
        // statement_timeout is whole milliseconds, and 0 turns it off.
        if self.timeout < Duration::from_millis(1) {
            return Err(Error::config("timeout must be at least 1 ms"));
        }
        Ok(PgStore {
            first: Arc::default(),
            held: Arc::new(Held {
                idle: parking_lot::Mutex::new(Vec::new()),
                keep: self.hold,
            }),
            pool: self.pool,
            sql: Arc::new(sql),
            timeout: self.timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
        })
    }
}

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
    pool: PgPool,
    held: Arc<Held>,
    /// Picks a claim's first statement from what recent claims met.
    first: Arc<FirstStatement>,
    /// The statements, built once for the schema and table.
    sql: Arc<Statements>,
    timeout: Duration,
    caps: Capabilities,
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
    pub const MAX_CONNECTION_LIFETIME: Duration = Duration::from_secs(30 * 60);

    /// Settings for a store on a pool the caller already has.
    pub fn builder(pool: PgPool) -> PgBuilder {
        PgBuilder {
            pool,
            schema: Self::DEFAULT_SCHEMA.to_string(),
            table: Self::DEFAULT_TABLE.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            hold: 0,
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
            .hold_connections(5)
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
            .map_err(|_| Error::Timeout {
                after: timeout,
                source: None,
            })?
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

    async fn acquire(&self) -> Result<Checkout> {
        let kept = loop {
            let Some((conn, since, parked)) = self.held.idle.lock().pop() else {
                break None;
            };
            if parked.elapsed() < Held::IDLE_FOR
                && since.elapsed() < Self::MAX_CONNECTION_LIFETIME
                && !self.pool.is_closed()
            {
                break Some((conn, since));
            }
            // Idle too long, too old, or its pool closed: back to the pool
            // through the bounded check.
            drop(Checkout {
                conn: Some(conn),
                since,
                bound: self.timeout,
                held: Arc::clone(&self.held),
                clean: false,
            });
        };
        let (conn, since) = match kept {
            Some(kept) => kept,
            // Boxed: sqlx's acquire future is 8.6 KB, and unboxed it made
            // every call's future 18 KB, copied at each await layer (about
            // 1 µs of memmove a claim). A store that holds its connections
            // rarely takes this path.
            None => (
                Box::pin(self.pool.acquire())
                    .await
                    .map_err(|e| self.err(e))?,
                Instant::now(),
            ),
        };
        Ok(Checkout {
            conn: Some(conn),
            since,
            bound: self.timeout,
            held: Arc::clone(&self.held),
            clean: false,
        })
    }

    fn ops(&self) -> Ops<'_> {
        Ops {
            sql: &self.sql,
            timeout: self.timeout,
            caps: self.caps,
        }
    }

    /// Runs one call on a connection of the store's, bounded by its timeout.
    async fn call<T>(
        &self,
        op: impl AsyncFnOnce(Ops<'_>, &mut PgConnection) -> Result<T>,
    ) -> Result<T> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            let result = op(self.ops(), &mut conn).await;
            conn.settle(&result);
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
            conn.settle(&result);
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

    /// The whole batch in one statement (`unnest` of arrays), one round trip; or,
    /// while recent claims were of new keys and the batch carries no claim id,
    /// the bare batch insert first and the one statement for the keys that
    /// have a record.
    ///
    /// A batch with a claim id always runs the one statement: it writes
    /// nothing while a live record among the keys would not decode, where the
    /// bare insert would have committed the new keys first, and a failed
    /// batch with a claim id cannot give them back (see `Ops::give_back`).
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (answers, had_records) = self
            .call(async |ops, conn| {
                // As for `claim`: the bare insert first while recent claims were
                // of new keys (see `FirstStatement`), unless the batch has a claim id.
                if self.first.expect_records() || opts.claim_id.is_some() {
                    let answers = ops.claim_many(conn, keys, opts).await?;
                    let lost = answers.iter().filter(|a| a.lease().is_none()).count();
                    let had_records = lost * 2 > answers.len();
                    Ok((answers, had_records))
                } else {
                    ops.claim_many_new_first(conn, keys, opts).await
                }
            })
            .await?;
        self.first.note(had_records);
        Ok(answers)
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
