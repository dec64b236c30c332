//! `dedupe race`: duplicate deliveries of every event, copies at the same
//! instant and later retries, through a Deduper; every event's work must run
//! exactly once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupe_core::{Deduper, Error, HandleError, Handled, Key};
use dedupe_url::Opener;

#[derive(clap::Args, Debug)]
pub struct RaceArgs {
    /// The store, as a URL: memory:, sqlite:[//path], postgres://...,
    /// redis://..., redis+cluster://..., dynamodb://TABLE?endpoint=...
    #[arg(long, value_name = "URL", default_value = "sqlite:")]
    pub store: String,
    /// Distinct events.
    #[arg(long, default_value_t = 500)]
    pub events: u32,
    /// Deliveries of each event.
    #[arg(long, default_value_t = 4)]
    pub copies: u32,
    /// Concurrent workers, each on its own store handle (its own connection).
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// Run in a new namespace of the store (table, schema, prefix), removed
    /// afterwards, instead of the one the URL names.
    #[arg(long)]
    pub fresh: bool,
    /// Milliseconds the work of one event takes.
    #[arg(long, default_value_t = 2)]
    pub work_ms: u64,
}

#[derive(Default)]
struct Tally {
    ran: AtomicU64,
    duplicates: AtomicU64,
    in_flight: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
    takeovers: AtomicU64,
}

/// Order of deliveries: half the events arrive as a burst of copies at once, the
/// other half spread over the run (retries after the first copy finished).
fn delivery_order(events: u32, copies: u32) -> VecDeque<u32> {
    let mut bursts = Vec::new();
    let mut spread = Vec::new();
    for e in 0..events {
        for _ in 0..copies {
            if e % 2 == 0 {
                bursts.push(e);
            } else {
                spread.push(e);
            }
        }
    }
    // A fixed permutation (multiplicative step coprime with the length) keeps runs
    // comparable without a random number generator.
    let n = spread.len();
    let step = (1..n.max(2))
        .rev()
        .find(|s| gcd(*s, n) == 1 && *s > n / 3)
        .unwrap_or(1);
    let spread: Vec<u32> = (0..n).map(|i| spread[(i * step) % n.max(1)]).collect();
    let mut order = VecDeque::with_capacity(bursts.len() + spread.len());
    let mut s = spread.into_iter();
    for chunk in bursts.chunks(copies.max(1) as usize) {
        order.extend(chunk.iter().copied());
        order.extend(s.by_ref().take(copies as usize));
    }
    order.extend(s);
    order
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub async fn race(args: RaceArgs) -> Result<bool, Error> {
    let store = crate::store_url(&args.store)?;
    let url = if args.fresh {
        store.in_namespace(&crate::fresh_namespace())
    } else {
        store
    };
    let opener = Opener::new(url).await?;
    let queue = Arc::new(Mutex::new(delivery_order(args.events, args.copies)));
    let deliveries = queue.lock().map(|q| q.len()).unwrap_or(0);
    let side_effects: Arc<Vec<AtomicU32>> =
        Arc::new((0..args.events).map(|_| AtomicU32::new(0)).collect());
    let tally = Arc::new(Tally::default());
    let mut workers = Vec::new();
    for _ in 0..args.workers.max(1) {
        workers.push(Deduper::new(opener.handle().await?));
    }
    println!(
        "racing {deliveries} deliveries of {} events ({} copies each) on {} with {} workers",
        args.events,
        args.copies,
        opener.url(),
        workers.len()
    );
    let work = Duration::from_millis(args.work_ms);
    let started = Instant::now();
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|deduper| {
            let (queue, side_effects, tally) = (queue.clone(), side_effects.clone(), tally.clone());
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                    let Some(event) = next else { break };
                    let key = Key::new("race", format!("evt_{event:06}"))?;
                    let effects = side_effects.clone();
                    let answer = deduper
                        .run(&key, move |_lease| async move {
                            tokio::time::sleep(work).await;
                            effects[event as usize].fetch_add(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(format!("done {event}").into_bytes())
                        })
                        .await;
                    match answer {
                        Ok(Handled::Ran { attempt, .. }) => {
                            tally.ran.fetch_add(1, Ordering::Relaxed);
                            if attempt > 1 {
                                tally.takeovers.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Ok(Handled::Duplicate { .. }) => {
                            tally.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Handled::InFlight { .. }) => {
                            // The provider retries later: put the delivery back.
                            tally.in_flight.fetch_add(1, Ordering::Relaxed);
                            if let Ok(mut q) = queue.lock() {
                                q.push_back(event);
                            }
                            tokio::task::yield_now().await;
                        }
                        Ok(Handled::Mismatch) => {
                            tally.mismatches.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Handled::Failed { error }) => {
                            // The race's work never fails: a stored failure is a bug.
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            eprintln!("delivery of {key} answered a stored failure: {error}");
                        }
                        Ok(other) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            eprintln!("delivery of {key} answered {other:?}, which this race does not know");
                        }
                        Err(e) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            eprintln!("delivery of {key} failed: {e}");
                            if let HandleError::Store(e) = e {
                                if e.is_retryable() {
                                    if let Ok(mut q) = queue.lock() {
                                        q.push_back(event);
                                    }
                                }
                            }
                        }
                    }
                }
                Ok::<(), Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await
            .map_err(|e| Error::fatal("worker task failed", Some(Box::new(e) as _)))??;
    }
    let elapsed = started.elapsed();
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let counts: Vec<u32> = side_effects
        .iter()
        .map(|c| c.load(Ordering::SeqCst))
        .collect();
    let once = counts.iter().filter(|c| **c == 1).count();
    let twice = counts.iter().filter(|c| **c > 1).count();
    // An event whose work did not run in this run is fine only if the store said it
    // was done before (every copy answered Duplicate).
    let done_before = counts.iter().filter(|c| **c == 0).count();
    let unresolved = (load(&tally.ran) + load(&tally.duplicates))
        .abs_diff(u64::from(args.events) * u64::from(args.copies));
    println!("claims won (work ran):     {}", load(&tally.ran));
    println!("  of which takeovers:      {}", load(&tally.takeovers));
    println!("duplicates answered:       {}", load(&tally.duplicates));
    println!(
        "in-flight answers (retried later): {}",
        load(&tally.in_flight)
    );
    println!("mismatches:                {}", load(&tally.mismatches));
    println!("errors:                    {}", load(&tally.errors));
    println!(
        "time taken:                {:.1} ms ({:.0} deliveries/s)",
        elapsed.as_secs_f64() * 1e3,
        deliveries as f64 / elapsed.as_secs_f64()
    );
    println!(
        "events whose work ran once: {once} of {}; done before this run: {done_before}; more than once: {twice}",
        args.events
    );
    if args.fresh {
        opener.remove_namespace().await?;
    }
    let ok = twice == 0 && unresolved == 0 && load(&tally.errors) == 0;
    if ok {
        println!("OK: no event's work ran twice, and every delivery was answered");
    } else {
        println!("FAILED: {twice} events ran more than once, {unresolved} deliveries unanswered");
    }
    Ok(ok)
}
