//! A history checker: every answer of every worker, with when it was asked and
//! when it was answered, checked against the contract as a whole rather than by
//! end counts.
//!
//! Workers record each call into a shared [`History`] (the store is used
//! through [`Recorder`], which records for them); [`History::check`] then
//! verifies:
//!
//! 1. **one live holder**: two `Claimed` answers on one key never hold it at
//!    once. A later winner is valid only once the earlier lease had passed or
//!    had been released or completed (each judged at the latest moment the
//!    contract allows: a call takes effect somewhere between being asked and
//!    being answered, and clocks are allowed [`History::tolerance`]);
//! 2. **no stale completion**: a `complete` that succeeded was asked while its
//!    lease could still be live and before any other claim of the key had been
//!    answered `Claimed`;
//! 3. **one outcome**: per key, at most one `complete` succeeds, and every
//!    `Duplicate` answer carries exactly that outcome (never one nobody stored,
//!    never an answer before any completion was even asked);
//! 4. **nothing lost**: no claim is won after a completion of the key had been
//!    acknowledged (the record was done; winning it again means the store lost
//!    it, as a server without durable writes does when it is killed);
//! 5. **a lost lease is no guess**: a `complete` answered `LeaseLost` was
//!    answered after its lease could have passed, or after another claim of
//!    the key was asked (a store that answers `LeaseLost` for a transport
//!    error makes a caller drop work that may have been stored).
//!
//! [`recheck_completed`] adds the last word after a fault: every completion
//! that was acknowledged is claimed once more, recorded, and must answer its
//! outcome.
//!
//! Retention must outlast the run (a key completed twice is counted as a
//! violation). Errors are recorded too and never count as answers: a claim that failed
//! may or may not have taken effect, so the checker assumes the worst only
//! where the contract does (a failed `complete` may have stored its outcome).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, LeaseToken};

/// What one call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `claim` won: the lease's token and deadline.
    Claimed {
        /// The lease token.
        token: LeaseToken,
        /// The lease deadline, on the store's clock.
        deadline: SystemTime,
    },
    /// `claim` found the key held by another lease.
    InFlight,
    /// `claim` found the key done, with this outcome.
    Duplicate(Vec<u8>),
    /// `claim` found another payload.
    Mismatch,
    /// `complete` of the lease with this token stored this outcome.
    Completed {
        /// The token completed.
        token: LeaseToken,
        /// The outcome stored.
        outcome: Vec<u8>,
    },
    /// `complete` was asked with this outcome and failed (it may still have
    /// taken effect when the error was a timeout).
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
    /// `release` of this token failed (it may still have taken effect when the
    /// error was a timeout).
    ReleaseFailed(LeaseToken),
    /// Any other call failed with this error.
    Failed(String),
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
    /// Instant <-> wall-clock mapping taken when the history began, to compare
    /// lease deadlines (store time) with call times.
    origin: (Instant, SystemTime),
    /// How far the store's clock may be from this process's.
    pub tolerance: Duration,
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
            origin: (Instant::now(), SystemTime::now()),
            tolerance,
        }
    }

    /// Adds one call.
    pub fn record(&self, call: Call) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call);
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The instant a store deadline corresponds to.
    fn instant_of(&self, at: SystemTime) -> Instant {
        let (i0, s0) = self.origin;
        match at.duration_since(s0) {
            Ok(after) => i0 + after,
            Err(before) => i0.checked_sub(before.duration()).unwrap_or(i0),
        }
    }

    /// Checks the whole history; every violation found, in words.
    pub fn check(&self) -> Result<(), Vec<String>> {
        let calls = self.calls();
        let tol = self.tolerance;
        let mut by_key: HashMap<&str, Vec<&Call>> = HashMap::new();
        for call in &calls {
            by_key.entry(call.key.as_str()).or_default().push(call);
        }
        let mut problems = Vec::new();
        for (key, calls) in by_key {
            // Leases won on this key, in the order they were answered.
            let mut wins: Vec<(&Call, &LeaseToken, Instant)> = calls
                .iter()
                .filter_map(|c| match &c.answer {
                    Answer::Claimed { token, deadline } => {
                        Some((*c, token, self.instant_of(*deadline)))
                    }
                    _ => None,
                })
                .collect();
            wins.sort_by_key(|(c, _, _)| c.answered);
            // When each token's hold ended at the earliest: the first release
            // or completion of it that was asked.
            let let_go = |token: &LeaseToken| -> Option<Instant> {
                calls
                    .iter()
                    .filter(|c| match &c.answer {
                        Answer::Released(t)
                        | Answer::ReleaseFailed(t)
                        | Answer::Completed { token: t, .. } => t == token,
                        Answer::CompleteFailed {
                            token: t,
                            lease_lost: false,
                            ..
                        } => t == token,
                        _ => false,
                    })
                    .map(|c| c.asked)
                    .min()
            };
            // 1. one live holder. The earliest moment a hold could have ended.
            let free_from = |token: &LeaseToken, deadline: Instant| {
                let mut free = deadline.checked_sub(tol).unwrap_or(deadline);
                if let Some(t) = let_go(token) {
                    free = free.min(t);
                }
                free
            };
            for pair in wins.windows(2) {
                let ((a, a_token, a_deadline), (b, b_token, b_deadline)) = (pair[0], pair[1]);
                let a_free = free_from(a_token, a_deadline);
                let b_free = free_from(b_token, b_deadline);
                // B took effect at the latest when it was answered: A before B
                // is possible if A's hold could have ended by then, and B
                // before A (A's answer delayed past B's) if B's could have
                // ended by the time A was answered. Neither: two holders.
                if b.answered < a_free && a.answered < b_free {
                    problems.push(format!(
                        "{key}: two live holders: worker {} won {a_token} and worker {} won {b_token} {:?} before that lease could have ended",
                        a.worker,
                        b.worker,
                        a_free - b.answered
                    ));
                }
            }
            // 5. a lost lease is no guess.
            for c in &calls {
                let Answer::CompleteFailed {
                    token,
                    lease_lost: true,
                    ..
                } = &c.answer
                else {
                    continue;
                };
                let Some((won, _, deadline)) = wins.iter().find(|(_, t, _)| *t == token) else {
                    continue;
                };
                let passed = c.answered + tol >= *deadline;
                // Another claim that may have taken effect while this lease
                // was held (answered Claimed, or failed and so unknown).
                let contested = calls.iter().any(|o| {
                    o.asked < c.answered
                        && o.answered > won.asked
                        && o.worker != c.worker
                        && matches!(o.answer, Answer::Claimed { .. } | Answer::Failed(_))
                });
                let let_go_before = let_go(token).is_some_and(|t| t < c.asked);
                if !passed && !contested && !let_go_before {
                    problems.push(format!(
                        "{key}: worker {} was told its lease {token} was lost {:?} before it passed, with no other claim of the key",
                        c.worker,
                        *deadline - c.answered
                    ));
                }
            }
            // 2. no stale completion, and 3. one outcome.
            let mut stored: Vec<(&Call, &Vec<u8>)> = Vec::new();
            let mut maybe_stored: Vec<&Vec<u8>> = Vec::new();
            for c in &calls {
                match &c.answer {
                    Answer::Completed { token, outcome } => {
                        stored.push((*c, outcome));
                        match wins.iter().find(|(_, t, _)| *t == token) {
                            None => problems.push(format!(
                                "{key}: worker {} completed {token}, a token no claim won",
                                c.worker
                            )),
                            Some((won, _, deadline)) => {
                                if c.asked > *deadline + tol {
                                    problems.push(format!(
                                        "{key}: worker {} completed {token} {:?} after its lease had passed",
                                        c.worker,
                                        c.asked - *deadline
                                    ));
                                }
                                // Another claim, asked after this lease was won
                                // and answered Claimed before this completion was
                                // even asked, took the key over: this holder was
                                // stale when it completed.
                                let taken = wins.iter().find(|(b, t, _)| {
                                    *t != token && b.asked > won.answered && b.answered < c.asked
                                });
                                if let Some((b, b_token, _)) = taken {
                                    problems.push(format!(
                                        "{key}: worker {} completed {token} after worker {} had taken the key over ({b_token})",
                                        c.worker, b.worker
                                    ));
                                }
                            }
                        }
                    }
                    Answer::CompleteFailed {
                        outcome,
                        lease_lost: false,
                        ..
                    } => maybe_stored.push(outcome),
                    _ => {}
                }
            }
            // 4. nothing lost.
            // A win answered after a completion of another token was asked:
            // whichever took effect first, one of them was wrong (a done record
            // won again, or a completion stored over a newer holder).
            for (b, b_token, _) in &wins {
                let after = stored.iter().find(|(c, _)| {
                    c.asked < b.answered
                        && !matches!(&c.answer, Answer::Completed { token, .. } if token == *b_token)
                });
                if let Some((done, _)) = after {
                    problems.push(format!(
                        "{key}: worker {} won {b_token} after worker {}'s completion had been acknowledged (the done record was lost)",
                        b.worker, done.worker
                    ));
                }
            }
            if stored.len() > 1 {
                problems.push(format!(
                    "{key}: {} completions succeeded (workers {:?})",
                    stored.len(),
                    stored.iter().map(|(c, _)| c.worker).collect::<Vec<_>>()
                ));
            }
            for c in &calls {
                if let Answer::Duplicate(outcome) = &c.answer {
                    let known = stored
                        .iter()
                        .any(|(done, o)| *o == outcome && done.asked <= c.answered)
                        || maybe_stored.contains(&outcome);
                    if !known {
                        problems.push(format!(
                            "{key}: worker {} got a duplicate carrying {:?}, an outcome no completion stored before",
                            c.worker,
                            String::from_utf8_lossy(outcome)
                        ));
                    }
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            problems.sort();
            Err(problems)
        }
    }
}

/// A store used through a [`History`]: every call is recorded with its times.
#[derive(Debug, Clone)]
pub struct Recorder {
    store: Arc<dyn DedupeStore>,
    history: History,
    worker: usize,
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

    fn record(&self, key: &Key, asked: Instant, answer: Answer) {
        self.history.record(Call {
            worker: self.worker,
            key: key.to_string(),
            asked,
            answered: Instant::now(),
            answer,
        });
    }

    /// `claim`, recorded.
    pub async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome, Error> {
        let asked = Instant::now();
        let result = self.store.claim(key, opts).await;
        let answer = match &result {
            Ok(ClaimOutcome::Claimed(lease)) => Answer::Claimed {
                token: lease.token.clone(),
                deadline: lease.deadline,
            },
            Ok(ClaimOutcome::InFlight { .. }) => Answer::InFlight,
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => Answer::Duplicate(outcome.clone()),
            Ok(ClaimOutcome::Mismatch { .. }) => Answer::Mismatch,
            Err(e) => Answer::Failed(e.to_string()),
        };
        self.record(key, asked, answer);
        result
    }

    /// `complete`, recorded.
    pub async fn complete(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<(), Error> {
        let asked = Instant::now();
        let result = self.store.complete(lease, outcome, retention).await;
        let answer = match &result {
            Ok(()) => Answer::Completed {
                token: lease.token.clone(),
                outcome: outcome.to_vec(),
            },
            Err(e) => Answer::CompleteFailed {
                token: lease.token.clone(),
                outcome: outcome.to_vec(),
                lease_lost: matches!(e, Error::LeaseLost { .. }),
            },
        };
        self.record(&lease.key, asked, answer);
        result
    }

    /// `release`, recorded.
    pub async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let asked = Instant::now();
        let result = self.store.release(lease).await;
        let answer = match &result {
            Ok(()) => Answer::Released(lease.token.clone()),
            Err(_) => Answer::ReleaseFailed(lease.token.clone()),
        };
        self.record(&lease.key, asked, answer);
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
            Err(e) => errors.push(Error::backend(
                "a load worker panicked",
                false,
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
