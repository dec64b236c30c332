//! The store's settings, and connecting it.

use std::time::Duration;

use dedupe_core::backend::{check_ttl, duration_millis};
use dedupe_core::{Capabilities, Error, Result};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;

use crate::conn::{Conn, Link};
use crate::store::RedisStore;

/// Where a [`RedisBuilder`] connects.
#[derive(Clone)]
pub(crate) enum Target {
    Url(String),
    Cluster(Vec<String>),
    Conn(Conn),
}

/// Settings of a [`RedisStore`]; start with [`RedisStore::builder`].
#[derive(Clone)]
pub struct RedisBuilder {
    pub(crate) target: Target,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) grace: Duration,
    pub(crate) max_outcome_bytes: usize,
    pub(crate) wait_replicas: Option<(u32, Duration)>,
    pub(crate) root_cert: Option<Vec<u8>>,
    pub(crate) allow_eviction: bool,
    pub(crate) address_map:
        Option<std::collections::HashMap<redis::cluster::NodeAddress, redis::cluster::NodeAddress>>,
    pub(crate) hash_tags: bool,
}

impl std::fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

/// Checks a key prefix: 2 to 64 bytes, letters, digits and `_ . - /`, ending in
/// one `:` and holding no other. A record key is `prefix namespace : id`, and
/// a namespace never holds `:`, so the first `:` of a record key ends its
/// prefix: two stores with different prefixes never share a record key
/// (`a:` and `a:b:` would: namespace `b` under the first is the second's
/// prefix), and an empty prefix is refused for the same reason. No spaces,
/// quotes, braces (a Cluster hash tag) or anything a shell or a `SCAN`
/// pattern would trip on.
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    let ok = (2..=64).contains(&prefix.len())
        && prefix.ends_with(':')
        && prefix[..prefix.len() - 1]
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "redis key prefix {prefix:?} must be 1 to 63 of [A-Za-z0-9_./-] then one ':' \
             (one colon, at the end, so no two stores' keys can meet)"
        )))
    }
}

/// Checks the settings of [`RedisBuilder::wait_for_replicas`].
pub(crate) fn check_wait(replicas: u32, wait: Duration, timeout: Duration) -> Result<()> {
    if replicas == 0 {
        return Err(Error::config(
            "wait_for_replicas needs at least 1 replica to wait for",
        ));
    }
    // `WAIT n 0` blocks until n replicas answer, however long that takes.
    if wait < Duration::from_millis(1) {
        return Err(Error::config(format!(
            "the replica wait ({wait:?}) must be at least 1 ms (WAIT with 0 ms waits forever)"
        )));
    }
    if wait >= timeout {
        return Err(Error::config(format!(
            "the replica wait ({wait:?}) must be shorter than the timeout ({timeout:?})"
        )));
    }
    Ok(())
}

impl RedisBuilder {
    /// Prefix of every record key (default `dedupe:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bound on each operation (default 2 s): the response timeout of the
    /// connection, and the time a call waits for a reconnect. Past it the call
    /// fails with a retryable [`Error::Timeout`]. A claim that timed out may still
    /// have run on the server: retry it with the same claim id to be handed the
    /// same lease.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long an in-flight record's key outlives its lease (default 24 h), so
    /// that a delivery arriving after a worker died still finds the record, takes
    /// it over and counts the attempt. Past it, Redis removes the key and the
    /// next claim starts over at attempt 1.
    pub fn takeover_window(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// After every write (a claim that wins, a completion, an extension, a
    /// release, a forget), waits (`WAIT`) until `replicas` replicas have it,
    /// for at most `timeout`; fewer is a retryable error, and the write stands
    /// on the primary (a claim: retry with the same claim id; a completion:
    /// retry `complete` with the same outcome, which answers Ok and waits
    /// again). For deployments where a failover must not lose an answered
    /// write: without it, a primary that dies before its replica has a
    /// completion takes the completion with it, and the event runs again.
    ///
    /// Each write and its `WAIT` go in one pipeline on a connection of their
    /// own (a waiting connection holds every call queued behind it), routed
    /// to the key's node on a Cluster. `replicas` is at least 1; `timeout` at
    /// least 1 ms (`WAIT n 0` would wait forever) and shorter than the
    /// store's [`timeout`](Self::timeout). The store must open its own
    /// connections (not [`RedisStore::builder_with_manager`] or
    /// [`RedisStore::builder_with_cluster`]).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas = Some((replicas, timeout));
        self
    }

    /// Opens on a server whose `maxmemory-policy` may evict records (anything
    /// but `noeviction` while `maxmemory` is set), which [`connect`](Self::connect)
    /// otherwise refuses: an evicted record lets a second claim of its event
    /// win. For caches shared with other data where the operator accepts that.
    pub fn allow_eviction(mut self, allow: bool) -> Self {
        self.allow_eviction = allow;
        self
    }

    /// On a Cluster, connects to each node the cluster announces at the
    /// address this map gives for it instead (nodes behind NAT or in
    /// containers, which announce addresses clients cannot reach; a TLS
    /// certificate issued for a name, not the announced IP). Redirects still
    /// name the announced addresses.
    pub fn cluster_address_map(
        mut self,
        map: std::collections::HashMap<redis::cluster::NodeAddress, redis::cluster::NodeAddress>,
    ) -> Self {
        self.address_map = Some(map);
        self
    }

    /// Puts each namespace's keys under a Cluster hash tag (`dedupe:{stripe}:evt_1`
    /// instead of `dedupe:stripe:evt_1`), so that a namespace's records and its
    /// inbox index share one slot, on one node: the [`Inbox`](dedupe_core::Inbox)
    /// on a Cluster needs it (its take reads the index and leases the items in
    /// one script), and refuses to run without it. The cost: a namespace's
    /// claims all go to one primary instead of spreading over the Cluster
    /// (spread namespaces instead: `stripe-eu`, `stripe-us`). Default off.
    ///
    /// It changes every key name, on one server as on a Cluster: records
    /// written before under the untagged names are not seen (their events
    /// would run again). Switch it on for a new prefix or an empty store.
    pub fn namespace_hash_tags(mut self, on: bool) -> Self {
        self.hash_tags = on;
        self
    }

    /// Trusts this CA certificate (PEM) for `rediss://` instead of the system's
    /// roots: a private CA, as test servers and some managed services use.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_cert = Some(pem.into());
        self
    }

    /// Connects (or takes the caller's connection) and builds the store. Refuses
    /// (a configuration error naming the setting) a server older than Redis 7.0
    /// and one that may evict records (see [`allow_eviction`](Self::allow_eviction)),
    /// on every primary of a Cluster.
    pub async fn connect(self) -> Result<RedisStore> {
        check_prefix(&self.prefix)?;
        if self.timeout.is_zero() {
            return Err(Error::config("timeout must be above zero"));
        }
        check_ttl("takeover window", self.grace)?;
        let on_cluster = matches!(
            self.target,
            Target::Cluster(_) | Target::Conn(Conn::Cluster(_))
        );
        if let Some((replicas, wait)) = self.wait_replicas {
            check_wait(replicas, wait, self.timeout)?;
            if matches!(self.target, Target::Conn(_)) {
                return Err(Error::config(
                    "wait_for_replicas needs a store that opens its own connections \
                     (RedisStore::builder or cluster_builder), one of them for the waits",
                ));
            }
        }
        #[cfg(feature = "tls")]
        crate::install_crypto_provider();
        let timeout = self.timeout;
        let topology = if on_cluster {
            crate::error::Topology::Cluster
        } else {
            crate::error::Topology::Standalone
        };
        let map = |e| crate::error::map(e, timeout, None, topology);
        let mut wait_link = None;
        // Where the wake-up subscription connects (none on a caller's
        // connection).
        let mut wake_clients = Vec::new();
        let link = match self.target {
            Target::Conn(conn) => Link::new(conn, None),
            Target::Url(url) => {
                let client = client_for(&url, self.root_cert.as_deref(), timeout)?;
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(2)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_millis(200))
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout));
                let open = || async {
                    let manager = tokio::time::timeout(
                        timeout * 2,
                        ConnectionManager::new_with_config(client.clone(), config.clone()),
                    )
                    .await
                    .map_err(|_| Error::timeout(timeout * 2))?
                    .map_err(map)?;
                    Ok::<_, Error>(Link::new(
                        Conn::Single(manager),
                        Some(crate::conn::Rebuild::Single(client.clone(), config.clone())),
                    ))
                };
                if self.wait_replicas.is_some() {
                    wait_link = Some(open().await?);
                }
                wake_clients.push(client.clone());
                open().await?
            }
            Target::Cluster(urls) => {
                for url in &urls {
                    wake_clients.push(client_for(url, self.root_cert.as_deref(), timeout)?);
                }
                let builder = ClusterClientBuilder::new(urls.iter().map(String::as_str));
                #[cfg(feature = "tls")]
                let builder = match self.root_cert {
                    Some(pem) => builder.certs(redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem),
                    }),
                    None => builder,
                };
                let builder = match self.address_map {
                    Some(map) => builder.node_address_map(map),
                    None => builder,
                };
                let client = builder
                    .tcp_settings(crate::conn::tcp_settings(timeout))
                    .retries(2)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .build()
                    .map_err(|e| Error::config(format!("redis cluster URLs {urls:?}: {e}")))?;
                let open = || async {
                    let conn = tokio::time::timeout(timeout * 2, client.get_async_connection())
                        .await
                        .map_err(|_| Error::timeout(timeout * 2))?
                        .map_err(map)?;
                    Ok::<_, Error>(Link::new(
                        Conn::Cluster(conn),
                        Some(crate::conn::Rebuild::Cluster(client.clone())),
                    ))
                };
                if self.wait_replicas.is_some() {
                    wait_link = Some(open().await?);
                }
                open().await?
            }
        };
        let (_, mut conn) = link.get();
        crate::server::preflight(&mut conn, self.allow_eviction, map).await?;
        let wake_channel = crate::wake::channel(&self.prefix);
        let wake = (!wake_clients.is_empty())
            .then(|| crate::wake::subscribe(wake_clients, wake_channel.clone(), timeout));
        Ok(RedisStore {
            wake,
            wake_channel,
            link,
            hash_tags: self.hash_tags,
            prefix: self.prefix,
            timeout,
            grace_ms: duration_millis(self.grace),
            caps: Capabilities::new()
                .with_expires_by_itself(true)
                .with_explicit_expire(false)
                .with_max_outcome_bytes(self.max_outcome_bytes),
            wait: self
                .wait_replicas
                .zip(wait_link)
                .map(|((replicas, timeout), link)| crate::ops::Wait {
                    replicas,
                    timeout,
                    link,
                }),
        })
    }
}

/// A client of one server at `url`, with the store's TCP settings, trusting
/// `root_cert` (PEM) for `rediss://` where given.
fn client_for(url: &str, root_cert: Option<&[u8]>, timeout: Duration) -> Result<redis::Client> {
    use redis::IntoConnectionInfo;
    let bad_url = |e: redis::RedisError| Error::config(format!("redis URL {url:?}: {e}"));
    let info = url
        .into_connection_info()
        .map_err(bad_url)?
        .set_tcp_settings(crate::conn::tcp_settings(timeout));
    match root_cert {
        #[cfg(feature = "tls")]
        Some(pem) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.to_vec()),
            },
        )
        .map_err(bad_url),
        _ => redis::Client::open(info).map_err(bad_url),
    }
}
