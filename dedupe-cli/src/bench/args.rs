//! `dedupe bench`'s arguments: what a run measures and for how long.

use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A store to measure, as a URL (repeatable; default: memory: and a
    /// SQLite file in a temporary directory). Each runs in a new namespace
    /// (table, schema, prefix) removed afterwards.
    #[arg(long = "store", value_name = "URL")]
    pub(crate) stores: Vec<String>,
    /// Workloads: claim (new keys), duplicate (keys already done), cycle
    /// (claim then complete), batch (claim_many of --batch new keys), mixed
    /// (cycle on keys that repeat with --dup-ratio), accept (inbox accepts of
    /// new keys), work (inbox take-and-complete of --inbox-items accepted
    /// first), ordered (the same with each item under one of 64 ordering
    /// keys: at most one item of a key is held at a time; stores that keep
    /// ordering keys only), start (accept-to-start latency of an idle inbox: items
    /// accepted one at a time while that many InboxWorkers with the default
    /// settings wait, 0 to 300 ms apart; give it a --duration of 30s for a
    /// p99), inbox
    /// (accept, work, ordered, start).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "claim,duplicate,cycle,batch"
    )]
    pub(crate) workload: Vec<Workload>,
    /// Concurrent tasks, each with its own handle; a comma list sweeps.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub(crate) concurrency: Vec<usize>,
    /// How long each row measures (after the warm-up), e.g. 2s.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Operations per row instead of a duration.
    #[arg(long)]
    pub(crate) ops: Option<u64>,
    /// Uncounted warm-up before each row.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub(crate) warmup: Duration,
    /// Keys per claim_many in the batch workload.
    #[arg(long, default_value_t = 16)]
    pub(crate) batch: usize,
    /// Repetitions of each row, store and raw taking turns in pairs whose
    /// order alternates (store then raw, raw then store, ...), each run with
    /// fresh handles and a warm-up. The row shows each side's median run by
    /// ops/s, and as store/raw the median of the pairs' own ratios: a pair
    /// runs back to back, so a spell of a slower machine moves both sides of
    /// it, where it would move one side's median alone. Errors and double
    /// wins count over all.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=99))]
    pub(crate) repeat: u32,
    /// Keys made done before the duplicate workload, which claims them again
    /// and again.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) done_keys: u64,
    /// Share of operations on a key seen before, in the mixed workload.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) dup_ratio: f64,
    /// Items accepted (uncounted) before each work row, which its tasks then
    /// take and complete until the row's time is up or none is left.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) inbox_items: u64,
    /// Records stored before measuring (in flight, long leases), in the
    /// store and in the raw table: how claims move from 10^4 to 10^6 keys.
    #[arg(long, default_value_t = 0)]
    pub(crate) prefill: u64,
    /// Also measure `expire()` over this many expired records while claims
    /// go on at the first concurrency (0: no purge figure).
    #[arg(long, default_value_t = 0)]
    pub(crate) purge: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Also write results.json, results.csv, throughput.svg and latency.svg
    /// into this directory.
    #[arg(long, value_name = "DIR")]
    pub(crate) out: Option<std::path::PathBuf>,
}

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
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
    /// Inbox take-and-complete of items under 64 ordering keys.
    Ordered,
    /// Inbox accepts under 64 ordering keys: the `ordered` row's items.
    #[value(skip)]
    AcceptOrdered,
    /// Accept-to-start latency of an idle inbox's workers.
    Start,
    /// `accept` then `work` (expanded before the run).
    Inbox,
}

impl Workload {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::Claim => "claim",
            Workload::Duplicate => "duplicate",
            Workload::Cycle => "cycle",
            Workload::Batch => "batch",
            Workload::Mixed => "mixed",
            Workload::Accept => "accept",
            Workload::Work => "work",
            Workload::Ordered => "ordered",
            Workload::AcceptOrdered => "accept-ordered",
            Workload::Start => "start",
            Workload::Inbox => "inbox",
        }
    }
}

/// When a row stops: after `period`, or after `ops` operations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) period: Duration,
    pub(crate) ops: Option<u64>,
}

impl BenchArgs {
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            period: self.duration,
            ops: self.ops,
        }
    }

    pub(crate) fn warmup_limits(&self) -> Limits {
        Limits {
            period: self.warmup,
            ops: None,
        }
    }
}
