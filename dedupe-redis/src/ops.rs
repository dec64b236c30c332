//! Where every operation runs: the script invocations, the answers read back
//! from them, the batch chunks and the replica wait.

use std::future::Future;

use dedupe_core::backend::{self, duration_millis};
use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, Error, Fingerprint, Key, Result};
use redis::Value;

use crate::codec;
use crate::scripts::SCRIPTS;

use crate::conn::Conn;
use crate::store::RedisStore;

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
    pub(crate) fn record_key(&self, key: &Key) -> String {
        format!("{}{}:{}", self.prefix, key.namespace(), key.id())
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
        let bound = self.timeout * 2;
        tokio::time::timeout(bound, op)
            .await
            .unwrap_or(Err(Error::Timeout {
                after: bound,
                source: None,
            }))
    }

    pub(crate) async fn run(
        &self,
        invocation: redis::ScriptInvocation<'_>,
        key: &Key,
    ) -> Result<Value> {
        self.run_on(self.link.get(), invocation, key).await
    }

    /// [`run`](Self::run) on a connection the caller took from the link (a
    /// claim and its `WAIT` must use the same one).
    pub(crate) async fn run_on(
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
    pub(crate) fn after<T>(&self, generation: u64, result: &Result<T>) {
        if matches!(result, Err(Error::Timeout { .. })) {
            self.link.replace(generation);
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

    /// One claim, without waiting for replicas (the caller does, once).
    pub(crate) async fn claim_one(
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
    pub(crate) const CLAIM_CHUNK: usize = 128;

    /// Claims distinct keys of one server in one script call, without waiting
    /// for replicas. A record among them that does not decode fails the call
    /// with nothing claimed.
    pub(crate) async fn claim_chunk(
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
    pub(crate) async fn wait_for_replicas(
        &self,
        link: (u64, Conn),
        answers: &[ClaimOutcome],
    ) -> Result<()> {
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
}
