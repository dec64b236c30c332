//! The history checker: every answer of every worker, with when it was asked and
//! when it was answered, checked against the contract as a whole rather than by
//! end counts. It is the one checker of the suite: the attack rounds, the fault
//! runs of the testkit, `dedupe soak` and the stores' own adversarial tests all
//! record into a [`History`] and are judged by [`History::check`].
//!
//! Workers record each call (the store is used through a [`Recorder`], which
//! records for them; a call whose future is dropped half way is recorded as one
//! whose effect is unknown). [`History::check`] then verifies, per key:
//!
//! 1. **one live holder**: two leases never hold the key at once. A later
//!    winner is valid only once the earlier lease could have ended: passed (as
//!    extended), released, or never, once completed. Each call is judged at the
//!    latest moment the contract allows: a call takes effect somewhere between
//!    being asked and being answered, and clocks may differ by
//!    [`History::tolerance`];
//! 2. **no stale holder**: a `complete` or `extend` that succeeded was asked
//!    before the lease's deadline in force then, and before another claim of
//!    the key had been answered `Claimed` (a `release` answers Ok whenever
//!    nothing live holds the key, so it proves nothing); no lease is completed
//!    with two outcomes, nor both completed and released; one token always
//!    shows one attempt;
//! 3. **one outcome**: per key at most one lease completes, and every
//!    `Duplicate` carries that outcome (never one nobody stored, never before
//!    the completion was even asked);
//! 4. **nothing lost**: no claim is answered `Claimed` or `InFlight` after a
//!    completion of the key was acknowledged, or after a claim was answered
//!    `Duplicate` (the record was done; anything
//!    else means the store lost it, as a server without durable writes does
//!    when it is killed);
//! 5. **a lost lease is no guess**: a call answered `LeaseLost` was answered
//!    after its lease could have passed, been let go, or been taken by
//!    another claim answered `Claimed` (a claim of unknown effect could only
//!    have won once the lease had passed; a store that answers `LeaseLost` for a transport error
//!    makes a caller drop work that may have been stored);
//! 6. **no stale or phantom `InFlight`**: an `InFlight` answer (or a claim id's
//!    `Claimed` handed back) shows a lease that could still hold the key while
//!    the call ran, with a deadline that could have been the one in force (not
//!    one an extend had replaced before the call). With
//!    [`History::every_in_flight_seen`], it must also be a lease some recorded
//!    claim was answered, and a `Mismatch` needs some claim of the key to have
//!    been answered `Claimed`;
//! 7. with [`History::attempts_in_order`]: on keys never released, the winners
//!    are attempts 1, 2, 3... each once.
//!
//! [`recheck_completed`] adds the last word after a fault: every completion
//! that was acknowledged is claimed once more, recorded, and must answer its
//! outcome.
//!
//! Retention must outlast the run (a key completed by two leases is counted as
//! a violation). Errors are recorded too and never count as answers: a call that
//! failed may or may not have taken effect, so the checker assumes the worst
//! only where the contract does (a failed `complete` may have stored its
//! outcome; a refusal of bad input wrote nothing).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, LeaseToken};

/// What one call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `claim` won (or a claim id was handed its lease back).
    Claimed {
        /// The lease token.
        token: LeaseToken,
        /// The lease deadline, on the store's clock.
        deadline: SystemTime,
        /// The attempt the lease reports.
        attempt: u32,
    },
    /// `claim` found the key held by another lease.
    InFlight {
        /// The holder's deadline, as answered.
        deadline: SystemTime,
        /// The holder's attempt, as answered.
        attempt: u32,
    },
    /// `claim` found the key done, with this outcome.
    Duplicate(Vec<u8>),
    /// `claim` found another payload.
    Mismatch,
    /// `claim` failed. `nothing_written`: the error is one after which the
    /// contract says nothing was written (refused input, a corrupt record);
    /// otherwise (a transport error, a timeout, a dropped call) it may have
    /// taken effect.
    Failed {
        /// The error, with its sources.
        error: String,
        /// Whether the error says nothing was written.
        nothing_written: bool,
    },
    /// `complete` of the lease with this token stored this outcome.
    Completed {
        /// The token completed.
        token: LeaseToken,
        /// The outcome stored.
        outcome: Vec<u8>,
    },
    /// `complete` was asked with this outcome and failed (it may still have
    /// taken effect unless the store said the lease was lost).
    CompleteFailed {
        /// The token.
        token: LeaseToken,
        /// The outcome it tried to store.
        outcome: Vec<u8>,
        /// Whether the store said the lease was lost (then it did not).
        lease_lost: bool,
    },
    /// `release` of this token succeeded.
    Released(LeaseToken),
    /// `release` of this token failed (it may still have taken effect unless
    /// the store said the lease was lost).
    ReleaseFailed {
        /// The token.
        token: LeaseToken,
        /// Whether the store said the lease was lost.
        lease_lost: bool,
    },
    /// `extend` of this token answered this deadline.
    Extended {
        /// The token.
        token: LeaseToken,
        /// The new deadline, on the store's clock.
        deadline: SystemTime,
    },
    /// `extend` of this token failed.
    ExtendFailed {
        /// The token.
        token: LeaseToken,
        /// Whether the store said the lease was lost.
        lease_lost: bool,
    },
}

impl Answer {
    /// Whether the call failed in a way that may have taken effect.
    fn unknown(&self) -> bool {
        matches!(
            self,
            Answer::Failed {
                nothing_written: false,
                ..
            } | Answer::CompleteFailed {
                lease_lost: false,
                ..
            } | Answer::ReleaseFailed {
                lease_lost: false,
                ..
            } | Answer::ExtendFailed {
                lease_lost: false,
                ..
            }
        )
    }

    /// The answer of a claim, for a call recorded by hand (a claim made
    /// inside a transaction of the caller's, say).
    pub fn of_claim(result: &Result<ClaimOutcome, Error>) -> Self {
        match result {
            Ok(ClaimOutcome::Claimed(lease)) => Answer::Claimed {
                token: lease.token.clone(),
                deadline: lease.deadline,
                attempt: lease.attempt,
            },
            Ok(ClaimOutcome::InFlight { deadline, attempt }) => Answer::InFlight {
                deadline: *deadline,
                attempt: *attempt,
            },
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => Answer::Duplicate(outcome.clone()),
            Ok(ClaimOutcome::Mismatch { .. }) => Answer::Mismatch,
            Err(e) => Answer::Failed {
                error: chain(e),
                nothing_written: nothing_written(e),
            },
        }
    }

    /// The answer recorded for a claim whose future was dropped.
    fn cancelled_claim() -> Self {
        Answer::Failed {
            error: "cancelled by the caller (its future was dropped)".into(),
            nothing_written: false,
        }
    }
}

/// Errors after which the contract says nothing was written (rule 8).
fn nothing_written(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidKey(_)
            | Error::InvalidConfig { .. }
            | Error::OutcomeTooLarge { .. }
            | Error::BatchTooLarge { .. }
            | Error::CorruptRecord { .. }
    )
}

/// An error and its sources, in one line (`a: b: c`).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// One call: who, on which key, asked when, answered when, and what.
#[derive(Debug, Clone)]
pub struct Call {
    /// The worker (any number that tells workers apart).
    pub worker: usize,
    /// The key.
    pub key: String,
    /// When it was asked.
    pub asked: Instant,
    /// When it was answered.
    pub answered: Instant,
    /// The answer.
    pub answer: Answer,
}

/// Every call of a run, shared by its workers.
#[derive(Debug, Clone)]
pub struct History {
    calls: Arc<Mutex<Vec<Call>>>,
    /// Violations a worker saw directly (an answer wrong on its own).
    flags: Arc<Mutex<Vec<String>>>,
    /// Instant <-> wall-clock mapping taken when the history began, to compare
    /// lease deadlines (store time) with call times.
    origin: (Instant, SystemTime),
    /// How far the store's clock may be from this process's.
    pub tolerance: Duration,
    every_in_flight_seen: bool,
    attempts_in_order: bool,
}

impl Default for History {
    fn default() -> Self {
        Self::new(Duration::from_millis(50))
    }
}

impl History {
    /// An empty history allowing `tolerance` between the store's clock and ours.
    pub fn new(tolerance: Duration) -> Self {
        Self {
            calls: Arc::new(Mutex::new(Vec::new())),
            flags: Arc::new(Mutex::new(Vec::new())),
            origin: (Instant::now(), SystemTime::now()),
            tolerance,
            every_in_flight_seen: false,
            attempts_in_order: false,
        }
    }

    /// Every `InFlight` answer must show a lease (attempt and deadline) that a
    /// recorded claim was answered, and a `Mismatch` needs a recorded claim of
    /// the key answered `Claimed`, on keys where no call's effect is unknown:
    /// for runs where every claim goes through the history.
    pub fn every_in_flight_seen(mut self) -> Self {
        self.every_in_flight_seen = true;
        self
    }

    /// On keys never released, the winners' attempts must be 1, 2, 3... each
    /// once (each takeover counts one): for runs where every claim goes through
    /// the history and no retention passes.
    pub fn attempts_in_order(mut self) -> Self {
        self.attempts_in_order = true;
        self
    }

    /// Adds one call.
    pub fn record(&self, call: Call) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call);
    }

    /// Adds a violation a worker saw directly; [`History::check`] reports it
    /// with the rest.
    pub fn flag(&self, violation: impl Into<String>) {
        self.flags
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(violation.into());
    }

    /// The violations workers flagged so far (without judging the calls).
    pub fn flags(&self) -> Vec<String> {
        self.flags.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every call that failed in a way that may have taken effect, in words:
    /// none is expected of a run without faults or cancellations.
    pub fn failures(&self) -> Vec<String> {
        self.calls()
            .iter()
            .filter(|c| c.answer.unknown())
            .map(|c| format!("worker {} on {}: {:?}", c.worker, c.key, c.answer))
            .collect()
    }

    /// The instant a store deadline (or a wall-clock time another process
    /// recorded) corresponds to on this history's clock.
    pub fn instant_of(&self, at: SystemTime) -> Instant {
        let (i0, s0) = self.origin;
        match at.duration_since(s0) {
            Ok(after) => i0 + after,
            Err(before) => i0.checked_sub(before.duration()).unwrap_or(i0),
        }
    }

    /// The wall-clock time of `at`, for a call another process will read
    /// back with [`History::instant_of`].
    pub fn wall_clock_of(&self, at: Instant) -> SystemTime {
        let (i0, s0) = self.origin;
        if at >= i0 {
            s0 + (at - i0)
        } else {
            s0 - (i0 - at)
        }
    }

    /// Checks the whole history; every violation found, in words (the flags
    /// first, then by key).
    pub fn check(&self) -> Result<(), Vec<String>> {
        let calls = self.calls();
        let mut by_key: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
        for call in &calls {
            by_key.entry(call.key.as_str()).or_default().push(call);
        }
        let mut problems = self.flags.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (key, calls) in by_key {
            self.check_key(key, &calls, &mut problems);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// [`History::check`] as a [`Failure`](crate::Failure) naming `what` ran,
    /// with the first violations (for checks).
    pub fn verdict(&self, what: &str) -> Result<(), crate::Failure> {
        self.check().map_err(|bad| {
            crate::Failure::new(format!(
                "{what}: {} contract violations in a history of {} calls; the first ones:\n  {}",
                bad.len(),
                self.calls().len(),
                bad.iter()
                    .take(20)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n  ")
            ))
        })
    }
}

/// One lease won on a key, as the history shows it.
struct Hold<'a> {
    token: &'a LeaseToken,
    attempt: u32,
    worker: usize,
    /// The earliest ask of a claim answered with this lease.
    start_lo: Instant,
    /// The earliest answer of such a claim: the lease existed by then.
    start_hi: Instant,
    /// The deadline of that earliest answer.
    deadline0: SystemTime,
    /// Every deadline the lease was shown with (claims and extends).
    deadlines: HashSet<SystemTime>,
    /// Successful extends: asked, answered, deadline (in the order asked).
    extends: Vec<(Instant, Instant, SystemTime)>,
    completed: Option<(Instant, Instant)>,
    released: Option<(Instant, Instant)>,
    /// The earliest instant on this history's clock the lease may have
    /// stopped holding the key (a deadline counts the clock tolerance, a
    /// release, asked on this clock, does not); `None` once it completed (a
    /// done record is never won again).
    end_lo: Option<Instant>,
}

impl Hold<'_> {
    fn describe(&self) -> String {
        format!(
            "lease {} (attempt {}, worker {})",
            self.token, self.attempt, self.worker
        )
    }
}

impl History {
    /// The deadline of `hold` in force at `t`, leaving out extend `skip`: an
    /// extend answered by then counts, one asked but not yet answered may have.
    fn deadline_at(&self, hold: &Hold<'_>, t: Instant, skip: Option<usize>) -> Instant {
        let mut d = self.instant_of(hold.deadline0);
        for (i, (asked, answered, deadline)) in hold.extends.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            let e = self.instant_of(*deadline);
            if *answered <= t {
                d = e;
            } else if *asked <= t {
                d = d.max(e);
            }
        }
        d
    }

    #[allow(clippy::too_many_lines)] // one rule after the other, on one key's calls
    fn check_key(&self, key: &str, calls: &[&Call], problems: &mut Vec<String>) {
        let tol = self.tolerance;
        let unknown = calls.iter().filter(|c| c.answer.unknown()).count();

        // The leases won, by token.
        let mut holds: BTreeMap<&str, Hold<'_>> = BTreeMap::new();
        for c in calls {
            let Answer::Claimed {
                token,
                deadline,
                attempt,
            } = &c.answer
            else {
                continue;
            };
            let h = holds.entry(token.as_str()).or_insert_with(|| Hold {
                token,
                attempt: *attempt,
                worker: c.worker,
                start_lo: c.asked,
                start_hi: c.answered,
                deadline0: *deadline,
                deadlines: HashSet::new(),
                extends: Vec::new(),
                completed: None,
                released: None,
                end_lo: None,
            });
            if h.attempt != *attempt {
                problems.push(format!(
                    "{key}: lease {token} was answered with attempts {} and {attempt}",
                    h.attempt
                ));
            }
            h.deadlines.insert(*deadline);
            h.start_lo = h.start_lo.min(c.asked);
            if c.answered < h.start_hi {
                h.start_hi = c.answered;
                h.deadline0 = *deadline;
                h.worker = c.worker;
            }
        }

        // 2. Each lease's life: how it ended, and whether its holder acted in time.
        let starts: Vec<(&str, Instant, Instant, usize)> = holds
            .values()
            .map(|h| (h.token.as_str(), h.start_lo, h.start_hi, h.worker))
            .collect();
        for h in holds.values_mut() {
            let mut completes = Vec::new();
            let mut releases = Vec::new();
            let mut unknown_release: Option<Instant> = None;
            // An extend whose effect is unknown may have moved the deadline
            // (its new one is not known): acts asked after it are not judged
            // by the deadline.
            let mut unknown_extend: Option<Instant> = None;
            for c in calls {
                match &c.answer {
                    Answer::Completed { token, outcome } if token == h.token => {
                        completes.push((c.asked, c.answered, outcome));
                    }
                    Answer::Released(token) if token == h.token => {
                        releases.push((c.asked, c.answered));
                    }
                    Answer::ReleaseFailed {
                        token,
                        lease_lost: false,
                    } if token == h.token => {
                        unknown_release = Some(unknown_release.map_or(c.asked, |t| t.min(c.asked)));
                    }
                    Answer::Extended { token, deadline } if token == h.token => {
                        h.extends.push((c.asked, c.answered, *deadline));
                    }
                    Answer::ExtendFailed {
                        token,
                        lease_lost: false,
                    } if token == h.token => {
                        unknown_extend = Some(unknown_extend.map_or(c.asked, |t| t.min(c.asked)));
                    }
                    _ => {}
                }
            }
            completes.sort_unstable();
            releases.sort_unstable();
            h.extends.sort_unstable();
            for x in &h.extends {
                h.deadlines.insert(x.2);
            }
            // A complete asked again with the same outcome answers Ok and
            // changes nothing (rule 10); with another outcome it must fail.
            let outcomes: HashSet<&Vec<u8>> = completes.iter().map(|c| c.2).collect();
            if outcomes.len() > 1 {
                problems.push(format!(
                    "{key}: {} completed with {} different outcomes (a done record must answer LeaseLost to another)",
                    h.describe(),
                    outcomes.len()
                ));
            }
            if !completes.is_empty() && !releases.is_empty() {
                problems.push(format!(
                    "{key}: {} was both completed and released",
                    h.describe()
                ));
            }
            h.completed = completes.first().map(|c| (c.0, c.1));
            h.released = releases.first().copied();
            // Only complete and extend prove the lease held: a release answers
            // Ok whenever nothing live holds the key, its lease passed or not
            // (rule 10), so it is never a stale holder's act.
            let mut acts: Vec<(&str, Instant, Option<usize>)> = Vec::new();
            acts.extend(completes.iter().map(|c| ("complete", c.0, None)));
            acts.extend(
                h.extends
                    .iter()
                    .enumerate()
                    .map(|(i, x)| ("extend", x.0, Some(i))),
            );
            for (what, asked, skip) in acts {
                let d = self.deadline_at(h, asked, skip);
                if asked > d + tol && unknown_extend.is_none_or(|t| t >= asked) {
                    problems.push(format!(
                        "{key}: stale holder: a {what} of {} succeeded although it was asked {:?} after its lease had passed",
                        h.describe(),
                        asked - d
                    ));
                }
                // Another claim, asked after this lease was won and answered
                // Claimed before this call was even asked, took the key over.
                let taken = starts.iter().find(|(t, lo, hi, _)| {
                    *t != h.token.as_str() && *lo > h.start_hi && *hi < asked
                });
                if let Some((t, _, _, w)) = taken {
                    problems.push(format!(
                        "{key}: stale holder: a {what} of {} succeeded after worker {w} had taken the key over (lease {t})",
                        h.describe()
                    ));
                }
            }
            let last = h.extends.last().map_or(h.deadline0, |x| x.2);
            h.end_lo = if h.completed.is_some() {
                None
            } else {
                let d = self.instant_of(last);
                let passed = d.checked_sub(tol).unwrap_or(d);
                // A release ends the lease when asked, or found it passed.
                Some(h.released.map_or(passed, |(asked, _)| asked.min(passed)))
            };
            if let Some(t) = unknown_release {
                h.end_lo = Some(h.end_lo.map_or(t, |e| e.min(t)));
            }
        }
        let hs: Vec<&Hold<'_>> = holds.values().collect();

        // 1. Two leases never hold the key at once.
        for (i, a) in hs.iter().enumerate() {
            for b in &hs[i + 1..] {
                let a_then_b = a.end_lo.is_some_and(|e| e <= b.start_hi);
                let b_then_a = b.end_lo.is_some_and(|e| e <= a.start_hi);
                if !a_then_b && !b_then_a {
                    problems.push(format!(
                        "{key}: two live holders: {} and {} both held the key at once",
                        a.describe(),
                        b.describe()
                    ));
                }
            }
        }

        // 7. Attempts in order.
        if self.attempts_in_order && hs.iter().all(|h| h.released.is_none()) {
            let mut seen: HashMap<u32, usize> = HashMap::new();
            for h in &hs {
                if let Some(other) = seen.insert(h.attempt, h.worker) {
                    problems.push(format!(
                        "{key}: two winners (workers {other} and {}) were both answered attempt {}",
                        h.worker, h.attempt
                    ));
                }
            }
            if unknown == 0 {
                let mut at: Vec<u32> = hs.iter().map(|h| h.attempt).collect();
                at.sort_unstable();
                let want: Vec<u32> = (1..=u32::try_from(at.len()).unwrap_or(u32::MAX)).collect();
                if at != want {
                    problems.push(format!(
                        "{key}: the winners' attempts are {at:?}, not 1, 2, 3... (a takeover counts one)"
                    ));
                }
            }
        }

        // 3. One outcome.
        let mut stored: Vec<(&Call, &LeaseToken, &Vec<u8>)> = Vec::new();
        let mut maybe_stored: Vec<&Vec<u8>> = Vec::new();
        let mut refused: Vec<&Vec<u8>> = Vec::new();
        for c in calls {
            match &c.answer {
                Answer::Completed { token, outcome } => {
                    if !holds.contains_key(token.as_str()) {
                        problems.push(format!(
                            "{key}: worker {} completed {token}, a token no claim won",
                            c.worker
                        ));
                    }
                    stored.push((*c, token, outcome));
                }
                Answer::CompleteFailed {
                    outcome,
                    lease_lost,
                    ..
                } => {
                    if *lease_lost {
                        refused.push(outcome);
                    } else {
                        maybe_stored.push(outcome);
                    }
                }
                _ => {}
            }
        }
        let done_tokens: HashSet<&LeaseToken> = stored.iter().map(|s| s.1).collect();
        if done_tokens.len() > 1 {
            problems.push(format!(
                "{key}: processed twice: {} different leases completed it (workers {:?})",
                done_tokens.len(),
                stored.iter().map(|(c, _, _)| c.worker).collect::<Vec<_>>()
            ));
        }
        for c in calls {
            if let Answer::Duplicate(outcome) = &c.answer {
                let known = stored
                    .iter()
                    .any(|(done, _, o)| *o == outcome && done.asked <= c.answered)
                    || maybe_stored.contains(&outcome);
                if !known {
                    problems.push(format!(
                        "{key}: worker {} got a Duplicate carrying {:?}, an outcome no completion stored before{}",
                        c.worker,
                        String::from_utf8_lossy(outcome),
                        if refused.contains(&outcome) {
                            " (a complete answered LeaseLost, yet changed the record)"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }

        // 4. Nothing lost: a done record answers Duplicate from then on. The
        // first sign of one is a completion that returned, or a Duplicate
        // answered (after a completion whose answer was lost, say).
        let first_done = calls
            .iter()
            .filter_map(|c| match &c.answer {
                Answer::Completed { .. } => Some((c, "completion")),
                Answer::Duplicate(_) => Some((c, "Duplicate")),
                _ => None,
            })
            .min_by_key(|(c, _)| c.answered);
        if let Some((done, sign)) = first_done {
            for c in calls {
                match &c.answer {
                    // Asked after the sign returned: a claim answered before
                    // may have taken effect before it (rule 1 judges those).
                    Answer::Claimed { token, .. }
                        if !done_tokens.contains(token) && c.asked > done.answered =>
                    {
                        problems.push(format!(
                            "{key}: worker {} won {token} after worker {}'s {sign} had returned (the done record was lost)",
                            c.worker, done.worker
                        ));
                    }
                    Answer::InFlight { .. } if c.asked > done.answered => {
                        problems.push(format!(
                            "{key}: worker {} was answered InFlight {:?} after worker {}'s {sign} had returned",
                            c.worker,
                            c.asked - done.answered,
                            done.worker
                        ));
                    }
                    _ => {}
                }
            }
        }

        // 5. A lost lease is no guess.
        for c in calls {
            let (token, what) = match &c.answer {
                Answer::CompleteFailed {
                    token,
                    lease_lost: true,
                    ..
                } => (token, "complete"),
                Answer::ReleaseFailed {
                    token,
                    lease_lost: true,
                } => (token, "release"),
                Answer::ExtendFailed {
                    token,
                    lease_lost: true,
                } => (token, "extend"),
                _ => continue,
            };
            let Some(h) = holds.get(token.as_str()) else {
                continue;
            };
            let deadline = self.deadline_at(h, c.answered, None);
            let passed = c.answered + tol >= deadline;
            // Another claim that may have taken effect while this lease was
            // held (answered Claimed on another lease, or failed and so unknown).
            let contested = calls.iter().any(|o| {
                o.asked < c.answered
                    && o.answered > h.start_lo
                    && o.worker != c.worker
                    && match &o.answer {
                        // A claim of unknown effect is no contest: it could
                        // only have won the key once this lease had passed.
                        Answer::Claimed { token: t, .. } => t != token,
                        _ => false,
                    }
            });
            let let_go_before = calls.iter().any(|o| {
                o.asked < c.asked
                    && match &o.answer {
                        Answer::Completed { token: t, .. } | Answer::Released(t) => t == token,
                        Answer::CompleteFailed {
                            token: t,
                            lease_lost: false,
                            ..
                        }
                        | Answer::ReleaseFailed {
                            token: t,
                            lease_lost: false,
                        } => t == token,
                        _ => false,
                    }
            });
            if !passed && !contested && !let_go_before {
                problems.push(format!(
                    "{key}: worker {} was told its lease {token} was lost (by a {what}) {:?} before it passed, with no other claim of the key",
                    c.worker,
                    deadline - c.answered
                ));
            }
        }

        // 6. An InFlight, or a claim id's lease handed back, shows a lease
        // that could still hold the key while the call ran.
        // Whether `deadline` may have been the one in force while a call
        // asked at `asked` and answered at `answered` read it: set (by the
        // claim or an extend) before the call ended, and not replaced for
        // certain (by an extend asked after it was set) before the call began.
        let in_force = |h: &Hold<'_>, asked: Instant, answered: Instant, deadline: SystemTime| {
            let sets: Vec<(Instant, Instant, SystemTime)> =
                std::iter::once((h.start_lo, h.start_hi, h.deadline0))
                    .chain(h.extends.iter().copied())
                    .collect();
            sets.iter().any(|(set_lo, set_hi, d)| {
                *d == deadline
                    && *set_lo < answered
                    && !sets.iter().any(|(lo, hi, _)| *lo > *set_hi && *hi < asked)
            })
        };
        let stale = |h: &Hold<'_>,
                     asked: Instant,
                     answered: Instant,
                     deadline: SystemTime|
         -> Option<String> {
            if !in_force(h, asked, answered, deadline) {
                return Some("that deadline had been replaced by an extend before the call".into());
            }
            let d = self.instant_of(deadline);
            if d + tol < asked {
                return Some(format!(
                    "its deadline had passed {:?} before the call",
                    asked - d
                ));
            }
            if h.released.is_some_and(|(_, r)| r < asked) {
                return Some("its release had already returned".into());
            }
            if h.completed.is_some_and(|(_, r)| r < asked) {
                return Some("its completion had already returned".into());
            }
            hs.iter()
                .find(|h2| h2.token != h.token && h2.start_lo > h.start_hi && h2.start_hi < asked)
                .map(|h2| {
                    format!(
                        "a later winner ({}) had already been answered",
                        h2.describe()
                    )
                })
        };
        for c in calls {
            match &c.answer {
                Answer::InFlight { attempt, deadline } => {
                    let cands: Vec<&&Hold<'_>> = hs
                        .iter()
                        .filter(|h| h.attempt == *attempt && h.deadlines.contains(deadline))
                        .collect();
                    if cands.is_empty() {
                        if self.every_in_flight_seen && unknown == 0 {
                            problems.push(format!(
                                "{key}: phantom InFlight: worker {} was answered InFlight (attempt {attempt}, deadline {deadline:?}) for a lease no claim was answered",
                                c.worker
                            ));
                        }
                    } else {
                        let reasons: Vec<String> = cands
                            .iter()
                            .filter_map(|h| stale(h, c.asked, c.answered, *deadline))
                            .collect();
                        if reasons.len() == cands.len() {
                            problems.push(format!(
                                "{key}: stale InFlight: worker {} was answered InFlight on attempt {attempt} but {}",
                                c.worker, reasons[0]
                            ));
                        }
                    }
                }
                // A Mismatch reads a live record: with every call recorded,
                // some claim must have won one.
                Answer::Mismatch if hs.is_empty() && self.every_in_flight_seen && unknown == 0 => {
                    problems.push(format!(
                        "{key}: phantom Mismatch: worker {} was answered Mismatch although no claim of the key was answered Claimed",
                        c.worker
                    ));
                }
                Answer::Claimed {
                    token, deadline, ..
                } => {
                    if let Some(h) = holds.get(token.as_str()) {
                        if c.asked > h.start_hi {
                            if let Some(why) = stale(h, c.asked, c.answered, *deadline) {
                                problems.push(format!(
                                    "{key}: worker {} was handed back {} (same claim id) but {why}",
                                    c.worker,
                                    h.describe()
                                ));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

/// A store used through a [`History`]: every call is recorded with its times.
/// A call whose future is dropped before it answers (a timeout, a cancelled
/// task) is recorded as one whose effect is unknown.
#[derive(Debug, Clone)]
pub struct Recorder {
    store: Arc<dyn DedupeStore>,
    history: History,
    worker: usize,
}

/// The calls recorded should the future holding it be dropped before they
/// are answered.
struct Unanswered<'a> {
    recorder: &'a Recorder,
    asked: Instant,
    calls: Vec<(String, Answer)>,
}

impl Unanswered<'_> {
    /// The call answered: record `answers` instead.
    fn answered(mut self, answers: Vec<(String, Answer)>) {
        self.calls = answers;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        let answered = Instant::now();
        for (key, answer) in self.calls.drain(..) {
            self.recorder.history.record(Call {
                worker: self.recorder.worker,
                key,
                asked: self.asked,
                answered,
                answer,
            });
        }
    }
}

impl Recorder {
    /// Worker `worker`'s view of `store`, recording into `history`.
    pub fn new(store: Arc<dyn DedupeStore>, history: History, worker: usize) -> Self {
        Self {
            store,
            history,
            worker,
        }
    }

    /// The store recorded.
    pub fn store(&self) -> &Arc<dyn DedupeStore> {
        &self.store
    }

    /// The history recorded into.
    pub fn history(&self) -> &History {
        &self.history
    }

    fn pending(&self, calls: Vec<(String, Answer)>) -> Unanswered<'_> {
        Unanswered {
            recorder: self,
            asked: Instant::now(),
            calls,
        }
    }

    /// `claim`, recorded.
    pub async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome, Error> {
        let pending = self.pending(vec![(key.to_string(), Answer::cancelled_claim())]);
        let result = self.store.claim(key, opts).await;
        pending.answered(vec![(key.to_string(), Answer::of_claim(&result))]);
        result
    }

    /// `claim_many`, recorded as one claim per place (a failed batch as one
    /// failed claim per distinct key). A key twice in the batch must be
    /// answered at its second place what a claim right after the first would
    /// be (the contract's `claim_many` row); anything else is flagged.
    pub async fn claim_many(
        &self,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>, Error> {
        let mut distinct = HashSet::new();
        let keys_once: Vec<&Key> = keys.iter().filter(|k| distinct.insert(*k)).collect();
        let pending = self.pending(
            keys_once
                .iter()
                .map(|k| (k.to_string(), Answer::cancelled_claim()))
                .collect(),
        );
        let result = self.store.claim_many(keys, opts).await;
        let answers = match &result {
            Ok(answers) if answers.len() == keys.len() => {
                self.check_repeats(keys, answers, opts);
                keys.iter()
                    .zip(answers)
                    .map(|(k, a)| (k.to_string(), Answer::of_claim(&Ok(a.clone()))))
                    .collect()
            }
            Ok(answers) => {
                self.history.flag(format!(
                    "worker {}: claim_many of {} keys answered {} answers",
                    self.worker,
                    keys.len(),
                    answers.len()
                ));
                Vec::new()
            }
            Err(e) => {
                let failed = Answer::Failed {
                    error: chain(e),
                    nothing_written: nothing_written(e),
                };
                keys_once
                    .iter()
                    .map(|k| (k.to_string(), failed.clone()))
                    .collect()
            }
        };
        pending.answered(answers);
        result
    }

    fn check_repeats(&self, keys: &[Key], answers: &[ClaimOutcome], opts: &ClaimOptions) {
        let mut first: HashMap<&Key, &ClaimOutcome> = HashMap::new();
        for (k, a) in keys.iter().zip(answers) {
            let Some(f) = first.get(k) else {
                first.insert(k, a);
                continue;
            };
            let expected = match (*f, &opts.claim_id) {
                (ClaimOutcome::Claimed(l), None) => ClaimOutcome::InFlight {
                    deadline: l.deadline,
                    attempt: l.attempt,
                },
                (other, _) => other.clone(),
            };
            if *a != expected {
                self.history.flag(format!(
                    "{k}: worker {}'s claim_many answered the key twice in one batch: first {f:?}, then {a:?}; a claim right after the first would see {expected:?}",
                    self.worker
                ));
            }
        }
    }

    /// `complete`, recorded.
    pub async fn complete(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<(), Error> {
        let failed = |lease_lost| Answer::CompleteFailed {
            token: lease.token.clone(),
            outcome: outcome.to_vec(),
            lease_lost,
        };
        let pending = self.pending(vec![(lease.key.to_string(), failed(false))]);
        let result = self.store.complete(lease, outcome, retention).await;
        let answer = match &result {
            Ok(()) => Answer::Completed {
                token: lease.token.clone(),
                outcome: outcome.to_vec(),
            },
            Err(e) => failed(matches!(e, Error::LeaseLost { .. })),
        };
        pending.answered(vec![(lease.key.to_string(), answer)]);
        result
    }

    /// `release`, recorded.
    pub async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let failed = |lease_lost| Answer::ReleaseFailed {
            token: lease.token.clone(),
            lease_lost,
        };
        let pending = self.pending(vec![(lease.key.to_string(), failed(false))]);
        let result = self.store.release(lease).await;
        let answer = match &result {
            Ok(()) => Answer::Released(lease.token.clone()),
            Err(e) => failed(matches!(e, Error::LeaseLost { .. })),
        };
        pending.answered(vec![(lease.key.to_string(), answer)]);
        result
    }

    /// `extend`, recorded.
    pub async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease, Error> {
        let failed = |lease_lost| Answer::ExtendFailed {
            token: lease.token.clone(),
            lease_lost,
        };
        let pending = self.pending(vec![(lease.key.to_string(), failed(false))]);
        let result = self.store.extend(lease, ttl).await;
        let answer = match &result {
            Ok(extended) => Answer::Extended {
                token: lease.token.clone(),
                deadline: extended.deadline,
            },
            Err(e) => failed(matches!(e, Error::LeaseLost { .. })),
        };
        pending.answered(vec![(lease.key.to_string(), answer)]);
        result
    }
}

impl History {
    /// The longest any call took, from asked to answered (zero with no calls).
    pub fn slowest_call(&self) -> Duration {
        self.calls()
            .iter()
            .map(|c| c.answered - c.asked)
            .max()
            .unwrap_or_default()
    }

    /// Every completion the store acknowledged: key (as `namespace:id`) and
    /// outcome.
    pub fn acknowledged(&self) -> Vec<(String, Vec<u8>)> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c.answer {
                Answer::Completed { outcome, .. } => Some((c.key, outcome)),
                _ => None,
            })
            .collect()
    }

    /// How many claims were answered `Claimed`.
    pub fn claims_won(&self) -> usize {
        self.calls()
            .iter()
            .filter(|c| matches!(c.answer, Answer::Claimed { .. }))
            .count()
    }
}

/// A contested load for fault runs, recorded into `history`: `workers` tasks
/// walk one run of keys a few steps apart (every key is contested, new keys
/// keep coming), claim each with `lease`, then complete it (four times in
/// five) or release it, until `stop` is set. Answers every error the calls
/// met, for the caller to judge.
pub async fn contested_load(
    store: Arc<dyn DedupeStore>,
    history: &History,
    workers: usize,
    lease: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<Error> {
    use std::sync::atomic::Ordering;
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let recorder = Recorder::new(Arc::clone(&store), history.clone(), worker);
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let opts = ClaimOptions::new(lease);
                let mut errors = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let Ok(key) = Key::new("chaos", format!("k{}", (i + worker as u64) / 3)) else {
                        break;
                    };
                    let result = match recorder.claim(&key, &opts).await {
                        Ok(ClaimOutcome::Claimed(lease)) if i.is_multiple_of(5) => {
                            recorder.release(&lease).await
                        }
                        Ok(ClaimOutcome::Claimed(lease)) => {
                            let outcome = format!("w{worker}-{i}");
                            recorder
                                .complete(&lease, outcome.as_bytes(), Duration::from_secs(600))
                                .await
                        }
                        Ok(_) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            Ok(())
                        }
                        Err(e) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            Err(e)
                        }
                    };
                    if let Err(e) = result {
                        errors.push(e);
                    }
                }
                errors
            })
        })
        .collect();
    let mut errors = Vec::new();
    for task in tasks {
        match task.await {
            Ok(mine) => errors.extend(mine),
            Err(e) => errors.push(Error::fatal(
                "a load worker panicked",
                Some(Box::new(e) as _),
            )),
        }
    }
    errors
}

/// Claims every key whose completion `history` acknowledged once more, through
/// a [`Recorder`] of worker `usize::MAX` (so [`History::check`] judges the
/// answers with the rest), and answers the keys that did not come back as that
/// duplicate: after a crash of a durable store, none. Keys are rebuilt from
/// their `namespace:id` form; a call that fails is retried for up to `patience`.
pub async fn recheck_completed(
    store: Arc<dyn DedupeStore>,
    history: &History,
    patience: Duration,
) -> Vec<String> {
    let recorder = Recorder::new(store, history.clone(), usize::MAX);
    let opts = ClaimOptions::new(Duration::from_secs(30));
    let mut lost = Vec::new();
    for (key, outcome) in history.acknowledged() {
        let Some(parsed) = key
            .split_once(':')
            .and_then(|(ns, id)| Key::new(ns, id).ok())
        else {
            lost.push(format!("{key}: not a key this checker can rebuild"));
            continue;
        };
        let give_up = Instant::now() + patience;
        let answer = loop {
            match recorder.claim(&parsed, &opts).await {
                Err(e) if e.is_retryable() && Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => break other,
            }
        };
        match answer {
            Ok(ClaimOutcome::Duplicate { outcome: o, .. }) if o == outcome => {}
            other => lost.push(format!(
                "{key}: completed with {:?}, now {other:?}",
                String::from_utf8_lossy(&outcome)
            )),
        }
    }
    lost
}
