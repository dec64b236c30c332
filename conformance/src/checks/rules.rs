//! One check per rule of the contract.

use super::*;

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
    let cases: [(&str, &[u8]); 6] = [
        ("empty", b""),
        ("small", b"order 17 created"),
        ("bytes", &all_bytes),
        ("64k", &big),
        // What a C string or a padded CHAR column would lose.
        ("trailing-nul", b"ok\0\0"),
        ("trailing-space", b"ok  "),
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

/// Release removes the record; asked again, it answers Ok (nothing live holds
/// the key: rule 10); the next claim wins with a new token, attempt 1; the
/// released lease can no longer complete or release. A complete asked again
/// with the same outcome answers Ok and changes nothing; with another outcome,
/// LeaseLost.
pub async fn release_then_reclaim(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("released")?;
    let first = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    let first_seen = match store.get(&k).await? {
        Some(record) => record.first_seen,
        None => return Err(Failure::new("get finds no record of a fresh claim")),
    };
    // The clocks that stamp first_seen count milliseconds: let one pass.
    tokio::time::sleep(Duration::from_millis(5)).await;
    store.release(&first).await?;
    ensure!(
        store.get(&k).await?.is_none(),
        "get still finds a record after release"
    );
    if let Err(e) = store.release(&first).await {
        return Err(Failure::new(format!(
            "a release asked again, with nothing under the key, failed: {e} (expected Ok, as the first)"
        )));
    }
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
    match store.get(&k).await? {
        Some(record) => ensure!(
            record.first_seen > first_seen,
            "the claim after a release kept the released record's first_seen \
             ({:?}, was {first_seen:?}): the release did not remove the record",
            record.first_seen
        ),
        None => {
            return Err(Failure::new(
                "get finds no record of the claim after a release",
            ))
        }
    }
    expect_lease_lost(
        "release of an already released lease",
        store.release(&first).await,
    )?;
    expect_lease_lost(
        "complete with a released lease",
        store.complete(&first, b"x", LONG_TTL).await,
    )?;
    // An outcome long enough that another one can share all but its last byte.
    let outcome: Vec<u8> = (0..200u8).collect();
    store.complete(&second, &outcome, LONG_TTL).await?;
    let done = store.get(&k).await?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Asked again with another retention: Ok, and nothing changes (neither
    // the completion time nor the retention).
    if let Err(e) = store.complete(&second, &outcome, LONG_TTL / 2).await {
        return Err(Failure::new(format!(
            "a complete asked again with the same lease and outcome failed: {e} (expected Ok, as the first)"
        )));
    }
    ensure!(
        store.get(&k).await? == done,
        "a complete asked again changed the done record: {:?}, was {done:?}",
        store.get(&k).await?
    );
    let mut nearly = outcome.clone();
    if let Some(last) = nearly.last_mut() {
        *last ^= 1;
    }
    expect_lease_lost(
        "a second complete with an outcome differing in its last byte",
        store.complete(&second, &nearly, LONG_TTL).await,
    )?;
    expect_lease_lost(
        "a second complete with another outcome",
        store.complete(&second, b"other", LONG_TTL).await,
    )?;
    expect_lease_lost("release after complete", store.release(&second).await)?;
    expect_lease_lost(
        "release of an old lease over another lease's done record",
        store.release(&first).await,
    )?;
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
    // Its completion asked again once the record is gone: nothing live holds
    // this outcome any more, so it is no longer the same complete.
    expect_lease_lost(
        "a complete asked again past the record's retention",
        store.complete(&lease, b"v1", SHORT_TTL).await,
    )?;
    ensure!(
        store.get(&k).await?.is_none(),
        "a complete asked again past the retention brought the record back"
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
    // A claim id does not override a payload check: the holder's own claim id
    // with another payload is still a Mismatch, never its lease back.
    let held = key("payload-held")?;
    let worker = ClaimId::new("worker-1").map_err(|e| Failure::new(e.to_string()))?;
    let lease = must_claim(
        &*store,
        &held,
        &original.clone().with_claim_id(worker.clone()),
    )
    .await?;
    match store
        .claim(&held, &forged.clone().with_claim_id(worker))
        .await?
    {
        ClaimOutcome::Mismatch { .. } => {}
        other => {
            return Err(Failure::new(format!(
                "the holder's claim id with another payload answered {other:?}, expected \
                 Mismatch: a fingerprint is checked whatever the claim id"
            )))
        }
    }
    store.complete(&lease, b"held", LONG_TTL).await?;
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
    // One claim id on two leases of one key: a lease that passed and was
    // taken over under the same claim id is fenced by its token all the same.
    let shared = key("reentrant-takeover")?;
    let short = opts(Duration::from_millis(50)).with_claim_id(cid("attempt-C")?);
    let stale = must_claim(&*store, &shared, &short).await?;
    wait_past(stale.deadline).await?;
    let taker = must_claim(
        &*store,
        &shared,
        &opts(LONG_TTL).with_claim_id(cid("attempt-C")?),
    )
    .await?;
    ensure!(
        taker.token != stale.token,
        "a takeover under the same claim id kept the passed lease's token"
    );
    expect_lease_lost(
        "extend with a passed lease whose claim id the new holder shares",
        store.extend(&stale, LONG_TTL).await.map(|_| ()),
    )?;
    expect_lease_lost(
        "complete with a passed lease whose claim id the new holder shares",
        store.complete(&stale, b"stale", LONG_TTL).await,
    )?;
    expect_lease_lost(
        "release with a passed lease whose claim id the new holder shares",
        store.release(&stale).await,
    )?;
    store.complete(&taker, b"taker", LONG_TTL).await?;
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
    // Fingerprints in batches: compared against live records, and stored with
    // the claims a batch wins.
    let (fp_1, fp_2) = (Fingerprint::sha256(b"one"), Fingerprint::sha256(b"two"));
    let fresh = key("batch-fp-fresh")?;
    let answers = store
        .claim_many(
            &[fresh.clone(), done.clone()],
            &opts(LONG_TTL).with_fingerprint(fp_1.clone()),
        )
        .await?;
    ensure!(
        answers[0].lease().is_some(),
        "a fresh key in a batch with a fingerprint answered {:?}",
        answers[0]
    );
    let stored = store.get(&fresh).await?.and_then(|r| r.fingerprint);
    ensure!(
        stored.as_ref() == Some(&fp_1),
        "a batch's claim stored fingerprint {stored:?}, expected the batch's"
    );
    let answers = store
        .claim_many(
            std::slice::from_ref(&fresh),
            &opts(LONG_TTL).with_fingerprint(fp_2),
        )
        .await?;
    ensure!(
        matches!(answers[0], ClaimOutcome::Mismatch { .. }),
        "a batch with another fingerprint on a live key answered {:?}, expected Mismatch",
        answers[0]
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
    // In one batch too: the same id in two namespaces is two claims, and only the
    // key itself repeated is a repeat.
    let batch = ["stripe", "github", "stripe"]
        .into_iter()
        .map(|ns| Key::new(ns, "evt_2").map_err(|e| Failure::new(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let answers = store.claim_many(&batch, &opts(LONG_TTL)).await?;
    let kinds: Vec<&str> = answers.iter().map(ClaimOutcome::kind).collect();
    ensure!(
        kinds == ["claimed", "claimed", "in-flight"],
        "claim_many of stripe:evt_2, github:evt_2, stripe:evt_2 answered {kinds:?}, expected \
         claimed, claimed, in-flight"
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
    let flying_seen = match store.get(&flying).await? {
        Some(record) => record.first_seen,
        None => return Err(Failure::new("get finds no record of a fresh claim")),
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    ensure!(
        store.forget(&flying).await?,
        "forget of an in-flight record answered false"
    );
    let reclaimed = must_claim(&*store, &flying, &opts(LONG_TTL)).await?;
    match store.get(&flying).await? {
        Some(record) => ensure!(
            reclaimed.attempt == 1 && record.first_seen > flying_seen,
            "the claim after a forget is attempt {} with first_seen {:?} (was {flying_seen:?}): \
             the forget did not remove the record",
            reclaimed.attempt,
            record.first_seen
        ),
        None => {
            return Err(Failure::new(
                "get finds no record of the claim after a forget",
            ))
        }
    }
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

/// Ten thousand distinct keys (a thousand at reduced scale), claimed in one
/// `claim_many` call (the most a batch may hold), are all Claimed (no false
/// duplicates), and all answer InFlight afterwards.
pub async fn ten_thousand_distinct_keys(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let keys: Vec<Key> = (0..factory.scale().distinct_keys())
        .map(|i| key(&format!("many-{i:05}")))
        .collect::<Result<_, _>>()?;
    let mut tokens = HashSet::new();
    for chunk in keys.chunks(dedupe_core::MAX_BATCH_KEYS) {
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

/// A `claim_many` batch over [`MAX_BATCH_KEYS`](dedupe_core::MAX_BATCH_KEYS)
/// is refused with `BatchTooLarge` before anything is written: none of its
/// keys is claimed afterwards.
pub async fn oversized_batches_are_refused(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let limit = dedupe_core::MAX_BATCH_KEYS;
    let keys: Vec<Key> = (0..=limit)
        .map(|i| key(&format!("over-{i:05}")))
        .collect::<Result<_, _>>()?;
    match store.claim_many(&keys, &opts(LONG_TTL)).await {
        Err(Error::BatchTooLarge { size, limit: l }) => ensure!(
            size == limit + 1 && l == limit,
            "BatchTooLarge reports size {size} limit {l}, expected {} and {limit}",
            limit + 1
        ),
        Ok(answers) => {
            return Err(Failure::new(format!(
                "a batch of {} keys was claimed ({} answers), expected BatchTooLarge",
                keys.len(),
                answers.len()
            )))
        }
        Err(other) => {
            return Err(Failure::new(format!(
                "a batch of {} keys failed with {other:?}, expected BatchTooLarge",
                keys.len()
            )))
        }
    }
    for k in [&keys[0], &keys[limit / 2], &keys[limit]] {
        ensure!(
            store.get(k).await?.is_none(),
            "{k} of a refused batch was written"
        );
    }
    Ok(Verdict::Passed)
}
