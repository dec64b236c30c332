//! Races across OS processes, which a store's own tests run: the parent test
//! calls [`race_across_processes`], which starts copies of the test binary, each
//! running one ignored child test that opens its handles and calls
//! [`run_race_child`]; every child claims the same keys at the same moment and
//! prints one [`answer_line`] per claim, and the parent judges every child's
//! output together with [`judge_answers`].
//!
//! ```no_run
//! // tests/processes.rs of a store crate
//! use std::sync::Arc;
//! use dedupe_conformance::processes::{race_across_processes, run_race_child};
//! use dedupe_core::{DedupeStore, MemoryStore};
//!
//! #[test]
//! fn single_winner_across_processes() {
//!     // Tell the children where the shared store is (a file, a URL, a schema).
//!     let env = [("MY_STORE_URL", "...".to_string())];
//!     race_across_processes("child_racer", 4, 8, 100, &env).unwrap_or_else(|f| panic!("{f}"));
//! }
//!
//! #[tokio::test]
//! #[ignore = "run by single_winner_across_processes in a child process"]
//! async fn child_racer() {
//!     let handles: Vec<Arc<dyn DedupeStore>> = Vec::new(); // open 8 handles on MY_STORE_URL
//!     run_race_child(handles).await;
//! }
//! # fn main() {}
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
use tokio::sync::Barrier;

use crate::children::{self, Children};
use crate::harness::Failure;

const PREFIX: &str = "ANSWER ";
/// Rounds to race.
const ROUNDS_VAR: &str = "DEDUPE_RACE_ROUNDS";
/// How long either side waits for the other before it fails.
const MEET_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the children may race once started.
const RACE_TIMEOUT: Duration = Duration::from_secs(300);

/// The parent's side: starts `processes` copies of the current test binary, each
/// running the ignored test `child_test` with `env` set (where the shared store
/// is); waits until every child has opened its handles; starts them together;
/// then judges every answer: each of `rounds` keys Claimed exactly once across
/// all `processes * racers_per_process` racers, the others InFlight.
pub fn race_across_processes(
    child_test: &str,
    processes: usize,
    racers_per_process: usize,
    rounds: usize,
    env: &[(&str, String)],
) -> Result<(), Failure> {
    let mut children = Children::new("race", child_test, env)?;
    for _ in 0..processes {
        children.spawn(&[(ROUNDS_VAR, rounds.to_string())])?;
    }
    let dir = children.dir().to_path_buf();
    for index in 0..processes {
        wait_for_file(&dir.join(format!("ready-{index}")))
            .map_err(|()| Failure::new(format!("child {index} never opened its handles")))?;
    }
    std::fs::write(dir.join("go"), b"go").map_err(|e| Failure::new(format!("go file: {e}")))?;
    let started = Instant::now();
    while !children.live.is_empty() {
        if started.elapsed() > RACE_TIMEOUT {
            return Err(Failure::new(format!(
                "the racing children did not finish within {RACE_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
        children.reap()?;
    }
    let outputs: Vec<String> = (0..processes).map(|i| children.stdout(i)).collect();
    judge_answers(&outputs, rounds, processes * racers_per_process)
}

fn wait_for_file(path: &Path) -> Result<(), ()> {
    let started = Instant::now();
    while !path.exists() {
        if started.elapsed() > MEET_TIMEOUT {
            return Err(());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// The child's side, called by the ignored child test with its handles already
/// open (each with its own connection): says it is ready, waits for the parent's
/// start, races every handle on the same keys round by round, and prints the
/// answers for the parent to judge. Panics (failing the child) on any error.
pub async fn run_race_child(handles: Vec<Arc<dyn DedupeStore>>) {
    let dir = children::dir();
    let index = children::index();
    let rounds = children::number(ROUNDS_VAR);
    std::fs::write(dir.join(format!("ready-{index}")), b"ready").expect("ready file");
    let go = dir.join("go");
    let started = Instant::now();
    while !go.exists() {
        assert!(started.elapsed() < MEET_TIMEOUT, "the parent never said go");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let lines = race_rounds(handles, rounds)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    for line in lines {
        println!("{line}");
    }
}

/// The line a racing child prints for its answer in `round`.
pub fn answer_line(round: usize, answer: &ClaimOutcome) -> String {
    format!("{PREFIX}{round} {}", answer.kind())
}

/// The child's side: races every handle on keys `race:round-0` ..
/// `race:round-{rounds-1}`, one round at a time behind a barrier, and answers the
/// [`answer_line`]s to print, every handle's answer for every round.
pub async fn race_rounds(
    handles: Vec<Arc<dyn DedupeStore>>,
    rounds: usize,
) -> Result<Vec<String>, Failure> {
    let barrier = Arc::new(Barrier::new(handles.len()));
    let tasks: Vec<_> = handles
        .into_iter()
        .map(|store| {
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                let mut lines = Vec::with_capacity(rounds);
                for round in 0..rounds {
                    barrier.wait().await;
                    let key = Key::new("race", format!("round-{round}"))
                        .map_err(|e| Failure::new(e.to_string()))?;
                    let answer = store
                        .claim(&key, &ClaimOptions::new(Duration::from_secs(600)))
                        .await?;
                    lines.push(answer_line(round, &answer));
                }
                Ok::<_, Failure>(lines)
            })
        })
        .collect();
    let mut lines = Vec::new();
    for task in tasks {
        lines.extend(
            task.await
                .map_err(|e| Failure::new(format!("a racing task died: {e}")))??,
        );
    }
    Ok(lines)
}

/// Judges the output of every child of a cross-process race: each of `rounds`
/// rounds must have `racers` answers, exactly one `claimed`, the rest `in-flight`.
/// Lines without an answer (test harness chatter) are ignored, even when the
/// harness printed them on the same line.
pub fn judge_answers(outputs: &[String], rounds: usize, racers: usize) -> Result<(), Failure> {
    let mut claimed = vec![0usize; rounds];
    let mut answers = vec![0usize; rounds];
    for line in outputs.iter().flat_map(|o| o.lines()) {
        let Some((_, rest)) = line.split_once(PREFIX) else {
            continue;
        };
        let (round, kind) = rest
            .split_once(' ')
            .ok_or_else(|| Failure::new(format!("malformed answer line {line:?}")))?;
        let round: usize = round
            .parse()
            .ok()
            .filter(|r| *r < rounds)
            .ok_or_else(|| Failure::new(format!("answer line names no round: {line:?}")))?;
        answers[round] += 1;
        match kind {
            "claimed" => claimed[round] += 1,
            "in-flight" => {}
            other => {
                return Err(Failure::new(format!(
                    "round {round}: a racer answered {other}, expected claimed or in-flight"
                )))
            }
        }
    }
    for round in 0..rounds {
        if answers[round] != racers {
            return Err(Failure::new(format!(
                "round {round}: {} answers from {racers} racers",
                answers[round]
            )));
        }
        if claimed[round] != 1 {
            return Err(Failure::new(format!(
                "round {round}: {} racers across processes were Claimed, expected exactly 1",
                claimed[round]
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judges_winners_and_missing_answers() {
        let ok = vec![
            "test x ... ANSWER 0 claimed\nANSWER 0 in-flight".to_string(),
            "ANSWER 1 in-flight\nANSWER 1 claimed".into(),
        ];
        assert!(judge_answers(&ok, 2, 2).is_ok());
        let two_winners = vec!["ANSWER 0 claimed\nANSWER 0 claimed".to_string()];
        assert!(judge_answers(&two_winners, 1, 2).is_err());
        let missing = vec!["ANSWER 0 claimed".to_string()];
        assert!(judge_answers(&missing, 1, 2).is_err());
        let duplicate = vec!["ANSWER 0 claimed\nANSWER 0 duplicate".to_string()];
        assert!(judge_answers(&duplicate, 1, 2).is_err());
    }
}
