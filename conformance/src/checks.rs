//! Every rule of the store contract as a named check.
//!
//! Each check takes a [`StoreFactory`], creates its own empty store, and answers
//! [`Verdict::Passed`], [`Verdict::Skipped`] or a [`Failure`] that says what the
//! store did wrong.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedupe_core::{
    ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease, RecordState,
    RecordStateKind, MAX_ID_BYTES, MAX_NAMESPACE_BYTES,
};
use tokio::sync::Barrier;

use crate::harness::{CheckResult, Failure, StoreFactory, Verdict};

/// Lease used where a check needs it to pass quickly.
pub const SHORT_TTL: Duration = Duration::from_millis(250);
/// Lease or retention used where a check needs it to outlive the check.
pub const LONG_TTL: Duration = Duration::from_secs(600);
/// Tasks racing on one key in the race checks.
pub const RACERS: usize = 32;
/// Rounds of each race.
pub const ROUNDS: usize = 100;
/// Slack allowed between the caller's clock and a store's clock when judging a
/// deadline the store reported.
const CLOCK_SLACK: Duration = Duration::from_secs(2);
/// Margin past a deadline before a check relies on it having passed.
const PAST_MARGIN: Duration = Duration::from_millis(30);

type CheckFuture<'a> = Pin<Box<dyn Future<Output = CheckResult> + Send + 'a>>;

/// A named check in the suite.
#[derive(Clone, Copy)]
pub struct Check {
    /// Its name, as the test the [`suite!`](crate::suite) macro generates.
    pub name: &'static str,
    /// Runs it.
    pub run: for<'a> fn(&'a dyn StoreFactory) -> CheckFuture<'a>,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish()
    }
}

macro_rules! checks {
    ($($name:ident),* $(,)?) => {
        /// Every check, in the order the runner runs them.
        pub const CHECKS: &[Check] = &[$(Check {
            name: stringify!($name),
            run: |factory| Box::pin($name(factory)),
        }),*];
    };
}

checks!(
    fresh_claim,
    in_flight_answer,
    duplicate_returns_exact_outcome,
    release_then_reclaim,
    lease_expiry_takeover,
    stale_holder_is_fenced,
    extend_pushes_deadline,
    retention_expiry,
    expire_removes_exactly_expired,
    fingerprint_mismatch,
    reentrant_claim_id,
    claim_many_matches_claim,
    namespaces_isolate,
    key_case_unicode_and_max_length,
    bad_input_rejected_nothing_written,
    forget_removes_any_state,
    ten_thousand_distinct_keys,
    single_winner_race,
    single_winner_takeover_race,
    matches_reference_store,
);

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(Failure::new(format!($($arg)+)));
        }
    };
}

fn key(id: &str) -> Result<Key, Failure> {
    Key::new("conf", id).map_err(|e| Failure::new(format!("test key {id:?} refused: {e}")))
}

fn opts(ttl: Duration) -> ClaimOptions {
    ClaimOptions::new(ttl)
}

async fn must_claim(
    store: &dyn DedupeStore,
    key: &Key,
    opts: &ClaimOptions,
) -> Result<Lease, Failure> {
    match store.claim(key, opts).await? {
        ClaimOutcome::Claimed(lease) => {
            ensure!(
                &lease.key == key,
                "Claimed lease names key {} for a claim of {key}",
                lease.key
            );
            Ok(lease)
        }
        other => Err(Failure::new(format!(
            "claim of {key} answered {other:?}, expected Claimed"
        ))),
    }
}

/// Sleeps until `deadline` (of a short lease or retention) has passed by a small
/// margin, on the caller's clock. A deadline further away than a short TTL plus the
/// clock slack is itself a failure: the store did not honour the TTL asked for.
async fn wait_past(deadline: SystemTime) -> Result<(), Failure> {
    let target = deadline + PAST_MARGIN;
    if let Ok(left) = target.duration_since(SystemTime::now()) {
        ensure!(
            left <= SHORT_TTL + CLOCK_SLACK,
            "a deadline set {SHORT_TTL:?} ahead is {left:?} away"
        );
        tokio::time::sleep(left).await;
    }
    Ok(())
}

fn expect_lease_lost(
    what: &str,
    result: Result<impl std::fmt::Debug, Error>,
) -> Result<(), Failure> {
    match result {
        Err(Error::LeaseLost { .. }) => Ok(()),
        other => Err(Failure::new(format!(
            "{what} answered {other:?}, expected LeaseLost"
        ))),
    }
}

fn deadline_near(
    what: &str,
    deadline: SystemTime,
    before: SystemTime,
    after: SystemTime,
    ttl: Duration,
) -> Result<(), Failure> {
    let low = before + ttl - CLOCK_SLACK;
    let high = after + ttl + CLOCK_SLACK;
    ensure!(
        deadline >= low && deadline <= high,
        "{what} deadline {deadline:?} is not now + {ttl:?} (expected between {low:?} and {high:?})"
    );
    Ok(())
}

/// A fresh key is Claimed: attempt 1, no takeover, deadline now + lease TTL, and
/// `get` shows it in flight with that token.
pub async fn fresh_claim(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("fresh")?;
    ensure!(
        store.get(&k).await?.is_none(),
        "get of a never-claimed key found a record"
    );
    let ttl = Duration::from_secs(30);
    let before = SystemTime::now();
    let lease = must_claim(&*store, &k, &opts(ttl)).await?;
    let after = SystemTime::now();
    ensure!(
        lease.attempt == 1 && !lease.is_takeover(),
        "fresh claim reported attempt {}",
        lease.attempt
    );
    deadline_near("fresh lease", lease.deadline, before, after, ttl)?;
    let record = store
        .get(&k)
        .await?
        .ok_or_else(|| Failure::new("get found no record after a claim"))?;
    ensure!(
        record.key == k,
        "get returned record of {} for {k}",
        record.key
    );
    ensure!(
        record.token == lease.token,
        "get shows token {:?}, lease has {:?}",
        record.token,
        lease.token
    );
    ensure!(
        record.attempts == 1,
        "get shows {} attempts after one claim",
        record.attempts
    );
    match record.state {
        RecordState::InFlight { lease_deadline } => {
            ensure!(
                lease_deadline == lease.deadline,
                "get shows deadline {lease_deadline:?}, lease has {:?}",
                lease.deadline
            )
        }
        other => {
            return Err(Failure::new(format!(
                "get shows {other:?} after a claim, expected in flight"
            )))
        }
    }
    ensure!(
        store.get(&k).await? == Some(record),
        "a second get saw a different record: get must not change it"
    );
    Ok(Verdict::Passed)
}

/// A second claim of a live in-flight key answers InFlight with the holder's
/// deadline and attempt, and changes nothing.
pub async fn in_flight_answer(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("busy")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    for _ in 0..3 {
        match store.claim(&k, &opts(LONG_TTL)).await? {
            ClaimOutcome::InFlight { deadline, attempt } => {
                ensure!(
                    deadline == lease.deadline,
                    "InFlight deadline {deadline:?} is not the holder's {:?}",
                    lease.deadline
                );
                ensure!(attempt == 1, "InFlight attempt {attempt}, expected 1");
            }
            other => {
                return Err(Failure::new(format!(
                    "claim of a live in-flight key answered {other:?}, expected InFlight"
                )))
            }
        }
    }
    let record = store
        .get(&k)
        .await?
        .ok_or_else(|| Failure::new("record vanished"))?;
    ensure!(
        record.token == lease.token,
        "an InFlight answer changed the stored token"
    );
    store.complete(&lease, b"done", LONG_TTL).await?;
    Ok(Verdict::Passed)
}

/// A done key answers Duplicate with the stored outcome byte for byte: empty,
/// small, every byte value, and 64 KiB.
pub async fn duplicate_returns_exact_outcome(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    let big: Vec<u8> = (0..64 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let cases: [(&str, &[u8]); 4] = [
        ("empty", b""),
        ("small", b"order 17 created"),
        ("bytes", &all_bytes),
        ("64k", &big),
    ];
    for (id, outcome) in cases {
        let k = key(&format!("dup-{id}"))?;
        let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
        let before = SystemTime::now();
        store.complete(&lease, outcome, LONG_TTL).await?;
        let after = SystemTime::now();
        for round in 0..2 {
            match store.claim(&k, &opts(LONG_TTL)).await? {
                ClaimOutcome::Duplicate {
                    outcome: got,
                    completed_at,
                } => {
                    ensure!(
                        got == outcome,
                        "Duplicate for {id} outcome ({} bytes) returned {} bytes that differ",
                        outcome.len(),
                        got.len()
                    );
                    ensure!(
                        completed_at + CLOCK_SLACK >= before && completed_at <= after + CLOCK_SLACK,
                        "completed_at {completed_at:?} is not when complete ran"
                    );
                }
                other => {
                    return Err(Failure::new(format!(
                        "claim #{round} of a done key answered {other:?}, expected Duplicate"
                    )))
                }
            }
        }
        match store.get(&k).await?.map(|r| r.state) {
            Some(RecordState::Done {
                outcome: got,
                retention_deadline,
                ..
            }) => {
                ensure!(got == outcome, "get shows a different outcome for {id}");
                deadline_near("retention", retention_deadline, before, after, LONG_TTL)?;
            }
            other => return Err(Failure::new(format!("get of a done key shows {other:?}"))),
        }
        expect_lease_lost(
            "a second complete of the same lease",
            store.complete(&lease, b"again", LONG_TTL).await,
        )?;
    }
    Ok(Verdict::Passed)
}

/// Release removes the record; the next claim wins with a new token, attempt 1;
/// the released lease can no longer complete.
pub async fn release_then_reclaim(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("released")?;
    let first = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    store.release(&first).await?;
    ensure!(
        store.get(&k).await?.is_none(),
        "get still finds a record after release"
    );
    let second = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    ensure!(
        second.token != first.token,
        "the claim after a release reused the released token"
    );
    ensure!(
        second.attempt == 1,
        "the claim after a release reports attempt {}, expected 1",
        second.attempt
    );
    expect_lease_lost(
        "release of an already released lease",
        store.release(&first).await,
    )?;
    expect_lease_lost(
        "complete with a released lease",
        store.complete(&first, b"x", LONG_TTL).await,
    )?;
    store.complete(&second, b"ok", LONG_TTL).await?;
    expect_lease_lost("release after complete", store.release(&second).await)?;
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "release after complete removed a done record"
    );
    Ok(Verdict::Passed)
}

/// A live lease answers InFlight; once its deadline passes the next claim takes it
/// over with a new token and attempt 2, and `get` shows the new holder.
pub async fn lease_expiry_takeover(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("takeover")?;
    let first = must_claim(&*store, &k, &opts(SHORT_TTL)).await?;
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::InFlight { .. }
        ),
        "a claim before the lease deadline did not answer InFlight"
    );
    wait_past(first.deadline).await?;
    ensure!(
        store.get(&k).await?.is_none(),
        "get shows an in-flight record whose lease passed (expiry must be logical)"
    );
    let second = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    ensure!(
        second.token != first.token,
        "the takeover reused the dead worker's token"
    );
    ensure!(
        second.attempt == 2 && second.is_takeover(),
        "the takeover reports attempt {}, expected 2",
        second.attempt
    );
    let record = store
        .get(&k)
        .await?
        .ok_or_else(|| Failure::new("no record after takeover"))?;
    ensure!(
        record.attempts == 2 && record.token == second.token,
        "get after takeover shows {record:?}"
    );
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::InFlight { attempt: 2, .. }
        ),
        "after the takeover the key is not in flight at attempt 2"
    );
    Ok(Verdict::Passed)
}

/// After a takeover the stale holder's complete, release and extend answer
/// LeaseLost and leave the new holder's record exactly as it was.
pub async fn stale_holder_is_fenced(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("fenced")?;
    let stale = must_claim(&*store, &k, &opts(SHORT_TTL)).await?;
    wait_past(stale.deadline).await?;
    // Past its deadline and not yet taken over, the lease is already dead.
    expect_lease_lost(
        "extend of a lease past its deadline",
        store.extend(&stale, LONG_TTL).await,
    )?;
    let holder = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    let before = store.get(&k).await?;
    expect_lease_lost(
        "stale complete",
        store.complete(&stale, b"stale work", LONG_TTL).await,
    )?;
    expect_lease_lost("stale release", store.release(&stale).await)?;
    expect_lease_lost("stale extend", store.extend(&stale, LONG_TTL).await)?;
    let after = store.get(&k).await?;
    ensure!(
        before == after,
        "stale calls changed the new holder's record: {before:?} became {after:?}"
    );
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::InFlight { .. } => {}
        other => {
            return Err(Failure::new(format!(
                "after stale calls the key answers {other:?}, expected InFlight"
            )))
        }
    }
    store.complete(&holder, b"holder work", LONG_TTL).await?;
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::Duplicate { outcome, .. } => {
            ensure!(outcome == b"holder work", "stored outcome is {outcome:?}")
        }
        other => {
            return Err(Failure::new(format!(
                "after the holder completed the key answers {other:?}"
            )))
        }
    }
    Ok(Verdict::Passed)
}

/// Extend pushes the deadline out so the lease outlives its first TTL; a lost
/// lease cannot be extended.
pub async fn extend_pushes_deadline(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("extended")?;
    let lease = must_claim(&*store, &k, &opts(SHORT_TTL)).await?;
    let before = SystemTime::now();
    let extended = store.extend(&lease, LONG_TTL).await?;
    let after = SystemTime::now();
    ensure!(extended.token == lease.token, "extend changed the token");
    deadline_near("extended lease", extended.deadline, before, after, LONG_TTL)?;
    wait_past(lease.deadline).await?;
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::InFlight { deadline, .. } => {
            ensure!(
                deadline == extended.deadline,
                "InFlight shows deadline {deadline:?}, extend answered {:?}",
                extended.deadline
            )
        }
        other => {
            return Err(Failure::new(format!(
                "an extended lease past its first deadline answers {other:?}, expected InFlight"
            )))
        }
    }
    store.complete(&extended, b"long work", LONG_TTL).await?;
    expect_lease_lost(
        "extend after complete",
        store.extend(&extended, LONG_TTL).await,
    )?;
    Ok(Verdict::Passed)
}

/// A done record answers Duplicate inside its retention and counts as absent the
/// moment the retention passes, removed or not.
pub async fn retention_expiry(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("retained")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    store.complete(&lease, b"v1", SHORT_TTL).await?;
    let retention_deadline = match store.get(&k).await?.map(|r| r.state) {
        Some(RecordState::Done {
            retention_deadline, ..
        }) => retention_deadline,
        other => return Err(Failure::new(format!("get of a done key shows {other:?}"))),
    };
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "a done key inside its retention did not answer Duplicate"
    );
    wait_past(retention_deadline).await?;
    ensure!(
        store.get(&k).await?.is_none(),
        "get shows a done record past its retention"
    );
    let again = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    ensure!(
        again.attempt == 1,
        "a claim after retention reports attempt {}, expected 1",
        again.attempt
    );
    ensure!(
        again.token != lease.token,
        "a claim after retention reused the old token"
    );
    Ok(Verdict::Passed)
}

/// `expire()` removes exactly the expired records (in flight past the lease, done
/// past retention), reports the count, and leaves live records untouched.
pub async fn expire_removes_exactly_expired(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    if !store.capabilities().explicit_expire {
        return Ok(Verdict::Skipped(
            "store expires natively; expire() removes nothing".into(),
        ));
    }
    let mut latest = SystemTime::now();
    for i in 0..3 {
        let lease = must_claim(
            &*store,
            &key(&format!("dead-flight-{i}"))?,
            &opts(SHORT_TTL),
        )
        .await?;
        latest = latest.max(lease.deadline);
    }
    for i in 0..2 {
        let lease = must_claim(&*store, &key(&format!("dead-done-{i}"))?, &opts(LONG_TTL)).await?;
        store.complete(&lease, b"old", SHORT_TTL).await?;
        match store.get(&lease.key).await?.map(|r| r.state) {
            Some(RecordState::Done {
                retention_deadline, ..
            }) => latest = latest.max(retention_deadline),
            other => return Err(Failure::new(format!("get of a done key shows {other:?}"))),
        }
    }
    let live_flight = must_claim(&*store, &key("live-flight")?, &opts(LONG_TTL)).await?;
    let live_done = must_claim(&*store, &key("live-done")?, &opts(LONG_TTL)).await?;
    store.complete(&live_done, b"keep", LONG_TTL).await?;
    let live_before = (
        store.get(&live_flight.key).await?,
        store.get(&live_done.key).await?,
    );
    wait_past(latest).await?;
    let removed = store.expire().await?;
    ensure!(
        removed == 5,
        "expire() reported {removed} removed, expected 5 (3 dead leases, 2 past retention)"
    );
    let live_after = (
        store.get(&live_flight.key).await?,
        store.get(&live_done.key).await?,
    );
    ensure!(
        live_before == live_after,
        "expire() changed live records: {live_before:?} became {live_after:?}"
    );
    ensure!(
        live_after.0.is_some() && live_after.1.is_some(),
        "expire() removed a live record"
    );
    let again = store.expire().await?;
    ensure!(
        again == 0,
        "a second expire() reported {again} removed, expected 0"
    );
    Ok(Verdict::Passed)
}

/// The same key with a different payload fingerprint answers Mismatch, in flight
/// and done, and is never Claimed; the matching fingerprint answers as usual.
pub async fn fingerprint_mismatch(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("payload")?;
    let original = opts(LONG_TTL).with_fingerprint(Fingerprint::sha256(b"amount=10"));
    let forged = opts(LONG_TTL).with_fingerprint(Fingerprint::sha256(b"amount=9999"));
    let lease = must_claim(&*store, &k, &original).await?;
    match store.claim(&k, &forged).await? {
        ClaimOutcome::Mismatch {
            state: RecordStateKind::InFlight,
        } => {}
        other => {
            return Err(Failure::new(format!(
                "a different fingerprint on an in-flight key answered {other:?}, expected Mismatch"
            )))
        }
    }
    ensure!(
        matches!(
            store.claim(&k, &original).await?,
            ClaimOutcome::InFlight { .. }
        ),
        "the same fingerprint on an in-flight key did not answer InFlight"
    );
    store.complete(&lease, b"paid 10", LONG_TTL).await?;
    match store.claim(&k, &forged).await? {
        ClaimOutcome::Mismatch {
            state: RecordStateKind::Done,
        } => {}
        other => {
            return Err(Failure::new(format!(
                "a different fingerprint on a done key answered {other:?}, expected Mismatch"
            )))
        }
    }
    ensure!(
        matches!(
            store.claim(&k, &original).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "the same fingerprint on a done key did not answer Duplicate"
    );
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "a claim without fingerprint on a done key did not answer Duplicate"
    );
    let stored = store.get(&k).await?.and_then(|r| r.fingerprint);
    ensure!(
        stored == original.fingerprint,
        "get shows fingerprint {stored:?}"
    );
    Ok(Verdict::Passed)
}

/// A retried claim with the claim id that holds the record gets the same lease
/// back; another claim id, or none, answers InFlight.
pub async fn reentrant_claim_id(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("reentrant")?;
    let cid = |s: &str| ClaimId::new(s).map_err(|e| Failure::new(e.to_string()));
    let mine = opts(LONG_TTL).with_claim_id(cid("attempt-A")?);
    let lease = must_claim(&*store, &k, &mine).await?;
    let retried = must_claim(&*store, &k, &mine)
        .await
        .map_err(|f| Failure::new(format!("retry with the holder's claim id: {f}")))?;
    ensure!(
        retried.token == lease.token,
        "the retried claim got token {:?}, the holder has {:?}",
        retried.token,
        lease.token
    );
    ensure!(
        retried.attempt == lease.attempt,
        "the retried claim reports attempt {}",
        retried.attempt
    );
    ensure!(
        retried.claim_id == mine.claim_id,
        "the retried lease lost its claim id"
    );
    let other = opts(LONG_TTL).with_claim_id(cid("attempt-B")?);
    ensure!(
        matches!(
            store.claim(&k, &other).await?,
            ClaimOutcome::InFlight { .. }
        ),
        "another claim id did not answer InFlight"
    );
    ensure!(
        matches!(
            store.claim(&k, &opts(LONG_TTL)).await?,
            ClaimOutcome::InFlight { .. }
        ),
        "a claim without id did not answer InFlight"
    );
    store.complete(&retried, b"once", LONG_TTL).await?;
    ensure!(
        matches!(
            store.claim(&k, &mine).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "the holder's claim id on a done key did not answer Duplicate"
    );
    Ok(Verdict::Passed)
}

fn same_kind(a: &ClaimOutcome, b: &ClaimOutcome) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// `claim_many` answers exactly as claim-by-claim: fresh keys Claimed, a key twice
/// in one batch Claimed then InFlight, done keys Duplicate with their outcome,
/// in-flight keys InFlight; and its leases work.
pub async fn claim_many_matches_claim(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let done = key("batch-done")?;
    let busy = key("batch-busy")?;
    let lease = must_claim(&*store, &done, &opts(LONG_TTL)).await?;
    store.complete(&lease, b"earlier", LONG_TTL).await?;
    must_claim(&*store, &busy, &opts(LONG_TTL)).await?;
    let a = key("batch-a")?;
    let b = key("batch-b")?;
    let batch = vec![
        a.clone(),
        done.clone(),
        b.clone(),
        a.clone(),
        busy.clone(),
        b.clone(),
    ];
    let answers = store.claim_many(&batch, &opts(LONG_TTL)).await?;
    ensure!(
        answers.len() == batch.len(),
        "claim_many answered {} times for {} keys",
        answers.len(),
        batch.len()
    );
    let expected = [
        "claimed",
        "duplicate",
        "claimed",
        "in-flight",
        "in-flight",
        "in-flight",
    ];
    for (i, (answer, want)) in answers.iter().zip(expected).enumerate() {
        ensure!(
            answer.kind() == want,
            "claim_many answer #{i} for {} is {answer:?}, expected {want}",
            batch[i]
        );
    }
    if let ClaimOutcome::Duplicate { outcome, .. } = &answers[1] {
        ensure!(
            outcome == b"earlier",
            "claim_many's Duplicate carries {outcome:?}"
        );
    }
    for answer in [&answers[0], &answers[2]] {
        let lease = answer
            .lease()
            .ok_or_else(|| Failure::new("missing lease"))?;
        store.complete(lease, b"batched", LONG_TTL).await?;
    }
    // The same batch again, now answered one claim at a time, must agree.
    let batch_again = store.claim_many(&batch, &opts(LONG_TTL)).await?;
    for (i, k) in batch.iter().enumerate() {
        let single = store.claim(k, &opts(LONG_TTL)).await?;
        ensure!(
            same_kind(&batch_again[i], &single),
            "claim_many said {:?} for {k}, claim says {single:?}",
            batch_again[i]
        );
    }
    ensure!(
        store.claim_many(&[], &opts(LONG_TTL)).await?.is_empty(),
        "an empty batch answered something"
    );
    Ok(Verdict::Passed)
}

/// The same id in two namespaces is two events.
pub async fn namespaces_isolate(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let stripe = Key::new("stripe", "evt_1").map_err(|e| Failure::new(e.to_string()))?;
    let github = Key::new("github", "evt_1").map_err(|e| Failure::new(e.to_string()))?;
    let s = must_claim(&*store, &stripe, &opts(LONG_TTL)).await?;
    let g = must_claim(&*store, &github, &opts(LONG_TTL))
        .await
        .map_err(|f| Failure::new(format!("same id, other namespace: {f}")))?;
    store.complete(&s, b"stripe", LONG_TTL).await?;
    ensure!(
        matches!(
            store.claim(&github, &opts(LONG_TTL)).await?,
            ClaimOutcome::InFlight { .. }
        ),
        "completing stripe:evt_1 changed github:evt_1"
    );
    store.release(&g).await?;
    ensure!(
        matches!(
            store.claim(&stripe, &opts(LONG_TTL)).await?,
            ClaimOutcome::Duplicate { .. }
        ),
        "releasing github:evt_1 changed stripe:evt_1"
    );
    Ok(Verdict::Passed)
}

/// Keys are compared byte for byte: case matters, unicode and quotes round-trip,
/// and the longest namespace and id are kept whole.
pub async fn key_case_unicode_and_max_length(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let max_ns = "n".repeat(MAX_NAMESPACE_BYTES);
    let max_id: String = "é".repeat(MAX_ID_BYTES / 2);
    let near_max: String = format!("{}x", "é".repeat(MAX_ID_BYTES / 2 - 1));
    let ids = [
        ("conf", "evt_ABC".to_string()),
        ("conf", "evt_abc".to_string()),
        ("conf", "évènement-日本-🦀".to_string()),
        ("conf", "quote'\"back\\slash;--%_".to_string()),
        ("conf", "  spaces  ".to_string()),
        (max_ns.as_str(), max_id.clone()),
        (max_ns.as_str(), near_max),
    ];
    let mut keys = Vec::new();
    for (ns, id) in &ids {
        let k = Key::new(*ns, id.as_str())
            .map_err(|e| Failure::new(format!("valid key refused: {e}")))?;
        let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
        store.complete(&lease, k.id().as_bytes(), LONG_TTL).await?;
        keys.push(k);
    }
    for k in &keys {
        let record = store
            .get(k)
            .await?
            .ok_or_else(|| Failure::new(format!("get of {k:?} found nothing")))?;
        ensure!(
            &record.key == k,
            "get of {k:?} returned key {:?}",
            record.key
        );
        match store.claim(k, &opts(LONG_TTL)).await? {
            ClaimOutcome::Duplicate { outcome, .. } => {
                ensure!(
                    outcome == k.id().as_bytes(),
                    "{k:?} came back with the outcome of another key: {:?}",
                    String::from_utf8_lossy(&outcome)
                )
            }
            other => {
                return Err(Failure::new(format!(
                    "{k:?} answered {other:?}, expected Duplicate"
                )))
            }
        }
    }
    Ok(Verdict::Passed)
}

/// Bad input gets a typed error and writes nothing: empty, over-long and NUL keys
/// are refused before any store sees them; a zero lease, a zero retention and an
/// outcome over the store's limit are refused by the store.
pub async fn bad_input_rejected_nothing_written(factory: &dyn StoreFactory) -> CheckResult {
    use dedupe_core::KeyError;
    ensure!(
        matches!(Key::new("conf", ""), Err(KeyError::Empty { .. })),
        "an empty id was accepted"
    );
    ensure!(
        matches!(Key::new("", "x"), Err(KeyError::Empty { .. })),
        "an empty namespace was accepted"
    );
    ensure!(
        matches!(Key::new("conf", "a\0b"), Err(KeyError::Nul { .. })),
        "an id with NUL was accepted"
    );
    ensure!(
        matches!(
            Key::new("conf", "x".repeat(MAX_ID_BYTES + 1)),
            Err(KeyError::TooLong { .. })
        ),
        "an over-long id was accepted"
    );
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("bad-input")?;
    match store.claim(&k, &opts(Duration::ZERO)).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "a zero lease TTL answered {other:?}, expected InvalidConfig"
            )))
        }
    }
    ensure!(
        store.get(&k).await?.is_none(),
        "a refused claim wrote a record"
    );
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    let before = store.get(&k).await?;
    let limit = store.capabilities().max_outcome_bytes;
    let too_big = vec![7u8; limit + 1];
    match store.complete(&lease, &too_big, LONG_TTL).await {
        Err(Error::OutcomeTooLarge { size, limit: l }) => {
            ensure!(
                size == limit + 1 && l == limit,
                "OutcomeTooLarge reports size {size} limit {l}"
            )
        }
        other => {
            return Err(Failure::new(format!(
                "an outcome of {} bytes answered {other:?}, expected OutcomeTooLarge",
                limit + 1
            )))
        }
    }
    match store.complete(&lease, b"x", Duration::ZERO).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "a zero retention answered {other:?}, expected InvalidConfig"
            )))
        }
    }
    ensure!(
        store.get(&k).await? == before,
        "a refused complete changed the record"
    );
    let exact = vec![7u8; limit];
    store
        .complete(&lease, &exact, LONG_TTL)
        .await
        .map_err(|e| {
            Failure::new(format!(
                "an outcome of exactly the limit ({limit} bytes) was refused: {e}"
            ))
        })?;
    Ok(Verdict::Passed)
}

/// Forget removes a record in any state and says whether there was one.
pub async fn forget_removes_any_state(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let flying = key("forget-flying")?;
    let done = key("forget-done")?;
    must_claim(&*store, &flying, &opts(LONG_TTL)).await?;
    let lease = must_claim(&*store, &done, &opts(LONG_TTL)).await?;
    store.complete(&lease, b"x", LONG_TTL).await?;
    ensure!(
        store.forget(&flying).await?,
        "forget of an in-flight record answered false"
    );
    ensure!(
        store.forget(&done).await?,
        "forget of a done record answered false"
    );
    ensure!(!store.forget(&done).await?, "a second forget answered true");
    ensure!(
        !store.forget(&key("forget-never")?).await?,
        "forget of an absent key answered true"
    );
    ensure!(
        store.get(&done).await?.is_none(),
        "get finds a forgotten record"
    );
    let again = must_claim(&*store, &done, &opts(LONG_TTL)).await?;
    ensure!(
        again.attempt == 1,
        "a claim after forget reports attempt {}",
        again.attempt
    );
    Ok(Verdict::Passed)
}

/// Ten thousand distinct keys are all Claimed (no false duplicates), and all answer
/// InFlight afterwards.
pub async fn ten_thousand_distinct_keys(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let keys: Vec<Key> = (0..10_000)
        .map(|i| key(&format!("many-{i:05}")))
        .collect::<Result<_, _>>()?;
    let mut tokens = HashSet::new();
    for chunk in keys.chunks(500) {
        for (k, answer) in chunk
            .iter()
            .zip(store.claim_many(chunk, &opts(LONG_TTL)).await?)
        {
            match answer {
                ClaimOutcome::Claimed(lease) => {
                    ensure!(
                        tokens.insert(lease.token.clone()),
                        "token {:?} was handed out twice",
                        lease.token
                    )
                }
                other => {
                    return Err(Failure::new(format!(
                        "distinct key {k} answered {other:?}, expected Claimed"
                    )))
                }
            }
        }
    }
    for chunk in keys.chunks(500) {
        for (k, answer) in chunk
            .iter()
            .zip(store.claim_many(chunk, &opts(LONG_TTL)).await?)
        {
            ensure!(
                matches!(answer, ClaimOutcome::InFlight { .. }),
                "{k} answered {answer:?} on the second pass"
            );
        }
    }
    Ok(Verdict::Passed)
}

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

/// A small deterministic generator (xorshift64*), so a failing sequence replays
/// exactly.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One store's side of the differential run: the store and the leases its
/// claims handed out, per key, in order.
struct Side {
    store: Arc<dyn DedupeStore>,
    leases: Vec<Vec<Lease>>,
}

/// What two conforming stores must agree on for one operation: the answer with
/// tokens and deadlines (which differ by nature) left out.
fn normal(answer: &Result<ClaimOutcome, Error>) -> String {
    match answer {
        Ok(ClaimOutcome::Claimed(lease)) => format!("claimed attempt {}", lease.attempt),
        Ok(ClaimOutcome::InFlight { attempt, .. }) => format!("in-flight attempt {attempt}"),
        Ok(ClaimOutcome::Duplicate { outcome, .. }) => format!("duplicate {outcome:?}"),
        Ok(ClaimOutcome::Mismatch { state }) => format!("mismatch {state:?}"),
        Err(e) => normal_err(e),
    }
}

fn normal_err(e: &Error) -> String {
    match e {
        Error::LeaseLost { .. } => "lease lost".into(),
        other => format!("error {other}"),
    }
}

impl Side {
    /// Applies operation `op` (drawn from `seq`, identical for both sides) and
    /// answers its normalized result.
    async fn apply(&mut self, keys: &[Key], op: &[usize; 5]) -> String {
        let [kind, k, variant, pick, extra] = *op;
        let fingerprints = [
            None,
            Some(Fingerprint::sha256(b"a")),
            Some(Fingerprint::sha256(b"b")),
        ];
        let claim_ids = [None, ClaimId::new("x").ok(), ClaimId::new("y").ok()];
        let mut opts = ClaimOptions::new(LONG_TTL);
        opts.fingerprint = fingerprints[variant % 3].clone();
        opts.claim_id = claim_ids[(variant / 3) % 3].clone();
        let lease = |leases: &Vec<Vec<Lease>>| {
            let list = &leases[k];
            (!list.is_empty()).then(|| list[pick % list.len()].clone())
        };
        match kind {
            0..=3 => {
                let answer = self.store.claim(&keys[k], &opts).await;
                if let Ok(ClaimOutcome::Claimed(l)) = &answer {
                    self.leases[k].push(l.clone());
                }
                format!("claim {}", normal(&answer))
            }
            4 | 5 => match lease(&self.leases) {
                Some(l) => {
                    let outcome = format!("outcome-{extra}").into_bytes();
                    let r = self.store.complete(&l, &outcome, LONG_TTL).await;
                    format!(
                        "complete {}",
                        r.map(|()| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            6 => match lease(&self.leases) {
                Some(l) => {
                    let r = self.store.release(&l).await;
                    format!(
                        "release {}",
                        r.map(|()| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            7 => match lease(&self.leases) {
                Some(l) => {
                    let r = self.store.extend(&l, LONG_TTL).await;
                    format!(
                        "extend {}",
                        r.map(|_| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            8 => format!(
                "forget {:?}",
                self.store
                    .forget(&keys[k])
                    .await
                    .map_err(|e| normal_err(&e))
            ),
            9 => {
                let got = self.store.get(&keys[k]).await.map(|r| {
                    r.map(|r| {
                        let outcome = match r.state {
                            RecordState::Done { outcome, .. } => Some(outcome),
                            RecordState::InFlight { .. } => None,
                        };
                        (r.attempts, outcome, r.fingerprint, r.claim_id)
                    })
                });
                format!("get {:?}", got.map_err(|e| normal_err(&e)))
            }
            _ => {
                // A batch of three keys, repeats allowed.
                let batch: Vec<Key> = [k, pick, extra]
                    .iter()
                    .map(|i| keys[i % keys.len()].clone())
                    .collect();
                match self.store.claim_many(&batch, &opts).await {
                    Ok(answers) => {
                        let mut text = String::from("claim_many");
                        for (key, answer) in batch.iter().zip(answers) {
                            if let ClaimOutcome::Claimed(l) = &answer {
                                let i = keys.iter().position(|x| x == key).unwrap_or(0);
                                self.leases[i].push(l.clone());
                            }
                            text.push_str(&format!(" [{}]", normal(&Ok(answer))));
                        }
                        text
                    }
                    Err(e) => format!("claim_many {}", normal_err(&e)),
                }
            }
        }
    }
}

/// Differential check: 600 operations drawn from a fixed seed (claims with and
/// without fingerprints and claim ids, completes, releases and extends with
/// current and stale leases, forgets, gets, batches with repeats) on six keys,
/// run in lockstep on the store and on the reference [`MemoryStore`]; every
/// answer must match.
///
/// [`MemoryStore`]: dedupe_core::MemoryStore
pub async fn matches_reference_store(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let keys: Vec<Key> = (0..6)
        .map(|i| key(&format!("diff-{i}")))
        .collect::<Result<_, _>>()?;
    let mut tested = Side {
        store: fixture.store(),
        leases: vec![Vec::new(); keys.len()],
    };
    let mut reference = Side {
        store: Arc::new(dedupe_core::MemoryStore::new()),
        leases: vec![Vec::new(); keys.len()],
    };
    let mut seq = Sequence(0x9e37_79b9_7f4a_7c15);
    let mut history: Vec<String> = Vec::new();
    for step in 0..600 {
        let op = [
            seq.below(11),
            seq.below(keys.len()),
            seq.below(9),
            seq.below(8),
            seq.below(6),
        ];
        let want = reference.apply(&keys, &op).await;
        let got = tested.apply(&keys, &op).await;
        if got != want {
            let recent = history
                .iter()
                .rev()
                .take(8)
                .rev()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n  ");
            return Err(Failure::new(format!(
                "step {step} (op {op:?}): the store answered `{got}`, the reference `{want}`; the steps before:\n  {recent}"
            )));
        }
        history.push(format!("{step}: {op:?} -> {got}"));
    }
    // The sequence must have reached every kind of answer, or it proved little.
    for needed in [
        "claim claimed",
        "claim in-flight",
        "claim duplicate",
        "claim mismatch",
        "complete ok",
        "complete lease lost",
        "release ok",
        "release lease lost",
        "extend ok",
        "extend lease lost",
        "forget Ok(true)",
        "forget Ok(false)",
        "get Ok(Some",
        "get Ok(None)",
        "claim_many",
    ] {
        ensure!(
            history.iter().any(|h| h.contains(needed)),
            "the differential sequence never produced `{needed}`: the store answered too few kinds"
        );
    }
    Ok(Verdict::Passed)
}
