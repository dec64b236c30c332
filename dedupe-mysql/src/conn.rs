//! The connection a call runs on, and how it goes back to the pool.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use dedupe_core::Result;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool};

/// A pool connection for one call.
///
/// A call that ran to its end (an answer or an error) gives its connection
/// back through sqlx's return check (a ping), bounded by the store's timeout:
/// a connection that does not answer it is dropped, and its pool slot with
/// it. A call stopped part-way (its timeout fired, its future was dropped)
/// leaves its connection out of step with the server: it is closed, never
/// reused. Before this, a blackhole of 2.5 s left all eight connections of a
/// pool waiting forever on their return ping, and the store answered
/// "pool timed out" until it was rebuilt.
pub(crate) struct Checkout {
    conn: Option<PoolConnection<MySql>>,
    finished: bool,
    bound: Duration,
}

impl Checkout {
    pub(crate) async fn take(pool: &MySqlPool, timeout: Duration) -> Result<Self> {
        let conn = pool
            .acquire()
            .await
            .map_err(|e| crate::error::map(e, timeout))?;
        Ok(Self {
            conn: Some(conn),
            finished: false,
            bound: timeout,
        })
    }

    /// The call ran to its end: the connection may go back to the pool.
    pub(crate) fn finish(mut self) {
        self.finished = true;
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
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let runtime = tokio::runtime::Handle::try_current();
        match runtime {
            Ok(runtime) if self.finished => {
                let (back, bound) = (conn.return_to_pool(), self.bound);
                runtime.spawn(async move {
                    if tokio::time::timeout(bound, back).await.is_err() {
                        tracing::warn!(
                            ?bound,
                            "a MySQL connection did not answer its return check; dropped it"
                        );
                    }
                });
            }
            // Stopped part-way, or no runtime to run the return check on:
            // out of the pool, socket closed.
            _ => drop(conn.detach()),
        }
    }
}
