//! The async store over one SQLite connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use dedupe_core::backend::{check_ttl, to_millis, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use rusqlite::{Connection, TransactionBehavior};

use crate::group::FileWriter;
use crate::ops::Ops;
use crate::sql::{Statements, EXPIRE_BATCH};
use crate::workers::{Slot, Workers};

/// Settings of a [`SqliteStore`]; build one with [`SqliteStore::builder`].
#[derive(Debug, Clone)]
pub struct SqliteBuilder {
    path: PathBuf,
    table: String,
    busy_timeout: Duration,
    max_outcome_bytes: usize,
    connections: usize,
    /// The temporary directory the file is in, when the store owns it.
    dir: Option<Arc<tempfile::TempDir>>,
}

impl SqliteBuilder {
    /// The file the store opens.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Connections this handle (and its clones) keeps open, each on a thread of
    /// its own (default 4). SQLite lets one writer in at a time whatever the
    /// count; more connections let reads (duplicates) run beside a write. The
    /// handle also opens as many read connections for reads on the caller's
    /// thread, and more (up to 32) when that many reads run at once, and one or
    /// two write connections for writes on the caller's thread. Writes that
    /// must wait go to one writer thread per file and process, with a
    /// connection of its own, shared by every handle (see the crate's README:
    /// group commit).
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

    /// How long a call waits for another connection's write lock, or in a
    /// queue for its turn, before it fails with a retryable [`Error::Timeout`]
    /// (default 5 s). The bound holds per step: a claim whose duplicate check
    /// could not run on the caller's thread waits up to this long for that read
    /// on a connection thread, then up to this long again for its write.
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
    /// table and index if they are missing. The work runs on the handle's own
    /// connection threads, never on the async runtime's.
    pub async fn open(self) -> Result<SqliteStore> {
        let sql = Statements::new(&self.table)?;
        if self.busy_timeout.is_zero() {
            return Err(Error::config("busy timeout must be above zero"));
        }
        if self.connections == 0 {
            return Err(Error::config("a store needs at least one connection"));
        }
        let settings = Arc::new(Settings {
            sql,
            writer: FileWriter::for_file(&self.path)?,
            path: self.path,
            busy_timeout: self.busy_timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
        });
        let workers = Workers::start(self.connections, &settings)?;
        let store = SqliteStore {
            inner: Arc::new(Inner {
                workers,
                settings,
                readers: Arc::new(Pool::default()),
                writers: Pool::default(),
                dir: self.dir,
            }),
        };
        // The first connection opens now, so a bad path or file fails here.
        store.migrate().await?;
        // Connections for reads on the caller's thread, opened on a connection
        // thread (opening may wait for a lock; the caller's thread never does).
        let (readers, path) = (self.connections, store.path().to_path_buf());
        let opened = store
            .with_conn(move |ops, _| {
                (0..readers)
                    .map(|_| crate::workers::open_reader(&path, ops.busy_timeout))
                    .collect::<Result<Vec<_>>>()
            })
            .await?;
        store
            .inner
            .readers
            .opened
            .store(opened.len(), std::sync::atomic::Ordering::Relaxed);
        *store.inner.readers.idle.lock() = opened;
        Ok(store)
    }
}

/// What every connection thread of a handle needs.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) sql: Statements,
    /// This process's writer to the file (its turn, and the thread that commits
    /// queued writes in groups), shared by its handles.
    pub(crate) writer: Arc<FileWriter>,
    pub(crate) path: PathBuf,
    pub(crate) busy_timeout: Duration,
    pub(crate) caps: Capabilities,
}

impl Settings {
    pub(crate) fn ops(&self) -> Ops<'_> {
        Ops {
            sql: &self.sql,
            busy_timeout: self.busy_timeout,
            caps: self.caps,
            writer: Some(self.writer.turn()),
        }
    }
}

#[derive(Debug)]
struct Inner {
    /// The handle's connection threads.
    workers: Workers,
    settings: Arc<Settings>,
    /// Connections for reads run on the caller's thread (see
    /// [`SqliteStore::read_in_place`]).
    readers: Arc<Pool>,
    /// Connections for writes run on the caller's thread (see
    /// [`SqliteStore::write_in_place`]).
    writers: Pool,
    /// The temporary directory the file is in, for a store that owns it:
    /// removed when the last handle onto it (clones, reopens) drops. Last, so
    /// the handle's connections close first.
    dir: Option<Arc<tempfile::TempDir>>,
}

/// Most read connections one handle opens.
const MAX_READERS: usize = 32;

/// Most connections one handle opens for writes on the caller's thread. Only the
/// holder of the process's writers' turn writes there, so one is enough; a second
/// covers a handle whose writes race the turn.
const MAX_WRITERS: usize = 2;

/// Connections a handle uses on its callers' threads. Read connections: as many
/// as its connection threads at first, more (up to [`MAX_READERS`]) when reads
/// running at once find none idle. Write connections: opened on first use, up
/// to [`MAX_WRITERS`].
#[derive(Debug, Default)]
struct Pool {
    /// The idle ones; a call takes one out while it runs.
    idle: parking_lot::Mutex<Vec<Connection>>,
    /// How many are open or being opened.
    opened: std::sync::atomic::AtomicUsize,
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
/// - **Duplicates read, never write**: a claim first reads the key outside any
///   write transaction; a live record (a duplicate, a claim in flight) answers it
///   without taking the write lock. Only a claim that may win takes the lock.
/// - **Runtime**: on Tokio's multi-thread runtime, calls that need not wait run
///   on the caller's thread inside `block_in_place` (the worker's other tasks
///   move to another thread first, so the runtime never waits on SQLite): reads
///   (the duplicate check of a claim, `get`) on a read connection, and writes
///   when the process's writers' turn is free and no other connection holds
///   SQLite's write lock. Neither ever waits for a lock there. Anywhere else,
///   for `forget()`, and for a read that would have to wait, the call goes to the
///   handle's connection threads, each owning a connection and fed by a queue
///   (one hand-off each way), which wait up to the busy timeout.
/// - **Group commit**: a write that would have to wait is queued for the
///   process's writer thread of the file, which commits every write queued
///   together in one transaction (a savepoint each, one fsync for all) and
///   answers each after the commit; a write that fails is undone alone.
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
            dir: None,
        }
    }

    /// Settings for a store on a file in a new temporary directory that the
    /// store owns: the directory and the file go when the last handle onto it
    /// (its clones, and the handles [`reopen`](Self::reopen) and
    /// [`rebuild`](Self::rebuild) open) is dropped. For tests, demos and
    /// `sqlite:` URLs without a path.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = dedupe_sqlite::SqliteStore::temporary()?.open().await?;
    /// let dir = store.path().parent().unwrap().to_path_buf();
    /// let other = store.reopen().await?;
    /// drop(store);
    /// assert!(dir.exists(), "another handle still uses it");
    /// drop(other);
    /// assert!(!dir.exists());
    /// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
    /// ```
    pub fn temporary() -> Result<SqliteBuilder> {
        let dir = tempfile::tempdir()
            .map_err(|e| Error::unavailable("a temporary directory", Some(Box::new(e))))?;
        let mut builder = Self::builder(dir.path().join("dedupe.db"));
        builder.dir = Some(Arc::new(dir));
        Ok(builder)
    }

    /// Opens the file at `path` with default settings.
    pub async fn open(path: impl Into<PathBuf>) -> Result<Self> {
        Self::builder(path).open().await
    }

    /// Another handle onto the same file with connections of its own.
    pub async fn reopen(&self) -> Result<Self> {
        self.rebuild().open().await
    }

    /// A builder with this handle's settings onto the same file (and, for a
    /// [`temporary`](Self::temporary) store, holding its directory too), to
    /// open another handle with some settings changed.
    pub fn rebuild(&self) -> SqliteBuilder {
        let settings = &self.inner.settings;
        let mut builder = Self::builder(&settings.path)
            .table(self.table_name())
            .busy_timeout(settings.busy_timeout)
            .max_outcome_bytes(settings.caps.max_outcome_bytes)
            .connections(self.inner.workers.threads());
        builder.dir = self.inner.dir.clone();
        builder
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.settings.path
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        self.inner.settings.sql.table()
    }

    /// Creates the table and its expiry index if they are missing. `open` calls it;
    /// it is safe to call again.
    pub async fn migrate(&self) -> Result<()> {
        self.with_conn(|ops, conn| {
            let _turn = ops.turn()?;
            conn.execute_batch(&ops.sql.create)
                .map_err(|e| crate::error::map(e, ops.busy_timeout))
        })
        .await
    }

    /// The statements for a caller's own transaction (no process turn: the
    /// caller's transaction already holds SQLite's write lock or waits for it).
    fn ops(&self) -> Ops<'_> {
        Ops {
            writer: None,
            ..self.inner.settings.ops()
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

    /// Runs a read on the calling thread, when that is allowed, instead of handing
    /// it to a connection thread and back: the two thread wake-ups of that
    /// hand-off are nearly all of what a duplicate costs (about 90 µs on a small
    /// VM, against 5-10 µs for the read itself).
    ///
    /// It runs only on Tokio's multi-thread runtime, inside
    /// [`tokio::task::block_in_place`], which first hands this worker thread's
    /// other tasks to another thread: the runtime is never kept waiting on SQLite.
    /// The read never waits for a lock either (see `open_reader`). `None` when the
    /// read cannot run here (another runtime, every read connection in use) or
    /// failed in any way: the caller then sends it to a connection thread, which
    /// waits for locks up to the busy timeout and reports errors as usual.
    fn read_in_place<T>(&self, read: impl FnOnce(&Ops<'_>, &Connection) -> Result<T>) -> Option<T> {
        if !on_multi_thread_runtime() {
            return None;
        }
        let Some(conn) = self.inner.readers.idle.lock().pop() else {
            self.open_another_reader();
            return None;
        };
        let answer = tokio::task::block_in_place(|| read(&self.inner.settings.ops(), &conn));
        self.inner.readers.idle.lock().push(conn);
        answer.ok()
    }

    /// Runs a write on the calling thread, when it need not wait for anything,
    /// instead of handing it to the writer thread and back (two thread
    /// wake-ups, most of what a lone write costs when the disk's fsync is fast).
    ///
    /// It is a second write path beside the writer thread's, kept because it
    /// pays for one task: on 2026-12-02, on this VM's disk, `dedupe bench
    /// --repeat 3` with every write sent to the writer thread instead gave one
    /// task 24% fewer claims (4,000 a second against 5,300), 22% fewer claims +
    /// completes (2,090 against 2,670) and 21% fewer batch keys (35,500
    /// against 45,000); at 16 tasks the two were level (writes queue for the
    /// writer thread there anyway).
    ///
    /// Like [`read_in_place`](Self::read_in_place) it runs only on Tokio's
    /// multi-thread runtime, inside [`tokio::task::block_in_place`] (the
    /// runtime's other tasks move to another thread first). It runs only when
    /// this process's writers' turn is free, and it never waits for SQLite's
    /// lock either: the caller's task is held for the write's own transaction
    /// and fsync, never for another writer, so a timeout or `select!` around the
    /// call still fires within about one commit. `None` when the write did not
    /// run here (another runtime, writes already queued, the turn taken,
    /// SQLite's lock held by another connection): nothing was written, and the
    /// caller queues it for the process's writer thread (`crate::group`), which
    /// waits up to the busy timeout and commits it with the writes queued
    /// beside it. Once the write has run, its
    /// answer is final, errors included: a write is never run twice.
    fn write_in_place<T>(
        &self,
        write: impl FnOnce(&Ops<'_>, &mut Connection) -> Result<T>,
    ) -> Option<Result<T>> {
        use std::sync::atomic::Ordering::Relaxed;
        if !on_multi_thread_runtime() {
            return None;
        }
        let settings = &self.inner.settings;
        // Writes waiting in the writer thread's queue go first. (A group the
        // thread has taken and that waits for the turn may still be passed: the
        // write here holds the turn for one commit at most.)
        if !settings.writer.queue_is_empty() {
            return None;
        }
        let _turn = settings.writer.turn().try_lock()?;
        let writers = &self.inner.writers;
        let idle = writers.idle.lock().pop();
        if idle.is_none()
            && writers
                .opened
                .fetch_update(Relaxed, Relaxed, |n| (n < MAX_WRITERS).then_some(n + 1))
                .is_err()
        {
            return None;
        }
        // The turn is held above, so the statements must not take it again.
        let ops = Ops {
            writer: None,
            ..settings.ops()
        };
        let answer = tokio::task::block_in_place(|| {
            // A deadline already passed: SQLite's busy handler gives up at once.
            crate::workers::with_busy_deadline(std::time::Instant::now(), || {
                let mut conn = match idle {
                    Some(conn) => conn,
                    None => {
                        match crate::workers::open_connection(&settings.path, settings.busy_timeout)
                        {
                            Ok(conn) => conn,
                            Err(e) => {
                                writers.opened.fetch_sub(1, Relaxed);
                                return Err(e);
                            }
                        }
                    }
                };
                let result = write(&ops, &mut conn);
                writers.idle.lock().push(conn);
                result
            })
        });
        match answer {
            // SQLite's lock was held by another connection: in WAL mode a write
            // meets it only when it begins (`BEGIN IMMEDIATE`, or a single
            // statement's first write), so nothing was written.
            Err(Error::Timeout { .. }) => None,
            answer => Some(answer),
        }
    }

    /// Asks a connection thread to open one more read connection, when reads
    /// found every one in use and the handle has fewer than [`MAX_READERS`].
    /// Nobody waits for it: the read that asked goes to a connection thread.
    fn open_another_reader(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let readers = Arc::clone(&self.inner.readers);
        if readers
            .opened
            .fetch_update(Relaxed, Relaxed, |n| (n < MAX_READERS).then_some(n + 1))
            .is_err()
        {
            return;
        }
        let path = self.path().to_path_buf();
        let asked = self.inner.workers.spawn(move |slot: &mut Slot| {
            match crate::workers::open_reader(&path, slot.settings.busy_timeout) {
                Ok(conn) => readers.idle.lock().push(conn),
                Err(_) => {
                    readers.opened.fetch_sub(1, Relaxed);
                }
            }
        });
        if !asked {
            self.inner.readers.opened.fetch_sub(1, Relaxed);
        }
    }

    /// Runs `f` on one of the handle's connection threads.
    async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &mut Connection) -> Result<T> + Send + 'static,
    {
        self.inner
            .workers
            .run(self.inner.settings.busy_timeout, move |slot: &mut Slot| {
                let settings = Arc::clone(&slot.settings);
                f(&settings.ops(), slot.conn()?)
            })
            .await
    }
}

impl SqliteStore {
    /// Writes ever queued for this process's writer thread of the file, and
    /// those waiting in its queue now.
    #[cfg(test)]
    pub(crate) fn queued_writes(&self) -> (usize, usize) {
        self.inner.settings.writer.queued()
    }

    /// Queues a write for this process's writer thread, which commits the
    /// writes queued together in one transaction (see `group`), and waits for
    /// its answer.
    /// `keys`: how many keys the write claims (one for a single-key write).
    pub(crate) async fn write<T, F>(&self, keys: usize, write: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &Connection) -> Result<T> + Send + 'static,
    {
        let settings = &self.inner.settings;
        settings.writer.run(settings, keys, write).await
    }
}

/// Whether this thread runs Tokio's multi-thread runtime, the only one where
/// `block_in_place` may run a call on the caller's thread.
fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Runs `f` in a `BEGIN IMMEDIATE` transaction on `conn`.
fn write_tx<T>(
    ops: &Ops<'_>,
    conn: &mut Connection,
    f: impl FnOnce(&Ops<'_>, &Connection) -> Result<T>,
) -> Result<T> {
    let _turn = ops.turn()?;
    let map = |e| crate::error::map(e, ops.busy_timeout);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(map)?;
    let value = f(ops, &tx)?;
    tx.commit().map_err(map)?;
    Ok(value)
}

#[async_trait]
impl DedupeStore for SqliteStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        // A live record answers from a plain read; only a claim that may win
        // takes the write lock (and decides again under it).
        let read = match self.read_in_place(|ops, conn| ops.answer_if_live(conn, key, opts)) {
            Some(Some(answer)) => return Ok(answer),
            Some(None) => true,
            None => false,
        };
        let claim = move |ops: &Ops<'_>, conn: &mut Connection, key: &Key, opts: &ClaimOptions| {
            if !read {
                if let Some(answer) = ops.answer_if_live(conn, key, opts)? {
                    return Ok(answer);
                }
            }
            write_tx(ops, conn, |ops, tx| ops.claim(tx, key, opts))
        };
        if let Some(answer) = self.write_in_place(|ops, conn| claim(ops, conn, key, opts)) {
            return answer;
        }
        let (key, opts) = (key.clone(), opts.clone());
        if !read {
            let (key, opts) = (key.clone(), opts.clone());
            let live = self
                .with_conn(move |ops, conn| ops.answer_if_live(conn, &key, &opts))
                .await?;
            if let Some(answer) = live {
                return Ok(answer);
            }
        }
        self.write(1, move |ops, conn| ops.claim(conn, &key, &opts))
            .await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.inner.settings.caps.check_outcome(outcome)?;
        if let Some(answer) =
            self.write_in_place(|ops, conn| ops.complete(conn, lease, outcome, retention))
        {
            return answer;
        }
        let (lease, outcome) = (lease.clone(), outcome.to_vec());
        self.write(1, move |ops, conn| {
            ops.complete(conn, &lease, &outcome, retention)
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        if let Some(answer) = self.write_in_place(|ops, conn| ops.release(conn, lease)) {
            return answer;
        }
        let lease = lease.clone();
        self.write(1, move |ops, conn| ops.release(conn, &lease))
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        if let Some(answer) = self.write_in_place(|ops, conn| ops.extend(conn, lease, ttl)) {
            return answer;
        }
        let lease = lease.clone();
        self.write(1, move |ops, conn| ops.extend(conn, &lease, ttl))
            .await
    }

    async fn expire(&self) -> Result<u64> {
        let now = to_millis(SystemTime::now());
        let mut removed = 0;
        loop {
            // One batch at a time through the writer thread: each joins the
            // group of the writes queued beside it (one commit for all), and
            // the writes queued while it runs go in the next group, before the
            // next batch, so claims are never blocked for long.
            let n = self
                .write(EXPIRE_BATCH.unsigned_abs() as usize, move |ops, conn| {
                    ops.expire_batch(conn, now)
                })
                .await?;
            removed += n;
            if n < EXPIRE_BATCH as u64 {
                return Ok(removed);
            }
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        if let Some(record) = self.read_in_place(|ops, conn| ops.get(conn, key)) {
            return Ok(record);
        }
        let key = key.clone();
        self.with_conn(move |ops, conn| ops.get(conn, &key)).await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let key = key.clone();
        self.with_conn(move |ops, conn| {
            let _turn = ops.turn()?;
            ops.forget(conn, &key)
        })
        .await
    }

    /// All claims of the batch in one `BEGIN IMMEDIATE` transaction, in order.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // Each distinct key is claimed once; a repeat is answered as the claim
        // right after its first place (`BatchKeys`), as every store answers it,
        // not claimed again: a second read could see the record changed by
        // another process in between (the first place InFlight, the second
        // Duplicate), and a second claim in a batch that outlasts its lease
        // would take over the first place's own lease.
        let batch = BatchKeys::new(keys);
        let distinct: Vec<Key> = batch.distinct().iter().map(|k| (*k).clone()).collect();
        let answers = self.claim_distinct(&distinct, opts).await?;
        batch.answers(answers, opts)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.settings.caps
    }
}

impl SqliteStore {
    /// Claims distinct keys, answering in their order.
    async fn claim_distinct(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        // A batch of live records (a redelivered batch) is answered by reads.
        let all_live = |ops: &Ops<'_>, conn: &Connection, keys: &[Key], opts: &ClaimOptions| {
            let mut answers = Vec::with_capacity(keys.len());
            for key in keys {
                match ops.answer_if_live(conn, key, opts)? {
                    Some(answer) => answers.push(answer),
                    None => return Ok(None),
                }
            }
            Ok(Some(answers))
        };
        let read = match self.read_in_place(|ops, conn| all_live(ops, conn, keys, opts)) {
            Some(Some(answers)) => return Ok(answers),
            Some(None) => true,
            None => false,
        };
        let claim_all =
            move |ops: &Ops<'_>, conn: &mut Connection, keys: &[Key], opts: &ClaimOptions| {
                if !read {
                    if let Some(answers) = all_live(ops, conn, keys, opts)? {
                        return Ok(answers);
                    }
                }
                write_tx(ops, conn, |ops, tx| {
                    keys.iter().map(|key| ops.claim(tx, key, opts)).collect()
                })
            };
        if let Some(answers) = self.write_in_place(|ops, conn| claim_all(ops, conn, keys, opts)) {
            return answers;
        }
        let (keys, opts) = (keys.to_vec(), opts.clone());
        if !read {
            let (keys, opts) = (keys.clone(), opts.clone());
            let live = self
                .with_conn(move |ops, conn| all_live(ops, conn, &keys, &opts))
                .await?;
            if let Some(answers) = live {
                return Ok(answers);
            }
        }
        // Its savepoint in the group's transaction makes the batch all or nothing.
        self.write(keys.len(), move |ops, conn| {
            keys.iter().map(|key| ops.claim(conn, key, &opts)).collect()
        })
        .await
    }
}
