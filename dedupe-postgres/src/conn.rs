//! The store's connections: the ones it keeps checked out between calls, and
//! the one a call runs on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{Error, Result};
use sqlx::{PgConnection, PgPool};

use crate::store::PgStore;

pub(crate) type PooledConn = sqlx::pool::PoolConnection<sqlx::Postgres>;

/// Connections the store keeps checked out between its calls, with when each
/// was first taken from the pool.
///
/// sqlx tests every connection as it goes back to its pool with a round trip
/// (`Sync`, unconditionally in 0.9) before the next caller may have it: with
/// one connection per worker, every call waited for a second round trip. A
/// connection whose call went well is kept here instead and handed to the next
/// call as it is (a connection that broke while idle fails that call with a
/// retryable error and is not kept). At most `keep` of them
/// ([`PgBuilder::hold_connections`]); each goes back to the pool after
/// [`PgStore::MAX_CONNECTION_LIFETIME`], and all of them when the last clone
/// of the store is dropped.
#[derive(Debug)]
pub(crate) struct Held {
    /// Connections, when each was first taken from the pool, and when it was
    /// parked here.
    pub(crate) idle: parking_lot::Mutex<Vec<(PooledConn, Instant, Instant)>>,
    pub(crate) keep: usize,
    /// Calls waiting on the pool for a connection. While any waits, a
    /// connection whose call ended goes back to the pool, where the waiter
    /// gets it: parked here, it would reach only calls that start later, and
    /// with every connection held the waiters starved until their acquire
    /// timed out (32 concurrent claims on a store holding its 4 connections:
    /// 27 timed out).
    pub(crate) waiting: std::sync::atomic::AtomicUsize,
}

/// Counts a call in [`Held::waiting`] while it lives.
struct Waiting<'a>(&'a Held);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0
            .waiting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Held {
    /// A held connection idle longer than this goes back to the pool (whose
    /// return check finds one a firewall or `idle_session_timeout` cut)
    /// instead of to the next call.
    const IDLE_FOR: Duration = Duration::from_secs(30);
}

impl Drop for Held {
    fn drop(&mut self) {
        // Outside a runtime sqlx cannot run its return task (it would panic):
        // let the connections go without it (their sockets close, their pool
        // slots free).
        if tokio::runtime::Handle::try_current().is_err() {
            for (conn, _, _) in self.idle.get_mut().drain(..) {
                drop(conn.detach());
            }
        }
    }
}

/// A connection for one call: taken from [`Held`] or the pool, and given back
/// by [`settle`](Checkout::settle) and drop.
///
/// A connection whose call failed in a way that may have left it out of step
/// (a lost connection, a timeout, a call dropped half way) goes back to the
/// pool through sqlx's return check, in a task of its own bounded by the
/// store's timeout: a connection whose network went silent (blackholed,
/// half-open) never answers that check, and unbounded it would hold its pool
/// slot until the kernel gave up on the socket, minutes later, leaving a pool
/// that answers nothing but acquire timeouts long after the network healed
/// (seen under a blackholing proxy). Past the bound it is dropped instead.
pub(crate) struct Checkout {
    conn: Option<PooledConn>,
    since: Instant,
    bound: Duration,
    held: Arc<Held>,
    clean: bool,
}

impl Checkout {
    /// A connection for one call: a held one (unless idle too long, too old,
    /// or its pool closed) or one from the pool.
    pub(crate) async fn take(
        pool: &PgPool,
        held: &Arc<Held>,
        timeout: Duration,
    ) -> Result<Checkout> {
        let (conn, since) = match Self::pop_idle(pool, held, timeout) {
            Some(kept) => kept,
            None => {
                held.waiting
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _waiting = Waiting(held);
                // One parked before this call was counted would wait for
                // calls that start later: take it.
                match Self::pop_idle(pool, held, timeout) {
                    Some(kept) => kept,
                    // Boxed: sqlx's acquire future is 8.6 KB, and unboxed it
                    // made every call's future 18 KB, copied at each await
                    // layer (about 1 µs of memmove a claim). A store that holds
                    // its connections rarely takes this path.
                    None => (
                        Box::pin(pool.acquire())
                            .await
                            .map_err(|e| crate::error::map(e, timeout))?,
                        Instant::now(),
                    ),
                }
            }
        };
        Ok(Checkout {
            conn: Some(conn),
            since,
            bound: timeout,
            held: Arc::clone(held),
            clean: false,
        })
    }

    /// A held connection fit for a call (not idle too long, not too old, its
    /// pool open); unfit ones go back to the pool through the bounded check.
    fn pop_idle(
        pool: &PgPool,
        held: &Arc<Held>,
        timeout: Duration,
    ) -> Option<(PooledConn, Instant)> {
        loop {
            let (conn, since, parked) = held.idle.lock().pop()?;
            if parked.elapsed() < Held::IDLE_FOR
                && since.elapsed() < PgStore::MAX_CONNECTION_LIFETIME
                && !pool.is_closed()
            {
                return Some((conn, since));
            }
            drop(Checkout {
                conn: Some(conn),
                since,
                bound: timeout,
                held: Arc::clone(held),
                clean: false,
            });
        }
    }

    /// Records whether the call left the connection clean: it answered, or the
    /// server refused the statement's effect (a lost lease, a corrupt row)
    /// with the connection ready for the next one.
    pub(crate) fn settle<T>(&mut self, result: &Result<T>) {
        self.clean = match result {
            Ok(_) => true,
            Err(e) => matches!(
                e,
                Error::LeaseLost { .. } | Error::CorruptRecord { .. } | Error::InvalidKey(_)
            ),
        };
    }
}

impl std::ops::Deref for Checkout {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn.as_deref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn.as_deref_mut().expect("present until dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if self.clean && self.since.elapsed() < PgStore::MAX_CONNECTION_LIFETIME {
            let mut idle = self.held.idle.lock();
            let waited_for = self.held.waiting.load(std::sync::atomic::Ordering::SeqCst) > 0;
            if idle.len() < self.held.keep && !waited_for {
                idle.push((conn, self.since, Instant::now()));
                return;
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            drop(conn.detach()); // no runtime: let it go without sqlx's return task
            return;
        };
        let back = conn.return_to_pool();
        let bound = self.bound;
        runtime.spawn(async move {
            if tokio::time::timeout(bound, back).await.is_err() {
                tracing::warn!(
                    ?bound,
                    "a Postgres connection did not answer its return check; dropped it"
                );
            }
        });
    }
}
