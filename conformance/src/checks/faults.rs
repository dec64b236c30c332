//! Errors are never answers (rule 7).

use super::*;

/// A call's name, its judged answer, and how long it took.
async fn timed(
    what: &'static str,
    fut: Pin<Box<dyn Future<Output = String> + Send + '_>>,
) -> (&'static str, String, Duration) {
    let started = std::time::Instant::now();
    let answer = fut.await;
    (what, answer, started.elapsed())
}

/// With the way to its records cut (a fixture's [`FaultyHandle`]), every call
/// through the handle fails, within the handle's bound, with a retryable error;
/// none answers Claimed, InFlight, Duplicate or Ok for what it could not read or
/// write. A `get`, and a claim of a live key, may still answer where the fault
/// leaves reads working (a write lock held elsewhere), but only the truth: the
/// answer the record stored before the fault gives. Once healed, nothing has
/// changed: the in-flight record still holds its lease, the done record its
/// outcome, the absent key is absent, and the lease still completes.
///
/// [`FaultyHandle`]: crate::FaultyHandle
pub async fn errors_are_not_answers(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let Some(faulty) = fixture.faulty_handle().await? else {
        return Ok(Verdict::Skipped(
            "the fixture cannot break its store's connection (Fixture::faulty_handle)".into(),
        ));
    };
    let store = fixture.store();
    let (busy, done, absent) = (key("fault-busy")?, key("fault-done")?, key("fault-absent")?);
    let lease = must_claim(&*store, &busy, &opts(LONG_TTL)).await?;
    let done_lease = must_claim(&*store, &done, &opts(LONG_TTL)).await?;
    store.complete(&done_lease, b"kept", LONG_TTL).await?;
    let busy_before = store.get(&busy).await?;
    let done_before = store.get(&done).await?;
    // The handle works before the fault.
    ensure!(
        faulty.store.get(&busy).await? == busy_before,
        "the faulty handle does not see the fixture's records"
    );

    faulty.switch.set_broken(true).await?;
    let s = &faulty.store;
    let started = std::time::Instant::now();
    fn judge<T: std::fmt::Debug + PartialEq>(r: Result<T, Error>, truth: Option<&T>) -> String {
        match (r, truth) {
            (Err(e), _) if e.is_retryable() => "retryable error".into(),
            (Err(e), _) => format!("a non-retryable error ({e})"),
            (Ok(v), Some(t)) if &v == t => "retryable error".into(),
            (Ok(v), _) => format!("the answer {v:?}"),
        }
    }
    // The true answers of claims of the two live keys, for a store whose reads
    // still work under the fault.
    let busy_truth = busy_before
        .clone()
        .map(|r| dedupe_core::backend::losing_claim(r, &opts(LONG_TTL)));
    let done_truth = done_before
        .clone()
        .map(|r| dedupe_core::backend::losing_claim(r, &opts(LONG_TTL)));
    let calls = vec![
        timed(
            "claim of an absent key",
            Box::pin(async { judge(s.claim(&absent, &opts(LONG_TTL)).await, None) }),
        ),
        timed(
            "claim of an in-flight key",
            Box::pin(async { judge(s.claim(&busy, &opts(LONG_TTL)).await, busy_truth.as_ref()) }),
        ),
        timed(
            "claim of a done key",
            Box::pin(async { judge(s.claim(&done, &opts(LONG_TTL)).await, done_truth.as_ref()) }),
        ),
        timed(
            "claim_many",
            Box::pin(async {
                judge(
                    s.claim_many(&[absent.clone(), done.clone()], &opts(LONG_TTL))
                        .await,
                    None,
                )
            }),
        ),
        timed(
            "complete",
            Box::pin(async { judge(s.complete(&lease, b"lost?", LONG_TTL).await, None) }),
        ),
        timed(
            "release",
            Box::pin(async { judge(s.release(&lease).await, None) }),
        ),
        timed(
            "extend",
            Box::pin(async { judge(s.extend(&lease, LONG_TTL).await, None) }),
        ),
        timed(
            "forget",
            Box::pin(async { judge(s.forget(&done).await, None) }),
        ),
        timed(
            "expire",
            Box::pin(async {
                // A store that expires natively does no I/O here, and its 0 is true.
                let native = (!s.capabilities().explicit_expire).then_some(0);
                judge(s.expire().await, native.as_ref())
            }),
        ),
        timed(
            "get",
            Box::pin(async { judge(s.get(&done).await, Some(&done_before)) }),
        ),
    ];
    let results = futures_util::future::join_all(calls).await;
    let total = started.elapsed();
    faulty.switch.set_broken(false).await?;
    for (what, answer, took) in results {
        ensure!(
            answer == "retryable error",
            "{what} through a broken connection gave {answer}, expected a retryable error"
        );
        ensure!(
            took <= faulty.bound,
            "{what} through a broken connection took {took:?}, over the handle's bound {:?}",
            faulty.bound
        );
    }
    ensure!(
        total <= faulty.bound + Duration::from_secs(1),
        "the calls through a broken connection took {total:?} together"
    );
    ensure!(
        store.get(&busy).await? == busy_before,
        "the in-flight record changed while the connection was broken"
    );
    ensure!(
        store.get(&done).await? == done_before,
        "the done record changed while the connection was broken"
    );
    ensure!(
        store.get(&absent).await?.is_none(),
        "a claim through a broken connection wrote a record"
    );
    store.complete(&lease, b"after the fault", LONG_TTL).await?;
    // And the handle itself works again: at once, or after retryable errors
    // within its bound (a driver may meet the dead connection once more
    // before it reconnects; a caller retries those).
    let healed = key("fault-healed")?;
    let healing = std::time::Instant::now();
    loop {
        match s.claim(&healed, &opts(LONG_TTL)).await {
            Ok(ClaimOutcome::Claimed(_)) => break,
            Ok(other) => {
                return Err(Failure::new(format!(
                    "a claim of a fresh key through the healed handle answered {other:?}"
                )))
            }
            Err(e) if e.is_retryable() && healing.elapsed() < faulty.bound * 2 => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(Failure::new(format!(
                    "the handle did not work again within {:?} of the fault healing: {e}",
                    faulty.bound * 2
                )))
            }
        }
    }
    Ok(Verdict::Passed)
}

/// A request the driver sends again because its answer was lost is answered as
/// the first would have been (rule 10). Through a fixture's [`FaultyHandle`]
/// whose switch can lose exactly one answer (the request reaches the store and
/// does its work, the answer is dropped and the connection closed), each
/// operation is asked once, on a key nobody else touches, and its answer is
/// judged against the record the fixture's own handle then reads:
///
/// - a claim of a fresh key (no claim id, as `Deduper` and the webhook receiver
///   claim): `Claimed` with the lease the record holds, never `InFlight` about
///   the record it wrote itself; the same for `claim_many`;
/// - `complete`: `Ok` when the outcome is stored, never `LeaseLost`;
/// - `release`: `Ok` when the record is gone, never `LeaseLost`;
/// - `extend`: the deadline the record holds;
/// - `forget`: `true` when the live record is gone.
///
/// A retryable error is always a fair answer (the driver did not re-send, or
/// gave up); a wrong answer is not.
///
/// [`FaultyHandle`]: crate::FaultyHandle
pub async fn resent_requests_answer_as_the_first(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let Some(faulty) = fixture.faulty_handle().await? else {
        return Ok(Verdict::Skipped(
            "the fixture cannot break its store's connection (Fixture::faulty_handle)".into(),
        ));
    };
    let store = fixture.store();
    let (s, switch) = (&faulty.store, &faulty.switch);
    let lose = || async {
        ensure!(
            switch.lose_next_answer().await?,
            "the fault switch lost no answer"
        );
        Ok::<(), Failure>(())
    };
    if !switch.lose_next_answer().await? {
        return Ok(Verdict::Skipped(
            "the fixture's fault switch cannot lose one answer (FaultSwitch::lose_next_answer)"
                .into(),
        ));
    }
    // The probe above armed the switch: disarm it before the first real call.
    switch.answer_was_lost().await?;
    let lost = || async {
        ensure!(
            switch.answer_was_lost().await?,
            "the fault switch was asked to lose an answer and lost none: the call sent no request"
        );
        Ok::<(), Failure>(())
    };
    let resent = "(the answer was lost once and the driver may have sent the request again)";
    let fail = |what: &str, answer: String| -> Result<(), Failure> {
        Err(Failure::new(format!("{what} {resent} answered {answer}")))
    };
    let retryable = |e: &Error| e.is_retryable();

    // Claims of fresh keys (three rounds), then a takeover of a record whose
    // lease passed; one at a time, then in a batch. A claim that answers
    // Claimed hands out exactly the stored lease (token, deadline, attempt),
    // and the key is then held: a second claim through the same handle is
    // not Claimed.
    for round in 0..4 {
        let k = key(&format!("resent-claim-{round}"))?;
        let takeover = round == 3;
        if takeover {
            let old = must_claim(&*store, &k, &opts(Duration::from_millis(50))).await?;
            wait_past(old.deadline).await?;
        }
        let what = if takeover {
            "a takeover of a passed lease"
        } else {
            "a claim of a fresh key"
        };
        lose().await?;
        let answer = s.claim(&k, &opts(LONG_TTL)).await;
        lost().await?;
        let record = store.get(&k).await?;
        let won = matches!(&answer, Ok(ClaimOutcome::Claimed(_)));
        match (answer, &record) {
            (Ok(ClaimOutcome::Claimed(l)), Some(r))
                if r.token == l.token
                    && l.deadline == record_deadline(r)
                    && l.attempt == r.attempts
                    && l.attempt == if takeover { 2 } else { 1 } => {}
            (Ok(ClaimOutcome::Claimed(l)), Some(r)) if r.token == l.token => fail(
                what,
                format!(
                    "Claimed with a lease that is not the stored one: deadline {:?}, attempt {} \
                     (the record: {:?}, attempt {})",
                    l.deadline,
                    l.attempt,
                    record_deadline(r),
                    r.attempts
                ),
            )?,
            (Err(e), _) if retryable(&e) => {}
            (Ok(ClaimOutcome::InFlight { .. }), Some(r)) => fail(
                what,
                format!(
                    "InFlight about the record it wrote itself (token {}): its own write judged as another claim's",
                    r.token
                ),
            )?,
            (other, r) => fail(what, format!("{other:?} while the store holds {r:?}"))?,
        }
        if won {
            let again = s.claim(&k, &opts(LONG_TTL)).await?;
            ensure!(
                !matches!(again, ClaimOutcome::Claimed(_)),
                "after {what} whose answer was lost, a second claim of the held key through \
                 the same handle answered {again:?}: two winners"
            );
        }
    }
    let batch = [key("resent-batch-a")?, key("resent-batch-b")?];
    lose().await?;
    let answer = s.claim_many(&batch, &opts(LONG_TTL)).await;
    lost().await?;
    match answer {
        Ok(answers) => {
            for (k, a) in batch.iter().zip(&answers) {
                let record = store.get(k).await?;
                match (a, &record) {
                    (ClaimOutcome::Claimed(l), Some(r)) if r.token == l.token => {}
                    (a, r) => fail(
                        "claim_many of fresh keys",
                        format!("{a:?} for {k} while the store holds {r:?}"),
                    )?,
                }
            }
        }
        Err(e) if retryable(&e) => {}
        Err(e) => fail("claim_many of fresh keys", format!("{e}"))?,
    }

    // complete.
    let k = key("resent-complete")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    lose().await?;
    let answer = s.complete(&lease, b"stored once", LONG_TTL).await;
    lost().await?;
    let record = store.get(&k).await?;
    let stored = record.as_ref().is_some_and(|r| {
        r.token == lease.token
            && matches!(&r.state, RecordState::Done { outcome, .. } if outcome.as_slice() == b"stored once")
    });
    match answer {
        Ok(()) if stored => {}
        Err(e) if retryable(&e) => {}
        Err(Error::LeaseLost { .. }) if stored => fail(
            "complete",
            "LeaseLost although its outcome is stored".into(),
        )?,
        other => fail(
            "complete",
            format!("{other:?} while the store holds {record:?}"),
        )?,
    }

    // release.
    let k = key("resent-release")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    lose().await?;
    let answer = s.release(&lease).await;
    lost().await?;
    let record = store.get(&k).await?;
    match answer {
        Ok(()) if record.is_none() => {}
        Err(e) if retryable(&e) => {}
        Err(Error::LeaseLost { .. }) if record.is_none() => {
            fail("release", "LeaseLost although the record is gone".into())?
        }
        other => fail(
            "release",
            format!("{other:?} while the store holds {record:?}"),
        )?,
    }

    // extend.
    let k = key("resent-extend")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    lose().await?;
    let answer = s.extend(&lease, LONG_TTL).await;
    lost().await?;
    let record = live_record(&*store, &k, "after an extend whose answer was lost").await?;
    match answer {
        Ok(l) if record.token == lease.token && l.deadline == record_deadline(&record) => {}
        Err(e) if retryable(&e) => {}
        other => fail(
            "extend",
            format!("{other:?} while the store holds {record:?}"),
        )?,
    }

    // forget.
    let k = key("resent-forget")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    store.complete(&lease, b"to forget", LONG_TTL).await?;
    lose().await?;
    let answer = s.forget(&k).await;
    lost().await?;
    let record = store.get(&k).await?;
    match answer {
        Ok(true) if record.is_none() => {}
        Err(e) if retryable(&e) => {}
        Ok(false) if record.is_none() => fail(
            "forget of a live record",
            "false although the record is gone".into(),
        )?,
        other => fail(
            "forget of a live record",
            format!("{other:?} while the store holds {record:?}"),
        )?,
    }
    Ok(Verdict::Passed)
}

fn record_deadline(record: &Record) -> SystemTime {
    match &record.state {
        RecordState::InFlight { lease_deadline } => *lease_deadline,
        RecordState::Done {
            retention_deadline, ..
        } => *retention_deadline,
    }
}
