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

/// Whether `signal` (an inbox's wake-up, `Inbox::wake`) is raised within
/// `limit` of `change`, listening from before it; panics when the change
/// fails.
pub async fn wakes<T, E: std::fmt::Debug>(
    signal: &tokio::sync::Notify,
    limit: Duration,
    change: impl Future<Output = Result<T, E>>,
) -> bool {
    let woken = signal.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    change.await.expect("the change");
    tokio::time::timeout(limit, woken).await.is_ok()
}

/// Asserts that `applied` (a SQL store's `MIGRATIONS`) is every file of the
/// crate's `folder` (its `migrations/`), in the order of their numbers
/// (`0001_what.sql`, `0002_...`), text for text: a file added but not
/// applied, applied out of order, or misnamed fails.
pub fn assert_migrations_applied(folder: &str, applied: &[&str]) {
    let mut files: Vec<_> = std::fs::read_dir(folder)
        .expect("migrations folder")
        .map(|entry| entry.expect("entry").path())
        .collect();
    files.sort();
    let texts: Vec<String> = files
        .iter()
        .map(|path| std::fs::read_to_string(path).expect("migration"))
        .collect();
    assert_eq!(texts, applied, "migrations/ holds {files:?}");
    for (n, path) in files.iter().enumerate() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        assert!(
            name.starts_with(&format!("{:04}_", n + 1)) && name.ends_with(".sql"),
            "{name} is not migration {}",
            n + 1
        );
    }
}
