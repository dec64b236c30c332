//! Tracing written once, for every store.

use std::time::Duration;

use async_trait::async_trait;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::capabilities::Capabilities;
use crate::claim::{ClaimOptions, ClaimOutcome, Lease};
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::Record;
use crate::store::DedupeStore;

/// A store that puts a `tracing` span on every call of the store it wraps: the
/// span is named `dedupe.<operation>`, carries the key (or the batch size) and,
/// when the call returns, the answer (`claimed`, `in-flight`, `duplicate`,
/// `mismatch`, `ok`, a count) or the error. Errors that mean the store is in
/// trouble are logged at `WARN`; a lost lease, which is an answer, at `DEBUG`.
///
/// [`Deduper`](crate::Deduper) wraps its store in one, so every store, a third
/// party's included, is traced the same way without writing a line of tracing.
///
/// ```
/// use dedupe_core::{ClaimOptions, DedupeStore, Key, MemoryStore, TracedStore};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = TracedStore::new(MemoryStore::new());
/// let answer = store.claim(&Key::new("stripe", "evt_1")?, &ClaimOptions::default()).await?;
/// assert_eq!(answer.kind(), "claimed"); // and a `dedupe.claim` span was recorded
/// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug, Clone, Default)]
pub struct TracedStore<S> {
    inner: S,
}

impl<S> TracedStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps it.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Records the answer (or the error) of a finished call on its span.
fn finish<T>(span: &Span, result: Result<T>, answer: impl FnOnce(&T) -> String) -> Result<T> {
    match &result {
        // Building the answer's text is work on every call: only when someone
        // listens.
        Ok(value) if !span.is_disabled() => {
            span.record("answer", answer(value).as_str());
        }
        Ok(_) => {}
        Err(error) => {
            span.record("answer", "error");
            span.record("error", tracing::field::display(error));
            match error {
                Error::LeaseLost { .. } => tracing::debug!(parent: span, %error, "lease lost"),
                _ => {
                    tracing::warn!(parent: span, %error, retryable = error.is_retryable(), "store call failed")
                }
            }
        }
    }
    result
}

macro_rules! span {
    ($name:literal, key = $key:expr) => {
        tracing::info_span!($name, key = %$key, answer = Empty, error = Empty)
    };
    ($name:literal) => {
        tracing::info_span!($name, answer = Empty, error = Empty)
    };
}

#[async_trait]
impl<S: DedupeStore> DedupeStore for TracedStore<S> {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        let span = span!("dedupe.claim", key = key);
        let result = self.inner.claim(key, opts).instrument(span.clone()).await;
        finish(&span, result, |a| a.kind().to_string())
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        let span = span!("dedupe.complete", key = lease.key);
        let result = self
            .inner
            .complete(lease, outcome, retention)
            .instrument(span.clone())
            .await;
        finish(&span, result, |()| "ok".into())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let span = span!("dedupe.release", key = lease.key);
        let result = self.inner.release(lease).instrument(span.clone()).await;
        finish(&span, result, |()| "ok".into())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let span = span!("dedupe.extend", key = lease.key);
        let result = self.inner.extend(lease, ttl).instrument(span.clone()).await;
        finish(&span, result, |_| "ok".into())
    }

    async fn expire(&self) -> Result<u64> {
        let span = span!("dedupe.expire");
        let result = self.inner.expire().instrument(span.clone()).await;
        finish(&span, result, |n| format!("{n} removed"))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let span = span!("dedupe.get", key = key);
        let result = self.inner.get(key).instrument(span.clone()).await;
        finish(&span, result, |r| match r {
            Some(record) => format!("{:?}", record.state.kind()),
            None => "absent".into(),
        })
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let span = span!("dedupe.forget", key = key);
        let result = self.inner.forget(key).instrument(span.clone()).await;
        finish(&span, result, |live| format!("live={live}"))
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        let span = tracing::info_span!(
            "dedupe.claim_many",
            keys = keys.len(),
            answer = Empty,
            error = Empty
        );
        let result = self
            .inner
            .claim_many(keys, opts)
            .instrument(span.clone())
            .await;
        finish(&span, result, |answers| {
            let won = answers.iter().filter(|a| a.lease().is_some()).count();
            format!("{won} claimed of {}", answers.len())
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
