//! One row of `dedupe bench`: the keys it uses, the two sides (the store
//! and its raw driver), and the loop that runs tasks against one side and
//! measures them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{AcceptOptions, ClaimOptions, ClaimOutcome, DedupeStore, Error, Inbox, Key};
use dedupe_url::{Opener, Target};
use hdrhistogram::Histogram;

use super::args::{Limits, Workload};
use super::raw::RawHandle;

pub(crate) const LEASE: Duration = Duration::from_secs(300);
pub(crate) const RETENTION: Duration = Duration::from_secs(3600);

/// Where an operation's key comes from.
pub(crate) struct KeyStream {
    pub(crate) label: String,
    pub(crate) done_keys: u64,
    pub(crate) batch: usize,
    pub(crate) next: AtomicU64,
    pub(crate) workload: Workload,
    pub(crate) dup_ratio: f64,
}

impl KeyStream {
    /// The keys of operation number `i` (one, or a batch).
    pub(crate) fn keys(&self, i: u64) -> Vec<String> {
        let batch = self.batch;
        match self.workload {
            Workload::Duplicate => {
                vec![format!("{}-done-{}", self.label, i % self.done_keys.max(1))]
            }
            Workload::Batch => (0..batch as u64)
                .map(|j| format!("{}-{}", self.label, i * batch as u64 + j))
                .collect(),
            Workload::Mixed => {
                // A fixed pseudo-random draw per operation: a key seen shortly
                // before (so racing tasks meet on it) or a new one.
                let h = splitmix(i);
                let repeat = (h % 10_000) as f64 / 10_000.0 < self.dup_ratio && i > 0;
                let n = if repeat {
                    i - 1 - (h >> 32) % i.min(32)
                } else {
                    i
                };
                vec![format!("{}-{n}", self.label)]
            }
            Workload::Claim
            | Workload::Cycle
            | Workload::Accept
            | Workload::AcceptOrdered
            | Workload::Inbox
            | Workload::Start => {
                vec![format!("{}-{i}", self.label)]
            }
            // A take chooses its item.
            Workload::Work | Workload::Ordered => Vec::new(),
        }
    }
}

/// An error and the errors under it, `: `-separated (a raw driver's error is
/// its source).
pub(crate) fn with_sources(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One task's side of a row.
pub(crate) enum Side {
    Store(Arc<dyn DedupeStore>),
    /// The store, for the inbox workloads.
    Inbox(Arc<dyn Inbox>),
    Raw(RawHandle),
}

/// The payload of a benchmark item: about what a small webhook carries.
pub(crate) const PAYLOAD: &[u8] = &[b'x'; 512];

impl Side {
    /// Runs one operation; the keys it won.
    pub(crate) async fn op(
        &mut self,
        workload: Workload,
        keys: &[String],
    ) -> Result<Vec<String>, Error> {
        let opts = ClaimOptions::new(LEASE);
        match self {
            Side::Store(store) => {
                let keys: Vec<Key> = keys
                    .iter()
                    .map(|k| Key::new("bench", k.as_str()))
                    .collect::<Result<_, _>>()?;
                let answers = if keys.len() == 1 {
                    vec![store.claim(&keys[0], &opts).await?]
                } else {
                    store.claim_many(&keys, &opts).await?
                };
                let mut won = Vec::new();
                for (key, answer) in keys.iter().zip(answers) {
                    if let ClaimOutcome::Claimed(lease) = answer {
                        if matches!(workload, Workload::Cycle | Workload::Mixed) {
                            store.complete(&lease, b"ok", RETENTION).await?;
                        }
                        won.push(key.id().to_string());
                    }
                }
                Ok(won)
            }
            Side::Inbox(inbox) => match workload {
                Workload::Work | Workload::Ordered => {
                    match inbox.take("bench", 1, LEASE).await?.pop() {
                        Some(taken) => {
                            inbox.complete(&taken.lease, b"ok", RETENTION).await?;
                            Ok(vec![taken.lease.key.id().to_string()])
                        }
                        None => Ok(Vec::new()),
                    }
                }
                _ => {
                    let mut won = Vec::new();
                    for k in keys {
                        let key = Key::new("bench", k.as_str())?;
                        let mut options = AcceptOptions::new();
                        if workload == Workload::AcceptOrdered {
                            // One of 64 keys, drawn from the key.
                            let h = k.bytes().fold(0u64, |h, b| splitmix(h ^ u64::from(b)));
                            options = options.ordering_key(format!("o{}", h % 64));
                        }
                        if inbox.accept_with(&key, PAYLOAD, &options).await?.is_new() {
                            won.push(k.clone());
                        }
                    }
                    Ok(won)
                }
            },
            Side::Raw(raw) if matches!(workload, Workload::Accept | Workload::Work) => {
                if workload == Workload::Work {
                    return match raw.take(LEASE).await? {
                        Some(key) => {
                            raw.complete(&key, RETENTION).await?;
                            Ok(vec![key])
                        }
                        None => Ok(Vec::new()),
                    };
                }
                let mut won = Vec::new();
                for k in keys {
                    if raw.accept(k).await? {
                        won.push(k.clone());
                    }
                }
                Ok(won)
            }
            Side::Raw(raw) => {
                let answers = raw.claim(keys, LEASE).await?;
                let mut won = Vec::new();
                for (key, answer) in keys.iter().zip(answers) {
                    if answer {
                        if matches!(workload, Workload::Cycle | Workload::Mixed) {
                            raw.complete(key, RETENTION).await?;
                        }
                        won.push(key.clone());
                    }
                }
                Ok(won)
            }
        }
    }
}

/// What the tasks of one row measured.
#[derive(Default)]
pub(crate) struct Measured {
    pub(crate) ops: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) wins: HashMap<String, u32>,
    pub(crate) latency: Option<Histogram<u64>>,
}

pub(crate) async fn run_row(
    sides: Vec<Side>,
    stream: Arc<KeyStream>,
    limits: Limits,
    stop: Option<Arc<AtomicBool>>,
) -> (Measured, Duration, Vec<Side>) {
    let Limits { period, ops: limit } = limits;
    let started = Instant::now();
    let done_ops = Arc::new(AtomicU64::new(0));
    let workload = stream.workload;
    let tasks: Vec<_> = sides
        .into_iter()
        .map(|mut side| {
            let (stream, done_ops) = (Arc::clone(&stream), Arc::clone(&done_ops));
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut m = Measured {
                    latency: Histogram::new_with_bounds(1, 60_000_000, 3).ok(),
                    ..Measured::default()
                };
                loop {
                    if stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed)) {
                        break;
                    }
                    match limit {
                        Some(n) if done_ops.fetch_add(1, Ordering::Relaxed) >= n => break,
                        None if started.elapsed() >= period => break,
                        _ => {}
                    }
                    let i = stream.next.fetch_add(1, Ordering::Relaxed);
                    let keys = stream.keys(i);
                    let t = Instant::now();
                    match side.op(workload, &keys).await {
                        // Nothing left to take: this task's part of the row is done.
                        Ok(won)
                            if matches!(workload, Workload::Work | Workload::Ordered)
                                && won.is_empty() =>
                        {
                            break
                        }
                        Ok(won) => {
                            if let Some(h) = m.latency.as_mut() {
                                let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                            }
                            m.ops += keys.len().max(won.len()) as u64;
                            for k in won {
                                *m.wins.entry(k).or_default() += 1;
                            }
                        }
                        Err(e) => {
                            m.errors += 1;
                            m.first_error.get_or_insert_with(|| with_sources(&e));
                        }
                    }
                }
                (m, side)
            })
        })
        .collect();
    let mut total = Measured::default();
    let mut sides = Vec::with_capacity(tasks.len());
    for task in tasks {
        let Ok((m, side)) = task.await else {
            total.errors += 1;
            continue;
        };
        sides.push(side);
        total.ops += m.ops;
        total.errors += m.errors;
        if total.first_error.is_none() {
            total.first_error = m.first_error;
        }
        for (k, n) in m.wins {
            *total.wins.entry(k).or_default() += n;
        }
        match (&mut total.latency, m.latency) {
            (Some(all), Some(h)) => {
                let _ = all.add(h);
            }
            (slot @ None, h) => *slot = h,
            _ => {}
        }
    }
    (total, started.elapsed(), sides)
}

/// Every key won more than once, and for the duplicate workload every done
/// key claimed again: each is a broken single-winner guarantee.
pub(crate) fn judge(measured: &Measured, workload: Workload, who: &str) -> Vec<String> {
    let mut doubles: Vec<String> = measured
        .wins
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(key, n)| format!("{who} {}: {key} won {n} times", workload.name()))
        .collect();
    if workload == Workload::Duplicate && !measured.wins.is_empty() {
        doubles.push(format!(
            "{who} duplicate: {} done keys were claimed again",
            measured.wins.len()
        ));
    }
    doubles.sort();
    doubles
}

/// A store handle for one benchmark task. Like the raw baseline it holds one
/// connection of its own, unless the URL sets `?connections=`.
pub(crate) async fn store_handle(opener: &Opener) -> Result<Arc<dyn DedupeStore>, Error> {
    match opener.url().target() {
        Target::Sqlite {
            connections: None, ..
        } => Ok(Arc::new(opener.sqlite(1).await?)),
        Target::Postgres {
            connections: None, ..
        } => Ok(Arc::new(opener.postgres_dedicated(1).await?)),
        Target::Mysql {
            connections: None, ..
        } => Ok(Arc::new(opener.mysql_dedicated(1).await?)),
        _ => opener.handle().await,
    }
}

/// The store's inbox for one benchmark task, on handles as [`store_handle`]'s.
pub(crate) async fn inbox_handle(opener: &Opener) -> Result<Arc<dyn Inbox>, Error> {
    match opener.url().target() {
        Target::Sqlite {
            connections: None, ..
        } => Ok(Arc::new(opener.sqlite(1).await?)),
        Target::Postgres {
            connections: None, ..
        } => Ok(Arc::new(opener.postgres_dedicated(1).await?)),
        _ => opener
            .inbox_handle()
            .await?
            .ok_or_else(|| Error::config("this store has no inbox")),
    }
}
