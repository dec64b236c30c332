//! A poison item: one that kills the worker process running it, every time
//! (a panic across FFI, an OOM kill, a segfault in a native library). The
//! store's own tests run it, like [`crashes`](crate::crashes).
//!
//! The parent test calls [`poison_workers`]: it starts copies of the test
//! binary, each running one ignored child test that opens the store's inbox
//! and calls [`run_poison_worker`]. The first worker accepts a set of good
//! items and one poison item; every worker runs an [`InboxWorker`] (one item
//! at a time, default `max_takeovers`, 3) whose handler aborts its own process on the poison
//! item and completes the others. The parent replaces each worker that
//! dies. The judge then requires:
//!
//! - the poison item ran exactly `max_takeovers` times, each run killed its
//!   process, and it ends dead as quarantined, with its takeovers counted
//!   (CONTRACT.md I10), instead of taking down worker after worker;
//! - every good item done;
//! - with [`PoisonPlan::ordered`], where every item shares one ordering key
//!   (the poison item first, each accepted to be skipped when dead): no
//!   good item ran before the poison item was quarantined (the time of its
//!   last failure, from its history), and the good items ran in accept
//!   order (CONTRACT.md I15).

use std::collections::HashMap;
use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::time::SystemTime;

use dedupe_core::{
    AcceptOptions, DedupeStore, Deduper, Inbox, InboxWorker, ItemStatus, Key, RecordState, WhenDead,
};

use crate::children::{self, Children, Log};
use crate::harness::Failure;

const ITEMS_VAR: &str = "DEDUPE_POISON_ITEMS";
const LEASE_VAR: &str = "DEDUPE_POISON_LEASE_MS";
const ORDERED_VAR: &str = "DEDUPE_POISON_ORDERED";
const NAMESPACE: &str = "poison";
const POISON: &str = "poison";

/// How a poison run goes.
#[derive(Debug, Clone)]
pub struct PoisonPlan {
    /// Good items beside the poison one.
    pub items: usize,
    /// Worker processes alive at once.
    pub workers: usize,
    /// The workers' lease: how long a dead worker's item waits for its
    /// takeover.
    pub lease: Duration,
    /// How long the whole run may take before it fails.
    pub deadline: Duration,
    /// Every item under one ordering key, the poison item first, each
    /// skipped when dead: the good items wait for its quarantine, then run
    /// in accept order.
    pub ordered: bool,
}

impl Default for PoisonPlan {
    /// 20 good items, 2 workers, 400 ms leases.
    fn default() -> Self {
        Self {
            items: 20,
            workers: 2,
            lease: Duration::from_millis(400),
            deadline: Duration::from_secs(120),
            ordered: false,
        }
    }
}

impl PoisonPlan {
    /// The run with every item under one ordering key (see
    /// [`ordered`](Self::ordered)).
    pub fn ordered() -> Self {
        Self {
            ordered: true,
            ..Self::default()
        }
    }
}

/// Milliseconds since the epoch.
fn wall_ms(at: SystemTime) -> i64 {
    dedupe_core::backend::to_millis(at)
}

/// What a poison run showed.
#[derive(Debug, Clone, Default)]
pub struct PoisonReport {
    /// Worker processes the poison item killed.
    pub killed: usize,
    /// The poison item's takeovers when it was quarantined.
    pub takeovers: u32,
    /// Good items, every one done.
    pub items: usize,
}

impl fmt::Display for PoisonReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the poison item killed {} workers and was quarantined after {} takeovers; {} good \
             items done",
            self.killed, self.takeovers, self.items
        )
    }
}

/// The parent's side: runs `plan` with workers that are copies of the
/// current test binary running the ignored test `child_test` with `env` set
/// (where the shared store is, which must be empty of `poison:` keys),
/// replaces each one the poison item kills, and judges every worker's log
/// (see the module docs).
pub fn poison_workers(
    child_test: &str,
    plan: &PoisonPlan,
    env: &[(&str, String)],
) -> Result<PoisonReport, Failure> {
    let mut children = Children::new("poison", child_test, env)?;
    let killed = run(&mut children, plan)?;
    judge(&children, plan, killed)
}

/// Runs the workers, replacing each killed one; answers how many were.
fn run(children: &mut Children, plan: &PoisonPlan) -> Result<usize, Failure> {
    let vars = [
        (ITEMS_VAR, plan.items.to_string()),
        (LEASE_VAR, plan.lease.as_millis().to_string()),
        (ORDERED_VAR, u8::from(plan.ordered).to_string()),
    ];
    for _ in 0..plan.workers {
        children.spawn(&vars)?;
    }
    let started = Instant::now();
    let mut killed = 0;
    while !children.live.is_empty() {
        if started.elapsed() > plan.deadline {
            return Err(Failure::new(format!(
                "the poison run passed its deadline of {:?} ({killed} workers killed)",
                plan.deadline
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
        for (index, status) in children.exited()? {
            // What the poison item does to its worker: replaced.
            if status.signal() == Some(6) {
                killed += 1;
                children.spawn(&vars)?;
            } else if !status.success() {
                return Err(Failure::new(format!(
                    "worker {index} failed ({status}):\n{}",
                    children.stderr(index)
                )));
            }
        }
        if killed > 10 {
            return Err(Failure::new(format!(
                "the poison item killed {killed} workers: it was never quarantined"
            )));
        }
    }
    Ok(killed)
}

fn key(id: &str) -> Key {
    Key::new(NAMESPACE, id).expect("a plain key")
}

/// The worker's side, called by the ignored child test with the store's
/// inbox open: the first worker accepts the items; every worker runs an
/// [`InboxWorker`] whose handler aborts the process on the poison item,
/// until no item is pending, running or failed; then it logs how each item
/// ended. Panics (failing the worker) only when it is not run by
/// [`poison_workers`].
pub async fn run_poison_worker(inbox: Arc<dyn Inbox>) {
    let index = children::index();
    let items = children::number(ITEMS_VAR);
    let lease = children::millis(LEASE_VAR);
    let ordered = children::number(ORDERED_VAR) == 1;
    let log = Log::open();
    if index == 0 {
        let options = match ordered {
            true => AcceptOptions::new()
                .ordering_key("one")
                .when_dead(WhenDead::Skip),
            false => AcceptOptions::new(),
        };
        let ids = std::iter::once(POISON.to_string()).chain((0..items).map(|i| format!("i{i}")));
        for id in ids {
            while inbox
                .accept_with(&key(&id), b"work", &options)
                .await
                .is_err()
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let deduper = Deduper::new(Arc::clone(&inbox)).with_lease_ttl(lease);
    // One item at a time: the poison item's abort takes down only itself
    // (a neighbour in the same process would die with it, and be quarantined
    // beside it, as a real crash would do).
    let worker = InboxWorker::new(&deduper, Arc::clone(&inbox), NAMESPACE)
        .with_concurrency(1)
        .with_poll_interval(Duration::from_millis(20));
    let running = tokio::spawn({
        let (worker, log) = (worker.clone(), log.clone());
        async move {
            worker
                .run(move |taken| {
                    let log = log.clone();
                    async move {
                        let id = taken.lease.key.id().to_string();
                        log.line(format!(
                            "RAN {id} {} {}",
                            taken.takeovers,
                            wall_ms(SystemTime::now())
                        ));
                        if id == POISON {
                            std::process::abort();
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, String>(b"done".to_vec())
                    }
                })
                .await
        }
    });
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match inbox.counts(NAMESPACE).await {
            // Accepted (the first worker may still be accepting) and settled.
            Ok(c) if c.pending + c.running + c.failed == 0 && c.dead > 0 => break,
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(100),
            "the items did not settle"
        );
    }
    worker.shutdown(Duration::from_secs(5)).await;
    running
        .await
        .expect("the worker's task")
        .expect("the worker ran");
    match inbox.item(&key(POISON)).await {
        Ok(Some(item)) if item.status == ItemStatus::Dead => log.line(format!(
            "POISON {} {} {}",
            item.takeovers,
            item.errors.last().map_or(0, |failed| wall_ms(failed.at)),
            item.last_error.unwrap_or_default()
        )),
        other => log.line(format!("POISON - {other:?}")),
    }
    for i in 0..items {
        let line = match inbox.get(&key(&format!("i{i}"))).await {
            Ok(Some(record)) if matches!(record.state, RecordState::Done { .. }) => {
                format!("FINAL {i} done")
            }
            other => format!("FINAL {i} {other:?}"),
        };
        log.line(line);
    }
    log.line("EXIT".to_string());
}

/// Judges every worker log of the run (see the module docs).
fn judge(children: &Children, plan: &PoisonPlan, killed: usize) -> Result<PoisonReport, Failure> {
    let max_takeovers = InboxWorker::DEFAULT_MAX_TAKEOVERS;
    let mut poison_runs: Vec<String> = Vec::new();
    let mut poison: Vec<String> = Vec::new();
    let mut quarantined_at: Vec<i64> = Vec::new();
    // Each good item's first run (wall ms).
    let mut first_runs: HashMap<usize, i64> = HashMap::new();
    let mut finals: HashMap<usize, Vec<String>> = HashMap::new();
    for (_, log) in children.logs()? {
        for line in log.lines() {
            let parts: Vec<&str> = line.splitn(4, ' ').collect();
            match parts.as_slice() {
                ["RAN", id, takeovers, _] if *id == POISON => {
                    poison_runs.push(takeovers.to_string())
                }
                ["RAN", id, _, at] => {
                    let item = id.strip_prefix('i').and_then(|n| n.parse::<usize>().ok());
                    if let (Some(item), Ok(at)) = (item, at.parse::<i64>()) {
                        let first = first_runs.entry(item).or_insert(at);
                        *first = (*first).min(at);
                    }
                }
                ["POISON", takeovers, at, error] => {
                    poison.push(format!("{takeovers} {error}"));
                    quarantined_at.extend(at.parse::<i64>().ok());
                }
                ["FINAL", item, how] => {
                    if let Ok(item) = item.parse::<usize>() {
                        finals.entry(item).or_default().push(how.to_string());
                    }
                }
                _ => {}
            }
        }
    }
    poison_runs.sort();
    let expected_runs: Vec<String> = (0..max_takeovers).map(|t| t.to_string()).collect();
    if poison_runs != expected_runs || killed != max_takeovers as usize {
        return Err(Failure::new(format!(
            "the poison item ran with takeovers {poison_runs:?} and killed {killed} workers, \
             expected one run at each of {expected_runs:?}, each killing its worker"
        )));
    }
    let quarantined = format!(
        "{max_takeovers} quarantined: its workers died holding it {max_takeovers} times \
         (max_takeovers {max_takeovers})"
    );
    if poison.is_empty() || poison.iter().any(|p| *p != quarantined) {
        return Err(Failure::new(format!(
            "the poison item ended as {poison:?}, expected dead as {quarantined:?}"
        )));
    }
    for item in 0..plan.items {
        let seen = finals.remove(&item).unwrap_or_default();
        if seen.is_empty() || seen.iter().any(|f| f != "done") {
            return Err(Failure::new(format!(
                "good item {item} ended as {seen:?}, expected done"
            )));
        }
    }
    if plan.ordered {
        // The store's clock and the workers' are one machine's: only their
        // rounding to the millisecond separates them.
        let quarantined = quarantined_at.iter().copied().max().unwrap_or(i64::MAX);
        let mut previous = i64::MIN;
        for item in 0..plan.items {
            let Some(&ran) = first_runs.get(&item) else {
                return Err(Failure::new(format!("good item {item} never ran")));
            };
            if ran + 1 < quarantined {
                return Err(Failure::new(format!(
                    "good item {item} ran {} ms before the poison item ahead of it in its \
                     ordering key was quarantined",
                    quarantined - ran
                )));
            }
            if ran < previous {
                return Err(Failure::new(format!(
                    "good item {item} ran before good item {}, accepted before it in its \
                     ordering key",
                    item - 1
                )));
            }
            previous = ran;
        }
    }
    Ok(PoisonReport {
        killed,
        takeovers: max_takeovers,
        items: plan.items,
    })
}
