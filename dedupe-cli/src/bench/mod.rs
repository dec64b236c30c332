//! `dedupe bench`: stores side by side, each against its raw driver doing the
//! same work with its minimal atomic primitive, in one run.
//!
//! Every row is one store, one workload, one concurrency: that many tasks,
//! each with a handle (a connection) of its own, run operations for the
//! row's duration after an uncounted warm-up; then the raw driver does the
//! same. A row reports throughput, latency percentiles (an HDR histogram),
//! errors, and the ratio store / raw. Winners are counted per key: a key won
//! twice is printed and the run exits non-zero.

mod chart;
mod load;
mod raw;
mod report;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Inbox, Key};
use dedupe_url::{Opener, Target};
use hdrhistogram::Histogram;

use raw::{RawHandle, RawStore};
pub use report::Row;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A store to measure, as a URL (repeatable; default: memory: and a
    /// SQLite file in a temporary directory). Each runs in a new namespace
    /// (table, schema, prefix) removed afterwards.
    #[arg(long = "store", value_name = "URL")]
    pub stores: Vec<String>,
    /// Workloads: claim (new keys), duplicate (keys already done), cycle
    /// (claim then complete), batch (claim_many of --batch new keys), mixed
    /// (cycle on keys that repeat with --dup-ratio), accept (inbox accepts of
    /// new keys), work (inbox take-and-complete of --inbox-items accepted
    /// first), inbox (accept then work).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "claim,duplicate,cycle,batch"
    )]
    pub workload: Vec<Workload>,
    /// Concurrent tasks, each with its own handle; a comma list sweeps.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// How long each row measures (after the warm-up), e.g. 2s.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Operations per row instead of a duration.
    #[arg(long)]
    pub ops: Option<u64>,
    /// Uncounted warm-up before each row.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Keys per claim_many in the batch workload.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Repetitions of each row, store and raw taking turns in pairs whose
    /// order alternates (store then raw, raw then store, ...), each run with
    /// fresh handles and a warm-up. The row shows each side's median run by
    /// ops/s, and as store/raw the median of the pairs' own ratios: a pair
    /// runs back to back, so a spell of a slower machine moves both sides of
    /// it, where it would move one side's median alone. Errors and double
    /// wins count over all.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=99))]
    pub repeat: u32,
    /// Keys made done before the duplicate workload, which claims them again
    /// and again.
    #[arg(long, default_value_t = 1_000)]
    pub done_keys: u64,
    /// Share of operations on a key seen before, in the mixed workload.
    #[arg(long, default_value_t = 0.5)]
    pub dup_ratio: f64,
    /// Items accepted (uncounted) before each work row, which its tasks then
    /// take and complete until the row's time is up or none is left.
    #[arg(long, default_value_t = 20_000)]
    pub inbox_items: u64,
    /// Records stored before measuring (in flight, long leases), in the
    /// store and in the raw table: how claims move from 10^4 to 10^6 keys.
    #[arg(long, default_value_t = 0)]
    pub prefill: u64,
    /// Also measure `expire()` over this many expired records while claims
    /// go on at the first concurrency (0: no purge figure).
    #[arg(long, default_value_t = 0)]
    pub purge: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write results.json, results.csv, throughput.svg and latency.svg
    /// into this directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<std::path::PathBuf>,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let url = format!("memory:?timeout={text}");
    url.parse::<dedupe_url::StoreUrl>()
        .ok()
        .and_then(|u| u.timeout())
        .ok_or_else(|| format!("{text:?} is not a duration like 500ms, 2s or 1m"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Claim,
    Duplicate,
    Cycle,
    Batch,
    Mixed,
    /// Inbox accepts of new keys.
    Accept,
    /// Inbox take-and-complete, one item a take.
    Work,
    /// `accept` then `work` (expanded before the run).
    Inbox,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Claim => "claim",
            Workload::Duplicate => "duplicate",
            Workload::Cycle => "cycle",
            Workload::Batch => "batch",
            Workload::Mixed => "mixed",
            Workload::Accept => "accept",
            Workload::Work => "work",
            Workload::Inbox => "inbox",
        }
    }
}

/// When a row stops: after `period`, or after `ops` operations.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub period: Duration,
    pub ops: Option<u64>,
}

impl BenchArgs {
    fn limits(&self) -> Limits {
        Limits {
            period: self.duration,
            ops: self.ops,
        }
    }

    fn warmup_limits(&self) -> Limits {
        Limits {
            period: self.warmup,
            ops: None,
        }
    }
}

const LEASE: Duration = Duration::from_secs(300);
const RETENTION: Duration = Duration::from_secs(3600);

/// Where an operation's key comes from.
struct KeyStream {
    label: String,
    done_keys: u64,
    batch: usize,
    next: AtomicU64,
    workload: Workload,
    dup_ratio: f64,
}

impl KeyStream {
    /// The keys of operation number `i` (one, or a batch).
    fn keys(&self, i: u64) -> Vec<String> {
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
            Workload::Claim | Workload::Cycle | Workload::Accept | Workload::Inbox => {
                vec![format!("{}-{i}", self.label)]
            }
            // A take chooses its item.
            Workload::Work => Vec::new(),
        }
    }
}

/// An error and the errors under it, `: `-separated (a raw driver's error is
/// its source).
fn with_sources(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One task's side of a row.
enum Side {
    Store(Arc<dyn DedupeStore>),
    /// The store, for the inbox workloads.
    Inbox(Arc<dyn Inbox>),
    Raw(RawHandle),
}

/// The payload of a benchmark item: about what a small webhook carries.
const PAYLOAD: &[u8] = &[b'x'; 512];

impl Side {
    /// Runs one operation; the keys it won.
    async fn op(&mut self, workload: Workload, keys: &[String]) -> Result<Vec<String>, Error> {
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
                Workload::Work => match inbox.take("bench", 1, LEASE).await?.pop() {
                    Some(taken) => {
                        inbox.complete(&taken.lease, b"ok", RETENTION).await?;
                        Ok(vec![taken.lease.key.id().to_string()])
                    }
                    None => Ok(Vec::new()),
                },
                _ => {
                    let mut won = Vec::new();
                    for k in keys {
                        let key = Key::new("bench", k.as_str())?;
                        if inbox.accept(&key, PAYLOAD).await?.is_new() {
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
struct Measured {
    ops: u64,
    errors: u64,
    first_error: Option<String>,
    wins: HashMap<String, u32>,
    latency: Option<Histogram<u64>>,
}

async fn run_row(
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
                        Ok(won) if workload == Workload::Work && won.is_empty() => break,
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
fn judge(measured: &Measured, workload: Workload, who: &str) -> Vec<String> {
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
async fn inbox_handle(opener: &Opener) -> Result<Arc<dyn Inbox>, Error> {
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

/// Makes the duplicate workload's keys done, through the store and raw.
async fn make_done(
    opener: &Opener,
    raw: &RawStore,
    label: &str,
    done_keys: u64,
) -> Result<(), Error> {
    let stream = KeyStream {
        label: label.to_string(),
        done_keys,
        batch: 1,
        next: AtomicU64::new(0),
        workload: Workload::Duplicate,
        dup_ratio: 0.0,
    };
    let mut store = Side::Store(store_handle(opener).await?);
    let mut raw = Side::Raw(raw.handle(opener).await?);
    for i in 0..done_keys.max(1) {
        let keys = stream.keys(i);
        store.op(Workload::Cycle, &keys).await?;
        raw.op(Workload::Cycle, &keys).await?;
    }
    Ok(())
}

async fn bench_store(
    url: dedupe_url::StoreUrl,
    args: &BenchArgs,
    rows: &mut Vec<Row>,
    purges: &mut Vec<load::Purge>,
    doubles: &mut Vec<String>,
    progress: &indicatif::ProgressBar,
) -> Result<(), Error> {
    let opener = Opener::new(url.in_namespace(&crate::fresh_namespace())).await?;
    let raw = RawStore::prepare(&opener).await?;
    let result = async {
        if args.prefill > 0 {
            load::load(&opener, Some(&raw), "prefill", args.prefill, LEASE).await?;
        }
        measure_store(&opener, &raw, args, rows, doubles, progress).await?;
        if args.purge > 0 {
            purges.push(load::purge(&opener, args, args.purge).await?);
        }
        Ok::<(), Error>(())
    }
    .await;
    raw.finish(&opener).await?;
    opener.remove_namespace().await?;
    result
}

/// The median of the paired repetitions' own store/raw ratios (the lower of
/// the two middle ones for an even count); `None` without a pair whose raw
/// side ran any operation.
fn paired_ratio(store: &[(Measured, Duration)], raw: &[(Measured, Duration)]) -> Option<f64> {
    let mut ratios: Vec<f64> = store
        .iter()
        .zip(raw)
        .filter_map(|((s, se), (r, re))| {
            let raw = report::rate(r, *re);
            (raw > 0.0).then(|| report::rate(s, *se) / raw)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios.get(ratios.len().checked_sub(1)? / 2).copied()
}

/// The repetition with the median rate (the lower of the two middle ones for an
/// even count), carrying the errors of every repetition.
fn median(mut reps: Vec<(Measured, Duration)>) -> Option<(Measured, Duration)> {
    let errors: u64 = reps.iter().map(|(m, _)| m.errors).sum();
    let first_error = reps.iter().find_map(|(m, _)| m.first_error.clone());
    reps.sort_by(|(a, ae), (b, be)| report::rate(a, *ae).total_cmp(&report::rate(b, *be)));
    let middle = reps.len().checked_sub(1)? / 2;
    let (mut chosen, elapsed) = reps.swap_remove(middle);
    chosen.errors = errors;
    chosen.first_error = chosen.first_error.or(first_error);
    Some((chosen, elapsed))
}

async fn measure_store(
    opener: &Opener,
    raw: &RawStore,
    args: &BenchArgs,
    rows: &mut Vec<Row>,
    doubles: &mut Vec<String>,
    progress: &indicatif::ProgressBar,
) -> Result<(), Error> {
    let shown = opener.url().to_string();
    for (w, &workload) in args.workload.iter().enumerate() {
        if workload == Workload::Duplicate {
            make_done(opener, raw, &format!("w{w}"), args.done_keys).await?;
        }
        for (c, &concurrency) in args.concurrency.iter().enumerate() {
            let concurrency = concurrency.max(1);
            progress.set_message(format!(
                "{} {} x{concurrency}",
                opener.url().scheme(),
                workload.name()
            ));
            let mut reps: [Vec<(Measured, Duration)>; 2] = [Vec::new(), Vec::new()];
            for rep in 0..args.repeat {
                // Store first in even repetitions, raw first in odd ones, so
                // a machine that drifts faster or slower favours neither.
                let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
                for m in order {
                    let mode = ["store", "raw"][m];
                    let label = |phase: &str| {
                        if workload == Workload::Duplicate {
                            format!("w{w}")
                        } else {
                            format!("w{w}c{c}m{m}r{rep}{phase}")
                        }
                    };
                    let stream = |phase: &str| {
                        Arc::new(KeyStream {
                            label: label(phase),
                            done_keys: args.done_keys,
                            batch: args.batch,
                            next: AtomicU64::new(0),
                            workload,
                            dup_ratio: args.dup_ratio,
                        })
                    };
                    let inbox = matches!(workload, Workload::Accept | Workload::Work);
                    let mut sides = Vec::with_capacity(concurrency);
                    for _ in 0..concurrency {
                        sides.push(match mode {
                            "store" if inbox => Side::Inbox(inbox_handle(opener).await?),
                            "store" => Side::Store(store_handle(opener).await?),
                            _ => Side::Raw(raw.handle(opener).await?),
                        });
                    }
                    // The warm-up runs on keys of its own, then the same handles measure.
                    let (_, _, sides) =
                        run_row(sides, stream("warm"), args.warmup_limits(), None).await;
                    let mut sides = sides;
                    if workload == Workload::Work {
                        // The items the row works through, accepted uncounted
                        // on the same handles, after the warm-up (which takes
                        // what earlier rows left).
                        let fill = Arc::new(KeyStream {
                            label: label("items"),
                            done_keys: 0,
                            batch: 1,
                            next: AtomicU64::new(0),
                            workload: Workload::Accept,
                            dup_ratio: 0.0,
                        });
                        let limits = Limits {
                            period: Duration::from_secs(3600),
                            ops: Some(args.inbox_items),
                        };
                        let (filled, _, back) = run_row(sides, fill, limits, None).await;
                        if let Some(e) = filled.first_error {
                            return Err(Error::retryable(
                                format!("accepting the work row's items: {e}"),
                                None,
                            ));
                        }
                        sides = back;
                    }

                    let (measured, elapsed, _) =
                        run_row(sides, stream(""), args.limits(), None).await;
                    doubles.extend(judge(&measured, workload, &format!("{shown} {mode}")));
                    if let Some(e) = &measured.first_error {
                        eprintln!(
                            "{shown} {mode} {}: {} errors, the first: {e}",
                            workload.name(),
                            measured.errors
                        );
                    }
                    reps[m].push((measured, elapsed));
                }
            }
            let [store_reps, raw_reps] = reps;
            let paired = paired_ratio(&store_reps, &raw_reps);
            if let (Some(s), Some(r)) = (median(store_reps), median(raw_reps)) {
                let mut row =
                    Row::new(&shown, opener.url().scheme(), workload, concurrency, &s, &r);
                row.stored_keys = args.prefill;
                if let Some(paired) = paired {
                    row.store_over_raw = paired;
                }
                rows.push(row);
            }
            progress.inc(1);
        }
    }
    Ok(())
}

pub async fn bench(mut args: BenchArgs) -> Result<bool, Error> {
    // `inbox` is `accept` then `work`.
    args.workload = args
        .workload
        .iter()
        .flat_map(|w| match w {
            Workload::Inbox => vec![Workload::Accept, Workload::Work],
            other => vec![*other],
        })
        .collect();
    let urls = if args.stores.is_empty() {
        vec!["memory:".to_string(), "sqlite:".to_string()]
    } else {
        args.stores.clone()
    };
    let urls: Vec<dedupe_url::StoreUrl> = urls
        .iter()
        .map(|u| crate::store_url(u))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut purges = Vec::new();
    let mut doubles = Vec::new();
    // Drawn on stderr only when it is a terminal.
    let progress = indicatif::ProgressBar::new(
        (urls.len() * args.workload.len() * args.concurrency.len()) as u64,
    );
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} rows  {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // A store that fails is reported after the others' results, not instead.
    let mut failed = None;
    for url in urls {
        let shown = url.to_string();
        if let Err(e) =
            bench_store(url, &args, &mut rows, &mut purges, &mut doubles, &progress).await
        {
            eprintln!("{shown}: {e}");
            failed.get_or_insert(e);
        }
    }
    progress.finish_and_clear();
    report::print(&rows, &purges, &args)?;
    for d in &doubles {
        println!("DOUBLE WIN: {d}");
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(doubles.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupe_core::{async_trait, Lease, MemoryStore, Record};

    /// The row of repeated runs is the median one by rate, whatever the order
    /// they ran in, and keeps every run's errors.
    #[test]
    fn repeated_rows_show_the_median_run_and_every_error() {
        let run = |ops: u64, errors: u64| {
            (
                Measured {
                    ops,
                    errors,
                    first_error: (errors > 0).then(|| format!("{errors} went wrong")),
                    ..Measured::default()
                },
                Duration::from_secs(1),
            )
        };
        let (chosen, _) = median(vec![run(900, 0), run(100, 2), run(500, 0)]).expect("a row");
        assert_eq!(chosen.ops, 500);
        assert_eq!(chosen.errors, 2);
        assert_eq!(chosen.first_error.as_deref(), Some("2 went wrong"));
        let (lower, _) = median(vec![run(300, 0), run(100, 0)]).expect("a row");
        assert_eq!(lower.ops, 100, "an even count shows the lower middle");
        assert!(median(Vec::new()).is_none());
    }

    /// store/raw of repeated runs is the median of each pair's own ratio: a
    /// slow spell that slows both sides of one pair does not move it, where
    /// the sides' medians taken apart would pair a slow run with a fast one.
    #[test]
    fn repeated_rows_take_the_median_of_the_pairs_ratios() {
        let run = |ops: u64| {
            (
                Measured {
                    ops,
                    ..Measured::default()
                },
                Duration::from_secs(1),
            )
        };
        let runs = |ops: &[u64]| ops.iter().map(|&n| run(n)).collect::<Vec<_>>();
        // Pairs at 0.9, 0.9 and 0.5 of raw, the machine twice as fast during
        // the second and third: the sides' medians apart (1,000 and 2,000)
        // would say 0.5.
        let (store, raw) = (runs(&[900, 1800, 1000]), runs(&[1000, 2000, 2000]));
        let ratio = paired_ratio(&store, &raw).expect("a ratio");
        assert!((ratio - 0.9).abs() < 1e-9, "{ratio}");
        let apart =
            median(store).expect("a run").0.ops as f64 / median(raw).expect("a run").0.ops as f64;
        assert!((apart - 0.5).abs() < 1e-9, "{apart}");
        // Pairs at 1.0, 0.9 and 0.2: matched by repetition the median is 0.9;
        // each side sorted before pairing, or one side reversed, gives 0.5.
        let ratio = paired_ratio(&runs(&[1000, 900, 400]), &runs(&[1000, 1000, 2000]));
        assert!((ratio.expect("a ratio") - 0.9).abs() < 1e-9, "{ratio:?}");
        assert_eq!(
            paired_ratio(&[run(5)], &[run(0)]),
            None,
            "no raw operations, no ratio"
        );
        assert_eq!(paired_ratio(&[], &[]), None);
    }

    /// A broken store: every claim wins.
    #[derive(Debug)]
    struct EveryoneWins;

    #[async_trait]
    impl DedupeStore for EveryoneWins {
        async fn claim(&self, key: &Key, opts: &ClaimOptions) -> dedupe_core::Result<ClaimOutcome> {
            Ok(ClaimOutcome::Claimed(Lease {
                key: key.clone(),
                token: dedupe_core::backend::new_token(),
                deadline: std::time::SystemTime::now() + opts.lease_ttl,
                attempt: 1,
                claim_id: None,
            }))
        }
        async fn complete(&self, _: &Lease, _: &[u8], _: Duration) -> dedupe_core::Result<()> {
            Ok(())
        }
        async fn release(&self, _: &Lease) -> dedupe_core::Result<()> {
            Ok(())
        }
        async fn extend(&self, lease: &Lease, _: Duration) -> dedupe_core::Result<Lease> {
            Ok(lease.clone())
        }
        async fn expire(&self) -> dedupe_core::Result<u64> {
            Ok(0)
        }
        async fn get(&self, _: &Key) -> dedupe_core::Result<Option<Record>> {
            Ok(None)
        }
        async fn forget(&self, _: &Key) -> dedupe_core::Result<bool> {
            Ok(false)
        }
    }

    fn stream(workload: Workload) -> Arc<KeyStream> {
        Arc::new(KeyStream {
            label: "t".into(),
            done_keys: 3,
            batch: 4,
            next: AtomicU64::new(0),
            workload,
            dup_ratio: 0.9,
        })
    }

    const FEW: Limits = Limits {
        period: Duration::from_secs(10),
        ops: Some(200),
    };

    #[tokio::test]
    async fn a_store_that_lets_two_win_is_caught() {
        for workload in [Workload::Mixed, Workload::Duplicate] {
            let sides = vec![
                Side::Store(Arc::new(EveryoneWins)),
                Side::Store(Arc::new(EveryoneWins)),
            ];
            let (measured, _, _) = run_row(sides, stream(workload), FEW, None).await;
            assert!(
                !judge(&measured, workload, "broken").is_empty(),
                "{workload:?}: a store where everyone wins passed"
            );
        }
    }

    #[tokio::test]
    async fn a_correct_store_is_not_accused() {
        let store = MemoryStore::new();
        let sides = vec![
            Side::Store(Arc::new(store.clone())),
            Side::Store(Arc::new(store.clone())),
        ];
        let (measured, _, _) = run_row(sides, stream(Workload::Mixed), FEW, None).await;
        assert_eq!(measured.errors, 0);
        assert!(measured.ops > 0);
        assert_eq!(
            judge(&measured, Workload::Mixed, "memory"),
            Vec::<String>::new()
        );
    }
}
