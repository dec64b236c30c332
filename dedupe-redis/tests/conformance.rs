//! The Redis store runs the whole conformance suite three times:
//! - on a standalone server, a test per check (each test is a process under
//!   nextest, with a server of its own);
//! - on a three-master Cluster, every check in one test on one cluster: a
//!   cluster takes two seconds or more to start (a fresh master waits before it
//!   says the cluster is up), which a cluster per check paid 35 times;
//! - on a primary with one replica, every store waiting for it after each
//!   write (`wait_for_replicas`: every write goes out in a pipeline with its
//!   `WAIT`, on a connection of its own), every check in one test.
//!
//! Every fixture gets a key prefix of its own; every racing handle a connection
//! of its own.

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::{run_all, FaultyHandle, Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error, Inbox};
use dedupe_redis::RedisStore;
use dedupe_testkit::redis as support;
use tokio::sync::OnceCell;

/// Where the fixture's store lives.
#[derive(Clone)]
enum Place {
    Single(String),
    Cluster(Vec<String>),
    /// A primary with a replica: every store waits for it after each write.
    Replicated(String),
}

impl Place {
    async fn open(&self, prefix: &str, timeout: Duration) -> Result<RedisStore, Error> {
        self.open_at(None, prefix, timeout).await
    }

    /// Opens on `via` (a proxy's URL) instead of the place's own address.
    async fn open_at(
        &self,
        via: Option<String>,
        prefix: &str,
        timeout: Duration,
    ) -> Result<RedisStore, Error> {
        let builder = match self {
            Place::Single(url) => RedisStore::builder(via.unwrap_or_else(|| url.clone())),
            // A namespace's records and its inbox index must share a slot.
            Place::Cluster(urls) => {
                RedisStore::cluster_builder(urls.clone()).namespace_hash_tags(true)
            }
            Place::Replicated(url) => RedisStore::builder(via.unwrap_or_else(|| url.clone()))
                .wait_for_replicas(1, timeout / 2),
        };
        builder.prefix(prefix).timeout(timeout).connect().await
    }

    fn url(&self) -> Option<&str> {
        match self {
            Place::Single(url) | Place::Replicated(url) => Some(url),
            Place::Cluster(_) => None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Single,
    Cluster,
    Replicated,
}

/// A private primary and its replica, synced.
struct Pair {
    primary: support::RedisServer,
    _replica: support::RedisServer,
}

impl Pair {
    fn start() -> Self {
        let primary = support::RedisServer::start();
        let replica = support::RedisServer::start_with(support::RedisOptions {
            replica_of: Some(primary.port),
            ..support::RedisOptions::default()
        });
        support::wait_for_replicas(primary.port, 1);
        Self {
            primary,
            _replica: replica,
        }
    }
}

/// Owns the servers for one test: they are stopped when the factory drops at the
/// end of the test (a `static` would never drop, and leak a server per process).
struct RedisFactory {
    mode: Mode,
    single: OnceCell<(Option<support::RedisServer>, String)>,
    clusters: OnceCell<(Option<support::RedisCluster>, Vec<String>)>,
    pair: OnceCell<Pair>,
}

impl RedisFactory {
    fn new(mode: Mode) -> Self {
        Self {
            mode,
            single: OnceCell::new(),
            clusters: OnceCell::new(),
            pair: OnceCell::new(),
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
        let place = if self.mode == Mode::Replicated {
            let pair = self
                .pair
                .get_or_init(|| async {
                    tokio::task::spawn_blocking(Pair::start)
                        .await
                        .expect("primary and replica")
                })
                .await;
            Place::Replicated(pair.primary.url())
        } else if self.mode == Mode::Cluster {
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

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        Some(Arc::new(self.store.clone()))
    }

    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(Some(Arc::new(
            self.place
                .open(&self.prefix, Duration::from_secs(10))
                .await?,
        )))
    }

    /// A handle through loopback proxies the fixture owns, with a half-second
    /// timeout; the fault cuts the proxies. On a Cluster, one proxy per node,
    /// and the client maps each node's address (as the cluster announces it)
    /// to its proxy (`node_address_map`).
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        let timeout = Duration::from_millis(500);
        let Some(url) = self.place.url() else {
            let Place::Cluster(urls) = &self.place else {
                return Ok(None);
            };
            let (store, proxies) = cluster_through_proxies(urls, &self.prefix, timeout).await?;
            return Ok(Some(FaultyHandle {
                store: Arc::new(store),
                switch: Box::new(dedupe_testkit::ProxiesFault(proxies)),
                bound: timeout * 2 + Duration::from_millis(500),
            }));
        };
        let (proxy, via) = dedupe_testkit::proxied(url)
            .await
            .map_err(|e| Error::unavailable("proxy", Some(Box::new(e))))?;
        let store = self.place.open_at(Some(via), &self.prefix, timeout).await?;
        Ok(Some(FaultyHandle {
            store: Arc::new(store),
            switch: Box::new(dedupe_testkit::ProxyFault(proxy)),
            bound: timeout * 2 + Duration::from_millis(500),
        }))
    }
}

/// A store on the Cluster whose every node connection goes through a proxy
/// of its own: the client maps each node's announced address to its proxy.
pub(crate) async fn cluster_through_proxies(
    urls: &[String],
    prefix: &str,
    timeout: Duration,
) -> Result<(RedisStore, Vec<dedupe_testkit::TcpProxy>), Error> {
    let (map, initial, proxies) = dedupe_testkit::redis::proxy_every_node(urls)
        .await
        .map_err(|e| Error::unavailable("proxy", Some(Box::new(e))))?;
    let store = RedisStore::cluster_builder(initial)
        .namespace_hash_tags(true)
        .cluster_address_map(map)
        .prefix(prefix)
        .timeout(timeout)
        .connect()
        .await?;
    Ok((store, proxies))
}

mod standalone {
    dedupe_conformance::suite!(super::RedisFactory::new(super::Mode::Single));
}

/// The whole suite on one Cluster, the faults through a proxy per node
/// included, with namespace hash tags (the inbox needs them; the untagged
/// layout's spread over the nodes is tested in `redis.rs`). It skips
/// `expire()` alone (Redis expires records itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_passes_the_whole_suite() {
    let report = run_all(&RedisFactory::new(Mode::Cluster)).await;
    println!("{report}");
    assert!(report.all_passed(), "{report}");
    let skipped: Vec<&str> = report.skipped().map(|(name, _)| name).collect();
    assert_eq!(skipped, ["expire_removes_exactly_expired"], "{report}");
}

/// The whole suite on a primary with one replica, every store waiting for it
/// after each write: the pipelined path of every operation, the faults through
/// a proxy in front of the primary included. Skips `expire()` and per-key
/// order, as the Cluster run does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicated_with_waits_passes_the_whole_suite() {
    let report = run_all(&RedisFactory::new(Mode::Replicated)).await;
    println!("{report}");
    assert!(report.all_passed(), "{report}");
    let skipped: Vec<&str> = report.skipped().map(|(name, _)| name).collect();
    assert_eq!(skipped, ["expire_removes_exactly_expired"], "{report}");
}
