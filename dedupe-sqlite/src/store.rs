//! The async store over one SQLite connection.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use dedupe_core::backend::{check_ttl, to_millis, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Key, Lease, Record, Result,
};
use rusqlite::{Connection, TransactionBehavior};

pub use crate::builder::SqliteBuilder;
use crate::conn::Conns;
use crate::ops::Ops;
use crate::sql::EXPIRE_BATCH;

#[derive(Debug)]
struct Inner {
    /// Where its calls run.
    conns: Conns,
    /// Raised when an inbox item becomes due now (accepted, given back,
    /// replayed, its namespace resumed), for the workers on this handle and
    /// its clones (a handle opened apart, or another process, polls).
    wakeups: dedupe_core::backend::Wakeups,
    /// The temporary directory the file is in, for a store that owns it:
    /// removed when the last handle onto it (clones, reopens) drops. Last, so
    /// the handle's connections close first.
    dir: Option<Arc<tempfile::TempDir>>,
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
///   (default 4, see [`SqliteBuilder::connection_threads`]); clones share it, and each
///   `open` or [`reopen`](SqliteStore::reopen) is a handle with a pool of its own.
///   The file is in WAL mode with a busy timeout, so connections in other threads
///   and processes wait for the write lock rather than fail; past the timeout the
///   error is a retryable [`Error::Timeout`](dedupe_core::Error::Timeout).
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
    pub(crate) fn from_parts(conns: Conns, dir: Option<Arc<tempfile::TempDir>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                conns,
                wakeups: Default::default(),
                dir,
            }),
        }
    }

    /// The wake-ups of this handle's workers.
    pub(crate) fn wakeups(&self) -> &dedupe_core::backend::Wakeups {
        &self.inner.wakeups
    }

    /// Where this handle's calls run.
    pub(crate) fn conns(&self) -> &Conns {
        &self.inner.conns
    }

    /// Writes ever queued for this process's writer thread of the file, and
    /// those waiting in its queue now.
    #[cfg(test)]
    pub(crate) fn queued_writes(&self) -> (usize, usize) {
        self.conns().queued_writes()
    }

    /// Default table name.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";
    /// Default number of connections per handle.
    pub const DEFAULT_CONNECTION_THREADS: usize = 4;
    /// Default busy timeout.
    pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// Another handle onto the same file with connections of its own.
    pub async fn reopen(&self) -> Result<Self> {
        self.rebuild().open().await
    }

    /// A builder with this handle's settings onto the same file (and, for a
    /// [`temporary`](Self::temporary) store, holding its directory too), to
    /// open another handle with some settings changed.
    pub fn rebuild(&self) -> SqliteBuilder {
        let settings = &self.conns().settings();
        let mut builder = Self::builder(&settings.path)
            .table(self.table_name())
            .busy_timeout(settings.busy_timeout)
            .max_outcome_bytes(settings.caps.max_outcome_bytes)
            .connection_threads(self.conns().threads());
        builder.dir = self.inner.dir.clone();
        builder
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.conns().settings().path
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        self.conns().settings().sql.table()
    }

    /// Creates the table and its indexes if they are missing, and adds the
    /// inbox's columns to a table made before them (the numbered files of
    /// `migrations/`, in order: `payload`, `wait`, `last_error`, nullable,
    /// as existing rows are records, not items; then `takeovers` and
    /// `max_attempts`).
    /// `open` calls it; it is safe to call again, from any number of
    /// processes (one `BEGIN IMMEDIATE` transaction).
    pub async fn migrate(&self) -> Result<()> {
        self.conns()
            .with_conn(|ops, conn| {
                let _turn = ops.turn()?;
                let map = |e| crate::error::map(e, ops.busy_timeout);
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(map)?;
                tx.execute_batch(&ops.sql.records).map_err(map)?;
                let columns = tx
                    .prepare(&ops.sql.columns)
                    .and_then(|mut stmt| {
                        stmt.query_map([], |row| row.get::<_, String>(0))?
                            .collect::<rusqlite::Result<Vec<String>>>()
                    })
                    .map_err(map)?;
                if !columns.iter().any(|c| c == "wait") {
                    tx.execute_batch(&ops.sql.inbox_columns).map_err(map)?;
                }
                tx.execute_batch(&ops.sql.indexes).map_err(map)?;
                if !columns.iter().any(|c| c == "takeovers") {
                    tx.execute_batch(&ops.sql.item_counts).map_err(map)?;
                }
                tx.execute_batch(&ops.sql.paused_table).map_err(map)?;
                if !columns.iter().any(|c| c == "order_key") {
                    tx.execute_batch(&ops.sql.ordering).map_err(map)?;
                }
                if !columns.iter().any(|c| c == "dead_until") {
                    tx.execute_batch(&ops.sql.dead_retention).map_err(map)?;
                }
                if !columns.iter().any(|c| c == "errors") {
                    tx.execute_batch(&ops.sql.error_history).map_err(map)?;
                }
                if !columns.iter().any(|c| c == "order_head") {
                    tx.execute_batch(&ops.sql.order_park).map_err(map)?;
                }
                tx.commit().map_err(map)
            })
            .await
    }

    /// The statements for a caller's own transaction (no process turn: the
    /// caller's transaction already holds SQLite's write lock or waits for it).
    pub(crate) fn ops(&self) -> Ops<'_> {
        Ops {
            writer: None,
            ..self.conns().settings().ops()
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
        let read = match self
            .conns()
            .read_in_place(|ops, conn| ops.answer_if_live(conn, key, opts))
        {
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
        if let Some(answer) = self
            .conns()
            .write_in_place(|ops, conn| claim(ops, conn, key, opts))
        {
            return answer;
        }
        let (key, opts) = (key.clone(), opts.clone());
        if !read {
            let (key, opts) = (key.clone(), opts.clone());
            let live = self
                .conns()
                .with_conn(move |ops, conn| ops.answer_if_live(conn, &key, &opts))
                .await?;
            if let Some(answer) = live {
                return Ok(answer);
            }
        }
        self.conns()
            .write(1, move |ops, conn| ops.claim(conn, &key, &opts))
            .await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.conns().settings().caps.check_outcome(outcome)?;
        if let Some(answer) = self
            .conns()
            .write_in_place(|ops, conn| ops.complete(conn, lease, outcome, retention))
        {
            return answer;
        }
        let (lease, outcome) = (lease.clone(), outcome.to_vec());
        self.conns()
            .write(1, move |ops, conn| {
                ops.complete(conn, &lease, &outcome, retention)
            })
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let answer = match self
            .conns()
            .write_in_place(|ops, conn| ops.release(conn, lease))
        {
            Some(answer) => answer,
            None => {
                let lease = lease.clone();
                self.conns()
                    .write(1, move |ops, conn| ops.release(conn, &lease))
                    .await
            }
        };
        if answer.is_ok() {
            // A held item given back is due now (a claim's release wakes
            // no one: no worker waits on its namespace, or one looks for
            // nothing).
            self.wakeups().raise(lease.key.namespace());
        }
        answer
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        if let Some(answer) = self
            .conns()
            .write_in_place(|ops, conn| ops.extend(conn, lease, ttl))
        {
            return answer;
        }
        let lease = lease.clone();
        self.conns()
            .write(1, move |ops, conn| ops.extend(conn, &lease, ttl))
            .await
    }

    async fn expire(&self) -> Result<u64> {
        let now = to_millis(SystemTime::now());
        let mut removed = 0;
        // Records past their deadline, then dead items past their retention
        // (I16), each through its own index.
        for dead in [false, true] {
            loop {
                // One batch at a time through the writer thread: each joins the
                // group of the writes queued beside it (one commit for all), and
                // the writes queued while it runs go in the next group, before the
                // next batch, so claims are never blocked for long.
                let n = self
                    .conns()
                    .write(EXPIRE_BATCH.unsigned_abs() as usize, move |ops, conn| {
                        ops.expire_batch(conn, now, dead)
                    })
                    .await?;
                removed += n;
                if n < EXPIRE_BATCH as u64 {
                    break;
                }
            }
        }
        Ok(removed)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        if let Some(record) = self.conns().read_in_place(|ops, conn| ops.get(conn, key)) {
            return Ok(record);
        }
        let key = key.clone();
        self.conns()
            .with_conn(move |ops, conn| ops.get(conn, &key))
            .await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let key = key.clone();
        self.conns()
            .with_conn(move |ops, conn| {
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
        self.conns().settings().caps
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
        let read = match self
            .conns()
            .read_in_place(|ops, conn| all_live(ops, conn, keys, opts))
        {
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
        if let Some(answers) = self
            .conns()
            .write_in_place(|ops, conn| claim_all(ops, conn, keys, opts))
        {
            return answers;
        }
        let (keys, opts) = (keys.to_vec(), opts.clone());
        if !read {
            let (keys, opts) = (keys.clone(), opts.clone());
            let live = self
                .conns()
                .with_conn(move |ops, conn| all_live(ops, conn, &keys, &opts))
                .await?;
            if let Some(answers) = live {
                return Ok(answers);
            }
        }
        // Its savepoint in the group's transaction makes the batch all or nothing.
        self.conns()
            .write(keys.len(), move |ops, conn| {
                keys.iter().map(|key| ops.claim(conn, key, &opts)).collect()
            })
            .await
    }
}
