//! The connection a call runs on: taken from the ones a store keeps, or from
//! the pool, and where it goes afterwards.

use std::collections::VecDeque;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dedupe_core::{Error, Result};
use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};
use tokio::sync::oneshot;

/// How long a connection lives before its pool renews it: the lifetime of a
/// store's pool (`max_lifetime`), and past it a kept connection goes back to
/// the pool instead of to the next call.
pub const MAX_CONNECTION_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// A connection parked longer than this goes back to the pool (whose check
/// finds one a firewall, `wait_timeout` or `idle_session_timeout` cut)
/// instead of to the next call.
const IDLE_FOR: Duration = Duration::from_secs(30);

/// A connection ready for a call, and when it was first taken from the pool.
type Ready<DB> = (PoolConnection<DB>, Instant);

/// Connections a store keeps between its calls instead of giving them back
/// to the pool (see the [crate](crate) docs). Shared by a store's clones.
pub struct Kept<DB: Database> {
    state: Mutex<State<DB>>,
    keep: usize,
}

struct State<DB: Database> {
    /// Parked: the connection, when it was first taken from the pool, when
    /// it was parked.
    idle: Vec<(PoolConnection<DB>, Instant, Instant)>,
    /// Calls waiting for a kept connection, oldest first.
    waiters: VecDeque<oneshot::Sender<Ready<DB>>>,
    /// Connections kept, parked or in use (at most `keep`).
    members: usize,
}

impl<DB: Database> fmt::Debug for Kept<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Kept")
            .field("keep", &self.keep)
            .field("members", &state.members)
            .field("parked", &state.idle.len())
            .field("waiting", &state.waiters.len())
            .finish()
    }
}

impl<DB: Database> Kept<DB> {
    /// Keeps up to `keep` connections (0: every call takes one from the pool
    /// and gives it back).
    pub fn new(keep: usize) -> Self {
        Self {
            state: Mutex::new(State {
                idle: Vec::new(),
                waiters: VecDeque::new(),
                members: 0,
            }),
            keep,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<DB>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A parked connection fit for a call, or a place in the queue for the
    /// next one handed on. Unfit ones (parked too long, too old, their pool
    /// closed) go back to the pool.
    fn pop_or_wait(
        &self,
        pool: &Pool<DB>,
        bound: Duration,
    ) -> std::result::Result<Ready<DB>, oneshot::Receiver<Ready<DB>>> {
        let mut state = self.state();
        while let Some((conn, since, parked)) = state.idle.pop() {
            if parked.elapsed() < IDLE_FOR
                && since.elapsed() < MAX_CONNECTION_LIFETIME
                && !pool.is_closed()
            {
                return Ok((conn, since));
            }
            state.members -= 1;
            give_back(conn, bound);
        }
        let (tx, rx) = oneshot::channel();
        state.waiters.push_back(tx);
        Err(rx)
    }

    /// Counts a connection from the pool in, if there is room.
    fn admit(&self) -> bool {
        let mut state = self.state();
        if state.members < self.keep {
            state.members += 1;
            true
        } else {
            false
        }
    }

    /// A kept connection whose call ended well: to the oldest waiter, or
    /// parked.
    fn hand_on(&self, conn: PoolConnection<DB>, since: Instant) {
        let mut state = self.state();
        let mut item = (conn, since);
        while let Some(waiter) = state.waiters.pop_front() {
            match waiter.send(item) {
                Ok(()) => return,
                // That caller got a connection from the pool meanwhile.
                Err(back) => item = back,
            }
        }
        state.idle.push((item.0, item.1, Instant::now()));
    }

    /// A kept connection leaves the kept set.
    fn release(&self) {
        let mut state = self.state();
        state.members = state.members.saturating_sub(1);
    }
}

impl<DB: Database> Drop for Kept<DB> {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (conn, _, _) in state.idle.drain(..) {
            give_back(conn, Duration::from_secs(1));
        }
    }
}

/// Returns `conn` to its pool through sqlx's check, bounded; outside a
/// runtime (sqlx's return task needs one) or past the bound, the connection
/// is closed and its pool slot freed. Unbounded, a connection whose network
/// went silent (blackholed, half-open) never answers that check and holds
/// its pool slot until the kernel gives up on the socket, minutes later.
fn give_back<DB: Database>(mut conn: PoolConnection<DB>, bound: Duration) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let back = conn.return_to_pool();
            runtime.spawn(async move {
                if tokio::time::timeout(bound, back).await.is_err() {
                    tracing::warn!(
                        ?bound,
                        "a connection did not answer its return check; dropped it"
                    );
                }
            });
        }
        Err(_) => drop(conn.detach()),
    }
}

/// A connection for one call: dereferences to the driver's connection.
///
/// Where it goes when dropped:
/// - the call ended with [`finish`](Self::finish) on an answer that leaves
///   the connection as good as before (`Ok`, or an error of the store's own)
///   and it is a kept one: to the next call ([`Kept`]);
/// - the call answered an error from the server or the driver (a cut
///   connection, a timeout, a statement refused), or it is not a kept
///   connection: back to the pool through its check, bounded by the timeout;
/// - the call was stopped part-way (never finished: its timeout fired, its
///   future was dropped), leaving the connection out of step with the
///   server: closed, never reused.
pub struct Checkout<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    since: Instant,
    kept: Arc<Kept<DB>>,
    /// One of the kept connections.
    member: bool,
    ended: Option<bool>,
    bound: Duration,
}

impl<DB: Database> fmt::Debug for Checkout<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkout")
            .field("kept", &self.member)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> Checkout<DB> {
    /// A kept connection, or one from the pool: whichever comes first.
    /// `map` turns the pool's error (its acquire timed out, the server is
    /// away) into the store's.
    pub async fn take(
        pool: &Pool<DB>,
        kept: &Arc<Kept<DB>>,
        timeout: Duration,
        map: fn(sqlx::Error, Duration) -> Error,
    ) -> Result<Self> {
        let checkout = |conn, since, member| Self {
            conn: Some(conn),
            since,
            kept: Arc::clone(kept),
            member,
            ended: None,
            bound: timeout,
        };
        // Boxed: sqlx's acquire future is 8.6 KB, and unboxed it made every
        // call's future 18 KB, copied at each await layer (about 1 µs of
        // memmove a claim, measured on Postgres).
        let acquire = || async { Box::pin(pool.acquire()).await.map_err(|e| map(e, timeout)) };
        if kept.keep == 0 {
            return Ok(checkout(acquire().await?, Instant::now(), false));
        }
        loop {
            let mut handed = match kept.pop_or_wait(pool, timeout) {
                Ok((conn, since)) => return Ok(checkout(conn, since, true)),
                Err(handed) => handed,
            };
            tokio::select! {
                biased;
                conn = &mut handed => match conn {
                    Ok((conn, since)) => return Ok(checkout(conn, since, true)),
                    // The store is going away: ask again.
                    Err(_) => continue,
                },
                conn = acquire() => {
                    let conn = conn?;
                    // Handed one just as the pool gave one: keep the kept
                    // one, the other goes back to the pool.
                    if let Ok((kept_conn, since)) = handed.try_recv() {
                        give_back(conn, timeout);
                        return Ok(checkout(kept_conn, since, true));
                    }
                    let member = kept.admit();
                    return Ok(checkout(conn, Instant::now(), member));
                }
            }
        }
    }

    /// The call ran to its end with `answer`: an answer of the store's own
    /// leaves the connection as good as before; anything the server or the
    /// driver said may have ended the session (a packet over MySQL's
    /// `max_allowed_packet` closes it).
    pub fn finish<T>(&mut self, answer: &Result<T>) {
        let fine = match answer {
            Ok(_) => true,
            Err(e) => !matches!(
                e,
                Error::Unavailable { .. } | Error::Timeout { .. } | Error::Backend { .. }
            ),
        };
        self.ended = Some(fine);
    }
}

impl<DB: Database> Deref for Checkout<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.conn
            .as_deref()
            .expect("a checkout holds its connection until dropped")
    }
}

impl<DB: Database> DerefMut for Checkout<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.conn
            .as_deref_mut()
            .expect("a checkout holds its connection until dropped")
    }
}

impl<DB: Database> Drop for Checkout<DB> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let fine = self.ended;
        if self.member && fine == Some(true) && self.since.elapsed() < MAX_CONNECTION_LIFETIME {
            self.kept.hand_on(conn, self.since);
            return;
        }
        if self.member {
            self.kept.release();
        }
        match fine {
            Some(_) => give_back(conn, self.bound),
            None => drop(conn.detach()),
        }
    }
}
