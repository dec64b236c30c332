//! Deploys under load: inbox worker processes stopped gracefully (`SIGTERM`,
//! then [`InboxWorker::shutdown`] with no grace, so the items they run are
//! cut off and handed back) and replaced, over and over, while they work
//! through a set of items; the store's own tests run it, like
//! [`crashes`](crate::crashes).
//!
//! The parent test calls [`deploy_workers`]: it starts copies of the test
//! binary, each running one ignored child test that opens the store's inbox
//! and calls [`run_deploy_worker`]. The first workers accept the items between
//! them; every worker runs an [`InboxWorker`] whose handler logs the attempt it was handed and works a
//! while. The parent stops the oldest worker and starts a fresh one, again
//! and again; when the deploys are done the last workers finish the items,
//! and each logs every record as it stands. The judge then requires:
//!
//! - every item done exactly once, as a record of attempt 1, and every run
//!   of the handler handed attempt 1: a hand-back spends no attempt
//!   (CONTRACT.md I9), so no number of deploys moves an item toward the
//!   dead letters;
//! - at least one item handed back mid-run per two deploys (else the run
//!   proved nothing), and every stopped worker gone within its grace.

use std::collections::HashMap;
use std::fmt;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{DedupeStore, Deduper, Inbox, InboxWorker, Key, RecordState};
use futures_util::StreamExt;

use crate::children::{self, Children, Log};
use crate::harness::Failure;

const ITEMS_VAR: &str = "DEDUPE_DEPLOY_ITEMS";
const WORK_VAR: &str = "DEDUPE_DEPLOY_WORK_MS";
const FIRST_VAR: &str = "DEDUPE_DEPLOY_FIRST_WORKERS";
const NAMESPACE: &str = "deploy";

/// How a deploy run goes.
#[derive(Debug, Clone)]
pub struct DeployPlan {
    /// Items to process, each exactly once.
    pub items: usize,
    /// Worker processes alive at once.
    pub workers: usize,
    /// Graceful stops (each followed by a fresh worker).
    pub deploys: usize,
    /// How long the handler works on an item.
    pub work: Duration,
    /// How long the parent waits between deploys.
    pub every: Duration,
    /// How long the whole run may take before it fails.
    pub deadline: Duration,
}

impl Default for DeployPlan {
    /// 600 items, 2 workers of 4 items at a time, 20 deploys 250 ms apart,
    /// 150 ms of work an item (about 50 items a second: the items outlast
    /// the deploys).
    fn default() -> Self {
        Self {
            items: 600,
            workers: 2,
            deploys: 20,
            work: Duration::from_millis(150),
            every: Duration::from_millis(250),
            deadline: Duration::from_secs(120),
        }
    }
}

/// What a deploy run showed.
#[derive(Debug, Clone, Default)]
pub struct DeployReport {
    /// Items, every one done exactly once at attempt 1.
    pub items: usize,
    /// Workers stopped gracefully.
    pub deploys: usize,
    /// Items cut off by a stop and handed back.
    pub handed_back: usize,
    /// Runs of the handler (items run again after a hand-back included).
    pub runs: usize,
}

impl fmt::Display for DeployReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} items done once each at attempt 1 over {} deploys; {} items handed back \
             mid-run, {} runs of the handler",
            self.items, self.deploys, self.handed_back, self.runs
        )
    }
}

/// The parent's side: runs `plan` with workers that are copies of the
/// current test binary running the ignored test `child_test` with `env` set
/// (where the shared store is, which must be empty of `deploy:` keys), and
/// judges every worker's log (see the module docs).
pub fn deploy_workers(
    child_test: &str,
    plan: &DeployPlan,
    env: &[(&str, String)],
) -> Result<DeployReport, Failure> {
    let mut pool = Pool {
        children: Children::new("deploy", child_test, env)?,
        plan,
    };
    pool.run()?;
    judge(&pool.children, plan)
}

struct Pool<'a> {
    children: Children,
    plan: &'a DeployPlan,
}

impl Pool<'_> {
    fn spawn(&mut self) -> Result<(), Failure> {
        self.children.spawn(&[
            (ITEMS_VAR, self.plan.items.to_string()),
            (WORK_VAR, self.plan.work.as_millis().to_string()),
            (FIRST_VAR, self.plan.workers.to_string()),
        ])?;
        Ok(())
    }

    /// Whether worker `index` has begun running items (its stop handler is
    /// in place, and a stop now cuts work off).
    fn running(&self, index: usize) -> bool {
        self.children
            .log(index)
            .lines()
            .any(|l| l.starts_with("RAN "))
    }

    fn run(&mut self) -> Result<(), Failure> {
        let started = Instant::now();
        let late = |what: &str| {
            Failure::new(format!(
                "the deploy run passed its deadline of {:?} {what}",
                self.plan.deadline
            ))
        };
        for _ in 0..self.plan.workers {
            self.spawn()?;
        }
        for _ in 0..self.plan.deploys {
            std::thread::sleep(self.plan.every);
            // The oldest worker goes, once it runs items.
            let index = self.children.live[0].0;
            while !self.running(index) {
                if started.elapsed() > self.plan.deadline {
                    return Err(late("waiting for a worker to start"));
                }
                if let Ok(Some(status)) = self.children.live[0].1.try_wait() {
                    return Err(Failure::new(format!(
                        "worker {index} exited ({status}) before a deploy could stop it: the \
                         items ran out before the deploys did\n{}",
                        self.children.stderr(index)
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let (index, mut child) = self.children.live.remove(0);
            let pid = child.id().to_string();
            let sent = Command::new("sh")
                .args(["-c", &format!("kill -TERM {pid}")])
                .status()
                .map_err(|e| Failure::new(format!("kill -TERM {pid}: {e}")))?;
            if !sent.success() {
                return Err(Failure::new(format!("kill -TERM {pid} answered {sent}")));
            }
            let stop_by = Instant::now() + Duration::from_secs(10);
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break status,
                    Ok(None) if Instant::now() < stop_by => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Ok(None) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(Failure::new(format!(
                            "worker {index} was still running 10 s after SIGTERM"
                        )));
                    }
                    Err(e) => return Err(Failure::new(format!("worker {index}: {e}"))),
                }
            };
            if !status.success() {
                return Err(Failure::new(format!(
                    "worker {index} failed on SIGTERM ({status}):\n{}",
                    self.children.stderr(index)
                )));
            }
            self.spawn()?;
        }
        // The last workers finish the items.
        while !self.children.live.is_empty() {
            if started.elapsed() > self.plan.deadline {
                return Err(late("waiting for the last workers"));
            }
            std::thread::sleep(Duration::from_millis(20));
            self.children.reap()?;
        }
        Ok(())
    }
}

fn item_key(item: usize) -> Key {
    Key::new(NAMESPACE, format!("i{item}")).expect("a plain key")
}

/// The worker's side, called by the ignored child test with the store's
/// inbox open: accepts its share of the items (the first workers only), then
/// runs an [`InboxWorker`] (4 items at
/// a time, polling every 20 ms) until `SIGTERM`, when it shuts down with no
/// grace (the items it runs are handed back) and logs how many it cut off;
/// or until no item is pending, running or failed, when it logs each record
/// as it stands. Panics (failing the worker) only when it is not run by
/// [`deploy_workers`].
pub async fn run_deploy_worker(inbox: Arc<dyn Inbox>) {
    let index = children::index();
    let items = children::number(ITEMS_VAR);
    let work = children::millis(WORK_VAR);
    let log = Log::open();
    // In place before anything runs: a stop never meets the default action.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    // The first workers accept the items between them; the ones that
    // replace them only work.
    let first = children::number(FIRST_VAR);
    let mine = (0..items).filter(|item| index < first && item % first == index);
    futures_util::stream::iter(mine)
        .for_each_concurrent(16, |item| {
            let inbox = Arc::clone(&inbox);
            async move {
                while inbox.accept(&item_key(item), b"work").await.is_err() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
        .await;
    let deduper = Deduper::new(Arc::clone(&inbox));
    let worker = InboxWorker::new(&deduper, Arc::clone(&inbox), NAMESPACE)
        .with_concurrency(4)
        .with_poll_interval(Duration::from_millis(20));
    let running = tokio::spawn({
        let (worker, log) = (worker.clone(), log.clone());
        async move {
            worker
                .run(move |taken| {
                    let log = log.clone();
                    async move {
                        log.line(format!(
                            "RAN {} {}",
                            taken.lease.key.id(),
                            taken.lease.attempt
                        ));
                        tokio::time::sleep(work).await;
                        Ok::<_, String>(b"done".to_vec())
                    }
                })
                .await
        }
    });
    loop {
        tokio::select! {
            _ = term.recv() => {
                let drained = worker.shutdown(Duration::ZERO).await;
                log.line(format!("STOPPED {}", drained.aborted));
                running.await.expect("the worker's task").expect("the worker ran");
                return;
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => {
                match inbox.counts(NAMESPACE).await {
                    Ok(c) if c.pending + c.running + c.failed == 0 => break,
                    _ => {}
                }
            }
        }
    }
    worker.shutdown(Duration::from_secs(5)).await;
    running
        .await
        .expect("the worker's task")
        .expect("the worker ran");
    for item in 0..items {
        let line = match inbox.get(&item_key(item)).await {
            Ok(Some(record)) => match &record.state {
                RecordState::Done { outcome, .. } => format!(
                    "FINAL {item} {} {}",
                    String::from_utf8_lossy(outcome),
                    record.attempts
                ),
                other => format!("FINAL {item} not-done {other:?}"),
            },
            Ok(None) => format!("FINAL {item} missing"),
            Err(e) => format!("FINAL {item} error {e}"),
        };
        log.line(line);
    }
    log.line("EXIT".to_string());
}

/// Judges every worker log of the run (see the module docs).
fn judge(children: &Children, plan: &DeployPlan) -> Result<DeployReport, Failure> {
    let mut report = DeployReport {
        items: plan.items,
        deploys: plan.deploys,
        ..DeployReport::default()
    };
    let mut finals: HashMap<usize, Vec<String>> = HashMap::new();
    let mut exited = 0;
    for (index, log) in children.logs()? {
        for line in log.lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["RAN", id, attempt] => {
                    report.runs += 1;
                    if *attempt != "1" {
                        return Err(Failure::new(format!(
                            "worker {index}: item {id} was run as attempt {attempt}: a deploy spent an \
                             attempt (a hand-back must take back its take's)"
                        )));
                    }
                }
                ["STOPPED", n] => report.handed_back += n.parse::<usize>().unwrap_or(0),
                ["FINAL", item, rest @ ..] => {
                    if let Ok(item) = item.parse::<usize>() {
                        finals.entry(item).or_default().push(rest.join(" "));
                    }
                }
                ["EXIT"] => exited += 1,
                _ => {}
            }
        }
    }
    if exited == 0 {
        return Err(Failure::new("no worker saw every item done"));
    }
    for item in 0..plan.items {
        let seen = finals.remove(&item).unwrap_or_default();
        if seen.is_empty() || seen.iter().any(|f| f != "done 1") {
            return Err(Failure::new(format!(
                "item {item} ended as {seen:?}, expected done at attempt 1 (\"done 1\")"
            )));
        }
    }
    if report.handed_back < plan.deploys / 2 {
        return Err(Failure::new(format!(
            "{} items were handed back over {} deploys: the stops cut too little work off to \
             prove anything",
            report.handed_back, plan.deploys
        )));
    }
    Ok(report)
}
