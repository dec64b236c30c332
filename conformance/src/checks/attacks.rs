//! Attack rounds: rules exercised on several handles at once, at the edges
//! where stores went wrong. An independent reviewer wrote them against the SQL
//! stores from `CONTRACT.md` alone; they found real bugs there, and every store
//! runs them here. Recorded rounds are judged by the one history checker
//! ([`crate::history`]); the rest say what they expected and what came.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dedupe_core::{MemoryStore, MAX_BATCH_KEYS};

use super::*;
use crate::harness::{Fixture, Scale};
use crate::history::{History, Recorder};

/// A lease that must not pass during a step.
const HELD: Duration = Duration::from_secs(20);
/// Retention of every completion of a recorded round (beyond any run).
const KEEP: Duration = Duration::from_secs(3600);
/// Handles the rounds act and watch through.
const HANDLES: usize = 4;

fn nkey(ns: &str, id: impl AsRef<str>) -> Result<Key, Failure> {
    let id = id.as_ref();
    Key::new(ns, id).map_err(|e| Failure::new(format!("test key {ns}:{id:?} refused: {e}")))
}

fn cid(id: &str) -> Result<ClaimId, Failure> {
    ClaimId::new(id).map_err(|e| Failure::new(format!("test claim id {id:?} refused: {e}")))
}

fn fp(n: u8) -> Result<Fingerprint, Failure> {
    Fingerprint::from_bytes(vec![n; 32])
        .map_err(|e| Failure::new(format!("test fingerprint refused: {e}")))
}

/// The fixture's own handle and `n - 1` more, each with its connection.
async fn handles(fixture: &dyn Fixture, n: usize) -> Result<Vec<Arc<dyn DedupeStore>>, Failure> {
    let mut all = vec![fixture.store()];
    for _ in 1..n {
        all.push(fixture.open_handle().await?);
    }
    Ok(all)
}

/// A history for a round on this store: deadlines judged to a few
/// milliseconds beyond the clock offset measured.
async fn history_for(store: &dyn DedupeStore, label: &str) -> Result<History, Failure> {
    let clock = Clock::measure(store, label).await?;
    let offset = clock.low.abs().max(clock.high.abs());
    Ok(History::new(
        Duration::from_secs_f64(offset / 1e3) + Duration::from_millis(5),
    ))
}

/// The history's verdict, and no call failing where nothing was faulted.
fn judge(what: &str, history: &History) -> CheckResult {
    history.verdict(what)?;
    let failures = history.failures();
    ensure!(
        failures.is_empty(),
        "{what}: {} calls failed although nothing was faulted; the first ones:\n  {}",
        failures.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    Ok(Verdict::Passed)
}

fn verdict(what: &str, bad: Vec<String>) -> CheckResult {
    ensure!(
        bad.is_empty(),
        "{what}: {} violations:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
    Ok(Verdict::Passed)
}

fn expect_lease(
    r: Result<ClaimOutcome, Error>,
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

fn expect_lost<T: std::fmt::Debug>(r: Result<T, Error>, what: &str, bad: &mut Vec<String>) {
    if !matches!(r, Err(Error::LeaseLost { .. })) {
        bad.push(format!(
            "stale holder: {what}: expected LeaseLost, got {r:?}"
        ));
    }
}

/// Rule 4 and the `extend`/`complete` rows, one handle acting and another
/// watching: `extend` counts from now (so it can shorten a lease), a stale
/// holder is fenced after a takeover and after a lapse nobody took over
/// (whichever copy of its lease it uses), a late `complete` changes nothing,
/// a done record whose retention passed starts over at attempt 1, a claim id
/// gets back the exact stored lease on every handle (by `claim` and by
/// `claim_many`, and the extended one after an `extend`), fingerprints
/// mismatch whatever the claim id, and refused input writes nothing.
pub async fn lease_rules_across_handles(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, HANDLES).await?;
    lease_rules_on(&st, "rules").await?;
    Ok(Verdict::Passed)
}

/// The rounds of [`lease_rules_across_handles`] on handles of the caller's
/// (at least two, onto one store), with keys in namespace `ns`: for a store's
/// own tests that put its handles in particular modes first.
pub async fn lease_rules_on(st: &[Arc<dyn DedupeStore>], ns: &str) -> Result<(), Failure> {
    ensure!(st.len() >= 2, "lease_rules_on needs two handles or more");
    let clock = Clock::measure(&*st[0], ns).await?;
    let (a, b) = (&*st[0], &*st[1]);
    let mut bad = Vec::new();

    // 1. extend shortens; the takeover after the shorter deadline wins and
    //    the old holder is fenced whatever copy of its lease it uses.
    let k = nkey(ns, "shrink")?;
    if let Some(l) = expect_lease(
        a.claim(&k, &opts(HELD)).await,
        "claim of a fresh key",
        &mut bad,
    ) {
        let seen0 = a.get(&k).await?.map(|r| r.first_seen);
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
                wait_past_on(&clock, l2.deadline).await?;
                match b.claim(&k, &opts(HELD)).await {
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
                                a.complete(old, b"stale", KEEP).await,
                                "complete by a holder whose lease was taken over",
                                &mut bad,
                            );
                            expect_lost(
                                a.extend(old, HELD).await,
                                "extend by a holder whose lease was taken over",
                                &mut bad,
                            );
                            expect_lost(
                                a.release(old).await,
                                "release by a holder whose lease was taken over",
                                &mut bad,
                            );
                        }
                        match a.get(&k).await? {
                            Some(rec) => {
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
                            None => bad.push("get after a takeover found nothing".into()),
                        }
                        if let Err(e) = a.complete(&l3, b"taken-over", KEEP).await {
                            bad.push(format!("the taker could not complete its live lease: {e}"));
                        }
                        match b.claim(&k, &opts(HELD)).await {
                            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"taken-over" => {}
                            other => bad.push(format!(
                                "a claim after the taker completed answered {other:?}"
                            )),
                        }
                    }
                    other => bad.push(format!(
                        "a claim made 30 ms after a lease shortened by extend(150 ms) had passed answered {other:?}: extend must set the deadline to now + ttl"
                    )),
                }
            }
            Err(e) => bad.push(format!("extend of a live lease failed: {e}")),
        }
    }

    // 2. A lease that lapsed with nobody taking over: every late call is
    //    refused and changes nothing, and the next claim is a takeover.
    let k = nkey(ns, "lapsed")?;
    if let Some(l) = expect_lease(
        a.claim(&k, &opts(Duration::from_millis(100))).await,
        "claim (100 ms)",
        &mut bad,
    ) {
        let seen0 = a.get(&k).await?.map(|r| r.first_seen);
        wait_past_on(&clock, l.deadline).await?;
        if let Some(rec) = b.get(&k).await? {
            bad.push(format!(
                "expiry is not logical: get answered a record 30 ms after its lease passed: {rec:?}"
            ));
        }
        expect_lost(
            a.complete(&l, b"late", KEEP).await,
            "complete 30 ms after the lease passed (nobody took over)",
            &mut bad,
        );
        expect_lost(
            a.extend(&l, HELD).await,
            "extend 30 ms after the lease passed",
            &mut bad,
        );
        if let Err(e) = a.release(&l).await {
            bad.push(format!(
                "release 30 ms after the lease passed (nothing live under the key) failed: {e}, expected Ok"
            ));
        }
        match b.claim(&k, &opts(HELD)).await {
            Ok(ClaimOutcome::Claimed(l2)) => {
                if l2.attempt != 2 {
                    bad.push(format!(
                        "the claim after a lapsed lease answered attempt {} (expected 2)",
                        l2.attempt
                    ));
                }
                // (Unknown when the get above came after the 100 ms lease.)
                if seen0.is_some() && b.get(&k).await?.map(|r| r.first_seen) != seen0 {
                    bad.push("a takeover of a lapsed lease changed first_seen".into());
                }
            }
            other => bad.push(format!(
                "a claim after a lapsed lease answered {other:?} (a refused late complete must change nothing)"
            )),
        }
    }

    // 3. A done record whose retention passed starts over at attempt 1.
    let k = nkey(ns, "retained")?;
    if let Some(l) = expect_lease(a.claim(&k, &opts(HELD)).await, "claim", &mut bad) {
        // Long enough for the get and the claim below on a loaded machine.
        match a.complete(&l, b"short", Duration::from_millis(400)).await {
            Err(e) => bad.push(format!("complete failed: {e}")),
            Ok(()) => {
                let done = a.get(&k).await?;
                match b.claim(&k, &opts(HELD)).await {
                    Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"short" => {}
                    other => bad.push(format!("a claim of a done record answered {other:?}")),
                }
                let old_seen = done.as_ref().map(|r| r.first_seen);
                match done.map(|r| r.state) {
                    Some(RecordState::Done {
                        retention_deadline, ..
                    }) => wait_past_on(&clock, retention_deadline).await?,
                    other => {
                        bad.push(format!("get of a done record answered {other:?}"));
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                match b.claim(&k, &opts(HELD)).await {
                    Ok(ClaimOutcome::Claimed(l2)) => {
                        if l2.attempt != 1 {
                            bad.push(format!(
                                "a claim after a done record's retention passed answered attempt {} (expected 1)",
                                l2.attempt
                            ));
                        }
                        let seen = b.get(&k).await?.map(|r| r.first_seen);
                        if seen.is_none() || seen <= old_seen {
                            bad.push(format!(
                                "a claim after retention passed kept the old first_seen ({old_seen:?} -> {seen:?})"
                            ));
                        }
                    }
                    other => bad.push(format!(
                        "a claim 30 ms after a done record's retention passed answered {other:?}"
                    )),
                }
            }
        }
    }

    // 4. Release, then the next delivery claims it afresh.
    let k = nkey(ns, "released")?;
    if let Some(l) = expect_lease(a.claim(&k, &opts(HELD)).await, "claim", &mut bad) {
        if let Err(e) = a.release(&l).await {
            bad.push(format!("release of a live lease failed: {e}"));
        }
        if let Err(e) = a.release(&l).await {
            bad.push(format!(
                "a second release (nothing under the key) failed: {e}, expected Ok"
            ));
        }
        expect_lost(
            a.complete(&l, b"after release", KEEP).await,
            "complete after release",
            &mut bad,
        );
        match b.claim(&k, &opts(HELD)).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 1 && l2.token != l.token => {}
            other => bad.push(format!(
                "a claim after release answered {other:?} (expected a new attempt 1)"
            )),
        }
    }

    // 5. Rule 3 on every handle: the same claim id gets the exact stored
    //    lease, by claim and by claim_many, and the extended one after extend.
    let k = nkey(ns, "reentrant")?;
    let o_x = opts(HELD).with_claim_id(cid("cid-X")?);
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
            match s.claim(&k, &o_x.clone().with_fingerprint(fp(9)?)).await {
                Ok(ClaimOutcome::Claimed(again)) if again == l => {}
                other => bad.push(format!(
                    "handle {i}: a retry with the claim id and a fingerprint (the record has none) answered {other:?}"
                )),
            }
            match s.claim(&k, &opts(HELD).with_claim_id(cid("cid-Y")?)).await {
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
    let k = nkey(ns, "mismatch")?;
    let o_m = opts(HELD)
        .with_fingerprint(fp(1)?)
        .with_claim_id(cid("cid-M")?);
    if let Some(l) = expect_lease(
        a.claim(&k, &o_m).await,
        "claim with a fingerprint",
        &mut bad,
    ) {
        for (what, o) in [
            ("another fingerprint", opts(HELD).with_fingerprint(fp(2)?)),
            (
                "another fingerprint with the holder's claim id",
                opts(HELD)
                    .with_fingerprint(fp(2)?)
                    .with_claim_id(cid("cid-M")?),
            ),
        ] {
            match b.claim(&k, &o).await {
                Ok(ClaimOutcome::Mismatch {
                    state: RecordStateKind::InFlight,
                }) => {}
                other => bad.push(format!("{what} on an in-flight record answered {other:?}")),
            }
        }
        match b.claim(&k, &opts(HELD)).await {
            Ok(ClaimOutcome::InFlight { .. }) => {}
            other => bad.push(format!("a claim without fingerprint answered {other:?}")),
        }
        if let Err(e) = a.complete(&l, b"fp-done", KEEP).await {
            bad.push(format!("complete failed: {e}"));
        }
        match b
            .claim_many(&[k.clone(), k.clone()], &opts(HELD).with_fingerprint(fp(2)?))
            .await
        {
            Ok(v) if v.len() == 2
                && v.iter().all(|x| matches!(x, ClaimOutcome::Mismatch { state } if *state == RecordStateKind::Done)) => {}
            other => bad.push(format!(
                "claim_many([k, k]) with another fingerprint on a done record answered {other:?}"
            )),
        }
        match b.claim(&k, &opts(HELD).with_fingerprint(fp(1)?)).await {
            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == b"fp-done" => {}
            other => bad.push(format!(
                "the same fingerprint on a done record answered {other:?}"
            )),
        }
    }
    let k = nkey(ns, "mismatch-expired")?;
    if let Some(l) = expect_lease(
        a.claim(
            &k,
            &opts(Duration::from_millis(80)).with_fingerprint(fp(1)?),
        )
        .await,
        "claim",
        &mut bad,
    ) {
        wait_past_on(&clock, l.deadline).await?;
        match b.claim(&k, &opts(HELD).with_fingerprint(fp(2)?)).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 2 => {}
            other => bad.push(format!(
                "another fingerprint after the lease passed answered {other:?} (an expired record is absent)"
            )),
        }
    }

    // 7. Bad input is refused and writes nothing.
    let k = nkey(ns, "bad-input")?;
    match a.claim(&k, &opts(Duration::ZERO)).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => bad.push(format!("a zero lease answered {other:?}")),
    }
    match a.claim(&k, &opts(MAX_TTL + Duration::from_millis(1))).await {
        Err(_) => {}
        other => bad.push(format!("a lease over MAX_TTL answered {other:?}")),
    }
    match a
        .claim_many(std::slice::from_ref(&k), &opts(Duration::ZERO))
        .await
    {
        Err(_) => {}
        other => bad.push(format!("claim_many with a zero lease answered {other:?}")),
    }
    let many: Vec<Key> = (0..=MAX_BATCH_KEYS)
        .map(|i| nkey(ns, format!("too-many-{i}")))
        .collect::<Result<_, _>>()?;
    match a.claim_many(&many, &opts(HELD)).await {
        Err(Error::BatchTooLarge { .. }) => {}
        other => bad.push(format!(
            "a batch of MAX_BATCH_KEYS + 1 answered {:?}",
            other.map(|v| v.len())
        )),
    }
    for kk in [&k, &many[0], &many[MAX_BATCH_KEYS]] {
        if let Some(rec) = b.get(kk).await? {
            bad.push(format!("a refused claim wrote a record: {rec:?}"));
        }
    }
    match a.claim_many(&[], &opts(HELD)).await {
        Ok(v) if v.is_empty() => {}
        other => bad.push(format!("an empty batch answered {other:?}")),
    }
    if let Some(l) = expect_lease(a.claim(&k, &opts(HELD)).await, "claim", &mut bad) {
        let max = a.capabilities().max_outcome_bytes;
        match a.complete(&l, &vec![7u8; max + 1], KEEP).await {
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
        match b.get(&k).await? {
            Some(rec)
                if rec.token == l.token
                    && rec.state
                        == RecordState::InFlight {
                            lease_deadline: l.deadline,
                        } => {}
            other => bad.push(format!("refused calls changed the record: {other:?}")),
        }
        if let Err(e) = a.complete(&l, b"fine", KEEP).await {
            bad.push(format!(
                "the lease no longer completes after refused calls: {e}"
            ));
        }
    }
    let k = nkey(ns, "max-ttl")?;
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
    verdict("lease rules across handles", bad)?;
    Ok(())
}

/// The boundary where `>` against `>=` and clock reads decide: for 42 rounds a
/// holder completes, releases, or extends and completes, aimed at its 40 ms
/// lease's deadline from 1.5 ms before to 1.5 ms after, while a taker on each
/// handle claims (by `claim`, or by `claim_many` with the key twice) around the
/// same instant. Recorded and judged whole: never a completion and a takeover
/// both, never two takers, attempts in order, no stale or phantom `InFlight`.
pub async fn deadline_edge_races(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, HANDLES).await?;
    let rounds = if factory.scale() == Scale::Full {
        42
    } else {
        14
    };
    deadline_edge_races_on(&st, rounds).await?;
    Ok(Verdict::Passed)
}

/// `rounds` rounds of [`deadline_edge_races`] on handles of the caller's.
pub async fn deadline_edge_races_on(
    st: &[Arc<dyn DedupeStore>],
    rounds: usize,
) -> Result<(), Failure> {
    ensure!(!st.is_empty(), "deadline_edge_races_on needs a handle");
    let history = history_for(&*st[0], "edge")
        .await?
        .every_in_flight_seen()
        .attempts_in_order();
    for r in 0..rounds {
        let k = nkey("edge", format!("edge{r}"))?;
        let holder = Recorder::new(Arc::clone(&st[r % st.len()]), history.clone(), 0);
        let l = match holder.claim(&k, &opts(Duration::from_millis(40))).await {
            Ok(ClaimOutcome::Claimed(l)) => l,
            other => {
                history.flag(format!("{k}: a fresh claim answered {other:?}"));
                continue;
            }
        };
        let aim =
            l.deadline - Duration::from_micros(1_500) + Duration::from_micros(500 * (r % 7) as u64);
        let mut set = tokio::task::JoinSet::new();
        set.spawn(async move {
            until(aim).await;
            let out = format!("holder-{r}").into_bytes();
            match r % 3 {
                1 => {
                    if let Ok(l2) = holder.extend(&l, Duration::from_millis(200)).await {
                        let _ = holder.complete(&l2, &out, KEEP).await;
                    }
                }
                2 => {
                    let _ = holder.release(&l).await;
                }
                _ => {
                    let _ = holder.complete(&l, &out, KEEP).await;
                }
            }
        });
        for (i, s) in st.iter().enumerate() {
            let taker = Recorder::new(Arc::clone(s), history.clone(), i + 1);
            let k = k.clone();
            let at = aim + Duration::from_micros(400 * (i % 3) as u64) - Duration::from_micros(400);
            set.spawn(async move {
                until(at).await;
                let won = if i % 2 == 0 {
                    taker
                        .claim(&k, &opts(HELD))
                        .await
                        .ok()
                        .and_then(|a| a.lease().cloned())
                } else {
                    taker
                        .claim_many(&[k.clone(), k.clone()], &opts(HELD))
                        .await
                        .ok()
                        .and_then(|v| v.first().and_then(|a| a.lease().cloned()))
                };
                if let Some(l) = won {
                    let out = format!("taker{i}-{r}").into_bytes();
                    let _ = taker.complete(&l, &out, KEEP).await;
                }
            });
        }
        while let Some(j) = set.join_next().await {
            if let Err(e) = j {
                history.flag(format!("a racing task died: {e}"));
            }
        }
    }
    judge("deadline edge races", &history)?;
    Ok(())
}

/// Rule 2 under a race: keys that differ by case, Unicode normalisation, one
/// byte, a trailing space or length (up to the longest id), in namespaces that
/// differ the same way, claimed by two concurrent batches on two handles in
/// opposite orders: each is won exactly once and keeps its own outcome, and
/// every later claim of either handle sees that outcome.
pub async fn near_identical_keys_race(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, 2).await?;
    let history = history_for(&*st[0], "exact").await?.every_in_flight_seen();
    let base = "exact";
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
    ids.push("a".repeat(MAX_ID_BYTES));
    ids.push("a".repeat(MAX_ID_BYTES - 1));
    ids.push("ä".repeat(MAX_ID_BYTES / 2));
    ids.push("ä".repeat(MAX_ID_BYTES / 2 - 1) + "a");
    let mut keys = Vec::new();
    for ns in &nss[..2] {
        for id in &ids {
            keys.push(nkey(ns, id)?);
        }
    }
    for ns in &nss[2..] {
        keys.push(nkey(ns, "evt_1")?);
        keys.push(nkey(ns, "EVT_1")?);
    }
    let a = Recorder::new(Arc::clone(&st[0]), history.clone(), 0);
    let b = Recorder::new(Arc::clone(&st[1]), history.clone(), 1);
    let rev: Vec<Key> = keys.iter().rev().cloned().collect();
    let o = opts(HELD);
    let (ra, rb) = tokio::join!(a.claim_many(&keys, &o), b.claim_many(&rev, &o));
    let mut leases: HashMap<Key, Vec<(&Recorder, Lease)>> = HashMap::new();
    for (who, r) in [(&a, ra), (&b, rb)] {
        match r {
            Ok(v) => {
                for x in v {
                    if let ClaimOutcome::Claimed(l) = x {
                        leases.entry(l.key.clone()).or_default().push((who, l));
                    }
                }
            }
            Err(e) => history.flag(format!(
                "a batch of distinct near-identical keys failed: {e}"
            )),
        }
    }
    for (i, k) in keys.iter().enumerate() {
        let won = leases.get(k).map_or(0, Vec::len);
        if won != 1 {
            history.flag(format!(
                "keys not exact: {k:?} was won {won} times by two concurrent batches of distinct keys"
            ));
        }
        for (who, l) in leases.get(k).into_iter().flatten() {
            let mut out = format!("{i}:{k:?}").into_bytes();
            out.extend_from_slice(&[0, 255, 0]);
            let _ = who.complete(l, &out, KEEP).await;
        }
    }
    for who in [&a, &b] {
        for k in &keys {
            let _ = who.claim(k, &opts(HELD)).await;
        }
        let _ = who.claim_many(&rev, &opts(HELD)).await;
    }
    judge("near-identical keys", &history)
}

/// Outcomes come back byte for byte through another handle, by `claim` and by
/// `get`: empty, NULs, every byte value, bytes that are not UTF-8, and one
/// byte under and exactly at the store's limit.
pub async fn outcome_bytes_round_trip(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, 2).await?;
    let (a, b) = (&*st[0], &*st[1]);
    let mut bad = Vec::new();
    let max = a.capabilities().max_outcome_bytes;
    let mut seq = Sequence(0x9E37_79B9_7F4A_7C15);
    let big: Vec<u8> = (0..max).map(|_| (seq.next() >> 24) as u8).collect();
    let cases: Vec<Vec<u8>> = vec![
        Vec::new(),
        vec![0],
        vec![0, 0, 0],
        (0..=255u8).collect(),
        vec![0xff; 3],
        b"\xc3\x28 not utf-8 \xff\xfe".to_vec(),
        big[..max.saturating_sub(1)].to_vec(),
        big,
    ];
    for (i, out) in cases.iter().enumerate() {
        let k = nkey("outcomes", format!("outcome-{i}"))?;
        let Some(l) = expect_lease(a.claim(&k, &opts(HELD)).await, "claim", &mut bad) else {
            continue;
        };
        if let Err(e) = a.complete(&l, out, KEEP).await {
            bad.push(format!(
                "an outcome of {} bytes was refused: {e}",
                out.len()
            ));
            continue;
        }
        match b.claim(&k, &opts(HELD)).await {
            Ok(ClaimOutcome::Duplicate { outcome, .. }) if outcome == *out => {}
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => bad.push(format!(
                "lost outcome: an outcome of {} bytes came back as {} different bytes",
                out.len(),
                outcome.len()
            )),
            other => bad.push(format!(
                "a claim of a record done with {} outcome bytes answered {:?}",
                out.len(),
                other.map(|o| o.kind())
            )),
        }
        match b.get(&k).await? {
            Some(rec) => match rec.state {
                RecordState::Done { outcome, .. } if outcome == *out => {}
                RecordState::Done { outcome, .. } => bad.push(format!(
                    "get of a record done with {} bytes shows {} different bytes",
                    out.len(),
                    outcome.len()
                )),
                other => bad.push(format!(
                    "get of a record done with {} bytes shows {other:?}",
                    out.len()
                )),
            },
            None => bad.push("get of a done record found nothing".into()),
        }
    }
    verdict("outcome bytes", bad)
}

/// The contract's `claim_many` row at the edge where a batch outlasts its own
/// lease (2 ms and 50 ms leases, batches of a few thousand keys and of the
/// most a batch takes, with and without a claim id): the second place of a key
/// answers what a claim right after the first would (`InFlight` on the first
/// place's lease, or that same lease again with a claim id), never a second
/// `Claimed`. A store that judges each place by its own clock read takes the
/// first place's lease over within one call.
pub async fn key_twice_in_a_batch_outlasting_its_lease(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let s = fixture.store();
    let (small, big) = match factory.scale() {
        Scale::Full => (3_000, MAX_BATCH_KEYS - 2),
        Scale::Reduced => (300, factory.scale().distinct_keys() - 2),
    };
    let mut bad = Vec::new();
    for (ttl_ms, filler, with_cid) in [
        (2u64, small, false),
        (2, small, true),
        (50, big, false),
        (50, big, true),
    ] {
        let tag = format!("{ttl_ms}-{with_cid}");
        let k = nkey("twice", format!("twice-{tag}"))?;
        let mut keys = vec![k.clone()];
        for i in 0..filler {
            keys.push(nkey("twice", format!("filler-{tag}-{i}"))?);
        }
        keys.push(k.clone());
        let mut o = opts(Duration::from_millis(ttl_ms));
        if with_cid {
            o = o.with_claim_id(cid("twice-cid")?);
        }
        let started = Instant::now();
        let answers = s.claim_many(&keys, &o).await?;
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
                "a batch repeat won twice: lease {ttl_ms} ms, claim id {with_cid}, batch of {} keys taking {took:?}: the key's first place answered {first:?} and its second place {last:?}; the contract (and MemoryStore) answer the second place {expected:?}",
                keys.len()
            ));
        }
    }
    verdict("a key twice in a long batch", bad)
}

// ---------- claim_many against claims on the reference store ----------

/// What a key is before a batch meets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Before {
    Absent,
    /// In flight, claimed with claim id A and fingerprint 1.
    LiveA,
    /// In flight, claimed with neither.
    LiveNone,
    /// Done, claimed with fingerprint 1.
    DoneF1,
    /// Done, claimed with no fingerprint.
    DoneNone,
    /// Claimed with claim id A and a lease that passed before the batch.
    ExpiredA,
    /// Done with a retention that passed before the batch.
    ExpiredDone,
}

const BEFORE: [Before; 7] = [
    Before::Absent,
    Before::LiveA,
    Before::LiveNone,
    Before::DoneF1,
    Before::DoneNone,
    Before::ExpiredA,
    Before::ExpiredDone,
];

/// The lease or retention of the records that expire before the batch.
const EXPIRING: Duration = Duration::from_millis(150);

/// One scenario: the states of ten keys, a batch over them (with repeats),
/// and the batch's claim id and fingerprint.
#[derive(Clone, Debug)]
struct Scenario {
    before: Vec<Before>,
    batch: Vec<usize>,
    claim_id: Option<&'static str>,
    fingerprint: Option<u8>,
}

fn scenarios(seed: u64, n: usize, keys: usize) -> Vec<Scenario> {
    let mut seq = Sequence(seed | 1);
    (0..n)
        .map(|_| {
            let before = (0..keys).map(|_| BEFORE[seq.below(BEFORE.len())]).collect();
            let len = 1 + seq.below(24);
            let batch = (0..len).map(|_| seq.below(keys)).collect();
            let claim_id = [None, Some("cid-A"), Some("cid-B")][seq.below(3)];
            let fingerprint = [None, Some(1u8), Some(2u8)][seq.below(3)];
            Scenario {
                before,
                batch,
                claim_id,
                fingerprint,
            }
        })
        .collect()
}

/// How a side's handle is used just before each batch, so stores that pick
/// their statements by recent traffic are met in each of their modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warmup {
    /// Nine duplicate claims of one done key (a retry storm).
    Duplicates,
    /// Nine claims of new keys (fresh deliveries).
    NewKeys,
}

/// One way of answering the scenarios' batches.
#[derive(Clone)]
pub struct BatchSide {
    /// Its name in a failure.
    pub name: String,
    /// The store asked.
    pub store: Arc<dyn DedupeStore>,
    /// `true`: one `claim_many`; `false`: a `claim` per place, in order.
    pub many: bool,
    /// What the handle does just before each batch.
    pub warm: Option<Warmup>,
}

impl std::fmt::Debug for BatchSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchSide")
            .field("name", &self.name)
            .field("many", &self.many)
            .field("warm", &self.warm)
            .finish_non_exhaustive()
    }
}

async fn set_up(
    s: &dyn DedupeStore,
    ns: &str,
    sc: &Scenario,
) -> Result<Vec<Option<Lease>>, Failure> {
    let mut leases = Vec::new();
    for (i, before) in sc.before.iter().enumerate() {
        let k = nkey(ns, format!("k{i}"))?;
        let out = format!("out-{i}").into_bytes();
        let o = match before {
            Before::Absent => {
                leases.push(None);
                continue;
            }
            Before::LiveA => opts(LONG_TTL)
                .with_claim_id(cid("cid-A")?)
                .with_fingerprint(fp(1)?),
            Before::DoneF1 => opts(LONG_TTL).with_fingerprint(fp(1)?),
            Before::ExpiredA => opts(EXPIRING).with_claim_id(cid("cid-A")?),
            Before::LiveNone | Before::DoneNone | Before::ExpiredDone => opts(LONG_TTL),
        };
        let l = must_claim(s, &k, &o).await?;
        match before {
            Before::DoneF1 | Before::DoneNone => {
                s.complete(&l, &out, KEEP).await?;
                leases.push(None);
            }
            Before::ExpiredDone => {
                s.complete(&l, &out, EXPIRING).await?;
                leases.push(None);
            }
            _ => leases.push(Some(l)),
        }
    }
    Ok(leases)
}

fn scenario_opts(sc: &Scenario) -> Result<ClaimOptions, Failure> {
    let mut o = opts(LONG_TTL);
    if let Some(c) = sc.claim_id {
        o = o.with_claim_id(cid(c)?);
    }
    if let Some(f) = sc.fingerprint {
        o = o.with_fingerprint(fp(f)?);
    }
    Ok(o)
}

/// The first earlier place of the same key whose `Claimed` lease satisfies `pred`.
fn earlier_place(
    answers: &[ClaimOutcome],
    batch: &[usize],
    pos: usize,
    pred: impl Fn(&Lease) -> bool,
) -> Option<usize> {
    answers[..pos]
        .iter()
        .enumerate()
        .find_map(|(p, b)| match b {
            ClaimOutcome::Claimed(l) if batch[p] == batch[pos] && pred(l) => Some(p),
            _ => None,
        })
}

/// Each answer in words that do not depend on which store or handle gave it:
/// tokens and deadlines by where they came from (the set-up, an earlier place
/// of the batch, or new).
fn in_words(sc: &Scenario, setup: &[Option<Lease>], answers: &[ClaimOutcome]) -> Vec<String> {
    let mut words = Vec::new();
    for (pos, a) in answers.iter().enumerate() {
        let s: Option<&Lease> = setup[sc.batch[pos]].as_ref();
        let origin = |what: &str, same: &dyn Fn(&Lease) -> bool, new: &str| -> String {
            if s.is_some_and(same) {
                format!("the set-up's {what}")
            } else if let Some(p) = earlier_place(answers, &sc.batch, pos, same) {
                format!("place {p}'s {what}")
            } else {
                new.to_string()
            }
        };
        words.push(match a {
            ClaimOutcome::Claimed(l) => format!(
                "Claimed(attempt {}, claim id {:?}, {}, {})",
                l.attempt,
                l.claim_id.as_ref().map(|c| c.as_str().to_string()),
                origin("token", &|e: &Lease| e.token == l.token, "a new token"),
                origin(
                    "deadline",
                    &|e: &Lease| e.deadline == l.deadline,
                    "a new deadline"
                ),
            ),
            ClaimOutcome::InFlight { deadline, attempt } => format!(
                "InFlight(attempt {attempt}, {})",
                origin(
                    "deadline",
                    &|e: &Lease| e.deadline == *deadline,
                    "an unknown deadline"
                )
            ),
            ClaimOutcome::Duplicate { outcome, .. } => {
                format!("Duplicate({})", String::from_utf8_lossy(outcome))
            }
            ClaimOutcome::Mismatch { state } => format!("Mismatch({state:?})"),
        });
    }
    words
}

async fn warm_up(
    s: &dyn DedupeStore,
    warm: Warmup,
    done: &Key,
    n: &AtomicU64,
) -> Result<(), Failure> {
    for _ in 0..9 {
        match warm {
            Warmup::Duplicates => {
                let _ = s.claim(done, &opts(HELD)).await?;
            }
            Warmup::NewKeys => {
                let i = n.fetch_add(1, Ordering::Relaxed);
                let _ = s
                    .claim(
                        &nkey("warm", format!("new{i}"))?,
                        &opts(Duration::from_secs(1)),
                    )
                    .await?;
            }
        }
    }
    Ok(())
}

/// Sets every scenario up once per side (each in a namespace of its own), lets
/// the expiring records expire, then asks every side the same batch and
/// compares every answer with `claim`s, place by place, on the reference
/// [`MemoryStore`](dedupe_core::MemoryStore) (set up the same way). Answers
/// every disagreement, in words; the sides' stores must be empty of the
/// namespaces `b{side}s{scenario}` and `warm`.
pub async fn batches_against_reference(
    sides: Vec<BatchSide>,
    seed: u64,
    n: usize,
) -> Result<(), Failure> {
    let mem: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let mut sides = sides;
    sides.push(BatchSide {
        name: "MemoryStore claim_many".into(),
        store: Arc::clone(&mem),
        many: true,
        warm: None,
    });
    sides.push(BatchSide {
        name: "MemoryStore claim, place by place (the reference)".into(),
        store: mem,
        many: false,
        warm: None,
    });
    let scns = scenarios(seed, n, 10);
    let warm_count = Arc::new(AtomicU64::new(0));
    let done_key = nkey("warm", "done")?;
    for side in &sides {
        if side.warm.is_some() {
            if let ClaimOutcome::Claimed(l) = side.store.claim(&done_key, &opts(HELD)).await? {
                side.store.complete(&l, b"warm", KEEP).await?;
            }
        }
    }
    // Set-up, every (side, scenario) at once.
    let mut set = tokio::task::JoinSet::new();
    for (ri, side) in sides.iter().enumerate() {
        for (si, sc) in scns.iter().enumerate() {
            let (s, sc, ns) = (Arc::clone(&side.store), sc.clone(), format!("b{ri}s{si}"));
            set.spawn(async move { ((ri, si), set_up(&*s, &ns, &sc).await) });
        }
    }
    let mut setups: HashMap<(usize, usize), Vec<Option<Lease>>> = HashMap::new();
    while let Some(j) = set.join_next().await {
        let (at, leases) = j.map_err(|e| Failure::new(format!("a set-up task died: {e}")))?;
        setups.insert(at, leases?);
    }
    tokio::time::sleep(EXPIRING * 2).await;
    let mut bad = Vec::new();
    for (si, sc) in scns.iter().enumerate() {
        let mut answers: Vec<(String, Vec<String>)> = Vec::new();
        for (ri, side) in sides.iter().enumerate() {
            let ns = format!("b{ri}s{si}");
            let keys: Vec<Key> = sc
                .batch
                .iter()
                .map(|i| nkey(&ns, format!("k{i}")))
                .collect::<Result<_, _>>()?;
            if let Some(warm) = side.warm {
                warm_up(&*side.store, warm, &done_key, &warm_count).await?;
            }
            let o = scenario_opts(sc)?;
            let got = if side.many {
                side.store.claim_many(&keys, &o).await
            } else {
                let mut v = Vec::new();
                let mut failed = None;
                for k in &keys {
                    match side.store.claim(k, &o).await {
                        Ok(a) => v.push(a),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                failed.map_or(Ok(v), Err)
            };
            match got {
                Ok(v) if v.len() == keys.len() => {
                    answers.push((side.name.clone(), in_words(sc, &setups[&(ri, si)], &v)));
                }
                other => bad.push(format!(
                    "scenario {si} ({sc:?}), {}: answered {:?}",
                    side.name,
                    other.map(|v| v.len())
                )),
            }
        }
        let Some((_, reference)) = answers.last().cloned() else {
            continue;
        };
        for (name, got) in &answers {
            if let Some(first) = got.iter().zip(&reference).position(|(x, y)| x != y) {
                bad.push(format!(
                    "claim_many disagrees: scenario {si}, states {:?}, batch {:?}, claim id {:?}, fingerprint {:?}: {name} answered place {first} (key k{}) with {:?} where claims on the reference answer {:?}",
                    sc.before,
                    sc.batch,
                    sc.claim_id,
                    sc.fingerprint,
                    sc.batch[first],
                    got.get(first),
                    reference.get(first)
                ));
            }
        }
    }
    ensure!(
        bad.is_empty(),
        "{} disagreements with the reference:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
    Ok(())
}

/// `claim_many` answers every place as `claim`s on the reference store would,
/// over random scenarios: ten keys each absent, in flight (with or without
/// claim id and fingerprint), done (with or without fingerprint), with a lease
/// or a retention that passed; batches of 1 to 24 places with repeats; with and
/// without a claim id and a fingerprint. Asked of one handle by `claim_many`,
/// of another place by place, and of handles that were used a moment before
/// by a storm of duplicates or a run of new keys.
pub async fn claim_many_matches_reference_claims(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, HANDLES).await?;
    let side = |i: usize, name: &str, many, warm| BatchSide {
        name: name.to_string(),
        store: Arc::clone(&st[i]),
        many,
        warm,
    };
    let sides = vec![
        side(0, "claim_many", true, None),
        side(1, "claim, place by place", false, None),
        side(
            2,
            "claim_many after a storm of duplicates",
            true,
            Some(Warmup::Duplicates),
        ),
        side(
            3,
            "claim_many after a run of new keys",
            true,
            Some(Warmup::NewKeys),
        ),
    ];
    let n = if factory.scale() == Scale::Full {
        24
    } else {
        8
    };
    batches_against_reference(sides, 0x5EED_0001, n).await?;
    Ok(Verdict::Passed)
}

// ---------- cancelled calls ----------

/// Random calls on sixteen keys, each under a timeout of 0 to 4 ms, so many
/// futures are dropped half way (queued, mid-statement, between statements).
async fn cancelling_worker(
    rec: Recorder,
    t: usize,
    done: Vec<Key>,
    stop_at: Instant,
) -> Result<(), Failure> {
    let mut seq = Sequence(0x00C0_FFEE ^ (t as u64 + 1).wrapping_mul(7919));
    let mut held: Vec<Lease> = Vec::new();
    let ttl = Duration::from_millis(150);
    let within = |seq: &mut Sequence| Duration::from_micros(seq.below(4_000) as u64);
    while Instant::now() < stop_at {
        let k = nkey("storm", format!("c{}", seq.below(16)))?;
        let tmo = within(&mut seq);
        match seq.below(11) {
            0..=3 => {
                if let Ok(Ok(ClaimOutcome::Claimed(l))) =
                    tokio::time::timeout(tmo, rec.claim(&k, &opts(ttl))).await
                {
                    held.push(l);
                }
            }
            4 => {
                let keys = vec![k.clone(), nkey("storm", format!("c{}", seq.below(16)))?, k];
                if let Ok(Ok(v)) =
                    tokio::time::timeout(tmo, rec.claim_many(&keys, &opts(ttl))).await
                {
                    held.extend(v.iter().filter_map(|a| a.lease().cloned()));
                }
            }
            5 => {
                if !done.is_empty() {
                    let d = &done[seq.below(done.len())];
                    let _ = tokio::time::timeout(tmo, rec.claim(d, &opts(HELD))).await;
                }
            }
            6 | 7 => {
                if let Some(l) = held.pop() {
                    let out = format!("cx{t}-{}", seq.next()).into_bytes();
                    let _ = tokio::time::timeout(tmo, rec.complete(&l, &out, KEEP)).await;
                }
            }
            8 => {
                if let Some(l) = held.pop() {
                    let _ = tokio::time::timeout(tmo, rec.release(&l)).await;
                }
            }
            _ => {
                if let Some(l) = held.pop() {
                    if let Ok(Ok(l2)) = tokio::time::timeout(tmo, rec.extend(&l, ttl)).await {
                        held.push(l2);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Twelve tasks on four handles call for two seconds with timeouts of 0 to 4
/// ms, so futures are dropped while queued, between a read and a write, or
/// mid-write. Whatever was answered must fit the contract (a dropped call
/// counts as one of unknown effect), no lease outlives its deadline: 600 ms
/// after the storm every key is free or done, and every handle still answers
/// a fresh claim within five seconds.
pub async fn cancelled_calls_leave_a_sound_store(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let st = handles(&*fixture, HANDLES).await?;
    let history = history_for(&*st[0], "storm").await?.every_in_flight_seen();
    cancellation_storm_on(&st, 12, Duration::from_secs(2), &history).await?;
    history.verdict("cancellation storm")?;
    Ok(Verdict::Passed)
}

/// The storm of [`cancelled_calls_leave_a_sound_store`] with `tasks` tasks for
/// `during` on handles of the caller's (while the caller does something to
/// the store, say), recorded into `history`, which the caller judges (after
/// recording more calls of its own, if it likes). Answers the done keys the
/// storm claimed among its others.
pub async fn cancellation_storm_on(
    st: &[Arc<dyn DedupeStore>],
    tasks: usize,
    during: Duration,
    history: &History,
) -> Result<Vec<Key>, Failure> {
    ensure!(!st.is_empty(), "cancellation_storm_on needs a handle");
    let setup = Recorder::new(Arc::clone(&st[0]), history.clone(), usize::MAX);
    let mut done = Vec::new();
    for i in 0..6 {
        let k = nkey("storm-done", format!("d{i}"))?;
        if let ClaimOutcome::Claimed(l) = setup.claim(&k, &opts(HELD)).await? {
            setup.complete(&l, format!("d{i}").as_bytes(), KEEP).await?;
        }
        done.push(k);
    }
    let stop_at = Instant::now() + during;
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let rec = Recorder::new(Arc::clone(&st[t % st.len()]), history.clone(), t);
        set.spawn(cancelling_worker(rec, t, done.clone(), stop_at));
    }
    let joined = tokio::time::timeout(during + Duration::from_secs(60), async {
        let mut died = Vec::new();
        while let Some(j) = set.join_next().await {
            match j {
                Ok(Ok(())) => {}
                Ok(Err(f)) => died.push(f.to_string()),
                Err(e) => died.push(format!("a worker died: {e}")),
            }
        }
        died
    })
    .await;
    let died = joined.map_err(|_| {
        Failure::new("hang: the cancellation storm did not end within a minute of its time")
    })?;
    ensure!(died.is_empty(), "{died:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    for i in 0..16 {
        let k = nkey("storm", format!("c{i}"))?;
        let after = Recorder::new(Arc::clone(&st[i % st.len()]), history.clone(), 1000 + i);
        match after.claim(&k, &opts(HELD)).await {
            Ok(ClaimOutcome::Claimed(_) | ClaimOutcome::Duplicate { .. }) => {}
            other => history.flag(format!(
                "{k}: 600 ms after every 150 ms lease of the storm had been set, a claim answered {other:?}"
            )),
        }
    }
    for (i, s) in st.iter().enumerate() {
        let k = nkey("storm", format!("alive{i}"))?;
        match tokio::time::timeout(Duration::from_secs(5), s.claim(&k, &opts(HELD))).await {
            Ok(Ok(ClaimOutcome::Claimed(_))) => {}
            Ok(other) => history.flag(format!(
                "handle {i} after the storm: a fresh key answered {other:?}"
            )),
            Err(_) => history.flag(format!(
                "hang: handle {i} did not answer a fresh claim within 5 s after the storm"
            )),
        }
    }
    Ok(done)
}
