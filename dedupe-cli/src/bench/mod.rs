//! `dedupe bench`: stores side by side, each against its raw driver doing the
//! same work with its minimal atomic primitive, in one run.
//!
//! Every row is one store, one workload, one concurrency: that many tasks,
//! each with a handle (a connection) of its own, run operations for the
//! row's duration after an uncounted warm-up; then the raw driver does the
//! same. A row reports throughput, latency percentiles (an HDR histogram),
//! errors, and the ratio store / raw. Winners are counted per key: a key won
//! twice is printed and the run exits non-zero.

mod args;
mod chart;
mod load;
mod raw;
mod report;
mod run;
mod start;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use dedupe_core::Error;
use dedupe_url::Opener;

use args::Limits;
pub use args::{BenchArgs, Workload};
use raw::RawStore;
pub use report::Row;
use run::{inbox_handle, judge, run_row, store_handle, KeyStream, Measured, Side, LEASE};

/// Makes the duplicate workload's keys done, through the store and raw.
async fn make_done(
    opener: &Opener,
    raw: Option<&RawStore>,
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
    let mut raw = match raw {
        Some(raw) => Some(Side::Raw(raw.handle(opener).await?)),
        None => None,
    };
    for i in 0..done_keys.max(1) {
        let keys = stream.keys(i);
        store.op(Workload::Cycle, &keys).await?;
        if let Some(raw) = raw.as_mut() {
            raw.op(Workload::Cycle, &keys).await?;
        }
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
            load::load(&opener, raw.as_ref(), "prefill", args.prefill, LEASE).await?;
        }
        measure_store(&opener, raw.as_ref(), args, rows, doubles, progress).await?;
        if args.purge > 0 {
            purges.push(load::purge(&opener, args, args.purge).await?);
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Some(raw) = &raw {
        raw.finish(&opener).await?;
    }
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

/// One run of a row on `concurrency` handles of the store (or of its raw
/// driver): a warm-up on keys of its own, the work row's items accepted
/// uncounted, then the measured run on the same handles.
async fn handles_row(
    opener: &Opener,
    raw: Option<&RawStore>,
    args: &BenchArgs,
    workload: Workload,
    concurrency: usize,
    label: &dyn Fn(&str) -> String,
) -> Result<(Measured, Duration), Error> {
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
    let inbox = matches!(
        workload,
        Workload::Accept | Workload::Work | Workload::Ordered
    );
    if workload == Workload::Ordered && raw.is_none() {
        // A store that keeps no ordering keys refuses the first accept
        // with one (`InvalidConfig`, which skips the row); the probe item
        // is one more for the row to take.
        let probe = inbox_handle(opener).await?;
        let key = dedupe_core::Key::new("bench", label("probe"))?;
        probe
            .accept_with(
                &key,
                b"probe",
                &dedupe_core::AcceptOptions::new().ordering_key("probe"),
            )
            .await?;
    }
    let mut sides = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        sides.push(match raw {
            Some(raw) => Side::Raw(raw.handle(opener).await?),
            None if inbox => Side::Inbox(inbox_handle(opener).await?),
            None => Side::Store(store_handle(opener).await?),
        });
    }
    // The warm-up runs on keys of its own, then the same handles measure.
    let (_, _, sides) = run_row(sides, stream("warm"), args.warmup_limits(), None).await;
    let mut sides = sides;
    if matches!(workload, Workload::Work | Workload::Ordered) {
        // The items the row works through, accepted uncounted
        // on the same handles, after the warm-up (which takes
        // what earlier rows left).
        let fill = Arc::new(KeyStream {
            label: label("items"),
            done_keys: 0,
            batch: 1,
            next: AtomicU64::new(0),
            workload: if workload == Workload::Ordered {
                Workload::AcceptOrdered
            } else {
                Workload::Accept
            },
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

    let (measured, elapsed, _) = run_row(sides, stream(""), args.limits(), None).await;
    Ok((measured, elapsed))
}

async fn measure_store(
    opener: &Opener,
    raw: Option<&RawStore>,
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
                    // 0 is the store, 1 its raw driver, when it has one.
                    let raw = match (m, raw) {
                        (0, _) => None,
                        // No single statement does what a worker's wake-up
                        // does: the start workload has no raw side.
                        (_, Some(_)) if workload == Workload::Start => continue,
                        // Raw drivers keep no ordering keys.
                        (_, Some(_)) if workload == Workload::Ordered => continue,
                        (_, Some(raw)) => Some(raw),
                        (_, None) => continue,
                    };
                    let mode = ["store", "raw"][m];
                    let label = |phase: &str| {
                        if workload == Workload::Duplicate {
                            format!("w{w}")
                        } else {
                            format!("w{w}c{c}m{m}r{rep}{phase}")
                        }
                    };
                    let (measured, elapsed) = if workload == Workload::Start {
                        start::measure(
                            opener,
                            concurrency,
                            &label(""),
                            args.warmup_limits(),
                            args.limits(),
                        )
                        .await?
                    } else {
                        match handles_row(opener, raw, args, workload, concurrency, &label).await {
                            // A store that keeps no ordering keys has no
                            // `ordered` row.
                            Err(Error::InvalidConfig { reason })
                                if workload == Workload::Ordered =>
                            {
                                eprintln!("{shown}: no ordered row: {reason}");
                                continue;
                            }
                            other => other?,
                        }
                    };
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
            if let Some(s) = median(store_reps) {
                let r = median(raw_reps);
                let mut row = Row::new(
                    &shown,
                    opener.url().scheme(),
                    workload,
                    concurrency,
                    &s,
                    r.as_ref(),
                );
                row.stored_keys = args.prefill;
                if paired.is_some() {
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
    // `inbox` is `accept`, `work` and `start`.
    args.workload = args
        .workload
        .iter()
        .flat_map(|w| match w {
            Workload::Inbox => vec![
                Workload::Accept,
                Workload::Work,
                Workload::Ordered,
                Workload::Start,
            ],
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
    if let Some(dir) = &args.out {
        chart::draw(&rows, dir)?;
    }
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
    use dedupe_core::{
        async_trait, ClaimOptions, ClaimOutcome, DedupeStore, Key, Lease, MemoryStore, Record,
    };

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
