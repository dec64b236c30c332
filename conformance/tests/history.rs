//! The history checker on real concurrent runs: a correct store passes, and
//! stores broken each in one way are caught by the rule they break.

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::history::{recheck_completed, Answer, Call, History, Recorder};
use dedupe_core::{
    async_trait, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, MemoryStore, Record,
    Result,
};

/// Eight workers on twelve keys with 30 ms leases: most claims complete at
/// once, some release, some sleep past their lease before completing (a
/// stalled worker: at least each worker's first win), so takeovers and lost
/// leases happen.
async fn run(store: Arc<dyn DedupeStore>) -> History {
    let history = History::new(Duration::from_millis(5));
    let tasks: Vec<_> = (0..8)
        .map(|worker| {
            let recorder = Recorder::new(Arc::clone(&store), history.clone(), worker);
            tokio::spawn(async move {
                let mut seed = 0x9e37_79b9_u64.wrapping_mul(worker as u64 + 1);
                let mut next = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let opts = ClaimOptions::new(Duration::from_millis(30));
                let mut won = 0;
                for i in 0..60 {
                    let key = Key::new("h", format!("k{}", next() % 12)).expect("key");
                    let Ok(ClaimOutcome::Claimed(lease)) = recorder.claim(&key, &opts).await else {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    };
                    // Each worker's first win stalls, so every run has stalled
                    // holders whatever the timing (a run on a loaded machine
                    // once won too few claims to draw one).
                    let choice = if won == 0 { 1 } else { next() % 6 };
                    won += 1;
                    if choice == 0 {
                        let _ = recorder.release(&lease).await;
                        continue;
                    }
                    if choice == 1 {
                        // Stalled past the 30 ms lease.
                        tokio::time::sleep(Duration::from_millis(45)).await;
                    }
                    let outcome = format!("w{worker}-{i}");
                    let _ = recorder
                        .complete(&lease, outcome.as_bytes(), Duration::from_secs(600))
                        .await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("worker");
    }
    history
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_store_passes() {
    let history = run(Arc::new(MemoryStore::new())).await;
    let calls = history.calls();
    assert!(calls.len() > 200, "too few calls: {}", calls.len());
    if let Err(problems) = history.check() {
        panic!("{} problems:\n{}", problems.len(), problems.join("\n"));
    }
}

/// How a store is broken.
#[derive(Debug, Clone, Copy)]
enum Flaw {
    /// A claim of a held or done key wins anyway.
    EveryoneWins,
    /// A duplicate carries an outcome nobody stored.
    MadeUpOutcome,
    /// A complete whose lease was lost succeeds anyway (by forgetting the
    /// record and storing over it).
    StaleCompletes,
    /// A done record is forgotten: its next claim wins it afresh.
    ForgetsDone,
    /// About a third of `complete` calls made well inside their lease answer
    /// `LeaseLost` without trying (a transport error reported as a lost lease).
    GuessesLeaseLost,
}

#[derive(Debug)]
struct Broken(MemoryStore, Flaw);

#[async_trait]
impl DedupeStore for Broken {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        let answer = self.0.claim(key, opts).await?;
        Ok(match (self.1, answer) {
            (
                Flaw::EveryoneWins,
                ClaimOutcome::InFlight { .. } | ClaimOutcome::Duplicate { .. },
            ) => {
                self.0.forget(key).await?;
                self.0.claim(key, opts).await?
            }
            (Flaw::ForgetsDone, ClaimOutcome::Duplicate { .. }) => {
                self.0.forget(key).await?;
                self.0.claim(key, opts).await?
            }
            (Flaw::MadeUpOutcome, ClaimOutcome::Duplicate { completed_at, .. }) => {
                ClaimOutcome::Duplicate {
                    outcome: b"made up".to_vec(),
                    completed_at,
                }
            }
            (_, answer) => answer,
        })
    }
    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        // Guessed only well inside the lease (20 ms of its 30 left), so each
        // guess is a lie the checker must see even on a loaded machine, where
        // a guess made near the deadline could be the truth by the time it
        // is judged (a gate run once drew no guess it could tell apart).
        if matches!(self.1, Flaw::GuessesLeaseLost)
            && lease.token.as_str().ends_with(['0', '1', '2', '3', '4'])
            && lease.deadline > std::time::SystemTime::now() + Duration::from_millis(20)
        {
            return Err(Error::lease_lost(&lease.key));
        }
        match self.0.complete(lease, outcome, retention).await {
            Err(Error::LeaseLost { .. }) if matches!(self.1, Flaw::StaleCompletes) => {
                self.0.forget(&lease.key).await?;
                let opts = ClaimOptions::new(Duration::from_secs(60));
                if let ClaimOutcome::Claimed(mine) = self.0.claim(&lease.key, &opts).await? {
                    self.0.complete(&mine, outcome, retention).await?;
                }
                Ok(())
            }
            other => other,
        }
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.0.release(lease).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.0.extend(lease, ttl).await
    }
    async fn expire(&self) -> Result<u64> {
        self.0.expire().await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.0.get(key).await
    }
    async fn forget(&self, key: &Key) -> Result<bool> {
        self.0.forget(key).await
    }
}

async fn caught(flaw: Flaw, rules: &[&str]) {
    let history = run(Arc::new(Broken(MemoryStore::new(), flaw))).await;
    match history.check() {
        Ok(()) => panic!("{flaw:?} passed the history check"),
        Err(problems) => assert!(
            problems.iter().any(|p| rules.iter().any(|r| p.contains(r))),
            "{flaw:?} was not caught by {rules:?}:\n{}",
            problems.join("\n")
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everyone_wins_is_two_live_holders() {
    caught(Flaw::EveryoneWins, &["two live holders"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_made_up_outcome_is_caught() {
    caught(Flaw::MadeUpOutcome, &["an outcome no completion stored"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_completion_is_caught() {
    caught(
        Flaw::StaleCompletes,
        &[
            "completions succeeded",
            "after its lease had passed",
            "taken the key over",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_done_record_is_caught() {
    caught(Flaw::ForgetsDone, &["the done record was lost"]).await;
}

/// After a "crash" that loses everything (the run's store replaced by an empty
/// one, as a server without durable writes comes back), rechecking the
/// acknowledged completions finds every one of them lost and the history check
/// fails; on the store that kept them, none is lost and the history holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recheck_finds_completions_a_crash_lost() {
    let kept: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let history = run(Arc::clone(&kept)).await;
    let acknowledged = history.acknowledged().len();
    assert!(acknowledged > 5, "too few completions: {acknowledged}");
    let lost = recheck_completed(kept, &history, Duration::from_secs(1)).await;
    assert!(lost.is_empty(), "{lost:?}");
    history.check().expect("a store that kept everything");

    let history = run(Arc::new(MemoryStore::new())).await;
    let amnesiac: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let lost = recheck_completed(amnesiac, &history, Duration::from_secs(1)).await;
    assert_eq!(lost.len(), history.acknowledged().len(), "{lost:?}");
    let problems = history.check().expect_err("lost records pass the check");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("the done record was lost")),
        "{problems:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guessed_lost_lease_is_caught() {
    caught(Flaw::GuessesLeaseLost, &["was told its lease"]).await;
}

/// Calls on one key at instants given in milliseconds from a common start,
/// for histories written by hand.
struct Timeline {
    t0: std::time::Instant,
    now: std::time::SystemTime,
}

impl Timeline {
    fn new() -> Self {
        Self {
            t0: std::time::Instant::now(),
            now: std::time::SystemTime::now(),
        }
    }

    fn call(&self, worker: usize, asked: u64, answered: u64, answer: Answer) -> Call {
        Call {
            worker,
            key: "h:k".into(),
            asked: self.t0 + Duration::from_millis(asked),
            answered: self.t0 + Duration::from_millis(answered),
            answer,
        }
    }

    fn claimed(&self, token: &str, lease: Duration, attempt: u32) -> Answer {
        Answer::Claimed {
            token: dedupe_core::backend::stored_token(token),
            deadline: self.now + lease,
            attempt,
        }
    }
}

/// A claim answered late (it took effect at once, its answer was slow) is not
/// a done record won again when the lease it won passed and another worker
/// took the key over and completed it before that answer came. The checker
/// once flagged it: it judged a win by when it was answered.
#[test]
fn a_slow_answer_of_an_early_win_is_no_lost_record() {
    let history = History::new(Duration::from_millis(2));
    let t = Timeline::new();
    let minute = Duration::from_secs(60);
    history.record(t.call(1, 0, 120, t.claimed("t1", Duration::from_millis(40), 1)));
    history.record(t.call(2, 50, 51, t.claimed("t2", minute, 2)));
    history.record(t.call(
        2,
        60,
        61,
        Answer::Completed {
            token: dedupe_core::backend::stored_token("t2"),
            outcome: b"done".to_vec(),
        },
    ));
    history.check().expect("a legal history");
    // The same win asked after the completion returned is a lost record.
    history.record(t.call(3, 70, 71, t.claimed("t3", minute, 3)));
    let problems = history.check().expect_err("a done record won again");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("the done record was lost")),
        "{problems:?}"
    );
}

/// A second winner answered a moment before the first holder's release was
/// even asked held the key with it, however small the moment (the release and
/// the claim are both timed on this process's clock: no clock tolerance
/// applies). Once let through by a tolerance meant for store deadlines.
#[test]
fn a_win_before_the_release_was_asked_is_two_holders() {
    let t = Timeline::new();
    let minute = Duration::from_secs(60);
    let released = || Answer::Released(dedupe_core::backend::stored_token("t1"));
    let history = History::new(Duration::from_millis(20));
    history.record(t.call(1, 0, 1, t.claimed("t1", minute, 1)));
    history.record(t.call(2, 2, 3, t.claimed("t2", minute, 1)));
    history.record(t.call(1, 8, 9, released()));
    let problems = history.check().expect_err("two holders");
    assert!(
        problems.iter().any(|p| p.contains("two live holders")),
        "{problems:?}"
    );
    // Won after the release was asked: one holder after the other.
    let history = History::new(Duration::from_millis(20));
    history.record(t.call(1, 0, 1, t.claimed("t1", minute, 1)));
    history.record(t.call(1, 2, 3, released()));
    history.record(t.call(2, 2, 4, t.claimed("t2", minute, 1)));
    history.check().expect("a release, then a claim");
}

/// A Duplicate shows a done record as surely as an acknowledged completion
/// does (the completion's own answer may have been lost): a claim asked after
/// it returned that wins the key, or is answered InFlight, means the store lost
/// that record. Once let through: only completions that returned counted.
#[test]
fn a_win_after_a_duplicate_is_a_lost_record() {
    let t = Timeline::new();
    let minute = Duration::from_secs(60);
    let token = dedupe_core::backend::stored_token("t1");
    let history = History::new(Duration::from_millis(2));
    history.record(t.call(1, 0, 1, t.claimed("t1", minute, 1)));
    history.record(t.call(
        1,
        2,
        3,
        Answer::CompleteFailed {
            token,
            outcome: b"done".to_vec(),
            lease_lost: false,
        },
    ));
    history.record(t.call(2, 4, 5, Answer::Duplicate(b"done".to_vec())));
    history
        .check()
        .expect("a completion of unknown effect, then its Duplicate");
    history.record(t.call(3, 6, 7, t.claimed("t3", minute, 1)));
    let problems = history.check().expect_err("a done record won again");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("Duplicate had returned (the done record was lost)")),
        "{problems:?}"
    );
}

/// An InFlight answer must show the deadline in force while it ran: once an
/// extend has returned a new deadline, an InFlight asked afterwards carrying
/// the old one read a superseded lease. Once let through: any deadline the
/// lease ever had was accepted.
#[test]
fn an_in_flight_with_a_replaced_deadline_is_stale() {
    let t = Timeline::new();
    let minute = Duration::from_secs(60);
    let extended = t.now + 2 * minute;
    let in_flight = |deadline| Answer::InFlight {
        deadline,
        attempt: 1,
    };
    let history = History::new(Duration::from_millis(2));
    history.record(t.call(1, 0, 1, t.claimed("t1", minute, 1)));
    history.record(t.call(
        1,
        10,
        11,
        Answer::Extended {
            token: dedupe_core::backend::stored_token("t1"),
            deadline: extended,
        },
    ));
    // During the extend either deadline may be read; after it, only the new one.
    history.record(t.call(2, 5, 10, in_flight(t.now + minute)));
    history.record(t.call(2, 10, 12, in_flight(t.now + minute)));
    history.record(t.call(2, 20, 21, in_flight(extended)));
    history.check().expect("deadlines in force");
    history.record(t.call(3, 20, 21, in_flight(t.now + minute)));
    let problems = history.check().expect_err("a replaced deadline");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("replaced by an extend before the call")),
        "{problems:?}"
    );
}

/// A claim that failed (its effect unknown) could only have won the key once
/// the lease had passed, so it does not excuse a LeaseLost answered while the
/// lease was live. Once it did.
#[test]
fn a_failed_claim_does_not_excuse_a_lost_lease() {
    let t = Timeline::new();
    let minute = Duration::from_secs(60);
    let history = History::new(Duration::from_millis(2));
    history.record(t.call(1, 0, 1, t.claimed("t1", minute, 1)));
    history.record(t.call(
        2,
        2,
        3,
        Answer::Failed {
            error: "connection reset".into(),
            nothing_written: false,
        },
    ));
    history.record(t.call(
        1,
        4,
        5,
        Answer::CompleteFailed {
            token: dedupe_core::backend::stored_token("t1"),
            outcome: b"done".to_vec(),
            lease_lost: true,
        },
    ));
    let problems = history.check().expect_err("a guessed LeaseLost");
    assert!(
        problems.iter().any(|p| p.contains("was told its lease")),
        "{problems:?}"
    );
}

/// With every call recorded, a Mismatch (which reads a live record) on a key
/// no claim ever won is phantom.
#[test]
fn a_mismatch_on_a_key_nobody_won_is_phantom() {
    let t = Timeline::new();
    let history = History::new(Duration::from_millis(2)).every_in_flight_seen();
    history.record(t.call(1, 0, 1, Answer::Mismatch));
    let problems = history.check().expect_err("a phantom Mismatch");
    assert!(
        problems.iter().any(|p| p.contains("phantom Mismatch")),
        "{problems:?}"
    );
    let history = History::new(Duration::from_millis(2)).every_in_flight_seen();
    history.record(t.call(1, 0, 1, t.claimed("t1", Duration::from_secs(60), 1)));
    history.record(t.call(2, 2, 3, Answer::Mismatch));
    history.check().expect("a Mismatch of a live lease");
}
