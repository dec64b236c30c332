//! The store's connections, each owned by a thread of its own.
//!
//! A store handle starts one thread per connection; the threads take jobs from
//! one shared queue and answer each on a oneshot channel. Compared with a trip
//! through Tokio's blocking pool per call, the connection never changes threads
//! and a call costs one queue push and one wake-up each way. (That is still most
//! of what a call costs, so reads and writes run on the caller's thread where
//! the runtime allows it: see `Conns::read_in_place` in `conn`, [`open_reader`] and
//! `Conns::write_in_place`; and writes that must wait go to the process's
//! writer thread, `crate::group`, which commits them in groups.)
//!
//! Every job carries a deadline, the store's busy timeout counted from the call:
//! a job still queued at its deadline is answered with [`Error::Timeout`] without
//! running, and a running job stops waiting for the write lock at the same
//! deadline. A job whose caller has gone (its future was dropped) is skipped
//! before it starts, so a cancelled call never writes behind the caller's back
//! once the call is known to be cancelled.

use std::cell::Cell;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dedupe_core::{Error, Result};
use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use crate::ops::Settings;

/// One unit of work for a connection thread.
type Job = Box<dyn FnOnce(&mut Slot) + Send>;

/// The queue of a store handle's connection threads. Dropping the last sender
/// (the last clone of the handle) ends the threads and closes the connections.
#[derive(Debug)]
pub(crate) struct Workers {
    queue: Sender<Job>,
    threads: usize,
}

/// What a connection thread owns: its connection (opened on its first job,
/// reopened on the next job if opening failed) and the store's settings.
pub(crate) struct Slot {
    conn: Option<Connection>,
    pub(crate) settings: Arc<Settings>,
}

impl Slot {
    /// The thread's connection, opened now if it has none yet.
    pub(crate) fn conn(&mut self) -> Result<&mut Connection> {
        if self.conn.is_none() {
            self.conn = Some(open_connection(
                &self.settings.path,
                self.settings.busy_timeout,
            )?);
        }
        // Set just above.
        self.conn
            .as_mut()
            .ok_or_else(|| Error::retryable("sqlite connection missing", None))
    }
}

impl Workers {
    /// Starts `threads` connection threads for a store with `settings`.
    pub(crate) fn start(threads: usize, settings: &Arc<Settings>) -> Result<Self> {
        let (queue, jobs) = crossbeam_channel::unbounded::<Job>();
        for i in 0..threads {
            let jobs: Receiver<Job> = jobs.clone();
            let mut slot = Slot {
                conn: None,
                settings: Arc::clone(settings),
            };
            std::thread::Builder::new()
                .name(format!("dedupe-sqlite-{i}"))
                .spawn(move || {
                    while let Ok(job) = jobs.recv() {
                        job(&mut slot);
                    }
                })
                .map_err(|e| {
                    Error::fatal(
                        "could not start a sqlite connection thread",
                        Some(Box::new(e) as _),
                    )
                })?;
        }
        Ok(Self { queue, threads })
    }

    /// How many connection threads serve this handle.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Queues `f` for a connection thread without waiting for it; `false` when
    /// the threads have stopped.
    pub(crate) fn spawn(&self, f: impl FnOnce(&mut Slot) + Send + 'static) -> bool {
        self.queue.send(Box::new(f)).is_ok()
    }

    /// Runs `f` on a connection thread and waits, without blocking the runtime,
    /// for its answer.
    pub(crate) async fn run<T, F>(&self, busy_timeout: Duration, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Slot) -> Result<T> + Send + 'static,
    {
        let deadline = Instant::now() + busy_timeout;
        let (answer, answered) = oneshot::channel();
        let job: Job = Box::new(move |slot: &mut Slot| {
            if answer.is_closed() {
                return; // the caller has gone: do nothing on its behalf
            }
            let result = if Instant::now() >= deadline {
                Err(Error::timeout(busy_timeout))
            } else {
                with_busy_deadline(deadline, || f(slot))
            };
            let _ = answer.send(result);
        });
        self.queue
            .send(job)
            .map_err(|_| Error::fatal("sqlite connection threads stopped", None))?;
        answered.await.map_err(|_| {
            Error::fatal("a sqlite connection thread stopped before answering", None)
        })?
    }
}

/// The deadline of the job running on this thread, if any.
pub(crate) fn busy_deadline() -> Option<Instant> {
    BUSY_DEADLINE.with(Cell::get)
}

thread_local! {
    /// When the job running on this thread stops waiting for the write lock.
    static BUSY_DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's busy deadline set to `deadline` (or the deadline
/// already set, if that is earlier), then puts back the one it found.
pub(crate) fn with_busy_deadline<T>(deadline: Instant, f: impl FnOnce() -> T) -> T {
    /// Puts the outer deadline back when `f` returns or unwinds.
    struct Restore(Option<Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            BUSY_DEADLINE.with(|d| d.set(self.0));
        }
    }
    let outer = BUSY_DEADLINE.with(Cell::get);
    let inner = outer.map_or(deadline, |outer| outer.min(deadline));
    let _restore = Restore(outer);
    BUSY_DEADLINE.with(|d| d.set(Some(inner)));
    f()
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

/// Opens a connection for the reads a store runs on its caller's thread (see
/// `Conns::read_in_place` in `conn`). Such a thread never has a busy deadline, so the
/// busy handler gives up at once: a read that meets a lock fails instead of
/// waiting, and goes to a connection thread. `query_only`: it can never write.
pub(crate) fn open_reader(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    let map = |e| crate::error::map(e, busy_timeout);
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(map)?;
    conn.busy_handler(Some(wait_for_lock)).map_err(map)?;
    conn.pragma_update(None, "query_only", true).map_err(map)?;
    Ok(conn)
}

/// Opens a connection on this thread, waiting for locks at most `busy_timeout`.
///
/// Connections opening a new file together race to switch it to WAL, which
/// takes an exclusive lock: SQLite answers one of them `SQLITE_BUSY` at once,
/// without calling the busy handler (waiting could deadlock). That attempt is
/// made again, a millisecond later, until the deadline (an adversarial test
/// had four processes open one new file at once, and one open failed).
pub(crate) fn open_connection(path: &Path, busy_timeout: Duration) -> Result<Connection> {
    with_busy_deadline(Instant::now() + busy_timeout, || loop {
        match open_write_connection(path) {
            Ok(conn) => return Ok(conn),
            Err(e)
                if crate::group::is_busy(&e)
                    && busy_deadline().is_some_and(|deadline| Instant::now() < deadline) =>
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(crate::error::map(e, busy_timeout)),
        }
    })
}

/// Opens a connection that may write, waiting for locks until the thread's
/// busy deadline (none set: not at all).
pub(crate) fn open_write_connection(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )?;
    conn.busy_handler(Some(wait_for_lock))?;
    // WAL lets readers run beside the one writer; FULL sync makes a completed record
    // survive power loss, which is the point of keeping it.
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}
