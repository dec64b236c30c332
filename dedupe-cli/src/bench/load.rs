//! Stored records before measuring (`--prefill`), and the purge figure
//! (`--purge`): `expire()` over expired records while claims go on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use dedupe_core::{ClaimOptions, Error, Key};
use dedupe_url::Opener;
use serde::Serialize;

use super::args::{BenchArgs, Limits, Workload};
use super::raw::RawStore;
use super::run::{run_row, store_handle, KeyStream, Side};

const CHUNK: u64 = 500;

/// Loads `n` in-flight records through the store (leases of `lease`) and `n`
/// raw keys, in batches; answers the latest lease deadline.
pub(super) async fn load(
    opener: &Opener,
    raw: Option<&RawStore>,
    label: &str,
    n: u64,
    lease: Duration,
) -> Result<SystemTime, Error> {
    let store = opener.handle().await?;
    let mut raw = match raw {
        Some(raw) => Some(raw.handle(opener).await?),
        None => None,
    };
    let opts = ClaimOptions::new(lease);
    let mut latest = SystemTime::now();
    let mut start = 0;
    while start < n {
        let end = (start + CHUNK).min(n);
        let ids: Vec<String> = (start..end).map(|i| format!("{label}-{i}")).collect();
        let keys: Vec<Key> = ids
            .iter()
            .map(|id| Key::new("bench", id.as_str()))
            .collect::<Result<_, _>>()?;
        for answer in store.claim_many(&keys, &opts).await? {
            if let Some(lease) = answer.lease() {
                latest = latest.max(lease.deadline);
            }
        }
        if let Some(raw) = raw.as_mut() {
            raw.claim(&ids, lease).await?;
        }
        start = end;
    }
    Ok(latest)
}

/// `expire()` over expired records while claims go on.
#[derive(Debug, Clone, Serialize)]
pub struct Purge {
    pub store: String,
    pub kind: &'static str,
    /// Expired records loaded before the purge.
    pub expired: u64,
    /// What `expire()` answered.
    pub removed: u64,
    pub purge_ms: f64,
    /// Claims running beside the purge (new keys, `concurrency` tasks).
    pub concurrency: usize,
    pub claims_per_sec: f64,
    pub claims_p99_us: u64,
    pub errors: u64,
    /// The store expires records itself (Redis): no purge to measure.
    pub native_expiry: bool,
}

pub(super) async fn purge(opener: &Opener, args: &BenchArgs, n: u64) -> Result<Purge, Error> {
    let shown = opener.url().to_string();
    let kind = opener.url().scheme();
    let concurrency = args.concurrency.first().copied().unwrap_or(1).max(1);
    let probe = opener.handle().await?;
    let mut figure = Purge {
        store: shown,
        kind,
        expired: n,
        removed: 0,
        purge_ms: 0.0,
        concurrency,
        claims_per_sec: 0.0,
        claims_p99_us: 0,
        errors: 0,
        native_expiry: !probe.capabilities().explicit_expire,
    };
    if figure.native_expiry {
        return Ok(figure);
    }
    let latest = load(opener, None, "purge", n, Duration::from_millis(500)).await?;
    // The deadlines are known: wait until the last has passed.
    if let Ok(left) = latest.duration_since(SystemTime::now()) {
        tokio::time::sleep(left + Duration::from_millis(20)).await;
    }
    let mut sides = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        sides.push(Side::Store(store_handle(opener).await?));
    }
    let stream = Arc::new(KeyStream {
        label: "during-purge".into(),
        done_keys: 1,
        batch: 1,
        next: AtomicU64::new(0),
        workload: Workload::Claim,
        dup_ratio: 0.0,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let drawn = Arc::clone(&stream);
    let claims = {
        let stop = Arc::clone(&stop);
        // Until the purge ends.
        let limits = Limits {
            period: Duration::from_secs(24 * 3600),
            ops: None,
        };
        tokio::spawn(async move { run_row(sides, stream, limits, Some(stop)).await })
    };
    // The purge starts once a claim has: on a fast store it may take a few
    // milliseconds, less than the claiming tasks need to be scheduled.
    let waiting = Instant::now();
    while drawn.next.load(Ordering::Relaxed) == 0 && waiting.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = Instant::now();
    let removed = probe.expire().await;
    figure.purge_ms = started.elapsed().as_secs_f64() * 1e3;
    stop.store(true, Ordering::Relaxed);
    let (measured, elapsed, _) = claims
        .await
        .map_err(|e| Error::fatal("claims during the purge", Some(Box::new(e) as _)))?;
    figure.removed = removed?;
    figure.claims_per_sec = measured.ops as f64 / elapsed.as_secs_f64().max(1e-9);
    figure.claims_p99_us = measured
        .latency
        .as_ref()
        .map_or(0, |h| h.value_at_quantile(0.99));
    figure.errors = measured.errors;
    Ok(figure)
}
