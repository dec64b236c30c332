//! Many handles on one key at the same instant.

use super::*;

async fn race(factory: &dyn StoreFactory, keys: &[Key]) -> Result<Vec<Vec<ClaimOutcome>>, Failure> {
    let fixture = factory.create().await?;
    race_on(&*fixture, keys).await
}

async fn race_on(
    fixture: &dyn crate::harness::Fixture,
    keys: &[Key],
) -> Result<Vec<Vec<ClaimOutcome>>, Failure> {
    let mut handles = Vec::with_capacity(RACERS);
    for _ in 0..RACERS {
        handles.push(fixture.open_handle().await?);
    }
    let barrier = Arc::new(Barrier::new(RACERS));
    let keys: Arc<Vec<Key>> = Arc::new(keys.to_vec());
    let mut tasks = Vec::with_capacity(RACERS);
    for handle in handles {
        let barrier = Arc::clone(&barrier);
        let keys = Arc::clone(&keys);
        tasks.push(tokio::spawn(async move {
            let mut answers = Vec::with_capacity(keys.len());
            for k in keys.iter() {
                barrier.wait().await;
                answers.push(handle.claim(k, &ClaimOptions::new(LONG_TTL)).await);
            }
            answers
        }));
    }
    let mut per_round: Vec<Vec<ClaimOutcome>> = vec![Vec::with_capacity(RACERS); keys.len()];
    for task in tasks {
        let answers = task
            .await
            .map_err(|e| Failure::new(format!("a racing task died: {e}")))?;
        for (round, answer) in answers.into_iter().enumerate() {
            per_round[round].push(answer?);
        }
    }
    Ok(per_round)
}

fn judge_rounds(
    per_round: &[Vec<ClaimOutcome>],
    keys: &[Key],
    attempt: u32,
) -> Result<(), Failure> {
    for (round, answers) in per_round.iter().enumerate() {
        let winners: Vec<&Lease> = answers.iter().filter_map(ClaimOutcome::lease).collect();
        ensure!(
            winners.len() == 1,
            "round {round} on {}: {} of {RACERS} racers were Claimed, expected exactly 1",
            keys[round],
            winners.len()
        );
        ensure!(
            winners[0].attempt == attempt,
            "round {round}: the winner reports attempt {}, expected {attempt}",
            winners[0].attempt
        );
        for answer in answers {
            ensure!(
                matches!(
                    answer,
                    ClaimOutcome::Claimed(_) | ClaimOutcome::InFlight { .. }
                ),
                "round {round}: a losing racer answered {answer:?}, expected InFlight"
            );
        }
    }
    Ok(())
}

/// Rule 1: 32 tasks, each on its own handle, race one key behind a barrier, 100
/// rounds; exactly one is Claimed each round, the rest InFlight.
pub async fn single_winner_race(factory: &dyn StoreFactory) -> CheckResult {
    let keys: Vec<Key> = (0..ROUNDS)
        .map(|r| key(&format!("race-{r}")))
        .collect::<Result<_, _>>()?;
    let per_round = race(factory, &keys).await?;
    judge_rounds(&per_round, &keys, 1)?;
    Ok(Verdict::Passed)
}

/// Rule 1 for takeovers: each key's lease is left to pass, then 32 handles race to
/// take it over; exactly one wins (attempt 2) each round.
pub async fn single_winner_takeover_race(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let keys: Vec<Key> = (0..ROUNDS)
        .map(|r| key(&format!("takeover-race-{r}")))
        .collect::<Result<_, _>>()?;
    let mut latest = SystemTime::now();
    for chunk in keys.chunks(50) {
        for answer in store.claim_many(chunk, &opts(SHORT_TTL)).await? {
            let lease = answer
                .lease()
                .ok_or_else(|| Failure::new(format!("setup claim answered {answer:?}")))?;
            latest = latest.max(lease.deadline);
        }
    }
    wait_past(latest).await?;
    let per_round = race_on(&*fixture, &keys).await?;
    judge_rounds(&per_round, &keys, 2)?;
    Ok(Verdict::Passed)
}
