//! The connection a call runs on: taken from the ones the store keeps, or
//! from the pool, and where it goes afterwards.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dedupe_core::Result;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool};
use tokio::sync::Notify;

type Pooled = PoolConnection<MySql>;

/// Connections the store keeps between its calls, each with when it was
/// first taken from the pool and when it was parked here.
///
/// sqlx pings every connection going back to its pool before the next
/// caller may have it: with one connection per task, every call waited for
/// a third round trip after its two. A call that went well parks its
/// connection here instead, and the next call takes it as it is; a call
/// waiting on the pool is woken to take a parked one, so no caller starves
/// while connections sit here. Measured with `dedupe bench` on MariaDB
/// 10.11, one run each way (README): claims 2,082/s from one task and
/// 8,519/s from 64 through the pool, 2,467/s and 11,773/s kept here;
/// claim-then-complete from 64 tasks 4,865/s, then 7,033/s.
///
/// A parked connection still holds its slot of the pool: other users of the
/// pool (the caller's own transactions, a ledger beside the store) cannot
/// have it. So the store keeps at most `keep` ([`MySqlBuilder::keep_connections`],
/// none unless asked); with every slot kept, a `dedupe serve` ledger
/// sharing the pool waited out its timeout on every event after one burst.
///
/// [`MySqlBuilder::keep_connections`]: crate::MySqlBuilder::keep_connections
#[derive(Debug, Default)]
pub(crate) struct Kept {
    idle: Mutex<Vec<(Pooled, Instant, Instant)>>,
    parked: Notify,
    keep: usize,
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
            idle: Mutex::default(),
            parked: Notify::new(),
            keep,
        }
    }

    fn idle(&self) -> MutexGuard<'_, Vec<(Pooled, Instant, Instant)>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recently parked connection still fresh enough to use; the
    /// stale ones it meets go back to the pool.
    fn pop(&self, bound: Duration) -> Option<(Pooled, Instant)> {
        loop {
            let (conn, since, parked) = self.idle().pop()?;
            if parked.elapsed() < Self::IDLE_FOR {
                return Some((conn, since));
            }
            give_back(conn, bound);
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let idle = self.idle.get_mut().unwrap_or_else(|e| e.into_inner());
        for (conn, _, _) in idle.drain(..) {
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
///   input, a corrupt record): parked in [`Kept`] for the next call, when
///   it keeps fewer than it may;
/// - the call answered an error from the server or the driver (a cut
///   connection, a timeout, a statement refused): back to the pool through
///   its ping, bounded by the timeout;
/// - the call was stopped part-way (its timeout fired, its future was
///   dropped), leaving the connection out of step with the server: closed,
///   never reused. Before, a blackhole of 2.5 s left every connection of the
///   pool waiting forever on its return ping.
pub(crate) struct Checkout {
    conn: Option<Pooled>,
    since: Instant,
    kept: Arc<Kept>,
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
        let checkout = |conn, since| Self {
            conn: Some(conn),
            since,
            kept: Arc::clone(kept),
            ended: None,
            bound: timeout,
        };
        if kept.keep == 0 {
            let conn = pool
                .acquire()
                .await
                .map_err(|e| crate::error::map(e, timeout))?;
            return Ok(checkout(conn, Instant::now()));
        }
        loop {
            if let Some((conn, since)) = kept.pop(timeout) {
                return Ok(checkout(conn, since));
            }
            let parked = kept.parked.notified();
            tokio::pin!(parked);
            parked.as_mut().enable();
            // Parked between the look above and the registration.
            if let Some((conn, since)) = kept.pop(timeout) {
                return Ok(checkout(conn, since));
            }
            tokio::select! {
                conn = pool.acquire() => {
                    let conn = conn.map_err(|e| crate::error::map(e, timeout))?;
                    return Ok(checkout(conn, Instant::now()));
                }
                () = &mut parked => {}
            }
        }
    }

    /// The call ran to its end with `answer`.
    pub(crate) fn finish<T>(mut self, answer: &Result<T>) {
        use dedupe_core::Error;
        // An answer of the store's own: the connection is as good as before.
        // Anything the server or the driver said may have ended the session
        // (a packet over `max_allowed_packet` closes it).
        let kept = match answer {
            Ok(_) => true,
            Err(e) => !matches!(
                e,
                Error::Unavailable { .. } | Error::Timeout { .. } | Error::Backend { .. }
            ),
        };
        self.ended = Some(kept);
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
        match self.ended {
            Some(true) if self.since.elapsed() < Kept::LIFETIME => {
                let mut idle = self.kept.idle();
                if idle.len() < self.kept.keep {
                    idle.push((conn, self.since, Instant::now()));
                    drop(idle);
                    self.kept.parked.notify_one();
                } else {
                    drop(idle);
                    give_back(conn, self.bound);
                }
            }
            Some(_) => give_back(conn, self.bound),
            None => drop(conn.detach()),
        }
    }
}
