//! The suite's self-test: deliberately broken stores, and a test per broken store
//! proving that the suite rejects it, by the checks named for its rule. A check
//! that no broken store trips would be a check that cannot fail, so
//! `every_check_is_tripped_by_some_broken_store` holds the two tables below to
//! covering them all.
//!
//! Two sets of broken stores:
//! - `Flaw`: written with the suite; each wraps the correct [`MemoryStore`] and
//!   breaks one thing the way real stores get it wrong;
//! - `AFlaw` (`adversary/flawed.rs`): written by a reviewer who had not read the
//!   checks, on a row store of its own, one plausible backend mistake each.
//!   Before the checks that now catch them, the suite passed 17 of the first
//!   44; of the 12 a second reviewer added later, it passed 2
//!   (`ExpireScanThenDelete`, `ClaimManyDedupByIdOnly`) until
//!   `expire_races_takeovers` and a batch in `namespaces_isolate` came.

#[allow(dead_code, missing_docs)]
#[path = "adversary/flawed.rs"]
mod flawed;

use flawed::{all_flaws, AFlaw, FlawedFactory};

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use dedupe_conformance::{checks::CHECKS, run_all, run_check, run_selected, Fixture, StoreFactory};
use dedupe_core::{
    AcceptOptions, Accepted, Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Inbox,
    InboxCounts, Item, ItemPage, ItemQuery, ItemStatus, Key, Lease, MemoryStore, Record,
    RecordState, Result, Retry, Taken,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Reads, awaits, then writes blindly: two racers both see "absent" and both win.
    CheckThenWrite,
    /// `release` deletes the key without looking at the token.
    ReleaseIgnoresToken,
    /// `complete` marks whatever in-flight record is there as done.
    CompleteIgnoresToken,
    /// `extend` pushes whatever record is there (or pretends to).
    ExtendIgnoresToken,
    /// A record counts as live until `expire()` physically deletes it.
    ExpiryByDeletionOnly,
    /// `claim_many` answers a key seen twice in one batch with the first answer again.
    ClaimManyIgnoresBatchDuplicates,
    /// Stored outcomes come back cut at 32 KiB (a column too narrow).
    TruncatesOutcome,
    /// Fingerprints are never compared.
    IgnoresFingerprint,
    /// Claim ids are never stored, so a retried claim gets InFlight.
    IgnoresClaimId,
    /// Keys are stored by id alone.
    NamespaceBlind,
    /// Ids are folded to lower case (a case-insensitive collation).
    CaseInsensitive,
    /// `expire()` removes live records too.
    ExpireRemovesLive,
    /// `release` answers Ok and removes nothing.
    ReleaseKeepsRecord,
    /// `extend` answers a new deadline but stores nothing.
    ExtendForgets,
    /// `forget` always answers false.
    ForgetAnswersFalse,
    /// Advertises a 1 KiB outcome limit and does not enforce it.
    NoOutcomeLimit,
    /// `claim_many` takes a batch of any size.
    UnboundedBatches,
    /// Keys are bucketed by a short hash, so distinct keys collide.
    HashCollisions,
    /// Every lease lasts an hour, whatever TTL was asked.
    DeadlineIgnoresTtl,
    /// A live in-flight record is answered as an empty Duplicate.
    InFlightAsDuplicate,
    /// A takeover is reported as attempt 1.
    TakeoverResetsAttempt,
    /// A completion rewrites `first_seen` to the completion time.
    CompletionResetsFirstSeen,
    /// A done record whose retention passed is taken over by read, wait, write
    /// (expired in-flight records are taken over atomically).
    DoneTakeoverCheckThenWrite,
    /// `complete` still accepts a lease up to 100 ms past its deadline when nobody
    /// took it over (a "grace for clock skew"). With 25 ms of grace it passed
    /// `passed_lease_is_lost`, which calls 30 ms late; the check that names it
    /// calls a few ms late, so 100 ms keeps it caught on a loaded machine.
    CompletionGrace,
    // Inbox flaws (the inbox checks run only for these).
    /// `accept` reads, waits, then writes: racing accepts each store an item.
    AcceptCheckThenInsert,
    /// `accept` of a key holding a pending item overwrites its payload.
    AcceptOverwritesPending,
    /// `take` hands out due items without leasing them: every taker gets them.
    TakeWithoutLeasing,
    /// A takeover of an item whose worker's lease passed answers attempt 1.
    TakeoverAttemptNotCounted,
    /// `replay` of a dead item accepts it afresh: attempts and error lost.
    ReplayStartsOver,
    /// `expire()` removes items held past their lease.
    ExpireRemovesItems,
    /// `list` starts a page at its cursor, not after it: the boundary item
    /// shows on two pages.
    ListCursorInclusive,
    /// `take` hands out the right items, newest due first.
    TakeNewestFirst,
    /// `accept` keeps the first 64 KiB of a payload.
    PayloadTruncated64K,
    /// `counts` answers the newest due time as the oldest.
    OldestDueIsNewest,
    /// A dead item is taken again 200 ms after it died.
    DeadReturnsLater,
    /// A take of one namespace hands out other namespaces' items too.
    TakeIgnoresNamespace,
    /// A fail sent again after its answer was lost is `LeaseLost`.
    FailAgainIsLeaseLost,
    /// A release of an item sent again is `LeaseLost`.
    ItemReleaseAgainIsLeaseLost,
    /// A failure's retry comes after twice the delay asked.
    FailDelayDoubled,
    /// A replay answers true at once and makes the item due 300 ms later.
    ReplayDueLater,
    /// A replay of a failed item that is due already answers true: two
    /// operators replaying an item at once both count it.
    ReplayAgainAnswersTrue,
    /// `forget_if` forgets whatever is there, as `forget` does.
    ForgetIfIgnoresState,
    /// An accept of a dead item's key starts the item over.
    AcceptResetsDead,
    /// An accept over a claim whose lease passed answers `InFlight`.
    AcceptLapsedClaimInFlight,
    /// A listing filtered by status starts every page from the beginning.
    FilteredListIgnoresCursor,
    /// A release of an item keeps the attempt its take counted: every
    /// deploy spends one.
    HandBackSpendsAttempt,
    /// Takeovers of a worker that died are not counted.
    TakeoverNotCounted,
    /// `accept_with` ignores `not_before`: delayed work is due at once.
    NotBeforeIgnored,
    /// `accept_with` drops the item's own attempt limit.
    ItemLimitDropped,
    /// A completed item is still listed, as it was before the completion.
    CompletedStillListed,
    /// A snooze is a failure retried after the delay: it spends the attempt.
    SnoozeSpendsAttempt,
    /// A snooze is a release: the item is due again at once.
    SnoozeIgnoresDelay,
    /// A take hands out the time of the take as the item's accept time.
    AcceptedAtIsTakeTime,
    /// A pause is noted beside the store and never reaches its takes.
    PauseIgnored,
    /// A pause of one namespace stops the takes of every namespace.
    PauseEveryNamespace,
    /// An accept into a paused namespace answers `New` and stores nothing.
    PauseLosesAccepts,
    /// A paused namespace's takes still take over items whose lease passed.
    PauseTakesOverLapsed,
    /// Pause and resume always answer that they changed something.
    PauseAnswersChanged,
    /// Offers a wake-up signal that nothing ever raises.
    WakeNeverRaised,
    /// Raises its wake-up signal on accepts only: an item given back,
    /// replayed or resumed waits for the poll.
    WakeOnAcceptOnly,
    /// Hands out the first namespace's signal for every namespace.
    WakeOneNamespace,
    /// Drops an accept's ordering key: items of one key run at once.
    OrderIgnored,
    /// Every item is accepted to be skipped when dead.
    DeadAlwaysSkipped,
    /// Forgetting an item a worker holds leaves its ordering key held: the
    /// items behind it never go.
    ForgetKeepsKeyHeld,
    /// A take of `max` looks at the first `max` ordering keys of the due
    /// items only, held or blocked or not: a free key behind a blocked one
    /// waits for it.
    OrderKeysCountBlocked,
    /// A dead item is kept until forgotten, whatever retention its fail gave.
    DeadKeptForever,
    /// `expire()` removes every dead item, its retention passed or not.
    DeadExpiresAtOnce,
    /// A replay leaves the dead item's retention: `expire()` removes the
    /// replayed item when it passes.
    ReplayKeepsDeadRetention,
    /// The failure history keeps the first five failures, not the last.
    HistoryKeepsFirst,
    /// A hand-back (release) is written into the failure history.
    HistoryCountsReleases,
    /// The failure history holds the last failure only.
    HistoryOnlyLast,
}

impl Flaw {
    fn is_inbox(self) -> bool {
        matches!(
            self,
            Flaw::AcceptCheckThenInsert
                | Flaw::AcceptOverwritesPending
                | Flaw::TakeWithoutLeasing
                | Flaw::TakeoverAttemptNotCounted
                | Flaw::ReplayStartsOver
                | Flaw::ExpireRemovesItems
                | Flaw::ListCursorInclusive
                | Flaw::TakeNewestFirst
                | Flaw::PayloadTruncated64K
                | Flaw::OldestDueIsNewest
                | Flaw::DeadReturnsLater
                | Flaw::TakeIgnoresNamespace
                | Flaw::FailAgainIsLeaseLost
                | Flaw::ItemReleaseAgainIsLeaseLost
                | Flaw::FailDelayDoubled
                | Flaw::ReplayDueLater
                | Flaw::ReplayAgainAnswersTrue
                | Flaw::ForgetIfIgnoresState
                | Flaw::AcceptResetsDead
                | Flaw::AcceptLapsedClaimInFlight
                | Flaw::FilteredListIgnoresCursor
                | Flaw::HandBackSpendsAttempt
                | Flaw::TakeoverNotCounted
                | Flaw::NotBeforeIgnored
                | Flaw::ItemLimitDropped
                | Flaw::CompletedStillListed
                | Flaw::SnoozeSpendsAttempt
                | Flaw::SnoozeIgnoresDelay
                | Flaw::AcceptedAtIsTakeTime
                | Flaw::PauseIgnored
                | Flaw::PauseEveryNamespace
                | Flaw::PauseLosesAccepts
                | Flaw::PauseTakesOverLapsed
                | Flaw::PauseAnswersChanged
                | Flaw::WakeNeverRaised
                | Flaw::WakeOnAcceptOnly
                | Flaw::WakeOneNamespace
                | Flaw::OrderIgnored
                | Flaw::DeadAlwaysSkipped
                | Flaw::OrderKeysCountBlocked
                | Flaw::ForgetKeepsKeyHeld
                | Flaw::DeadKeptForever
                | Flaw::DeadExpiresAtOnce
                | Flaw::ReplayKeepsDeadRetention
                | Flaw::HistoryKeepsFirst
                | Flaw::HistoryCountsReleases
                | Flaw::HistoryOnlyLast
        )
    }
}

#[derive(Debug, Clone)]
struct Broken {
    inner: MemoryStore,
    flaw: Flaw,
    /// Keys ever claimed and not yet physically removed.
    physical: Arc<Mutex<HashSet<Key>>>,
    /// Keys ever completed.
    done: Arc<Mutex<HashSet<Key>>>,
    /// Items as they were before their completion (`CompletedStillListed`).
    completed_items: Arc<Mutex<Vec<Item>>>,
    /// Attempts hand-backs kept (`HandBackSpendsAttempt`).
    spent: Arc<Mutex<HashMap<Key, u32>>>,
    /// Namespaces paused beside the store (`PauseIgnored`,
    /// `PauseEveryNamespace`).
    paused: Arc<Mutex<HashSet<String>>>,
    /// Signals raised beside the store (`WakeOnAcceptOnly`).
    wakeups: dedupe_core::backend::Wakeups,
    /// The retention deadline each item got when it died
    /// (`ReplayKeepsDeadRetention`).
    died: Arc<Mutex<HashMap<Key, SystemTime>>>,
    /// Every failure (and, for `HistoryCountsReleases`, hand-back) of each
    /// item, for the history flaws.
    failures: Arc<Mutex<HashMap<Key, Vec<dedupe_core::FailedAttempt>>>>,
    /// Ordering keys whose held item was forgotten (`ForgetKeepsKeyHeld`).
    held_forgotten: Arc<Mutex<HashSet<String>>>,
}

impl Broken {
    fn inner_key(&self, key: &Key) -> Key {
        let mapped = match self.flaw {
            Flaw::NamespaceBlind => Key::new("shared", key.id()),
            Flaw::CaseInsensitive => Key::new(key.namespace(), key.id().to_lowercase()),
            Flaw::HashCollisions => {
                let mut h = DefaultHasher::new();
                key.hash(&mut h);
                Key::new(key.namespace(), format!("bucket-{}", h.finish() % 4096))
            }
            _ => return key.clone(),
        };
        mapped.unwrap_or_else(|_| key.clone())
    }

    fn inner_lease(&self, lease: &Lease) -> Lease {
        Lease {
            key: self.inner_key(&lease.key),
            ..lease.clone()
        }
    }

    /// Notes a failure of `lease`'s attempt beside the store (the history
    /// flaws).
    fn log_failure(&self, lease: &Lease, error: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(lease.key.clone())
            .or_default()
            .push(dedupe_core::FailedAttempt::new(
                lease.attempt,
                SystemTime::now(),
                error,
            ));
    }

    fn physical(&self) -> std::sync::MutexGuard<'_, HashSet<Key>> {
        self.physical.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn current_lease(&self, key: &Key) -> Result<Option<Lease>> {
        Ok(self.inner.get(key).await?.and_then(|r| match r.state {
            RecordState::InFlight { lease_deadline } => Some(Lease {
                key: key.clone(),
                token: r.token,
                deadline: lease_deadline,
                attempt: r.attempts,
                claim_id: r.claim_id,
            }),
            RecordState::Done { .. } => None,
        }))
    }
}

#[async_trait]
impl DedupeStore for Broken {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        let ik = self.inner_key(key);
        let mut opts = opts.clone();
        match self.flaw {
            Flaw::IgnoresFingerprint => opts.fingerprint = None,
            Flaw::IgnoresClaimId => opts.claim_id = None,
            Flaw::DeadlineIgnoresTtl if !opts.lease_ttl.is_zero() => {
                opts.lease_ttl = Duration::from_secs(3600)
            }
            _ => {}
        }
        let answer = match self.flaw {
            Flaw::CheckThenWrite if self.inner.get(&ik).await?.is_none() => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                self.inner.forget(&ik).await?;
                self.inner.claim(&ik, &opts).await?
            }
            Flaw::DoneTakeoverCheckThenWrite
                if self
                    .done
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(&ik)
                    && self.inner.get(&ik).await?.is_none() =>
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
                self.inner.forget(&ik).await?;
                self.inner.claim(&ik, &opts).await?
            }
            Flaw::ExpiryByDeletionOnly
                if self.physical().contains(&ik) && self.inner.get(&ik).await?.is_none() =>
            {
                ClaimOutcome::InFlight {
                    deadline: SystemTime::now(),
                    attempt: 1,
                }
            }
            _ => self.inner.claim(&ik, &opts).await?,
        };
        Ok(match answer {
            ClaimOutcome::Claimed(mut lease) => {
                self.physical().insert(ik);
                lease.key = key.clone();
                if self.flaw == Flaw::TakeoverResetsAttempt {
                    lease.attempt = 1;
                }
                ClaimOutcome::Claimed(lease)
            }
            ClaimOutcome::Duplicate {
                mut outcome,
                completed_at,
            } => {
                if self.flaw == Flaw::TruncatesOutcome {
                    outcome.truncate(32 * 1024);
                }
                ClaimOutcome::Duplicate {
                    outcome,
                    completed_at,
                }
            }
            ClaimOutcome::InFlight { .. } if self.flaw == Flaw::InFlightAsDuplicate => {
                ClaimOutcome::Duplicate {
                    outcome: Vec::new(),
                    completed_at: SystemTime::now(),
                }
            }
            other => other,
        })
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        let lease = self.inner_lease(lease);
        if self.flaw == Flaw::CompletedStillListed {
            if let Some(item) = self.inner.item(&lease.key).await? {
                self.inner.complete(&lease, outcome, retention).await?;
                self.completed_items
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(item);
                return Ok(());
            }
        }
        if self.flaw == Flaw::CompleteIgnoresToken {
            if let Some(current) = self.current_lease(&lease.key).await? {
                return self.inner.complete(&current, outcome, retention).await;
            }
        }
        if self.flaw == Flaw::CompletionGrace
            && SystemTime::now() < lease.deadline + Duration::from_millis(100)
            && self.inner.get(&lease.key).await?.is_none()
            && self.physical().contains(&lease.key)
        {
            // Past its deadline, not taken over: finish it anyway on a fresh lease.
            self.inner.forget(&lease.key).await?;
            if let ClaimOutcome::Claimed(fresh) = self
                .inner
                .claim(&lease.key, &ClaimOptions::new(Duration::from_secs(1)))
                .await?
            {
                return self.inner.complete(&fresh, outcome, retention).await;
            }
        }
        self.inner.complete(&lease, outcome, retention).await?;
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lease.key);
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let lease = self.inner_lease(lease);
        match self.flaw {
            Flaw::ReleaseIgnoresToken => {
                self.inner.forget(&lease.key).await?;
                Ok(())
            }
            Flaw::ReleaseKeepsRecord => Ok(()),
            Flaw::HistoryCountsReleases if self.inner.item(&lease.key).await?.is_some() => {
                self.inner.release(&lease).await?;
                self.log_failure(&lease, "given back");
                Ok(())
            }
            Flaw::HandBackSpendsAttempt if self.inner.item(&lease.key).await?.is_some() => {
                self.inner.release(&lease).await?;
                *self
                    .spent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(lease.key.clone())
                    .or_default() += 1;
                Ok(())
            }
            Flaw::ItemReleaseAgainIsLeaseLost
                if self
                    .inner
                    .item(&lease.key)
                    .await?
                    .is_some_and(|i| i.status != ItemStatus::Running) =>
            {
                Err(Error::lease_lost(&lease.key))
            }
            _ => {
                self.inner.release(&lease).await?;
                self.physical().remove(&lease.key);
                Ok(())
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let inner = self.inner_lease(lease);
        let pretend = Lease {
            deadline: SystemTime::now() + ttl,
            ..lease.clone()
        };
        match self.flaw {
            Flaw::ExtendIgnoresToken => match self.current_lease(&inner.key).await? {
                Some(current) => self.inner.extend(&current, ttl).await.map(|_| pretend),
                None => Ok(pretend),
            },
            Flaw::ExtendForgets => Ok(pretend),
            _ => {
                let mut extended = self.inner.extend(&inner, ttl).await?;
                extended.key = lease.key.clone();
                Ok(extended)
            }
        }
    }

    async fn expire(&self) -> Result<u64> {
        if self.flaw == Flaw::ExpireRemovesLive {
            let keys: Vec<Key> = self.physical().drain().collect();
            let mut removed = 0;
            for k in keys {
                self.inner.forget(&k).await?;
                removed += 1;
            }
            return Ok(removed);
        }
        if self.flaw == Flaw::ExpireRemovesItems {
            // Items held past their lease count as expired records.
            let page = self
                .inner
                .list(&ItemQuery {
                    limit: dedupe_core::MAX_PAGE,
                    ..ItemQuery::new("inbox").status(ItemStatus::Running)
                })
                .await?;
            for item in page.items {
                if item.due_at <= SystemTime::now() {
                    self.inner.forget(&item.key).await?;
                }
            }
        }
        let mut removed = 0;
        if matches!(
            self.flaw,
            Flaw::DeadExpiresAtOnce | Flaw::ReplayKeepsDeadRetention
        ) {
            let now = SystemTime::now();
            let page = self
                .inner
                .list(&ItemQuery {
                    limit: dedupe_core::MAX_PAGE,
                    ..ItemQuery::new("inbox")
                })
                .await?;
            let died = self.died.lock().unwrap_or_else(|e| e.into_inner()).clone();
            for item in page.items {
                let gone = match self.flaw {
                    Flaw::DeadExpiresAtOnce => item.status == ItemStatus::Dead,
                    _ => died.get(&item.key).is_some_and(|at| *at <= now),
                };
                if gone && self.inner.forget(&item.key).await? {
                    removed += 1;
                }
            }
        }
        removed += self.inner.expire().await?;
        let keys: Vec<Key> = self.physical().iter().cloned().collect();
        for k in keys {
            if self.inner.get(&k).await?.is_none() {
                self.physical().remove(&k);
            }
        }
        Ok(removed)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        Ok(self.inner.get(&self.inner_key(key)).await?.map(|mut r| {
            r.key = key.clone();
            if let (Flaw::CompletionResetsFirstSeen, RecordState::Done { completed_at, .. }) =
                (self.flaw, &r.state)
            {
                r.first_seen = *completed_at;
            }
            r
        }))
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let ik = self.inner_key(key);
        if self.flaw == Flaw::ForgetKeepsKeyHeld {
            if let Some(item) = self.inner.item(&ik).await? {
                if let (ItemStatus::Running, Some(order)) = (item.status, item.ordering_key) {
                    self.held_forgotten
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(order);
                }
            }
        }
        self.physical().remove(&ik);
        let had = self.inner.forget(&ik).await?;
        Ok(had && self.flaw != Flaw::ForgetAnswersFalse)
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        if self.flaw != Flaw::UnboundedBatches {
            dedupe_core::backend::check_batch(keys)?;
        }
        if self.flaw == Flaw::ClaimManyIgnoresBatchDuplicates {
            let mut seen: HashMap<&Key, ClaimOutcome> = HashMap::new();
            let mut answers = Vec::with_capacity(keys.len());
            for key in keys {
                let answer = match seen.get(key) {
                    Some(first) => first.clone(),
                    None => self.claim(key, opts).await?,
                };
                seen.insert(key, answer.clone());
                answers.push(answer);
            }
            return Ok(answers);
        }
        let batch = dedupe_core::backend::BatchKeys::new(keys);
        let mut firsts = Vec::with_capacity(batch.distinct().len());
        for key in batch.distinct() {
            firsts.push(self.claim(key, opts).await?);
        }
        batch.answers(firsts, opts)
    }

    fn capabilities(&self) -> Capabilities {
        let caps = self.inner.capabilities();
        if self.flaw == Flaw::NoOutcomeLimit {
            caps.with_max_outcome_bytes(1024)
        } else {
            caps
        }
    }
}

struct BrokenFactory(Flaw);

struct BrokenFixture(Broken);

#[async_trait]
impl StoreFactory for BrokenFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        Ok(Box::new(BrokenFixture(Broken {
            inner: MemoryStore::new(),
            flaw: self.0,
            physical: Arc::default(),
            done: Arc::default(),
            completed_items: Arc::default(),
            spent: Arc::default(),
            paused: Arc::default(),
            wakeups: Default::default(),
            died: Arc::default(),
            failures: Arc::default(),
            held_forgotten: Arc::default(),
        })))
    }
}

#[async_trait]
impl Fixture for BrokenFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.0.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(self.0.clone()))
    }

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        self.0
            .flaw
            .is_inbox()
            .then(|| Arc::new(self.0.clone()) as Arc<dyn Inbox>)
    }
}

#[async_trait]
impl Inbox for Broken {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        match self.flaw {
            Flaw::WakeOnAcceptOnly => {
                let accepted = self.inner.accept_with(key, payload, options).await?;
                self.wakeups.raise(key.namespace());
                Ok(accepted)
            }
            Flaw::PauseLosesAccepts if self.inner.paused(key.namespace()).await? => {
                dedupe_core::backend::check_accept(payload, options)?;
                Ok(Accepted::New)
            }
            Flaw::AcceptCheckThenInsert => {
                if self.inner.get(key).await?.is_none() {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    self.inner.forget(key).await?;
                }
                self.inner.accept_with(key, payload, options).await
            }
            Flaw::AcceptOverwritesPending => {
                if self
                    .inner
                    .item(key)
                    .await?
                    .is_some_and(|i| i.status == ItemStatus::Pending)
                {
                    self.inner.forget(key).await?;
                }
                self.inner.accept_with(key, payload, options).await
            }
            Flaw::AcceptResetsDead => {
                if self
                    .inner
                    .item(key)
                    .await?
                    .is_some_and(|i| i.status == ItemStatus::Dead)
                {
                    self.inner.forget(key).await?;
                }
                self.inner.accept_with(key, payload, options).await
            }
            Flaw::AcceptLapsedClaimInFlight
                if self.physical().contains(key) && self.inner.get(key).await?.is_none() =>
            {
                Ok(Accepted::InFlight {
                    deadline: SystemTime::now(),
                    attempt: 1,
                })
            }
            Flaw::PayloadTruncated64K => {
                self.inner
                    .accept(key, &payload[..payload.len().min(64 * 1024)])
                    .await
            }
            Flaw::NotBeforeIgnored => {
                let mut options = options.clone();
                options.not_before = None;
                self.inner.accept_with(key, payload, &options).await
            }
            Flaw::OrderIgnored => {
                let mut options = options.clone();
                if options
                    .ordering_key
                    .as_deref()
                    .is_some_and(|k| !k.is_empty())
                {
                    options.ordering_key = None;
                }
                self.inner.accept_with(key, payload, &options).await
            }
            Flaw::DeadAlwaysSkipped => {
                let options = options.clone().when_dead(dedupe_core::WhenDead::Skip);
                self.inner.accept_with(key, payload, &options).await
            }
            Flaw::ItemLimitDropped => {
                let mut options = options.clone();
                options.max_attempts = None;
                self.inner.accept_with(key, payload, &options).await
            }
            _ => self.inner.accept_with(key, payload, options).await,
        }
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        if self.flaw == Flaw::PauseEveryNamespace && !self.paused_set().is_empty() {
            return Ok(Vec::new());
        }
        if self.flaw == Flaw::PauseTakesOverLapsed && self.inner.paused(namespace).await? {
            // Takes over the lapsed leases as if it were not paused, and gives
            // back the waiting items the same take handed out.
            let running = self
                .inner
                .list(&ItemQuery {
                    limit: dedupe_core::MAX_PAGE,
                    ..ItemQuery::new(namespace).status(ItemStatus::Running)
                })
                .await?;
            let lapsed: HashSet<Key> = running
                .items
                .into_iter()
                .filter(|i| i.due_at <= SystemTime::now())
                .map(|i| i.key)
                .collect();
            self.inner.resume(namespace).await?;
            let taken = self.inner.take(namespace, max, lease).await;
            self.inner.pause(namespace).await?;
            let mut kept = Vec::new();
            for t in taken? {
                if lapsed.contains(&t.lease.key) {
                    kept.push(t);
                } else {
                    self.inner.release(&t.lease).await?;
                }
            }
            return Ok(kept);
        }
        if self.flaw == Flaw::DeadReturnsLater {
            let dead = self
                .inner
                .list(&ItemQuery {
                    limit: dedupe_core::MAX_PAGE,
                    ..ItemQuery::new(namespace).status(ItemStatus::Dead)
                })
                .await?;
            for item in dead.items {
                if item.due_at + Duration::from_millis(200) <= SystemTime::now() {
                    self.inner.replay(&item.key).await?;
                }
            }
        }
        if self.flaw == Flaw::TakeIgnoresNamespace {
            let mut elsewhere = self.inner.take("elsewhere", max, lease).await?;
            if !elsewhere.is_empty() {
                elsewhere.truncate(max);
                return Ok(elsewhere);
            }
        }
        if self.flaw == Flaw::OrderKeysCountBlocked {
            // The ordering keys of the first `max` due items and lapsed
            // leases (an item without a key counts as one of its own); an
            // item of any other key is given back.
            let now = SystemTime::now();
            let mut due = Vec::new();
            for status in [ItemStatus::Pending, ItemStatus::Failed, ItemStatus::Running] {
                let page = self
                    .inner
                    .list(&ItemQuery {
                        limit: dedupe_core::MAX_PAGE,
                        ..ItemQuery::new(namespace).status(status)
                    })
                    .await?;
                due.extend(page.items.into_iter().filter(|i| i.due_at <= now));
            }
            due.sort_by_key(|i| i.due_at);
            let mut slots: Vec<Option<String>> = Vec::new();
            for item in &due {
                if slots.len() == max {
                    break;
                }
                if item.ordering_key.is_none() || !slots.contains(&item.ordering_key) {
                    slots.push(item.ordering_key.clone());
                }
            }
            let taken = self.inner.take(namespace, max, lease).await?;
            let mut kept = Vec::new();
            for t in taken {
                let key = t.ordering_key.clone();
                if key.is_none() || slots.contains(&key) {
                    kept.push(t);
                } else {
                    self.inner.release(&t.lease).await?;
                }
            }
            return Ok(kept);
        }
        let taken = self.inner.take(namespace, max, lease).await?;
        if self.flaw == Flaw::ForgetKeepsKeyHeld {
            let held = self
                .held_forgotten
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let mut kept = Vec::new();
            for t in taken {
                if t.ordering_key.as_ref().is_some_and(|k| held.contains(k)) {
                    self.inner.release(&t.lease).await?;
                } else {
                    kept.push(t);
                }
            }
            return Ok(kept);
        }
        match self.flaw {
            Flaw::TakeWithoutLeasing => {
                // Hands them out, then lets them go again at once.
                for t in &taken {
                    self.inner.release(&t.lease).await?;
                }
                Ok(taken)
            }
            Flaw::TakeNewestFirst => Ok(taken.into_iter().rev().collect()),
            Flaw::AcceptedAtIsTakeTime => Ok(taken
                .into_iter()
                .map(|t| {
                    let (takeovers, limit) = (t.takeovers, t.max_attempts);
                    Taken::new(t.lease, t.payload, t.last_error, SystemTime::now())
                        .with_counts(takeovers, limit)
                })
                .collect()),
            Flaw::TakeoverNotCounted => Ok(taken
                .into_iter()
                .map(|t| {
                    let limit = t.max_attempts;
                    t.with_counts(0, limit)
                })
                .collect()),
            Flaw::HandBackSpendsAttempt => {
                let spent = self.spent.lock().unwrap_or_else(|e| e.into_inner());
                Ok(taken
                    .into_iter()
                    .map(|t| {
                        let mut lease = t.lease.clone();
                        lease.attempt += spent.get(&lease.key).copied().unwrap_or(0);
                        Taken::new(
                            lease,
                            t.payload.clone(),
                            t.last_error.clone(),
                            t.accepted_at,
                        )
                    })
                    .collect())
            }
            Flaw::TakeoverAttemptNotCounted => Ok(taken
                .into_iter()
                .map(|t| {
                    let mut lease = t.lease.clone();
                    lease.attempt = 1;
                    Taken::new(
                        lease,
                        t.payload.clone(),
                        t.last_error.clone(),
                        t.accepted_at,
                    )
                })
                .collect()),
            _ => Ok(taken),
        }
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        match self.flaw {
            Flaw::SnoozeSpendsAttempt => {
                dedupe_core::backend::check_ttl("snooze delay", delay)?;
                self.inner.fail(lease, "snoozed", Retry::After(delay)).await
            }
            Flaw::SnoozeIgnoresDelay => {
                dedupe_core::backend::check_ttl("snooze delay", delay)?;
                self.inner.release(lease).await
            }
            _ => self.inner.snooze(lease, delay).await,
        }
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        match (self.flaw, retry) {
            (Flaw::FailAgainIsLeaseLost, _)
                if self
                    .inner
                    .item(&lease.key)
                    .await?
                    .is_some_and(|i| i.status != ItemStatus::Running) =>
            {
                Err(Error::lease_lost(&lease.key))
            }
            (Flaw::HistoryKeepsFirst | Flaw::HistoryCountsReleases, _) => {
                self.inner.fail(lease, error, retry).await?;
                self.log_failure(lease, &dedupe_core::backend::cut_error(error));
                Ok(())
            }
            (Flaw::FailDelayDoubled, Retry::After(delay)) => {
                self.inner.fail(lease, error, Retry::After(delay * 2)).await
            }
            (Flaw::DeadKeptForever, Retry::Dead { .. }) => {
                retry.validate()?;
                self.inner
                    .fail(lease, error, Retry::Dead { keep: None })
                    .await
            }
            (Flaw::ReplayKeepsDeadRetention, Retry::Dead { keep: Some(keep) }) => {
                self.inner.fail(lease, error, retry).await?;
                self.died
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(lease.key.clone(), SystemTime::now() + keep);
                Ok(())
            }
            _ => self.inner.fail(lease, error, retry).await,
        }
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        let mut item = self.inner.item(key).await?;
        if let Some(item) = item.as_mut() {
            let all = self
                .failures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(key)
                .cloned()
                .unwrap_or_default();
            match self.flaw {
                Flaw::HistoryKeepsFirst => item.errors = all.into_iter().take(5).collect(),
                Flaw::HistoryCountsReleases => {
                    let skip = all.len().saturating_sub(5);
                    item.errors = all.into_iter().skip(skip).collect();
                }
                Flaw::HistoryOnlyLast => {
                    let last = item.errors.pop();
                    item.errors = last.into_iter().collect();
                }
                _ => {}
            }
            let spent = self.spent.lock().unwrap_or_else(|e| e.into_inner());
            item.attempts += spent.get(key).copied().unwrap_or(0);
            if self.flaw == Flaw::TakeoverNotCounted {
                item.takeovers = 0;
            }
        }
        Ok(item)
    }

    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        if self.flaw == Flaw::FilteredListIgnoresCursor && query.status.is_some() {
            return self
                .inner
                .list(&ItemQuery {
                    after: None,
                    ..query.clone()
                })
                .await;
        }
        if self.flaw == Flaw::CompletedStillListed {
            let mut page = self.inner.list(query).await?;
            let completed = self
                .completed_items
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            page.items.extend(completed.into_iter().filter(|i| {
                i.key.namespace() == query.namespace
                    && query.status.is_none_or(|s| s == i.status)
                    && query.after.as_deref().is_none_or(|a| i.key.id() > a)
            }));
            page.items.sort_by(|a, b| a.key.id().cmp(b.key.id()));
            return Ok(page);
        }
        if self.flaw == Flaw::ListCursorInclusive {
            if let Some(after) = &query.after {
                // Starts at the cursor: one id back.
                let mut page = self
                    .inner
                    .list(&ItemQuery {
                        after: None,
                        limit: dedupe_core::MAX_PAGE,
                        ..query.clone()
                    })
                    .await?;
                page.items.retain(|i| i.key.id() >= after.as_str());
                let next = (page.items.len() > query.limit)
                    .then(|| page.items[query.limit - 1].key.id().to_string());
                page.items.truncate(query.limit);
                return Ok(ItemPage::new(page.items, next));
            }
        }
        self.inner.list(query).await
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        if self.flaw == Flaw::ReplayDueLater {
            let replayable = self
                .inner
                .item(key)
                .await?
                .is_some_and(|i| matches!(i.status, ItemStatus::Dead | ItemStatus::Failed));
            if replayable {
                let (inner, key) = (self.inner.clone(), key.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let _ = inner.replay(&key).await;
                });
            }
            return Ok(replayable);
        }
        if self.flaw == Flaw::ReplayAgainAnswersTrue {
            // Any failed item is replayed and counted, due already or not.
            if let Some(item) = self.inner.item(key).await? {
                if item.status == ItemStatus::Failed {
                    self.inner.replay(key).await?;
                    return Ok(true);
                }
            }
        }
        if self.flaw == Flaw::ReplayStartsOver {
            if let Some(item) = self.inner.item(key).await? {
                if item.status == ItemStatus::Dead {
                    self.inner.forget(key).await?;
                    self.inner.accept(key, &item.payload).await?;
                    return Ok(true);
                }
            }
        }
        self.inner.replay(key).await
    }

    async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool> {
        if self.flaw == Flaw::ForgetIfIgnoresState {
            return self.inner.forget(key).await;
        }
        self.inner.forget_if(key, status, attempts).await
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        let mut counts = self.inner.counts(namespace).await?;
        if self.flaw == Flaw::OldestDueIsNewest {
            let page = self
                .inner
                .list(&ItemQuery {
                    limit: dedupe_core::MAX_PAGE,
                    ..ItemQuery::new(namespace)
                })
                .await?;
            counts.oldest_due = page
                .items
                .iter()
                .filter(|i| matches!(i.status, ItemStatus::Pending | ItemStatus::Failed))
                .map(|i| i.due_at)
                .max();
        }
        Ok(counts)
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        match self.flaw {
            Flaw::PauseIgnored => {
                dedupe_core::backend::check_namespace(namespace)?;
                Ok(self.paused_set().insert(namespace.to_string()))
            }
            Flaw::PauseEveryNamespace => {
                let changed = self.inner.pause(namespace).await?;
                self.paused_set().insert(namespace.to_string());
                Ok(changed)
            }
            Flaw::PauseAnswersChanged => self.inner.pause(namespace).await.map(|_| true),
            _ => self.inner.pause(namespace).await,
        }
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        match self.flaw {
            Flaw::PauseIgnored => {
                dedupe_core::backend::check_namespace(namespace)?;
                Ok(self.paused_set().remove(namespace))
            }
            Flaw::PauseEveryNamespace => {
                self.paused_set().remove(namespace);
                self.inner.resume(namespace).await
            }
            Flaw::PauseAnswersChanged => self.inner.resume(namespace).await.map(|_| true),
            _ => self.inner.resume(namespace).await,
        }
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        match self.flaw {
            Flaw::PauseIgnored => {
                dedupe_core::backend::check_namespace(namespace)?;
                Ok(self.paused_set().contains(namespace))
            }
            _ => self.inner.paused(namespace).await,
        }
    }

    async fn wake(&self, namespace: &str) -> Result<dedupe_core::Wake> {
        match self.flaw {
            Flaw::WakeNeverRaised => Ok(dedupe_core::Wake::in_process(Arc::default())),
            Flaw::WakeOnAcceptOnly => Ok(dedupe_core::Wake::in_process(
                self.wakeups.signal(namespace),
            )),
            Flaw::WakeOneNamespace => self.inner.wake("inbox").await,
            _ => self.inner.wake(namespace).await,
        }
    }
}

impl Broken {
    fn paused_set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.paused.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Which checks each broken store must trip (at least these; others may fail too).
/// `matches_reference_store` is named only where its random sequences are sure to
/// meet the flaw: the run keeps drawing seeds until the reference has given every
/// kind of answer, and these flaws change one of those kinds.
const EXPECTED: &[(Flaw, &[&str])] = &[
    (
        Flaw::CheckThenWrite,
        &["single_winner_race", "single_winner_takeover_race"],
    ),
    (
        Flaw::ReleaseIgnoresToken,
        &["stale_holder_is_fenced", "matches_reference_store"],
    ),
    (
        Flaw::CompleteIgnoresToken,
        &["stale_holder_is_fenced", "matches_reference_store"],
    ),
    (Flaw::ExtendIgnoresToken, &["stale_holder_is_fenced"]),
    (
        Flaw::ExpiryByDeletionOnly,
        &["lease_expiry_takeover", "retention_expiry"],
    ),
    (
        Flaw::ClaimManyIgnoresBatchDuplicates,
        &[
            "claim_many_matches_claim",
            "key_twice_in_a_batch_outlasting_its_lease",
            "claim_many_matches_reference_claims",
        ],
    ),
    (
        Flaw::TruncatesOutcome,
        &[
            "duplicate_returns_exact_outcome",
            "outcome_bytes_round_trip",
        ],
    ),
    (
        Flaw::IgnoresFingerprint,
        &["fingerprint_mismatch", "matches_reference_store"],
    ),
    (Flaw::IgnoresClaimId, &["reentrant_claim_id"]),
    (
        Flaw::NamespaceBlind,
        &["namespaces_isolate", "near_identical_keys_race"],
    ),
    (
        Flaw::CaseInsensitive,
        &[
            "key_case_unicode_and_max_length",
            "near_identical_keys_race",
        ],
    ),
    (Flaw::ExpireRemovesLive, &["expire_removes_exactly_expired"]),
    (
        Flaw::ReleaseKeepsRecord,
        &[
            "release_then_reclaim",
            "cancelled_calls_leave_a_sound_store",
        ],
    ),
    (
        Flaw::ExtendForgets,
        &["extend_pushes_deadline", "deadline_edge_races"],
    ),
    (
        Flaw::ForgetAnswersFalse,
        &["forget_removes_any_state", "matches_reference_store"],
    ),
    (
        Flaw::NoOutcomeLimit,
        &["bad_input_rejected_nothing_written"],
    ),
    (Flaw::HashCollisions, &["ten_thousand_distinct_keys"]),
    (Flaw::UnboundedBatches, &["oversized_batches_are_refused"]),
    (Flaw::DeadlineIgnoresTtl, &["fresh_claim"]),
    (Flaw::InFlightAsDuplicate, &["in_flight_answer"]),
    (
        Flaw::TakeoverResetsAttempt,
        &["single_winner_takeover_race", "lease_expiry_takeover"],
    ),
    (
        Flaw::CompletionResetsFirstSeen,
        &["takeover_resets_holder_keeps_record"],
    ),
    (
        Flaw::DoneTakeoverCheckThenWrite,
        &["single_winner_takeover_race"],
    ),
    (Flaw::CompletionGrace, &["lease_is_lost_at_its_deadline"]),
    (
        Flaw::AcceptCheckThenInsert,
        &["inbox_accepts_once", "inbox_accepts_race_claims"],
    ),
    (Flaw::AcceptOverwritesPending, &["inbox_accepts_once"]),
    (
        Flaw::TakeWithoutLeasing,
        &["inbox_one_taker_race", "inbox_fences_stale_workers"],
    ),
    (
        Flaw::TakeoverAttemptNotCounted,
        &["inbox_fences_stale_workers"],
    ),
    (Flaw::ReplayStartsOver, &["inbox_failures_and_replay"]),
    (Flaw::ExpireRemovesItems, &["inbox_items_never_expire"]),
    (Flaw::ListCursorInclusive, &["inbox_list_and_counts"]),
    (Flaw::TakeNewestFirst, &["inbox_takes_oldest_first"]),
    (Flaw::PayloadTruncated64K, &["inbox_accepts_once"]),
    (Flaw::OldestDueIsNewest, &["inbox_list_and_counts"]),
    (Flaw::DeadReturnsLater, &["inbox_failures_and_replay"]),
    (Flaw::TakeIgnoresNamespace, &["inbox_takes_oldest_first"]),
    (Flaw::FailAgainIsLeaseLost, &["inbox_calls_asked_twice"]),
    (
        Flaw::ItemReleaseAgainIsLeaseLost,
        &["inbox_calls_asked_twice"],
    ),
    (Flaw::FailDelayDoubled, &["inbox_failures_and_replay"]),
    (Flaw::ReplayDueLater, &["inbox_failures_and_replay"]),
    (Flaw::ReplayAgainAnswersTrue, &["inbox_failures_and_replay"]),
    (Flaw::ForgetIfIgnoresState, &["inbox_forget_if"]),
    (Flaw::AcceptResetsDead, &["inbox_failures_and_replay"]),
    (Flaw::AcceptLapsedClaimInFlight, &["inbox_accepts_once"]),
    (Flaw::FilteredListIgnoresCursor, &["inbox_list_and_counts"]),
    (
        Flaw::HandBackSpendsAttempt,
        &["inbox_hand_back_is_free", "inbox_calls_asked_twice"],
    ),
    (Flaw::TakeoverNotCounted, &["inbox_takeovers_are_counted"]),
    (Flaw::NotBeforeIgnored, &["inbox_accept_options"]),
    (Flaw::ItemLimitDropped, &["inbox_accept_options"]),
    (Flaw::CompletedStillListed, &["inbox_list_and_counts"]),
    (Flaw::SnoozeSpendsAttempt, &["inbox_snooze"]),
    (Flaw::SnoozeIgnoresDelay, &["inbox_snooze"]),
    (Flaw::AcceptedAtIsTakeTime, &["inbox_snooze"]),
    (Flaw::PauseIgnored, &["inbox_pause"]),
    (Flaw::PauseEveryNamespace, &["inbox_pause"]),
    (Flaw::PauseLosesAccepts, &["inbox_pause"]),
    (Flaw::PauseTakesOverLapsed, &["inbox_pause"]),
    (Flaw::PauseAnswersChanged, &["inbox_pause"]),
    (Flaw::WakeNeverRaised, &["inbox_wake"]),
    (Flaw::WakeOnAcceptOnly, &["inbox_wake"]),
    (Flaw::WakeOneNamespace, &["inbox_wake"]),
    (Flaw::OrderIgnored, &["inbox_ordering"]),
    (Flaw::DeadAlwaysSkipped, &["inbox_ordering"]),
    (Flaw::OrderKeysCountBlocked, &["inbox_ordering"]),
    (Flaw::ForgetKeepsKeyHeld, &["inbox_ordering"]),
    (Flaw::DeadKeptForever, &["inbox_dead_retention"]),
    (Flaw::DeadExpiresAtOnce, &["inbox_dead_retention"]),
    (Flaw::ReplayKeepsDeadRetention, &["inbox_dead_retention"]),
    (Flaw::HistoryKeepsFirst, &["inbox_error_history"]),
    (Flaw::HistoryCountsReleases, &["inbox_error_history"]),
    (Flaw::HistoryOnlyLast, &["inbox_error_history"]),
];

async fn assert_rejected(flaw: Flaw) {
    let expected = EXPECTED
        .iter()
        .find(|(f, _)| *f == flaw)
        .map(|(_, checks)| *checks)
        .unwrap_or_else(|| panic!("{flaw:?} has no expectations"));
    for check in expected {
        let verdict = run_check(&BrokenFactory(flaw), check).await;
        assert!(
            verdict.is_err(),
            "{check} did not catch {flaw:?}: {verdict:?}"
        );
    }
}

macro_rules! broken_store_tests {
    ($($test:ident => $flaw:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $test() {
                assert_rejected(Flaw::$flaw).await;
            }
        )*

        /// A flaw with expectations but no test would prove nothing.
        #[test]
        fn every_flaw_has_a_test() {
            let tested = [$(Flaw::$flaw),*];
            for (flaw, _) in EXPECTED {
                assert!(tested.contains(flaw), "{flaw:?} has no test");
            }
        }
    };
}

broken_store_tests!(
    rejects_check_then_write => CheckThenWrite,
    rejects_release_ignoring_token => ReleaseIgnoresToken,
    rejects_complete_ignoring_token => CompleteIgnoresToken,
    rejects_extend_ignoring_token => ExtendIgnoresToken,
    rejects_expiry_by_deletion_only => ExpiryByDeletionOnly,
    rejects_claim_many_ignoring_batch_duplicates => ClaimManyIgnoresBatchDuplicates,
    rejects_truncated_outcome => TruncatesOutcome,
    rejects_ignored_fingerprint => IgnoresFingerprint,
    rejects_ignored_claim_id => IgnoresClaimId,
    rejects_namespace_blind_keys => NamespaceBlind,
    rejects_case_insensitive_keys => CaseInsensitive,
    rejects_expire_removing_live_records => ExpireRemovesLive,
    rejects_release_keeping_record => ReleaseKeepsRecord,
    rejects_extend_that_forgets => ExtendForgets,
    rejects_forget_answering_false => ForgetAnswersFalse,
    rejects_unenforced_outcome_limit => NoOutcomeLimit,
    rejects_hash_collisions => HashCollisions,
    rejects_unbounded_batches => UnboundedBatches,
    rejects_deadline_ignoring_ttl => DeadlineIgnoresTtl,
    rejects_in_flight_as_duplicate => InFlightAsDuplicate,
    rejects_takeover_resetting_attempt => TakeoverResetsAttempt,
    rejects_completion_resetting_first_seen => CompletionResetsFirstSeen,
    rejects_done_takeover_by_check_then_write => DoneTakeoverCheckThenWrite,
    rejects_completion_grace => CompletionGrace,
    rejects_accept_check_then_insert => AcceptCheckThenInsert,
    rejects_accept_overwriting_a_pending_item => AcceptOverwritesPending,
    rejects_take_without_leasing => TakeWithoutLeasing,
    rejects_takeover_attempt_not_counted => TakeoverAttemptNotCounted,
    rejects_replay_starting_over => ReplayStartsOver,
    rejects_expire_removing_items => ExpireRemovesItems,
    rejects_list_cursor_inclusive => ListCursorInclusive,
    rejects_take_newest_first => TakeNewestFirst,
    rejects_payload_truncated_at_64k => PayloadTruncated64K,
    rejects_oldest_due_as_the_newest => OldestDueIsNewest,
    rejects_dead_items_taken_later => DeadReturnsLater,
    rejects_take_ignoring_the_namespace => TakeIgnoresNamespace,
    rejects_a_fail_asked_again_answering_lease_lost => FailAgainIsLeaseLost,
    rejects_an_item_release_asked_again_answering_lease_lost => ItemReleaseAgainIsLeaseLost,
    rejects_fail_delay_doubled => FailDelayDoubled,
    rejects_replay_due_later => ReplayDueLater,
    rejects_a_second_replay_answering_true => ReplayAgainAnswersTrue,
    rejects_forget_if_ignoring_the_state_seen => ForgetIfIgnoresState,
    rejects_accept_resetting_a_dead_item => AcceptResetsDead,
    rejects_accept_of_a_lapsed_claim_answering_in_flight => AcceptLapsedClaimInFlight,
    rejects_filtered_list_ignoring_the_cursor => FilteredListIgnoresCursor,
    rejects_completed_items_still_listed => CompletedStillListed,
    rejects_snooze_spending_an_attempt => SnoozeSpendsAttempt,
    rejects_snooze_ignoring_its_delay => SnoozeIgnoresDelay,
    rejects_take_time_as_accept_time => AcceptedAtIsTakeTime,
    rejects_a_pause_that_never_reaches_the_takes => PauseIgnored,
    rejects_a_pause_of_every_namespace => PauseEveryNamespace,
    rejects_accepts_lost_while_paused => PauseLosesAccepts,
    rejects_takeovers_while_paused => PauseTakesOverLapsed,
    rejects_pause_and_resume_always_changing => PauseAnswersChanged,
    rejects_a_wake_up_never_raised => WakeNeverRaised,
    rejects_wake_ups_on_accepts_only => WakeOnAcceptOnly,
    rejects_one_wake_up_for_every_namespace => WakeOneNamespace,
    rejects_ordering_keys_ignored => OrderIgnored,
    rejects_dead_items_always_skipped => DeadAlwaysSkipped,
    rejects_blocked_ordering_keys_counted_against_a_take => OrderKeysCountBlocked,
    rejects_a_forget_that_keeps_the_key_held => ForgetKeepsKeyHeld,
    rejects_dead_items_kept_forever => DeadKeptForever,
    rejects_dead_items_expired_at_once => DeadExpiresAtOnce,
    rejects_a_replay_keeping_the_dead_retention => ReplayKeepsDeadRetention,
    rejects_a_history_of_the_first_failures => HistoryKeepsFirst,
    rejects_hand_backs_in_the_history => HistoryCountsReleases,
    rejects_a_history_of_the_last_failure_only => HistoryOnlyLast,
    rejects_a_hand_back_spending_an_attempt => HandBackSpendsAttempt,
    rejects_takeovers_not_counted => TakeoverNotCounted,
    rejects_not_before_ignored => NotBeforeIgnored,
    rejects_the_item_limit_dropped => ItemLimitDropped,
);

/// Which checks each independently written broken store must trip: the check
/// that states the rule it breaks (others may fail too).
const EXPECTED_INDEPENDENT: &[(AFlaw, &[&str])] = &[
    (
        AFlaw::TakeoverKeepsClaimId,
        &["takeover_resets_holder_keeps_record"],
    ),
    (
        AFlaw::TakeoverKeepsFingerprint,
        &["takeover_resets_holder_keeps_record"],
    ),
    (
        AFlaw::TakeoverResetsAttempts,
        &[
            "lease_expiry_takeover",
            "takeover_resets_holder_keeps_record",
        ],
    ),
    (
        AFlaw::TakeoverResetsFirstSeen,
        &["takeover_resets_holder_keeps_record"],
    ),
    (AFlaw::TakeoverReturnsOldAttempt, &["lease_expiry_takeover"]),
    (
        AFlaw::DoneExpiryCountsAsTakeover,
        &["takeover_resets_holder_keeps_record"],
    ),
    (
        AFlaw::TakeoverKeepsDoneState,
        &[
            "takeover_resets_holder_keeps_record",
            "claim_many_matches_reference_claims",
        ],
    ),
    (
        AFlaw::CompleteIgnoresDeadline,
        &["passed_lease_is_lost", "lease_rules_across_handles"],
    ),
    (AFlaw::ExtendIgnoresDeadline, &["passed_lease_is_lost"]),
    (
        AFlaw::CompleteTwiceOverwrites,
        &["duplicate_returns_exact_outcome", "release_then_reclaim"],
    ),
    (AFlaw::ReleaseRemovesDone, &["release_then_reclaim"]),
    (AFlaw::ExtendShortensDone, &["extend_pushes_deadline"]),
    (
        AFlaw::GetIgnoresExpiry,
        &["passed_lease_is_lost", "lease_rules_across_handles"],
    ),
    (AFlaw::GetSlidesExpiry, &["deadlines_are_exact"]),
    (AFlaw::ForgetCountsExpired, &["passed_lease_is_lost"]),
    (AFlaw::ClaimIgnoresLogicalExpiry, &["passed_lease_is_lost"]),
    (
        AFlaw::ExpireJudgesDoneByLease,
        &["expire_spares_done_past_its_lease"],
    ),
    (
        AFlaw::RetentionFromFirstSeen,
        &["retention_counts_from_completion"],
    ),
    (
        AFlaw::DuplicateCompletedAtNow,
        &["retention_counts_from_completion"],
    ),
    (AFlaw::DeadlineInSeconds, &["deadlines_are_exact"]),
    (AFlaw::LeaseDeadlineUnrounded, &["deadlines_are_exact"]),
    (
        AFlaw::CompleteSkipsRetentionCheck,
        &[
            "bad_input_rejected_nothing_written",
            "durations_at_their_limits",
        ],
    ),
    (AFlaw::ExtendFromOldDeadline, &["deadlines_are_exact"]),
    (AFlaw::ReentrantRefreshesDeadline, &["deadlines_are_exact"]),
    (AFlaw::AttemptsCountLosingClaims, &["in_flight_answer"]),
    (AFlaw::InFlightDeadlineIsCallerTtl, &["deadlines_are_exact"]),
    (AFlaw::OutcomeTruncated64K, &["outcomes_up_to_the_limit"]),
    (AFlaw::ClaimIdTruncated, &["claim_ids_compare_whole"]),
    (
        AFlaw::KeyJoinedWithUnderscore,
        &["encoded_keys_stay_distinct"],
    ),
    (
        AFlaw::IdTrailingSpaceInsensitive,
        &["encoded_keys_stay_distinct"],
    ),
    (AFlaw::IdCaseInsensitive, &["encoded_keys_stay_distinct"]),
    (AFlaw::IdTruncated255, &["encoded_keys_stay_distinct"]),
    (AFlaw::ClaimCheckThenInsert, &["single_winner_race"]),
    (
        AFlaw::TakeoverCheckThenWrite,
        &["single_winner_takeover_race"],
    ),
    (
        AFlaw::ReleaseCheckThenDelete,
        &["stale_holders_race_takeovers"],
    ),
    (
        AFlaw::CompleteCheckThenWrite,
        &["stale_holders_race_takeovers"],
    ),
    (
        AFlaw::ClaimManyRepeatClonesFirst,
        &["claim_many_matches_claim", "batches_race_batches"],
    ),
    (AFlaw::ClaimManySnapshot, &["claim_many_matches_claim"]),
    (
        AFlaw::ClaimManyDropsFingerprint,
        &["claim_many_matches_claim"],
    ),
    (AFlaw::FingerprintOnlyOnDone, &["fingerprint_mismatch"]),
    (AFlaw::MismatchLosesToClaimId, &["fingerprint_mismatch"]),
    (
        AFlaw::FingerprintOneSidedMismatch,
        &["fingerprint_mismatch"],
    ),
    (AFlaw::FailOpenClaim, &["errors_are_not_answers"]),
    (
        AFlaw::CompleteSwallowsWriteError,
        &["errors_are_not_answers"],
    ),
    // The second adversary's.
    (
        AFlaw::ReleaseIgnoresDeadline,
        &["passed_lease_is_lost", "lease_is_lost_at_its_deadline"],
    ),
    (AFlaw::ExtendNeverShortens, &["deadlines_are_exact"]),
    (
        AFlaw::ExtendCheckThenWrite,
        &["stale_holders_race_takeovers"],
    ),
    (AFlaw::ExpireScanThenDelete, &["expire_races_takeovers"]),
    (
        AFlaw::ExpireCountsOnlyLastStatement,
        &["expire_removes_exactly_expired"],
    ),
    (AFlaw::ReentrantOnDoneRecord, &["reentrant_claim_id"]),
    (
        AFlaw::MismatchOnExpiredRecord,
        &[
            "passed_lease_is_lost",
            "takeover_resets_holder_keeps_record",
        ],
    ),
    (AFlaw::InFlightAttemptOne, &["lease_expiry_takeover"]),
    (
        AFlaw::EmptyOutcomeDropped,
        &["duplicate_returns_exact_outcome"],
    ),
    (
        AFlaw::OutcomeLimitOffByOne,
        &[
            "outcomes_up_to_the_limit",
            "bad_input_rejected_nothing_written",
        ],
    ),
    (AFlaw::ClaimManyDedupByIdOnly, &["namespaces_isolate"]),
    (AFlaw::IdLatin1Column, &["encoded_keys_stay_distinct"]),
    // Requests asked twice (rule 10).
    (
        AFlaw::ResentClaimAnswersInFlight,
        &["resent_requests_answer_as_the_first"],
    ),
    (
        AFlaw::CompleteAgainIsLeaseLost,
        &[
            "release_then_reclaim",
            "resent_requests_answer_as_the_first",
        ],
    ),
    (
        AFlaw::ReleaseAgainIsLeaseLost,
        &[
            "release_then_reclaim",
            "passed_lease_is_lost",
            "resent_requests_answer_as_the_first",
        ],
    ),
    (
        AFlaw::ForgetUnfenced,
        &["resent_requests_answer_as_the_first"],
    ),
    // The third adversary's: the first eleven here passed the whole suite
    // before the checks named beside them were sharpened or added.
    (
        AFlaw::CompleteAgainRetentionFromCompletedAt,
        &["release_then_reclaim"],
    ),
    (AFlaw::CompleteAgainIgnoresExpiry, &["retention_expiry"]),
    (
        AFlaw::CompleteAgainComparesPrefix64,
        &["release_then_reclaim"],
    ),
    (AFlaw::ForgetReadThenDelete, &["forget_races_claims"]),
    (AFlaw::ReleaseTombstone, &["release_then_reclaim"]),
    (AFlaw::ForgetTombstone, &["forget_removes_any_state"]),
    (
        AFlaw::ResentClaimAttemptOne,
        &["resent_requests_answer_as_the_first"],
    ),
    (
        AFlaw::ResentClaimFreshDeadline,
        &["resent_requests_answer_as_the_first"],
    ),
    (
        AFlaw::TokenPinnedAfterResend,
        &["resent_requests_answer_as_the_first"],
    ),
    (
        AFlaw::ExtendInclusiveDeadline,
        &["lease_is_lost_at_its_deadline"],
    ),
    (
        AFlaw::CompleteInclusiveDeadline,
        &["lease_is_lost_at_its_deadline"],
    ),
    (
        AFlaw::CompleteAgainOtherOutcomeOk,
        &["duplicate_returns_exact_outcome", "release_then_reclaim"],
    ),
    (AFlaw::CompleteAgainRewritesTimes, &["release_then_reclaim"]),
    (
        AFlaw::CompleteAgainComparesLength,
        &["release_then_reclaim"],
    ),
    (
        AFlaw::CompleteOkForOtherTokenSameOutcome,
        &["matches_reference_store"],
    ),
    (
        AFlaw::ReleaseExpiredDeletes,
        &["passed_lease_is_lost", "lease_is_lost_at_its_deadline"],
    ),
    (AFlaw::ReleaseDoneOk, &["release_then_reclaim"]),
    (AFlaw::ReleaseOtherDoneOk, &["release_then_reclaim"]),
    (AFlaw::FenceByTokenAndDeadline, &["matches_reference_store"]),
    (
        AFlaw::ExtendGrace100ms,
        &["stale_holder_is_fenced", "lease_is_lost_at_its_deadline"],
    ),
    (AFlaw::AuthorizeByClaimId, &["reentrant_claim_id"]),
];

async fn assert_independent_rejected(flaw: AFlaw) {
    let expected = EXPECTED_INDEPENDENT
        .iter()
        .find(|(f, _)| *f == flaw)
        .map(|(_, checks)| *checks)
        .unwrap_or_else(|| panic!("{flaw:?} has no expectations"));
    for check in expected {
        let verdict = run_check(&FlawedFactory(Some(flaw)), check).await;
        assert!(
            verdict.is_err(),
            "{check} did not catch {flaw:?}: {verdict:?}"
        );
    }
}

macro_rules! independent_flaw_tests {
    ($($test:ident => $flaw:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $test() {
                assert_independent_rejected(AFlaw::$flaw).await;
            }
        )*

        #[test]
        fn every_independent_flaw_has_a_test() {
            let tested = [$(AFlaw::$flaw),*];
            for flaw in all_flaws() {
                assert!(tested.contains(&flaw), "{flaw:?} has no test");
            }
        }
    };
}

independent_flaw_tests!(
    rejects_takeover_keeping_claim_id => TakeoverKeepsClaimId,
    rejects_takeover_keeping_fingerprint => TakeoverKeepsFingerprint,
    rejects_takeover_resetting_attempts => TakeoverResetsAttempts,
    rejects_takeover_resetting_first_seen => TakeoverResetsFirstSeen,
    rejects_takeover_returning_old_attempt => TakeoverReturnsOldAttempt,
    rejects_done_expiry_counted_as_takeover => DoneExpiryCountsAsTakeover,
    rejects_takeover_keeping_done_state => TakeoverKeepsDoneState,
    rejects_complete_ignoring_deadline => CompleteIgnoresDeadline,
    rejects_extend_ignoring_deadline => ExtendIgnoresDeadline,
    rejects_complete_twice_overwriting => CompleteTwiceOverwrites,
    rejects_release_removing_done => ReleaseRemovesDone,
    rejects_extend_shortening_done => ExtendShortensDone,
    rejects_get_ignoring_expiry => GetIgnoresExpiry,
    rejects_get_sliding_expiry => GetSlidesExpiry,
    rejects_forget_counting_expired => ForgetCountsExpired,
    rejects_claim_ignoring_logical_expiry => ClaimIgnoresLogicalExpiry,
    rejects_expire_judging_done_by_lease => ExpireJudgesDoneByLease,
    rejects_retention_from_first_seen => RetentionFromFirstSeen,
    rejects_duplicate_completed_at_now => DuplicateCompletedAtNow,
    rejects_deadline_in_seconds => DeadlineInSeconds,
    rejects_lease_deadline_unrounded => LeaseDeadlineUnrounded,
    rejects_complete_skipping_retention_check => CompleteSkipsRetentionCheck,
    rejects_extend_from_old_deadline => ExtendFromOldDeadline,
    rejects_reentrant_refreshing_deadline => ReentrantRefreshesDeadline,
    rejects_attempts_counting_losing_claims => AttemptsCountLosingClaims,
    rejects_in_flight_deadline_from_caller_ttl => InFlightDeadlineIsCallerTtl,
    rejects_outcome_truncated_at_64k => OutcomeTruncated64K,
    rejects_claim_id_truncated => ClaimIdTruncated,
    rejects_key_joined_with_underscore => KeyJoinedWithUnderscore,
    rejects_id_trailing_space_insensitive => IdTrailingSpaceInsensitive,
    rejects_id_case_insensitive => IdCaseInsensitive,
    rejects_id_truncated_at_255 => IdTruncated255,
    rejects_claim_check_then_insert => ClaimCheckThenInsert,
    rejects_takeover_check_then_write => TakeoverCheckThenWrite,
    rejects_release_check_then_delete => ReleaseCheckThenDelete,
    rejects_complete_check_then_write => CompleteCheckThenWrite,
    rejects_claim_many_repeat_cloning_first => ClaimManyRepeatClonesFirst,
    rejects_claim_many_snapshot => ClaimManySnapshot,
    rejects_claim_many_dropping_fingerprint => ClaimManyDropsFingerprint,
    rejects_fingerprint_only_on_done => FingerprintOnlyOnDone,
    rejects_mismatch_losing_to_claim_id => MismatchLosesToClaimId,
    rejects_one_sided_fingerprint_mismatch => FingerprintOneSidedMismatch,
    rejects_fail_open_claim => FailOpenClaim,
    rejects_complete_swallowing_write_error => CompleteSwallowsWriteError,
    rejects_release_ignoring_deadline => ReleaseIgnoresDeadline,
    rejects_extend_that_never_shortens => ExtendNeverShortens,
    rejects_extend_check_then_write => ExtendCheckThenWrite,
    rejects_expire_scan_then_delete => ExpireScanThenDelete,
    rejects_expire_counting_only_the_last_statement => ExpireCountsOnlyLastStatement,
    rejects_reentrant_claim_on_a_done_record => ReentrantOnDoneRecord,
    rejects_mismatch_on_an_expired_record => MismatchOnExpiredRecord,
    rejects_in_flight_attempt_always_one => InFlightAttemptOne,
    rejects_empty_outcome_dropped => EmptyOutcomeDropped,
    rejects_outcome_limit_off_by_one => OutcomeLimitOffByOne,
    rejects_claim_many_dedup_by_id_only => ClaimManyDedupByIdOnly,
    rejects_id_stored_as_latin1 => IdLatin1Column,
    rejects_a_resent_claim_answering_in_flight => ResentClaimAnswersInFlight,
    rejects_a_complete_asked_again_answering_lease_lost => CompleteAgainIsLeaseLost,
    rejects_a_release_asked_again_answering_lease_lost => ReleaseAgainIsLeaseLost,
    rejects_an_unfenced_forget => ForgetUnfenced,
    rejects_complete_again_retention_from_completed_at => CompleteAgainRetentionFromCompletedAt,
    rejects_complete_again_ignoring_expiry => CompleteAgainIgnoresExpiry,
    rejects_complete_again_comparing_a_prefix => CompleteAgainComparesPrefix64,
    rejects_forget_read_then_delete => ForgetReadThenDelete,
    rejects_release_leaving_a_tombstone => ReleaseTombstone,
    rejects_forget_leaving_a_tombstone => ForgetTombstone,
    rejects_resent_claim_answering_attempt_one => ResentClaimAttemptOne,
    rejects_resent_claim_answering_a_fresh_deadline => ResentClaimFreshDeadline,
    rejects_token_pinned_after_a_resend => TokenPinnedAfterResend,
    rejects_extend_inclusive_deadline => ExtendInclusiveDeadline,
    rejects_complete_inclusive_deadline => CompleteInclusiveDeadline,
    rejects_complete_again_with_another_outcome_ok => CompleteAgainOtherOutcomeOk,
    rejects_complete_again_rewriting_times => CompleteAgainRewritesTimes,
    rejects_complete_again_comparing_lengths => CompleteAgainComparesLength,
    rejects_complete_ok_for_another_token => CompleteOkForOtherTokenSameOutcome,
    rejects_release_deleting_an_expired_record => ReleaseExpiredDeletes,
    rejects_release_of_done_ok => ReleaseDoneOk,
    rejects_release_of_another_done_ok => ReleaseOtherDoneOk,
    rejects_fencing_by_token_and_deadline => FenceByTokenAndDeadline,
    rejects_extend_with_grace => ExtendGrace100ms,
    rejects_authorizing_by_claim_id => AuthorizeByClaimId,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_independent_store_without_a_flaw_passes_everything() {
    let report = run_all(&FlawedFactory(None)).await;
    assert!(report.all_passed(), "{report}");
    // It offers no inbox: those checks, and only those, are skipped.
    let skipped: Vec<&str> = report.skipped().map(|(name, _)| name).collect();
    assert!(
        !skipped.is_empty() && skipped.iter().all(|name| name.starts_with("inbox_")),
        "{report}"
    );
}

#[test]
fn every_check_is_tripped_by_some_broken_store() {
    let tripped: HashSet<&str> = EXPECTED
        .iter()
        .map(|(_, checks)| *checks)
        .chain(EXPECTED_INDEPENDENT.iter().map(|(_, checks)| *checks))
        .flat_map(|checks| checks.iter().copied())
        .collect();
    let untested: Vec<&str> = CHECKS
        .iter()
        .map(|c| c.name)
        .filter(|n| !tripped.contains(n))
        .collect();
    assert!(untested.is_empty(), "no broken store trips {untested:?}");
}

/// A store that expires natively (no explicit `expire()`): the expire check is
/// reported as skipped, with the reason, and never counted as passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capability_gaps_are_skipped_visibly() {
    #[derive(Debug, Clone)]
    struct NativeExpiry(MemoryStore);

    // A wrapper forwards every method: one it forgets would silently fall back
    // to the trait's default instead of the wrapped store's.
    #[deny(clippy::missing_trait_methods)]
    #[async_trait]
    impl DedupeStore for NativeExpiry {
        async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
            self.0.claim(key, opts).await
        }
        async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
            self.0.complete(lease, outcome, retention).await
        }
        async fn release(&self, lease: &Lease) -> Result<()> {
            self.0.release(lease).await
        }
        async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
            self.0.extend(lease, ttl).await
        }
        async fn expire(&self) -> Result<u64> {
            Ok(0)
        }
        async fn get(&self, key: &Key) -> Result<Option<Record>> {
            self.0.get(key).await
        }
        async fn forget(&self, key: &Key) -> Result<bool> {
            self.0.forget(key).await
        }
        async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
            self.0.claim_many(keys, opts).await
        }
        fn capabilities(&self) -> Capabilities {
            self.0.capabilities().with_explicit_expire(false)
        }
    }

    struct Factory;
    struct Fix(NativeExpiry);

    #[async_trait]
    impl StoreFactory for Factory {
        async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
            Ok(Box::new(Fix(NativeExpiry(MemoryStore::new()))))
        }
    }

    #[async_trait]
    impl Fixture for Fix {
        fn store(&self) -> Arc<dyn DedupeStore> {
            Arc::new(self.0.clone())
        }
        async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
            Ok(Arc::new(self.0.clone()))
        }
    }

    // The checks that call `expire()`, and the fault check; the Redis store
    // (native expiry, no fault fixture on a Cluster) runs the whole suite.
    let report = run_selected(&Factory, |name| {
        (name.contains("expire") && !name.starts_with("inbox_")) || name == "errors_are_not_answers"
    })
    .await;
    assert_eq!(report.checks.len(), 4, "{report}");
    let skipped: Vec<(&str, &str)> = report.skipped().collect();
    // Its fixture has no way to break a connection either.
    assert_eq!(skipped.len(), 2, "{report}");
    assert_eq!(skipped[0].0, "expire_removes_exactly_expired");
    assert!(skipped[0].1.contains("natively"), "{report}");
    assert_eq!(skipped[1].0, "errors_are_not_answers");
    assert!(report.all_passed(), "{report}");
    let text = report.to_string();
    assert!(
        text.contains("SKIP  expire_removes_exactly_expired"),
        "{text}"
    );
    assert!(text.contains("2 skipped"), "{text}");
}
