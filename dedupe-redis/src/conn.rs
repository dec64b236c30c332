//! The connection underneath a store: one server or a Cluster, and the link
//! that replaces a connection a call gave up on.

use std::sync::Arc;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// The connection underneath: one server (through a reconnecting
/// `ConnectionManager`) or a Cluster (redis-rs follows `MOVED`/`ASK`).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Conn::Single(_) => "Conn::Single",
            Conn::Cluster(_) => "Conn::Cluster",
        })
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The connection every call clones, and how to replace it.
///
/// A multiplexed connection whose call timed out may be half-open (a network
/// that swallows packets, a server that froze): redis-rs reconnects on
/// dropped connections but not on timeouts, so such a connection would time
/// out every call until the kernel gave up on the socket, minutes later (seen
/// under a blackholing proxy), and replies arriving late are out of step with
/// the calls still waiting. After a timeout the store swaps in a fresh,
/// lazily connecting `ConnectionManager` for a server it connected itself;
/// calls already holding the old one finish on it, and it closes when the last
/// of them lets go.
#[derive(Clone)]
pub(crate) struct Link {
    current: Arc<std::sync::RwLock<(u64, Conn)>>,
    rebuild: Option<Arc<(redis::Client, ConnectionManagerConfig)>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (generation, conn) = self.get();
        f.debug_struct("Link")
            .field("conn", &conn)
            .field("generation", &generation)
            .field("replaceable", &self.rebuild.is_some())
            .finish()
    }
}

impl Link {
    pub(crate) fn new(
        conn: Conn,
        rebuild: Option<(redis::Client, ConnectionManagerConfig)>,
    ) -> Self {
        Self {
            current: Arc::new(std::sync::RwLock::new((0, conn))),
            rebuild: rebuild.map(Arc::new),
        }
    }

    /// The current connection and its generation.
    pub(crate) fn get(&self) -> (u64, Conn) {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces connection `generation` after one of its calls timed out,
    /// unless another call already did.
    pub(crate) fn replace(&self, generation: u64) {
        let Some(rebuild) = &self.rebuild else {
            return;
        };
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if current.0 != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(rebuild.0.clone(), rebuild.1.clone()) {
            Ok(fresh) => {
                *current = (generation + 1, Conn::Single(fresh));
                tracing::warn!("a Redis call timed out; the connection was replaced");
            }
            Err(e) => tracing::warn!(error = %e, "could not replace a timed-out Redis connection"),
        }
    }

    /// Replaces connection `generation` when `result` is a timeout.
    pub(crate) fn after<T>(&self, generation: u64, result: &dedupe_core::Result<T>) {
        if matches!(result, Err(dedupe_core::Error::Timeout { .. })) {
            self.replace(generation);
        }
    }
}
