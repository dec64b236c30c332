//! # dedupe-testkit
//!
//! Real servers for the workspace's tests, owned by the test that starts them:
//! free loopback ports, temp dirs, stop and restart on demand, stopped on drop.
//! Not published; store crates and the CLI take it as a dev-dependency.

mod crash;
pub mod dynamo;
pub mod faults;
pub mod mysql;
pub mod postgres;
pub mod proxy;
pub mod redis;
pub mod rounds;

use std::future::Future;
use std::time::{Duration, Instant};

pub use mysql::{server as mysql_server, MariaDbServer};
pub use postgres::{server as postgres_server, unique_schema, PgCluster};

#[doc(hidden)]
pub use dedupe_conformance as __conformance;
pub use proxy::{proxied, reroute, ProxiesFault, ProxyFault, TcpProxy};

/// Polls `f` every 20 ms until it answers true, for at most `limit`; answers
/// whether it did. For waiting on an observable condition, never on time alone.
pub async fn eventually<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let since = Instant::now();
    while since.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
