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
/// rounds (25 at reduced scale); exactly one is Claimed each round, the rest
/// InFlight.
pub async fn single_winner_race(factory: &dyn StoreFactory) -> CheckResult {
    let keys: Vec<Key> = (0..factory.scale().race_rounds())
        .map(|r| key(&format!("race-{r}")))
        .collect::<Result<_, _>>()?;
    let per_round = race(factory, &keys).await?;
    judge_rounds(&per_round, &keys, 1)?;
    Ok(Verdict::Passed)
}

/// Rule 1 for takeovers: each key's lease is left to pass, then 32 handles race to
/// take it over; exactly one wins (attempt 2) each round (100 rounds, 25 at
/// reduced scale). Then the same on done records whose retention passed: one
/// winner each, attempt 1.
pub async fn single_winner_takeover_race(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let keys = race_keys(factory, "takeover-race")?;
    wait_past(claim_and_let_pass(&*store, &keys, false).await?).await?;
    let per_round = race_on(&*fixture, &keys).await?;
    judge_rounds(&per_round, &keys, 2)?;

    // The same race on done records whose retention passed: each starts over
    // (attempt 1), and still exactly one claimer may win it.
    let done = race_keys(factory, "retention-race")?;
    wait_past(claim_and_let_pass(&*store, &done, true).await?).await?;
    let per_round = race_on(&*fixture, &done).await?;
    judge_rounds(&per_round, &done, 1)?;
    Ok(Verdict::Passed)
}

/// One key per race round, named `{prefix}-{round}`.
fn race_keys(factory: &dyn StoreFactory, prefix: &str) -> Result<Vec<Key>, Failure> {
    (0..factory.scale().race_rounds())
        .map(|r| key(&format!("{prefix}-{r}")))
        .collect()
}

/// Claims every key (50 to a batch) with a short lease, or, with `complete`,
/// with a long one completed at once with a short retention; answers when the
/// last of them stops being live.
async fn claim_and_let_pass(
    store: &dyn DedupeStore,
    keys: &[Key],
    complete: bool,
) -> Result<SystemTime, Failure> {
    let mut latest = SystemTime::now();
    for chunk in keys.chunks(50) {
        let ttl = if complete { LONG_TTL } else { SHORT_TTL };
        for answer in store.claim_many(chunk, &opts(ttl)).await? {
            let lease = answer
                .lease()
                .ok_or_else(|| Failure::new(format!("setup claim answered {answer:?}")))?;
            if complete {
                store.complete(lease, b"done", SHORT_TTL).await?;
                latest = latest.max(SystemTime::now() + SHORT_TTL);
            } else {
                latest = latest.max(lease.deadline);
            }
        }
    }
    Ok(latest)
}

/// What the stale holder does at its deadline in [`stale_holders_race_takeovers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HolderOp {
    Complete,
    Release,
    Extend,
}

/// One key's history in [`stale_holders_race_takeovers`].
#[derive(Debug, Default)]
struct KeyHistory {
    /// Did the holder's complete, release or extend succeed?
    holder_ok: Option<bool>,
    /// Attempt numbers of the claimers that were answered Claimed.
    claimed: Vec<u32>,
    /// Did those claimers' completes succeed?
    completes_ok: Vec<bool>,
}

/// Completes, releases and extends racing takeovers (rule 4): each key's holder
/// acts right at its lease deadline (a few milliseconds either side) while four
/// other handles keep claiming it to take over. Whatever order each race took,
/// the history must be one a correct store can give: a holder whose complete or
/// extend succeeded was never taken over; a release that succeeded leaves one
/// winner (attempt 1 after a removal, 2 after a release that found the lease
/// passed and removed nothing); at most one claimer ever wins a key,
/// and its completion lands; a holder that lost has been taken over, so no event
/// is left unclaimed.
pub async fn stale_holders_race_takeovers(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let mut claimers = Vec::with_capacity(CLAIMERS);
    for _ in 0..CLAIMERS {
        claimers.push(fixture.open_handle().await?);
    }
    for round in 0..STALE_ROUNDS {
        stale_round(&*fixture, &claimers, round).await?;
    }
    Ok(Verdict::Passed)
}

/// Keys per round of [`stale_holders_race_takeovers`], a third per operation.
const KEYS: usize = 48;
/// Handles that claim to take over.
const CLAIMERS: usize = 4;
/// Rounds: a race missed in one round is met in another.
const STALE_ROUNDS: usize = 3;

async fn stale_round(
    fixture: &dyn crate::harness::Fixture,
    claimers: &[Arc<dyn DedupeStore>],
    round: usize,
) -> Result<(), Failure> {
    let holder = fixture.store();
    let keys: Vec<Key> = (0..KEYS)
        .map(|i| key(&format!("stale-race-{round}-{i}")))
        .collect::<Result<_, _>>()?;
    let ops = [HolderOp::Complete, HolderOp::Release, HolderOp::Extend];
    let mut leases = Vec::with_capacity(KEYS);
    for k in &keys {
        let lease = must_claim(&*holder, k, &opts(SHORT_TTL)).await?;
        let ahead = lease
            .deadline
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        ensure!(
            ahead <= SHORT_TTL + CLOCK_SLACK,
            "a lease of {SHORT_TTL:?} has its deadline {ahead:?} away"
        );
        leases.push(lease);
    }
    let last = leases
        .iter()
        .map(|l| l.deadline)
        .max()
        .unwrap_or_else(SystemTime::now);
    // A claimer stops once the key is settled: won, done, or held by a long
    // lease (the holder's extension or another claimer's takeover). However
    // slow the store, every claimer keeps trying until then; the bound only
    // turns a store that never settles a key into a failure instead of a hang.
    let give_up = last + Duration::from_secs(30);

    // The holder: each key's operation at its deadline, from 1.5 ms before to
    // 0.5 ms after in steps of 125 µs, spread over the keys.
    let holder_task = {
        let holder = Arc::clone(&holder);
        let leases = leases.clone();
        tokio::spawn(async move {
            let runs = leases.into_iter().enumerate().map(|(i, lease)| {
                let holder = Arc::clone(&holder);
                async move {
                    let offset_us = (i / 3 % 16) as i64 * 125 - 1500;
                    let shift = Duration::from_micros(offset_us.unsigned_abs());
                    let at = if offset_us < 0 {
                        lease.deadline - shift
                    } else {
                        lease.deadline + shift
                    };
                    until(at).await;
                    let result = match ops[i % 3] {
                        HolderOp::Complete => {
                            holder.complete(&lease, b"stale holder", LONG_TTL).await
                        }
                        HolderOp::Release => holder.release(&lease).await,
                        HolderOp::Extend => holder.extend(&lease, LONG_TTL).await.map(|_| ()),
                    };
                    (i, result)
                }
            });
            futures_util::future::join_all(runs).await
        })
    };
    // The claimers: two per key, on different handles, from just before its
    // deadline until the key is settled; each completes what it wins.
    let mut claimer_tasks = Vec::with_capacity(KEYS * 2);
    for (i, k) in keys.iter().enumerate() {
        for c in 0..2 {
            let store = Arc::clone(&claimers[(i + c) % CLAIMERS]);
            let (k, start) = (k.clone(), leases[i].deadline - Duration::from_millis(1));
            let short_deadline = leases[i].deadline;
            claimer_tasks.push(tokio::spawn(async move {
                until(start).await;
                while SystemTime::now() < give_up {
                    match store.claim(&k, &opts(LONG_TTL)).await? {
                        ClaimOutcome::Claimed(lease) => {
                            let done = store
                                .complete(&lease, format!("claimer {c}").as_bytes(), LONG_TTL)
                                .await;
                            return match done {
                                Ok(()) => Ok(Some((i, lease.attempt, true))),
                                Err(Error::LeaseLost { .. }) => Ok(Some((i, lease.attempt, false))),
                                Err(e) => Err(Failure::from(e)),
                            };
                        }
                        ClaimOutcome::Duplicate { .. } => return Ok(None),
                        // Held by a lease far beyond the holder's short one.
                        ClaimOutcome::InFlight { deadline, .. }
                            if deadline > short_deadline + LONG_TTL / 2 =>
                        {
                            return Ok(None)
                        }
                        ClaimOutcome::InFlight { .. } => tokio::task::yield_now().await,
                        other => {
                            return Err(Failure::new(format!(
                                "a claimer of {k} was answered {other:?}"
                            )))
                        }
                    }
                }
                Ok::<_, Failure>(None)
            }));
        }
    }
    let mut history: Vec<KeyHistory> = (0..KEYS).map(|_| KeyHistory::default()).collect();
    for (i, result) in holder_task
        .await
        .map_err(|e| Failure::new(format!("the holder task died: {e}")))?
    {
        history[i].holder_ok = Some(match result {
            Ok(()) => true,
            Err(Error::LeaseLost { .. }) => false,
            Err(e) => return Err(Failure::from(e)),
        });
    }
    for task in claimer_tasks {
        if let Some((i, attempt, completed)) = task
            .await
            .map_err(|e| Failure::new(format!("a claimer task died: {e}")))??
        {
            history[i].claimed.push(attempt);
            history[i].completes_ok.push(completed);
        }
    }
    for (i, h) in history.iter().enumerate() {
        let op = ops[i % 3];
        let holder_ok = h.holder_ok.unwrap_or(false);
        let shown = format!("{} ({op:?} by the stale holder): {h:?}", keys[i]);
        ensure!(
            h.claimed.len() <= 1,
            "{shown}: {} claimers won the key; at most one may",
            h.claimed.len()
        );
        ensure!(
            h.completes_ok.iter().all(|ok| *ok),
            "{shown}: a claimer's lease was lost before it completed, so two holders ran"
        );
        match (op, holder_ok) {
            (HolderOp::Complete | HolderOp::Extend, true) => ensure!(
                h.claimed.is_empty(),
                "{shown}: the holder's {op:?} succeeded, yet the key was taken over"
            ),
            // Removed while held (a fresh claim, attempt 1), or found passed
            // with nothing live under the key and left for the takeover
            // (attempt 2).
            (HolderOp::Release, true) => ensure!(
                h.claimed == [1] || h.claimed == [2],
                "{shown}: after a successful release exactly one claim must win the key (attempt 1, or 2 when the release came after the lease passed)"
            ),
            (_, false) => ensure!(
                h.claimed == [2],
                "{shown}: the holder lost its lease, so exactly one takeover (attempt 2) must have won"
            ),
        }
        let record = live_record(&*holder, &keys[i], "after the race").await?;
        let stale_won = holder_ok && op == HolderOp::Complete;
        match (&record.state, stale_won, op) {
            (RecordState::Done { outcome, .. }, true, _) => ensure!(
                outcome == b"stale holder",
                "{shown}: the stored outcome is {outcome:?}, the holder's complete won"
            ),
            (RecordState::InFlight { .. }, false, HolderOp::Extend) if holder_ok => ensure!(
                record.token == leases[i].token,
                "{shown}: the extended lease's record has another token"
            ),
            (RecordState::Done { outcome, .. }, false, _) => ensure!(
                outcome.starts_with(b"claimer "),
                "{shown}: the stored outcome {outcome:?} is not the winning claimer's"
            ),
            (state, _, _) => {
                return Err(Failure::new(format!(
                    "{shown}: the record ended as {state:?}"
                )))
            }
        }
    }
    Ok(())
}

/// Batches racing batches (rule 1 for `claim_many`): eight handles claim the same
/// forty keys in one batch each, in different orders (ascending, descending,
/// rotated, with a key repeated), at the same instant, for ten rounds (three at
/// reduced scale). Each key
/// has exactly one winner across all batches, every other answer is InFlight,
/// and no batch fails (a store that locks rows in batch order deadlocks here).
pub async fn batches_race_batches(factory: &dyn StoreFactory) -> CheckResult {
    const HANDLES: usize = 8;
    const KEYS: usize = 40;
    let fixture = factory.create().await?;
    let mut handles = Vec::with_capacity(HANDLES);
    for _ in 0..HANDLES {
        handles.push(fixture.open_handle().await?);
    }
    for round in 0..factory.scale().batch_rounds() {
        let keys: Vec<Key> = (0..KEYS)
            .map(|i| key(&format!("batch-race-{round}-{i}")))
            .collect::<Result<_, _>>()?;
        let barrier = Arc::new(Barrier::new(HANDLES));
        let tasks: Vec<_> = handles
            .iter()
            .enumerate()
            .map(|(h, store)| {
                let mut order: Vec<Key> = keys.clone();
                if h % 2 == 1 {
                    order.reverse();
                }
                order.rotate_left((h * 7) % KEYS);
                order.push(order[0].clone()); // a repeat inside the batch
                let (store, barrier) = (Arc::clone(store), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    let answers = store.claim_many(&order, &opts(LONG_TTL)).await;
                    (order, answers)
                })
            })
            .collect();
        let mut winners: std::collections::HashMap<Key, usize> = std::collections::HashMap::new();
        for task in tasks {
            let (order, answers) = task
                .await
                .map_err(|e| Failure::new(format!("a batch task died: {e}")))?;
            let answers = answers.map_err(|e| {
                Failure::new(format!(
                    "round {round}: a batch racing other batches failed: {e}"
                ))
            })?;
            ensure!(
                answers.len() == order.len(),
                "claim_many answered {} times for {} keys",
                answers.len(),
                order.len()
            );
            for (k, answer) in order.iter().zip(&answers) {
                match answer {
                    ClaimOutcome::Claimed(_) => *winners.entry(k.clone()).or_default() += 1,
                    ClaimOutcome::InFlight { .. } => {}
                    other => {
                        return Err(Failure::new(format!(
                            "round {round}: {k} answered {other:?} in a racing batch"
                        )))
                    }
                }
            }
        }
        for k in &keys {
            let n = winners.get(k).copied().unwrap_or(0);
            ensure!(
                n == 1,
                "round {round}: {k} was Claimed {n} times across {HANDLES} racing batches"
            );
        }
    }
    Ok(Verdict::Passed)
}

/// `expire` racing takeovers (rule 5, rule 1): while one handle runs `expire()`
/// over and over, four others take over keys whose leases passed, one key a
/// millisecond. Every takeover answered Claimed must still hold its key
/// afterwards (a live in-flight record with its token). A purge that finds the
/// expired keys first and deletes them by key later, without judging the
/// deadline again, deletes fresh claims: the event would then run twice. Three
/// rounds of 64 keys.
pub async fn expire_races_takeovers(factory: &dyn StoreFactory) -> CheckResult {
    const KEYS: usize = 64;
    const CLAIMERS: usize = 4;
    let fixture = factory.create().await?;
    let store = fixture.store();
    let purger = fixture.open_handle().await?;
    let mut claimers = Vec::with_capacity(CLAIMERS);
    for _ in 0..CLAIMERS {
        claimers.push(fixture.open_handle().await?);
    }
    for round in 0..3 {
        let keys: Vec<Key> = (0..KEYS)
            .map(|i| key(&format!("purge-race-{round}-{i}")))
            .collect::<Result<_, _>>()?;
        wait_past(claim_and_let_pass(&*store, &keys, false).await?).await?;
        let claiming = Arc::new(std::sync::atomic::AtomicUsize::new(CLAIMERS));
        let barrier = Arc::new(Barrier::new(CLAIMERS + 1));
        let purge = {
            let (purger, claiming, barrier) = (
                Arc::clone(&purger),
                Arc::clone(&claiming),
                Arc::clone(&barrier),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                let mut runs = 0u32;
                while claiming.load(std::sync::atomic::Ordering::SeqCst) > 0 || runs == 0 {
                    purger.expire().await?;
                    runs += 1;
                    tokio::task::yield_now().await;
                }
                Ok::<u32, Error>(runs)
            })
        };
        let tasks: Vec<_> = claimers
            .iter()
            .enumerate()
            .map(|(c, handle)| {
                let mine: Vec<Key> = keys.iter().skip(c).step_by(CLAIMERS).cloned().collect();
                let (handle, claiming, barrier) = (
                    Arc::clone(handle),
                    Arc::clone(&claiming),
                    Arc::clone(&barrier),
                );
                tokio::spawn(async move {
                    // Counts this claimer out however it ends, so the purge stops.
                    struct Done(Arc<std::sync::atomic::AtomicUsize>);
                    impl Drop for Done {
                        fn drop(&mut self) {
                            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    let _done = Done(claiming);
                    barrier.wait().await;
                    let mut taken = Vec::with_capacity(mine.len());
                    for k in mine {
                        let answer = handle.claim(&k, &opts(LONG_TTL)).await;
                        taken.push((k, answer));
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    taken
                })
            })
            .collect();
        let mut leases = Vec::with_capacity(KEYS);
        for task in tasks {
            let taken = task
                .await
                .map_err(|e| Failure::new(format!("a claiming task died: {e}")))?;
            for (k, answer) in taken {
                match answer? {
                    ClaimOutcome::Claimed(lease) => leases.push(lease),
                    other => {
                        return Err(Failure::new(format!(
                            "round {round}: {k}, whose lease passed, answered {other:?} to the \
                             only claim after it, expected Claimed"
                        )))
                    }
                }
            }
        }
        purge
            .await
            .map_err(|e| Failure::new(format!("the purging task died: {e}")))??;
        for lease in leases {
            let record = store.get(&lease.key).await?;
            match &record {
                Some(r)
                    if r.token == lease.token
                        && matches!(r.state, RecordState::InFlight { .. }) => {}
                _ => {
                    return Err(Failure::new(format!(
                        "round {round}: {} was taken over (attempt {}) while expire() ran, \
                         and then get shows {record:?}: the purge removed or changed a live claim",
                        lease.key, lease.attempt
                    )))
                }
            }
        }
    }
    Ok(Verdict::Passed)
}

/// `forget` racing claims of the same keys on another handle (rule 10: a
/// forget removes the record it read, never a newer one). Every key starts
/// with an in-flight record whose lease has passed; then, key by key, one
/// handle forgets it while another claims it, the claim sent 0 to 3 ms after
/// the forget (so that it lands inside a forget made of a read and a delete
/// on some keys). Wherever the claim answered Claimed and the forget answered
/// `false` (it found nothing live, so it ran before the claim, or read the
/// old record), the claim's record must still be there: a forget that reads
/// the old record and then deletes whatever is under the key removes the
/// new claim, and a third claim wins while the second still works. Three
/// rounds of 32 keys.
pub async fn forget_races_claims(factory: &dyn StoreFactory) -> CheckResult {
    const KEYS: usize = 32;
    let fixture = factory.create().await?;
    let store = fixture.store();
    let forgetter = fixture.open_handle().await?;
    let claimer = fixture.open_handle().await?;
    for round in 0..3 {
        let keys: Vec<Key> = (0..KEYS)
            .map(|i| key(&format!("forget-race-{round}-{i}")))
            .collect::<Result<_, _>>()?;
        wait_past(claim_and_let_pass(&*store, &keys, false).await?).await?;
        for (i, k) in keys.iter().enumerate() {
            let delay = Duration::from_millis((i % 4) as u64);
            let (forgot, claimed) = tokio::join!(forgetter.forget(k), async {
                tokio::time::sleep(delay).await;
                claimer.claim(k, &opts(LONG_TTL)).await
            });
            let (forgot, claimed) = (forgot?, claimed?);
            let ClaimOutcome::Claimed(lease) = claimed else {
                continue;
            };
            if forgot {
                continue;
            }
            let record = store.get(k).await?;
            ensure!(
                record.as_ref().is_some_and(|r| r.token == lease.token),
                "{k}: a claim answered Claimed and a forget racing it answered false (it \
                 found nothing live), yet the claim's record is gone ({record:?}): the forget \
                 removed a record newer than the one it read"
            );
        }
    }
    Ok(Verdict::Passed)
}
