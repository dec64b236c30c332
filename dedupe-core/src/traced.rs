//! Tracing written once, for every store.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::capabilities::Capabilities;
use crate::claim::{ClaimOptions, ClaimOutcome, Lease};
use crate::error::{Error, Result};
use crate::inbox::{
    AcceptOptions, Accepted, Inbox, InboxCounts, Item, ItemPage, ItemQuery, ItemStatus, Retry,
    Taken,
};
use crate::key::Key;
use crate::record::Record;
use crate::store::DedupeStore;

/// A store that puts a `tracing` span on every call of the store it wraps: the
/// span is named `dedupe.<operation>`, carries the key (or the batch size) and,
/// when the call returns, the answer (`claimed`, `in-flight`, `duplicate`,
/// `mismatch`, `ok`, a count) or the error. Errors that mean the store is in
/// trouble are logged at `WARN`; a lost lease, which is an answer, at `DEBUG`.
///
/// Every call is also counted through the [`metrics`] facade (a no-op until the
/// application installs a recorder, such as a Prometheus exporter):
///
/// | metric | labels | what |
/// |---|---|---|
/// | `dedupe_store_calls_total` | `operation`, `answer` | calls by answer: `claimed`, `in_flight`, `duplicate`, `mismatch` (claims; a batch counts each key), `ok`, `lease_lost`, `error` |
/// | `dedupe_store_call_seconds` | `operation` | how long each call took (histogram) |
///
/// Over a store that offers an [`Inbox`], the inbox's calls are traced and
/// counted the same way (`dedupe.accept` answering `new`, `item`, `done` or
/// `in_flight`; `dedupe.take` with the namespace and the number taken;
/// `dedupe.snooze`, `dedupe.fail`, `dedupe.item`, `dedupe.list`,
/// `dedupe.replay`, `dedupe.counts`, `dedupe.pause`, `dedupe.resume`,
/// `dedupe.paused`); the [`InboxWorker`](crate::InboxWorker) and
/// the webhook receiver's inbox mode put their inbox behind one.
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

/// The metric label of a claim's answer.
fn claim_label(outcome: &ClaimOutcome) -> &'static str {
    match outcome {
        ClaimOutcome::Claimed(_) => "claimed",
        ClaimOutcome::InFlight { .. } => "in_flight",
        ClaimOutcome::Duplicate { .. } => "duplicate",
        ClaimOutcome::Mismatch { .. } => "mismatch",
    }
}

/// Counts a finished call: its answers (`labels` gives one label per answer,
/// several for a batch) and how long it took.
fn measure<T>(
    operation: &'static str,
    started: Instant,
    result: &Result<T>,
    answers: impl FnOnce(&T, &mut dyn FnMut(&'static str)),
) {
    metrics::histogram!("dedupe_store_call_seconds", "operation" => operation)
        .record(started.elapsed().as_secs_f64());
    let mut count = |answer: &'static str| {
        metrics::counter!("dedupe_store_calls_total", "operation" => operation, "answer" => answer)
            .increment(1);
    };
    match result {
        Ok(value) => answers(value, &mut count),
        Err(Error::LeaseLost { .. }) => count("lease_lost"),
        Err(_) => count("error"),
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

// A wrapper forwards every method: one it forgets would silently fall back
// to the trait's default instead of the wrapped store's.
#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl<S: DedupeStore> DedupeStore for TracedStore<S> {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        let started = Instant::now();
        let span = span!("dedupe.claim", key = key);
        let result = self.inner.claim(key, opts).instrument(span.clone()).await;
        measure("claim", started, &result, |a, count| count(claim_label(a)));
        finish(&span, result, |a| a.kind().to_string())
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        let started = Instant::now();
        let span = span!("dedupe.complete", key = lease.key);
        let result = self
            .inner
            .complete(lease, outcome, retention)
            .instrument(span.clone())
            .await;
        measure("complete", started, &result, |_, count| count("ok"));
        finish(&span, result, |()| "ok".into())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let started = Instant::now();
        let span = span!("dedupe.release", key = lease.key);
        let result = self.inner.release(lease).instrument(span.clone()).await;
        measure("release", started, &result, |_, count| count("ok"));
        finish(&span, result, |()| "ok".into())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let started = Instant::now();
        let span = span!("dedupe.extend", key = lease.key);
        let result = self.inner.extend(lease, ttl).instrument(span.clone()).await;
        measure("extend", started, &result, |_, count| count("ok"));
        finish(&span, result, |_| "ok".into())
    }

    async fn expire(&self) -> Result<u64> {
        let started = Instant::now();
        let span = span!("dedupe.expire");
        let result = self.inner.expire().instrument(span.clone()).await;
        measure("expire", started, &result, |_, count| count("ok"));
        finish(&span, result, |n| format!("{n} removed"))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let started = Instant::now();
        let span = span!("dedupe.get", key = key);
        let result = self.inner.get(key).instrument(span.clone()).await;
        measure("get", started, &result, |_, count| count("ok"));
        finish(&span, result, |r| match r {
            Some(record) => format!("{:?}", record.state.kind()),
            None => "absent".into(),
        })
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let started = Instant::now();
        let span = span!("dedupe.forget", key = key);
        let result = self.inner.forget(key).instrument(span.clone()).await;
        measure("forget", started, &result, |_, count| count("ok"));
        finish(&span, result, |live| format!("live={live}"))
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        let started = Instant::now();
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
        measure("claim_many", started, &result, |answers, count| {
            answers.iter().for_each(|a| count(claim_label(a)))
        });
        finish(&span, result, |answers| {
            let won = answers.iter().filter(|a| a.lease().is_some()).count();
            format!("{won} claimed of {}", answers.len())
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl<S: Inbox> Inbox for TracedStore<S> {
    async fn accept(&self, key: &Key, payload: &[u8]) -> Result<Accepted> {
        let started = Instant::now();
        let span = span!("dedupe.accept", key = key);
        let result = self
            .inner
            .accept(key, payload)
            .instrument(span.clone())
            .await;
        measure("accept", started, &result, |a, count| count(a.kind()));
        finish(&span, result, |a| a.kind().to_string())
    }

    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        let started = Instant::now();
        let span = span!("dedupe.accept", key = key);
        let result = self
            .inner
            .accept_with(key, payload, options)
            .instrument(span.clone())
            .await;
        measure("accept", started, &result, |a, count| count(a.kind()));
        finish(&span, result, |a| a.kind().to_string())
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        let started = Instant::now();
        let span =
            tracing::info_span!("dedupe.take", namespace, max, answer = Empty, error = Empty);
        let result = self
            .inner
            .take(namespace, max, lease)
            .instrument(span.clone())
            .await;
        measure("take", started, &result, |taken, count| {
            taken.iter().for_each(|_| count("taken"))
        });
        finish(&span, result, |taken| format!("{} taken", taken.len()))
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        let started = Instant::now();
        let span = span!("dedupe.snooze", key = lease.key);
        let result = self
            .inner
            .snooze(lease, delay)
            .instrument(span.clone())
            .await;
        measure("snooze", started, &result, |_, count| count("ok"));
        finish(&span, result, |()| format!("due in {delay:?}"))
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        let started = Instant::now();
        let span = span!("dedupe.fail", key = lease.key);
        let result = self
            .inner
            .fail(lease, error, retry)
            .instrument(span.clone())
            .await;
        measure("fail", started, &result, |_, count| count("ok"));
        finish(&span, result, |()| match retry {
            Retry::After(delay) => format!("due in {delay:?}"),
            Retry::Dead { .. } => "dead".into(),
        })
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        let started = Instant::now();
        let span = span!("dedupe.item", key = key);
        let result = self.inner.item(key).instrument(span.clone()).await;
        measure("item", started, &result, |_, count| count("ok"));
        finish(&span, result, |i| match i {
            Some(item) => item.status.as_str().to_string(),
            None => "absent".into(),
        })
    }

    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "dedupe.list",
            namespace = %query.namespace,
            answer = Empty,
            error = Empty
        );
        let result = self.inner.list(query).instrument(span.clone()).await;
        measure("list", started, &result, |_, count| count("ok"));
        finish(&span, result, |page| format!("{} listed", page.items.len()))
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let started = Instant::now();
        let span = span!("dedupe.replay", key = key);
        let result = self.inner.replay(key).instrument(span.clone()).await;
        measure("replay", started, &result, |_, count| count("ok"));
        finish(&span, result, |replayed| format!("replayed={replayed}"))
    }

    async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool> {
        let started = Instant::now();
        let span = span!("dedupe.forget_if", key = key);
        let result = self
            .inner
            .forget_if(key, status, attempts)
            .instrument(span.clone())
            .await;
        measure("forget_if", started, &result, |_, count| count("ok"));
        finish(&span, result, |forgotten| format!("forgotten={forgotten}"))
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        let started = Instant::now();
        let span = tracing::info_span!("dedupe.counts", namespace, answer = Empty, error = Empty);
        let result = self.inner.counts(namespace).instrument(span.clone()).await;
        measure("counts", started, &result, |_, count| count("ok"));
        finish(&span, result, |c| {
            format!(
                "{} pending, {} running, {} failed, {} dead",
                c.pending, c.running, c.failed, c.dead
            )
        })
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        let started = Instant::now();
        let span = tracing::info_span!("dedupe.pause", namespace, answer = Empty, error = Empty);
        let result = self.inner.pause(namespace).instrument(span.clone()).await;
        measure("pause", started, &result, |_, count| count("ok"));
        finish(&span, result, |changed| {
            format!("paused, changed={changed}")
        })
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        let started = Instant::now();
        let span = tracing::info_span!("dedupe.resume", namespace, answer = Empty, error = Empty);
        let result = self.inner.resume(namespace).instrument(span.clone()).await;
        measure("resume", started, &result, |_, count| count("ok"));
        finish(&span, result, |changed| {
            format!("resumed, changed={changed}")
        })
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        let started = Instant::now();
        let span = tracing::info_span!("dedupe.paused", namespace, answer = Empty, error = Empty);
        let result = self.inner.paused(namespace).instrument(span.clone()).await;
        measure("paused", started, &result, |_, count| count("ok"));
        finish(&span, result, |paused| format!("paused={paused}"))
    }

    async fn wake(&self, namespace: &str) -> Result<crate::Wake> {
        let span = tracing::info_span!("dedupe.wake", namespace, answer = Empty, error = Empty);
        let result = self.inner.wake(namespace).instrument(span.clone()).await;
        finish(&span, result, |wake| {
            format!("everywhere={}", wake.everywhere)
        })
    }
}
