//! Sizes, durations and keys at and past their limits, and keys that a careless
//! encoding would merge.

use super::*;

/// Outcomes of every size up to the store's limit come back byte for byte (in
/// `Duplicate` and in `get`), at the sizes where real columns and encodings cut
/// (64 KiB, 128 KiB, the limit itself); one byte over the limit is refused with
/// `OutcomeTooLarge` and writes nothing (the lease still completes afterwards).
pub async fn outcomes_up_to_the_limit(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let limit = store.capabilities().max_outcome_bytes;
    let mut sizes: Vec<usize> = [
        255,
        256,
        65_535,
        65_536,
        65_537,
        100_000,
        131_072,
        limit.saturating_sub(1),
        limit,
    ]
    .into_iter()
    .filter(|s| *s <= limit)
    .collect();
    sizes.sort_unstable();
    sizes.dedup();
    for (i, size) in sizes.iter().enumerate() {
        let k = key(&format!("size-{size}"))?;
        let outcome = pattern(*size, i as u32 + 7);
        let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
        store.complete(&lease, &outcome, LONG_TTL).await?;
        match store.claim(&k, &opts(LONG_TTL)).await? {
            ClaimOutcome::Duplicate { outcome: got, .. } => ensure!(
                got == outcome,
                "an outcome of {size} bytes (limit {limit}) came back as {} bytes{}",
                got.len(),
                if got.len() == outcome.len() {
                    " with other content"
                } else {
                    ""
                }
            ),
            other => {
                return Err(Failure::new(format!(
                    "claim of a done key answered {other:?}"
                )))
            }
        }
        match live_record(&*store, &k, "after complete").await?.state {
            RecordState::Done { outcome: got, .. } => ensure!(
                got == outcome,
                "get returned {} bytes of a {size}-byte outcome",
                got.len()
            ),
            other => return Err(Failure::new(format!("get shows {other:?}"))),
        }
    }
    let k = key("size-over")?;
    let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
    match store
        .complete(&lease, &pattern(limit + 1, 3), LONG_TTL)
        .await
    {
        Err(Error::OutcomeTooLarge { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "complete with {} bytes (limit {limit}) answered {other:?}, expected \
                 OutcomeTooLarge",
                limit + 1
            )))
        }
    }
    let record = live_record(&*store, &k, "after a refused complete").await?;
    ensure!(
        record.state.kind() == RecordStateKind::InFlight && record.token == lease.token,
        "a refused complete changed the record: {record:?}"
    );
    store.complete(&lease, b"small", LONG_TTL).await?;
    Ok(Verdict::Passed)
}

/// Leases and retentions at the defaults and the maxima are taken, with their
/// deadlines exact; one millisecond past the maximum is refused with
/// `InvalidConfig` and writes nothing (no record, no completion, no extension).
pub async fn durations_at_their_limits(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let clock = Clock::measure(&*store, "limits").await?;
    let over = MAX_TTL + Duration::from_millis(1);

    let k = key("lease-max")?;
    let before = SystemTime::now();
    let lease = must_claim(&*store, &k, &opts(MAX_TTL)).await?;
    let after = SystemTime::now();
    clock.expect("a lease of MAX_TTL", lease.deadline, before, after, MAX_TTL)?;

    let refused = key("lease-over")?;
    match store.claim(&refused, &opts(over)).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "a claim with a lease of MAX_TTL + 1 ms answered {other:?}, expected \
                 InvalidConfig"
            )))
        }
    }
    ensure!(
        store.get(&refused).await?.is_none(),
        "a refused claim wrote a record"
    );
    match store
        .claim_many(std::slice::from_ref(&refused), &opts(over))
        .await
    {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "claim_many with a lease over the maximum answered {other:?}"
            )))
        }
    }
    ensure!(
        store.get(&refused).await?.is_none(),
        "a refused claim_many wrote a record"
    );

    let before_extend = live_record(&*store, &k, "after claim").await?;
    match store.extend(&lease, over).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "extend by MAX_TTL + 1 ms answered {other:?}, expected InvalidConfig"
            )))
        }
    }
    match store.complete(&lease, b"too long kept", over).await {
        Err(Error::InvalidConfig { .. }) => {}
        other => {
            return Err(Failure::new(format!(
                "complete with a retention of MAX_TTL + 1 ms answered {other:?}, expected \
                 InvalidConfig"
            )))
        }
    }
    ensure!(
        store.get(&k).await? == Some(before_extend),
        "a refused extend or complete changed the record"
    );

    for (name, retention) in [
        ("retention-default", Retention::DEFAULT),
        ("retention-max", MAX_TTL),
    ] {
        let k = key(name)?;
        let lease = must_claim(&*store, &k, &opts(LONG_TTL)).await?;
        let before = SystemTime::now();
        store.complete(&lease, name.as_bytes(), retention).await?;
        let after = SystemTime::now();
        match live_record(&*store, &k, "after complete").await?.state {
            RecordState::Done {
                retention_deadline, ..
            } => clock.expect(name, retention_deadline, before, after, retention)?,
            other => return Err(Failure::new(format!("get shows {other:?}"))),
        }
    }
    store
        .complete(&lease, b"max lease done", Retention::DEFAULT)
        .await?;
    Ok(Verdict::Passed)
}

/// Rule 2 against encodings: pairs of distinct keys that a store merges when it
/// joins namespace and id with a separator that may occur in them, trims or
/// folds case, normalises Unicode, or cuts long ids to a column width. Each key
/// is its own record, with its own outcome.
pub async fn encoded_keys_stay_distinct(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    let long = |fill: usize, last: char| format!("{}{last}", "x".repeat(fill));
    let pairs: Vec<(String, String)> = vec![
        // Joined with a separator or with none.
        ("a_b".into(), "c".into()),
        ("a".into(), "b_c".into()),
        ("a.b".into(), "c".into()),
        ("a".into(), "b.c".into()),
        ("a-b".into(), "c".into()),
        ("a".into(), "b-c".into()),
        ("ab".into(), "c".into()),
        ("a".into(), "bc".into()),
        ("a".into(), "b:c".into()),
        ("a".into(), "b/c".into()),
        // Trimmed, folded, normalised.
        ("n".into(), "evt".into()),
        ("n".into(), "evt ".into()),
        ("n".into(), " evt".into()),
        ("n".into(), "evt\t".into()),
        ("n".into(), "evt\n".into()),
        ("n".into(), "Evt".into()),
        ("n".into(), "EVT".into()),
        ("N".into(), "evt".into()),
        ("n".into(), "caf\u{e9}".into()),
        ("n".into(), "cafe\u{301}".into()),
        ("n".into(), "\u{fb01}".into()),
        ("n".into(), "fi".into()),
        ("n".into(), "\u{212b}".into()),
        ("n".into(), "\u{c5}".into()),
        // Cut to a column width: equal up to 64, 128, 255, 256 and 511 bytes.
        ("n".into(), long(64, 'a')),
        ("n".into(), long(64, 'b')),
        ("n".into(), long(128, 'a')),
        ("n".into(), long(128, 'b')),
        ("n".into(), long(255, 'a')),
        ("n".into(), long(255, 'b')),
        ("n".into(), long(256, 'a')),
        ("n".into(), long(256, 'b')),
        ("n".into(), long(MAX_ID_BYTES - 1, 'a')),
        ("n".into(), long(MAX_ID_BYTES - 1, 'b')),
    ];
    let keys: Vec<Key> = pairs
        .iter()
        .map(|(ns, id)| {
            Key::new(ns.as_str(), id.as_str())
                .map_err(|e| Failure::new(format!("test key {ns:?}/{id:?} refused: {e}")))
        })
        .collect::<Result<_, _>>()?;
    for k in &keys {
        match store.claim(k, &opts(LONG_TTL)).await? {
            ClaimOutcome::Claimed(lease) => {
                store
                    .complete(&lease, format!("outcome of {k:?}").as_bytes(), LONG_TTL)
                    .await?
            }
            other => {
                return Err(Failure::new(format!(
                    "the fresh key {k:?} answered {other:?}: the store merged it with one \
                     claimed before it"
                )))
            }
        }
    }
    for k in &keys {
        let want = format!("outcome of {k:?}").into_bytes();
        match store.claim(k, &opts(LONG_TTL)).await? {
            ClaimOutcome::Duplicate { outcome, .. } if outcome == want => {}
            other => {
                return Err(Failure::new(format!(
                    "{k:?} answered {other:?}, expected Duplicate with its own outcome"
                )))
            }
        }
        let record = live_record(&*store, k, "after complete").await?;
        ensure!(&record.key == k, "get of {k:?} returned {:?}", record.key);
    }
    Ok(Verdict::Passed)
}

/// Claim ids are compared whole: ids up to the maximum length that agree in
/// their first 64 or 127 bytes are different claims (the second is InFlight,
/// not a re-entrant Claimed), and the full id gets its lease back.
pub async fn claim_ids_compare_whole(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let store = fixture.store();
    for (i, shared) in [64usize, MAX_CLAIM_ID_BYTES - 1].into_iter().enumerate() {
        let k = key(&format!("claim-id-prefix-{i}"))?;
        let id = |last: char| {
            ClaimId::new(format!("{}{last}", "w".repeat(shared)))
                .map_err(|e| Failure::new(format!("claim id refused: {e}")))
        };
        let (mine, theirs) = (id('a')?, id('b')?);
        let lease = must_claim(&*store, &k, &opts(LONG_TTL).with_claim_id(mine.clone())).await?;
        match store
            .claim(&k, &opts(LONG_TTL).with_claim_id(theirs))
            .await?
        {
            ClaimOutcome::InFlight { .. } => {}
            other => {
                return Err(Failure::new(format!(
                    "a claim id sharing its first {shared} bytes with the holder's answered \
                     {other:?}, expected InFlight"
                )))
            }
        }
        let again = must_claim(&*store, &k, &opts(LONG_TTL).with_claim_id(mine)).await?;
        ensure!(
            again == lease,
            "the holder's {}-byte claim id got {again:?} back, not its lease {lease:?}",
            shared + 1
        );
    }
    // Claim ids are bytes, not words: one differing only by case is another
    // delivery (a case-insensitive column would hand it the lease).
    let k = key("claim-id-case")?;
    let upper = ClaimId::new("Delivery-A").map_err(|e| Failure::new(e.to_string()))?;
    let lower = ClaimId::new("delivery-a").map_err(|e| Failure::new(e.to_string()))?;
    must_claim(&*store, &k, &opts(LONG_TTL).with_claim_id(upper)).await?;
    match store
        .claim(&k, &opts(LONG_TTL).with_claim_id(lower))
        .await?
    {
        ClaimOutcome::InFlight { .. } => {}
        other => {
            return Err(Failure::new(format!(
                "claim id \"delivery-a\" against the holder's \"Delivery-A\" answered {other:?}, \
                 expected InFlight"
            )))
        }
    }
    Ok(Verdict::Passed)
}
