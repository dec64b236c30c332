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
    // And the handle itself works again.
    let healed = key("fault-healed")?;
    must_claim(&**s, &healed, &opts(LONG_TTL)).await?;
    Ok(Verdict::Passed)
}
