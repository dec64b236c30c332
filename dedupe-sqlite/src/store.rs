//! The async store over one SQLite connection.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use dedupe_core::backend::{check_ttl, to_millis};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use tokio::sync::Semaphore;

use crate::ops::Ops;
use crate::sql::{Statements, EXPIRE_BATCH};

/// Settings of a [`SqliteStore`]; build one with [`SqliteStore::builder`].
#[derive(Debug, Clone)]
pub struct SqliteBuilder {
    path: PathBuf,
    table: String,
    busy_timeout: Duration,
    max_outcome_bytes: usize,
    connections: usize,
}

impl SqliteBuilder {
    /// Connections this handle (and its clones) keeps open, at most (default 4).
    /// SQLite lets one writer in at a time whatever the count; more connections let
    /// reads run beside a write and keep callers waiting in async code rather than
    /// on blocking threads.
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections;
        self
    }

    /// Table that holds the records (default `dedupe_records`). Must be a plain
    /// identifier; anything else is refused with `InvalidConfig` at `open`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a statement waits for another connection's write lock before it
    /// fails with a retryable [`Error::Timeout`] (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Opens (or creates) the database file, switches it to WAL, and creates the
    /// table and index if they are missing. The work runs on a blocking thread.
    pub async fn open(self) -> Result<SqliteStore> {
        let sql = Statements::new(&self.table)?;
        if self.busy_timeout.is_zero() {
            return Err(Error::config("busy timeout must be above zero"));
        }
        if self.connections == 0 {
            return Err(Error::config("a store needs at least one connection"));
        }
        let busy_timeout = self.busy_timeout;
        let path = self.path.clone();
        // The first connection is opened now, so a bad path or file fails here.
        let conn = tokio::task::spawn_blocking(move || open_connection(&path, busy_timeout))
            .await
            .map_err(|e| {
                Error::backend("opening thread failed", false, Some(Box::new(e) as _))
            })??;
        let store = SqliteStore {
            inner: Arc::new(Inner {
                idle: Mutex::new(vec![conn]),
                permits: Arc::new(Semaphore::new(self.connections)),
                connections: self.connections,
                sql,
                path: self.path,
                busy_timeout,
                caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
            }),
        };
        store.migrate().await?;
        Ok(store)
    }
}

thread_local! {
    /// When the operation running on this thread stops waiting for the write lock.
    static BUSY_DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's busy deadline set to `busy_timeout` from now.
fn with_busy_deadline<T>(busy_timeout: Duration, f: impl FnOnce() -> T) -> T {
    BUSY_DEADLINE.with(|d| d.set(Some(Instant::now() + busy_timeout)));
    let value = f();
    BUSY_DEADLINE.with(|d| d.set(None));
    value
}

/// SQLite's busy handler: retry every millisecond or so until the deadline.
///
/// SQLite's own `busy_timeout` handler backs off to 100 ms sleeps, which leaves the
/// write lock idle most of the time when many connections contend for it; short
/// sleeps hand it over as soon as it is free.
fn wait_for_lock(attempt: i32) -> bool {
    let Some(deadline) = BUSY_DEADLINE.with(Cell::get) else {
        return false;
    };
    if Instant::now() >= deadline {
        return false;
    }
    let micros = 250 * u64::from(attempt.clamp(1, 8).unsigned_abs());
    std::thread::sleep(Duration::from_micros(micros));
    true
}

fn open_connection(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    with_busy_deadline(busy_timeout, || open_connection_now(path, busy_timeout))
}

fn open_connection_now(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    let map = |e| crate::error::map(e, busy_timeout);
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(map)?;
    conn.busy_handler(Some(wait_for_lock)).map_err(map)?;
    // WAL lets readers run beside the one writer; FULL sync makes a completed record
    // survive power loss, which is the point of keeping it.
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(map)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(map)?;
    Ok(conn)
}

#[derive(Debug)]
struct Inner {
    /// Open connections not in use.
    idle: Mutex<Vec<Connection>>,
    /// One permit per connection the handle may use at once.
    permits: Arc<Semaphore>,
    connections: usize,
    sql: Statements,
    path: PathBuf,
    busy_timeout: Duration,
    caps: Capabilities,
}

/// The SQLite store: records in one table of a database file, shared safely by
/// every thread and process that opens the same file.
///
/// - **Atomic primitive**: each claim is one `INSERT ... ON CONFLICT (namespace, id)
///   DO UPDATE ... WHERE expires_at <= now RETURNING` on the primary key, inside a
///   `BEGIN IMMEDIATE` transaction: the statement inserts a fresh record or takes
///   over an expired one; when it leaves a live record alone, that record is read
///   back under the same write lock to answer. Complete, release and extend are
///   single statements conditional on the lease token. Nothing checks then writes.
/// - **Concurrency**: each opened `SqliteStore` keeps a small pool of connections
///   (default 4, see [`SqliteBuilder::connections`]); clones share it, and each
///   `open` or [`reopen`](SqliteStore::reopen) is a handle with a pool of its own.
///   The file is in WAL mode with a busy timeout, so connections in other threads
///   and processes wait for the write lock rather than fail; past the timeout the
///   error is a retryable [`Error::Timeout`].
/// - **Runtime**: every statement runs on Tokio's blocking pool, never on the
///   async worker threads.
/// - **Time**: deadlines are judged by the caller's clock (`SystemTime::now()`, in
///   milliseconds). Every process sharing a file runs on the same machine, so they
///   share one clock; do not put the file on a network filesystem.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
/// use dedupe_sqlite::SqliteStore;
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
/// let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("dedupe.db")).await?;
/// let key = Key::new("stripe", "evt_1P9x")?;
/// let ClaimOutcome::Claimed(lease) = store.claim(&key, &ClaimOptions::default()).await? else {
///     unreachable!("a fresh key is claimed");
/// };
/// store.complete(&lease, b"order 17", Duration::from_secs(86_400)).await?;
/// assert!(matches!(
///     store.claim(&key, &ClaimOptions::default()).await?,
///     ClaimOutcome::Duplicate { .. }
/// ));
/// # Ok::<(), Box<dyn std::error::Error>>(()) }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

impl SqliteStore {
    /// Default table name.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";
    /// Default number of connections per handle.
    pub const DEFAULT_CONNECTIONS: usize = 4;
    /// Default busy timeout.
    pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// Settings for a store on the file at `path`.
    pub fn builder(path: impl Into<PathBuf>) -> SqliteBuilder {
        SqliteBuilder {
            path: path.into(),
            table: Self::DEFAULT_TABLE.to_string(),
            busy_timeout: Self::DEFAULT_BUSY_TIMEOUT,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            connections: Self::DEFAULT_CONNECTIONS,
        }
    }

    /// Opens the file at `path` with default settings.
    pub async fn open(path: impl Into<PathBuf>) -> Result<Self> {
        Self::builder(path).open().await
    }

    /// Another handle onto the same file with connections of its own.
    pub async fn reopen(&self) -> Result<Self> {
        Self::builder(&self.inner.path)
            .table(self.table_name())
            .busy_timeout(self.inner.busy_timeout)
            .max_outcome_bytes(self.inner.caps.max_outcome_bytes)
            .connections(self.inner.connections)
            .open()
            .await
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        self.inner.sql.table()
    }

    /// Creates the table and its expiry index if they are missing. `open` calls it;
    /// it is safe to call again.
    pub async fn migrate(&self) -> Result<()> {
        self.with_conn(|ops, conn| {
            conn.execute_batch(&ops.sql.create)
                .map_err(|e| crate::error::map(e, ops.busy_timeout))
        })
        .await
    }

    fn ops(&self) -> Ops<'_> {
        Ops {
            sql: &self.inner.sql,
            busy_timeout: self.inner.busy_timeout,
            caps: self.inner.caps,
        }
    }

    /// Claims `key` inside the caller's transaction, so the claim, the caller's own
    /// writes and [`complete_in`](Self::complete_in) commit together or not at all.
    ///
    /// Start the transaction with [`TransactionBehavior::Immediate`]: it takes the
    /// write lock up front, so a concurrent transaction on the same key waits for
    /// this one to commit (then answers `Duplicate`) or roll back (then claims).
    /// A rollback, or a crash before commit, leaves the event claimable again.
    pub fn claim_in(
        &self,
        conn: &Connection,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        self.ops().claim(conn, key, opts)
    }

    /// Completes a lease inside the caller's transaction (see [`claim_in`](Self::claim_in)).
    pub fn complete_in(
        &self,
        conn: &Connection,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        self.ops().complete(conn, lease, outcome, retention)
    }

    /// Releases a lease inside the caller's transaction.
    pub fn release_in(&self, conn: &Connection, lease: &Lease) -> Result<()> {
        self.ops().release(conn, lease)
    }

    /// Runs `f` with a connection of the handle's pool on the blocking pool. The
    /// wait for a free connection happens in async code, bounded by the busy
    /// timeout; the connection is opened on first use and returned after.
    async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &mut Connection) -> Result<T> + Send + 'static,
    {
        let timeout = self.inner.busy_timeout;
        let permit = tokio::time::timeout(timeout, Arc::clone(&self.inner.permits).acquire_owned())
            .await
            .map_err(|_| Error::Timeout {
                after: timeout,
                source: None,
            })?
            .map_err(|e| Error::backend("sqlite store closed", false, Some(Box::new(e) as _)))?;
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let idle = this
                .inner
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop();
            let mut conn = match idle {
                Some(conn) => conn,
                None => open_connection(&this.inner.path, timeout)?,
            };
            let result = with_busy_deadline(timeout, || f(&this.ops(), &mut conn));
            this.inner
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(conn);
            result
        })
        .await
        .map_err(|e| Error::backend("sqlite worker thread failed", false, Some(Box::new(e) as _)))?
    }

    /// Runs `f` in a `BEGIN IMMEDIATE` transaction on the blocking pool.
    async fn in_write_tx<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &Connection) -> Result<T> + Send + 'static,
    {
        self.with_conn(move |ops, conn| {
            let map = |e| crate::error::map(e, ops.busy_timeout);
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(map)?;
            let value = f(ops, &tx)?;
            tx.commit().map_err(map)?;
            Ok(value)
        })
        .await
    }
}

#[async_trait]
impl DedupeStore for SqliteStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        let (key, opts) = (key.clone(), opts.clone());
        self.in_write_tx(move |ops, conn| ops.claim(conn, &key, &opts))
            .await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.inner.caps.check_outcome(outcome)?;
        let (lease, outcome) = (lease.clone(), outcome.to_vec());
        self.with_conn(move |ops, conn| ops.complete(conn, &lease, &outcome, retention))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let lease = lease.clone();
        self.with_conn(move |ops, conn| ops.release(conn, &lease))
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let lease = lease.clone();
        self.with_conn(move |ops, conn| ops.extend(conn, &lease, ttl))
            .await
    }

    async fn expire(&self) -> Result<u64> {
        let now = to_millis(SystemTime::now());
        let mut removed = 0;
        loop {
            // One short transaction per batch, releasing the write lock between
            // batches so claims are never blocked for long.
            let n = self
                .with_conn(move |ops, conn| ops.expire_batch(conn, now))
                .await?;
            removed += n;
            if n < EXPIRE_BATCH as u64 {
                return Ok(removed);
            }
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let key = key.clone();
        self.with_conn(move |ops, conn| ops.get(conn, &key)).await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let key = key.clone();
        self.with_conn(move |ops, conn| ops.forget(conn, &key))
            .await
    }

    /// All claims of the batch in one `BEGIN IMMEDIATE` transaction, in order.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (keys, opts) = (keys.to_vec(), opts.clone());
        self.in_write_tx(move |ops, conn| {
            keys.iter().map(|key| ops.claim(conn, key, &opts)).collect()
        })
        .await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }
}
