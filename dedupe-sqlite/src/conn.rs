//! Where a call runs. A read runs on the caller's thread when it need not wait
//! (`read_in_place`), a write too (`write_in_place`); anything else goes to one
//! of the handle's connection threads (`with_conn`, see `workers`) or is queued
//! for the file's writer thread (`write`, see `group`), which commits the
//! writes queued together. Each method of the store asks here, so it reads as
//! what it does.

use std::sync::Arc;

use dedupe_core::{Error, Result};
use rusqlite::Connection;

use crate::group::FileWriter;
use crate::ops::{Ops, Settings};
use crate::workers::{Slot, Workers};

/// A handle's connections: its connection threads, the connections it uses on
/// its callers' threads, and the file's writer.
#[derive(Debug)]
pub(crate) struct Conns {
    /// The handle's connection threads.
    workers: Workers,
    settings: Arc<Settings>,
    /// This process's writer to the file (its turn, and the thread that
    /// commits queued writes in groups), shared by its handles.
    writer: Arc<FileWriter>,
    /// Connections for reads run on the caller's thread (see
    /// [`Conns::read_in_place`]).
    readers: Arc<Pool>,
    /// Connections for writes run on the caller's thread (see
    /// [`Conns::write_in_place`]).
    writers: Pool,
}

impl Conns {
    /// Starts `threads` connection threads for a handle.
    pub(crate) fn start(
        threads: usize,
        settings: Settings,
        writer: Arc<FileWriter>,
    ) -> Result<Self> {
        let settings = Arc::new(settings);
        let workers = Workers::start(threads, &settings)?;
        Ok(Self {
            workers,
            settings,
            writer,
            readers: Arc::new(Pool::default()),
            writers: Pool::default(),
        })
    }

    /// What every call of the handle needs.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// How many connection threads serve the handle.
    pub(crate) fn threads(&self) -> usize {
        self.workers.threads()
    }

    /// Opens `n` connections for reads on the caller's thread, on a connection
    /// thread (opening may wait for a lock; the caller's thread never does).
    pub(crate) async fn open_readers(&self, n: usize) -> Result<()> {
        let path = self.settings.path.clone();
        let opened = self
            .with_conn(move |ops, _| {
                (0..n)
                    .map(|_| crate::workers::open_reader(&path, ops.busy_timeout))
                    .collect::<Result<Vec<_>>>()
            })
            .await?;
        self.readers
            .opened
            .store(opened.len(), std::sync::atomic::Ordering::Relaxed);
        *self.readers.idle.lock() = opened;
        Ok(())
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
    pub(crate) fn read_in_place<T>(
        &self,
        read: impl FnOnce(&Ops<'_>, &Connection) -> Result<T>,
    ) -> Option<T> {
        if !on_multi_thread_runtime() {
            return None;
        }
        let Some(conn) = self.readers.idle.lock().pop() else {
            self.open_another_reader();
            return None;
        };
        let answer = tokio::task::block_in_place(|| read(&self.settings.ops(), &conn));
        self.readers.idle.lock().push(conn);
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
    pub(crate) fn write_in_place<T>(
        &self,
        write: impl FnOnce(&Ops<'_>, &mut Connection) -> Result<T>,
    ) -> Option<Result<T>> {
        use std::sync::atomic::Ordering::Relaxed;
        if !on_multi_thread_runtime() {
            return None;
        }
        let settings = &self.settings;
        // Writes waiting in the writer thread's queue go first. (A group the
        // thread has taken and that waits for the turn may still be passed: the
        // write here holds the turn for one commit at most.)
        if !self.writer.queue_is_empty() {
            return None;
        }
        let _turn = self.writer.turn().try_lock()?;
        let writers = &self.writers;
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
    pub(crate) fn open_another_reader(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let readers = Arc::clone(&self.readers);
        if readers
            .opened
            .fetch_update(Relaxed, Relaxed, |n| (n < MAX_READERS).then_some(n + 1))
            .is_err()
        {
            return;
        }
        let path = self.settings.path.clone();
        let asked = self.workers.spawn(move |slot: &mut Slot| {
            match crate::workers::open_reader(&path, slot.settings.busy_timeout) {
                Ok(conn) => readers.idle.lock().push(conn),
                Err(_) => {
                    readers.opened.fetch_sub(1, Relaxed);
                }
            }
        });
        if !asked {
            self.readers.opened.fetch_sub(1, Relaxed);
        }
    }

    /// Runs `f` on one of the handle's connection threads.
    pub(crate) async fn with_conn<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Ops<'_>, &mut Connection) -> Result<T> + Send + 'static,
    {
        self.workers
            .run(self.settings.busy_timeout, move |slot: &mut Slot| {
                let settings = Arc::clone(&slot.settings);
                f(&settings.ops(), slot.conn()?)
            })
            .await
    }

    /// Writes ever queued for this process's writer thread of the file, and
    /// those waiting in its queue now.
    #[cfg(test)]
    pub(crate) fn queued_writes(&self) -> (usize, usize) {
        self.writer.queued()
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
        self.writer.run(&self.settings, keys, write).await
    }
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

/// Whether this thread runs Tokio's multi-thread runtime, the only one where
/// `block_in_place` may run a call on the caller's thread.
fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}
