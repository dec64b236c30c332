//! Helpers for races across OS processes, which a store's own tests run (each
//! backend spawns its children differently): children print one line per claim
//! with [`answer_line`], the parent judges every child's output together with
//! [`judge_answers`].

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
use tokio::sync::Barrier;

use crate::harness::Failure;

const PREFIX: &str = "ANSWER ";

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
