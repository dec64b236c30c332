//! Time in a record's life: leases that pass with nobody taking over, what a
//! takeover replaces and keeps, time between claim and completion, and deadlines
//! to the millisecond.

use super::*;

/// Rules 4 and 5: a lease whose deadline passed while nobody took over is lost
/// to its holder (complete and extend answer LeaseLost and change nothing;
/// release answers Ok, as nothing live holds the key, and changes nothing
/// either), and its record counts as absent: `get` finds nothing, `forget`
/// answers false, a claim with another payload is Claimed (a takeover that
/// counts the passed attempt), not Mismatch. A done record past its retention
/// is absent the same way.
pub async fn passed_lease_is_lost(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let first = Fingerprint::sha256(b"first payload");
    let other = Fingerprint::sha256(b"other payload");
    let (k, gone, done) = (key("passed")?, key("passed-forget")?, key("passed-done")?);
    let lease = must_claim(
        &*store,
        &k,
        &opts(SHORT_TTL).with_fingerprint(first.clone()),
    )
    .await?;
    let gone_lease = must_claim(&*store, &gone, &opts(SHORT_TTL)).await?;
    let done_lease = must_claim(&*store, &done, &opts(LONG_TTL)).await?;
    store
        .complete(&done_lease, b"kept briefly", SHORT_TTL * 3)
        .await?;
    let done_deadline = match live_record(&*store, &done, "after complete").await?.state {
        RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
        other => return Err(Failure::new(format!("completed record shows {other:?}"))),
    };
    wait_past(lease.deadline.max(gone_lease.deadline).max(done_deadline)).await?;

    expect_lease_lost(
        "complete of a lease past its deadline",
        store.complete(&lease, b"late", LONG_TTL).await,
    )?;
    expect_lease_lost(
        "extend of a lease past its deadline",
        store.extend(&lease, LONG_TTL).await,
    )?;
    if let Err(e) = store.release(&lease).await {
        return Err(Failure::new(format!(
            "release of a lease past its deadline, nothing live under its key, failed: {e} \
             (expected Ok: the key is free, as asked)"
        )));
    }
    ensure!(
        store.get(&k).await?.is_none(),
        "get shows a record whose lease passed (after a late complete/extend/release)"
    );
    ensure!(
        !store.forget(&gone).await?,
        "forget of a record whose lease passed answered true: it was not live"
    );
    ensure!(
        store.get(&done).await?.is_none(),
        "get shows a done record past its retention"
    );
    ensure!(
        !store.forget(&done).await?,
        "forget of a done record past its retention answered true"
    );
    match store
        .claim(&k, &opts(LONG_TTL).with_fingerprint(other))
        .await?
    {
        ClaimOutcome::Claimed(taken) => ensure!(
            taken.attempt == 2,
            "the takeover of a passed lease is attempt {}, expected 2",
            taken.attempt
        ),
        answer => {
            return Err(Failure::new(format!(
                "a claim with another payload on a record whose lease passed answered \
                 {answer:?}: an expired record counts as absent, expected Claimed"
            )))
        }
    }
    Ok(Verdict::Passed)
}

/// A takeover replaces everything of the previous holder (token, claim id,
/// fingerprint, deadline) and keeps what belongs to the record (`first_seen`,
/// the attempt count, over several takeovers and the completion that follows);
/// the old claim id no longer gets the lease. A done record whose retention
/// passed starts over: attempt 1, a new `first_seen`, in flight with no outcome.
pub async fn takeover_resets_holder_keeps_record(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let k = key("takeover-state")?;
    let (fp_a, fp_b) = (Fingerprint::sha256(b"a"), Fingerprint::sha256(b"b"));
    let worker_a = ClaimId::new("worker-a").map_err(|e| Failure::new(e.to_string()))?;
    let worker_c = ClaimId::new("worker-c").map_err(|e| Failure::new(e.to_string()))?;
    let first = must_claim(
        &*store,
        &k,
        &opts(SHORT_TTL)
            .with_claim_id(worker_a.clone())
            .with_fingerprint(fp_a.clone()),
    )
    .await?;
    let first_seen = live_record(&*store, &k, "after the first claim")
        .await?
        .first_seen;
    wait_past(first.deadline).await?;
    // Enough time for a rewritten first_seen to show.
    tokio::time::sleep(Duration::from_millis(40)).await;

    // A longer lease: several calls must see it live.
    let second = must_claim(
        &*store,
        &k,
        &opts(SHORT_TTL * 3).with_fingerprint(fp_b.clone()),
    )
    .await?;
    ensure!(
        second.attempt == 2 && second.claim_id.is_none() && second.token != first.token,
        "the takeover answered {second:?}: expected attempt 2, no claim id, a new token"
    );
    let record = live_record(&*store, &k, "after a takeover").await?;
    ensure!(
        record.token == second.token
            && record.claim_id.is_none()
            && record.fingerprint.as_ref() == Some(&fp_b)
            && record.attempts == 2
            && record.first_seen == first_seen
            && record.state
                == RecordState::InFlight {
                    lease_deadline: second.deadline
                },
        "after a takeover get shows {record:?}; expected the new holder's token, no claim id, \
         the new fingerprint, deadline {:?}, 2 attempts and first_seen {first_seen:?} kept",
        second.deadline
    );
    match store
        .claim(
            &k,
            &opts(LONG_TTL)
                .with_claim_id(worker_a)
                .with_fingerprint(fp_b.clone()),
        )
        .await?
    {
        ClaimOutcome::InFlight { attempt: 2, .. } => {}
        other => {
            return Err(Failure::new(format!(
                "the dead holder's claim id, retried after a takeover, answered {other:?}; \
                 expected InFlight (attempt 2): the lease is no longer its"
            )))
        }
    }
    match store
        .claim(&k, &opts(LONG_TTL).with_fingerprint(fp_a))
        .await?
    {
        ClaimOutcome::Mismatch { .. } => {}
        other => {
            return Err(Failure::new(format!(
                "the dead holder's payload after a takeover with another payload answered \
                 {other:?}, expected Mismatch"
            )))
        }
    }

    wait_past(second.deadline).await?;
    let third = must_claim(
        &*store,
        &k,
        &opts(LONG_TTL)
            .with_claim_id(worker_c.clone())
            .with_fingerprint(fp_b.clone()),
    )
    .await?;
    ensure!(
        third.attempt == 3 && third.claim_id.as_ref() == Some(&worker_c),
        "a second takeover answered {third:?}: expected attempt 3 with claim id worker-c"
    );
    let record = live_record(&*store, &k, "after a second takeover").await?;
    ensure!(
        record.attempts == 3 && record.first_seen == first_seen,
        "after two takeovers get shows {} attempts and first_seen {:?}; expected 3 and {first_seen:?}",
        record.attempts,
        record.first_seen
    );

    // Long enough for the get below to find it on a loaded machine.
    store
        .complete(&third, b"third did it", SHORT_TTL * 3)
        .await?;
    let done = live_record(&*store, &k, "after complete").await?;
    ensure!(
        done.first_seen == first_seen && done.attempts == 3,
        "after complete get shows first_seen {:?} and {} attempts; a completion keeps both \
         ({first_seen:?}, 3)",
        done.first_seen,
        done.attempts
    );
    let retention_deadline = match done.state {
        RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
        other => return Err(Failure::new(format!("completed record shows {other:?}"))),
    };
    wait_past(retention_deadline).await?;
    let fourth = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    ensure!(
        fourth.attempt == 1 && fourth.claim_id.is_none(),
        "a claim after the retention of a done record passed answered {fourth:?}: it starts \
         over at attempt 1 (finished work is not a dead worker)"
    );
    let record = live_record(&*store, &k, "after a claim of an expired done record").await?;
    ensure!(
        record.attempts == 1
            && record.first_seen > first_seen
            && record.fingerprint.is_none()
            && record.state
                == RecordState::InFlight {
                    lease_deadline: fourth.deadline
                },
        "a claim of an expired done record left {record:?}: expected a fresh in-flight record \
         (1 attempt, a new first_seen, no fingerprint, no outcome)"
    );
    store.complete(&fourth, b"fourth", LONG_TTL).await?;
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::Duplicate { outcome, .. } if outcome == b"fourth" => {}
        other => {
            return Err(Failure::new(format!(
                "after the fresh claim completed, a claim answered {other:?}"
            )))
        }
    }
    Ok(Verdict::Passed)
}

/// Time between claim and complete: retention counts from the completion, not
/// from the claim; `completed_at` is when `complete` ran, and a Duplicate
/// reports that stored time, not the time of the duplicate claim.
pub async fn retention_counts_from_completion(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let clock = Clock::measure(&*store, "retention").await?;
    let k = key("slow-work")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    // The work takes a while.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retention = Duration::from_millis(1000);
    let before = SystemTime::now();
    store.complete(&lease, b"slow but done", retention).await?;
    let after = SystemTime::now();
    let record = live_record(&*store, &k, "after complete").await?;
    let RecordState::Done {
        completed_at,
        retention_deadline,
        ..
    } = record.state
    else {
        return Err(Failure::new(format!(
            "completed record shows {:?}",
            record.state
        )));
    };
    clock.expect(
        "completed_at",
        completed_at + retention,
        before,
        after,
        retention,
    )?;
    clock.expect(
        "the retention deadline",
        retention_deadline,
        before,
        after,
        retention,
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::Duplicate {
            completed_at: reported,
            outcome,
        } => {
            ensure!(
                reported == completed_at && outcome == b"slow but done",
                "Duplicate reports completed_at {reported:?} (stored {completed_at:?}) and \
                 outcome {outcome:?}"
            );
        }
        other => {
            return Err(Failure::new(format!(
                "a claim {retention:?} after completing (retention counted from completion) \
                 answered {other:?}, expected Duplicate"
            )))
        }
    }
    wait_past_on(&clock, retention_deadline).await?;
    ensure!(
        store.get(&k).await?.is_none(),
        "the done record is still live after its retention deadline"
    );
    Ok(Verdict::Passed)
}

/// Rule 4 with no grace: a lease is lost the moment its deadline passes, on the
/// store's clock. A complete or extend sent as soon as the deadline has surely
/// passed (1 ms after it, plus the measured clock offset's uncertainty: a few
/// milliseconds) answers LeaseLost and changes nothing; a release answers Ok
/// and changes nothing (the next claim is a takeover, attempt 2, not a fresh
/// claim after a removal). Catches a store
/// that lets the holder finish "just after" its deadline (a grace for clock
/// skew, a `<=` where `<` belongs, a deadline rounded up), which
/// [`passed_lease_is_lost`] may miss: it calls tens of milliseconds later.
pub async fn lease_is_lost_at_its_deadline(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let clock = Clock::measure(&*store, "at-deadline").await?;
    let ttl = Duration::from_millis(200);
    for op in ["complete", "release", "extend"] {
        let k = key(&format!("at-deadline-{op}"))?;
        let lease = must_claim(&*store, &k, &opts(ttl)).await?;
        let target = clock.surely_past(lease.deadline, Duration::from_millis(1));
        if let Ok(left) = target.duration_since(SystemTime::now()) {
            ensure!(
                left <= ttl + CLOCK_SLACK,
                "a lease of {ttl:?} has its deadline {left:?} away"
            );
            tokio::time::sleep(left).await;
        }
        let answer = match op {
            "complete" => store.complete(&lease, b"late", LONG_TTL).await,
            "release" => store.release(&lease).await,
            _ => store.extend(&lease, LONG_TTL).await.map(|_| ()),
        };
        let late = clock.at_most_past(lease.deadline, SystemTime::now());
        let what = format!("{op} of a lease at most {late:.1} ms past its deadline");
        if op == "release" {
            if let Err(e) = answer {
                return Err(Failure::new(format!("{what} failed: {e}, expected Ok")));
            }
            let next = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
            ensure!(
                next.attempt == 2,
                "after a {what}, the next claim is attempt {}: the release removed a record whose lease had passed (expected attempt 2, a takeover)",
                next.attempt
            );
            continue;
        }
        expect_lease_lost(&what, answer)?;
        ensure!(
            store.get(&k).await?.is_none(),
            "after a late {op} that answered LeaseLost, get shows the record again"
        );
    }
    // At the deadline's own millisecond: once get finds the record absent, a
    // holder's call made right after must find its lease passed too (a
    // deadline judged `>=` by one operation and `>` by another lets a holder
    // act on a record that get already called gone).
    for round in 0..20 {
        for op in ["extend", "complete"] {
            let k = key(&format!("edge-{op}-{round}"))?;
            let lease = must_claim(&*store, &k, &opts(Duration::from_millis(15))).await?;
            while let Ok(left) = lease.deadline.duration_since(SystemTime::now()) {
                if left > Duration::from_millis(2) {
                    tokio::time::sleep(left - Duration::from_millis(2)).await;
                } else {
                    tokio::task::yield_now().await;
                }
            }
            if store.get(&k).await?.is_some() {
                continue;
            }
            let answer = match op {
                "extend" => store.extend(&lease, LONG_TTL).await.map(|_| ()),
                _ => store.complete(&lease, b"edge", LONG_TTL).await,
            };
            expect_lease_lost(
                &format!("{op} of a lease right after get found its record gone (at its deadline)"),
                answer,
            )?;
        }
    }
    Ok(Verdict::Passed)
}

/// Deadlines to the millisecond (rule 3 and the extend row of the contract): a
/// lease's deadline is now + ttl on the store's clock; `InFlight`, `get` and a
/// re-entrant claim all report the stored deadline itself (a re-entrant claim
/// does not renew it); `extend` sets now + ttl, not the old deadline + ttl, and
/// a shorter ttl shortens the lease.
pub async fn deadlines_are_exact(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let clock = Clock::measure(&*store, "exact").await?;
    let k = key("exact")?;
    let id = ClaimId::new("exact-worker").map_err(|e| Failure::new(e.to_string()))?;
    let ttl = Duration::from_secs(5);
    let before = SystemTime::now();
    let lease = must_claim(&*store, &k, &opts(ttl).with_claim_id(id.clone())).await?;
    let after = SystemTime::now();
    clock.expect("a claim's lease", lease.deadline, before, after, ttl)?;
    tokio::time::sleep(Duration::from_millis(200)).await;

    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::InFlight { deadline, attempt } => ensure!(
            deadline == lease.deadline && attempt == lease.attempt,
            "InFlight names deadline {deadline:?} attempt {attempt}; the holder's lease has \
             {:?} attempt {}",
            lease.deadline,
            lease.attempt
        ),
        other => {
            return Err(Failure::new(format!(
                "a competing claim answered {other:?}"
            )))
        }
    }
    let again = must_claim(&*store, &k, &opts(LONG_TTL).with_claim_id(id)).await?;
    ensure!(
        again == lease,
        "a re-entrant claim 200 ms later was handed {again:?}; the stored lease is {lease:?}"
    );
    let record = live_record(&*store, &k, "while in flight").await?;
    ensure!(
        record.state
            == RecordState::InFlight {
                lease_deadline: lease.deadline
            },
        "get shows {:?}, the lease has deadline {:?}",
        record.state,
        lease.deadline
    );

    let longer = Duration::from_secs(8);
    let before = SystemTime::now();
    let extended = store.extend(&lease, longer).await?;
    let after = SystemTime::now();
    clock.expect(
        "extend (now + ttl, not the old deadline + ttl)",
        extended.deadline,
        before,
        after,
        longer,
    )?;
    ensure!(
        extended.token == lease.token && extended.attempt == lease.attempt,
        "extend changed the lease's token or attempt: {extended:?}"
    );
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::InFlight { deadline, .. } => ensure!(
            deadline == extended.deadline,
            "after extend, InFlight names {deadline:?}; extend answered {:?}",
            extended.deadline
        ),
        other => {
            return Err(Failure::new(format!(
                "a claim after extend answered {other:?}"
            )))
        }
    }
    let shorter = Duration::from_secs(2);
    let before = SystemTime::now();
    let shortened = store.extend(&extended, shorter).await?;
    let after = SystemTime::now();
    clock.expect(
        "extend with a shorter ttl",
        shortened.deadline,
        before,
        after,
        shorter,
    )?;
    let record = live_record(&*store, &k, "after two extends").await?;
    ensure!(
        record.state
            == RecordState::InFlight {
                lease_deadline: shortened.deadline
            },
        "get shows {:?} after extend answered {:?}",
        record.state,
        shortened.deadline
    );
    Ok(Verdict::Passed)
}

/// `expire()` judges a done record by its retention, never by the lease it had:
/// a done record whose lease deadline passed long ago but whose retention has
/// not is left alone (and still answers Duplicate), while an in-flight record
/// past its lease is removed.
pub async fn expire_spares_done_past_its_lease(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let (done, dead) = (key("done-long-kept")?, key("dead-worker")?);
    let lease = must_claim(&*store, &done, &opts(SHORT_TTL)).await?;
    store.complete(&lease, b"kept", LONG_TTL).await?;
    let dead_lease = must_claim(&*store, &dead, &opts(SHORT_TTL)).await?;
    wait_past(lease.deadline.max(dead_lease.deadline)).await?;
    let removed = store.expire().await?;
    if store.capabilities().explicit_expire {
        ensure!(
            removed == 1,
            "expire() removed {removed} records; only the in-flight one past its lease had \
             expired (the done one is kept for its retention)"
        );
    }
    match store.claim(&done, &opts(LONG_TTL)).await? {
        ClaimOutcome::Duplicate { outcome, .. } if outcome == b"kept" => {}
        other => {
            return Err(Failure::new(format!(
                "after expire(), a done record inside its retention answered {other:?}, \
                 expected Duplicate"
            )))
        }
    }
    Ok(Verdict::Passed)
}
