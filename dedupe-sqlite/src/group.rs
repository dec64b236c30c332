//! Group commit: the writes of one process to one file that queue up while
//! another write runs are committed together, in one transaction and one fsync.
//!
//! Every handle of a process on a file shares one [`FileWriter`]: the process's
//! turn to write (a lock that keeps its own writers from polling SQLite's lock
//! against each other) and a thread owning a write connection, fed by a queue.
//! A write that need not wait runs on its caller's thread (see
//! `Conns::write_in_place` in `conn`); a write that would wait is queued here
//! instead. The thread takes every queued write at once (at most
//! [`MAX_GROUP`] writes, and it stops taking more once they hold
//! [`MAX_GROUP_KEYS`] keys), runs each in a savepoint of one `BEGIN IMMEDIATE`
//! transaction, commits once, and only then answers each: a write is answered
//! after its commit is durable, as before, and with 16 writers waiting the disk
//! syncs once for all of them instead of 16 times.
//!
//! - A write that fails rolls back to its savepoint: its caller gets its error,
//!   nothing of it is written, and the others of the group go on.
//! - If the transaction itself fails (its commit, or an error after which
//!   SQLite rolled the whole transaction back), every write of the group gets
//!   an error naming the cause, none of them was written, and the thread opens
//!   a new connection for the next group.
//! - Writes run in the order they were queued, so two claims of one key in one
//!   group have one winner: the second sees the first's record, live.
//! - A write whose caller has gone (its future was dropped) is skipped before
//!   it starts. While the thread waits for the turn or for SQLite's lock, it
//!   wakes every [`WAIT_SLICE`] to take newly queued writes into the group and
//!   to answer [`Error::Timeout`], without running, each write whose deadline
//!   (its handle's busy timeout, counted from the call) has passed: a write is
//!   answered within about its busy timeout even when it shares the file with
//!   handles whose timeouts are longer.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dedupe_core::{Error, Result};
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::ops::{Ops, Settings};

/// Most writes committed in one transaction.
pub(crate) const MAX_GROUP: usize = 128;

/// Keys (a claim is one, a batch as many as it claims) after which the thread
/// takes no more writes into a group, so one group holds SQLite's lock briefly.
pub(crate) const MAX_GROUP_KEYS: usize = 1024;

/// How long the thread waits for a lock before it looks at the queue and the
/// deadlines again.
pub(crate) const WAIT_SLICE: Duration = Duration::from_millis(10);

/// The writers of one process to one file: their turn, and the thread that runs
/// the writes that had to wait, in groups.
#[derive(Debug)]
pub(crate) struct FileWriter {
    turn: Arc<parking_lot::Mutex<()>>,
    queue: Sender<Box<dyn Write>>,
    /// Writes ever queued (so a test knows when the thread has taken one).
    #[cfg(test)]
    sent: std::sync::atomic::AtomicUsize,
}

impl FileWriter {
    /// The writer of this process for the file at `path` (by its canonical
    /// directory and name, so two spellings of one path share it), started now if
    /// no handle has it open. Its thread ends when the last handle is dropped.
    pub(crate) fn for_file(path: &Path) -> Result<Arc<FileWriter>> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock, Weak};
        type Registry = Mutex<HashMap<PathBuf, Weak<FileWriter>>>;
        static WRITERS: OnceLock<Registry> = OnceLock::new();
        let canonical = match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) => {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                dir.canonicalize()
                    .map(|d| d.join(name))
                    .unwrap_or_else(|_| path.to_path_buf())
            }
            _ => path.to_path_buf(),
        };
        let mut writers = WRITERS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        writers.retain(|_, w| w.strong_count() > 0);
        if let Some(writer) = writers.get(&canonical).and_then(Weak::upgrade) {
            return Ok(writer);
        }
        // The thread opens the canonical path: a later change of the process's
        // working directory cannot move its writes to another file.
        let writer = Arc::new(FileWriter::start(canonical.clone())?);
        writers.insert(canonical, Arc::downgrade(&writer));
        Ok(writer)
    }

    fn start(path: PathBuf) -> Result<Self> {
        let (queue, writes) = crossbeam_channel::unbounded();
        let turn = Arc::new(parking_lot::Mutex::new(()));
        let thread_turn = Arc::clone(&turn);
        std::thread::Builder::new()
            .name("dedupe-sqlite-writer".into())
            .spawn(move || serve(&path, &thread_turn, &writes))
            .map_err(|e| {
                Error::fatal(
                    "could not start the sqlite writer thread",
                    Some(Box::new(e) as _),
                )
            })?;
        Ok(Self {
            turn,
            queue,
            #[cfg(test)]
            sent: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// This process's turn to write to the file. Whoever holds it is the only
    /// writer of the process; other processes still meet it at SQLite's lock.
    pub(crate) fn turn(&self) -> &Arc<parking_lot::Mutex<()>> {
        &self.turn
    }

    /// Whether no write is queued for the writer thread (a write may then run
    /// on its caller's thread without passing the queued ones).
    pub(crate) fn queue_is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// How many writes were ever queued, and how many wait in the queue now
    /// (the others the thread has taken).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> (usize, usize) {
        let sent = self.sent.load(std::sync::atomic::Ordering::SeqCst);
        (sent, self.queue.len())
    }

    /// Queues `write` (which claims `keys` keys) for the writer thread and
    /// waits, without blocking the runtime, for its answer, which comes once its
    /// group has committed.
    pub(crate) async fn run<T, F>(
        &self,
        settings: &Arc<Settings>,
        keys: usize,
        write: F,
    ) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &Connection) -> Result<T> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            deadline: Instant::now() + settings.busy_timeout,
            keys,
            settings: Arc::clone(settings),
            write,
            answer,
        };
        #[cfg(test)]
        self.sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.queue
            .send(Box::new(pending))
            .map_err(|_| Error::fatal("the sqlite writer thread stopped", None))?;
        answered.await.map_err(|_| {
            Error::fatal(
                "the sqlite writer thread did not answer this write (it panicked)",
                None,
            )
        })?
    }
}

/// Makes the error each write of a failed group is answered with, given the
/// busy timeout of the write's handle.
type GroupError<'a> = &'a dyn Fn(Duration) -> Error;

/// Sends a write's answer once its group's fate is known: `None` when the group
/// committed, else the group's error.
type Finish = Box<dyn FnOnce(Option<GroupError<'_>>) + Send>;

/// A write that ran inside the group's transaction.
struct Ran {
    /// Why it failed (it is then rolled back), if it did.
    failed: Option<String>,
    finish: Finish,
}

/// One queued write, whatever it answers.
trait Write: Send {
    /// When the write stops waiting to begin.
    fn deadline(&self) -> Instant;
    /// How many keys it claims (at least one).
    fn keys(&self) -> usize;
    /// Whether its caller has gone.
    fn gone(&self) -> bool;
    /// Answers without running.
    fn refuse(self: Box<Self>, error: GroupError<'_>);
    /// Runs the write inside the group's transaction; its answer waits for the
    /// commit.
    fn run(self: Box<Self>, conn: &Connection) -> Ran;
}

struct Pending<T, F> {
    deadline: Instant,
    keys: usize,
    settings: Arc<Settings>,
    write: F,
    answer: oneshot::Sender<Result<T>>,
}

impl<T, F> Write for Pending<T, F>
where
    T: Send + 'static,
    F: FnOnce(&Ops<'_>, &Connection) -> Result<T> + Send + 'static,
{
    fn deadline(&self) -> Instant {
        self.deadline
    }

    fn keys(&self) -> usize {
        self.keys.max(1)
    }

    fn gone(&self) -> bool {
        self.answer.is_closed()
    }

    fn refuse(self: Box<Self>, error: GroupError<'_>) {
        let _ = self.answer.send(Err(error(self.settings.busy_timeout)));
    }

    fn run(self: Box<Self>, conn: &Connection) -> Ran {
        let Pending {
            settings,
            write,
            answer,
            ..
        } = *self;
        // The writer thread holds the process's turn for the whole group.
        let ops = Ops {
            writer: None,
            ..settings.ops()
        };
        let result = write(&ops, conn);
        let busy_timeout = settings.busy_timeout;
        let failed = result.as_ref().err().map(error_chain);
        let finish: Finish = Box::new(move |group_failed: Option<GroupError<'_>>| {
            let result = match (result, group_failed) {
                (Ok(_), Some(error)) => Err(error(busy_timeout)),
                (result, _) => result,
            };
            let _ = answer.send(result);
        });
        Ran { failed, finish }
    }
}

/// An error and its sources, on one line.
fn error_chain(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The writer thread: takes every queued write at once and runs them as one
/// group, until the last handle on the file is dropped.
fn serve(path: &Path, turn: &parking_lot::Mutex<()>, writes: &Receiver<Box<dyn Write>>) {
    let mut conn: Option<Connection> = None;
    while let Ok(first) = writes.recv() {
        let mut group = vec![first];
        take_queued(&mut group, writes);
        run_group(path, turn, &mut conn, group, writes);
    }
}

/// Adds queued writes to `group` until it is full.
fn take_queued(group: &mut Vec<Box<dyn Write>>, writes: &Receiver<Box<dyn Write>>) {
    let mut keys: usize = group.iter().map(|w| w.keys()).sum();
    while group.len() < MAX_GROUP && keys < MAX_GROUP_KEYS {
        match writes.try_recv() {
            Ok(write) => {
                keys += write.keys();
                group.push(write);
            }
            Err(_) => break,
        }
    }
}

/// What became of a group.
enum Outcome {
    /// Every write was answered.
    Done,
    /// Every write was answered with an error, and the connection may be in a
    /// state no later group should meet: it is closed.
    Broken,
    /// SQLite's lock (or the file, to open it) stayed with another connection
    /// past the wait: the group, untouched, and SQLite's answer.
    Waiting(Vec<Box<dyn Write>>, Arc<rusqlite::Error>),
}

/// Runs `group` in one transaction. While the turn or SQLite's lock is taken,
/// it waits in slices of [`WAIT_SLICE`]; between slices it answers `Timeout`
/// to the writes past their deadline and takes newly queued writes in.
fn run_group(
    path: &Path,
    turn: &parking_lot::Mutex<()>,
    conn: &mut Option<Connection>,
    mut group: Vec<Box<dyn Write>>,
    writes: &Receiver<Box<dyn Write>>,
) {
    // SQLite's answer the last time the lock could not be taken, for the writes
    // that time out waiting for it.
    let mut busy: Option<Arc<rusqlite::Error>> = None;
    loop {
        let now = Instant::now();
        let mut kept = Vec::with_capacity(group.len());
        for write in group {
            if write.gone() {
                continue; // nobody waits for it: do nothing on its behalf
            }
            if write.deadline() <= now {
                write.refuse(&|after| match &busy {
                    Some(e) => crate::error::map_shared(e, after),
                    None => Error::timeout(after),
                });
            } else {
                kept.push(write);
            }
        }
        group = kept;
        let Some(deadline) = group.iter().map(|w| w.deadline()).min() else {
            return;
        };
        let until = deadline.min(now + WAIT_SLICE);
        let Some(held) = turn.try_lock_until(until) else {
            // The turn stayed with another writer of this process.
            take_queued(&mut group, writes);
            continue;
        };
        let outcome = crate::workers::with_busy_deadline(until, || commit_group(path, conn, group));
        drop(held);
        match outcome {
            Outcome::Done => return,
            Outcome::Broken => {
                *conn = None;
                return;
            }
            Outcome::Waiting(waiting, e) => {
                busy = Some(e);
                group = waiting;
                take_queued(&mut group, writes);
            }
        }
    }
}

/// Opens the connection if needed, begins, runs every write, commits, answers.
fn commit_group(path: &Path, conn: &mut Option<Connection>, group: Vec<Box<dyn Write>>) -> Outcome {
    // A connection left inside a transaction (a rollback that failed) would
    // answer every later group with an error: start again on a new one.
    if conn.as_ref().is_some_and(|c| !c.is_autocommit()) {
        *conn = None;
    }
    if conn.is_none() {
        match crate::workers::open_write_connection(path) {
            Ok(opened) => {
                opened.set_prepared_statement_cache_capacity(64);
                *conn = Some(opened);
            }
            Err(e) if is_busy(&e) => return Outcome::Waiting(group, Arc::new(e)),
            Err(e) => {
                refuse_all(group, &Arc::new(e));
                return Outcome::Broken;
            }
        }
    }
    let Some(conn) = conn.as_ref() else {
        return Outcome::Broken; // set just above
    };
    if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
        if is_busy(&e) {
            return Outcome::Waiting(group, Arc::new(e));
        }
        refuse_all(group, &Arc::new(e));
        return Outcome::Broken;
    }
    let many = group.len() > 1;
    let mut finished: Vec<Finish> = Vec::with_capacity(group.len());
    let mut group = group.into_iter();
    while let Some(write) = group.next() {
        if write.gone() {
            continue;
        }
        if many {
            if let Err(e) = savepoint(conn, "SAVEPOINT dedupe_write") {
                let rest = std::iter::once(write).chain(group).collect();
                return abort(conn, finished, rest, &Arc::new(e));
            }
        }
        // A write that panics is answered with an error (its answer channel is
        // dropped) and undone like a failed one; the thread goes on.
        let (failed, finish) = match std::panic::catch_unwind(AssertUnwindSafe(|| write.run(conn)))
        {
            Ok(Ran { failed, finish }) => (failed, Some(finish)),
            Err(_) => (Some("a write panicked".to_string()), None),
        };
        finished.extend(finish);
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (disk full, I/O error):
            // nothing of the group is written.
            let cause = failed.unwrap_or_else(|| "unknown".into());
            let e = Arc::new(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                Some(format!(
                    "the group's transaction was rolled back by one of its writes ({cause})"
                )),
            ));
            return abort(conn, finished, group.collect(), &e);
        }
        let undone = match (many, failed.is_some()) {
            (true, true) => savepoint(conn, "ROLLBACK TO dedupe_write")
                .and_then(|()| savepoint(conn, "RELEASE dedupe_write")),
            (true, false) => savepoint(conn, "RELEASE dedupe_write"),
            // A lone write that failed: the whole transaction is undone below.
            (false, _) => Ok(()),
        };
        if let Err(e) = undone {
            return abort(conn, finished, group.collect(), &Arc::new(e));
        }
        if !many && failed.is_some() {
            if let Err(e) = conn.execute_batch("ROLLBACK") {
                return abort(conn, finished, Vec::new(), &Arc::new(e));
            }
            // Its own error is its answer; nothing was written.
            finished.into_iter().for_each(|finish| finish(None));
            return Outcome::Done;
        }
    }
    match conn.execute_batch("COMMIT") {
        Ok(()) => {
            finished.into_iter().for_each(|finish| finish(None));
            Outcome::Done
        }
        Err(e) => abort(conn, finished, Vec::new(), &Arc::new(e)),
    }
}

/// Runs one of the fixed savepoint statements.
fn savepoint(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(drop)
}

pub(crate) fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// Rolls the group's transaction back and answers every write with `e`: those
/// that ran (`finished`; one whose own write failed keeps its own error) and
/// those that had not yet (`rest`). The connection is not used again.
fn abort(
    conn: &Connection,
    finished: Vec<Finish>,
    rest: Vec<Box<dyn Write>>,
    e: &Arc<rusqlite::Error>,
) -> Outcome {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    let error = |after| crate::error::map_shared(e, after);
    finished.into_iter().for_each(|finish| finish(Some(&error)));
    refuse_all(rest, e);
    Outcome::Broken
}

fn refuse_all(group: Vec<Box<dyn Write>>, e: &Arc<rusqlite::Error>) {
    for write in group {
        write.refuse(&|after| crate::error::map_shared(e, after));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key};
    use rusqlite::{Connection, TransactionBehavior};

    use crate::SqliteStore;

    fn key(id: &str) -> Key {
        Key::new("group", id).expect("key")
    }

    /// Waits until `n` writes were queued in all and the writer thread has
    /// taken every one of them: while the test holds the write lock they are
    /// all in the one group that waits for it, in the order they were queued.
    async fn until_taken(store: &SqliteStore, n: usize) {
        let give_up = std::time::Instant::now() + Duration::from_secs(20);
        while store.queued_writes() != (n, 0) {
            assert!(
                std::time::Instant::now() < give_up,
                "(queued in all, waiting in the queue) is {:?}, not ({n}, 0)",
                store.queued_writes()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Bytes in the file's write-ahead log.
    fn wal_bytes(db: &std::path::Path) -> u64 {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        std::fs::metadata(wal).map_or(0, |m| m.len())
    }

    /// Writes that queued while another connection held the lock are committed
    /// together: 32 claims add far fewer log frames than 32 commits would (each
    /// commit writes at least the table's page), and every one of them wins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_writes_commit_together() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("group.db");
        let store = SqliteStore::builder(&db)
            .busy_timeout(Duration::from_secs(20))
            .open()
            .await
            .expect("open");
        let page: i64 = {
            let conn = Connection::open(&db).expect("open");
            conn.pragma_query_value(None, "page_size", |row| row.get(0))
                .expect("page size")
        };
        let before = wal_bytes(&db);
        let mut blocker = Connection::open(&db).expect("open");
        let tx = blocker
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .expect("take the write lock");
        let claims: Vec<_> = (0..32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .claim(&key(&format!("evt_{i}")), &ClaimOptions::default())
                        .await
                })
            })
            .collect();
        until_taken(&store, 32).await;
        tx.rollback().expect("unlock");
        for claim in claims {
            let answer = claim.await.expect("task");
            assert!(
                matches!(answer, Ok(ClaimOutcome::Claimed(_))),
                "a fresh key answered {answer:?}"
            );
        }
        let frames = (wal_bytes(&db) - before) / (page.unsigned_abs() + 24);
        assert!(
            frames < 32,
            "32 claims wrote {frames} log frames: they were not committed together"
        );
        for i in 0..32 {
            assert!(store
                .get(&key(&format!("evt_{i}")))
                .await
                .expect("get")
                .is_some());
        }
    }

    /// Spawns a claim of `id` on `store`.
    fn spawn_claim(
        store: &SqliteStore,
        id: &'static str,
    ) -> tokio::task::JoinHandle<dedupe_core::Result<ClaimOutcome>> {
        let store = store.clone();
        tokio::spawn(async move { store.claim(&key(id), &ClaimOptions::default()).await })
    }

    /// A store on `db` waiting up to 20 s for locks, and another connection
    /// (taken by the test before it holds the write lock).
    async fn store_and_blocker(db: &std::path::Path) -> (SqliteStore, Connection) {
        let store = SqliteStore::builder(db)
            .busy_timeout(Duration::from_secs(20))
            .open()
            .await
            .expect("open");
        (store, Connection::open(db).expect("open"))
    }

    /// A write that fails inside a group is undone alone: a batch meeting a
    /// corrupt record answers the error and leaves none of its keys claimed,
    /// while the claims before and after it in the same transaction stand. A
    /// queued write whose caller has gone is not run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_is_undone_alone_and_a_dropped_one_never_runs() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("undo.db");
        let (store, mut blocker) = store_and_blocker(&db).await;
        blocker
            .execute_batch(&format!(
                "INSERT INTO dedupe_records (namespace, id, state, token, claim_id, fingerprint, expires_at, completed_at, outcome, attempts, first_seen) VALUES ('group','bad',7,'t',NULL,NULL,{},NULL,NULL,1,0)",
                i64::MAX / 2
            ))
            .expect("plant a corrupt row");
        let tx = blocker
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .expect("take the write lock");
        let lead = spawn_claim(&store, "lead");
        until_taken(&store, 1).await;
        let before = spawn_claim(&store, "before");
        until_taken(&store, 2).await;
        let batch = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim_many(&[key("in-batch"), key("bad")], &ClaimOptions::default())
                    .await
            })
        };
        until_taken(&store, 3).await;
        let dropped = spawn_claim(&store, "dropped");
        until_taken(&store, 4).await;
        dropped.abort();
        assert!(dropped.await.is_err(), "the dropped claim ran to its end");
        let after = spawn_claim(&store, "after");
        until_taken(&store, 5).await;
        tx.rollback().expect("unlock");
        for (id, claim) in [("lead", lead), ("before", before), ("after", after)] {
            let answer = claim.await.expect("task");
            assert!(
                matches!(answer, Ok(ClaimOutcome::Claimed(_))),
                "{id} answered {answer:?}"
            );
            assert!(
                store.get(&key(id)).await.expect("get").is_some(),
                "{id} was answered Claimed but its record is not stored"
            );
        }
        let batch = batch.await.expect("task");
        assert!(
            matches!(batch, Err(Error::CorruptRecord { .. })),
            "a batch meeting a corrupt record answered {batch:?}"
        );
        assert!(
            store.get(&key("in-batch")).await.expect("get").is_none(),
            "the failed batch left a key claimed"
        );
        assert!(
            store.get(&key("dropped")).await.expect("get").is_none(),
            "a claim whose caller had gone was written"
        );
    }

    /// A write that makes SQLite roll the whole transaction back (here a
    /// trigger's `RAISE(ROLLBACK)`; in production a full disk or an I/O
    /// error) fails its whole group: no write of it, before or after the
    /// culprit, is answered Claimed or stored, each answer names the cause, and
    /// the next write works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rolled_back_transaction_fails_its_whole_group() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("rollback.db");
        let (store, mut blocker) = store_and_blocker(&db).await;
        blocker
            .execute_batch(
                "CREATE TRIGGER boom BEFORE INSERT ON dedupe_records WHEN NEW.id = 'boom'
                 BEGIN SELECT RAISE(ROLLBACK, 'boom was refused'); END;",
            )
            .expect("trigger");
        let tx = blocker
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .expect("take the write lock");
        let mut claims = Vec::new();
        for (n, id) in ["before", "boom", "after"].into_iter().enumerate() {
            claims.push((id, spawn_claim(&store, id)));
            until_taken(&store, n + 1).await;
        }
        tx.rollback().expect("unlock");
        for (id, claim) in claims {
            match claim.await.expect("task") {
                Err(e) => {
                    let text = super::error_chain(&e);
                    assert!(text.contains("boom was refused"), "{id}: {text}");
                }
                Ok(answer) => panic!("{id} answered {answer:?} in a rolled-back group"),
            }
            assert!(
                store.get(&key(id)).await.expect("get").is_none(),
                "{id} is stored though its group was rolled back"
            );
        }
        let again = spawn_claim(&store, "again").await.expect("task");
        assert!(matches!(again, Ok(ClaimOutcome::Claimed(_))), "{again:?}");
    }

    /// Handles with different busy timeouts share the file's writer thread: a
    /// write queued behind another handle's write that waits 20 s for the lock
    /// is still answered Timeout at its own 200 ms, having written nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_write_times_out_at_its_own_deadline() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("deadlines.db");
        let (slow, mut blocker) = store_and_blocker(&db).await;
        let fast = SqliteStore::builder(&db)
            .busy_timeout(Duration::from_millis(200))
            .open()
            .await
            .expect("open");
        let tx = blocker
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .expect("take the write lock");
        let lead = spawn_claim(&slow, "slow");
        until_taken(&slow, 1).await;
        let started = std::time::Instant::now();
        let answer = fast.claim(&key("fast"), &ClaimOptions::default()).await;
        let waited = started.elapsed();
        tx.rollback().expect("unlock");
        assert!(
            matches!(answer, Err(Error::Timeout { .. })),
            "a claim under a held lock answered {answer:?}"
        );
        assert!(
            waited < Duration::from_secs(5),
            "a 200 ms busy timeout answered after {waited:?}"
        );
        assert!(matches!(
            lead.await.expect("task"),
            Ok(ClaimOutcome::Claimed(_))
        ));
        assert!(slow.get(&key("fast")).await.expect("get").is_none());
    }

    /// A write that panics on the writer thread is answered with an error and
    /// undone; the writes of its group before and after it commit, and the
    /// thread goes on serving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_write_is_answered_and_undone() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("panic.db");
        let (store, mut blocker) = store_and_blocker(&db).await;
        let tx = blocker
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .expect("take the write lock");
        let before = spawn_claim(&store, "before");
        until_taken(&store, 1).await;
        let panicking = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .conns()
                    .write(1, |ops, conn| {
                        let _claimed =
                            ops.claim(conn, &key("panicked"), &ClaimOptions::default())?;
                        panic!("a write that panics after writing");
                    })
                    .await
            })
        };
        until_taken(&store, 2).await;
        let after = spawn_claim(&store, "after");
        until_taken(&store, 3).await;
        tx.rollback().expect("unlock");
        let answer: dedupe_core::Result<()> = panicking.await.expect("task");
        assert!(answer.is_err(), "a panicking write answered {answer:?}");
        for (id, claim) in [("before", before), ("after", after)] {
            let answer = claim.await.expect("task");
            assert!(
                matches!(answer, Ok(ClaimOutcome::Claimed(_))),
                "{id} answered {answer:?}"
            );
            assert!(store.get(&key(id)).await.expect("get").is_some());
        }
        assert!(
            store.get(&key("panicked")).await.expect("get").is_none(),
            "the panicking write's claim was committed"
        );
        let again = spawn_claim(&store, "again").await.expect("task");
        assert!(matches!(again, Ok(ClaimOutcome::Claimed(_))), "{again:?}");
    }
}
