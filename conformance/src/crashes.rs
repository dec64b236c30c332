//! Worker processes killed with `SIGKILL` at random moments, most of them
//! between a claim and its completion, while a pool of them works through a
//! stream of events on one store; the store's own tests run it, like
//! [`processes`](crate::processes).
//!
//! The parent test calls [`crash_workers`]: it starts copies of the test binary,
//! each running one ignored child test that opens a store and calls
//! [`run_crash_worker`]. A worker walks every event: claims it, writes a line
//! to its own log, works a while, completes with its lease token as the
//! outcome, writes another line; every few claims it stalls past its lease
//! first. The parent kills workers (preferring one that
//! holds a claim) and starts fresh ones; killed workers' leases are taken over
//! once they pass. When a worker has seen every event done it reads each record
//! and exits. The parent then judges every log line together:
//!
//! - every event ends done, with one outcome;
//! - at most one completion of an event succeeded, and that is the stored
//!   outcome (a stale worker whose lease was taken over never overwrote a newer
//!   holder's result: its completion was refused as a lost lease);
//! - an outcome whose completion no surviving log shows belongs to a worker
//!   killed right after asking for it;
//! - every takeover was counted in the record's attempts;
//! - nothing won an event after its successful completion was asked for;
//! - at least one kill landed between a claim and its completion, and at least
//!   one stalled worker's completion was refused.
//!
//! ```no_run
//! // tests/crashes.rs of a store crate
//! use std::sync::Arc;
//! use dedupe_conformance::crashes::{crash_workers, run_crash_worker, CrashPlan};
//! use dedupe_core::{DedupeStore, MemoryStore};
//!
//! #[test]
//! fn killed_workers_lose_nothing() {
//!     let env = [("MY_STORE_URL", "...".to_string())];
//!     let report = crash_workers("crash_worker", &CrashPlan::default(), &env)
//!         .unwrap_or_else(|f| panic!("{f}"));
//!     eprintln!("{report}");
//! }
//!
//! #[tokio::test]
//! #[ignore = "run by killed_workers_lose_nothing in a child process"]
//! async fn crash_worker() {
//!     let store: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new()); // open MY_STORE_URL
//!     run_crash_worker(store).await;
//! }
//! # fn main() {}
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedupe_core::{
    AcceptOptions, Accepted, ClaimOptions, ClaimOutcome, DedupeStore, Error, Inbox, Key,
    RecordState,
};

use crate::children::{self, Children, Log};
use crate::harness::Failure;
use futures_util::StreamExt;

const EVENTS_VAR: &str = "DEDUPE_CRASH_EVENTS";
const LEASE_VAR: &str = "DEDUPE_CRASH_LEASE_MS";
const WORK_VAR: &str = "DEDUPE_CRASH_WORK_MS";
const STALL_VAR: &str = "DEDUPE_CRASH_STALL_EVERY";
const ORDER_VAR: &str = "DEDUPE_CRASH_ORDERING_KEYS";
const NAMESPACE: &str = "crash";
/// How far the workers' and the store's clocks (one machine) may disagree, and
/// a log line may lag its answer, when the judge compares times.
const CLOCK_TOLERANCE: Duration = Duration::from_millis(250);
/// How far past its lease (and the tolerance) a stalled worker completes.
const STALL_PAST: Duration = Duration::from_millis(150);

/// Milliseconds since the epoch.
fn wall_ms(at: SystemTime) -> i64 {
    match at.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// How a crash run goes.
#[derive(Debug, Clone)]
pub struct CrashPlan {
    /// Events to process, each exactly once.
    pub events: usize,
    /// Workers alive at once.
    pub workers: usize,
    /// Workers to kill over the run.
    pub kills: usize,
    /// The lease each claim takes (a killed holder's event waits this long).
    pub lease: Duration,
    /// How long each worker works between claim and complete.
    pub work: Duration,
    /// Every this many claims a worker stalls past its lease before it
    /// completes (a GC pause, a slow call): its lease is taken over and its
    /// completion must be refused. 0: never.
    pub stall_every: usize,
    /// How long the parent waits, before each kill, for a worker that holds
    /// a claim (then it kills any).
    pub holder_wait: Duration,
    /// How long the whole run may take before it fails.
    pub deadline: Duration,
    /// The inbox's run only: items are accepted under this many ordering
    /// keys (event `e` under key `e % ordering_keys`), and the judge also
    /// requires each key's items to run one at a time in accept order
    /// (CONTRACT.md I15). 0: no ordering keys.
    pub ordering_keys: usize,
}

impl Default for CrashPlan {
    /// 40 events, 3 workers, 8 kills, 400 ms leases, 120 ms of work, a stall
    /// past the lease every 5th claim.
    fn default() -> Self {
        Self {
            events: 40,
            workers: 3,
            kills: 8,
            lease: Duration::from_millis(400),
            work: Duration::from_millis(120),
            stall_every: 5,
            holder_wait: Duration::from_millis(300),
            deadline: Duration::from_secs(120),
            ordering_keys: 0,
        }
    }
}

impl CrashPlan {
    /// The inbox's run ([`run_inbox_crash_worker`]): 200 items, 3 workers, 8
    /// kills, 400 ms leases, 30 ms of work an item, takes of up to 3, a stall
    /// past the lease every 7th item; the parent waits up to 10 s for a
    /// worker holding items. A fresh worker accepts every item before it
    /// takes: on DynamoDB Local with four tests at a time that took longer
    /// than the 2 s waited before, every kill landed on a worker still
    /// accepting, and the run proved nothing.
    pub fn inbox() -> Self {
        Self {
            events: 200,
            work: Duration::from_millis(30),
            stall_every: 7,
            holder_wait: Duration::from_secs(10),
            ..Self::default()
        }
    }

    /// The inbox's run with ordering keys: 120 items under 8 keys (15 a
    /// key, accepted in event order), otherwise as [`inbox`](Self::inbox).
    /// Besides every item done exactly once, no item is taken before the
    /// completion of the one before it in its key was asked for: never two
    /// items of one key at once, never out of order.
    pub fn inbox_ordered() -> Self {
        Self {
            events: 120,
            ordering_keys: 8,
            ..Self::inbox()
        }
    }
}

/// What a crash run showed.
#[derive(Debug, Clone, Default)]
pub struct CrashReport {
    /// Events, every one done exactly once.
    pub events: usize,
    /// Workers killed.
    pub kills: usize,
    /// Claims whose worker was killed before it asked to complete.
    pub orphaned_claims: usize,
    /// Events claimed more than once (takeovers after a lease passed).
    pub taken_over: usize,
    /// Completions refused because the lease had been taken over.
    pub stale_refused: usize,
    /// Errors workers met (and retried).
    pub errors: usize,
}

impl fmt::Display for CrashReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} events done exactly once; {} workers killed, {} claims orphaned by a kill, \
             {} events taken over, {} stale completions refused, {} errors retried",
            self.events,
            self.kills,
            self.orphaned_claims,
            self.taken_over,
            self.stale_refused,
            self.errors
        )
    }
}

/// The parent's side: runs `plan` with workers that are copies of the current
/// test binary running the ignored test `child_test` with `env` set (where the
/// shared store is, which must be empty of `crash:` keys), kills them, and
/// judges every worker's log (see the module docs).
pub fn crash_workers(
    child_test: &str,
    plan: &CrashPlan,
    env: &[(&str, String)],
) -> Result<CrashReport, Failure> {
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    let mut pool = Pool {
        children: Children::new("crash", child_test, env)?,
        plan,
        seed: seed | 1,
    };
    let killed = pool.run()?;
    judge(&pool.children, plan, &killed)
}

struct Pool<'a> {
    children: Children,
    plan: &'a CrashPlan,
    seed: u64,
}

impl Pool<'_> {
    fn random(&mut self) -> u64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        self.seed
    }

    fn spawn(&mut self) -> Result<(), Failure> {
        self.children.spawn(&[
            (EVENTS_VAR, self.plan.events.to_string()),
            (LEASE_VAR, self.plan.lease.as_millis().to_string()),
            (WORK_VAR, self.plan.work.as_millis().to_string()),
            (STALL_VAR, self.plan.stall_every.to_string()),
            (ORDER_VAR, self.plan.ordering_keys.to_string()),
        ])?;
        Ok(())
    }

    /// Whether worker `index` holds a claim it has not yet asked to complete.
    fn holding(&self, index: usize) -> bool {
        self.children
            .log(index)
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("CLAIMED "))
    }

    /// Runs the plan; answers the indexes of the workers it killed.
    fn run(&mut self) -> Result<HashSet<usize>, Failure> {
        let started = Instant::now();
        for _ in 0..self.plan.workers {
            self.spawn()?;
        }
        let mut killed = HashSet::new();
        while killed.len() < self.plan.kills {
            if started.elapsed() > self.plan.deadline {
                return Err(Failure::new(
                    "the crash run passed its deadline while killing",
                ));
            }
            // Wait a random while, then kill a worker that holds a claim if one
            // does within the plan's wait, else any.
            let pause = 100 + self.random() % 300;
            std::thread::sleep(Duration::from_millis(pause));
            self.children.reap()?;
            let look_until = Instant::now() + self.plan.holder_wait;
            let victim = loop {
                let holder = self
                    .children
                    .live
                    .iter()
                    .position(|(i, _)| self.holding(*i));
                if holder.is_some() || Instant::now() > look_until {
                    break holder;
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            let live = self.children.live.len();
            let Some(at) = victim.or_else(|| (live > 0).then(|| (self.random() as usize) % live))
            else {
                break; // every worker finished before the kills ran out
            };
            killed.insert(self.children.kill(at));
            self.spawn()?;
        }
        // Let the survivors finish.
        while !self.children.live.is_empty() {
            if started.elapsed() > self.plan.deadline {
                return Err(Failure::new(format!(
                    "workers did not finish within {:?}",
                    self.plan.deadline
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
            self.children.reap()?;
        }
        Ok(killed)
    }
}

fn event_key(event: usize) -> Key {
    Key::new(NAMESPACE, format!("e{event}")).expect("a plain key")
}

/// The worker's side, called by the ignored child test with its store open:
/// works through every event until it has seen each one done, logging every
/// step, then logs each record as it stands and returns. Panics (failing the
/// worker) only when it is not run by [`crash_workers`].
pub async fn run_crash_worker(store: Arc<dyn DedupeStore>) {
    let index = children::index();
    let events = children::number(EVENTS_VAR);
    let lease = children::millis(LEASE_VAR);
    let work = children::millis(WORK_VAR);
    let stall_every = children::number(STALL_VAR);
    let mut claims = 0usize;
    let log = Log::open();
    let opts = ClaimOptions::new(lease);
    loop {
        let mut all_done = true;
        for step in 0..events {
            let event = (step + index * 7) % events;
            let key = event_key(event);
            match store.claim(&key, &opts).await {
                Ok(ClaimOutcome::Claimed(lease)) => {
                    all_done = false;
                    log.line(format!(
                        "CLAIMED {event} {} {} {} {}",
                        lease.token.as_str(),
                        lease.attempt,
                        wall_ms(SystemTime::now()),
                        wall_ms(lease.deadline)
                    ));
                    claims += 1;
                    if stall_every > 0 && claims.is_multiple_of(stall_every) {
                        // Not a holder the parent should prefer to kill: this
                        // one is about to try a stale completion.
                        log.line(format!("STALLING {event} {}", lease.token.as_str()));
                        tokio::time::sleep(opts.lease_ttl + STALL_PAST + CLOCK_TOLERANCE).await;
                    } else {
                        tokio::time::sleep(work).await;
                    }
                    log.line(format!(
                        "COMPLETING {event} {} {}",
                        lease.token.as_str(),
                        wall_ms(SystemTime::now())
                    ));
                    let outcome = lease.token.as_str().as_bytes().to_vec();
                    match store
                        .complete(&lease, &outcome, Duration::from_secs(3600))
                        .await
                    {
                        Ok(()) => log.line(format!("COMPLETED {event} {}", lease.token.as_str())),
                        Err(Error::LeaseLost { .. }) => {
                            log.line(format!("LOST {event} {}", lease.token.as_str()))
                        }
                        Err(e) => log.line(format!("ERROR {event} {e}")),
                    }
                }
                Ok(ClaimOutcome::Duplicate { .. }) => {}
                Ok(_) => all_done = false,
                Err(e) => {
                    all_done = false;
                    log.line(format!("ERROR {event} {e}"));
                }
            }
        }
        if all_done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    log_finals(store.as_ref(), events, &log).await;
}

/// Most items an inbox worker takes at once.
const TAKE: usize = 3;

/// The worker's side of the inbox's run, called by the ignored child test
/// with the store's inbox open. It first accepts every item (every worker
/// does, so accepts race accepts: one answers `New` per item, the rest what
/// is there), then takes due items, up to three at a time, and works each as
/// [`run_crash_worker`] works a claim (a stall past the lease every few
/// items, then completion with the lease token as the outcome), until no
/// item is pending, running or failed; then logs each record as it stands.
/// A killed worker's items are taken over once their leases pass.
pub async fn run_inbox_crash_worker(inbox: Arc<dyn Inbox>) {
    let index = children::index();
    let events = children::number(EVENTS_VAR);
    let lease = children::millis(LEASE_VAR);
    let work = children::millis(WORK_VAR);
    let stall_every = children::number(STALL_VAR);
    let ordering_keys = children::number(ORDER_VAR);
    let log = Log::open();
    let payload = |event: usize| format!("item {event}").into_bytes();
    let accept_one = |event: usize| {
        let inbox = Arc::clone(&inbox);
        async move {
            let mut options = AcceptOptions::new();
            if ordering_keys > 0 {
                options = options.ordering_key(format!("k{}", event % ordering_keys));
            }
            let mut lines = Vec::new();
            loop {
                match inbox
                    .accept_with(&event_key(event), &payload(event), &options)
                    .await
                {
                    Ok(Accepted::New) => lines.push(format!("ACCEPTED {event}")),
                    Ok(_) => {}
                    Err(e) => {
                        lines.push(format!("ERROR {event} {e}"));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                }
                return lines;
            }
        }
    };
    // Sixteen accepts at a time, so a worker starts taking soon after it
    // starts (the parent kills workers from the first moments on). With
    // ordering keys, each key's events one after the other in event order
    // (every worker the same way): an event's accept has answered, in some
    // worker, before the next event of its key is accepted, so accept order
    // is event order within a key.
    let accepted: Vec<Vec<String>> = if ordering_keys > 0 {
        futures_util::stream::iter(0..ordering_keys)
            .map(|k| {
                let accept_one = &accept_one;
                async move {
                    let mut lines = Vec::new();
                    for event in (k..events).step_by(ordering_keys) {
                        lines.extend(accept_one(event).await);
                    }
                    lines
                }
            })
            .buffer_unordered(16)
            .collect()
            .await
    } else {
        futures_util::stream::iter(0..events)
            .map(|step| accept_one((step + index * 7) % events))
            .buffer_unordered(16)
            .collect()
            .await
    };
    for line in accepted.into_iter().flatten() {
        log.line(line);
    }
    let mut worked = 0usize;
    loop {
        let taken = match inbox.take(NAMESPACE, TAKE, lease).await {
            Ok(taken) => taken,
            Err(e) => {
                log.line(format!("ERROR - {e}"));
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if taken.is_empty() {
            match inbox.counts(NAMESPACE).await {
                Ok(c) if c.pending + c.running + c.failed == 0 => break,
                Ok(_) => {}
                Err(e) => log.line(format!("ERROR - {e}")),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        // Every item is logged as held the moment the take answers, then
        // worked one after the other.
        let mut held = Vec::with_capacity(taken.len());
        for item in taken {
            let lease = item.lease;
            let Some(event) = lease
                .key
                .id()
                .strip_prefix('e')
                .and_then(|n| n.parse::<usize>().ok())
            else {
                log.line(format!("BADKEY {} -", lease.key));
                continue;
            };
            if item.payload != payload(event) {
                log.line(format!("BADPAYLOAD {event} {}", lease.token.as_str()));
            }
            log.line(format!(
                "CLAIMED {event} {} {} {} {}",
                lease.token.as_str(),
                lease.attempt,
                wall_ms(SystemTime::now()),
                wall_ms(lease.deadline)
            ));
            held.push((event, lease));
        }
        for (event, lease) in held {
            worked += 1;
            if stall_every > 0 && worked.is_multiple_of(stall_every) {
                log.line(format!("STALLING {event} {}", lease.token.as_str()));
                tokio::time::sleep(lease_ttl_of(&lease) + STALL_PAST + CLOCK_TOLERANCE).await;
            } else {
                tokio::time::sleep(work).await;
            }
            log.line(format!(
                "COMPLETING {event} {} {}",
                lease.token.as_str(),
                wall_ms(SystemTime::now())
            ));
            let outcome = lease.token.as_str().as_bytes().to_vec();
            match inbox
                .complete(&lease, &outcome, Duration::from_secs(3600))
                .await
            {
                Ok(()) => log.line(format!("COMPLETED {event} {}", lease.token.as_str())),
                Err(Error::LeaseLost { .. }) => {
                    log.line(format!("LOST {event} {}", lease.token.as_str()))
                }
                Err(e) => log.line(format!("ERROR {event} {e}")),
            }
        }
    }
    log_finals(inbox.as_ref(), events, &log).await;
}

/// How long a lease taken now runs (its deadline from now, at least the
/// stall's own margin).
fn lease_ttl_of(lease: &dedupe_core::Lease) -> Duration {
    lease
        .deadline
        .duration_since(SystemTime::now())
        .unwrap_or_default()
}

/// Logs each record as it stands, then `EXIT`.
async fn log_finals(store: &dyn DedupeStore, events: usize, log: &Log) {
    for event in 0..events {
        match store.get(&event_key(event)).await {
            Ok(Some(record)) => match &record.state {
                RecordState::Done { outcome, .. } => log.line(format!(
                    "FINAL {event} {} {}",
                    String::from_utf8_lossy(outcome),
                    record.attempts
                )),
                other => log.line(format!("FINAL {event} not-done {other:?}")),
            },
            Ok(None) => log.line(format!("FINAL {event} missing")),
            Err(e) => log.line(format!("FINAL {event} error {e}")),
        }
    }
    log.line("EXIT".to_string());
}

#[derive(Debug, Default)]
struct Event {
    claimed: Vec<(usize, String)>,
    /// Token, when the claim was answered and its deadline (wall ms).
    held: Vec<(String, i64, i64)>,
    /// Token and when the completion was asked (wall ms).
    asked: Vec<(String, i64)>,
    lost_tokens: HashSet<String>,
    completing: Vec<(usize, String)>,
    completed: Vec<String>,
    lost: usize,
    /// Accepts answered `New` (the inbox's run).
    accepted: usize,
    finals: Vec<(String, u32)>,
    bad_finals: Vec<String>,
}

/// Judges every worker log of the run (see the module docs).
fn judge(
    children: &Children,
    plan: &CrashPlan,
    killed: &HashSet<usize>,
) -> Result<CrashReport, Failure> {
    let mut events: HashMap<usize, Event> = HashMap::new();
    let mut report = CrashReport {
        events: plan.events,
        kills: killed.len(),
        ..CrashReport::default()
    };
    let mut exited = 0;
    for (index, log) in children.logs()? {
        let lines: Vec<&str> = log.lines().collect();
        // A killed worker may have been cut off mid-line.
        for (n, line) in lines.iter().enumerate() {
            let parts: Vec<&str> = line.split(' ').collect();
            let event = parts.get(1).and_then(|e| e.parse::<usize>().ok());
            let token = parts.get(2).map(|t| t.to_string());
            match (parts[0], event, token) {
                ("CLAIMED", Some(ev), Some(t)) => {
                    let e = events.entry(ev).or_default();
                    let times = (
                        parts.get(4).and_then(|n| n.parse::<i64>().ok()),
                        parts.get(5).and_then(|n| n.parse::<i64>().ok()),
                    );
                    if let (Some(at), Some(deadline)) = times {
                        e.held.push((t.clone(), at, deadline));
                    }
                    e.claimed.push((index, t))
                }
                ("COMPLETING", Some(ev), Some(t)) => {
                    let e = events.entry(ev).or_default();
                    if let Some(at) = parts.get(3).and_then(|n| n.parse::<i64>().ok()) {
                        e.asked.push((t.clone(), at));
                    }
                    e.completing.push((index, t))
                }
                ("STALLING", Some(_), Some(_)) => {}
                ("ACCEPTED", Some(ev), _) => events.entry(ev).or_default().accepted += 1,
                ("BADPAYLOAD" | "BADKEY", _, _) => {
                    return Err(Failure::new(format!(
                        "worker {index} was handed an item not as accepted: {line}"
                    )))
                }
                ("COMPLETED", Some(ev), Some(t)) => events.entry(ev).or_default().completed.push(t),
                ("LOST", Some(ev), Some(t)) => {
                    let e = events.entry(ev).or_default();
                    e.lost += 1;
                    e.lost_tokens.insert(t);
                }
                ("ERROR", _, _) => report.errors += 1,
                ("FINAL", Some(ev), Some(t)) => {
                    let attempts = parts.get(3).and_then(|a| a.parse::<u32>().ok());
                    match attempts {
                        Some(a) if parts.len() == 4 => {
                            events.entry(ev).or_default().finals.push((t, a))
                        }
                        _ => events
                            .entry(ev)
                            .or_default()
                            .bad_finals
                            .push(line.to_string()),
                    }
                }
                ("EXIT", _, _) => exited += 1,
                _ if killed.contains(&index) && n + 1 == lines.len() => {} // cut off by the kill
                _ => {
                    return Err(Failure::new(format!(
                        "worker {index}: unreadable log line {line:?}"
                    )))
                }
            }
        }
        if killed.contains(&index) {
            // Claims this worker never asked to complete: orphaned by the kill.
            let asked: HashSet<&str> = lines
                .iter()
                .filter_map(|l| l.strip_prefix("COMPLETING "))
                .filter_map(|rest| rest.split(' ').nth(1))
                .collect();
            report.orphaned_claims += lines
                .iter()
                .filter_map(|l| l.strip_prefix("CLAIMED "))
                .filter_map(|rest| rest.split(' ').nth(1))
                .filter(|token| !asked.contains(token))
                .count();
        }
    }
    if exited == 0 {
        return Err(Failure::new("no worker finished"));
    }
    for event in 0..plan.events {
        let Some(e) = events.get(&event) else {
            return Err(Failure::new(format!("event {event}: never claimed")));
        };
        if e.accepted > 1 {
            return Err(Failure::new(format!(
                "event {event}: {} accepts answered New",
                e.accepted
            )));
        }
        if let Some(bad) = e.bad_finals.first() {
            return Err(Failure::new(format!(
                "event {event}: not done at the end: {bad}"
            )));
        }
        let Some((outcome, attempts)) = e.finals.first().cloned() else {
            return Err(Failure::new(format!(
                "event {event}: no finished worker read it"
            )));
        };
        if let Some(other) = e.finals.iter().find(|(o, _)| *o != outcome) {
            return Err(Failure::new(format!(
                "event {event}: workers read two outcomes, {outcome} and {}",
                other.0
            )));
        }
        // Two holders at once: neither win can have come after the other's
        // lease passed.
        let tol = CLOCK_TOLERANCE.as_millis() as i64;
        for (i, (ta, at_a, dl_a)) in e.held.iter().enumerate() {
            for (tb, at_b, dl_b) in &e.held[i + 1..] {
                if *at_b < dl_a - tol && *at_a < dl_b - tol {
                    return Err(Failure::new(format!(
                        "event {event}: two live holders: {ta} (deadline {dl_a}) and {tb} \
                         (deadline {dl_b}) were both won while the other's lease ran"
                    )));
                }
            }
        }
        // A completion asked after its lease had passed must be refused.
        for token in &e.completed {
            let deadline = e.held.iter().find(|(t, _, _)| t == token).map(|h| h.2);
            let asked = e.asked.iter().find(|(t, _)| t == token).map(|a| a.1);
            if let (Some(deadline), Some(asked)) = (deadline, asked) {
                if asked > deadline + tol {
                    return Err(Failure::new(format!(
                        "event {event}: {token} completed, asked {} ms after its lease had passed",
                        asked - deadline
                    )));
                }
            }
        }
        // Nothing runs an event again once it is done: no win logged after
        // the successful completion was asked for (the side effects are the
        // first run plus one per holder that was killed or lost its lease).
        if let Some(done) = e.completed.first() {
            if let Some(asked) = e.asked.iter().find(|(t, _)| t == done).map(|a| a.1) {
                if let Some((late, at, _)) = e
                    .held
                    .iter()
                    .find(|(t, at, _)| t != done && *at > asked + tol)
                {
                    return Err(Failure::new(format!(
                        "event {event}: {late} won it {} ms after {done} completed it",
                        at - asked
                    )));
                }
            }
        }
        if e.completed.len() > 1 {
            return Err(Failure::new(format!(
                "event {event}: {} completions succeeded: {:?}",
                e.completed.len(),
                e.completed
            )));
        }
        match e.completed.first() {
            Some(token) if *token != outcome => {
                return Err(Failure::new(format!(
                    "event {event}: {token} completed, but the stored outcome is {outcome}: \
                     a completion was overwritten"
                )))
            }
            Some(_) => {}
            None => {
                // Asked, and its answer never logged: killed right after asking,
                // or an error (a timeout) that still took effect.
                let asked = e
                    .completing
                    .iter()
                    .any(|(_, t)| *t == outcome && !e.lost_tokens.contains(t));
                if !asked {
                    return Err(Failure::new(format!(
                        "event {event}: the stored outcome {outcome} is no completion any worker asked for"
                    )));
                }
            }
        }
        let claims: HashSet<&str> = e.claimed.iter().map(|(_, t)| t.as_str()).collect();
        if (attempts as usize) < claims.len() {
            return Err(Failure::new(format!(
                "event {event}: won {} times but the record counts {attempts} attempts",
                claims.len()
            )));
        }
        if claims.len() > 1 {
            report.taken_over += 1;
        }
        report.stale_refused += e.lost;
    }
    if plan.ordering_keys > 0 {
        judge_order(plan, &events)?;
    }
    if plan.stall_every > 0 && report.stale_refused == 0 {
        return Err(Failure::new(
            "no stalled worker's completion was refused: the run never tried a stale completion",
        ));
    }
    if report.orphaned_claims == 0 {
        return Err(Failure::new(
            "no kill landed between a claim and its completion: the run proved nothing",
        ));
    }
    Ok(report)
}

/// Per-key order (CONTRACT.md I15): within each ordering key, in accept
/// (event) order, every take of an item came after the completion of the
/// item before it was asked for. The completion is logged before it is
/// sent and the take after it answered, so a take of the later item logged
/// before the earlier one's completion was asked means the store handed it
/// out while the earlier one was not done: two items of a key at once, or
/// out of order.
fn judge_order(plan: &CrashPlan, events: &HashMap<usize, Event>) -> Result<(), Failure> {
    // Both times are read on one machine's clock, in order in real time:
    // only their rounding to the millisecond separates them.
    let tol = 1;
    for key in 0..plan.ordering_keys {
        let order: Vec<usize> = (key..plan.events).step_by(plan.ordering_keys).collect();
        for pair in order.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            let (Some(b), Some(a)) = (events.get(&before), events.get(&after)) else {
                continue; // reported as never claimed above
            };
            // The completion that took effect: the one answered Ok, else the
            // stored outcome's (its worker killed right after asking).
            let done = b
                .completed
                .first()
                .cloned()
                .or_else(|| b.finals.first().map(|(outcome, _)| outcome.clone()));
            let Some(asked) =
                done.and_then(|token| b.asked.iter().find(|(t, _)| *t == token).map(|(_, at)| *at))
            else {
                return Err(Failure::new(format!(
                    "event {before}: no completion asked for, so the order of key k{key} cannot be judged"
                )));
            };
            if let Some((token, at, _)) = a.held.iter().find(|(_, at, _)| *at < asked - tol) {
                return Err(Failure::new(format!(
                    "key k{key}: event {after} was taken ({token}, at {at}) {} ms before the \
                     completion of event {before}, earlier in the key's order, was asked for",
                    asked - at
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two events of one key: the second taken after the first's completion
    /// was asked passes; taken before it (two at once, or out of order)
    /// fails, naming the key.
    #[test]
    fn the_order_judge_catches_a_take_before_the_earlier_completion() {
        let plan = CrashPlan {
            events: 2,
            ordering_keys: 1,
            ..CrashPlan::inbox()
        };
        let events = |second_taken_at: i64| {
            let first = Event {
                held: vec![("t0".into(), 1_000, 1_400)],
                asked: vec![("t0".into(), 1_030)],
                completed: vec!["t0".into()],
                ..Event::default()
            };
            let second = Event {
                held: vec![("t1".into(), second_taken_at, second_taken_at + 400)],
                ..Event::default()
            };
            HashMap::from([(0, first), (1, second)])
        };
        assert!(judge_order(&plan, &events(1_031)).is_ok());
        let early = judge_order(&plan, &events(1_010)).expect_err("taken before");
        assert!(early.to_string().contains("key k0"), "{early}");
    }
}
