//! Where every operation runs: the script invocations, the answers read back
//! from them, the batch chunks and the replica wait that follows a write.

use std::future::Future;

use dedupe_core::backend::{self, duration_millis};
use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, Error, Fingerprint, Key, Result};
use redis::Value;

use crate::codec;
use crate::scripts::SCRIPTS;

use crate::conn::{Conn, Link};
use crate::store::RedisStore;

/// With [`RedisBuilder::wait_for_replicas`](crate::RedisBuilder::wait_for_replicas):
/// how many replicas each write must reach, how long its `WAIT` waits, and
/// the connection the writes and their waits run on.
#[derive(Debug, Clone)]
pub(crate) struct Wait {
    pub(crate) replicas: u32,
    pub(crate) timeout: std::time::Duration,
    pub(crate) link: Link,
}

/// Reads the script answers: an integer, or an array of an integer and bytes.
pub(crate) fn parts(value: Value) -> Option<(i64, Option<Vec<u8>>)> {
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
    /// The record key of `key`: the prefix, the namespace, `:`, the id. A
    /// namespace never holds `:`, so distinct keys never share a record key; one
    /// key per record keeps every command for a record on one Cluster slot.
    /// With [`namespace_hash_tags`](crate::RedisBuilder::namespace_hash_tags)
    /// the namespace is a hash tag (`{ns}`): a namespace's keys share a slot.
    pub(crate) fn record_key(&self, key: &Key) -> String {
        format!("{}{}", self.record_base(key.namespace()), key.id())
    }

    /// The key a record key names, `None` for any other key under the
    /// prefix (an index key, something else's).
    pub(crate) fn key_of_record_key(&self, redis_key: &str) -> Option<Key> {
        let rest = redis_key.strip_prefix(self.prefix.as_str())?;
        let (namespace, id) = if self.hash_tags {
            let rest = rest.strip_prefix('{')?;
            let (namespace, id) = rest.split_once("}:")?;
            (namespace, id)
        } else {
            rest.split_once(':')?
        };
        if namespace.contains(['|', '{', '}']) {
            return None;
        }
        Key::new(namespace, id).ok()
    }

    /// What every record key of `namespace` starts with.
    pub(crate) fn record_base(&self, namespace: &str) -> String {
        format!("{}:", self.namespace_base(namespace))
    }

    /// The prefix and the namespace (hash-tagged or not): the record keys'
    /// base without its `:`, and the index keys' stem.
    pub(crate) fn namespace_base(&self, namespace: &str) -> String {
        if self.hash_tags {
            format!("{}{{{namespace}}}", self.prefix)
        } else {
            format!("{}{namespace}", self.prefix)
        }
    }

    /// The namespace's inbox index keys: waiting, held, ids (`|` never occurs
    /// in a namespace, nor `:` after the prefix, so they meet no record key).
    /// `None` where an inbox cannot be kept: on a Cluster without hash tags,
    /// the index would live in another slot than the records.
    pub(crate) fn index_keys(&self, namespace: &str) -> Option<[String; 6]> {
        if self.is_cluster() && !self.hash_tags {
            return None;
        }
        let base = self.namespace_base(namespace);
        Some(["wait", "held", "ids", "dead", "ord", "seq"].map(|what| format!("{base}|{what}")))
    }

    /// An invocation of a script on one record: its key, then the namespace's
    /// index keys where the store may hold inbox items.
    pub(crate) fn record_invocation<'s>(
        &self,
        script: &'s redis::Script,
        key: &Key,
    ) -> redis::ScriptInvocation<'s> {
        let mut invocation = script.prepare_invoke();
        invocation.key(self.record_key(key));
        for index in self.index_keys(key.namespace()).into_iter().flatten() {
            invocation.key(index);
        }
        invocation
    }

    pub(crate) fn topology(&self) -> crate::error::Topology {
        match self.link.get().1 {
            Conn::Single(_) => crate::error::Topology::Standalone,
            Conn::Cluster(_) => crate::error::Topology::Cluster,
        }
    }

    pub(crate) fn err(&self, e: redis::RedisError, key: Option<&Key>) -> Error {
        crate::error::map(e, self.timeout, key, self.topology())
    }

    /// Bounds `op` by twice the timeout, so a call never hangs through an outage
    /// even when the connection's own timers do not fire.
    pub(crate) async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        dedupe_core::backend::within(self.timeout * 2, op).await
    }

    /// Runs a script that only reads (or whose write no failover can undo
    /// into a second winner) on the store's connection.
    pub(crate) async fn run(
        &self,
        invocation: redis::ScriptInvocation<'_>,
        key: &Key,
    ) -> Result<Value> {
        let (generation, mut conn) = self.link.get();
        let result = self
            .bounded(async {
                invocation
                    .invoke_async::<Value>(&mut conn)
                    .await
                    .map_err(|e| self.err(e, Some(key)))
            })
            .await;
        self.link.after(generation, &result);
        result
    }

    /// Runs a script that writes, and answers its value with how many replicas
    /// acknowledged the write (`None` without
    /// [`RedisBuilder::wait_for_replicas`](crate::RedisBuilder::wait_for_replicas)).
    ///
    /// With replicas to wait for, the script and a `WAIT` go out in one
    /// pipeline on the store's waiting connection: the `WAIT` counts the writes
    /// of its own connection, so it must follow the script on the very
    /// connection the script ran on (one pipeline cannot be split across a
    /// reconnect), and on a Cluster the pipeline goes to the node of the
    /// script's key (a `WAIT` alone would be sent to every primary). The
    /// server holds a connection while its `WAIT` waits; a connection of its
    /// own keeps the other calls of the store from queueing behind it.
    pub(crate) async fn write(
        &self,
        invocation: redis::ScriptInvocation<'_>,
        key: &Key,
    ) -> Result<(Value, Option<i64>)> {
        let Some(wait) = &self.wait else {
            return Ok((self.run(invocation, key).await?, None));
        };
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation)
            .cmd("WAIT")
            .arg(wait.replicas)
            .arg(duration_millis(wait.timeout));
        let (generation, mut conn) = wait.link.get();
        let result = self
            .bounded(async {
                let sent = match pipe.query_async::<(Value, i64)>(&mut conn).await {
                    // The server does not have the script yet (a restart, a
                    // failover, a new node): load it, then send the pipeline again.
                    Err(e)
                        if e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        match invocation.load_async(&mut conn).await {
                            Ok(_) => pipe.query_async(&mut conn).await,
                            Err(e) => Err(e),
                        }
                    }
                    sent => sent,
                };
                sent.map(|(value, acked)| (value, Some(acked)))
                    .map_err(|e| self.err(e, Some(key)))
            })
            .await;
        wait.link.after(generation, &result);
        result
    }

    /// Ok when a write reached the replicas it had to (or none were asked
    /// for); else a retryable error: the write stands on the primary, where a
    /// failover may still lose it. `advice` says how to retry.
    pub(crate) fn replicated(&self, acked: Option<i64>, what: &str, advice: &str) -> Result<()> {
        match (acked, &self.wait) {
            (Some(acked), Some(wait)) if acked < i64::from(wait.replicas) => {
                Err(Error::unavailable(
                    format!(
                        "the {what} reached {acked} of {} replicas within {:?}; it stands on \
                         the primary, where a failover may lose it: {advice}",
                        wait.replicas, wait.timeout
                    ),
                    None,
                ))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn unexpected(key: &Key, what: &str) -> Error {
        Error::corrupt(key, format!("unexpected answer from the {what} script"))
    }

    /// A claim script's invocation: the records of `keys`, then the arguments
    /// [`CLAIM`](crate::scripts) and its batch form share (claim id,
    /// fingerprint, lease, takeover window), then a new token for each key.
    pub(crate) fn claim_invocation<'s>(
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
    pub(crate) fn claim_answer(
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

    /// What a claim that won tells its caller when the replicas did not all
    /// acknowledge it in time.
    const CLAIM_RETRY: &'static str = "retry with the same claim id to be handed the lease";

    /// One claim. A claim that won (or was handed its lease again) waits for
    /// the replicas asked for.
    pub(crate) async fn claim_one(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        let invocation = self.claim_invocation(&SCRIPTS.claim, &[key], opts);
        let (answer, acked) = self.write(invocation, key).await?;
        let (code, value) = parts(answer).ok_or_else(|| Self::unexpected(key, "claim"))?;
        let value = value.ok_or_else(|| Self::unexpected(key, "claim"))?;
        let outcome = Self::claim_answer(key, code, &value, opts)?;
        if outcome.lease().is_some() {
            self.replicated(acked, "claim", Self::CLAIM_RETRY)?;
        }
        Ok(outcome)
    }

    /// Distinct keys one batch script call claims at most: a call holds the
    /// single-threaded server for its whole run (a few µs a key).
    pub(crate) const CLAIM_CHUNK: usize = 128;

    /// Claims distinct keys of one server in one script call. A record among
    /// them that does not decode fails the call with nothing claimed.
    pub(crate) async fn claim_chunk(
        &self,
        keys: &[&Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        let (Some(first), Some(last)) = (keys.first(), keys.last()) else {
            return Ok(Vec::new());
        };
        let invocation = self.claim_invocation(&SCRIPTS.claim_many, keys, opts);
        let (answer, acked) = self.write(invocation, first).await?;
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
        let outcomes = keys
            .iter()
            .zip(items.chunks_exact(2))
            .map(|(key, pair)| match pair {
                [Value::Int(code), Value::BulkString(value)] => {
                    Self::claim_answer(key, *code, value, opts)
                }
                _ => Err(Self::unexpected(key, "claim_many")),
            })
            .collect::<Result<Vec<_>>>()?;
        if outcomes.iter().any(|o| o.lease().is_some()) {
            self.replicated(acked, "batch claim", Self::CLAIM_RETRY)?;
        }
        Ok(outcomes)
    }
}
