//! The connection a call runs on: taken from the ones the store keeps, or
//! from the pool, and where it goes afterwards.

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dedupe_core::Result;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool};
use tokio::sync::oneshot;

type Pooled = PoolConnection<MySql>;

/// Connections the store keeps between its calls instead of giving them
/// back to the pool.
///
/// sqlx pings every connection going back to its pool before the next
/// caller may have it: with one connection per task, every call waited for
/// a third round trip after its two. A kept connection goes from a finished
/// call to the next one as it is. Measured with `dedupe bench` on MariaDB
/// 10.11, one run each way (README): claims 2,082/s from one task and
/// 8,519/s from 64 through the pool, 2,467/s and 11,773/s kept;
/// claim-then-complete from 64 tasks 4,865/s, then 7,033/s.
///
/// - **At most `keep` connections** ([`MySqlBuilder::keep_connections`],
///   none unless asked) are ever kept, parked or in use: every other
///   connection goes back through the pool, whose fair queue also serves
///   the pool's other users (the caller's own transactions, a ledger beside
///   the store). With every slot kept, a `dedupe serve` ledger sharing the
///   pool waited out its timeout on every event after one burst.
/// - **First come, first served**: a finished call hands its connection to
///   the call that has waited longest, and parks it only when none waits.
///   (A reviewer reasoned that with a stack and a wake-up, a task calling in
///   a loop could take back its own connection ahead of a woken waiter; the
///   test `callers_in_a_loop_are_served_in_turn` did not show it on the old
///   code, and fails when waiters are not handed connections at all.)
///
/// [`MySqlBuilder::keep_connections`]: crate::MySqlBuilder::keep_connections
#[derive(Debug)]
pub(crate) struct Kept {
    state: Mutex<State>,
    keep: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Parked: the connection, when it was first taken from the pool, when
    /// it was parked.
    idle: Vec<(Pooled, Instant, Instant)>,
    /// Calls waiting for a kept connection, oldest first.
    waiters: VecDeque<oneshot::Sender<(Pooled, Instant)>>,
    /// Connections kept, parked or in use (at most `keep`).
    members: usize,
}

impl Kept {
    /// A connection parked longer than this goes back to the pool (whose
    /// ping finds one the server's `wait_timeout` or a firewall cut)
    /// instead of to the next call.
    const IDLE_FOR: Duration = Duration::from_secs(30);
    /// A connection this old goes back to the pool, which renews it.
    const LIFETIME: Duration = Duration::from_secs(30 * 60);

    pub(crate) fn new(keep: usize) -> Self {
        Self {
            state: Mutex::default(),
            keep,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh parked connection, or a place in the queue for the next one.
    fn pop_or_wait(
        &self,
        bound: Duration,
    ) -> std::result::Result<(Pooled, Instant), oneshot::Receiver<(Pooled, Instant)>> {
        let mut state = self.state();
        while let Some((conn, since, parked)) = state.idle.pop() {
            if parked.elapsed() < Self::IDLE_FOR {
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
    fn hand_on(&self, conn: Pooled, since: Instant) {
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

impl Drop for Kept {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (conn, _, _) in state.idle.drain(..) {
            give_back(conn, Duration::from_secs(1));
        }
    }
}

/// Returns `conn` to its pool through sqlx's ping, bounded; outside a
/// runtime (sqlx's return task needs one) or past the bound, the connection
/// is closed and its pool slot freed.
fn give_back(mut conn: Pooled, bound: Duration) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let back = conn.return_to_pool();
            runtime.spawn(async move {
                if tokio::time::timeout(bound, back).await.is_err() {
                    tracing::warn!(
                        ?bound,
                        "a MySQL connection did not answer its return check; dropped it"
                    );
                }
            });
        }
        Err(_) => drop(conn.detach()),
    }
}

/// A connection for one call.
///
/// Where it goes when dropped:
/// - the call answered Ok, or an error of the store's own (a lost lease, bad
///   input, a corrupt record), on a kept connection: to the next call
///   ([`Kept`]);
/// - the call answered an error from the server or the driver (a cut
///   connection, a timeout, a statement refused), or it is not a kept
///   connection: back to the pool through its ping, bounded by the timeout;
/// - the call was stopped part-way (its timeout fired, its future was
///   dropped), leaving the connection out of step with the server: closed,
///   never reused. Before, a blackhole of 2.5 s left every connection of the
///   pool waiting forever on its return ping.
pub(crate) struct Checkout {
    conn: Option<Pooled>,
    since: Instant,
    kept: Arc<Kept>,
    /// One of the kept connections.
    member: bool,
    ended: Option<bool>,
    bound: Duration,
}

impl Checkout {
    /// A kept connection, or one from the pool: whichever comes first.
    pub(crate) async fn take(
        pool: &MySqlPool,
        kept: &Arc<Kept>,
        timeout: Duration,
    ) -> Result<Self> {
        let checkout = |conn, since, member| Self {
            conn: Some(conn),
            since,
            kept: Arc::clone(kept),
            member,
            ended: None,
            bound: timeout,
        };
        let acquire = || async {
            pool.acquire()
                .await
                .map_err(|e| crate::error::map(e, timeout))
        };
        if kept.keep == 0 {
            return Ok(checkout(acquire().await?, Instant::now(), false));
        }
        loop {
            let mut handed = match kept.pop_or_wait(timeout) {
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

    /// The call ran to its end with `answer`.
    pub(crate) fn finish<T>(mut self, answer: &Result<T>) {
        use dedupe_core::Error;
        // An answer of the store's own: the connection is as good as before.
        // Anything the server or the driver said may have ended the session
        // (a packet over `max_allowed_packet` closes it).
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

impl Deref for Checkout {
    type Target = MySqlConnection;

    fn deref(&self) -> &MySqlConnection {
        self.conn
            .as_deref()
            .expect("a checkout holds its connection until dropped")
    }
}

impl DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        self.conn
            .as_deref_mut()
            .expect("a checkout holds its connection until dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let fine = self.ended;
        if self.member && fine == Some(true) && self.since.elapsed() < Kept::LIFETIME {
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
