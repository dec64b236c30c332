//! `dedupe soak`: minutes of mixed traffic on one store (claims of fresh and
//! repeated keys, completions, releases, abandoned leases that expire, stalled
//! holders whose completion must be refused, and a purge every second), with
//! the process's memory and sockets sampled every second. Every answer is
//! recorded and checked against the contract epoch by epoch (each epoch has
//! keys of its own, so its history can be judged and dropped once the workers
//! moved on): any double win or lost completion fails the run. Timings and
//! the memory curve are reported, never asserted.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupe_conformance::history::{recheck_completed, History, Recorder};
use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key};
use dedupe_url::Opener;

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL", default_value = "sqlite:")]
    pub store: String,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Concurrent workers, sharing one store handle.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Distinct keys per epoch (fewer keys: more duplicates and contention).
    #[arg(long, default_value_t = 500)]
    pub keys: u64,
    /// Seconds per epoch: each epoch's history is judged and dropped.
    #[arg(long, default_value_t = 5)]
    pub epoch_seconds: u64,
    /// Milliseconds each worker pauses between operations (a steady load
    /// rather than the most the store takes, so the recorded history, and with
    /// it this process's memory, stays small and a store's own growth shows).
    #[arg(long, default_value_t = 1)]
    pub pause_ms: u64,
    /// Run in a new namespace of the store, removed afterwards.
    #[arg(long)]
    pub fresh: bool,
}

/// One epoch: its history and how many workers have left it.
struct Epoch {
    number: u64,
    history: History,
    left: AtomicUsize,
}

#[derive(Default)]
struct Totals {
    calls: AtomicU64,
    errors: AtomicU64,
    violations: AtomicU64,
    lost: AtomicU64,
    judged: AtomicU64,
    won: AtomicU64,
}

fn sample() -> (u64, usize) {
    let rss_kb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let sockets = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .map(|t| t.to_string_lossy().starts_with("socket:"))
                        .unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0);
    (rss_kb, sockets)
}

pub async fn soak(args: SoakArgs) -> Result<bool, Error> {
    // Soak leases are 200 ms to 1 s long.
    let store_url = crate::store_url(&args.store)?.with_short_leases();
    let url = if args.fresh {
        store_url.in_namespace(&crate::fresh_namespace())
    } else {
        store_url
    };
    let opener = Opener::new(url).await?;
    let store = opener.handle().await?;
    let workers = args.workers.max(1);
    let epoch_len = Duration::from_secs(args.epoch_seconds.max(1));
    let run_for = Duration::from_secs(args.seconds.max(1));
    println!(
        "soaking {} for {run_for:?}: {workers} workers, {} keys per {epoch_len:?} epoch",
        opener.url(),
        args.keys
    );
    let started = Instant::now();
    // Keys of this run only: a tag from the process id and the clock.
    let run_id: String = crate::fresh_namespace()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    let current: Arc<Mutex<Arc<Epoch>>> = Arc::new(Mutex::new(Arc::new(Epoch {
        number: 0,
        history: History::new(Duration::from_millis(100)),
        left: AtomicUsize::new(0),
    })));
    let retired: Arc<Mutex<Vec<Arc<Epoch>>>> = Arc::new(Mutex::new(Vec::new()));
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));

    let mut tasks = Vec::new();
    for worker in 0..workers {
        let (store, current, totals, stop) = (
            Arc::clone(&store),
            Arc::clone(&current),
            Arc::clone(&totals),
            Arc::clone(&stop),
        );
        let (keys, run_id) = (args.keys.max(1), run_id.clone());
        let pause = Duration::from_millis(args.pause_ms);
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x2545_f491_4f6c_dd1d_u64 ^ (worker as u64 + 1).wrapping_mul(0x9e37);
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut mine: Option<Arc<Epoch>> = None;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let epoch = current.lock().map(|e| Arc::clone(&e)).ok();
                let Some(epoch) = epoch else { break };
                if mine.as_ref().map(|e| e.number) != Some(epoch.number) {
                    if let Some(old) = mine.take() {
                        old.left.fetch_add(1, Ordering::SeqCst);
                    }
                    mine = Some(Arc::clone(&epoch));
                }
                let recorder = Recorder::new(Arc::clone(&store), epoch.history.clone(), worker);
                i += 1;
                let Ok(key) = Key::new(
                    format!("soak-{run_id}-e{}", epoch.number),
                    format!("k{}", next() % keys),
                ) else {
                    break;
                };
                let lease = Duration::from_millis(200 + next() % 800);
                totals.calls.fetch_add(1, Ordering::Relaxed);
                let result = match recorder.claim(&key, &ClaimOptions::new(lease)).await {
                    Ok(ClaimOutcome::Claimed(lease)) => {
                        totals.won.fetch_add(1, Ordering::Relaxed);
                        totals.calls.fetch_add(1, Ordering::Relaxed);
                        match next() % 20 {
                            // Abandoned: the lease expires and is taken over.
                            0 | 1 => Ok(()),
                            2 | 3 => recorder.release(&lease).await,
                            // Stalled past the lease (and the history's clock
                            // tolerance): the completion must be refused
                            // (LeaseLost); a success is a stale completion the
                            // history check reports.
                            4 => {
                                tokio::time::sleep(
                                    lease
                                        .deadline
                                        .duration_since(std::time::SystemTime::now())
                                        .unwrap_or_default()
                                        + Duration::from_millis(300),
                                )
                                .await;
                                match recorder
                                    .complete(
                                        &lease,
                                        format!("late-{worker}-{i}").as_bytes(),
                                        Duration::from_secs(1800),
                                    )
                                    .await
                                {
                                    Err(Error::LeaseLost { .. }) => Ok(()),
                                    other => other,
                                }
                            }
                            _ => {
                                recorder
                                    .complete(
                                        &lease,
                                        format!("w{worker}-{i}").as_bytes(),
                                        Duration::from_secs(1800),
                                    )
                                    .await
                            }
                        }
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(e),
                };
                if let Err(e) = result {
                    totals.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "soak call failed");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
            }
            if let Some(old) = mine {
                old.left.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }

    // The conductor: every second a purge and a sample; each epoch boundary
    // starts the next epoch; epochs every worker left are judged and dropped.
    let mut samples = Vec::new();
    let mut last_calls = 0;
    let mut epoch_number = 0;
    let mut purged = 0u64;
    while started.elapsed() < run_for {
        tokio::time::sleep(Duration::from_secs(1)).await;
        match store.expire().await {
            Ok(n) => purged += n,
            Err(e) => {
                totals.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "soak purge failed");
            }
        }
        let due = (started.elapsed().as_secs_f64() / epoch_len.as_secs_f64()) as u64;
        if due > epoch_number {
            epoch_number = due;
            let fresh = Arc::new(Epoch {
                number: epoch_number,
                history: History::new(Duration::from_millis(100)),
                left: AtomicUsize::new(0),
            });
            if let Ok(mut cur) = current.lock() {
                let old = std::mem::replace(&mut *cur, fresh);
                if let Ok(mut r) = retired.lock() {
                    r.push(old);
                }
            }
        }
        judge_left_epochs(&retired, workers, &store, &totals, false).await;
        let (rss_kb, sockets) = sample();
        let calls = totals.calls.load(Ordering::Relaxed);
        println!(
            "t={:>4}s  ops/s={:>7}  rss={:>7.1} MiB  sockets={:>3}  errors={}  judged epochs={} violations={} lost={}",
            started.elapsed().as_secs(),
            calls - last_calls,
            rss_kb as f64 / 1024.0,
            sockets,
            totals.errors.load(Ordering::Relaxed),
            totals.judged.load(Ordering::Relaxed),
            totals.violations.load(Ordering::Relaxed),
            totals.lost.load(Ordering::Relaxed),
        );
        samples.push((rss_kb, sockets));
        last_calls = calls;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    if let Ok(mut cur) = current.lock() {
        if let Ok(mut r) = retired.lock() {
            r.push(Arc::clone(&cur));
        }
        *cur = Arc::new(Epoch {
            number: u64::MAX,
            history: History::new(Duration::from_millis(100)),
            left: AtomicUsize::new(usize::MAX / 2),
        });
    }
    judge_left_epochs(&retired, workers, &store, &totals, true).await;

    let quarter = samples.get(samples.len() / 4).copied().unwrap_or_default();
    let end = samples.last().copied().unwrap_or_default();
    let peak_sockets = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let violations = totals.violations.load(Ordering::Relaxed);
    let lost = totals.lost.load(Ordering::Relaxed);
    println!(
        "soak done: {} calls, {} claims won, {} errors, {purged} records purged; {} epochs judged: \
         {violations} contract violations, {lost} acknowledged completions lost; rss {:.1} MiB at a \
         quarter, {:.1} MiB at the end; sockets {} at a quarter, {} at the end, {peak_sockets} at most",
        totals.calls.load(Ordering::Relaxed),
        totals.won.load(Ordering::Relaxed),
        totals.errors.load(Ordering::Relaxed),
        totals.judged.load(Ordering::Relaxed),
        quarter.0 as f64 / 1024.0,
        end.0 as f64 / 1024.0,
        quarter.1,
        end.1,
    );
    if args.fresh {
        if let Err(e) = opener.remove_namespace().await {
            eprintln!("warning: could not remove the soak namespace: {e}");
        }
    }
    Ok(violations == 0 && lost == 0)
}

/// Judges (and drops) every retired epoch all workers have left; `all` judges
/// every retired epoch (the workers have stopped).
async fn judge_left_epochs(
    retired: &Mutex<Vec<Arc<Epoch>>>,
    workers: usize,
    store: &Arc<dyn DedupeStore>,
    totals: &Totals,
    all: bool,
) {
    let ready: Vec<Arc<Epoch>> = match retired.lock() {
        Ok(mut r) => {
            let (ready, waiting): (Vec<_>, Vec<_>) = r
                .drain(..)
                .partition(|e| all || e.left.load(Ordering::SeqCst) >= workers);
            *r = waiting;
            ready
        }
        Err(_) => return,
    };
    for epoch in ready {
        let lost =
            recheck_completed(Arc::clone(store), &epoch.history, Duration::from_secs(30)).await;
        if let Err(problems) = epoch.history.check() {
            for p in problems.iter().take(5) {
                eprintln!("epoch {}: {p}", epoch.number);
            }
            totals
                .violations
                .fetch_add(problems.len() as u64, Ordering::Relaxed);
        }
        for l in lost.iter().take(5) {
            eprintln!("epoch {}: lost {l}", epoch.number);
        }
        totals.lost.fetch_add(lost.len() as u64, Ordering::Relaxed);
        totals.judged.fetch_add(1, Ordering::Relaxed);
    }
}
