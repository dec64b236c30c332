//! The Redis store: the handle and its `DedupeStore` implementation, each
//! operation one script, one round trip (run in `ops.rs`).

use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{check_ttl, duration_millis, from_millis, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::Value;

pub use crate::builder::RedisBuilder;
use crate::builder::Target;
use crate::codec;
use crate::conn::{Conn, Link};
use crate::ops::parts;
use crate::scripts::SCRIPTS;

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
    pub(crate) link: Link,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) grace_ms: i64,
    pub(crate) caps: Capabilities,
    pub(crate) wait: Option<crate::ops::Wait>,
    pub(crate) hash_tags: bool,
    /// The pub/sub connection that wakes this process's workers (I14);
    /// `None` on a connection the caller made.
    pub(crate) wake: Option<dedupe_core::backend::Subscription>,
    /// The channel the scripts publish wake-ups on (`<prefix>wake`).
    pub(crate) wake_channel: String,
}

impl RedisStore {
    /// Default key prefix.
    pub const DEFAULT_PREFIX: &'static str = "dedupe:";
    /// Default bound on each operation.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
    /// Default takeover window.
    pub const DEFAULT_TAKEOVER_WINDOW: Duration = Duration::from_secs(24 * 3600);
    /// How many times `forget` reads again when a newer record replaced the one
    /// it read before it could remove it.
    const FORGET_ROUNDS: usize = 4;

    pub(crate) fn builder_for(target: Target) -> RedisBuilder {
        RedisBuilder {
            target,
            prefix: Self::DEFAULT_PREFIX.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
            grace: Self::DEFAULT_TAKEOVER_WINDOW,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            wait_replicas: None,
            root_cert: None,
            allow_eviction: false,
            address_map: None,
            hash_tags: false,
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

    /// How many keys the server has evicted since it started (`evicted_keys` of
    /// `INFO stats`, summed over a Cluster's primaries); `None` where `INFO`
    /// is refused or unanswered. Anything above 0 on a store's server means
    /// records may have been evicted, and with them the claims that kept a
    /// second delivery out.
    pub async fn evicted_keys(&self) -> Option<u64> {
        let (_, mut conn) = self.link.get();
        tokio::time::timeout(self.timeout, crate::server::evicted_keys(&mut conn))
            .await
            .ok()
            .flatten()
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
        self.claim_one(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let mut invocation = self.record_invocation(&SCRIPTS.complete, &lease.key);
        invocation
            .arg(lease.token.as_str())
            .arg(duration_millis(retention))
            .arg(outcome)
            .arg(lease.key.id());
        let (answer, acked) = self.write(invocation, &lease.key).await?;
        match parts(answer) {
            Some((1, _)) => self.replicated(
                acked,
                "completion",
                "retry complete with the same outcome (it answers Ok and waits again)",
            ),
            Some((0, _)) => Err(Error::lease_lost(&lease.key)),
            Some((-1, _)) => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "complete")),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let mut invocation = self.record_invocation(&SCRIPTS.release, &lease.key);
        invocation
            .arg(lease.token.as_str())
            .arg(lease.key.id())
            .arg(self.wake_channel.as_str())
            .arg(lease.key.namespace());
        let (answer, acked) = self.write(invocation, &lease.key).await?;
        match parts(answer) {
            Some((1, _)) => self.replicated(acked, "release", "retry the release"),
            Some((0, _)) => Err(Error::lease_lost(&lease.key)),
            Some((-1, _)) => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "release")),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let mut invocation = self.record_invocation(&SCRIPTS.extend, &lease.key);
        invocation
            .arg(lease.token.as_str())
            .arg(duration_millis(ttl))
            .arg(self.grace_ms)
            .arg(lease.key.id());
        let (answer, acked) = self.write(invocation, &lease.key).await?;
        match parts(answer) {
            Some((1, Some(deadline))) => {
                let ms = std::str::from_utf8(&deadline)
                    .ok()
                    .and_then(|t| t.parse::<i64>().ok())
                    .ok_or_else(|| Self::unexpected(&lease.key, "extend"))?;
                self.replicated(
                    acked,
                    "extension",
                    "hold to the lease's earlier deadline, or extend again",
                )?;
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

    /// Two scripts: the first reads the record's token, the second removes the
    /// record only while it still holds that token. A forget the driver sends
    /// again after the first removed the record finds it gone and answers as
    /// the first did; it never removes a claim made since.
    async fn forget(&self, key: &Key) -> Result<bool> {
        let corrupt = || {
            Error::corrupt(
                key,
                "not a dedupe record; left in place for an operator to inspect",
            )
        };
        for _ in 0..Self::FORGET_ROUNDS {
            let peeked = self
                .run(SCRIPTS.peek.key(self.record_key(key)), key)
                .await?;
            let (token, live) = match peeked {
                Value::Array(items) => match items.as_slice() {
                    [Value::Int(0)] => return Ok(false),
                    [Value::Int(-1)] => return Err(corrupt()),
                    [Value::Int(1), Value::BulkString(token), Value::Int(live)] => {
                        (token.clone(), *live == 1)
                    }
                    _ => return Err(Self::unexpected(key, "forget")),
                },
                _ => return Err(Self::unexpected(key, "forget")),
            };
            let mut invocation = self.record_invocation(&SCRIPTS.forget, key);
            invocation.arg(token).arg(key.id());
            let (answer, acked) = self.write(invocation, key).await?;
            match parts(answer) {
                Some((1, _)) => {
                    self.replicated(acked, "forget", "retry the forget")?;
                    return Ok(live);
                }
                // Removed since the peek (another forget, or an expiry): of
                // two forgets at once, one answers that it found it.
                Some((2, _)) => return Ok(false),
                // A newer record took its place: look again.
                Some((0, _)) => continue,
                Some((-1, _)) => return Err(corrupt()),
                _ => return Err(Self::unexpected(key, "forget")),
            }
        }
        Err(Error::retryable(
            "the record kept changing under forget; retry",
            None,
        ))
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
        let answers = if self.is_cluster() {
            // Keys of a batch fall in many slots, each on its node: one script
            // call per key, sent together.
            futures_util::future::try_join_all(
                batch.distinct().iter().map(|key| self.claim_one(key, opts)),
            )
            .await?
        } else {
            let chunks = futures_util::future::try_join_all(
                batch
                    .distinct()
                    .chunks(Self::CLAIM_CHUNK)
                    .map(|chunk| self.claim_chunk(chunk, opts)),
            )
            .await?;
            chunks.into_iter().flatten().collect()
        };
        batch.answers(answers, opts)
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
