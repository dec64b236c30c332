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
// The store-agnostic rounds are conformance checks now
// (dedupe-conformance/src/checks/attacks.rs); what is left here serves the
// SQL stores' own rounds (claim modes, group limits, transactions).
// ======================================================================

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
