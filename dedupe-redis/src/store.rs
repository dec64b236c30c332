//! The Redis store: builder, connections (standalone or Cluster) and the
//! `DedupeStore` implementation, each operation one script, one round trip.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{self, check_ttl, duration_millis, from_millis, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease,
    Record, Result, DEFAULT_MAX_OUTCOME_BYTES,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::codec;
use crate::scripts::SCRIPTS;

/// The connection underneath: one server (through a reconnecting
/// `ConnectionManager`) or a Cluster (redis-rs follows `MOVED`/`ASK`).
#[derive(Clone)]
enum Conn {
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
struct Link {
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
    fn new(conn: Conn, rebuild: Option<(redis::Client, ConnectionManagerConfig)>) -> Self {
        Self {
            current: Arc::new(std::sync::RwLock::new((0, conn))),
            rebuild: rebuild.map(Arc::new),
        }
    }

    /// The current connection and its generation.
    fn get(&self) -> (u64, Conn) {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces connection `generation` after one of its calls timed out,
    /// unless another call already did.
    fn replace(&self, generation: u64) {
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
}

/// What the server promises about keeping a claim across a restart, as its
/// configuration says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// No append-only file: a restart loses every record written since the last
    /// snapshot (if any), so redelivered events run their work again. (Whatever
    /// the persistence, a `maxmemory-policy` other than `noeviction` can evict
    /// records, every one of which has a TTL: run with `noeviction`.)
    NotPersistent,
    /// Append-only file with the given `appendfsync` policy: `always` loses
    /// nothing on a crash; `everysec` up to a second of writes; `no` whatever the
    /// OS had not flushed.
    AppendOnly {
        /// The `appendfsync` setting.
        fsync: String,
    },
    /// `CONFIG` is disabled or refused (managed services): ask the provider.
    Unknown,
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Durability::NotPersistent => {
                f.write_str("not persistent (appendonly no): a restart loses claims")
            }
            Durability::AppendOnly { fsync } => write!(f, "append-only file, appendfsync {fsync}"),
            Durability::Unknown => f.write_str("unknown (CONFIG GET refused or unanswered)"),
        }
    }
}

/// Where a [`RedisBuilder`] connects.
#[derive(Clone)]
enum Target {
    Url(String),
    Cluster(Vec<String>),
    Conn(Conn),
}

/// Settings of a [`RedisStore`]; start with [`RedisStore::builder`].
#[derive(Clone)]
pub struct RedisBuilder {
    target: Target,
    prefix: String,
    timeout: Duration,
    grace: Duration,
    max_outcome_bytes: usize,
    wait_replicas: Option<(u32, Duration)>,
    root_cert: Option<Vec<u8>>,
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

/// Checks a key prefix: at most 64 bytes of letters, digits and `_ . - : /`
/// (no spaces, quotes or anything a shell or a `KEYS` pattern would trip on).
fn check_prefix(prefix: &str) -> Result<()> {
    let ok = prefix.len() <= 64
        && prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | ':' | '/'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "redis key prefix {prefix:?} must be at most 64 of [A-Za-z0-9_.:/-]"
        )))
    }
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

    /// After each winning claim, waits (`WAIT`) until `replicas` replicas have
    /// the write, for at most `timeout`; fewer is a retryable error (the claim
    /// stands; retry with the same claim id). For deployments where a failover
    /// must not lose a claim. Standalone servers with replicas only; `timeout`
    /// must be shorter than the store's [`timeout`](Self::timeout).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas = Some((replicas, timeout));
        self
    }

    /// Trusts this CA certificate (PEM) for `rediss://` instead of the system's
    /// roots: a private CA, as test servers and some managed services use.
    #[cfg(feature = "tls")]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_cert = Some(pem.into());
        self
    }

    /// Connects (or takes the caller's connection) and builds the store.
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
        if on_cluster && self.wait_replicas.is_some() {
            return Err(Error::config(
                "wait_for_replicas is for standalone servers, not a Cluster",
            ));
        }
        if let Some((_, wait)) = self.wait_replicas {
            if wait >= self.timeout {
                return Err(Error::config(format!(
                    "the replica wait ({wait:?}) must be shorter than the timeout ({:?})",
                    self.timeout
                )));
            }
        }
        #[cfg(feature = "tls")]
        crate::install_crypto_provider();
        let timeout = self.timeout;
        let map = |e| crate::error::map(e, timeout, None);
        let link = match self.target {
            Target::Conn(conn) => Link::new(conn, None),
            Target::Url(url) => {
                let bad_url =
                    |e: redis::RedisError| Error::config(format!("redis URL {url:?}: {e}"));
                let client = match self.root_cert {
                    #[cfg(feature = "tls")]
                    Some(pem) => redis::Client::build_with_tls(
                        url.as_str(),
                        redis::TlsCertificates {
                            client_tls: None,
                            root_cert: Some(pem),
                        },
                    )
                    .map_err(bad_url)?,
                    _ => redis::Client::open(url.as_str()).map_err(bad_url)?,
                };
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(2)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_millis(200))
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout));
                let rebuild = (client.clone(), config.clone());
                let manager = tokio::time::timeout(
                    timeout * 2,
                    ConnectionManager::new_with_config(client, config),
                )
                .await
                .map_err(|_| Error::Timeout {
                    after: timeout * 2,
                    source: None,
                })?
                .map_err(map)?;
                Link::new(Conn::Single(manager), Some(rebuild))
            }
            Target::Cluster(urls) => {
                let builder = ClusterClientBuilder::new(urls.iter().map(String::as_str));
                #[cfg(feature = "tls")]
                let builder = match self.root_cert {
                    Some(pem) => builder.certs(redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem),
                    }),
                    None => builder,
                };
                let client = builder
                    .retries(2)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .build()
                    .map_err(|e| Error::config(format!("redis cluster URLs {urls:?}: {e}")))?;
                let conn = tokio::time::timeout(timeout * 2, client.get_async_connection())
                    .await
                    .map_err(|_| Error::Timeout {
                        after: timeout * 2,
                        source: None,
                    })?
                    .map_err(map)?;
                Link::new(Conn::Cluster(conn), None)
            }
        };
        Ok(RedisStore {
            link,
            prefix: self.prefix,
            timeout,
            grace_ms: duration_millis(self.grace),
            caps: Capabilities::new()
                .with_explicit_expire(false)
                .with_max_outcome_bytes(self.max_outcome_bytes),
            wait_replicas: self.wait_replicas,
        })
    }
}

/// The Redis store: one string key per record, every decision made by one Lua
/// script on the server with the server's clock.
///
/// - **Atomic primitive**: a claim is one script: it reads the key, a live record
///   answers (`InFlight`, `Duplicate`, `Mismatch`, a re-entrant `Claimed`) with
///   nothing written, an absent key is claimed with `SET key record NX PX ms`
///   and an expired record taken over, in the same single round trip.
///   Complete, release and extend are one script each that checks the token, the
///   state and the deadline before writing. Nothing is read, decided and written
///   back from the client.
/// - **Time**: deadlines are `TIME` on the server plus the TTL; the caller's clock
///   plays no part.
/// - **Expiry**: a done record's key lives exactly its retention (`PX`); an
///   in-flight record's key lives its lease plus a takeover window (default 24 h)
///   so a late delivery still counts the attempt. Expiry is logical in every
///   script; Redis reclaims the memory itself, so [`expire`](DedupeStore::expire)
///   answers 0 and [`Capabilities::explicit_expire`] is false.
/// - **Failures**: a reconnecting `ConnectionManager` (two retries, 50 to 200 ms
///   apart) and a response timeout: during an outage calls fail fast with
///   retryable errors, and the same store works again once the server is back.
///
/// ```no_run
/// use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
/// use dedupe_redis::RedisStore;
///
/// # async fn run() -> Result<(), dedupe_core::Error> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379/0").await?;
/// let key = Key::new("stripe", "evt_1P9x")?;
/// if let ClaimOutcome::Claimed(lease) = store.claim(&key, &ClaimOptions::default()).await? {
///     store.complete(&lease, b"order 17", std::time::Duration::from_secs(86_400)).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStore {
    link: Link,
    prefix: String,
    timeout: Duration,
    grace_ms: i64,
    caps: Capabilities,
    wait_replicas: Option<(u32, Duration)>,
}

/// Reads the script answers: an integer, or an array of an integer and bytes.
fn parts(value: Value) -> Option<(i64, Option<Vec<u8>>)> {
    match value {
        Value::Int(code) => Some((code, None)),
        Value::Array(items) => {
            let mut items = items.into_iter();
            let code = match items.next()? {
                Value::Int(code) => code,
                _ => return None,
            };
            let bytes = match items.next() {
                None => None,
                Some(Value::BulkString(bytes)) => Some(bytes),
                Some(Value::SimpleString(text)) => Some(text.into_bytes()),
                Some(_) => return None,
            };
            Some((code, bytes))
        }
        _ => None,
    }
}

impl RedisStore {
    /// Default key prefix.
    pub const DEFAULT_PREFIX: &'static str = "dedupe:";
    /// Default bound on each operation.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
    /// Default takeover window.
    pub const DEFAULT_TAKEOVER_WINDOW: Duration = Duration::from_secs(24 * 3600);

    fn builder_for(target: Target) -> RedisBuilder {
        RedisBuilder {
            target,
            prefix: Self::DEFAULT_PREFIX.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
            grace: Self::DEFAULT_TAKEOVER_WINDOW,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            wait_replicas: None,
            root_cert: None,
        }
    }

    /// Settings for a store on one server: `redis://host:port/db` or
    /// `rediss://...` (TLS, with the `tls` feature).
    pub fn builder(url: impl Into<String>) -> RedisBuilder {
        Self::builder_for(Target::Url(url.into()))
    }

    /// Settings for a store on a Cluster, given some of its nodes' URLs.
    pub fn cluster_builder<I, S>(urls: I) -> RedisBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::builder_for(Target::Cluster(urls.into_iter().map(Into::into).collect()))
    }

    /// Settings for a store on a `ConnectionManager` the caller already has
    /// (its own retry and timeout settings then apply).
    pub fn builder_with_manager(manager: ConnectionManager) -> RedisBuilder {
        Self::builder_for(Target::Conn(Conn::Single(manager)))
    }

    /// Settings for a store on a Cluster connection the caller already has.
    pub fn builder_with_cluster(conn: ClusterConnection) -> RedisBuilder {
        Self::builder_for(Target::Conn(Conn::Cluster(conn)))
    }

    /// A store with default settings on one server.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::builder(url).connect().await
    }

    /// The record key of `key`: the prefix, the namespace, `:`, the id. A
    /// namespace never holds `:`, so distinct keys never share a record key; one
    /// key per record keeps every command for a record on one Cluster slot.
    fn record_key(&self, key: &Key) -> String {
        format!("{}{}:{}", self.prefix, key.namespace(), key.id())
    }

    fn err(&self, e: redis::RedisError, key: Option<&Key>) -> Error {
        crate::error::map(e, self.timeout, key)
    }

    /// Bounds `op` by twice the timeout, so a call never hangs through an outage
    /// even when the connection's own timers do not fire.
    async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        let bound = self.timeout * 2;
        tokio::time::timeout(bound, op)
            .await
            .unwrap_or(Err(Error::Timeout {
                after: bound,
                source: None,
            }))
    }

    async fn run(&self, invocation: redis::ScriptInvocation<'_>, key: &Key) -> Result<Value> {
        self.run_on(self.link.get(), invocation, key).await
    }

    /// [`run`](Self::run) on a connection the caller took from the link (a
    /// claim and its `WAIT` must use the same one).
    async fn run_on(
        &self,
        (generation, mut conn): (u64, Conn),
        invocation: redis::ScriptInvocation<'_>,
        key: &Key,
    ) -> Result<Value> {
        let result = self
            .bounded(async {
                invocation
                    .invoke_async::<Value>(&mut conn)
                    .await
                    .map_err(|e| self.err(e, Some(key)))
            })
            .await;
        self.after(generation, &result);
        result
    }

    /// Replaces the connection a timed-out call ran on (see [`Link`]).
    fn after<T>(&self, generation: u64, result: &Result<T>) {
        if matches!(result, Err(Error::Timeout { .. })) {
            self.link.replace(generation);
        }
    }

    fn unexpected(key: &Key, what: &str) -> Error {
        Error::corrupt(key, format!("unexpected answer from the {what} script"))
    }

    /// A claim script's invocation: the records of `keys`, then the arguments
    /// [`CLAIM`](crate::scripts) and its batch form share (claim id,
    /// fingerprint, lease, takeover window), then a new token for each key.
    fn claim_invocation<'s>(
        &self,
        script: &'s redis::Script,
        keys: &[&Key],
        opts: &ClaimOptions,
    ) -> redis::ScriptInvocation<'s> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(self.record_key(key));
        }
        invocation
            .arg(opts.claim_id.as_ref().map(ClaimId::as_str).unwrap_or(""))
            .arg(
                opts.fingerprint
                    .as_ref()
                    .map(Fingerprint::as_bytes)
                    .unwrap_or(b""),
            )
            .arg(duration_millis(opts.lease_ttl))
            .arg(self.grace_ms);
        for token in backend::new_tokens(keys.len()) {
            invocation.arg(token.as_str());
        }
        invocation
    }

    /// The answer of one key from a claim script: its code and its record.
    fn claim_answer(
        key: &Key,
        code: i64,
        value: &[u8],
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        let record = codec::decode(key, value)?;
        match code {
            1 => backend::won_claim(record),
            0 => Ok(backend::losing_claim(record, opts)),
            _ => Err(Error::corrupt(
                key,
                "the value at this key is not a dedupe record",
            )),
        }
    }

    /// One claim, without waiting for replicas (the caller does, once).
    async fn claim_one(
        &self,
        link: (u64, Conn),
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        let invocation = self.claim_invocation(&SCRIPTS.claim, &[key], opts);
        let answer = self.run_on(link, invocation, key).await?;
        let (code, value) = parts(answer).ok_or_else(|| Self::unexpected(key, "claim"))?;
        let value = value.ok_or_else(|| Self::unexpected(key, "claim"))?;
        Self::claim_answer(key, code, &value, opts)
    }

    /// Distinct keys one batch script call claims at most: a call holds the
    /// single-threaded server for its whole run (a few µs a key).
    const CLAIM_CHUNK: usize = 128;

    /// Claims distinct keys of one server in one script call, without waiting
    /// for replicas. A record among them that does not decode fails the call
    /// with nothing claimed.
    async fn claim_chunk(
        &self,
        link: (u64, Conn),
        keys: &[&Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        let (Some(first), Some(last)) = (keys.first(), keys.last()) else {
            return Ok(Vec::new());
        };
        let invocation = self.claim_invocation(&SCRIPTS.claim_many, keys, opts);
        let answer = self.run_on(link, invocation, first).await?;
        let Value::Array(items) = answer else {
            return Err(Self::unexpected(first, "claim_many"));
        };
        if let [Value::Int(-1), Value::Int(at), ..] = items.as_slice() {
            let key = usize::try_from(*at)
                .ok()
                .and_then(|at| keys.get(at.wrapping_sub(1)))
                .unwrap_or(first);
            return Err(Error::corrupt(
                key,
                "the value at this key is not a dedupe record",
            ));
        }
        if items.len() != keys.len() * 2 {
            return Err(Self::unexpected(last, "claim_many"));
        }
        keys.iter()
            .zip(items.chunks_exact(2))
            .map(|(key, pair)| match pair {
                [Value::Int(code), Value::BulkString(value)] => {
                    Self::claim_answer(key, *code, value, opts)
                }
                _ => Err(Self::unexpected(key, "claim_many")),
            })
            .collect()
    }

    /// With [`RedisBuilder::wait_for_replicas`], waits until the replicas have
    /// every write made so far on this store's connection. `WAIT` holds the
    /// multiplexed connection while it waits: calls of the same store queue
    /// behind it for at most the wait's timeout. `link` is the connection the
    /// claims ran on: `WAIT` counts the writes of its own connection, so on a
    /// connection swapped in since it would return at once.
    async fn wait_for_replicas(&self, link: (u64, Conn), answers: &[ClaimOutcome]) -> Result<()> {
        let Some((replicas, timeout)) = self.wait_replicas else {
            return Ok(());
        };
        // A re-entrant Claimed (a retry after a failed wait) waits again.
        if !answers.iter().any(|a| a.lease().is_some()) {
            return Ok(());
        }
        let (generation, mut conn) = link;
        let acked = self
            .bounded(async {
                redis::cmd("WAIT")
                    .arg(replicas)
                    .arg(duration_millis(timeout))
                    .query_async::<i64>(&mut conn)
                    .await
                    .map_err(|e| self.err(e, None))
            })
            .await;
        self.after(generation, &acked);
        let acked = acked?;
        if acked < i64::from(replicas) {
            return Err(Error::unavailable(
                format!(
                    "the claim reached {acked} of {replicas} replicas in {timeout:?}; it stands \
                     on the primary: retry with the same claim id"
                ),
                None,
            ));
        }
        Ok(())
    }

    /// What the server promises about keeping records across a restart
    /// (`CONFIG GET appendonly appendfsync`; `Unknown` where `CONFIG` is
    /// refused, as on managed services).
    pub async fn durability(&self) -> Durability {
        let (_, mut conn) = self.link.get();
        let read = async {
            let pairs: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("append*")
                .query_async(&mut conn)
                .await
                .ok()?;
            let get = |name: &str| {
                pairs
                    .chunks(2)
                    .find(|p| p.first().map(String::as_str) == Some(name))
                    .and_then(|p| p.get(1).cloned())
            };
            Some(match get("appendonly").as_deref() {
                Some("yes") => Durability::AppendOnly {
                    fsync: get("appendfsync").unwrap_or_else(|| "unknown".into()),
                },
                Some(_) => Durability::NotPersistent,
                None => Durability::Unknown,
            })
        };
        tokio::time::timeout(self.timeout, read)
            .await
            .ok()
            .flatten()
            .unwrap_or(Durability::Unknown)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether this store talks to a Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.link.get().1, Conn::Cluster(_))
    }
}

#[async_trait]
impl DedupeStore for RedisStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        let link = self.link.get();
        let answer = self.claim_one(link.clone(), key, opts).await?;
        self.wait_for_replicas(link, std::slice::from_ref(&answer))
            .await?;
        Ok(answer)
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let mut invocation = SCRIPTS.complete.key(self.record_key(&lease.key));
        invocation
            .arg(lease.token.as_str())
            .arg(duration_millis(retention))
            .arg(outcome);
        match parts(self.run(invocation, &lease.key).await?) {
            Some((1, _)) => Ok(()),
            Some((0, _)) => Err(Error::lease_lost(&lease.key)),
            Some((-1, _)) => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "complete")),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let mut invocation = SCRIPTS.release.key(self.record_key(&lease.key));
        invocation.arg(lease.token.as_str());
        match parts(self.run(invocation, &lease.key).await?) {
            Some((1, _)) => Ok(()),
            Some((0, _)) => Err(Error::lease_lost(&lease.key)),
            Some((-1, _)) => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "release")),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let mut invocation = SCRIPTS.extend.key(self.record_key(&lease.key));
        invocation
            .arg(lease.token.as_str())
            .arg(duration_millis(ttl))
            .arg(self.grace_ms);
        match parts(self.run(invocation, &lease.key).await?) {
            Some((1, Some(deadline))) => {
                let ms = std::str::from_utf8(&deadline)
                    .ok()
                    .and_then(|t| t.parse::<i64>().ok())
                    .ok_or_else(|| Self::unexpected(&lease.key, "extend"))?;
                Ok(Lease {
                    deadline: from_millis(ms),
                    ..lease.clone()
                })
            }
            Some((0, _)) => Err(Error::lease_lost(&lease.key)),
            Some((-1, _)) => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "extend")),
        }
    }

    /// Redis removes expired keys itself; nothing to do, and 0 removed.
    async fn expire(&self) -> Result<u64> {
        Ok(0)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let invocation = SCRIPTS.get.key(self.record_key(key));
        match parts(self.run(invocation, key).await?) {
            Some((1, Some(value))) => codec::decode(key, &value).map(Some),
            Some((0, _)) => Ok(None),
            Some((-1, value)) => {
                codec::decode(key, &value.unwrap_or_default())?;
                Err(Error::corrupt(key, "not a dedupe record"))
            }
            _ => Err(Self::unexpected(key, "get")),
        }
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let invocation = SCRIPTS.forget.key(self.record_key(key));
        match parts(self.run(invocation, key).await?) {
            Some((1, _)) => Ok(true),
            Some((0, _)) => Ok(false),
            Some((-1, _)) => Err(Error::corrupt(
                key,
                "not a dedupe record; left in place for an operator to inspect",
            )),
            _ => Err(Self::unexpected(key, "forget")),
        }
    }

    /// On one server, one batch script call per 128
    /// distinct keys: it reads every key before it writes any, so a corrupt
    /// record among them fails the call with none of them claimed, and the
    /// server pays for one script call instead of one a key (bench, 16 keys a
    /// batch: 0.36 / 0.39 / 0.25 of raw pipelined `SET NX` at 1 / 16 / 64
    /// tasks with a call a key, 0.56 / 0.55 / 0.61 with one call). On a
    /// Cluster, the keys fall in many slots: every distinct key's claim script
    /// is sent at once, as concurrent `EVALSHA` calls on the multiplexed
    /// connection (one round trip per node). Repeats inside the batch are
    /// answered by the core's bookkeeping. Not atomic as a whole across calls:
    /// if one fails, the batch fails and the claims that won in the others
    /// stand until their lease passes (retry the batch with the same claim id
    /// to be handed them again).
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let batch = BatchKeys::new(keys);
        let link = self.link.get();
        let answers = if matches!(link.1, Conn::Cluster(_)) {
            // Keys of a batch fall in many slots, each on its node: one script
            // call per key, sent together.
            futures_util::future::try_join_all(
                batch
                    .distinct()
                    .iter()
                    .map(|key| self.claim_one(link.clone(), key, opts)),
            )
            .await?
        } else {
            let chunks = futures_util::future::try_join_all(
                batch
                    .distinct()
                    .chunks(Self::CLAIM_CHUNK)
                    .map(|chunk| self.claim_chunk(link.clone(), chunk, opts)),
            )
            .await?;
            chunks.into_iter().flatten().collect()
        };
        self.wait_for_replicas(link, &answers).await?;
        batch.answers(answers, opts)
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
