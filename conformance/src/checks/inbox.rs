//! The inbox rules (CONTRACT.md, I1 to I16), for a store whose fixture offers
//! an [`Inbox`](dedupe_core::Inbox); skipped for one that does not.

use dedupe_core::{AcceptOptions, Accepted, Inbox, ItemQuery, ItemStatus, Retry, Taken};

use std::time::Instant;

use super::*;

/// The fixture's inbox, or the check's skip.
fn inbox_of(fixture: &dyn crate::Fixture) -> Result<Arc<dyn Inbox>, Verdict> {
    fixture
        .inbox()
        .ok_or_else(|| Verdict::Skipped("the store offers no inbox (Fixture::inbox)".into()))
}

macro_rules! inbox_or_skip {
    ($fixture:expr) => {
        match inbox_of(&*$fixture) {
            Ok(inbox) => inbox,
            Err(skip) => return Ok(skip),
        }
    };
}

fn item_key(id: &str) -> Result<Key, Failure> {
    Key::new("inbox", id).map_err(|e| Failure::new(format!("test key {id:?} refused: {e}")))
}

/// Takes until `want` items are in hand or a second passes.
async fn take_n(inbox: &dyn Inbox, want: usize, lease: Duration) -> Result<Vec<Taken>, Failure> {
    let started = std::time::Instant::now();
    let mut taken = Vec::new();
    while taken.len() < want && started.elapsed() < Duration::from_secs(1) {
        let more = inbox
            .take(
                "inbox",
                (want - taken.len()).min(dedupe_core::MAX_TAKE),
                lease,
            )
            .await?;
        if more.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        taken.extend(more);
    }
    Ok(taken)
}

/// Takes one item, or fails with `missing` when none comes within a second.
async fn take_one(inbox: &dyn Inbox, lease: Duration, missing: &str) -> Result<Taken, Failure> {
    take_n(inbox, 1, lease)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| Failure::new(missing))
}

/// Rounding of a store's times (milliseconds) and of the arithmetic here.
const TIME_SLACK: Duration = Duration::from_millis(5);

/// An item made due `delay` after a call that came after `taken`'s take, by
/// at most `elapsed` (the local time from before the take to after the call):
/// judged on the store's clock, which set the lease's deadline `LONG_TTL`
/// after its time at the take.
fn due_after_take(
    what: &str,
    due_at: SystemTime,
    taken: &Taken,
    delay: Duration,
    elapsed: Duration,
) -> Result<(), Failure> {
    let taken_at = taken.lease.deadline - LONG_TTL;
    let after = due_at
        .duration_since(taken_at)
        .map_err(|_| Failure::new(format!("{what} made the item due before its take")))?;
    ensure!(
        after + TIME_SLACK >= delay && after <= delay + elapsed + TIME_SLACK,
        "{what} made the item due {after:?} after its take, expected {delay:?} \
         plus at most the {elapsed:?} the calls took"
    );
    Ok(())
}

/// I1, I4, I7: an accept of a new key stores one pending item with its
/// payload byte for byte; a second accept answers the item and writes
/// nothing; 32 accepts racing on one key on many handles give one `New`; an
/// accept answers a claim in flight and a done record without writing; a
/// claim of an accepted key answers `InFlight`; a payload over the limit is
/// refused, nothing written.
pub async fn inbox_accepts_once(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("accepted")?;
    let payload: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    ensure!(
        inbox.accept(&k, &payload).await? == Accepted::New,
        "the first accept of a new key did not answer New"
    );
    let item = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("an accepted key holds no item"))?;
    ensure!(
        item.status == ItemStatus::Pending && item.attempts == 0 && item.payload == payload,
        "an accepted item shows {item:?}, expected pending, 0 attempts, its payload"
    );
    match inbox.accept(&k, b"another copy").await? {
        Accepted::Item(again) => ensure!(
            again.payload == payload && again.status == ItemStatus::Pending,
            "a second accept answered {again:?}"
        ),
        other => return Err(Failure::new(format!("a second accept answered {other:?}"))),
    }
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::InFlight { .. } => {}
        other => {
            return Err(Failure::new(format!(
                "a claim of a key the inbox holds answered {other:?}, expected InFlight"
            )))
        }
    }

    // Racing accepts on many handles.
    let mut handles = Vec::new();
    for _ in 0..4 {
        handles.push(
            fixture
                .open_inbox()
                .await?
                .ok_or_else(|| Failure::new("the fixture has an inbox but no inbox handles"))?,
        );
    }
    let raced = item_key("raced")?;
    let barrier = Arc::new(Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|i| {
            let (inbox, k, barrier) = (
                Arc::clone(&handles[i % handles.len()]),
                raced.clone(),
                Arc::clone(&barrier),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                inbox.accept(&k, format!("copy {i}").as_bytes()).await
            })
        })
        .collect();
    let mut new = 0;
    for task in tasks {
        let answer = task
            .await
            .map_err(|e| Failure::new(format!("accept task: {e}")))??;
        if answer.is_new() {
            new += 1;
        }
    }
    ensure!(
        new == 1,
        "{new} of {RACERS} racing accepts of one key answered New"
    );

    // A claim in flight, then done: answered, nothing written.
    let claimed = item_key("claimed")?;
    let lease = must_claim(&*store, &claimed, &opts(LONG_TTL)).await?;
    ensure!(
        matches!(
            inbox.accept(&claimed, b"x").await?,
            Accepted::InFlight { .. }
        ),
        "an accept of a key a claim holds did not answer InFlight"
    );
    store.complete(&lease, b"finished", LONG_TTL).await?;
    match inbox.accept(&claimed, b"x").await? {
        Accepted::Done { outcome, .. } => ensure!(
            outcome == b"finished",
            "an accept of a done key answered the outcome {outcome:?}"
        ),
        other => {
            return Err(Failure::new(format!(
                "an accept of a done key answered {other:?}"
            )))
        }
    }
    ensure!(
        inbox.item(&claimed).await?.is_none(),
        "an accept of a done key wrote an item"
    );

    // A claim whose lease passed holds nothing: the accept is New and keeps
    // the claim's attempt, as a takeover would.
    let lapsed = item_key("lapsed")?;
    let lease = must_claim(&*store, &lapsed, &opts(SHORT_TTL)).await?;
    wait_past(lease.deadline).await?;
    match inbox.accept(&lapsed, b"after the claim").await? {
        Accepted::New => {}
        other => {
            return Err(Failure::new(format!(
                "an accept of a key whose claim's lease passed answered {other:?}, expected New"
            )))
        }
    }
    ensure!(
        inbox
            .item(&lapsed)
            .await?
            .is_some_and(|i| i.status == ItemStatus::Pending && i.attempts == 1),
        "the item accepted over a lapsed claim is not pending with the claim's 1 attempt: {:?}",
        inbox.item(&lapsed).await?
    );

    // Too large: refused, nothing written.
    let big = item_key("too-big")?;
    let oversized = vec![7u8; dedupe_core::MAX_PAYLOAD_BYTES + 1];
    ensure!(
        matches!(
            inbox.accept(&big, &oversized).await,
            Err(Error::PayloadTooLarge { .. })
        ),
        "a payload over the limit was not refused with PayloadTooLarge"
    );
    ensure!(
        inbox.item(&big).await?.is_none() && store.get(&big).await?.is_none(),
        "a refused payload left something under its key"
    );
    let max: Vec<u8> = (0..dedupe_core::MAX_PAYLOAD_BYTES)
        .map(|i| (i % 251) as u8)
        .collect();
    ensure!(
        inbox.accept(&big, &max).await?.is_new(),
        "a payload of exactly the limit was refused"
    );
    ensure!(
        inbox.item(&big).await?.is_some_and(|i| i.payload == max),
        "a payload of exactly the limit did not come back byte for byte"
    );
    Ok(Verdict::Passed)
}

/// I2: 64 accepted items, four workers on their own handles taking at once
/// until none is left: every item is taken exactly once, at attempt 1, with
/// its payload.
pub async fn inbox_one_taker_race(factory: &dyn StoreFactory) -> CheckResult {
    const ITEMS: usize = 64;
    const WORKERS: usize = 4;
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    for i in 0..ITEMS {
        inbox
            .accept(
                &item_key(&format!("race-{i:02}"))?,
                format!("p{i}").as_bytes(),
            )
            .await?;
    }
    let barrier = Arc::new(Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let handle = fixture
            .open_inbox()
            .await?
            .ok_or_else(|| Failure::new("the fixture has an inbox but no inbox handles"))?;
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut mine = Vec::new();
            let mut empty = 0;
            // More than every item means items were handed out twice: stop.
            while empty < 3 && mine.len() <= ITEMS {
                let got = handle.take("inbox", 3, LONG_TTL).await?;
                if got.is_empty() {
                    empty += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                mine.extend(got);
            }
            Ok::<_, Error>(mine)
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for task in tasks {
        for taken in task
            .await
            .map_err(|e| Failure::new(format!("worker task: {e}")))??
        {
            total += 1;
            let id = taken.lease.key.id().to_string();
            ensure!(
                taken.lease.attempt == 1,
                "{id} was taken at attempt {}, expected 1",
                taken.lease.attempt
            );
            ensure!(
                taken.payload
                    == format!(
                        "p{}",
                        id.trim_start_matches("race-")
                            .trim_start_matches('0')
                            .parse::<usize>()
                            .unwrap_or(0)
                    )
                    .as_bytes(),
                "{id} came with the payload {:?}",
                String::from_utf8_lossy(&taken.payload)
            );
            ensure!(seen.insert(id.clone()), "{id} was taken twice");
        }
    }
    ensure!(
        total == ITEMS && seen.len() == ITEMS,
        "{total} takes of {ITEMS} items ({} distinct)",
        seen.len()
    );
    Ok(Verdict::Passed)
}

/// I2, I3, I4: a worker whose lease passed is taken over (attempt 2), and
/// then cannot complete, fail, extend or release the item; the new holder
/// completes it, after which claims answer `Duplicate`, accepts `Done`, and
/// no take hands it out.
pub async fn inbox_fences_stale_workers(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("fenced")?;
    inbox.accept(&k, b"work").await?;
    let stale = take_one(&*inbox, SHORT_TTL, "a due item was not taken").await?;
    ensure!(
        inbox.take("inbox", 10, LONG_TTL).await?.is_empty(),
        "an item held by a worker inside its lease was taken again"
    );
    wait_past(stale.lease.deadline).await?;
    // The lease passed and nobody took the item over yet: still fenced.
    expect_lease_lost(
        "a complete after the worker's lease passed",
        store.complete(&stale.lease, b"late", LONG_TTL).await,
    )?;
    expect_lease_lost(
        "a fail after the worker's lease passed",
        inbox.fail(&stale.lease, "late", Retry::dead()).await,
    )?;
    expect_lease_lost(
        "an extend after the worker's lease passed",
        store.extend(&stale.lease, LONG_TTL).await.map(|_| ()),
    )?;
    let fresh = take_one(
        &*inbox,
        LONG_TTL,
        "an item whose worker's lease passed was not taken again",
    )
    .await?;
    ensure!(
        fresh.lease.attempt == 2 && fresh.lease.token != stale.lease.token,
        "the takeover of a passed lease is attempt {} (expected 2) with token {:?}",
        fresh.lease.attempt,
        fresh.lease.token
    );
    expect_lease_lost(
        "a stale worker's complete",
        store.complete(&stale.lease, b"stale", LONG_TTL).await,
    )?;
    expect_lease_lost(
        "a stale worker's fail",
        inbox.fail(&stale.lease, "stale", Retry::dead()).await,
    )?;
    expect_lease_lost(
        "a stale worker's extend",
        store.extend(&stale.lease, LONG_TTL).await.map(|_| ()),
    )?;
    // A stale release must not give the item back while its new holder runs
    // it (the next take would hand it out a second time).
    expect_lease_lost(
        "a stale worker's release",
        store.release(&stale.lease).await,
    )?;
    ensure!(
        inbox.take("inbox", 10, LONG_TTL).await?.is_empty(),
        "after a stale worker's calls the held item was handed out again"
    );
    let item = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("the item vanished"))?;
    ensure!(
        item.status == ItemStatus::Running && item.attempts == 2,
        "after a stale worker's calls the item shows {item:?}"
    );
    store
        .complete(&fresh.lease, b"done by the second", LONG_TTL)
        .await?;
    match store.claim(&k, &opts(LONG_TTL)).await? {
        ClaimOutcome::Duplicate { outcome, .. } => ensure!(
            outcome == b"done by the second",
            "a completed item's claim answered the outcome {outcome:?}"
        ),
        other => {
            return Err(Failure::new(format!(
                "a completed item's claim answered {other:?}"
            )))
        }
    }
    ensure!(
        matches!(inbox.accept(&k, b"again").await?, Accepted::Done { .. }),
        "an accept of a completed item did not answer Done"
    );
    ensure!(
        inbox.item(&k).await?.is_none(),
        "a completed item is still shown as an item"
    );
    ensure!(
        inbox.take("inbox", 10, LONG_TTL).await?.is_empty(),
        "a completed item was handed out again"
    );
    Ok(Verdict::Passed)
}

/// I5, I6: a failure keeps the error (cut to its limit) and the attempts and
/// makes the item due after the delay (not before); a release gives it back
/// due now, the attempt its take counted taken back (I9); dead items are never taken; a replay makes a dead item due now
/// with its history; a replay of anything else (a replayed item replayed
/// again included) answers `false`.
pub async fn inbox_failures_and_replay(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("failing")?;
    inbox.accept(&k, b"poison").await?;
    ensure!(
        !inbox.replay(&k).await?,
        "a replay of a pending item answered true"
    );
    let started = Instant::now();
    let first = take_one(&*inbox, LONG_TTL, "a due item was not taken").await?;
    // Three-byte characters: 1024 is no boundary, so a cut past the limit to
    // the next one shows.
    let long_error = "€".repeat(dedupe_core::MAX_ERROR_BYTES);
    let retry = Duration::from_millis(300);
    inbox
        .fail(&first.lease, &long_error, Retry::After(retry))
        .await?;
    let failed = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a failed item vanished"))?;
    let kept = failed.last_error.clone().unwrap_or_default();
    ensure!(
        failed.status == ItemStatus::Failed
            && failed.attempts == 1
            && kept.len() <= dedupe_core::MAX_ERROR_BYTES
            && kept.len() + 3 > dedupe_core::MAX_ERROR_BYTES
            && long_error.starts_with(&kept),
        "a failed item shows status {:?}, {} attempts, an error of {} bytes",
        failed.status,
        failed.attempts,
        kept.len()
    );
    // Judged on the store's own clock: the take set its deadline `LONG_TTL`
    // after the store's time then, and the failure came at most the calls'
    // time later.
    due_after_take(
        "a failure with a 300 ms retry",
        failed.due_at,
        &first,
        retry,
        started.elapsed(),
    )?;
    ensure!(
        inbox.take("inbox", 10, LONG_TTL).await?.is_empty(),
        "a failed item was taken before its retry was due"
    );
    wait_past(failed.due_at).await?;
    let started = Instant::now();
    let second = take_one(&*inbox, LONG_TTL, "a failed item was not taken once due").await?;
    ensure!(
        second.lease.attempt == 2 && second.last_error.as_deref() == Some(kept.as_str()),
        "the retry was attempt {} with last error {:?}",
        second.lease.attempt,
        second.last_error.as_deref().map(|e| e.len())
    );
    store.release(&second.lease).await?;
    let released = inbox.item(&k).await?.ok_or_else(|| {
        Failure::new("a released item was removed (an item is given back, not removed)")
    })?;
    ensure!(
        released.attempts == 1 && released.status != ItemStatus::Running,
        "a released item shows {:?} with {} attempts",
        released.status,
        released.attempts
    );
    due_after_take(
        "a release",
        released.due_at,
        &second,
        Duration::ZERO,
        started.elapsed(),
    )?;
    let started = Instant::now();
    let third = take_one(
        &*inbox,
        LONG_TTL,
        "a released item was not due again at once",
    )
    .await?;
    inbox.fail(&third.lease, "for good", Retry::dead()).await?;
    let dead = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a dead item vanished"))?;
    ensure!(
        dead.status == ItemStatus::Dead
            && dead.attempts == 2
            && dead.last_error.as_deref() == Some("for good"),
        "a dead item shows {dead:?}"
    );
    match inbox.accept(&k, b"a resend").await? {
        Accepted::Item(item) => ensure!(
            item.status == ItemStatus::Dead && item.attempts == 2 && item.payload == b"poison",
            "an accept of a dead item's key answered the item as {:?} with {} attempts",
            item.status,
            item.attempts
        ),
        other => {
            return Err(Failure::new(format!(
                "an accept of a dead item's key answered {other:?}, expected the item"
            )))
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        inbox
            .take("inbox", 10, Duration::from_millis(10))
            .await?
            .is_empty(),
        "a dead item was taken"
    );
    ensure!(
        inbox.replay(&k).await?,
        "a replay of a dead item answered false"
    );
    let replayed = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a replayed item vanished"))?;
    ensure!(
        replayed.attempts == 2 && replayed.last_error.as_deref() == Some("for good"),
        "a replay lost the item's history: {replayed:?}"
    );
    ensure!(
        replayed.status == ItemStatus::Failed,
        "a replayed item shows {:?}, expected failed (due, its error kept)",
        replayed.status
    );
    due_after_take(
        "a replay",
        replayed.due_at,
        &third,
        Duration::ZERO,
        started.elapsed(),
    )?;
    // Due already: a second replay (another operator's, at the same time)
    // changes nothing and says so, so a bulk replay counts the item once.
    ensure!(
        !inbox.replay(&k).await?,
        "a second replay of a replayed item (failed, due now) answered true"
    );
    let fourth = take_n(&*inbox, 1, LONG_TTL).await?;
    ensure!(
        fourth.first().is_some_and(|t| t.lease.attempt == 3),
        "a replayed item was not taken at once as attempt 3: {fourth:?}"
    );
    ensure!(
        !inbox.replay(&k).await?,
        "a replay of a running item answered true"
    );
    ensure!(
        !inbox.replay(&item_key("never-accepted")?).await?,
        "a replay of an absent key answered true"
    );
    Ok(Verdict::Passed)
}

/// I7: pending, running (past its lease) and dead items survive `expire()`
/// and stay visible to `get`; a claim of an item's key answers `InFlight`
/// and never takes it over, even past the worker's lease.
pub async fn inbox_items_never_expire(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let (pending, running, dead) = (
        item_key("stays-pending")?,
        item_key("stays-running")?,
        item_key("stays-dead")?,
    );
    for k in [&pending, &running, &dead] {
        inbox.accept(k, b"kept").await?;
    }
    // Taken on a long lease, so that the release and the fail come within
    // it however slow the store is; the running item's lease is then cut
    // short and left to pass.
    let taken = take_n(&*inbox, 3, LONG_TTL).await?;
    ensure!(taken.len() == 3, "{} of 3 due items taken", taken.len());
    let mut latest = SystemTime::now();
    for t in &taken {
        if t.lease.key == pending {
            store.release(&t.lease).await?;
        } else if t.lease.key == dead {
            inbox.fail(&t.lease, "parked", Retry::dead()).await?;
        } else {
            let short = store.extend(&t.lease, SHORT_TTL).await?;
            latest = latest.max(short.deadline);
        }
    }
    wait_past(latest).await?;
    if store.capabilities().explicit_expire {
        store.expire().await?;
    }
    for k in [&pending, &running, &dead] {
        ensure!(
            inbox.item(k).await?.is_some(),
            "{k}: the item is gone after its lease passed and expire() ran"
        );
        ensure!(
            store.get(k).await?.is_some(),
            "{k}: get does not show the item's record"
        );
        match store.claim(k, &opts(LONG_TTL)).await? {
            ClaimOutcome::InFlight { .. } => {}
            other => {
                return Err(Failure::new(format!(
                    "{k}: a claim of an item's key answered {other:?}, expected InFlight"
                )))
            }
        }
    }
    let batch = [pending.clone(), running.clone(), dead.clone()];
    for (k, answer) in batch
        .iter()
        .zip(store.claim_many(&batch, &opts(LONG_TTL)).await?)
    {
        ensure!(
            matches!(answer, ClaimOutcome::InFlight { .. }),
            "{k}: claim_many of an item's key answered {answer:?}, expected InFlight"
        );
    }
    ensure!(
        inbox.item(&running).await?.is_some_and(|i| i.attempts == 1),
        "a claim changed an item's attempts"
    );
    ensure!(
        store.forget(&dead).await?,
        "forget of an item answered false (an item is live until done)"
    );
    ensure!(
        inbox.item(&dead).await?.is_none(),
        "a forgotten item is still there"
    );
    Ok(Verdict::Passed)
}

/// I8: 25 items in every status, listed 10 at a time: each exactly once, in
/// id order, with the right status; a status filter lists exactly that
/// status; `counts` agrees; items of another namespace are not listed.
pub async fn inbox_list_and_counts(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    for i in 0..25 {
        inbox
            .accept(&item_key(&format!("listed-{i:02}"))?, b"x")
            .await?;
    }
    inbox
        .accept(
            &Key::new("elsewhere", "listed-00").map_err(|e| Failure::new(e.to_string()))?,
            b"y",
        )
        .await?;
    let taken = take_n(&*inbox, 8, LONG_TTL).await?;
    ensure!(taken.len() == 8, "{} of 8 due items taken", taken.len());
    for (i, t) in taken.iter().enumerate() {
        match i {
            0 | 1 => {
                inbox
                    .fail(&t.lease, "later", Retry::After(LONG_TTL))
                    .await?
            }
            2 => inbox.fail(&t.lease, "dead", Retry::dead()).await?,
            // A completed item is a done record, no longer listed.
            3 => {
                fixture
                    .store()
                    .complete(&t.lease, b"done", LONG_TTL)
                    .await?
            }
            _ => {}
        }
    }
    let mut listed = Vec::new();
    let mut query = ItemQuery {
        limit: 10,
        ..ItemQuery::new("inbox")
    };
    for _ in 0..10 {
        let page = inbox.list(&query).await?;
        ensure!(
            page.items.len() <= 10,
            "a page of 10 held {}",
            page.items.len()
        );
        listed.extend(page.items);
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    let ids: Vec<&str> = listed.iter().map(|i| i.key.id()).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    ensure!(
        ids.len() == 24 && sorted == ids,
        "the pages listed {} items, expected the 24 not done ({} distinct, in order: {})",
        ids.len(),
        sorted.len(),
        sorted == ids
    );
    let count = |status| listed.iter().filter(|i| i.status == status).count() as u64;
    let counts = inbox.counts("inbox").await?;
    ensure!(
        (counts.pending, counts.running, counts.failed, counts.dead)
            == (count(ItemStatus::Pending), count(ItemStatus::Running), count(ItemStatus::Failed), count(ItemStatus::Dead))
            && (counts.pending, counts.running, counts.failed, counts.dead) == (17, 4, 2, 1),
        "counts {counts:?}; the list shows {} pending, {} running, {} failed, {} dead (expected 17, 4, 2, 1)",
        count(ItemStatus::Pending),
        count(ItemStatus::Running),
        count(ItemStatus::Failed),
        count(ItemStatus::Dead)
    );
    let oldest = listed
        .iter()
        .filter(|i| matches!(i.status, ItemStatus::Pending | ItemStatus::Failed))
        .map(|i| i.due_at)
        .min();
    ensure!(
        counts.oldest_due == oldest,
        "counts show the oldest due item at {:?}, the list at {oldest:?}",
        counts.oldest_due
    );
    for status in [
        ItemStatus::Pending,
        ItemStatus::Running,
        ItemStatus::Failed,
        ItemStatus::Dead,
    ] {
        let page = inbox
            .list(&ItemQuery {
                limit: 100,
                ..ItemQuery::new("inbox").status(status)
            })
            .await?;
        ensure!(
            page.items.len() as u64 == count(status)
                && page.items.iter().all(|i| i.status == status),
            "the {} filter listed {} items, expected {}",
            status.as_str(),
            page.items.len(),
            count(status)
        );
    }
    // A filtered listing pages too: the 17 pending items, 5 a page.
    let mut pending = Vec::new();
    let mut query = ItemQuery {
        limit: 5,
        ..ItemQuery::new("inbox").status(ItemStatus::Pending)
    };
    for _ in 0..10 {
        let page = inbox.list(&query).await?;
        pending.extend(page.items.into_iter().map(|i| i.key.id().to_string()));
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    let mut distinct = pending.clone();
    distinct.sort_unstable();
    distinct.dedup();
    ensure!(
        pending.len() == 17 && distinct == pending,
        "pages of 5 pending items listed {} ids ({} distinct), expected the 17 once each, in order",
        pending.len(),
        distinct.len()
    );
    Ok(Verdict::Passed)
}

/// I2: oldest due first. Five items accepted a few milliseconds apart, their
/// ids in the opposite order: a take of three hands out the three oldest, in
/// due order; a take of one hands out one; the last take the rest.
pub async fn inbox_takes_oldest_first(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    // An item of another namespace, due before all of them: never handed
    // out by a take of this one.
    let elsewhere = Key::new("elsewhere", "order-0").map_err(|e| Failure::new(e.to_string()))?;
    inbox.accept(&elsewhere, b"not this namespace").await?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let ids = ["order-e", "order-d", "order-c", "order-b", "order-a"];
    for id in ids {
        inbox.accept(&item_key(id)?, id.as_bytes()).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let taken_ids = |taken: &[Taken]| -> Vec<String> {
        taken.iter().map(|t| t.lease.key.id().to_string()).collect()
    };
    let first = inbox.take("inbox", 3, LONG_TTL).await?;
    ensure!(
        taken_ids(&first) == ["order-e", "order-d", "order-c"],
        "a take of 3 handed out {:?}, expected the three oldest in due order",
        taken_ids(&first)
    );
    let one = inbox.take("inbox", 1, LONG_TTL).await?;
    ensure!(
        taken_ids(&one) == ["order-b"],
        "a take of 1 handed out {:?}",
        taken_ids(&one)
    );
    let rest = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        taken_ids(&rest) == ["order-a"],
        "the last take handed out {:?}",
        taken_ids(&rest)
    );
    Ok(Verdict::Passed)
}

/// I1 against claims: on fresh keys, accepts and claims racing on many
/// handles give one winner per key (one `New` or one `Claimed`, never both),
/// and the loser's answer is about the winner's record.
pub async fn inbox_accepts_race_claims(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let _ = inbox_or_skip!(fixture);
    let mut handles = Vec::new();
    for _ in 0..4 {
        handles.push(
            fixture
                .open_inbox()
                .await?
                .ok_or_else(|| Failure::new("the fixture has an inbox but no inbox handles"))?,
        );
    }
    const ROUNDS: usize = 24;
    const PER_ROUND: usize = 8;
    for round in 0..ROUNDS {
        let k = item_key(&format!("contested-{round}"))?;
        let barrier = Arc::new(Barrier::new(PER_ROUND));
        let tasks: Vec<_> = (0..PER_ROUND)
            .map(|i| {
                let (inbox, k, barrier) = (
                    Arc::clone(&handles[i % handles.len()]),
                    k.clone(),
                    Arc::clone(&barrier),
                );
                tokio::spawn(async move {
                    barrier.wait().await;
                    if i % 2 == 0 {
                        inbox
                            .claim(&k, &opts(LONG_TTL))
                            .await
                            .map(|o| matches!(o, ClaimOutcome::Claimed(_)))
                    } else {
                        inbox.accept(&k, b"accepted").await.map(|a| a.is_new())
                    }
                })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            if task
                .await
                .map_err(|e| Failure::new(format!("racing task: {e}")))??
            {
                winners += 1;
            }
        }
        ensure!(
            winners == 1,
            "round {round}: {winners} of {PER_ROUND} racing claims and accepts of one new key won"
        );
    }
    Ok(Verdict::Passed)
}

/// I9: a release (a hand-back: a worker that stops, or never ran the
/// handler) takes back the attempt its take counted, so that deploys spend
/// no attempts; a failure spends one; a takeover of a worker that died
/// spends one.
pub async fn inbox_hand_back_is_free(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("handed-back")?;
    inbox.accept(&k, b"work").await?;
    for round in 1..=3 {
        let taken = take_one(
            &*inbox,
            LONG_TTL,
            "an item given back was not due again at once",
        )
        .await?;
        ensure!(
            taken.lease.attempt == 1,
            "after {} hand-backs the item was taken as attempt {}, expected 1",
            round - 1,
            taken.lease.attempt
        );
        store.release(&taken.lease).await?;
        let item = inbox
            .item(&k)
            .await?
            .ok_or_else(|| Failure::new("an item given back vanished"))?;
        ensure!(
            item.attempts == 0 && item.status == ItemStatus::Pending,
            "an item given back {round} times shows {:?} with {} attempts, expected pending \
             with 0",
            item.status,
            item.attempts
        );
    }
    // A failure spends its attempt: a hand-back after it takes back only
    // its own take's.
    let lease = take_one(&*inbox, LONG_TTL, "an item given back was not taken")
        .await?
        .lease;
    inbox
        .fail(&lease, "counted", Retry::After(dedupe_core::MIN_TTL))
        .await?;
    let failed = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a failed item vanished"))?;
    wait_past(failed.due_at).await?;
    let second = take_one(&*inbox, SHORT_TTL, "a failed item was not taken once due").await?;
    ensure!(
        second.lease.attempt == 2,
        "after a failure the item was taken as attempt {}, expected 2",
        second.lease.attempt
    );
    // Its worker dies: the takeover counts the attempt the dead worker spent.
    wait_past(second.lease.deadline).await?;
    let third = take_one(
        &*inbox,
        LONG_TTL,
        "an item whose lease passed was not taken over",
    )
    .await?;
    ensure!(
        third.lease.attempt == 3,
        "a takeover took the item as attempt {}, expected 3",
        third.lease.attempt
    );
    store.release(&third.lease).await?;
    let item = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("an item given back vanished"))?;
    ensure!(
        item.attempts == 2,
        "a hand-back after a takeover left {} attempts, expected 2",
        item.attempts
    );
    Ok(Verdict::Passed)
}

/// I10: a take of an item whose worker's lease passed counts a takeover, on
/// the taken item and on the item as listed; a take of a waiting item (new,
/// given back, or failed and due) counts none; nothing resets the count.
pub async fn inbox_takeovers_are_counted(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("taken-over")?;
    inbox.accept(&k, b"work").await?;
    let first = take_one(&*inbox, SHORT_TTL, "a due item was not taken").await?;
    ensure!(
        first.takeovers == 0,
        "a first take counted {} takeovers",
        first.takeovers
    );
    let mut deadline = first.lease.deadline;
    for expected in 1..=2u32 {
        // The worker dies: its lease passes, and the next take is a takeover.
        wait_past(deadline).await?;
        let taken = take_one(
            &*inbox,
            SHORT_TTL,
            "an item whose lease passed was not taken over",
        )
        .await?;
        let shown = inbox
            .item(&k)
            .await?
            .ok_or_else(|| Failure::new("an item taken over vanished"))?;
        ensure!(
            taken.takeovers == expected && shown.takeovers == expected,
            "takeover {expected} was counted as {} on the taken item and {} on the item",
            taken.takeovers,
            shown.takeovers
        );
        deadline = taken.lease.deadline;
    }
    // Given back and failed: the takes that follow are no takeovers, and the
    // count stays.
    wait_past(deadline).await?;
    let held = take_one(
        &*inbox,
        LONG_TTL,
        "an item whose lease passed was not taken over",
    )
    .await?;
    store.release(&held.lease).await?;
    let again = take_one(&*inbox, LONG_TTL, "an item given back was not taken").await?;
    ensure!(
        again.takeovers == 3,
        "a take after a hand-back counted {} takeovers, expected the 3 before it",
        again.takeovers
    );
    inbox
        .fail(&again.lease, "once", Retry::After(dedupe_core::MIN_TTL))
        .await?;
    let failed = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a failed item vanished"))?;
    wait_past(failed.due_at).await?;
    let retried = take_one(&*inbox, LONG_TTL, "a failed item was not taken once due").await?;
    ensure!(
        retried.takeovers == 3,
        "a take of a failed item counted {} takeovers, expected the 3 before it",
        retried.takeovers
    );
    Ok(Verdict::Passed)
}

/// I11: `accept_with` keeps the item's own attempt limit (shown by `item`
/// and handed to the taker) and its `not_before` (no take hands it out
/// before then; it is due then); a plain accept has no limit of its own; a
/// limit of 0 is refused and writes nothing.
pub async fn inbox_accept_options(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let later = item_key("later")?;
    let delay = Duration::from_millis(600);
    let not_before = SystemTime::now() + delay;
    let options = AcceptOptions::new().not_before(not_before).max_attempts(3);
    ensure!(
        inbox.accept_with(&later, b"work", &options).await?.is_new(),
        "an accept with options of a new key was not stored"
    );
    let shown = inbox
        .item(&later)
        .await?
        .ok_or_else(|| Failure::new("an item accepted with options vanished"))?;
    ensure!(
        shown.max_attempts == Some(3) && shown.status == ItemStatus::Pending,
        "an item accepted with max_attempts 3 shows {:?}, {:?}",
        shown.status,
        shown.max_attempts
    );
    let early = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        early.is_empty(),
        "an item accepted not before {delay:?} from now was taken at once"
    );
    let started = Instant::now();
    let taken = loop {
        let taken = inbox.take("inbox", 10, LONG_TTL).await?;
        if let Some(first) = taken.into_iter().next() {
            break first;
        }
        ensure!(
            started.elapsed() < delay + Duration::from_secs(1),
            "an item accepted not before {delay:?} from now was still not taken {:?} later",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let taken_at = SystemTime::now();
    ensure!(
        taken_at + Duration::from_millis(50) >= not_before,
        "an item was taken {:?} before its not_before",
        not_before.duration_since(taken_at).unwrap_or_default()
    );
    ensure!(
        taken.max_attempts == Some(3) && taken.lease.key == later,
        "the taker was handed {:?} with limit {:?}, expected the item with limit 3",
        taken.lease.key,
        taken.max_attempts
    );
    let plain = item_key("plain")?;
    inbox.accept(&plain, b"work").await?;
    let shown = inbox
        .item(&plain)
        .await?
        .ok_or_else(|| Failure::new("an accepted item vanished"))?;
    ensure!(
        shown.max_attempts.is_none(),
        "a plain accept gave the item a limit of {:?}",
        shown.max_attempts
    );
    let refused = item_key("no-attempts")?;
    let zero = AcceptOptions::new().max_attempts(0);
    ensure!(
        matches!(
            inbox.accept_with(&refused, b"work", &zero).await,
            Err(Error::InvalidConfig { .. })
        ),
        "an accept with max_attempts 0 was not refused as a bad configuration"
    );
    ensure!(
        inbox.item(&refused).await?.is_none(),
        "a refused accept wrote an item"
    );
    Ok(Verdict::Passed)
}

/// Rule 10 for items (I3): a fail or a release sent again after its answer
/// was lost answers Ok and changes nothing; a fail under the same lease with
/// another error or decision is no resend (`LeaseLost`); once the item was
/// taken again, the old lease's calls are `LeaseLost`.
pub async fn inbox_calls_asked_twice(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let shown = |item: Option<dedupe_core::Item>| {
        item.map(|i| (i.status, i.attempts, i.due_at, i.last_error))
    };

    let failing = item_key("failed-twice")?;
    inbox.accept(&failing, b"work").await?;
    let lease = take_one(&*inbox, LONG_TTL, "a due item was not taken")
        .await?
        .lease;
    inbox.fail(&lease, "boom", Retry::After(LONG_TTL)).await?;
    let before = shown(inbox.item(&failing).await?);
    if let Err(e) = inbox.fail(&lease, "boom", Retry::After(LONG_TTL)).await {
        return Err(Failure::new(format!(
            "a fail sent again after its answer was lost answered {e:?}, expected Ok"
        )));
    }
    let after = shown(inbox.item(&failing).await?);
    ensure!(
        after == before,
        "a fail sent again changed the item from {before:?} to {after:?}"
    );
    expect_lease_lost(
        "a second fail of the same lease with another error",
        inbox.fail(&lease, "another", Retry::After(LONG_TTL)).await,
    )?;
    expect_lease_lost(
        "a second fail of the same lease deciding dead",
        inbox.fail(&lease, "boom", Retry::dead()).await,
    )?;

    let dying = item_key("dead-twice")?;
    inbox.accept(&dying, b"work").await?;
    let lease = take_one(&*inbox, LONG_TTL, "a due item was not taken")
        .await?
        .lease;
    inbox.fail(&lease, "gone", Retry::dead()).await?;
    if let Err(e) = inbox.fail(&lease, "gone", Retry::dead()).await {
        return Err(Failure::new(format!(
            "a fail deciding dead sent again answered {e:?}, expected Ok"
        )));
    }
    ensure!(
        inbox
            .item(&dying)
            .await?
            .is_some_and(|i| i.status == ItemStatus::Dead && i.attempts == 1),
        "a dead fail sent again changed the item: {:?}",
        inbox.item(&dying).await?
    );

    let given = item_key("released-twice")?;
    inbox.accept(&given, b"work").await?;
    let old = take_one(&*inbox, LONG_TTL, "a due item was not taken")
        .await?
        .lease;
    store.release(&old).await?;
    let before = shown(inbox.item(&given).await?);
    if let Err(e) = store.release(&old).await {
        return Err(Failure::new(format!(
            "a release of an item sent again answered {e:?}, expected Ok"
        )));
    }
    let after = shown(inbox.item(&given).await?);
    ensure!(
        after == before,
        "a release sent again changed the item from {before:?} to {after:?}"
    );
    let new = take_one(&*inbox, LONG_TTL, "a released item was not taken")
        .await?
        .lease;
    ensure!(
        new.attempt == 1,
        "the item given back twice was taken as attempt {}, expected 1 (a release \
         takes back its take's attempt, once)",
        new.attempt
    );
    expect_lease_lost(
        "a release of a lease whose item was taken again",
        store.release(&old).await,
    )?;
    expect_lease_lost(
        "a fail of a lease whose item was taken again",
        inbox.fail(&old, "late", Retry::dead()).await,
    )?;
    store.complete(&new, b"done", LONG_TTL).await?;
    if let Err(e) = store.complete(&new, b"done", LONG_TTL).await {
        return Err(Failure::new(format!(
            "an item's complete sent again answered {e:?}, expected Ok"
        )));
    }
    Ok(Verdict::Passed)
}

/// I12: a snooze gives the running item back due after its delay, the
/// attempt its take counted taken back, and no take hands it out before
/// then; sent again it answers Ok and changes nothing; a lease taken over or
/// passed is `LeaseLost`; a zero delay is `InvalidConfig`; a take hands out
/// the item's accept time.
pub async fn inbox_snooze(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let shown = |item: Option<dedupe_core::Item>| {
        item.map(|i| (i.status, i.attempts, i.due_at, i.last_error))
    };
    let k = item_key("snoozed")?;
    inbox.accept(&k, b"work").await?;
    let accepted_at = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("an accepted item vanished"))?
        .accepted_at;
    let before = Instant::now();
    let taken = take_one(&*inbox, LONG_TTL, "a due item was not taken").await?;
    let accepted_as_shown = |taken: &Taken| -> Result<(), Failure> {
        let apart = match taken.accepted_at.duration_since(accepted_at) {
            Ok(later) => later,
            Err(earlier) => earlier.duration(),
        };
        ensure!(
            apart <= TIME_SLACK,
            "a take handed out the accept time {:?}, the item shows {accepted_at:?}",
            taken.accepted_at
        );
        Ok(())
    };
    accepted_as_shown(&taken)?;
    ensure!(
        matches!(
            inbox.snooze(&taken.lease, Duration::ZERO).await,
            Err(Error::InvalidConfig { .. })
        ),
        "a snooze of no delay was not refused as a bad configuration"
    );
    ensure!(
        matches!(
            inbox
                .snooze(&taken.lease, dedupe_core::MAX_TTL + Duration::from_secs(1))
                .await,
            Err(Error::InvalidConfig { .. })
        ),
        "a snooze past the longest TTL was not refused as a bad configuration"
    );
    let delay = Duration::from_millis(600);
    inbox.snooze(&taken.lease, delay).await?;
    let elapsed = before.elapsed();
    let snoozed = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("a snoozed item vanished"))?;
    ensure!(
        snoozed.status == ItemStatus::Pending && snoozed.attempts == 0,
        "a snoozed item shows {:?} with {} attempts, expected pending with 0 (a snooze \
         spends no attempt)",
        snoozed.status,
        snoozed.attempts
    );
    due_after_take("a snooze", snoozed.due_at, &taken, delay, elapsed)?;
    if let Err(e) = inbox.snooze(&taken.lease, delay).await {
        return Err(Failure::new(format!(
            "a snooze sent again after its answer was lost answered {e:?}, expected Ok"
        )));
    }
    let again = inbox.item(&k).await?;
    ensure!(
        shown(again.clone()) == shown(Some(snoozed.clone())),
        "a snooze sent again changed the item from {snoozed:?} to {again:?}"
    );
    // No take hands it out before it is due, judged on the store's clock.
    let next = loop {
        if let Some(first) = inbox.take("inbox", 10, LONG_TTL).await?.into_iter().next() {
            break first;
        }
        ensure!(
            before.elapsed() < delay + Duration::from_secs(2),
            "a snoozed item was still not taken {:?} after its take (delay {delay:?})",
            before.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let taken_again_at = next.lease.deadline - LONG_TTL;
    ensure!(
        taken_again_at + TIME_SLACK >= snoozed.due_at,
        "a snoozed item was taken {:?} before it was due",
        snoozed
            .due_at
            .duration_since(taken_again_at)
            .unwrap_or_default()
    );
    accepted_as_shown(&next)?;
    ensure!(
        next.lease.attempt == 1 && next.takeovers == 0,
        "a snoozed item was taken again as attempt {} with {} takeovers, expected attempt 1 \
         and none",
        next.lease.attempt,
        next.takeovers
    );
    expect_lease_lost(
        "a snooze of a lease whose item was taken again",
        inbox.snooze(&taken.lease, delay).await,
    )?;
    // A lease that passed snoozes nothing.
    fixture.store().release(&next.lease).await?;
    let short = take_one(&*inbox, SHORT_TTL, "a released item was not taken").await?;
    wait_past(short.lease.deadline).await?;
    let before = shown(inbox.item(&k).await?);
    expect_lease_lost(
        "a snooze of a lease that passed",
        inbox.snooze(&short.lease, delay).await,
    )?;
    let after = shown(inbox.item(&k).await?);
    ensure!(
        after == before,
        "a snooze of a passed lease changed the item from {before:?} to {after:?}"
    );
    Ok(Verdict::Passed)
}

/// I13: a pause is kept in the store and stops every take of the namespace
/// (due items, failed ones, one held past its lease) and nothing else:
/// accepts go on, a running item completes, other namespaces are taken as
/// before; after a resume the items waiting are taken. Pause and resume
/// answer whether they changed anything; a namespace no key can have is
/// refused.
pub async fn inbox_pause(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let namespace = "inbox";
    ensure!(
        matches!(inbox.pause("no:such").await, Err(Error::InvalidKey(_))),
        "a pause of a namespace no key can have was not refused as an invalid key"
    );
    ensure!(
        !inbox.paused(namespace).await?,
        "a namespace nobody paused shows as paused"
    );
    // A namespace the paused one is a prefix of: a pause matched by prefix
    // stops it too.
    let other = Key::new("inbox2", "other-item")
        .map_err(|e| Failure::new(format!("test key refused: {e}")))?;
    let (lapsing, running, waiting) = (
        item_key("lapsing")?,
        item_key("running")?,
        item_key("waiting")?,
    );
    inbox.accept(&lapsing, b"lapsing").await?;
    // Held for long (the takes below must not take it over, however slow the
    // store's calls), and shortened once paused.
    let lapses = take_one(&*inbox, LONG_TTL, "a due item was not taken").await?;
    inbox.accept(&running, b"running").await?;
    let long = take_one(&*inbox, LONG_TTL, "a due item was not taken").await?;
    inbox.accept(&waiting, b"waiting").await?;
    let failing = item_key("failing")?;
    inbox.accept(&failing, b"failing").await?;
    let failed = take_one(&*inbox, LONG_TTL, "a due item was not taken").await?;
    inbox
        .fail(&failed.lease, "once", Retry::After(dedupe_core::MIN_TTL))
        .await?;

    ensure!(
        inbox.pause(namespace).await?,
        "a pause of a running namespace answered that it changed nothing"
    );
    ensure!(
        !inbox.pause(namespace).await?,
        "a pause of a paused namespace answered that it paused it"
    );
    ensure!(
        inbox.paused(namespace).await? && !inbox.paused("inbox2").await?,
        "after a pause of {namespace:?} the paused namespaces show wrong"
    );
    // At once: the first take after the pause answered hands out nothing.
    let first = inbox.take(namespace, 10, LONG_TTL).await?;
    ensure!(
        first.is_empty(),
        "the first take after a pause handed out {:?}",
        first.iter().map(|t| t.lease.key.id()).collect::<Vec<_>>()
    );
    // Accepts go on, and other namespaces are taken as before.
    let late = item_key("accepted-while-paused")?;
    ensure!(
        inbox.accept(&late, b"late").await? == Accepted::New,
        "an accept into a paused namespace was not stored"
    );
    inbox.accept(&other, b"other").await?;
    let elsewhere = inbox.take("inbox2", 10, LONG_TTL).await?;
    ensure!(
        elsewhere.len() == 1,
        "a take of a namespace nobody paused handed out {} items, expected 1",
        elsewhere.len()
    );
    // The item running when the pause came finishes.
    store.complete(&long.lease, b"done", LONG_TTL).await?;
    // Nothing is taken while paused: not the waiting items, not the one whose
    // worker's lease passed.
    let short = store.extend(&lapses.lease, SHORT_TTL).await?;
    wait_past(short.deadline).await?;
    for _ in 0..5 {
        let taken = inbox.take(namespace, 10, LONG_TTL).await?;
        ensure!(
            taken.is_empty(),
            "a take of a paused namespace handed out {:?}",
            taken.iter().map(|t| t.lease.key.id()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counts = inbox.counts(namespace).await?;
    ensure!(
        counts.pending == 2 && counts.failed == 1 && counts.running == 1,
        "a paused namespace counts {counts:?}, expected 2 pending, 1 failed and the lapsed one \
         running"
    );
    // A resume is of its own namespace only.
    let second = Key::new("inbox2", "second-item")
        .map_err(|e| Failure::new(format!("test key refused: {e}")))?;
    inbox.accept(&second, b"second").await?;
    inbox.pause("inbox2").await?;

    ensure!(
        inbox.resume(namespace).await?,
        "a resume of a paused namespace answered that it changed nothing"
    );
    ensure!(
        !inbox.resume(namespace).await? && !inbox.paused(namespace).await?,
        "a resume of a running namespace answered that it resumed it, or it still shows paused"
    );
    let taken = take_n(&*inbox, 4, LONG_TTL).await?;
    let mut ids: Vec<String> = taken.iter().map(|t| t.lease.key.id().to_string()).collect();
    ids.sort();
    ensure!(
        ids == ["accepted-while-paused", "failing", "lapsing", "waiting"],
        "after a resume the takes handed out {ids:?}, expected the four items waiting"
    );
    // The lapsed lease is taken over as it would have been unpaused (I10).
    ensure!(
        taken
            .iter()
            .any(|t| t.lease.key.id() == "lapsing" && t.takeovers == 1),
        "the item whose lease passed during the pause was not counted as a takeover after \
         the resume"
    );
    let still = inbox.take("inbox2", 10, LONG_TTL).await?;
    ensure!(
        still.is_empty() && inbox.paused("inbox2").await?,
        "a resume of {namespace:?} resumed \"inbox2\" too"
    );
    Ok(Verdict::Passed)
}

/// Waits up to [`WAKE_WITHIN`] for `signal` after `change` ran (listening
/// from before it), and fails naming `what` when it does not come.
async fn expect_wake<T>(
    signal: &tokio::sync::Notify,
    what: &str,
    change: impl std::future::Future<Output = dedupe_core::Result<T>>,
) -> Result<T, Failure> {
    let woken = signal.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let answer = change.await?;
    tokio::time::timeout(WAKE_WITHIN, woken)
        .await
        .map_err(|_| {
            Failure::new(format!(
                "{what} did not wake the waiting worker within {WAKE_WITHIN:?}"
            ))
        })?;
    Ok(answer)
}

/// How soon a wake-up must come: far above a notification's way through a
/// loaded server, far below any worker's poll.
const WAKE_WITHIN: Duration = Duration::from_secs(5);

/// I14: a store that offers a wake-up signal raises it when an item of the
/// namespace becomes due now: an accept, a lease given back, a replay, a
/// resume. Where the store says it pushes (`Wake::everywhere`), each change
/// is made through another handle with its own connection (another process,
/// as far as the store can tell); otherwise through the listening handle.
/// The item a signal announced is there to take. Skipped for a store
/// whose workers only poll.
pub async fn inbox_wake(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let wake = inbox.wake("inbox").await?;
    let Some(signal) = wake.signal.clone() else {
        return Ok(Verdict::Skipped(
            "the store wakes no worker: its workers poll (Inbox::wake)".into(),
        ));
    };
    let (other, whose) = if wake.everywhere {
        let other = fixture
            .open_inbox()
            .await?
            .ok_or_else(|| Failure::new("the fixture opened no second inbox handle"))?;
        (other, "another handle's")
    } else {
        (Arc::clone(&inbox), "the handle's own")
    };
    let first = item_key("woken")?;
    expect_wake(
        &signal,
        &format!("{whose} accept"),
        other.accept(&first, b"1"),
    )
    .await?;
    let taken = take_one(
        &*inbox,
        LONG_TTL,
        "the item a wake-up announced was not there to take",
    )
    .await?;
    ensure!(
        taken.lease.key == first,
        "the take after the wake-up handed out {} instead of the accepted item",
        taken.lease.key
    );
    // A lease given back, as a worker shutting down does.
    expect_wake(
        &signal,
        &format!("{whose} release of a held item"),
        other.release(&taken.lease),
    )
    .await?;
    let again = take_one(&*inbox, LONG_TTL, "an item given back was not due").await?;
    inbox.fail(&again.lease, "poison", Retry::dead()).await?;
    let replayed = expect_wake(&signal, &format!("{whose} replay"), other.replay(&first)).await?;
    ensure!(
        replayed,
        "a replay of a dead item answered that it found none"
    );
    ensure!(other.pause("inbox").await?, "a pause changed nothing");
    expect_wake(&signal, &format!("{whose} resume"), other.resume("inbox")).await?;
    let resumed = take_one(
        &*inbox,
        LONG_TTL,
        "the replayed item was not due after the resume",
    )
    .await?;
    ensure!(
        resumed.lease.key == first,
        "the take after the resume handed out {} instead of the replayed item",
        resumed.lease.key
    );
    // A second namespace has a signal of its own, raised by its changes.
    let elsewhere = inbox.wake("inbox2").await?;
    let elsewhere = elsewhere
        .signal
        .ok_or_else(|| Failure::new("a second namespace got no wake-up signal"))?;
    let key2 =
        Key::new("inbox2", "woken").map_err(|e| Failure::new(format!("test key refused: {e}")))?;
    expect_wake(
        &elsewhere,
        &format!("{whose} accept in a second namespace"),
        other.accept(&key2, b"2"),
    )
    .await?;
    Ok(Verdict::Passed)
}

/// The ids a take handed out, sorted.
fn ids_of(taken: &[Taken]) -> Vec<String> {
    let mut ids: Vec<String> = taken.iter().map(|t| t.lease.key.id().to_string()).collect();
    ids.sort();
    ids
}

/// Accepts `id` in the `inbox` namespace under ordering key `order`.
async fn accept_ordered(
    inbox: &dyn Inbox,
    id: &str,
    order: &str,
    when_dead: dedupe_core::WhenDead,
) -> Result<(), Failure> {
    let answer = inbox
        .accept_with(
            &item_key(id)?,
            id.as_bytes(),
            &AcceptOptions::new()
                .ordering_key(order)
                .when_dead(when_dead),
        )
        .await?;
    ensure!(
        answer == Accepted::New,
        "accept of {id} answered {answer:?}"
    );
    Ok(())
}

/// I15: items of one ordering key are handed out one at a time, in accept
/// order: never while another item of the key runs, never before an earlier
/// one is done (a failed one retrying holds the rest back; a dead one too,
/// unless it was accepted to be skipped, until it is replayed and done or
/// forgotten); other keys, and items without one, go on beside them; a
/// take passes over a few blocked items to the free one behind them. Then
/// racing takers on their own handles work one key: never two of its items
/// held at once, done in accept order. Skipped for a store that refuses
/// ordering keys (a configuration error).
pub async fn inbox_ordering(factory: &dyn StoreFactory) -> CheckResult {
    use dedupe_core::WhenDead::{Block, Skip};
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let bad = inbox
        .accept_with(
            &item_key("bad-order")?,
            b"x",
            &AcceptOptions::new().ordering_key(""),
        )
        .await;
    ensure!(
        matches!(bad, Err(Error::InvalidConfig { .. })),
        "an empty ordering key was not refused: {bad:?}"
    );
    // Skipped when dead, with no ordering key: an item like any other.
    let plain = item_key("skip-without-key")?;
    inbox
        .accept_with(
            &plain,
            b"plain",
            &AcceptOptions::new().when_dead(dedupe_core::WhenDead::Skip),
        )
        .await?;
    let alone = take_one(
        &*inbox,
        LONG_TTL,
        "an item accepted to be skipped when dead, with no ordering key, was not taken",
    )
    .await?;
    ensure!(
        alone.lease.key == plain
            && inbox
                .item(&plain)
                .await?
                .is_some_and(|i| i.ordering_key.is_none()),
        "an item accepted to be skipped when dead, with no ordering key, came back as {:?}",
        inbox.item(&plain).await?
    );
    store.complete(&alone.lease, b"done", LONG_TTL).await?;
    match inbox
        .accept_with(
            &item_key("a1")?,
            b"a1",
            &AcceptOptions::new().ordering_key("cus_1"),
        )
        .await
    {
        Ok(answer) => ensure!(answer == Accepted::New, "accept of a1 answered {answer:?}"),
        Err(e @ Error::InvalidConfig { .. }) => {
            return Ok(Verdict::Skipped(format!(
                "the store refuses ordering keys: {e}"
            )))
        }
        Err(e) => return Err(e.into()),
    }
    ensure!(
        inbox.item(&item_key("bad-order")?).await?.is_none(),
        "a refused accept stored its item"
    );
    accept_ordered(&*inbox, "a2", "cus_1", Block).await?;
    accept_ordered(&*inbox, "a3", "cus_1", Block).await?;
    accept_ordered(&*inbox, "b1", "cus_2", Block).await?;
    inbox.accept(&item_key("c1")?, b"c1").await?;
    let first = take_n(&*inbox, 5, LONG_TTL).await?;
    ensure!(
        ids_of(&first) == ["a1", "b1", "c1"],
        "the first takes handed out {:?}, expected the first of each ordering key and the item without one",
        ids_of(&first)
    );
    let shown = inbox.item(&item_key("a2")?).await?;
    ensure!(
        shown.as_ref().and_then(|i| i.ordering_key.as_deref()) == Some("cus_1"),
        "an item does not show its ordering key: {shown:?}"
    );
    let held = |id: &str| {
        first
            .iter()
            .find(|t| t.lease.key.id() == id)
            .map(|t| t.lease.clone())
            .ok_or_else(|| Failure::new(format!("{id} was not taken")))
    };
    let none = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        none.is_empty(),
        "a take while the first of each key runs handed out {:?}",
        ids_of(&none)
    );
    store.complete(&held("a1")?, b"done", LONG_TTL).await?;
    store.complete(&held("b1")?, b"done", LONG_TTL).await?;
    let second = take_one(
        &*inbox,
        LONG_TTL,
        "the next item of a key was not due after the first was done",
    )
    .await?;
    ensure!(
        second.lease.key.id() == "a2",
        "after a1 was done the take handed out {}, expected a2",
        second.lease.key
    );
    // Failed and retrying: a3 waits.
    inbox
        .fail(
            &second.lease,
            "once",
            Retry::After(Duration::from_millis(300)),
        )
        .await?;
    let waiting = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        waiting.is_empty(),
        "a take while a2 retries handed out {:?}",
        ids_of(&waiting)
    );
    let retried = take_one_within(&*inbox, Duration::from_secs(3)).await?;
    ensure!(
        retried.lease.key.id() == "a2",
        "the take after a2's retry delay handed out {}, expected a2",
        retried.lease.key
    );
    // Dead and blocking: a3 waits until the replay is done.
    inbox.fail(&retried.lease, "poison", Retry::dead()).await?;
    let blocked = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        blocked.is_empty(),
        "a take behind a dead item that blocks handed out {:?}",
        ids_of(&blocked)
    );
    ensure!(
        inbox.replay(&item_key("a2")?).await?,
        "replay of a2 found nothing"
    );
    let replayed = take_one(&*inbox, LONG_TTL, "a replayed item was not due").await?;
    ensure!(
        replayed.lease.key.id() == "a2",
        "after the replay the take handed out {}, expected a2",
        replayed.lease.key
    );
    store.complete(&replayed.lease, b"done", LONG_TTL).await?;
    let third = take_one(&*inbox, LONG_TTL, "a3 was not due after a2 was done").await?;
    ensure!(
        third.lease.key.id() == "a3",
        "expected a3, got {}",
        third.lease.key
    );
    store.complete(&third.lease, b"done", LONG_TTL).await?;
    store.complete(&held("c1")?, b"done", LONG_TTL).await?;

    // Skipped when dead: s2 goes on; s1 replayed waits for s2, then runs.
    accept_ordered(&*inbox, "s1", "cus_3", Skip).await?;
    accept_ordered(&*inbox, "s2", "cus_3", Skip).await?;
    let s1 = take_one(&*inbox, LONG_TTL, "s1 was not due").await?;
    ensure!(
        s1.lease.key.id() == "s1",
        "expected s1, got {}",
        s1.lease.key
    );
    inbox.fail(&s1.lease, "poison", Retry::dead()).await?;
    let s2 = take_one(
        &*inbox,
        LONG_TTL,
        "an item behind a dead one accepted to be skipped was held back",
    )
    .await?;
    ensure!(
        s2.lease.key.id() == "s2",
        "expected s2, got {}",
        s2.lease.key
    );
    ensure!(
        inbox.replay(&item_key("s1")?).await?,
        "replay of s1 found nothing"
    );
    let beside = inbox.take("inbox", 10, LONG_TTL).await?;
    ensure!(
        beside.is_empty(),
        "a replayed item ran beside a later item of its key: {:?}",
        ids_of(&beside)
    );
    // s2's worker dies holding it: its takeover comes first (the replayed
    // s1 before it in the key's order does not hold it back), s1 still waits.
    let short = store.extend(&s2.lease, SHORT_TTL).await?;
    wait_past(short.deadline).await?;
    let over = take_one(
        &*inbox,
        LONG_TTL,
        "s2, held past its lease with the replayed s1 before it, was not taken over",
    )
    .await?;
    ensure!(
        over.lease.key.id() == "s2",
        "expected the takeover of s2, got {}",
        over.lease.key
    );
    store.complete(&over.lease, b"done", LONG_TTL).await?;
    let again = take_one(
        &*inbox,
        LONG_TTL,
        "the replayed s1 was not due after s2 was done",
    )
    .await?;
    ensure!(
        again.lease.key.id() == "s1",
        "expected s1, got {}",
        again.lease.key
    );
    store.complete(&again.lease, b"done", LONG_TTL).await?;

    // A dead item forgotten lets the rest go on.
    accept_ordered(&*inbox, "f1", "cus_4", Block).await?;
    accept_ordered(&*inbox, "f2", "cus_4", Block).await?;
    let f1 = take_one(&*inbox, LONG_TTL, "f1 was not due").await?;
    inbox.fail(&f1.lease, "poison", Retry::dead()).await?;
    ensure!(
        store.forget(&item_key("f1")?).await?,
        "forget of a dead item found nothing"
    );
    let f2 = take_one(
        &*inbox,
        LONG_TTL,
        "an item behind a forgotten dead one was held back",
    )
    .await?;
    ensure!(
        f2.lease.key.id() == "f2",
        "expected f2, got {}",
        f2.lease.key
    );
    store.complete(&f2.lease, b"done", LONG_TTL).await?;

    // A running item forgotten (an operator's override) lets the next one
    // of its key go; its worker's calls then find their lease lost.
    accept_ordered(&*inbox, "g1", "cus_5", Block).await?;
    accept_ordered(&*inbox, "g2", "cus_5", Block).await?;
    let g1 = take_one(&*inbox, LONG_TTL, "g1 was not due").await?;
    ensure!(
        g1.lease.key.id() == "g1",
        "expected g1, got {}",
        g1.lease.key
    );
    ensure!(
        store.forget(&item_key("g1")?).await?,
        "forget of a running item found nothing"
    );
    let g2 = take_one(
        &*inbox,
        LONG_TTL,
        "an item behind a forgotten running one was held back",
    )
    .await?;
    ensure!(
        g2.lease.key.id() == "g2",
        "expected g2, got {}",
        g2.lease.key
    );
    let stale = store.complete(&g1.lease, b"done", LONG_TTL).await;
    ensure!(
        matches!(stale, Err(Error::LeaseLost { .. })),
        "the forgotten item's worker completed it: {stale:?}"
    );
    store.complete(&g2.lease, b"done", LONG_TTL).await?;

    // A free item behind blocked ones is handed out.
    for i in 0..10 {
        accept_ordered(&*inbox, &format!("hot-{i:02}"), "hot", Block).await?;
    }
    let hot = take_one(&*inbox, LONG_TTL, "hot-00 was not due").await?;
    inbox.accept(&item_key("free")?, b"free").await?;
    let free = take_one(
        &*inbox,
        LONG_TTL,
        "an item behind ten blocked ones was not handed out",
    )
    .await?;
    ensure!(
        free.lease.key.id() == "free",
        "expected the free item, got {}",
        free.lease.key
    );
    store.complete(&free.lease, b"done", LONG_TTL).await?;
    // So is the first item of another ordering key behind them, to a take of
    // one: the held key is passed over, not counted against the take.
    accept_ordered(&*inbox, "cold-0", "cold", Block).await?;
    let cold = take_one(
        &*inbox,
        LONG_TTL,
        "the item of a free ordering key behind nine blocked ones was not handed out",
    )
    .await?;
    ensure!(
        cold.lease.key.id() == "cold-0",
        "expected cold-0, got {}",
        cold.lease.key
    );
    store.complete(&cold.lease, b"done", LONG_TTL).await?;

    // Racing takers on their own handles work the hot key in order.
    const RACERS: usize = 4;
    let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let order = Arc::new(std::sync::Mutex::new(vec!["hot-00".to_string()]));
    store.complete(&hot.lease, b"done", LONG_TTL).await?;
    running.store(0, std::sync::atomic::Ordering::SeqCst);
    let mut tasks = Vec::new();
    for _ in 0..RACERS {
        let handle = fixture
            .open_inbox()
            .await?
            .ok_or_else(|| Failure::new("the fixture has an inbox but no inbox handles"))?;
        let store = handle.clone();
        let (running, order) = (Arc::clone(&running), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if order.lock().map_or(0, |o| o.len()) == 10 {
                    return Ok(());
                }
                let got = handle.take("inbox", 2, LONG_TTL).await?;
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                for taken in got {
                    let at_once = running.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    if at_once > 1 {
                        return Err(Failure::new(format!(
                            "{} was handed out while another item of its ordering key ran",
                            taken.lease.key
                        )));
                    }
                    if let Ok(mut o) = order.lock() {
                        o.push(taken.lease.key.id().to_string());
                    }
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    running.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    store.complete(&taken.lease, b"done", LONG_TTL).await?;
                }
            }
            Err(Failure::new(
                "the racing takers did not finish the key within 10 s",
            ))
        }));
    }
    for task in tasks {
        task.await
            .map_err(|e| Failure::new(format!("racer task: {e}")))??;
    }
    let done = order.lock().map(|o| o.clone()).unwrap_or_default();
    let expected: Vec<String> = (0..10).map(|i| format!("hot-{i:02}")).collect();
    ensure!(
        done == expected,
        "racing takers ran the key's items in the order {done:?}"
    );
    Ok(Verdict::Passed)
}

/// Takes one item, waiting up to `within` for one to be due.
async fn take_one_within(inbox: &dyn Inbox, within: Duration) -> Result<Taken, Failure> {
    let started = Instant::now();
    loop {
        if let Some(taken) = inbox.take("inbox", 1, LONG_TTL).await?.into_iter().next() {
            return Ok(taken);
        }
        ensure!(
            started.elapsed() < within,
            "no item was due within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// I16: a dead item is kept for the retention its fail gave it, and no
/// longer. Four items die: one kept 2 s, one kept 10 minutes, one kept until
/// forgotten, and one kept 2 s but replayed before then. Before the 2 s pass,
/// `expire()` removes none of them; past it, the first is gone (after
/// `expire()` where the store needs one: `item`, `list` and `counts` no
/// longer show it, and an accept of its key is new), the others stay. A
/// retention of zero or past `MAX_TTL` is `InvalidConfig`, nothing changed.
pub async fn inbox_dead_retention(factory: &dyn StoreFactory) -> CheckResult {
    const KEEP: Duration = Duration::from_secs(2);
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let names = ["soon", "long", "kept", "replayed"];
    for name in names {
        inbox.accept(&item_key(name)?, name.as_bytes()).await?;
    }
    let taken = take_n(&*inbox, 4, LONG_TTL).await?;
    ensure!(taken.len() == 4, "{} of 4 due items taken", taken.len());
    for bad in [
        Duration::ZERO,
        dedupe_core::MAX_TTL + Duration::from_secs(1),
    ] {
        let refused = inbox
            .fail(&taken[0].lease, "never", Retry::Dead { keep: Some(bad) })
            .await;
        ensure!(
            matches!(refused, Err(Error::InvalidConfig { .. })),
            "a fail with a dead retention of {bad:?} answered {refused:?}, expected InvalidConfig"
        );
    }
    ensure!(
        inbox
            .item(&taken[0].lease.key)
            .await?
            .is_some_and(|i| i.status == ItemStatus::Running),
        "a refused fail changed the item"
    );
    let mut deadline = SystemTime::now();
    for t in &taken {
        let keep = match t.lease.key.id() {
            "long" => Some(LONG_TTL),
            "kept" => None,
            _ => Some(KEEP),
        };
        inbox.fail(&t.lease, "gone", Retry::Dead { keep }).await?;
        let died = inbox
            .item(&t.lease.key)
            .await?
            .filter(|i| i.status == ItemStatus::Dead)
            .ok_or_else(|| Failure::new(format!("{}: not dead after its fail", t.lease.key)))?;
        if keep == Some(KEEP) {
            deadline = deadline.max(died.due_at + KEEP);
        }
    }
    ensure!(
        inbox.replay(&item_key("replayed")?).await?,
        "a replay of a dead item answered false"
    );
    if store.capabilities().explicit_expire {
        let removed = store.expire().await?;
        ensure!(
            removed == 0,
            "expire() removed {removed} before any dead item's retention passed"
        );
    }
    ensure!(
        SystemTime::now() < deadline,
        "the checks before the retention took longer than it ({KEEP:?}): the store is too slow \
         for this check to judge"
    );
    for name in names {
        ensure!(
            inbox.item(&item_key(name)?).await?.is_some(),
            "{name}: gone before its retention passed"
        );
    }
    wait_past(deadline).await?;
    if store.capabilities().explicit_expire {
        let removed = store.expire().await?;
        ensure!(
            removed == 1,
            "expire() past the retention removed {removed}, expected 1 (the dead item kept {KEEP:?})"
        );
    }
    ensure!(
        inbox.item(&item_key("soon")?).await?.is_none(),
        "a dead item is still there past its retention"
    );
    for name in ["long", "kept", "replayed"] {
        ensure!(
            inbox.item(&item_key(name)?).await?.is_some(),
            "{name}: removed with the dead item whose retention passed"
        );
    }
    let dead: Vec<String> = inbox
        .list(&ItemQuery::new("inbox").status(ItemStatus::Dead))
        .await?
        .items
        .iter()
        .map(|i| i.key.id().to_string())
        .collect();
    ensure!(
        dead == ["kept", "long"],
        "the dead letters listed past the retention are {dead:?}, expected [\"kept\", \"long\"]"
    );
    let counts = inbox.counts("inbox").await?;
    ensure!(
        counts.dead == 2 && counts.failed == 1,
        "counts past the retention: {counts:?}, expected 2 dead and 1 failed (the replayed one)"
    );
    let again = inbox.accept(&item_key("soon")?, b"again").await?;
    ensure!(
        again == Accepted::New,
        "an accept of an expired dead item's key answered {again:?}, expected New"
    );
    Ok(Verdict::Passed)
}

/// I5: an item keeps its last `ERROR_HISTORY` (5) failures, oldest first,
/// each with its attempt, its time (on the store's clock, between the fail's
/// call and its answer) and its error as cut. Seven failures keep the last
/// five; a release (a hand-back) and a fail sent again add none; a replay
/// keeps the history and the next failure drops the oldest. An item that
/// never failed has none.
pub async fn inbox_error_history(factory: &dyn StoreFactory) -> CheckResult {
    use dedupe_core::ERROR_HISTORY;
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let store = fixture.store();
    let k = item_key("history")?;
    inbox.accept(&k, b"fails").await?;
    inbox.accept(&item_key("never-failed")?, b"fine").await?;
    let long = "é".repeat(dedupe_core::MAX_ERROR_BYTES);
    let error_of = |attempt: u32| match attempt {
        6 => long.clone(),
        n => format!("e{n}"),
    };
    let mut windows = Vec::new();
    let mut released = false;
    let mut attempt = 0;
    while attempt < 7 {
        let taken = take_until(&*inbox, &k).await?;
        if taken.lease.attempt == 3 && !released {
            store.release(&taken.lease).await?;
            released = true;
            continue;
        }
        attempt = taken.lease.attempt;
        let retry = if attempt == 7 {
            Retry::Dead { keep: None }
        } else {
            Retry::After(dedupe_core::MIN_TTL)
        };
        let before = SystemTime::now();
        inbox.fail(&taken.lease, &error_of(attempt), retry).await?;
        windows.push((attempt, before, SystemTime::now()));
        if attempt == 7 {
            // The same fail sent again: answered Ok, nothing added.
            inbox.fail(&taken.lease, &error_of(attempt), retry).await?;
        }
    }
    let expect = |item: &dedupe_core::Item, attempts: &[u32]| -> Result<(), Failure> {
        let got: Vec<(u32, String)> = item
            .errors
            .iter()
            .map(|e| (e.attempt, e.error.clone()))
            .collect();
        let want: Vec<(u32, String)> = attempts
            .iter()
            .map(|a| (*a, dedupe_core::backend::cut_error(&error_of(*a))))
            .collect();
        ensure!(
            got == want,
            "the failure history is {:?}, expected attempts {attempts:?} with their errors",
            got.iter()
                .map(|(a, e)| (a, e.chars().take(12).collect::<String>()))
                .collect::<Vec<_>>()
        );
        Ok(())
    };
    let item = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("the failed item is gone"))?;
    ensure!(
        item.errors.len() == ERROR_HISTORY,
        "{} failures kept, expected the last {ERROR_HISTORY}",
        item.errors.len()
    );
    expect(&item, &[3, 4, 5, 6, 7])?;
    for failed in &item.errors {
        let (_, before, after) = windows
            .iter()
            .find(|(a, _, _)| *a == failed.attempt)
            .ok_or_else(|| Failure::new("a failure of an attempt that never failed"))?;
        ensure!(
            failed.at + CLOCK_SLACK >= *before && failed.at <= *after + CLOCK_SLACK,
            "attempt {}'s failure is dated {:?}, outside its call ({before:?} to {after:?})",
            failed.attempt,
            failed.at
        );
    }
    ensure!(
        item.last_error.as_deref() == Some("e7"),
        "the last error is {:?}, expected the history's last",
        item.last_error
    );
    ensure!(
        inbox.replay(&k).await?,
        "a replay of the dead item answered false"
    );
    expect(
        &inbox
            .item(&k)
            .await?
            .ok_or_else(|| Failure::new("the replayed item is gone"))?,
        &[3, 4, 5, 6, 7],
    )?;
    let taken = take_until(&*inbox, &k).await?;
    inbox
        .fail(&taken.lease, &error_of(8), Retry::After(LONG_TTL))
        .await?;
    expect(
        &inbox
            .item(&k)
            .await?
            .ok_or_else(|| Failure::new("the item is gone"))?,
        &[4, 5, 6, 7, 8],
    )?;
    let fine = inbox
        .item(&item_key("never-failed")?)
        .await?
        .ok_or_else(|| Failure::new("the item that never failed is gone"))?;
    ensure!(
        fine.errors.is_empty(),
        "an item that never failed shows failures: {:?}",
        fine.errors
    );
    // Done at last, and accepted again once its done record expired: a new
    // item, with none of the old one's failures.
    ensure!(
        inbox.replay(&k).await?,
        "a replay of the failed item answered false"
    );
    let last = take_until(&*inbox, &k).await?;
    store.complete(&last.lease, b"done", SHORT_TTL).await?;
    if let Some(record) = store.get(&k).await? {
        if let dedupe_core::RecordState::Done {
            retention_deadline, ..
        } = record.state
        {
            wait_past(retention_deadline).await?;
        }
    }
    ensure!(
        inbox.accept(&k, b"again").await? == Accepted::New,
        "an accept of a key whose done record expired was not new"
    );
    let again = inbox
        .item(&k)
        .await?
        .ok_or_else(|| Failure::new("the item accepted again is not there"))?;
    ensure!(
        again.errors.is_empty(),
        "an item accepted again over an expired done record shows the old item's failures: {:?}",
        again.errors.iter().map(|e| e.attempt).collect::<Vec<_>>()
    );
    Ok(Verdict::Passed)
}

/// Takes until the item of `key` is in hand (others taken are given back),
/// within a few seconds.
async fn take_until(inbox: &dyn Inbox, key: &Key) -> Result<Taken, Failure> {
    let started = Instant::now();
    loop {
        for taken in inbox.take("inbox", 10, LONG_TTL).await? {
            if taken.lease.key == *key {
                return Ok(taken);
            }
            inbox_release(inbox, &taken).await?;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(5),
            "{key} was not due within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn inbox_release(inbox: &dyn Inbox, taken: &Taken) -> Result<(), Failure> {
    inbox.release(&taken.lease).await.map_err(Failure::from)
}

/// I17: `forget_if` removes an item only while it is in the state and at
/// the attempt the caller saw, so an operator's bulk forget never removes an
/// item another operator replayed, or a worker took, since its page was
/// read. A dead item is forgotten at its state and attempt and at no other;
/// replayed, it is no longer the dead item seen; taken, no longer the
/// failed one; the item as it is now goes, and its key is free. A pending
/// item never taken goes at attempt 0; an absent key answers false. A
/// forgotten dead item that held its ordering key's later items back lets
/// the next one run (I15).
pub async fn inbox_forget_if(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let inbox = inbox_or_skip!(fixture);
    let k = item_key("seen")?;
    inbox.accept(&k, b"{}").await?;
    let taken = take_n(&*inbox, 1, LONG_TTL).await?;
    ensure!(taken.len() == 1, "the item was not taken");
    inbox
        .fail(&taken[0].lease, "for good", Retry::dead())
        .await?;
    for (status, attempts) in [
        (ItemStatus::Pending, 1),
        (ItemStatus::Failed, 1),
        (ItemStatus::Running, 1),
        (ItemStatus::Dead, 0),
        (ItemStatus::Dead, 2),
    ] {
        ensure!(
            !inbox.forget_if(&k, status, attempts).await?,
            "forget_if of a dead item at attempt 1, as {} at attempt {attempts}, answered true",
            status.as_str()
        );
    }
    ensure!(
        inbox
            .item(&k)
            .await?
            .is_some_and(|i| i.status == ItemStatus::Dead),
        "a forget_if that answered false removed or changed the item"
    );
    ensure!(
        inbox.replay(&k).await?,
        "a replay of a dead item answered false"
    );
    ensure!(
        !inbox.forget_if(&k, ItemStatus::Dead, 1).await?,
        "forget_if removed a replayed item as the dead item it was"
    );
    let again = take_n(&*inbox, 1, LONG_TTL).await?;
    ensure!(again.len() == 1, "the replayed item was not taken");
    ensure!(
        !inbox.forget_if(&k, ItemStatus::Failed, 1).await?,
        "forget_if removed a running item as the failed item it was"
    );
    ensure!(
        inbox.forget_if(&k, ItemStatus::Running, 2).await?,
        "forget_if of a running item at its attempt answered false"
    );
    ensure!(
        inbox.item(&k).await?.is_none(),
        "forget_if answered true and left the item"
    );
    ensure!(
        inbox.accept(&k, b"{}").await?.is_new(),
        "the key of an item removed by forget_if was not free"
    );
    ensure!(
        inbox.forget_if(&k, ItemStatus::Pending, 0).await?,
        "forget_if of a pending item never taken, at attempt 0, answered false"
    );
    ensure!(
        !inbox
            .forget_if(&item_key("never-accepted")?, ItemStatus::Dead, 1)
            .await?,
        "forget_if of an absent key answered true"
    );

    // Ordered: a dead head that holds its key's next item back.
    let ordered = AcceptOptions::new().ordering_key("cus_1");
    let (first, second) = (item_key("o1")?, item_key("o2")?);
    inbox.accept_with(&first, b"1", &ordered).await?;
    inbox.accept_with(&second, b"2", &ordered).await?;
    let head = take_n(&*inbox, 1, LONG_TTL).await?;
    ensure!(
        head.len() == 1 && head[0].lease.key == first,
        "the first item of an ordering key was not taken alone: {head:?}"
    );
    inbox
        .fail(&head[0].lease, "for good", Retry::dead())
        .await?;
    ensure!(
        take_n(&*inbox, 1, Duration::from_millis(200))
            .await?
            .is_empty(),
        "an item behind a dead one of its ordering key was taken"
    );
    ensure!(
        inbox.forget_if(&first, ItemStatus::Dead, 1).await?,
        "forget_if of a dead ordered item answered false"
    );
    let next = take_n(&*inbox, 1, LONG_TTL).await?;
    ensure!(
        next.first().is_some_and(|t| t.lease.key == second),
        "the item behind a dead one removed by forget_if was not handed out: {next:?}"
    );
    Ok(Verdict::Passed)
}
