// Attacks on the contract shared by the SQLite and Postgres adversarial tests
// (`dedupe-sqlite/tests/sqlite_attack.rs`, `dedupe-postgres/tests/postgres_attack.rs`),
// written by an independent reviewer from CONTRACT.md and the stores' source,
// without reading the crates' own tests or the conformance suite.
//
// Each of those files pulls this one in with `include!`, so that the harness
// and the store-agnostic attacks are written once and see the file's own
// imports; it is not a module of `dedupe-testkit`.
// ======================================================================
// Shared harness (identical in sqlite_attack.rs and postgres_attack.rs):
// a recorder of every call and its answer with call/return times, and a
// checker that replays the contract's rules over that history.
// ======================================================================

/// Lease of a claim that must not pass during a test step.
const LONG: Duration = Duration::from_secs(20);
/// Retention of every completion (far beyond any test's run).
const RETAIN: Duration = Duration::from_secs(3600);
/// Clock slack for millisecond deadlines (store clocks floor to ms).
const SLACK_US: i64 = 2_000;

fn us(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

fn now_us() -> i64 {
    us(SystemTime::now())
}

fn key(ns: &str, id: impl AsRef<str>) -> Key {
    Key::new(ns, id).expect("a valid key")
}

fn opts(ttl: Duration) -> ClaimOptions {
    ClaimOptions::new(ttl)
}

fn cid(id: impl Into<String>) -> ClaimId {
    ClaimId::new(id).expect("a valid claim id")
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes(vec![n; 32]).expect("a valid fingerprint")
}

async fn sleep_until_us(t: i64) {
    let now = now_us();
    if t > now {
        tokio::time::sleep(Duration::from_micros(u64::try_from(t - now).unwrap_or(0))).await;
    }
}

/// Polls `f` every 10 ms for at most `limit`; whether it answered true.
async fn poll_until<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let since = Instant::now();
    while since.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Errors after which the contract says nothing was written (rule 8), so the
/// call is known not to have won anything.
fn definite(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidKey(_)
            | Error::InvalidConfig { .. }
            | Error::OutcomeTooLarge { .. }
            | Error::BatchTooLarge { .. }
            | Error::CorruptRecord { .. }
    )
}

/// A claim's answer as the checker needs it (times in µs since the epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ans {
    Claimed {
        token: String,
        attempt: u32,
        deadline: i64,
    },
    InFlight {
        attempt: u32,
        deadline: i64,
    },
    Duplicate {
        outcome: Vec<u8>,
    },
    Mismatch,
    /// `definite`: an error after which nothing was written (rule 8).
    Err {
        definite: bool,
        text: String,
    },
}

impl Ans {
    fn of(a: &ClaimOutcome) -> Self {
        match a {
            ClaimOutcome::Claimed(l) => Ans::Claimed {
                token: l.token.as_str().to_string(),
                attempt: l.attempt,
                deadline: us(l.deadline),
            },
            ClaimOutcome::InFlight { deadline, attempt } => Ans::InFlight {
                attempt: *attempt,
                deadline: us(*deadline),
            },
            ClaimOutcome::Duplicate { outcome, .. } => Ans::Duplicate {
                outcome: outcome.clone(),
            },
            ClaimOutcome::Mismatch { .. } => Ans::Mismatch,
        }
    }

    fn of_result(r: &dedupe_core::Result<ClaimOutcome>) -> Self {
        match r {
            Ok(a) => Ans::of(a),
            Err(e) => Ans::of_err(e),
        }
    }

    fn of_err(e: &Error) -> Self {
        Ans::Err {
            definite: definite(e),
            text: chain(e),
        }
    }

    fn cancelled() -> Self {
        Ans::Err {
            definite: false,
            text: "cancelled by the caller (future dropped)".into(),
        }
    }
}

/// What a complete, release or extend answered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Res {
    Ok,
    Lost,
    Err(String),
}

impl Res {
    fn of<T>(r: &dedupe_core::Result<T>) -> Self {
        match r {
            Ok(_) => Res::Ok,
            Err(Error::LeaseLost { .. }) => Res::Lost,
            Err(e) => Res::Err(chain(e)),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Claim(Ans),
    Complete {
        token: String,
        outcome: Vec<u8>,
        res: Res,
    },
    Release {
        token: String,
        res: Res,
    },
    Extend {
        token: String,
        res: Res,
        deadline: i64,
    },
}

/// One call on one key: who, when it was called and when it returned.
#[derive(Clone, Debug)]
struct Ev {
    key: String,
    who: String,
    t_call: i64,
    t_ret: i64,
    op: Op,
}

/// The history of a test, shared by its tasks.
#[derive(Clone, Default)]
struct Log {
    evs: Arc<Mutex<Vec<Ev>>>,
    bad: Arc<Mutex<Vec<String>>>,
}

impl Log {
    fn push(&self, key: &Key, who: &str, t_call: i64, t_ret: i64, op: Op) {
        self.evs.lock().expect("log").push(Ev {
            key: key.to_string(),
            who: who.to_string(),
            t_call,
            t_ret,
            op,
        });
    }

    /// A violation seen directly by a task (checked at the end).
    fn flag(&self, msg: String) {
        self.bad.lock().expect("log").push(msg);
    }

    fn events(&self) -> Vec<Ev> {
        self.evs.lock().expect("log").clone()
    }

    fn flags(&self) -> Vec<String> {
        self.bad.lock().expect("log").clone()
    }

    fn record_claim(
        &self,
        k: &Key,
        who: &str,
        t_call: i64,
        t_ret: i64,
        r: &dedupe_core::Result<ClaimOutcome>,
    ) {
        self.push(k, who, t_call, t_ret, Op::Claim(Ans::of_result(r)));
    }

    fn record_many(
        &self,
        keys: &[Key],
        who: &str,
        t_call: i64,
        t_ret: i64,
        o: &ClaimOptions,
        r: &dedupe_core::Result<Vec<ClaimOutcome>>,
    ) {
        match r {
            Ok(answers) if answers.len() == keys.len() => {
                for (k, a) in keys.iter().zip(answers) {
                    self.push(k, who, t_call, t_ret, Op::Claim(Ans::of(a)));
                }
                self.check_repeats(who, keys, answers, o);
            }
            Ok(answers) => {
                self.flag(format!(
                    "{who}: claim_many of {} keys answered {} answers",
                    keys.len(),
                    answers.len()
                ));
            }
            Err(e) => {
                let a = Ans::of_err(e);
                let mut seen = HashSet::new();
                for k in keys {
                    if seen.insert(k.clone()) {
                        self.push(k, who, t_call, t_ret, Op::Claim(a.clone()));
                    }
                }
            }
        }
    }

    /// A key twice in one batch: the second place answers what a claim right
    /// after the first would (the contract's `claim_many` row).
    fn check_repeats(&self, who: &str, keys: &[Key], answers: &[ClaimOutcome], o: &ClaimOptions) {
        let mut first: HashMap<&Key, &ClaimOutcome> = HashMap::new();
        for (k, a) in keys.iter().zip(answers) {
            match first.get(k) {
                None => {
                    first.insert(k, a);
                }
                Some(f) => {
                    let expected = match (*f, &o.claim_id) {
                        (ClaimOutcome::Claimed(l), None) => ClaimOutcome::InFlight {
                            deadline: l.deadline,
                            attempt: l.attempt,
                        },
                        (other, _) => other.clone(),
                    };
                    if *a != expected {
                        self.flag(format!(
                            "{who}: claim_many answered {k} twice in one batch: first {f:?}, then {a:?}; \
                             a claim right after the first would see {expected:?}"
                        ));
                    }
                }
            }
        }
    }

    async fn claim<S: DedupeStore + ?Sized>(
        &self,
        s: &S,
        who: &str,
        k: &Key,
        o: &ClaimOptions,
    ) -> dedupe_core::Result<ClaimOutcome> {
        let t_call = now_us();
        let r = s.claim(k, o).await;
        self.record_claim(k, who, t_call, now_us(), &r);
        r
    }

    async fn claim_many<S: DedupeStore + ?Sized>(
        &self,
        s: &S,
        who: &str,
        keys: &[Key],
        o: &ClaimOptions,
    ) -> dedupe_core::Result<Vec<ClaimOutcome>> {
        let t_call = now_us();
        let r = s.claim_many(keys, o).await;
        self.record_many(keys, who, t_call, now_us(), o, &r);
        r
    }

    async fn complete<S: DedupeStore + ?Sized>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
        outcome: &[u8],
    ) -> dedupe_core::Result<()> {
        let t_call = now_us();
        let r = s.complete(l, outcome, RETAIN).await;
        let op = Op::Complete {
            token: l.token.as_str().to_string(),
            outcome: outcome.to_vec(),
            res: Res::of(&r),
        };
        self.push(&l.key, who, t_call, now_us(), op);
        r
    }

    async fn release<S: DedupeStore + ?Sized>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
    ) -> dedupe_core::Result<()> {
        let t_call = now_us();
        let r = s.release(l).await;
        let op = Op::Release {
            token: l.token.as_str().to_string(),
            res: Res::of(&r),
        };
        self.push(&l.key, who, t_call, now_us(), op);
        r
    }

    async fn extend<S: DedupeStore + ?Sized>(
        &self,
        s: &S,
        who: &str,
        l: &Lease,
        ttl: Duration,
    ) -> dedupe_core::Result<Lease> {
        let t_call = now_us();
        let r = s.extend(l, ttl).await;
        let op = Op::Extend {
            token: l.token.as_str().to_string(),
            res: Res::of(&r),
            deadline: r.as_ref().map(|l| us(l.deadline)).unwrap_or(0),
        };
        self.push(&l.key, who, t_call, now_us(), op);
        r
    }
}

#[derive(Clone, Copy, Debug)]
struct CheckOpts {
    /// Every InFlight answer must show a lease some successful claim was
    /// answered (skipped on keys where a call's effect is unknown).
    strict_inflight: bool,
    /// On keys never released, the winners' attempts are 1, 2, 3... each once.
    distinct_attempts: bool,
}

/// One winning lease, as the history shows it.
#[derive(Clone, Debug)]
struct Win {
    token: String,
    attempt: u32,
    who: String,
    deadline0: i64,
    first_ret: i64,
    /// Earliest call of a claim answered with this lease.
    start_lo: i64,
    /// Earliest return of such a claim: the lease existed by then.
    start_hi: i64,
    /// Every deadline this lease was shown with (answers and extends).
    deadlines: HashSet<i64>,
    completed: Option<(i64, i64)>,
    released: Option<(i64, i64)>,
    final_deadline: i64,
    /// The earliest instant the lease can have stopped holding the key.
    end_lo: i64,
}

fn ms(t: i64) -> String {
    format!("{}.{:03}", (t / 1000) % 1_000_000, (t % 1000).abs())
}

fn describe(w: &Win) -> String {
    format!(
        "lease {}.. (attempt {}, by {}, claimed within [{} ms, {} ms], deadline {} ms, {})",
        &w.token[..w.token.len().min(8)],
        w.attempt,
        w.who,
        ms(w.start_lo),
        ms(w.start_hi),
        ms(w.final_deadline),
        match (w.completed, w.released) {
            (Some((c, _)), _) => format!("completed at {} ms", ms(c)),
            (_, Some((r, _))) => format!("released at {} ms", ms(r)),
            _ => "never completed nor released".to_string(),
        }
    )
}

fn check(evs: &[Ev], o: CheckOpts) -> Vec<String> {
    let mut by_key: BTreeMap<&str, Vec<&Ev>> = BTreeMap::new();
    for e in evs {
        by_key.entry(e.key.as_str()).or_default().push(e);
    }
    let mut bad = Vec::new();
    for (k, es) in &by_key {
        check_key(k, es, o, &mut bad);
    }
    bad
}

#[allow(clippy::too_many_lines)]
fn check_key(key: &str, es: &[&Ev], o: CheckOpts, bad: &mut Vec<String>) {
    let mut unknown = 0usize;
    let mut wins: BTreeMap<String, Win> = BTreeMap::new();
    for e in es {
        match &e.op {
            Op::Claim(Ans::Claimed {
                token,
                attempt,
                deadline,
            }) => {
                let w = wins.entry(token.clone()).or_insert_with(|| Win {
                    token: token.clone(),
                    attempt: *attempt,
                    who: e.who.clone(),
                    deadline0: *deadline,
                    first_ret: e.t_ret,
                    start_lo: e.t_call,
                    start_hi: e.t_ret,
                    deadlines: HashSet::new(),
                    completed: None,
                    released: None,
                    final_deadline: *deadline,
                    end_lo: 0,
                });
                if w.attempt != *attempt {
                    bad.push(format!(
                        "{key}: one token answered with attempts {} and {attempt}",
                        w.attempt
                    ));
                }
                w.deadlines.insert(*deadline);
                w.start_lo = w.start_lo.min(e.t_call);
                if e.t_ret < w.first_ret {
                    w.first_ret = e.t_ret;
                    w.deadline0 = *deadline;
                    w.who = e.who.clone();
                }
                w.start_hi = w.start_hi.min(e.t_ret);
            }
            Op::Claim(Ans::Err {
                definite: false, ..
            }) => unknown += 1,
            Op::Complete {
                res: Res::Err(_), ..
            }
            | Op::Release {
                res: Res::Err(_), ..
            }
            | Op::Extend {
                res: Res::Err(_), ..
            } => unknown += 1,
            _ => {}
        }
    }

    // Each lease's life: how it ended, and whether its holder acted in time.
    for w in wins.values_mut() {
        let tok = w.token.clone();
        let mut ext: Vec<(i64, i64, i64)> = Vec::new();
        let mut comp_ok: Vec<(i64, i64)> = Vec::new();
        let mut rel_ok: Vec<(i64, i64)> = Vec::new();
        // Releases whose effect is unknown (an error, a dropped call): the
        // lease may have ended at their call.
        let mut rel_unknown: Vec<i64> = Vec::new();
        for e in es {
            match &e.op {
                Op::Complete {
                    token,
                    res: Res::Ok,
                    ..
                } if *token == tok => comp_ok.push((e.t_call, e.t_ret)),
                Op::Release {
                    token,
                    res: Res::Ok,
                } if *token == tok => rel_ok.push((e.t_call, e.t_ret)),
                Op::Release {
                    token,
                    res: Res::Err(_),
                } if *token == tok => rel_unknown.push(e.t_call),
                Op::Extend {
                    token,
                    res: Res::Ok,
                    deadline,
                } if *token == tok => ext.push((e.t_call, e.t_ret, *deadline)),
                _ => {}
            }
        }
        ext.sort_unstable();
        comp_ok.sort_unstable();
        rel_ok.sort_unstable();
        for x in &ext {
            w.deadlines.insert(x.2);
        }
        if comp_ok.len() > 1 {
            bad.push(format!(
                "{key}: lease of attempt {} completed {} times (a done record must answer LeaseLost)",
                w.attempt,
                comp_ok.len()
            ));
        }
        if rel_ok.len() > 1 {
            bad.push(format!(
                "{key}: lease of attempt {} released {} times",
                w.attempt,
                rel_ok.len()
            ));
        }
        if !comp_ok.is_empty() && !rel_ok.is_empty() {
            bad.push(format!(
                "{key}: lease of attempt {} was both completed and released",
                w.attempt
            ));
        }
        w.completed = comp_ok.first().copied();
        w.released = rel_ok.first().copied();
        w.final_deadline = ext.last().map_or(w.deadline0, |x| x.2);
        let d0 = w.deadline0;
        // The deadline in force at `t`, leaving out extend number `skip`.
        let deadline_at = |t: i64, skip: Option<usize>| -> i64 {
            let mut d = d0;
            for (i, x) in ext.iter().enumerate() {
                if Some(i) == skip {
                    continue;
                }
                if x.1 <= t {
                    d = x.2;
                } else if x.0 <= t {
                    d = d.max(x.2);
                }
            }
            d
        };
        let mut acts: Vec<(&str, i64, Option<usize>)> = Vec::new();
        acts.extend(comp_ok.iter().map(|c| ("complete", c.0, None)));
        acts.extend(rel_ok.iter().map(|c| ("release", c.0, None)));
        acts.extend(
            ext.iter()
                .enumerate()
                .map(|(i, x)| ("extend", x.0, Some(i))),
        );
        for (what, t, skip) in acts {
            let d = deadline_at(t, skip);
            if t > d + SLACK_US {
                bad.push(format!(
                    "{key}: STALE HOLDER: {what} of the lease of attempt {} succeeded although it was called {:.1} ms after the lease's deadline",
                    w.attempt,
                    (t - d) as f64 / 1000.0
                ));
            }
        }
        w.end_lo = if w.completed.is_some() {
            i64::MAX
        } else if let Some((c, _)) = w.released {
            c
        } else {
            w.final_deadline
        };
        if let Some(t) = rel_unknown.iter().min() {
            w.end_lo = w.end_lo.min(*t);
        }
    }

    let ws: Vec<&Win> = wins.values().collect();
    // Rule 1: two leases of one key never hold it at once.
    for i in 0..ws.len() {
        for j in (i + 1)..ws.len() {
            let (a, b) = (ws[i], ws[j]);
            let a_then_b = a.end_lo <= b.start_hi.saturating_add(SLACK_US);
            let b_then_a = b.end_lo <= a.start_hi.saturating_add(SLACK_US);
            if !a_then_b && !b_then_a {
                bad.push(format!(
                    "{key}: DOUBLE WINNER: {} and {} both held the key at once",
                    describe(a),
                    describe(b)
                ));
            }
        }
    }
    if o.distinct_attempts && ws.iter().all(|w| w.released.is_none()) {
        let mut seen: HashMap<u32, &str> = HashMap::new();
        for w in &ws {
            if let Some(other) = seen.insert(w.attempt, &w.who) {
                bad.push(format!(
                    "{key}: two winners ({other} and {}) were both answered attempt {}",
                    w.who, w.attempt
                ));
            }
        }
        if unknown == 0 {
            let mut at: Vec<u32> = ws.iter().map(|w| w.attempt).collect();
            at.sort_unstable();
            let want: Vec<u32> = (1..=u32::try_from(at.len()).unwrap_or(u32::MAX)).collect();
            if at != want {
                bad.push(format!(
                    "{key}: the winners' attempts are {at:?}, not 1, 2, 3... (takeovers count one each)"
                ));
            }
        }
    }

    // Completions and the outcomes duplicates carry.
    let completes: Vec<(&Ev, &String, &Vec<u8>, &Res)> = es
        .iter()
        .copied()
        .filter_map(|e| match &e.op {
            Op::Complete {
                token,
                outcome,
                res,
            } => Some((e, token, outcome, res)),
            _ => None,
        })
        .collect();
    let ok_tokens: HashSet<&String> = completes
        .iter()
        .filter(|c| *c.3 == Res::Ok)
        .map(|c| c.1)
        .collect();
    if ok_tokens.len() > 1 {
        bad.push(format!(
            "{key}: PROCESSED TWICE: {} different leases completed it",
            ok_tokens.len()
        ));
    }
    let done = completes
        .iter()
        .filter(|c| *c.3 == Res::Ok)
        .min_by_key(|c| c.0.t_ret)
        .map(|c| (c.0, c.2));
    let maybe: HashSet<&Vec<u8>> = completes
        .iter()
        .filter(|c| matches!(c.3, Res::Err(_)))
        .map(|c| c.2)
        .collect();
    let refused: HashSet<&Vec<u8>> = completes
        .iter()
        .filter(|c| *c.3 == Res::Lost)
        .map(|c| c.2)
        .collect();
    for e in es {
        if let Op::Claim(Ans::Duplicate { outcome }) = &e.op {
            match done {
                Some((c, out)) => {
                    if outcome != out && !maybe.contains(outcome) {
                        bad.push(format!(
                            "{key}: LOST/WRONG OUTCOME: {} was answered Duplicate with {:?}, but the completion wrote {:?}",
                            e.who,
                            String::from_utf8_lossy(outcome),
                            String::from_utf8_lossy(out)
                        ));
                    }
                    if e.t_ret < c.t_call {
                        bad.push(format!(
                            "{key}: {} was answered Duplicate before the completion was even called",
                            e.who
                        ));
                    }
                }
                None if !maybe.contains(outcome) => bad.push(format!(
                    "{key}: {} was answered Duplicate with {:?}, which no successful completion wrote{}",
                    e.who,
                    String::from_utf8_lossy(outcome),
                    if refused.contains(outcome) {
                        " (its complete answered LeaseLost, yet changed the record)"
                    } else {
                        ""
                    }
                )),
                None => {}
            }
        }
    }
    if let Some((c, _)) = done {
        for e in es {
            if let Op::Claim(a @ (Ans::Claimed { .. } | Ans::InFlight { .. })) = &e.op {
                if e.t_call > c.t_ret {
                    bad.push(format!(
                        "{key}: DUPLICATE NOT RECOGNISED: {} was answered {a:?} {:.1} ms after a completion returned Ok",
                        e.who,
                        (e.t_call - c.t_ret) as f64 / 1000.0
                    ));
                }
            }
        }
    }

    // Stale or phantom answers: an InFlight or re-entrant Claimed must show a
    // lease that held the key at some instant of the call.
    let stale = |w: &Win, t_call: i64, dl: i64| -> Option<String> {
        if dl.saturating_add(SLACK_US) < t_call {
            return Some(format!(
                "its deadline had passed {:.1} ms before the call",
                (t_call - dl) as f64 / 1000.0
            ));
        }
        if let Some((_, r)) = w.released {
            if r < t_call {
                return Some("its release had already returned".into());
            }
        }
        if let Some((_, r)) = w.completed {
            if r < t_call {
                return Some("its completion had already returned".into());
            }
        }
        for w2 in &ws {
            if w2.token != w.token && w2.start_lo > w.start_hi && w2.start_hi < t_call {
                return Some(format!(
                    "a later winner (attempt {}, {}) had already been answered",
                    w2.attempt, w2.who
                ));
            }
        }
        None
    };
    for e in es {
        match &e.op {
            Op::Claim(Ans::InFlight { attempt, deadline }) => {
                let cands: Vec<&Win> = ws
                    .iter()
                    .filter(|w| w.attempt == *attempt && w.deadlines.contains(deadline))
                    .copied()
                    .collect();
                if cands.is_empty() {
                    if o.strict_inflight && unknown == 0 {
                        bad.push(format!(
                            "{key}: PHANTOM InFlight: {} was answered InFlight (attempt {attempt}, deadline {} ms) at [{} ms, {} ms] for a lease no successful claim was ever answered",
                            e.who,
                            ms(*deadline),
                            ms(e.t_call),
                            ms(e.t_ret)
                        ));
                    }
                } else {
                    let reasons: Vec<String> = cands
                        .iter()
                        .filter_map(|w| stale(w, e.t_call, *deadline))
                        .collect();
                    if reasons.len() == cands.len() {
                        bad.push(format!(
                            "{key}: STALE InFlight: {} was answered InFlight on attempt {attempt} but {}",
                            e.who, reasons[0]
                        ));
                    }
                }
            }
            Op::Claim(Ans::Claimed {
                token, deadline, ..
            }) => {
                if let Some(w) = wins.get(token) {
                    if e.t_call > w.start_hi {
                        if let Some(why) = stale(w, e.t_call, *deadline) {
                            bad.push(format!(
                                "{key}: {} was handed back lease of attempt {} (same claim id) but {why}",
                                e.who, w.attempt
                            ));
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// Runs the checker over a log and panics with the first violations found.
fn assert_history(what: &str, log: &Log, o: CheckOpts) {
    let evs = log.events();
    let mut bad = log.flags();
    bad.extend(check(&evs, o));
    assert!(
        bad.is_empty(),
        "{what}: {} contract violations in a history of {} calls; the first ones:\n  {}",
        bad.len(),
        evs.len(),
        bad.iter()
            .take(25)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// Fails on any error a call answered (none is expected without faults),
/// leaving out the typed refusals of rule 8 (tests check those themselves).
fn assert_no_errors(what: &str, log: &Log) {
    let errors: Vec<String> = log
        .events()
        .iter()
        .filter_map(|e| match &e.op {
            Op::Claim(Ans::Err {
                text,
                definite: false,
            }) => Some(format!("{} claim {}: {text}", e.who, e.key)),
            Op::Complete {
                res: Res::Err(t), ..
            } => Some(format!("{} complete {}: {t}", e.who, e.key)),
            Op::Release {
                res: Res::Err(t), ..
            } => Some(format!("{} release {}: {t}", e.who, e.key)),
            Op::Extend {
                res: Res::Err(t), ..
            } => Some(format!("{} extend {}: {t}", e.who, e.key)),
            _ => None,
        })
        .collect();
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

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

// ======================================================================
// Store-agnostic attacks (identical in both files), run on several handles.
// ======================================================================

fn expect_lease(
    r: dedupe_core::Result<ClaimOutcome>,
    what: &str,
    bad: &mut Vec<String>,
) -> Option<Lease> {
    match r {
        Ok(ClaimOutcome::Claimed(l)) => Some(l),
        other => {
            bad.push(format!("{what}: expected Claimed, got {other:?}"));
            None
        }
    }
}

fn expect_lost<T: std::fmt::Debug>(r: dedupe_core::Result<T>, what: &str, bad: &mut Vec<String>) {
    if !matches!(r, Err(Error::LeaseLost { .. })) {
        bad.push(format!(
            "STALE HOLDER: {what}: expected LeaseLost, got {r:?}"
        ));
    }
}

/// Rule 4 and the `extend`/`complete` rows, one handle acting and another
/// watching: extend counts from now (it can shorten a lease), a stale holder
/// is fenced after a takeover and after a lapse nobody took over, a late
/// complete changes nothing, claim ids hand back the exact stored lease,
/// fingerprints mismatch whatever the claim id, and refused input writes
/// nothing.
#[allow(clippy::too_many_lines)]
async fn lease_rules(st: &[Arc<dyn DedupeStore>], ns: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let n = st.len();
    let a: &dyn DedupeStore = &*st[0];
    let b: &dyn DedupeStore = &*st[1 % n];

    // 1. extend shortens; the takeover after the shorter deadline wins and
    //    the old holder is fenced whatever copy of its lease it uses.
    let k = key(ns, "shrink");
    if let Some(l) = expect_lease(
        a.claim(&k, &opts(LONG)).await,
        "claim of a fresh key",
        &mut bad,
    ) {
        let seen0 = a.get(&k).await.ok().flatten().map(|r| r.first_seen);
        match a.extend(&l, Duration::from_millis(150)).await {
            Ok(l2) => {
                if l2.deadline >= l.deadline {
                    bad.push(format!(
                        "extend(150 ms) of a 20 s lease answered deadline {:?}, not before the old {:?}: the deadline must become now + ttl",
                        l2.deadline, l.deadline
                    ));
                }
                if l2.token != l.token || l2.attempt != l.attempt || l2.key != l.key {
                    bad.push(format!(
                        "extend changed the lease's identity: {l:?} -> {l2:?}"
                    ));
                }
                sleep_until_us(us(l2.deadline) + 20_000).await;
                match b.claim(&k, &opts(LONG)).await {
                    Ok(ClaimOutcome::Claimed(l3)) => {
                        if l3.attempt != 2 {
                            bad.push(format!(
                                "a takeover of an expired lease answered attempt {} (expected 2)",
                                l3.attempt
                            ));
                        }
                        if l3.token == l.token {
                            bad.push("a takeover was handed the old token".into());
                        }
                        for old in [&l, &l2] {
                            expect_lost(
                                a.complete(old, b"stale", RETAIN).await,
                                "complete by a holder whose lease was taken over",
                                &mut bad,
                            );
                            expect_lost(
                                a.extend(old, LONG).await,
                                "extend by a holder whose lease was taken over",
                                &mut bad,
                            );
                            expect_lost(
                                a.release(old).await,
                                "release by a holder whose lease was taken over",
                                &mut bad,
                            );
                        }
                        match a.get(&k).await {
                            Ok(Some(rec)) => {
                                if rec.token != l3.token
                                    || rec.attempts != 2
                                    || !matches!(rec.state, RecordState::InFlight { .. })
                                {
                                    bad.push(format!(
                                        "after a stale holder's refused calls the record is {rec:?}, not the taker's lease {l3:?}"
                                    ));
                                }
                                if Some(rec.first_seen) != seen0 {
                                    bad.push(format!(
                                        "a takeover changed first_seen: {seen0:?} -> {:?}",
                                        rec.first_seen
                                    ));
                                }
                            }
                            other => bad.push(format!("get after a takeover answered {other:?}")),
                        }
                        if let Err(e) = a.complete(&l3, b"taken-over", RETAIN).await {
                            bad.push(format!("the taker could not complete its live lease: {e}"));
                        }
                        match b.claim(&k, &opts(LONG)).await {
                            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"taken-over" => {}
                            other => bad.push(format!(
                                "a claim after the taker completed answered {other:?}"
                            )),
                        }
                    }
                    other => bad.push(format!(
                        "a claim made 20 ms after a lease shortened by extend(150 ms) had passed answered {other:?}: \
                         extend must set the deadline to now + ttl"
                    )),
                }
            }
            Err(e) => bad.push(format!("extend of a live lease failed: {e}")),
        }
    }

    // 2. A lease that lapsed with nobody taking over: every late call is
    //    refused and changes nothing, and the next claim is a takeover.
    let k = key(ns, "lapsed");
    if let Some(l) = expect_lease(
        a.claim(&k, &opts(Duration::from_millis(100))).await,
        "claim (100 ms)",
        &mut bad,
    ) {
        let seen0 = a.get(&k).await.ok().flatten().map(|r| r.first_seen);
        sleep_until_us(us(l.deadline) + 20_000).await;
        if let Ok(Some(rec)) = b.get(&k).await {
            bad.push(format!(
                "EXPIRY NOT LOGICAL: get answered a record 20 ms after its lease passed: {rec:?}"
            ));
        }
        expect_lost(
            a.complete(&l, b"late", RETAIN).await,
            "complete 20 ms after the lease passed (nobody took over)",
            &mut bad,
        );
        expect_lost(
            a.extend(&l, LONG).await,
            "extend 20 ms after the lease passed",
            &mut bad,
        );
        expect_lost(
            a.release(&l).await,
            "release 20 ms after the lease passed",
            &mut bad,
        );
        match b.claim(&k, &opts(LONG)).await {
            Ok(ClaimOutcome::Claimed(l2)) => {
                if l2.attempt != 2 {
                    bad.push(format!(
                        "the claim after a lapsed lease answered attempt {} (expected 2)",
                        l2.attempt
                    ));
                }
                if let Ok(Some(rec)) = b.get(&k).await {
                    if Some(rec.first_seen) != seen0 {
                        bad.push("a takeover of a lapsed lease changed first_seen".into());
                    }
                }
            }
            other => bad.push(format!(
                "a claim after a lapsed lease answered {other:?} (a refused late complete must change nothing)"
            )),
        }
    }

    // 3. A done record whose retention passed starts over at attempt 1.
    let k = key(ns, "retained");
    if let Some(l) = expect_lease(a.claim(&k, &opts(LONG)).await, "claim", &mut bad) {
        let t_done = SystemTime::now();
        match a.complete(&l, b"short", Duration::from_millis(120)).await {
            Err(e) => bad.push(format!("complete failed: {e}")),
            Ok(()) => {
                match b.claim(&k, &opts(LONG)).await {
                    Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"short" => {}
                    other => bad.push(format!("a claim of a done record answered {other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                match b.claim(&k, &opts(LONG)).await {
                    Ok(ClaimOutcome::Claimed(l2)) => {
                        if l2.attempt != 1 {
                            bad.push(format!(
                                "a claim after a done record's retention passed answered attempt {} (expected 1)",
                                l2.attempt
                            ));
                        }
                        if let Ok(Some(rec)) = b.get(&k).await {
                            if rec.first_seen < t_done {
                                bad.push("a claim after retention kept the old first_seen".into());
                            }
                        }
                    }
                    other => bad.push(format!(
                        "a claim 80 ms after a done record's retention passed answered {other:?}"
                    )),
                }
            }
        }
    }

    // 4. Release, then the next delivery claims it afresh.
    let k = key(ns, "released");
    if let Some(l) = expect_lease(a.claim(&k, &opts(LONG)).await, "claim", &mut bad) {
        if let Err(e) = a.release(&l).await {
            bad.push(format!("release of a live lease failed: {e}"));
        }
        expect_lost(a.release(&l).await, "a second release", &mut bad);
        expect_lost(
            a.complete(&l, b"after release", RETAIN).await,
            "complete after release",
            &mut bad,
        );
        match b.claim(&k, &opts(LONG)).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 1 && l2.token != l.token => {}
            other => bad.push(format!(
                "a claim after release answered {other:?} (expected a new attempt 1)"
            )),
        }
    }

    // 5. Rule 3 on every handle: the same claim id gets the exact stored lease,
    //    by claim and by claim_many, and the extended one after an extend.
    let k = key(ns, "reentrant");
    let o_x = opts(LONG).with_claim_id(cid("cid-X"));
    if let Some(l) = expect_lease(a.claim(&k, &o_x).await, "claim with a claim id", &mut bad) {
        for (i, s) in st.iter().enumerate() {
            match s.claim(&k, &o_x).await {
                Ok(ClaimOutcome::Claimed(again)) if again == l => {}
                other => bad.push(format!(
                    "handle {i}: a claim with the holder's claim id answered {other:?}, not the stored lease {l:?}"
                )),
            }
            match s.claim_many(&[k.clone(), k.clone()], &o_x).await {
                Ok(v) if v.len() == 2 && v.iter().all(|x| *x == ClaimOutcome::Claimed(l.clone())) => {}
                other => bad.push(format!(
                    "handle {i}: claim_many([k, k]) with the holder's claim id answered {other:?}, not the stored lease twice"
                )),
            }
            match s.claim(&k, &o_x.clone().with_fingerprint(fp(9))).await {
                Ok(ClaimOutcome::Claimed(again)) if again == l => {}
                other => bad.push(format!(
                    "handle {i}: a retry with the claim id and a fingerprint (the record has none) answered {other:?}"
                )),
            }
            match s.claim(&k, &opts(LONG).with_claim_id(cid("cid-Y"))).await {
                Ok(ClaimOutcome::InFlight { deadline, attempt })
                    if deadline == l.deadline && attempt == l.attempt => {}
                other => bad.push(format!(
                    "handle {i}: another claim id answered {other:?}, not InFlight on {l:?}"
                )),
            }
        }
        match a.extend(&l, Duration::from_secs(30)).await {
            Ok(l2) => {
                for (i, s) in st.iter().enumerate() {
                    match s.claim(&k, &o_x).await {
                        Ok(ClaimOutcome::Claimed(again)) if again == l2 => {}
                        other => bad.push(format!(
                            "handle {i}: after extend, the holder's claim id answered {other:?}, not the extended lease {l2:?}"
                        )),
                    }
                }
            }
            Err(e) => bad.push(format!("extend failed: {e}")),
        }
    }

    // 6. Fingerprints: Mismatch whatever the claim id; expired means absent.
    let k = key(ns, "mismatch");
    let o_m = opts(LONG)
        .with_fingerprint(fp(1))
        .with_claim_id(cid("cid-M"));
    if let Some(l) = expect_lease(
        a.claim(&k, &o_m).await,
        "claim with a fingerprint",
        &mut bad,
    ) {
        for (what, o) in [
            ("another fingerprint", opts(LONG).with_fingerprint(fp(2))),
            (
                "another fingerprint with the holder's claim id",
                opts(LONG)
                    .with_fingerprint(fp(2))
                    .with_claim_id(cid("cid-M")),
            ),
        ] {
            match b.claim(&k, &o).await {
                Ok(ClaimOutcome::Mismatch {
                    state: RecordStateKind::InFlight,
                }) => {}
                other => bad.push(format!("{what} on an in-flight record answered {other:?}")),
            }
        }
        match b.claim(&k, &opts(LONG)).await {
            Ok(ClaimOutcome::InFlight { .. }) => {}
            other => bad.push(format!("a claim without fingerprint answered {other:?}")),
        }
        if let Err(e) = a.complete(&l, b"fp-done", RETAIN).await {
            bad.push(format!("complete failed: {e}"));
        }
        match b
            .claim_many(&[k.clone(), k.clone()], &opts(LONG).with_fingerprint(fp(2)))
            .await
        {
            Ok(v) if v.len() == 2
                && v.iter().all(|x| matches!(x, ClaimOutcome::Mismatch { state } if *state == RecordStateKind::Done)) => {}
            other => bad.push(format!(
                "claim_many([k, k]) with another fingerprint on a done record answered {other:?}"
            )),
        }
        match b.claim(&k, &opts(LONG).with_fingerprint(fp(1))).await {
            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"fp-done" => {}
            other => bad.push(format!(
                "the same fingerprint on a done record answered {other:?}"
            )),
        }
    }
    let k = key(ns, "mismatch-expired");
    if let Some(l) = expect_lease(
        a.claim(&k, &opts(Duration::from_millis(80)).with_fingerprint(fp(1)))
            .await,
        "claim",
        &mut bad,
    ) {
        sleep_until_us(us(l.deadline) + 20_000).await;
        match b.claim(&k, &opts(LONG).with_fingerprint(fp(2))).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 2 => {}
            other => bad.push(format!(
                "another fingerprint after the lease passed answered {other:?} (an expired record is absent)"
            )),
        }
    }

    // 7. Bad input is refused and writes nothing.
    let k = key(ns, "bad-input");
    match a.claim(&k, &opts(Duration::ZERO)).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => bad.push(format!("a zero lease answered {other:?}")),
    }
    match a.claim(&k, &opts(MAX_TTL + Duration::from_millis(1))).await {
        Err(_) => {}
        other => bad.push(format!("a lease over MAX_TTL answered {other:?}")),
    }
    match a.claim_many(std::slice::from_ref(&k), &opts(Duration::ZERO)).await {
        Err(_) => {}
        other => bad.push(format!("claim_many with a zero lease answered {other:?}")),
    }
    let many: Vec<Key> = (0..=MAX_BATCH_KEYS)
        .map(|i| key(ns, format!("too-many-{i}")))
        .collect();
    match a.claim_many(&many, &opts(LONG)).await {
        Err(Error::BatchTooLarge { .. }) => {}
        other => bad.push(format!(
            "a batch of MAX_BATCH_KEYS + 1 answered {:?}",
            other.map(|v| v.len())
        )),
    }
    for kk in [&k, &many[0], &many[MAX_BATCH_KEYS]] {
        if let Ok(Some(rec)) = b.get(kk).await {
            bad.push(format!("a refused claim wrote a record: {rec:?}"));
        }
    }
    match a.claim_many(&[], &opts(LONG)).await {
        Ok(v) if v.is_empty() => {}
        other => bad.push(format!("an empty batch answered {other:?}")),
    }
    if let Some(l) = expect_lease(a.claim(&k, &opts(LONG)).await, "claim", &mut bad) {
        let max = a.capabilities().max_outcome_bytes;
        match a.complete(&l, &vec![7u8; max + 1], RETAIN).await {
            Err(Error::OutcomeTooLarge { .. }) => {}
            other => bad.push(format!("an outcome over the limit answered {other:?}")),
        }
        match a.complete(&l, b"x", Duration::ZERO).await {
            Err(_) => {}
            other => bad.push(format!("a zero retention answered {other:?}")),
        }
        match a
            .complete(&l, b"x", MAX_TTL + Duration::from_millis(1))
            .await
        {
            Err(_) => {}
            other => bad.push(format!("a retention over MAX_TTL answered {other:?}")),
        }
        match a.extend(&l, Duration::ZERO).await {
            Err(_) => {}
            other => bad.push(format!("extend by zero answered {other:?}")),
        }
        match a.extend(&l, MAX_TTL + Duration::from_millis(1)).await {
            Err(_) => {}
            other => bad.push(format!("extend over MAX_TTL answered {other:?}")),
        }
        match b.get(&k).await {
            Ok(Some(rec))
                if rec.token == l.token
                    && rec.state
                        == RecordState::InFlight {
                            lease_deadline: l.deadline,
                        } => {}
            other => bad.push(format!("refused calls changed the record: {other:?}")),
        }
        if let Err(e) = a.complete(&l, b"fine", RETAIN).await {
            bad.push(format!(
                "the lease no longer completes after refused calls: {e}"
            ));
        }
    }
    let k = key(ns, "max-ttl");
    match a.claim(&k, &opts(MAX_TTL)).await {
        Ok(ClaimOutcome::Claimed(l)) => match a.extend(&l, MAX_TTL).await {
            Ok(l2) => {
                if let Err(e) = a.complete(&l2, b"m", MAX_TTL).await {
                    bad.push(format!("complete with MAX_TTL retention failed: {e}"));
                }
            }
            Err(e) => bad.push(format!("extend by MAX_TTL failed: {e}")),
        },
        other => bad.push(format!("a MAX_TTL lease answered {other:?}")),
    }
    bad
}

/// Holder and takers aimed at the lease's deadline, from -1.5 ms to +1.5 ms:
/// the boundary where `>` against `>=` and clock reads decide. Never both a
/// completion and a takeover; never two takers.
async fn deadline_races(st: &[Arc<dyn DedupeStore>], ns: &str, log: &Log, rounds: usize) {
    for r in 0..rounds {
        let k = key(ns, format!("edge{r}"));
        let holder = Arc::clone(&st[r % st.len()]);
        let l = match log
            .claim(&*holder, "holder", &k, &opts(Duration::from_millis(40)))
            .await
        {
            Ok(ClaimOutcome::Claimed(l)) => l,
            other => {
                log.flag(format!("{k}: a fresh claim answered {other:?}"));
                continue;
            }
        };
        let aim = us(l.deadline) - 1_500 + i64::try_from(r % 7).unwrap_or(0) * 500;
        let mut set = tokio::task::JoinSet::new();
        {
            let (log, holder, l) = (log.clone(), Arc::clone(&holder), l.clone());
            set.spawn(async move {
                sleep_until_us(aim).await;
                let out = format!("holder-{r}").into_bytes();
                match r % 3 {
                    1 => {
                        if let Ok(l2) = log
                            .extend(&*holder, "holder", &l, Duration::from_millis(200))
                            .await
                        {
                            let _ = log.complete(&*holder, "holder", &l2, &out).await;
                        }
                    }
                    2 => {
                        let _ = log.release(&*holder, "holder", &l).await;
                    }
                    _ => {
                        let _ = log.complete(&*holder, "holder", &l, &out).await;
                    }
                }
            });
        }
        for (i, s) in st.iter().enumerate() {
            let (log, s, k) = (log.clone(), Arc::clone(s), k.clone());
            let who = format!("taker{i}");
            set.spawn(async move {
                sleep_until_us(aim + i64::try_from(i % 3).unwrap_or(0) * 400 - 400).await;
                let won = if i % 2 == 0 {
                    log.claim(&*s, &who, &k, &opts(LONG))
                        .await
                        .ok()
                        .and_then(|a| a.lease().cloned())
                } else {
                    log.claim_many(&*s, &who, &[k.clone(), k.clone()], &opts(LONG))
                        .await
                        .ok()
                        .and_then(|v| v.first().and_then(|a| a.lease().cloned()))
                };
                if let Some(l) = won {
                    let out = format!("{who}-{r}").into_bytes();
                    let _ = log.complete(&*s, &who, &l, &out).await;
                }
            });
        }
        while let Some(j) = set.join_next().await {
            if let Err(e) = j {
                log.flag(format!("a racing task panicked: {e}"));
            }
        }
    }
}

/// Rule 2: keys that differ by case, Unicode normalisation, one byte or
/// length are distinct events, claimed concurrently by two handles in
/// opposite orders; each is won exactly once and keeps its own outcome.
async fn exact_keys(st: &[Arc<dyn DedupeStore>], base: &str, log: &Log) {
    let nss = [
        base.to_string(),
        base.to_uppercase(),
        format!("{base}."),
        format!("{base}_"),
        format!("{base}-"),
    ];
    let mut ids: Vec<String> = [
        "evt_1",
        "EVT_1",
        "Evt_1",
        "evt_1 ",
        " evt_1",
        "evt_10",
        "evt_",
        "evt",
        "é",
        "e\u{301}",
        "1",
        "01",
        "1.0",
        "1e0",
        "0x1",
        "+1",
        "%",
        "_",
        "%_",
        "\u{130}",
        "i\u{307}",
        "evt\t1",
        "evt\n1",
        "evt\r\n1",
        "😀",
        "\u{feff}evt_1",
        "evt_1\u{200b}",
        "'; DROP TABLE x; --",
        "sha256:abc",
        "SHA256:abc",
        "a\\b",
        "a/b",
        "a:b",
        "NULL",
        "null",
        " ",
        "\u{a0}",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    ids.push("a".repeat(512));
    ids.push("a".repeat(511));
    ids.push("ä".repeat(256));
    ids.push("ä".repeat(255) + "a");
    let mut keys = Vec::new();
    for ns in &nss[..2] {
        for id in &ids {
            keys.push(key(ns, id.clone()));
        }
    }
    for ns in &nss[2..] {
        keys.push(key(ns, "evt_1"));
        keys.push(key(ns, "EVT_1"));
    }
    let a = Arc::clone(&st[0]);
    let b = Arc::clone(&st[1 % st.len()]);
    let rev: Vec<Key> = keys.iter().rev().cloned().collect();
    let o = opts(LONG);
    let (ra, rb) = tokio::join!(
        log.claim_many(&*a, "exact-a", &keys, &o),
        log.claim_many(&*b, "exact-b", &rev, &o)
    );
    let mut leases: HashMap<Key, Vec<(Arc<dyn DedupeStore>, Lease)>> = HashMap::new();
    for (s, r) in [(&a, ra), (&b, rb)] {
        match r {
            Ok(v) => {
                for x in v {
                    if let ClaimOutcome::Claimed(l) = x {
                        leases
                            .entry(l.key.clone())
                            .or_default()
                            .push((Arc::clone(s), l));
                    }
                }
            }
            Err(e) => log.flag(format!(
                "a batch of distinct near-identical keys failed: {e}"
            )),
        }
    }
    for (i, k) in keys.iter().enumerate() {
        let n = leases.get(k).map_or(0, Vec::len);
        if n != 1 {
            log.flag(format!(
                "KEYS NOT EXACT: {k:?} was won {n} times by two concurrent batches of distinct keys"
            ));
        }
        if let Some(v) = leases.get(k) {
            for (s, l) in v {
                let mut out = format!("{i}:{k:?}").into_bytes();
                out.extend_from_slice(&[0, 255, 0]);
                let _ = log.complete(&**s, "exact", l, &out).await;
            }
        }
    }
    for (who, s) in [("exact-a", &a), ("exact-b", &b)] {
        for k in &keys {
            let _ = log.claim(&**s, who, k, &opts(LONG)).await;
        }
        let _ = log.claim_many(&**s, who, &rev, &opts(LONG)).await;
    }
}

/// Outcomes come back byte for byte: empty, NULs, every byte value, and
/// exactly the store's limit.
async fn outcomes_round_trip(st: &[Arc<dyn DedupeStore>], ns: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let a: &dyn DedupeStore = &*st[0];
    let b: &dyn DedupeStore = &*st[1 % st.len()];
    let max = a.capabilities().max_outcome_bytes;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let big: Vec<u8> = (0..max).map(|_| (rng.next() >> 24) as u8).collect();
    let cases: Vec<Vec<u8>> = vec![
        Vec::new(),
        vec![0],
        vec![0, 0, 0],
        (0..=255u8).collect(),
        vec![0xff; 3],
        b"\xc3\x28 not utf-8 \xff\xfe".to_vec(),
        big[..max - 1].to_vec(),
        big,
    ];
    for (i, out) in cases.iter().enumerate() {
        let k = key(ns, format!("outcome-{i}"));
        let Some(l) = expect_lease(a.claim(&k, &opts(LONG)).await, "claim", &mut bad) else {
            continue;
        };
        if let Err(e) = a.complete(&l, out, RETAIN).await {
            bad.push(format!(
                "an outcome of {} bytes was refused: {e}",
                out.len()
            ));
            continue;
        }
        match b.claim(&k, &opts(LONG)).await {
            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == *out => {}
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => bad.push(format!(
                "LOST OUTCOME: an outcome of {} bytes came back as {} different bytes",
                out.len(),
                outcome.len()
            )),
            other => bad.push(format!(
                "a claim of a record done with {} outcome bytes answered {:?}",
                out.len(),
                other.map(|o| o.kind())
            )),
        }
        match b.get(&k).await {
            Ok(Some(rec)) => match rec.state {
                RecordState::Done { outcome, .. } if outcome == *out => {}
                other => bad.push(format!(
                    "get of a record done with {} bytes shows {:?}",
                    out.len(),
                    std::mem::discriminant(&other)
                )),
            },
            other => bad.push(format!(
                "get of a done record answered {:?}",
                other.map(|r| r.is_some())
            )),
        }
    }
    bad
}

/// The contract's `claim_many` row, at the edge where a batch outlasts its own
/// lease: the second place of a key answers what a claim right after the first
/// would (InFlight on the first place's lease, or that same lease again with a
/// claim id), never a second `Claimed`. The reference store answers so.
async fn key_twice_in_a_long_batch(s: &dyn DedupeStore, ns: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for (ttl_ms, filler, with_cid) in [
        (2u64, 3_000usize, false),
        (2, 3_000, true),
        (50, MAX_BATCH_KEYS - 2, false),
        (50, MAX_BATCH_KEYS - 2, true),
    ] {
        let tag = format!("{ttl_ms}-{with_cid}");
        let k = key(ns, format!("twice-{tag}"));
        let mut keys = vec![k.clone()];
        keys.extend((0..filler).map(|i| key(ns, format!("filler-{tag}-{i}"))));
        keys.push(k.clone());
        let mut o = opts(Duration::from_millis(ttl_ms));
        if with_cid {
            o = o.with_claim_id(cid("twice-cid"));
        }
        let started = Instant::now();
        let answers = match s.claim_many(&keys, &o).await {
            Ok(v) => v,
            Err(e) => {
                bad.push(format!("a batch of {} keys failed: {e}", keys.len()));
                continue;
            }
        };
        let took = started.elapsed();
        let (Some(first), Some(last)) = (answers.first(), answers.last()) else {
            bad.push("a batch answered nothing".into());
            continue;
        };
        let ClaimOutcome::Claimed(l0) = first else {
            bad.push(format!("a fresh key answered {first:?}"));
            continue;
        };
        let expected = if with_cid {
            ClaimOutcome::Claimed(l0.clone())
        } else {
            ClaimOutcome::InFlight {
                deadline: l0.deadline,
                attempt: l0.attempt,
            }
        };
        if *last != expected {
            bad.push(format!(
                "BATCH REPEAT WON TWICE: lease {ttl_ms} ms, claim id {with_cid}, batch of {} keys taking {took:?}: \
                 the key's first place answered {first:?} and its second place {last:?}; \
                 the contract (and MemoryStore) answer the second place {expected:?}",
                keys.len()
            ));
        }
    }
    bad
}

// ---------- differential: claim_many against claim, and against MemoryStore ----------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Absent,
    LiveA,
    LiveNone,
    DoneF1,
    DoneNone,
    ExpiredA,
    ExpiredDone,
}

const STATES: [St; 7] = [
    St::Absent,
    St::LiveA,
    St::LiveNone,
    St::DoneF1,
    St::DoneNone,
    St::ExpiredA,
    St::ExpiredDone,
];

const EXPIRING: Duration = Duration::from_millis(150);

#[derive(Clone, Debug)]
struct Scn {
    states: Vec<St>,
    batch: Vec<usize>,
    cid: Option<&'static str>,
    fp: Option<u8>,
}

fn scenarios(seed: u64, n: usize, keys: usize) -> Vec<Scn> {
    let mut rng = Rng(seed | 1);
    (0..n)
        .map(|_| {
            let states: Vec<St> = (0..keys)
                .map(|_| STATES[usize::try_from(rng.below(7)).unwrap_or(0)])
                .collect();
            let len = 1 + usize::try_from(rng.below(24)).unwrap_or(0);
            let batch = (0..len)
                .map(|_| usize::try_from(rng.below(keys as u64)).unwrap_or(0))
                .collect();
            let cid =
                [None, Some("cid-A"), Some("cid-B")][usize::try_from(rng.below(3)).unwrap_or(0)];
            let fp = [None, Some(1u8), Some(2u8)][usize::try_from(rng.below(3)).unwrap_or(0)];
            Scn {
                states,
                batch,
                cid,
                fp,
            }
        })
        .collect()
}

/// One way of answering a batch: a store, whether it is asked with one
/// `claim_many` or a `claim` per place, and how its handle is warmed first
/// (`Some(true)`: a storm of duplicates; `Some(false)`: a run of new keys).
struct Role {
    name: String,
    store: Arc<dyn DedupeStore>,
    many: bool,
    warm: Option<bool>,
}

async fn setup_scn(s: &dyn DedupeStore, ns: &str, sc: &Scn) -> Vec<Option<Lease>> {
    let mut leases = Vec::new();
    for (i, st) in sc.states.iter().enumerate() {
        let k = key(ns, format!("k{i}"));
        let claimed = |r: dedupe_core::Result<ClaimOutcome>| match r {
            Ok(ClaimOutcome::Claimed(l)) => l,
            other => panic!("setup claim of {k:?} answered {other:?}"),
        };
        let out = format!("out-{i}").into_bytes();
        leases.push(match st {
            St::Absent => None,
            St::LiveA => Some(claimed(
                s.claim(
                    &k,
                    &opts(LONG)
                        .with_claim_id(cid("cid-A"))
                        .with_fingerprint(fp(1)),
                )
                .await,
            )),
            St::LiveNone => Some(claimed(s.claim(&k, &opts(LONG)).await)),
            St::DoneF1 => {
                let l = claimed(s.claim(&k, &opts(LONG).with_fingerprint(fp(1))).await);
                s.complete(&l, &out, RETAIN).await.expect("setup complete");
                None
            }
            St::DoneNone => {
                let l = claimed(s.claim(&k, &opts(LONG)).await);
                s.complete(&l, &out, RETAIN).await.expect("setup complete");
                None
            }
            St::ExpiredA => Some(claimed(
                s.claim(&k, &opts(EXPIRING).with_claim_id(cid("cid-A")))
                    .await,
            )),
            St::ExpiredDone => {
                let l = claimed(s.claim(&k, &opts(LONG)).await);
                s.complete(&l, &out, EXPIRING)
                    .await
                    .expect("setup complete");
                None
            }
        });
    }
    leases
}

fn scn_opts(sc: &Scn) -> ClaimOptions {
    let mut o = opts(LONG);
    if let Some(c) = sc.cid {
        o = o.with_claim_id(cid(c));
    }
    if let Some(f) = sc.fp {
        o = o.with_fingerprint(fp(f));
    }
    o
}

/// The first earlier place of the same key whose `Claimed` lease satisfies `pred`.
fn earlier_place(
    answers: &[ClaimOutcome],
    batch: &[usize],
    pos: usize,
    pred: impl Fn(&Lease) -> bool,
) -> Option<usize> {
    let slot = batch[pos];
    answers[..pos]
        .iter()
        .enumerate()
        .find_map(|(p, b)| match b {
            ClaimOutcome::Claimed(l) if batch[p] == slot && pred(l) => Some(p),
            _ => None,
        })
}

/// Each answer in words that do not depend on which store or handle gave it.
fn normalize(sc: &Scn, setup: &[Option<Lease>], answers: &[ClaimOutcome]) -> Vec<String> {
    let mut out = Vec::new();
    for (pos, a) in answers.iter().enumerate() {
        let s: Option<&Lease> = setup[sc.batch[pos]].as_ref();
        out.push(match a {
            ClaimOutcome::Claimed(l) => {
                let tok = if s.is_some_and(|s| s.token == l.token) {
                    "the setup's token".to_string()
                } else if let Some(p) =
                    earlier_place(answers, &sc.batch, pos, |e: &Lease| e.token == l.token)
                {
                    format!("place {p}'s token")
                } else {
                    "a new token".to_string()
                };
                let dl = if s.is_some_and(|s| s.deadline == l.deadline) {
                    "the setup's deadline".to_string()
                } else if let Some(p) = earlier_place(answers, &sc.batch, pos, |e: &Lease| {
                    e.deadline == l.deadline
                }) {
                    format!("place {p}'s deadline")
                } else {
                    "a new deadline".to_string()
                };
                format!(
                    "Claimed(attempt {}, claim id {:?}, {tok}, {dl})",
                    l.attempt,
                    l.claim_id.as_ref().map(|c| c.as_str().to_string())
                )
            }
            ClaimOutcome::InFlight { deadline, attempt } => {
                let dl = if s.is_some_and(|s| s.deadline == *deadline) {
                    "the setup's deadline".to_string()
                } else if let Some(p) =
                    earlier_place(answers, &sc.batch, pos, |e: &Lease| e.deadline == *deadline)
                {
                    format!("place {p}'s deadline")
                } else {
                    "an unknown deadline".to_string()
                };
                format!("InFlight(attempt {attempt}, {dl})")
            }
            ClaimOutcome::Duplicate { outcome, .. } => {
                format!("Duplicate({})", String::from_utf8_lossy(outcome))
            }
            ClaimOutcome::Mismatch { state } => format!("Mismatch({state:?})"),
        });
    }
    out
}

async fn warm(s: &dyn DedupeStore, records: bool, done: &Key, ns: &str, n: &AtomicU64) {
    for _ in 0..9 {
        if records {
            let _ = s.claim(done, &opts(LONG)).await;
        } else {
            let i = n.fetch_add(1, Ordering::Relaxed);
            let _ = s
                .claim(&key(ns, format!("warm{i}")), &opts(Duration::from_secs(1)))
                .await;
        }
    }
}

/// Sets every scenario up once per role (each in a namespace of its own),
/// lets the expiring records expire, then asks every role the same batch and
/// compares every answer with `claim`s on the reference `MemoryStore`.
async fn differential(tag: &str, roles: Vec<Role>, seed: u64, n: usize) -> Vec<String> {
    let mut bad = Vec::new();
    let mem: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let mut roles = roles;
    roles.push(Role {
        name: "MemoryStore claim_many".into(),
        store: Arc::clone(&mem),
        many: true,
        warm: None,
    });
    roles.push(Role {
        name: "MemoryStore claim, place by place (reference)".into(),
        store: mem,
        many: false,
        warm: None,
    });
    let scns = scenarios(seed, n, 10);
    let warm_count = Arc::new(AtomicU64::new(0));
    let done_key = key(&format!("{tag}w"), "done");
    for r in &roles {
        if let Ok(ClaimOutcome::Claimed(l)) = r.store.claim(&done_key, &opts(LONG)).await {
            let _ = r.store.complete(&l, b"warm", RETAIN).await;
        }
    }
    // Setup, every (role, scenario) at once.
    let mut set = tokio::task::JoinSet::new();
    for (ri, r) in roles.iter().enumerate() {
        for (si, sc) in scns.iter().enumerate() {
            let (s, sc, ns) = (Arc::clone(&r.store), sc.clone(), format!("{tag}{ri}s{si}"));
            set.spawn(async move { ((ri, si), setup_scn(&*s, &ns, &sc).await) });
        }
    }
    let mut setups: HashMap<(usize, usize), Vec<Option<Lease>>> = HashMap::new();
    while let Some(j) = set.join_next().await {
        match j {
            Ok((at, leases)) => {
                setups.insert(at, leases);
            }
            Err(e) => bad.push(format!("a scenario's setup failed: {e}")),
        }
    }
    if !bad.is_empty() {
        return bad;
    }
    tokio::time::sleep(EXPIRING * 2).await;
    for (si, sc) in scns.iter().enumerate() {
        let mut answers: Vec<(String, Vec<String>)> = Vec::new();
        for (ri, r) in roles.iter().enumerate() {
            let ns = format!("{tag}{ri}s{si}");
            let keys: Vec<Key> = sc.batch.iter().map(|i| key(&ns, format!("k{i}"))).collect();
            if let Some(records) = r.warm {
                warm(
                    &*r.store,
                    records,
                    &done_key,
                    &format!("{tag}w"),
                    &warm_count,
                )
                .await;
            }
            let o = scn_opts(sc);
            let got = if r.many {
                r.store.claim_many(&keys, &o).await
            } else {
                let mut v = Vec::new();
                let mut failed = None;
                for k in &keys {
                    match r.store.claim(k, &o).await {
                        Ok(a) => v.push(a),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                match failed {
                    Some(e) => Err(e),
                    None => Ok(v),
                }
            };
            match got {
                Ok(v) if v.len() == keys.len() => {
                    answers.push((r.name.clone(), normalize(sc, &setups[&(ri, si)], &v)));
                }
                other => bad.push(format!(
                    "scenario {si} ({sc:?}), {}: answered {:?}",
                    r.name,
                    other.map(|v| v.len())
                )),
            }
        }
        let Some((_, reference)) = answers.last().cloned() else {
            continue;
        };
        for (name, got) in &answers {
            if *got != reference {
                let first = got
                    .iter()
                    .zip(&reference)
                    .position(|(x, y)| x != y)
                    .unwrap_or(0);
                bad.push(format!(
                    "CLAIM_MANY DISAGREES: scenario {si}, states {:?}, batch {:?}, claim id {:?}, fingerprint {:?}: \
                     {name} answered place {first} (key k{}) with {:?} where claims on the reference answer {:?}",
                    sc.states,
                    sc.batch,
                    sc.cid,
                    sc.fp,
                    sc.batch[first],
                    got.get(first),
                    reference.get(first)
                ));
            }
        }
    }
    bad
}

/// Random calls, each under a timeout of 0 to 4 ms, so many futures are
/// dropped half way (queued, mid-statement, between statements). Cancelled
/// calls are recorded as unknown; everything answered must still fit.
async fn cancel_worker(
    log: Log,
    s: Arc<dyn DedupeStore>,
    t: usize,
    ns: String,
    done: Vec<Key>,
    until: Instant,
) {
    let who = format!("cx{t}");
    let mut rng = Rng(0x00C0_FFEE ^ (t as u64 + 1).wrapping_mul(7919));
    let mut held: Vec<Lease> = Vec::new();
    let ttl = Duration::from_millis(150);
    while Instant::now() < until {
        let k = key(&ns, format!("c{}", rng.below(16)));
        let tmo = Duration::from_micros(rng.below(4_000));
        let choice = rng.below(11);
        let t_call = now_us();
        match choice {
            0..=3 => match tokio::time::timeout(tmo, s.claim(&k, &opts(ttl))).await {
                Ok(r) => {
                    log.record_claim(&k, &who, t_call, now_us(), &r);
                    if let Ok(ClaimOutcome::Claimed(l)) = r {
                        held.push(l);
                    }
                }
                Err(_) => log.push(&k, &who, t_call, now_us(), Op::Claim(Ans::cancelled())),
            },
            4 => {
                let keys = vec![
                    k.clone(),
                    key(&ns, format!("c{}", rng.below(16))),
                    k.clone(),
                ];
                let o = opts(ttl);
                match tokio::time::timeout(tmo, s.claim_many(&keys, &o)).await {
                    Ok(r) => {
                        log.record_many(&keys, &who, t_call, now_us(), &o, &r);
                        if let Ok(v) = r {
                            held.extend(v.iter().filter_map(|a| a.lease().cloned()));
                        }
                    }
                    Err(_) => {
                        let mut seen = HashSet::new();
                        for kk in &keys {
                            if seen.insert(kk.clone()) {
                                log.push(kk, &who, t_call, now_us(), Op::Claim(Ans::cancelled()));
                            }
                        }
                    }
                }
            }
            5 => {
                if !done.is_empty() {
                    let d = &done[usize::try_from(rng.below(done.len() as u64)).unwrap_or(0)];
                    match tokio::time::timeout(tmo, s.claim(d, &opts(LONG))).await {
                        Ok(r) => log.record_claim(d, &who, t_call, now_us(), &r),
                        Err(_) => log.push(d, &who, t_call, now_us(), Op::Claim(Ans::cancelled())),
                    }
                }
            }
            6 | 7 => {
                if let Some(l) = held.pop() {
                    let out = format!("{who}-{}", rng.next()).into_bytes();
                    let res = match tokio::time::timeout(tmo, s.complete(&l, &out, RETAIN)).await {
                        Ok(r) => Res::of(&r),
                        Err(_) => Res::Err("cancelled".into()),
                    };
                    let op = Op::Complete {
                        token: l.token.as_str().to_string(),
                        outcome: out,
                        res,
                    };
                    log.push(&l.key, &who, t_call, now_us(), op);
                }
            }
            8 => {
                if let Some(l) = held.pop() {
                    let res = match tokio::time::timeout(tmo, s.release(&l)).await {
                        Ok(r) => Res::of(&r),
                        Err(_) => Res::Err("cancelled".into()),
                    };
                    let op = Op::Release {
                        token: l.token.as_str().to_string(),
                        res,
                    };
                    log.push(&l.key, &who, t_call, now_us(), op);
                }
            }
            _ => {
                if let Some(l) = held.pop() {
                    let (res, deadline, again) =
                        match tokio::time::timeout(tmo, s.extend(&l, ttl)).await {
                            Ok(Ok(l2)) => (Res::Ok, us(l2.deadline), Some(l2)),
                            Ok(Err(e)) => (Res::of::<()>(&Err(e)), 0, None),
                            Err(_) => (Res::Err("cancelled".into()), 0, None),
                        };
                    let op = Op::Extend {
                        token: l.token.as_str().to_string(),
                        res,
                        deadline,
                    };
                    log.push(&l.key, &who, t_call, now_us(), op);
                    held.extend(again);
                }
            }
        }
    }
}

/// After every lease of a cancellation storm has passed: each key is free or
/// done (never still in flight), and every handle still answers at once.
async fn after_the_storm(st: &[Arc<dyn DedupeStore>], ns: &str, log: &Log) {
    tokio::time::sleep(Duration::from_millis(600)).await;
    for i in 0..16 {
        let k = key(ns, format!("c{i}"));
        let s = &st[i % st.len()];
        match log.claim(&**s, "after", &k, &opts(LONG)).await {
            Ok(ClaimOutcome::Claimed(_) | ClaimOutcome::Duplicate { .. }) => {}
            other => log.flag(format!(
                "{k}: 600 ms after every 150 ms lease of the storm had been set, a claim answered {other:?}"
            )),
        }
    }
    for (i, s) in st.iter().enumerate() {
        let k = key(ns, format!("alive{i}"));
        match tokio::time::timeout(Duration::from_secs(5), s.claim(&k, &opts(LONG))).await {
            Ok(Ok(ClaimOutcome::Claimed(_))) => {}
            Ok(other) => log.flag(format!(
                "handle {i} after the storm: a fresh key answered {other:?}"
            )),
            Err(_) => log.flag(format!(
                "HANG: handle {i} did not answer a fresh claim within 5 s after the storm"
            )),
        }
    }
}

/// Plain (non-transactional) claimers racing the transactions on the same
/// keys: a win is completed at once.
async fn plain_claimer(a: usize, s: Arc<dyn DedupeStore>, keys: Arc<Vec<Key>>, log: Log) {
    let who = format!("as{a}");
    for pass in 0..300 {
        let mut open = false;
        for (i, k) in keys.iter().enumerate() {
            if !(i + a + pass).is_multiple_of(5) {
                continue;
            }
            let r = if (i + pass) % 2 == 0 {
                log.claim(&*s, &who, k, &opts(LONG)).await
            } else {
                log.claim_many(&*s, &who, &[k.clone(), k.clone()], &opts(LONG))
                    .await
                    .and_then(|v| {
                        v.into_iter()
                            .next()
                            .ok_or_else(|| Error::backend("an empty answer", false, None))
                    })
            };
            match r {
                Ok(ClaimOutcome::Claimed(l)) => {
                    let out = format!("as|{k}|{who}|{pass}").into_bytes();
                    let _ = log.complete(&*s, &who, &l, &out).await;
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
fn judge_transactions(
    log: &Log,
    keys: &[Key],
    commits: &[(String, String, Vec<u8>)],
    rows: &HashMap<String, i64>,
    stored: &HashMap<String, Option<Vec<u8>>>,
) {
    let evs = log.events();
    for k in keys {
        let ks = k.to_string();
        let tx_wins: Vec<&Vec<u8>> = commits.iter().filter(|c| c.0 == ks).map(|c| &c.2).collect();
        let plain_wins: Vec<&Vec<u8>> = evs
            .iter()
            .filter(|e| e.key == ks && e.who.starts_with("as"))
            .filter_map(|e| match &e.op {
                Op::Complete {
                    outcome,
                    res: Res::Ok,
                    ..
                } => Some(outcome),
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
async fn observe(
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
            if let Ok(ClaimOutcome::Claimed(l)) = log.claim(&*s, &who, k, &op).await {
                mine.insert(k.clone());
                let (log, s, who) = (log.clone(), Arc::clone(&s), who.clone());
                works.spawn(async move {
                    tokio::time::sleep(work).await;
                    let out = format!("{who}-{}", l.key).into_bytes();
                    let _ = log.complete(&*s, &who, &l, &out).await;
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
struct Entry {
    id: usize,
    lease: Option<Lease>,
    first: Option<ClaimOutcome>,
    err: bool,
    t_call: i64,
    t_ret: i64,
}

const MODES: usize = 7;

#[derive(Default)]
struct Board {
    p: [Vec<Entry>; 3],
    /// The completion of phase 0 and of phase 1: outcome, and whether it succeeded.
    done: [Option<(Vec<u8>, bool)>; 2],
    released: bool,
}

fn outcome_for(round: usize, id: usize, phase: usize) -> Vec<u8> {
    let mut v = format!("race|r{round}|t{id}|p{phase}|").into_bytes();
    v.extend_from_slice(&[0, 255, 10, 0]);
    v
}

fn first_winner(p: &[Entry]) -> Option<(usize, Lease)> {
    p.iter()
        .filter_map(|e| e.lease.clone().map(|l| (e.id, l)))
        .min_by_key(|(i, _)| *i)
}

const KINDS: [&str; 4] = [
    "complete",
    "release",
    "lapse then takeover",
    "extend then complete",
];

/// The round's own expectations, on top of the history checker.
fn judge_round(log: &Log, round: usize, kind: usize, b: &Board) {
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
