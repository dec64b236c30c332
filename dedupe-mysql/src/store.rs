//! The store: its pool, its calls bounded in time, the trait, and the
//! transactional methods.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{Executor, MySqlConnection, MySqlPool};

use crate::builder::MySqlBuilder;
use crate::ops::Ops;
use crate::sql::Statements;
use dedupe_core::backend::FirstStatement;
use dedupe_sqlx::{Checkout, Kept};

/// Room for a completion's statement besides its outcome: the text, the key
/// (576 bytes at most), the token and the packet headers.
const STATEMENT_ROOM: u64 = 4096;

/// A dedupe store in a MySQL 8.0+ or MariaDB 10.6+ table (InnoDB).
///
/// Each claim is one `INSERT ... ON DUPLICATE KEY UPDATE` on the primary key
/// that inserts a new record or takes over one whose deadline passed (judged
/// by the server's `NOW(3)`), then a read of the row by key: the token it
/// holds says whether this claim won. Complete, release and extend are single
/// statements fenced by the token and the deadline.
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pub(crate) pool: MySqlPool,
    pub(crate) sql: Arc<Statements>,
    pub(crate) timeout: Duration,
    pub(crate) caps: Capabilities,
    /// Connections kept between calls (shared by the store's clones).
    pub(crate) kept: Arc<Kept<sqlx::MySql>>,
    /// Whether claims read first (shared by the store's clones).
    pub(crate) first: Arc<FirstStatement>,
    /// Raised when an inbox item becomes due now through this handle or a
    /// clone (I14): MySQL has no notifications, so other processes' changes
    /// are found by their workers' poll.
    pub(crate) wakeups: dedupe_core::backend::Wakeups,
}

impl MySqlStore {
    /// The table a store uses unless told otherwise.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";
    /// A call's time bound unless told otherwise.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
    /// How long past the timeout the client waits for a server that does not
    /// answer (a hung connection, a partitioned network) before it gives up
    /// on the call; the server's own bounds fire first.
    pub const BACKSTOP: Duration = Duration::from_secs(1);

    /// Settings for a store on `pool`.
    pub fn builder(pool: MySqlPool) -> MySqlBuilder {
        MySqlBuilder::new(pool)
    }

    /// Connects a pool of 10 to `url` (`mysql://user:pass@host:port/db`) and
    /// builds the store with the defaults, keeping 5 connections between
    /// calls (the other 5 for your transactions on [`pool`](Self::pool)). No table is made: call
    /// [`migrate`](Self::migrate).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::builder(Self::connect_pool(url, 10, Self::DEFAULT_TIMEOUT).await?)
            .keep_connections(5)
            .build()
    }

    /// Connects a pool suited to the store: at most `max_connections`, each
    /// session `READ COMMITTED` (no gap locks: claims of neighbouring keys
    /// and the purge do not lock each other out), with the server bounding
    /// its statements by `timeout`: MariaDB's `max_statement_time` (every
    /// statement), MySQL's `max_execution_time` (reads), and on both
    /// `innodb_lock_wait_timeout` (whole seconds, rounded up). The client
    /// waits [`BACKSTOP`](Self::BACKSTOP) longer, so the server stops a
    /// statement before the client gives up on it.
    pub async fn connect_pool(
        url: &str,
        max_connections: u32,
        timeout: Duration,
    ) -> Result<MySqlPool> {
        if timeout < Duration::from_millis(1) {
            return Err(Error::config("timeout must be at least 1 ms"));
        }
        let options: MySqlConnectOptions = url
            .parse()
            .map_err(|e| Error::config(format!("mysql URL: {e}")))?;
        let bounds = [
            format!(
                "SET SESSION max_statement_time = {:.3}",
                timeout.as_secs_f64()
            ),
            format!("SET SESSION max_execution_time = {}", timeout.as_millis()),
            format!(
                "SET SESSION innodb_lock_wait_timeout = {}",
                timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0)
            ),
        ];
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(timeout)
            .test_before_acquire(false)
            .after_connect(move |conn, _| {
                let bounds = bounds.clone();
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    for bound in bounds {
                        match conn.execute(sqlx::AssertSqlSafe(bound)).await {
                            // The other server's variable: unknown here (1193).
                            Err(e) if crate::error::number(&e) == Some(1193) => {}
                            other => {
                                other?;
                            }
                        }
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(|e| crate::error::map(e, timeout))
    }

    /// The pool, for the caller's own transactions.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table's name.
    pub fn table_name(&self) -> &str {
        &self.sql.table
    }

    /// Creates the table if it is not there and brings it up to date (the
    /// numbered files of `migrations/`, in order), and checks that the server's
    /// `max_allowed_packet` carries a completion with the largest outcome
    /// the store accepts (an `InvalidConfig` naming both sizes if not). Safe
    /// to call again, from any number of processes.
    pub async fn migrate(&self) -> Result<()> {
        let map = |e| crate::error::map(e, self.timeout);
        self.bounded(async {
            let Some((records, later)) = self.sql.migrations.split_first() else {
                return Err(Error::fatal("the store knows no migration", None));
            };
            sqlx::query(sqlx::AssertSqlSafe(records.as_str()))
                .execute(&self.pool)
                .await
                .map_err(map)?;
            for (migration, gate) in later.iter().zip(crate::sql::GATES) {
                let Some((column, _)) = gate else {
                    sqlx::query(sqlx::AssertSqlSafe(migration.as_str()))
                        .execute(&self.pool)
                        .await
                        .map_err(map)?;
                    continue;
                };
                let has: i64 =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(self.sql.has_column.as_str()))
                        .bind(column)
                        .fetch_one(&self.pool)
                        .await
                        .map_err(map)?;
                if has > 0 {
                    continue;
                }
                match sqlx::query(sqlx::AssertSqlSafe(migration.as_str()))
                    .execute(&self.pool)
                    .await
                {
                    // A concurrent migrate added the columns first.
                    Err(e) if crate::error::number(&e) == Some(1060) => {}
                    other => {
                        other.map_err(map)?;
                    }
                }
            }
            let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
                .fetch_one(&self.pool)
                .await
                .map_err(map)?;
            let needed = self.caps.max_outcome_bytes as u64 + STATEMENT_ROOM;
            if needed > packet {
                return Err(Error::config(format!(
                    "max outcome of {} bytes does not fit the server's max_allowed_packet of \
                     {packet} bytes with the statement around it ({needed} needed): raise \
                     max_allowed_packet or lower max_outcome_bytes",
                    self.caps.max_outcome_bytes
                )));
            }
            Ok(())
        })
        .await
    }

    /// Claims `key` inside the caller's transaction (`&mut *tx`), so the
    /// claim, the caller's writes and [`complete_in`](Self::complete_in)
    /// commit together or not at all. A concurrent transaction claiming the
    /// same key waits on the row until this one ends. Not bounded by the
    /// store's timeout (the caller owns the transaction); a deadlock rolled
    /// the caller's whole transaction back and is answered as a retryable
    /// error.
    #[tracing::instrument(name = "dedupe.claim_in", skip_all, fields(store = "mysql", key = %key), err)]
    pub async fn claim_in(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        self.ops(true).claim(conn, key, opts).await
    }

    /// Completes a lease inside the caller's transaction.
    #[tracing::instrument(name = "dedupe.complete_in", skip_all, fields(store = "mysql", key = %lease.key), err)]
    pub async fn complete_in(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        self.ops(true)
            .complete(conn, lease, outcome, retention)
            .await
    }

    /// Releases a lease inside the caller's transaction.
    #[tracing::instrument(name = "dedupe.release_in", skip_all, fields(store = "mysql", key = %lease.key), err)]
    pub async fn release_in(&self, conn: &mut MySqlConnection, lease: &Lease) -> Result<()> {
        self.ops(true).release(conn, lease).await
    }

    pub(crate) fn ops(&self, in_transaction: bool) -> Ops<'_> {
        Ops {
            sql: &self.sql,
            timeout: self.timeout,
            caps: self.caps,
            first: (!in_transaction).then_some(&*self.first),
            in_transaction,
        }
    }

    /// Runs `op` bounded by the timeout and the backstop, so the server's
    /// statement bounds (which stop the statement) fire first.
    async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        dedupe_core::backend::within(self.timeout + Self::BACKSTOP, op).await
    }

    /// Runs `f` on a connection of the pool, bounded by the timeout.
    pub(crate) async fn call<T>(
        &self,
        f: impl AsyncFnOnce(Ops<'_>, &mut MySqlConnection) -> Result<T>,
    ) -> Result<T> {
        self.bounded(async {
            let mut conn =
                Checkout::take(&self.pool, &self.kept, self.timeout, crate::error::map).await?;
            let answer = f(self.ops(false), &mut conn).await;
            conn.finish(&answer);
            answer
        })
        .await
    }
}

// Input is checked here, before a connection is taken (bad input is refused
// by name even when the server is away), and again in `Ops` for the `*_in`
// methods, which take no connection of the store's.
#[async_trait]
impl dedupe_sqlx::Transactional for MySqlStore {
    type Database = sqlx::MySql;

    fn pool(&self) -> &sqlx::Pool<sqlx::MySql> {
        MySqlStore::pool(self)
    }

    async fn claim_in(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        MySqlStore::claim_in(self, conn, key, opts).await
    }

    async fn complete_in(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        MySqlStore::complete_in(self, conn, lease, outcome, retention).await
    }

    async fn release_in(&self, conn: &mut MySqlConnection, lease: &Lease) -> Result<()> {
        MySqlStore::release_in(self, conn, lease).await
    }

    async fn accept_in(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        payload: &[u8],
        options: &dedupe_core::AcceptOptions,
    ) -> Result<dedupe_core::Accepted> {
        MySqlStore::accept_in(self, conn, key, payload, options).await
    }
}

#[async_trait]
impl DedupeStore for MySqlStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        self.call(async |ops, conn| ops.claim(conn, key, opts).await)
            .await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        dedupe_core::backend::check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        self.call(async |ops, conn| ops.complete(conn, lease, outcome, retention).await)
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.call(async |ops, conn| ops.release(conn, lease).await)
            .await?;
        // A held item given back is due now.
        self.wakeups.raise(lease.key.namespace());
        Ok(())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        dedupe_core::backend::check_ttl("lease ttl", ttl)?;
        self.call(async |ops, conn| ops.extend(conn, lease, ttl).await)
            .await
    }

    async fn expire(&self) -> Result<u64> {
        self.call(async |ops, conn| ops.expire(conn).await).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.call(async |ops, conn| ops.get(conn, key).await).await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        self.call(async |ops, conn| ops.forget(conn, key).await)
            .await
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        dedupe_core::backend::check_batch(keys)?;
        opts.validate()?;
        self.call(async |ops, conn| ops.claim_many(conn, keys, opts).await)
            .await
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
