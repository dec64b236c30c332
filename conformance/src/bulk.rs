//! Bulk replay and forget by filter (dedupe-core's [`Bulk`]) on a real store,
//! beside running workers and a second operator doing the same thing. The
//! store's own tests call [`bulk_by_filter`] with two handles (two
//! operators, each on its own connections) and the number of dead items.
//!
//! The run makes `items` dead items, a third failed with an error naming a
//! 502 and two thirds with one naming a 404, then:
//!
//! 1. a dry run ([`count_items`]) of "dead, error contains 502" answers the
//!    third exactly;
//! 2. with an [`InboxWorker`] running, both operators replay that filter at
//!    the same time: together they replay each matching item exactly once
//!    (their `done` counts add up to the third, and what one replayed the
//!    other skipped), the worker runs each replayed item exactly once, and
//!    no 404 item moved;
//! 3. both operators forget "dead, error contains 404" at the same time: each
//!    item is forgotten by one of them, and no item is left.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupe_core::{
    count_items, Bulk, BulkAction, BulkProgress, Deduper, Inbox, InboxWorker, ItemFilter,
    ItemStatus, Key, Retry, MAX_TAKE,
};

use crate::harness::Failure;

const NAMESPACE: &str = "bulk";

/// What a bulk run found.
#[derive(Debug, Clone)]
pub struct BulkReport {
    /// Dead items made.
    pub items: usize,
    /// The two replays' progress.
    pub replays: [BulkProgress; 2],
    /// The two forgets' progress.
    pub forgets: [BulkProgress; 2],
    /// How long making the dead items took.
    pub setup: Duration,
    /// How long the two replays (run together) took.
    pub replay: Duration,
    /// How long the two forgets (run together) took.
    pub forget: Duration,
}

impl std::fmt::Display for BulkReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} dead items made in {:.1?}; two replays together in {:.1?} (done {} + {}, skipped {} + {}); \
             two forgets together in {:.1?} (done {} + {})",
            self.items,
            self.setup,
            self.replay,
            self.replays[0].done,
            self.replays[1].done,
            self.replays[0].skipped,
            self.replays[1].skipped,
            self.forget,
            self.forgets[0].done,
            self.forgets[1].done,
        )
    }
}

fn key(i: usize) -> Key {
    Key::new(NAMESPACE, format!("evt_{i:06}")).expect("a valid key")
}

fn fail<T>(what: impl std::fmt::Display) -> Result<T, Failure> {
    Err(Failure::new(what.to_string()))
}

/// Makes `items` dead items through `a`, then runs the two bulk actions on
/// `a` and `b` together, as described in the module's documentation.
pub async fn bulk_by_filter(
    a: Arc<dyn Inbox>,
    b: Arc<dyn Inbox>,
    items: usize,
) -> Result<BulkReport, Failure> {
    let started = Instant::now();
    let is_502 = |i: usize| i.is_multiple_of(3);
    for i in 0..items {
        if !a.accept(&key(i), b"{}").await.map_err(err)?.is_new() {
            return fail(format!("{} was not new", key(i)));
        }
    }
    let mut dead = 0;
    while dead < items {
        let taken = a
            .take(NAMESPACE, MAX_TAKE, Duration::from_secs(120))
            .await
            .map_err(err)?;
        if taken.is_empty() {
            return fail(format!("only {dead} of {items} items could be taken"));
        }
        for t in taken {
            let n: usize = t.lease.key.id()[4..].parse().map_err(err)?;
            let error = if is_502(n) {
                "upstream answered 502 Bad Gateway"
            } else {
                "the API answered HTTP 404 Not Found"
            };
            a.fail(&t.lease, error, Retry::dead()).await.map_err(err)?;
            dead += 1;
        }
    }
    let setup = started.elapsed();
    let matching = (0..items).filter(|&i| is_502(i)).count() as u64;
    let replayable = ItemFilter::new(NAMESPACE)
        .status(ItemStatus::Dead)
        .error("502");
    let counted = count_items(a.as_ref(), &replayable).await.map_err(err)?;
    if counted != matching {
        return fail(format!(
            "the dry run counted {counted} dead items with 502 in their error, {matching} are"
        ));
    }

    // Workers run while both operators replay: each replayed item is run once.
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let deduper = Deduper::new(Arc::clone(&a));
    let worker = InboxWorker::new(&deduper, Arc::clone(&a), NAMESPACE)
        .with_concurrency(16)
        .with_poll_interval(Duration::from_millis(50));
    let running = tokio::spawn({
        let (worker, runs) = (worker.clone(), Arc::clone(&runs));
        async move {
            worker
                .run(move |taken| {
                    let runs = Arc::clone(&runs);
                    async move {
                        *runs
                            .lock()
                            .expect("runs")
                            .entry(taken.lease.key.id().to_string())
                            .or_default() += 1;
                        Ok::<_, String>(b"done".to_vec())
                    }
                })
                .await
        }
    });
    let started = Instant::now();
    let replays = together(&a, &b, &replayable, BulkAction::Replay).await;
    let replay = started.elapsed();
    // Settled: nothing of the replayed third left to run.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let c = a.counts(NAMESPACE).await.map_err(err)?;
        if c.pending + c.running + c.failed == 0 {
            break;
        }
        if Instant::now() > deadline {
            return fail(format!("replayed items still not done after 120 s: {c:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.stop();
    deduper.shutdown(Duration::from_secs(10)).await;
    running.abort();
    for p in &replays {
        if let Some(e) = &p.error {
            return fail(format!("a replay stopped on an error: {e}"));
        }
    }
    let replayed = replays[0].done + replays[1].done;
    if replayed != matching {
        return fail(format!(
            "two operators replayed {replayed} items together, {matching} matched: {replays:?}"
        ));
    }
    {
        let runs = runs.lock().expect("runs");
        let twice: Vec<_> = runs.iter().filter(|(_, &n)| n > 1).take(5).collect();
        if !twice.is_empty() {
            return fail(format!(
                "items run more than once after the replays: {twice:?}"
            ));
        }
        let stray = runs
            .keys()
            .filter(|id| id[4..].parse::<usize>().map(|n| !is_502(n)).unwrap_or(true))
            .take(5)
            .collect::<Vec<_>>();
        if !stray.is_empty() {
            return fail(format!("items outside the filter were run: {stray:?}"));
        }
        if runs.len() as u64 != matching {
            return fail(format!(
                "{} replayed items ran, {matching} were replayed",
                runs.len()
            ));
        }
    }
    let c = a.counts(NAMESPACE).await.map_err(err)?;
    if c.dead != items as u64 - matching {
        return fail(format!(
            "{} dead items left after the replay, {} expected",
            c.dead,
            items as u64 - matching
        ));
    }

    let forgettable = ItemFilter::new(NAMESPACE)
        .status(ItemStatus::Dead)
        .error("404");
    let started = Instant::now();
    let forgets = together(&a, &b, &forgettable, BulkAction::Forget).await;
    let forget = started.elapsed();
    for p in &forgets {
        if let Some(e) = &p.error {
            return fail(format!("a forget stopped on an error: {e}"));
        }
    }
    let forgotten = forgets[0].done + forgets[1].done;
    if forgotten != items as u64 - matching {
        return fail(format!(
            "two operators forgot {forgotten} items together, {} matched: {forgets:?}",
            items as u64 - matching
        ));
    }
    let c = a.counts(NAMESPACE).await.map_err(err)?;
    if c.dead + c.pending + c.running + c.failed != 0 {
        return fail(format!("items left after the forget: {c:?}"));
    }
    Ok(BulkReport {
        items,
        replays,
        forgets,
        setup,
        replay,
        forget,
    })
}

/// The same bulk action run by two operators at once, one on each handle.
async fn together(
    a: &Arc<dyn Inbox>,
    b: &Arc<dyn Inbox>,
    filter: &ItemFilter,
    action: BulkAction,
) -> [BulkProgress; 2] {
    // Tasks of their own: on a multi-threaded runtime they run at the same
    // time even on a store whose calls never wait (memory).
    let run = |inbox: &Arc<dyn Inbox>| {
        let (bulk, inbox) = (
            Arc::new(Bulk::new(filter.clone(), action)),
            Arc::clone(inbox),
        );
        let running = Arc::clone(&bulk);
        (
            bulk,
            tokio::spawn(async move { running.run(inbox.as_ref()).await }),
        )
    };
    let (one, one_ran) = run(a);
    let (two, two_ran) = run(b);
    let _ = tokio::join!(one_ran, two_ran);
    [one.progress(), two.progress()]
}

fn err(e: impl std::fmt::Display) -> Failure {
    Failure::new(e.to_string())
}
