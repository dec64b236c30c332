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

/// How to open a connection like the one a store started with.
pub(crate) enum Rebuild {
    /// A lazily connecting `ConnectionManager` for one server.
    Single(redis::Client, ConnectionManagerConfig),
    /// A new Cluster connection: new connections to the nodes it lists, and
    /// a slot map read afresh (so slots failed over since are found).
    Cluster(redis::cluster::ClusterClient),
}

/// The TCP settings of every connection a store opens: no Nagle delay, and
/// a socket the kernel closes when the other end stops answering at the TCP
/// level (unacknowledged data for `2 x timeout`, or an idle connection whose
/// keepalive probes, from `timeout` on, go unanswered), so a connection to a
/// host that vanished is noticed by the driver and opened again.
pub(crate) fn tcp_settings(timeout: std::time::Duration) -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    let probe = timeout.max(std::time::Duration::from_secs(1));
    let settings = redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(
            TcpKeepalive::new()
                .with_time(probe)
                .with_interval(probe)
                .with_retries(3),
        );
    #[cfg(target_os = "linux")]
    let settings = settings.set_user_timeout(timeout * 2);
    settings
}

/// The connection every call clones, and how to replace it.
///
/// A multiplexed connection whose call timed out may be half-open (a network
/// that swallows packets, a server that froze): redis-rs reconnects on
/// dropped connections but not on timeouts (a Cluster connection retries the
/// same node at once), so such a connection would time out every call until
/// the kernel gave up on the socket, minutes later (seen under a blackholing
/// proxy, and with a frozen Cluster primary whose slots had already failed
/// over to its replica), and replies arriving late are out of step with the
/// calls still waiting. After a timeout the store swaps in a fresh connection
/// for a server or Cluster it connected itself: at once a lazily connecting
/// `ConnectionManager` for one server; a Cluster connection built in the
/// background (it connects to the nodes and reads the slot map first), one at
/// a time. Calls already holding the old one finish on it, and it closes when
/// the last of them lets go.
#[derive(Clone)]
pub(crate) struct Link {
    current: Arc<std::sync::RwLock<(u64, Conn)>>,
    rebuild: Option<Arc<Rebuild>>,
    /// A Cluster connection is being built in the background.
    rebuilding: Arc<std::sync::atomic::AtomicBool>,
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
    pub(crate) fn new(conn: Conn, rebuild: Option<Rebuild>) -> Self {
        Self {
            current: Arc::new(std::sync::RwLock::new((0, conn))),
            rebuild: rebuild.map(Arc::new),
            rebuilding: Arc::default(),
        }
    }

    /// The current connection and its generation.
    pub(crate) fn get(&self) -> (u64, Conn) {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts `conn` in place of connection `generation`, unless another call
    /// replaced it already.
    fn swap(&self, generation: u64, conn: Conn) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if current.0 == generation {
            *current = (generation + 1, conn);
            tracing::warn!("a Redis call timed out; the connection was replaced");
        }
    }

    /// Replaces connection `generation` after one of its calls timed out,
    /// unless another call already did.
    pub(crate) fn replace(&self, generation: u64) {
        let Some(rebuild) = &self.rebuild else {
            return;
        };
        if self.get().0 != generation {
            return;
        }
        match &**rebuild {
            Rebuild::Single(client, config) => {
                match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
                    Ok(fresh) => self.swap(generation, Conn::Single(fresh)),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "could not replace a timed-out Redis connection"
                    ),
                }
            }
            Rebuild::Cluster(client) => {
                use std::sync::atomic::Ordering;
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                if self.rebuilding.swap(true, Ordering::SeqCst) {
                    return;
                }
                let (link, client) = (self.clone(), client.clone());
                runtime.spawn(async move {
                    match client.get_async_connection().await {
                        Ok(fresh) => link.swap(generation, Conn::Cluster(fresh)),
                        Err(e) => tracing::warn!(
                            error = %e,
                            "could not replace a timed-out Redis Cluster connection"
                        ),
                    }
                    link.rebuilding.store(false, Ordering::SeqCst);
                });
            }
        }
    }
    /// Replaces connection `generation` when `result` is a timeout.
    pub(crate) fn after<T>(&self, generation: u64, result: &dedupe_core::Result<T>) {
        if matches!(result, Err(dedupe_core::Error::Timeout { .. })) {
            self.replace(generation);
        }
    }
}
