//! The Redis store runs the whole conformance suite twice:
//! - on a standalone server, a test per check (each test is a process under
//!   nextest, with a server of its own);
//! - on a three-master Cluster, every check in one test on one cluster: a
//!   cluster takes two seconds or more to start (a fresh master waits before it
//!   says the cluster is up), which a cluster per check paid 35 times.
//!
//! Every fixture gets a key prefix of its own; every racing handle a connection
//! of its own.

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::{run_all, FaultyHandle, Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error};
use dedupe_redis::RedisStore;
use dedupe_testkit::redis as support;
use tokio::sync::OnceCell;

/// Where the fixture's store lives.
#[derive(Clone)]
enum Place {
    Single(String),
    Cluster(Vec<String>),
}

impl Place {
    async fn open(&self, prefix: &str, timeout: Duration) -> Result<RedisStore, Error> {
        let builder = match self {
            Place::Single(url) => RedisStore::builder(url.clone()),
            Place::Cluster(urls) => RedisStore::cluster_builder(urls.clone()),
        };
        builder.prefix(prefix).timeout(timeout).connect().await
    }
}

/// Owns the servers for one test: they are stopped when the factory drops at the
/// end of the test (a `static` would never drop, and leak a server per process).
struct RedisFactory {
    cluster: bool,
    single: OnceCell<(Option<support::RedisServer>, String)>,
    clusters: OnceCell<(Option<support::RedisCluster>, Vec<String>)>,
}

impl RedisFactory {
    fn new(cluster: bool) -> Self {
        Self {
            cluster,
            single: OnceCell::new(),
            clusters: OnceCell::new(),
        }
    }
}

struct RedisFixture {
    place: Place,
    prefix: String,
    store: RedisStore,
}

#[async_trait]
impl StoreFactory for RedisFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let place = if self.cluster {
            let (_, urls) = self
                .clusters
                .get_or_init(|| async {
                    tokio::task::spawn_blocking(support::cluster)
                        .await
                        .expect("cluster")
                })
                .await;
            Place::Cluster(urls.clone())
        } else {
            let (_, url) = self
                .single
                .get_or_init(|| async {
                    tokio::task::spawn_blocking(support::server)
                        .await
                        .expect("server")
                })
                .await;
            Place::Single(url.clone())
        };
        let prefix = support::unique_prefix("conf");
        let store = place.open(&prefix, Duration::from_secs(10)).await?;
        Ok(Box::new(RedisFixture {
            place,
            prefix,
            store,
        }))
    }
}

#[async_trait]
impl Fixture for RedisFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.store.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(
            self.place
                .open(&self.prefix, Duration::from_secs(10))
                .await?,
        ))
    }

    /// On a single server: a handle through a loopback proxy the fixture owns,
    /// with a half-second timeout; the fault cuts the proxy. (A Cluster client
    /// learns the nodes' real addresses from the cluster and would go around a
    /// proxy, so the Cluster suite reports this check as skipped.)
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        let Place::Single(url) = &self.place else {
            return Ok(None);
        };
        let (proxy, via) = dedupe_testkit::proxied(url)
            .await
            .map_err(|e| Error::unavailable("proxy", Some(Box::new(e))))?;
        let timeout = Duration::from_millis(500);
        let store = RedisStore::builder(via)
            .prefix(&self.prefix)
            .timeout(timeout)
            .connect()
            .await?;
        Ok(Some(FaultyHandle {
            store: Arc::new(store),
            switch: Box::new(dedupe_testkit::ProxyFault(proxy)),
            bound: timeout * 2 + Duration::from_millis(500),
        }))
    }
}

mod standalone {
    dedupe_conformance::suite!(super::RedisFactory::new(false));
}

/// The whole suite on one Cluster. It skips three checks, as the standalone
/// tests do for the first: `expire()` (Redis expires records itself), and the
/// two that need a proxy in the way, the cut connection and the lost answer (a
/// Cluster client learns the nodes' own addresses and would go around a proxy,
/// see `faulty_handle`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_passes_the_whole_suite() {
    let report = run_all(&RedisFactory::new(true)).await;
    println!("{report}");
    assert!(report.all_passed(), "{report}");
    let mut skipped: Vec<&str> = report.skipped().map(|(name, _)| name).collect();
    skipped.sort_unstable();
    assert_eq!(
        skipped,
        [
            "errors_are_not_answers",
            "expire_removes_exactly_expired",
            "resent_requests_answer_as_the_first"
        ],
        "{report}"
    );
}
