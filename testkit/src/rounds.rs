//! What the SQL stores' own attack rounds share (`dedupe-sqlite/tests/sqlite_attack.rs`,
//! `dedupe-postgres/tests/postgres_attack.rs`): the rounds that need a store's
//! own handles in a mode of theirs (claim modes, a held write lock, claims
//! inside the application's transaction, processes on one file). The
//! store-agnostic rounds are conformance checks (`dedupe_conformance::checks`,
//! `attacks.rs`), and every call here is judged by the suite's one history
//! checker ([`dedupe_conformance::history`]).
//!
//! [`Log`] names its workers ("racer3", "holder", "as1") and records through a
//! [`Recorder`] per call, so a round reads as the calls it makes.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_conformance::history::{Answer, Call, History, Recorder};
use dedupe_core::{
    ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease,
};

/// Lease of a claim that must not pass during a test step.
pub const LONG: Duration = Duration::from_secs(20);
/// Retention of every completion (far beyond any test's run).
pub const RETAIN: Duration = Duration::from_secs(3600);
/// Clock slack for millisecond deadlines (store clocks floor to ms), in µs.
pub const SLACK_US: i64 = 2_000;

/// Microseconds since the epoch.
pub fn us(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

/// Now, in microseconds since the epoch.
pub fn now_us() -> i64 {
    us(SystemTime::now())
}

fn at_us(t: i64) -> SystemTime {
    if t >= 0 {
        UNIX_EPOCH + Duration::from_micros(t.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_micros(t.unsigned_abs())
    }
}

/// A key the test knows is valid.
///
/// # Panics
/// On a key core refuses (a test bug).
pub fn key(ns: &str, id: impl AsRef<str>) -> Key {
    Key::new(ns, id).expect("a valid key")
}

/// Claim options with this lease.
pub fn opts(ttl: Duration) -> ClaimOptions {
    ClaimOptions::new(ttl)
}

/// A claim id the test knows is valid.
///
/// # Panics
/// On a claim id core refuses (a test bug).
pub fn cid(id: impl Into<String>) -> ClaimId {
    ClaimId::new(id).expect("a valid claim id")
}

/// A fingerprint of 32 bytes `n`.
///
/// # Panics
/// Never: 32 bytes are always a valid fingerprint.
pub fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes(vec![n; 32]).expect("a valid fingerprint")
}

/// Sleeps until `t` (µs since the epoch).
pub async fn sleep_until_us(t: i64) {
    let now = now_us();
    if t > now {
        tokio::time::sleep(Duration::from_micros(u64::try_from(t - now).unwrap_or(0))).await;
    }
}

pub use dedupe_conformance::history::chain;

/// The history of a test, shared by its tasks, with a name per worker.
#[derive(Clone, Debug)]
pub struct Log {
    history: History,
    names: Arc<Mutex<Vec<String>>>,
}

impl Default for Log {
    fn default() -> Self {
        Self {
            history: History::new(Duration::from_micros(SLACK_US.unsigned_abs())),
            names: Arc::default(),
        }
    }
}

impl Log {
    /// The history the calls are recorded into.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The worker number of `who` (a new one the first time).
    fn worker(&self, who: &str) -> usize {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.iter().position(|n| n == who).unwrap_or_else(|| {
            names.push(who.to_string());
            names.len() - 1
        })
    }

    /// The name of worker `worker`.
    pub fn name(&self, worker: usize) -> String {
        self.names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(worker)
            .cloned()
            .unwrap_or_else(|| format!("worker {worker}"))
    }

    /// `who`'s recorder on `store`.
    pub fn on<S: DedupeStore + Clone + 'static>(&self, store: &S, who: &str) -> Recorder {
        Recorder::new(
            Arc::new(store.clone()),
            self.history.clone(),
            self.worker(who),
        )
    }

    /// `claim`, recorded.
    pub async fn claim<S: DedupeStore + Clone + 'static>(
        &self,
        s: &S,
        who: &str,
        k: &Key,
        o: &ClaimOptions,
    ) -> dedupe_core::Result<ClaimOutcome> {
        self.on(s, who).claim(k, o).await
    }

    /// `claim_many`, recorded (a key twice in the batch is judged at once).
    pub async fn claim_many<S: DedupeStore + Clone + 'static>(
        &self,
        s: &S,
        who: &str,
        keys: &[Key],
        o: &ClaimOptions,
    ) -> dedupe_core::Result<Vec<ClaimOutcome>> {
        self.on(s, who).claim_many(keys, o).await
    }

    /// `complete` with [`RETAIN`], recorded.
    pub async fn complete<S: DedupeStore + Clone + 'static>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
        outcome: &[u8],
    ) -> dedupe_core::Result<()> {
        self.on(s, who).complete(l, outcome, RETAIN).await
    }

    /// `release`, recorded.
    pub async fn release<S: DedupeStore + Clone + 'static>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
    ) -> dedupe_core::Result<()> {
        self.on(s, who).release(l).await
    }

    /// `extend`, recorded.
    pub async fn extend<S: DedupeStore + Clone + 'static>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
        ttl: Duration,
    ) -> dedupe_core::Result<Lease> {
        self.on(s, who).extend(l, ttl).await
    }

    /// A call made outside the store's trait (inside a transaction of the
    /// caller's, or in another process), asked at `t_call` and answered at
    /// `t_ret` (µs since the epoch).
    pub fn record(&self, k: &Key, who: &str, t_call: i64, t_ret: i64, answer: Answer) {
        self.history.record(Call {
            worker: self.worker(who),
            key: k.to_string(),
            asked: self.history.instant_of(at_us(t_call)),
            answered: self.history.instant_of(at_us(t_ret)),
            answer,
        });
    }

    /// A claim made outside the store's trait, recorded.
    pub fn record_claim(
        &self,
        k: &Key,
        who: &str,
        t_call: i64,
        t_ret: i64,
        r: &dedupe_core::Result<ClaimOutcome>,
    ) {
        self.record(k, who, t_call, t_ret, Answer::of_claim(r));
    }

    /// A violation seen directly by a task (reported with the history's).
    pub fn flag(&self, msg: String) {
        self.history.flag(msg);
    }

    /// Every call so far, with its worker's name and its times in µs since
    /// the epoch.
    pub fn calls(&self) -> Vec<(String, i64, i64, Call)> {
        self.history
            .calls()
            .into_iter()
            .map(|c| {
                let asked = us(self.history.wall_clock_of(c.asked));
                let answered = us(self.history.wall_clock_of(c.answered));
                (self.name(c.worker), asked, answered, c)
            })
            .collect()
    }
}

/// How strictly [`assert_history`] judges.
#[derive(Clone, Copy, Debug)]
pub struct CheckOpts {
    /// Every InFlight answer must show a lease some successful claim was
    /// answered (on keys where no call's effect is unknown).
    pub strict_inflight: bool,
    /// On keys never released, the winners' attempts are 1, 2, 3... each once.
    pub distinct_attempts: bool,
}

/// Every rule, attempts in order.
pub const STRICT: CheckOpts = CheckOpts {
    strict_inflight: true,
    distinct_attempts: true,
};

/// Every rule but attempts in order (for runs where retention passes or
/// calls are cancelled).
pub const LOOSE: CheckOpts = CheckOpts {
    strict_inflight: true,
    distinct_attempts: false,
};

/// Runs the history checker over a log and panics with the first violations.
///
/// # Panics
/// On any violation.
pub fn assert_history(what: &str, log: &Log, o: CheckOpts) {
    let mut history = log.history.clone();
    if o.strict_inflight {
        history = history.every_in_flight_seen();
    }
    if o.distinct_attempts {
        history = history.attempts_in_order();
    }
    if let Err(f) = history.verdict(what) {
        panic!("{f}");
    }
}

/// Fails on any call that failed in a way that may have taken effect (none is
/// expected without faults), leaving out the typed refusals of rule 8.
///
/// # Panics
/// On any such failure.
pub fn assert_no_errors(what: &str, log: &Log) {
    let errors = log.history.failures();
    assert!(
        errors.is_empty(),
        "{what}: {} calls failed although nothing was faulted; the first ones:\n  {}",
        errors.len(),
        errors
            .iter()
            .take(15)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// A transaction that committed a win: the key, the worker, the outcome.
pub type Commit = (String, String, Vec<u8>);

/// Plain (non-transactional) claimers racing the transactions on the same
/// keys: a win is completed at once.
pub async fn plain_claimer(a: usize, s: Arc<dyn DedupeStore>, keys: Arc<Vec<Key>>, log: Log) {
    let who = format!("as{a}");
    for pass in 0..300 {
        let mut open = false;
        for (i, k) in keys.iter().enumerate() {
            if !(i + a + pass).is_multiple_of(5) {
                continue;
            }
            let r = if (i + pass) % 2 == 0 {
                log.claim(&s, &who, k, &opts(LONG)).await
            } else {
                log.claim_many(&s, &who, &[k.clone(), k.clone()], &opts(LONG))
                    .await
                    .and_then(|v| {
                        v.into_iter()
                            .next()
                            .ok_or_else(|| Error::fatal("an empty answer", None))
                    })
            };
            match r {
                Ok(ClaimOutcome::Claimed(l)) => {
                    let out = format!("as|{k}|{who}|{pass}").into_bytes();
                    let _ = log.complete(&s, &who, &l, &out).await;
                }
                Ok(ClaimOutcome::Duplicate { .. }) => {}
                _ => open = true,
            }
        }
        if !open && pass > 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The per-key verdict of a transactions test: exactly one committed win
/// (a transaction's, or a plain claim's completion), the application's rows
/// matching the transactions' wins, and the stored outcome that winner's.
pub fn judge_transactions(
    log: &Log,
    keys: &[Key],
    commits: &[Commit],
    rows: &HashMap<String, i64>,
    stored: &HashMap<String, Option<Vec<u8>>>,
) {
    let calls = log.calls();
    for k in keys {
        let ks = k.to_string();
        let tx_wins: Vec<&Vec<u8>> = commits.iter().filter(|c| c.0 == ks).map(|c| &c.2).collect();
        let plain_wins: Vec<&Vec<u8>> = calls
            .iter()
            .filter(|(who, _, _, c)| c.key == ks && who.starts_with("as"))
            .filter_map(|(_, _, _, c)| match &c.answer {
                Answer::Completed { outcome, .. } => Some(outcome),
                _ => None,
            })
            .collect();
        if tx_wins.len() + plain_wins.len() != 1 {
            log.flag(format!(
                "{ks}: {} transactions committed a win and {} plain claims completed it; exactly one expected",
                tx_wins.len(),
                plain_wins.len()
            ));
        }
        let n_rows = rows.get(&ks).copied().unwrap_or(0);
        if n_rows != i64::try_from(tx_wins.len()).unwrap_or(-1) {
            log.flag(format!(
                "{ks}: the application holds {n_rows} rows but {} transactions committed a win: claim and work did not commit together",
                tx_wins.len()
            ));
        }
        let want = tx_wins.first().or(plain_wins.first()).copied();
        let got = stored.get(&ks).cloned().flatten();
        if want.is_some() && got.as_ref() != want {
            log.flag(format!(
                "{ks}: the stored outcome is {:?}, not the single winner's {:?}",
                got.map(|o| String::from_utf8_lossy(&o).into_owned()),
                want.map(|o| String::from_utf8_lossy(o).into_owned())
            ));
        }
    }
}

/// Claims `keys` over and over until stopped; a win is worked on for `work`
/// and then completed (a key once won is not claimed again by this observer).
/// With `same_cid`, claims carry that claim id.
pub async fn observe(
    log: Log,
    s: Arc<dyn DedupeStore>,
    o: usize,
    keys: Vec<Key>,
    same_cid: Option<&'static str>,
    work: Duration,
    stop: Arc<AtomicBool>,
) {
    let who = format!("observer{o}");
    let mut mine: HashSet<Key> = HashSet::new();
    let mut works = tokio::task::JoinSet::new();
    while !stop.load(Ordering::Relaxed) {
        for k in &keys {
            if mine.contains(k) {
                continue;
            }
            let op = match same_cid {
                Some(c) => opts(LONG).with_claim_id(cid(c)),
                None => opts(LONG),
            };
            if let Ok(ClaimOutcome::Claimed(l)) = log.claim(&s, &who, k, &op).await {
                mine.insert(k.clone());
                let (log, s, who) = (log.clone(), Arc::clone(&s), who.clone());
                works.spawn(async move {
                    tokio::time::sleep(work).await;
                    let out = format!("{who}-{}", l.key).into_bytes();
                    let _ = log.complete(&s, &who, &l, &out).await;
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    while works.join_next().await.is_some() {}
}

// ======================================================================
// One race round as both stores run it: what each racer saw, and the
// round's own expectations on top of the history checker.
// ======================================================================

/// What one racer saw of the race key in one phase.
#[derive(Clone, Debug, Default)]
pub struct Entry {
    /// The racer.
    pub id: usize,
    /// The lease it won, if it won.
    pub lease: Option<Lease>,
    /// Its first answer on the race key.
    pub first: Option<ClaimOutcome>,
    /// Whether its call failed.
    pub err: bool,
    /// When it called (µs since the epoch).
    pub t_call: i64,
    /// When it was answered.
    pub t_ret: i64,
}

/// The ways a racer claims (see the stores' `claim_by_mode`).
pub const MODES: usize = 7;

/// What the racers of one round saw, phase by phase.
#[derive(Debug, Default)]
pub struct Board {
    /// What each racer saw, per phase.
    pub p: [Vec<Entry>; 3],
    /// The completion of phase 0 and of phase 1: outcome, and whether it succeeded.
    pub done: [Option<(Vec<u8>, bool)>; 2],
    /// Whether phase 0's winner released.
    pub released: bool,
}

/// The outcome racer `id` completes with in `phase` of `round`.
pub fn outcome_for(round: usize, id: usize, phase: usize) -> Vec<u8> {
    let mut v = format!("race|r{round}|t{id}|p{phase}|").into_bytes();
    v.extend_from_slice(&[0, 255, 10, 0]);
    v
}

/// The lowest-numbered racer that won in a phase, and its lease.
pub fn first_winner(p: &[Entry]) -> Option<(usize, Lease)> {
    p.iter()
        .filter_map(|e| e.lease.clone().map(|l| (e.id, l)))
        .min_by_key(|(i, _)| *i)
}

/// What phase 0's winner does, by `round % 4`.
pub const KINDS: [&str; 4] = [
    "complete",
    "release",
    "lapse then takeover",
    "extend then complete",
];

/// The round's own expectations, on top of the history checker.
pub fn judge_round(log: &Log, round: usize, kind: usize, b: &Board) {
    let tag = format!("round {round} ({})", KINDS[kind]);
    let errs = |p: &[Entry]| p.iter().any(|e| e.err);
    let toks = |p: &[Entry]| -> HashSet<String> {
        p.iter()
            .filter_map(|e| e.lease.as_ref().map(|l| l.token.as_str().to_string()))
            .collect()
    };
    if !errs(&b.p[0][..]) {
        let t = toks(&b.p[0][..]);
        let earliest = b.p[0]
            .iter()
            .filter_map(|e| e.lease.as_ref())
            .map(|l| us(l.deadline))
            .min();
        let late = earliest.is_some_and(|d| b.p[0].iter().any(|e| e.t_ret + SLACK_US >= d));
        if t.len() != 1 && !late {
            let detail: Vec<String> = b.p[0]
                .iter()
                .filter_map(|e| {
                    e.lease.as_ref().map(|l| {
                        format!(
                            "racer{} attempt {} deadline {} call {} ret {}",
                            e.id,
                            l.attempt,
                            us(l.deadline),
                            e.t_call,
                            e.t_ret
                        )
                    })
                })
                .collect();
            log.flag(format!(
                "{tag}: {} distinct winners among {} simultaneous claims of a fresh key (exactly one expected): {detail:?}",
                t.len(),
                b.p[0].len()
            ));
        }
    }
    let w0 = first_winner(&b.p[0]);
    let single0 = !errs(&b.p[0][..]) && toks(&b.p[0][..]).len() == 1;
    let dup_of = |p: &[Entry], out: &[u8], phase: usize| {
        for e in p {
            match &e.first {
                Some(ClaimOutcome::Duplicate { outcome, .. }) if outcome.as_slice() == out => {}
                Some(other) => log.flag(format!(
                    "{tag} phase {phase}: racer{} expected Duplicate with the completed outcome, got {other:?}",
                    e.id
                )),
                None => {}
            }
        }
    };
    match kind {
        0 | 3 => {
            if let Some((out, true)) = &b.done[0] {
                dup_of(&b.p[1][..], &out[..], 1);
                dup_of(&b.p[2][..], &out[..], 2);
            }
        }
        _ => {
            if single0 && !errs(&b.p[1][..]) && (kind == 2 || b.released) {
                let t = toks(&b.p[1][..]);
                if t.len() != 1 {
                    log.flag(format!(
                        "{tag} phase 1: {} distinct winners after the first holder {} (exactly one expected)",
                        t.len(),
                        if kind == 1 { "released" } else { "let its lease lapse" }
                    ));
                }
                let want = if kind == 1 {
                    1
                } else {
                    w0.as_ref().map_or(0, |(_, l)| l.attempt + 1)
                };
                for e in &b.p[1] {
                    if let Some(l) = &e.lease {
                        if l.attempt != want {
                            log.flag(format!(
                                "{tag} phase 1: racer{} won attempt {} (expected {want})",
                                e.id, l.attempt
                            ));
                        }
                    }
                }
            }
            if let Some((out, true)) = &b.done[1] {
                dup_of(&b.p[2][..], &out[..], 2);
            }
        }
    }
}

/// A claim inside a transaction of the application's own, committed at once:
/// the way of claiming only the SQL stores have (`claim_in`), the sixth of
/// [`claim_by_mode`]'s.
pub type ClaimIn = Arc<
    dyn Fn(
            Key,
            ClaimOptions,
        ) -> Pin<Box<dyn Future<Output = dedupe_core::Result<ClaimOutcome>> + Send>>
        + Send
        + Sync,
>;

/// Who claims, on which handle, and how it claims inside a transaction.
pub struct Claimer<'a, S> {
    /// The history.
    pub log: &'a Log,
    /// The worker's name.
    pub who: &'a str,
    /// Its handle.
    pub store: &'a S,
    /// Its claim inside a transaction of its own.
    pub claim_in: &'a ClaimIn,
}

impl<S> std::fmt::Debug for Claimer<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimer")
            .field("who", &self.who)
            .finish_non_exhaustive()
    }
}

/// Claims `k` one of seven ways, by `mode`: claim; claim with a claim id;
/// `claim_many [k, k]`; `claim_many [fresh, k, fresh, k]`; `claim_many [k, k]`
/// with a claim id; `claim_in` in a transaction of the caller's; claim with a
/// fingerprint. Answers what the claimer saw of `k`.
pub async fn claim_by_mode<S: DedupeStore + Clone + 'static>(
    c: &Claimer<'_, S>,
    mode: usize,
    tag: &str,
    k: &Key,
    ttl: Duration,
) -> Entry {
    let Claimer {
        log,
        who,
        store,
        claim_in,
    } = *c;
    let t_call = now_us();
    let o = opts(ttl);
    let one = |a: ClaimOutcome| vec![(k.clone(), a)];
    let answers: dedupe_core::Result<Vec<(Key, ClaimOutcome)>> = match mode % MODES {
        0 => log.claim(store, who, k, &o).await.map(one),
        1 => {
            let o = o.clone().with_claim_id(cid(format!("{who}-{tag}")));
            log.claim(store, who, k, &o).await.map(one)
        }
        2 | 4 => {
            let keys = vec![k.clone(), k.clone()];
            let o = if mode % MODES == 4 {
                o.clone().with_claim_id(cid(format!("{who}-{tag}")))
            } else {
                o.clone()
            };
            log.claim_many(store, who, &keys, &o)
                .await
                .map(|v| keys.into_iter().zip(v).collect())
        }
        3 => {
            let keys = vec![
                key("fresh", format!("{who}-{tag}-a")),
                k.clone(),
                key("fresh", format!("{who}-{tag}-b")),
                k.clone(),
            ];
            log.claim_many(store, who, &keys, &o)
                .await
                .map(|v| keys.into_iter().zip(v).collect())
        }
        5 => {
            let t0 = now_us();
            let r = claim_in(k.clone(), o.clone()).await;
            log.record_claim(k, who, t0, now_us(), &r);
            r.map(one)
        }
        _ => {
            let o = o.clone().with_fingerprint(fp(7));
            log.claim(store, who, k, &o).await.map(one)
        }
    };
    let t_ret = now_us();
    match answers {
        Ok(v) => {
            let mine: Vec<&ClaimOutcome> =
                v.iter().filter(|(kk, _)| kk == k).map(|(_, a)| a).collect();
            Entry {
                id: 0,
                lease: mine.iter().find_map(|a| a.lease().cloned()),
                first: mine.first().map(|a| (*a).clone()),
                err: false,
                t_call,
                t_ret,
            }
        }
        Err(_) => Entry {
            id: 0,
            lease: None,
            first: None,
            err: true,
            t_call,
            t_ret,
        },
    }
}

/// What the racers of a race share.
#[derive(Debug)]
pub struct RaceCtx {
    rounds: usize,
    barrier: tokio::sync::Barrier,
    board: Mutex<Board>,
    log: Log,
    /// The lease of the rounds whose winner lets it lapse.
    short: Duration,
    /// How long past that lease's deadline the next wave claims.
    past: Duration,
}

impl RaceCtx {
    /// A race of `racers` racers over `rounds` rounds, recorded into `log`;
    /// rounds that let a lease lapse use `short` and wait `past` its deadline.
    pub fn new(
        racers: usize,
        rounds: usize,
        log: &Log,
        short: Duration,
        past: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            rounds,
            barrier: tokio::sync::Barrier::new(racers),
            board: Mutex::default(),
            log: log.clone(),
            short,
            past,
        })
    }

    fn board(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One racer of a race: every round, every racer claims the fresh key at once
/// (each by one of [`claim_by_mode`]'s ways); the winner completes, releases,
/// lets its short lease lapse, or extends and completes ([`KINDS`]); a second
/// wave claims again (duplicates, a fresh claim after the release, or the
/// takeover), and its winner completes; the first holder calls again on its
/// old lease (always refused); a third wave sees duplicates of the one
/// outcome. The last racer to finish a round judges it ([`judge_round`]).
pub async fn racer<S: DedupeStore + Clone + 'static>(
    ctx: Arc<RaceCtx>,
    id: usize,
    store: S,
    claim_in: ClaimIn,
) {
    let who = format!("racer{id}");
    let log = ctx.log.clone();
    let me = Claimer {
        log: &log,
        who: &who,
        store: &store,
        claim_in: &claim_in,
    };
    for round in 0..ctx.rounds {
        let kind = round % 4;
        let k = key("race", format!("r{round}"));
        let ttl = if kind == 2 { ctx.short } else { LONG };

        // Phase 0: every racer claims the fresh key at once.
        ctx.barrier.wait().await;
        let mut e = claim_by_mode(&me, id + round, &format!("{round}-0"), &k, ttl).await;
        e.id = id;
        ctx.board().p[0].push(e);
        ctx.barrier.wait().await;
        let p0 = ctx.board().p[0].clone();
        let w0 = first_winner(&p0);
        if let Some((wid, l)) = &w0 {
            if *wid == id {
                match kind {
                    0 => {
                        let out = outcome_for(round, id, 0);
                        let ok = log.complete(&store, &who, l, &out).await.is_ok();
                        ctx.board().done[0] = Some((out, ok));
                    }
                    1 => {
                        let ok = log.release(&store, &who, l).await.is_ok();
                        ctx.board().released = ok;
                    }
                    2 => {}
                    _ => {
                        let out = outcome_for(round, id, 0);
                        let ok = match log.extend(&store, &who, l, Duration::from_secs(30)).await {
                            Ok(l2) => log.complete(&store, &who, &l2, &out).await.is_ok(),
                            Err(_) => false,
                        };
                        ctx.board().done[0] = Some((out, ok));
                    }
                }
            }
        }
        ctx.barrier.wait().await;
        if kind == 2 {
            if let Some((_, l)) = &w0 {
                sleep_until_us(us(l.deadline + ctx.past)).await;
            }
        }

        // Phase 1: everyone claims again: a duplicate, a fresh claim after the
        // release, or the takeover of the lapsed lease.
        ctx.barrier.wait().await;
        let mut e = claim_by_mode(&me, id + round + 3, &format!("{round}-1"), &k, LONG).await;
        e.id = id;
        ctx.board().p[1].push(e);
        ctx.barrier.wait().await;
        let p1 = ctx.board().p[1].clone();
        if let Some((wid, l)) = first_winner(&p1) {
            if wid == id {
                let out = outcome_for(round, id, 1);
                let ok = log.complete(&store, &who, &l, &out).await.is_ok();
                ctx.board().done[1] = Some((out, ok));
            }
        }
        // The first holder acts again on its old lease: always refused.
        if let Some((wid, l)) = &w0 {
            if *wid == id {
                let c = log.complete(&store, &who, l, b"stale").await.map(|_| ());
                let x = log.extend(&store, &who, l, LONG).await.map(|_| ());
                let r = log.release(&store, &who, l).await.map(|_| ());
                for (what, res) in [("complete", c), ("extend", x), ("release", r)] {
                    if res.is_ok() {
                        log.flag(format!(
                            "round {round} ({}): stale holder: the first holder's {what} on its old lease succeeded",
                            KINDS[kind]
                        ));
                    }
                }
            }
        }

        // Phase 2: everyone claims once more; all duplicates of the one outcome.
        ctx.barrier.wait().await;
        let mut e = claim_by_mode(&me, id + round + 5, &format!("{round}-2"), &k, LONG).await;
        e.id = id;
        ctx.board().p[2].push(e);
        if ctx.barrier.wait().await.is_leader() {
            let mut b = ctx.board();
            judge_round(&log, round, kind, &b);
            *b = Board::default();
        }
    }
}
