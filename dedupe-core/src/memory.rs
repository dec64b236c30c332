//! The in-memory store: the reference implementation of the contract.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::backend::{self, check_accept, check_namespace, check_take, cut_error};
use crate::claim::{check_ttl, ClaimOptions, ClaimOutcome, Lease};
use crate::error::{Error, Result};
use crate::inbox::{
    AcceptOptions, Accepted, Inbox, InboxCounts, Item, ItemPage, ItemQuery, ItemStatus, Retry,
    Taken,
};
use crate::key::{ClaimId, Fingerprint, Key, LeaseToken};
use crate::record::{Record, RecordState};
use crate::store::DedupeStore;

/// What an entry that is an inbox item holds besides a record's fields.
#[derive(Debug, Clone)]
struct ItemEntry {
    payload: Vec<u8>,
    /// Waiting to be taken (`expires_at` is then when it is due), or dead;
    /// neither while a worker holds it.
    wait: Wait,
    last_error: Option<String>,
    /// Takeovers of workers that died holding it.
    takeovers: u32,
    /// Its own attempt limit, set at accept.
    max_attempts: Option<u32>,
    /// Its ordering key, its place in the key's accept order, and what it
    /// does dead (I15).
    ordering: Option<Ordering>,
    /// Dead: when its retention ends and `expire()` removes it (I16);
    /// `None` kept until forgotten.
    dead_until: Option<SystemTime>,
    /// Its last failures, oldest first (I5).
    errors: std::collections::VecDeque<crate::FailedAttempt>,
    /// Parked: held back by its ordering key, out of the due set until an
    /// item of its key leaves the queue and makes it the key's head (I15).
    parked: bool,
    /// Made its key's head: never parked.
    head: bool,
}

#[derive(Debug, Clone)]
struct Ordering {
    key: String,
    seq: u64,
    when_dead: crate::WhenDead,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    Held,
    Due,
    Dead,
}

#[derive(Debug, Clone)]
struct Entry {
    token: LeaseToken,
    claim_id: Option<ClaimId>,
    fingerprint: Option<Fingerprint>,
    /// Lease deadline while in flight, retention deadline once done.
    expires_at: SystemTime,
    /// `Some((completed_at, outcome))` once done.
    done: Option<(SystemTime, Vec<u8>)>,
    attempts: u32,
    first_seen: SystemTime,
    /// An inbox item until it is done.
    item: Option<ItemEntry>,
}

impl Entry {
    /// Live: inside its lease or retention; an inbox item always (until done).
    fn is_live(&self, now: SystemTime) -> bool {
        self.item.is_some() || self.expires_at > now
    }

    /// Gone at `expire()`: a record past its lease or retention, or a dead
    /// item past its own retention (I16).
    fn is_expired(&self, now: SystemTime) -> bool {
        match &self.item {
            None => self.expires_at <= now,
            Some(item) => item.wait == Wait::Dead && item.dead_until.is_some_and(|at| at <= now),
        }
    }

    /// Held by `lease`: its token, in flight, before the deadline (an item:
    /// held by a worker, not waiting).
    fn holds(&self, lease: &Lease, now: SystemTime) -> bool {
        self.done.is_none()
            && self.token == lease.token
            && self.expires_at > now
            && self.item.as_ref().is_none_or(|i| i.wait == Wait::Held)
    }

    /// Where the item stands, if this is an item (nothing copied: `counts`
    /// reads every entry of the map).
    fn item_status(&self) -> Option<ItemStatus> {
        let item = self.item.as_ref()?;
        Some(match (item.wait, &item.last_error) {
            (Wait::Held, _) => ItemStatus::Running,
            (Wait::Dead, _) => ItemStatus::Dead,
            (Wait::Due, None) => ItemStatus::Pending,
            (Wait::Due, Some(_)) => ItemStatus::Failed,
        })
    }

    fn item_view(&self, key: &Key) -> Option<Item> {
        let item = self.item.as_ref()?;
        let status = self.item_status()?;
        Some(
            Item::new(
                key.clone(),
                status,
                self.attempts,
                self.first_seen,
                self.expires_at,
                item.last_error.clone(),
                item.payload.clone(),
            )
            .with_counts(item.takeovers, item.max_attempts)
            .with_ordering_key(item.ordering.as_ref().map(|o| o.key.clone()))
            .with_errors(item.errors.iter().cloned().collect()),
        )
    }

    /// Due to be taken: waiting and its time came, or held past its lease.
    fn is_due(&self, now: SystemTime) -> bool {
        self.item
            .as_ref()
            .is_some_and(|i| i.wait != Wait::Dead && self.expires_at <= now)
    }

    /// An item this lease gave back already: waiting under its token and due
    /// (what its release left; the same release sent again finds this).
    fn given_back_by(&self, lease: &Lease, now: SystemTime) -> bool {
        self.token == lease.token
            && self.expires_at <= now
            && self.item.as_ref().is_some_and(|i| i.wait == Wait::Due)
    }

    /// An item this lease failed already with `error` (cut) and `retry`'s
    /// decision: the same fail sent again finds this.
    fn failed_by(&self, lease: &Lease, error: &str, retry: Retry) -> bool {
        let wait = match retry {
            Retry::After(_) => Wait::Due,
            Retry::Dead { .. } => Wait::Dead,
        };
        self.token == lease.token
            && self
                .item
                .as_ref()
                .is_some_and(|i| i.wait == wait && i.last_error.as_deref() == Some(error))
    }

    fn completed_by(&self, lease: &Lease, outcome: &[u8], now: SystemTime) -> bool {
        self.token == lease.token
            && self.is_live(now)
            && self
                .done
                .as_ref()
                .is_some_and(|(_, o)| o.as_slice() == outcome)
    }

    fn lease(&self, key: &Key) -> Lease {
        Lease {
            key: key.clone(),
            token: self.token.clone(),
            deadline: self.expires_at,
            attempt: self.attempts,
            claim_id: self.claim_id.clone(),
        }
    }

    fn record(&self, key: &Key) -> Record {
        let state = match &self.done {
            None => RecordState::InFlight {
                lease_deadline: self.expires_at,
            },
            Some((completed_at, outcome)) => RecordState::Done {
                completed_at: *completed_at,
                retention_deadline: self.expires_at,
                outcome: outcome.clone(),
            },
        };
        Record::new(
            key.clone(),
            state,
            self.token.clone(),
            self.claim_id.clone(),
            self.fingerprint.clone(),
            // An inbox item never taken shows as attempt 1, as on every store
            // (a record's count starts there).
            if self.item.is_some() {
                self.attempts.max(1)
            } else {
                self.attempts
            },
            self.first_seen,
        )
    }
}

/// A store held in process memory, shared by its clones.
///
/// It is the reference implementation of the contract: every operation takes one
/// mutex, decides and writes under it, so each is atomic. Deadlines use the
/// caller's clock (`SystemTime::now()`); there is only one process, so there is no
/// skew to tolerate. Records do not survive the process: use it for tests, tools
/// and single-process apps that can afford to reprocess after a restart.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key, MemoryStore};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let key = Key::new("stripe", "evt_1")?;
/// let ClaimOutcome::Claimed(lease) = store.claim(&key, &ClaimOptions::default()).await? else {
///     panic!("a fresh key is always claimed");
/// };
/// store.complete(&lease, b"charged", Duration::from_secs(3600)).await?;
/// match store.claim(&key, &ClaimOptions::default()).await? {
///     ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"charged"),
///     other => panic!("expected a duplicate, got {other:?}"),
/// }
/// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    records: Arc<Mutex<Records>>,
    /// Raised when an item becomes due now (accepted, given back, replayed,
    /// its namespace resumed), for the workers of this process.
    wakeups: crate::backend::Wakeups,
}

/// The entries, and per namespace the inbox items a take may hand out
/// (pending, failed, running) ordered by due time: a take reads the front of
/// its namespace's set, not every record. Every change of an entry goes
/// through [`Records::change`], [`Records::insert`] or [`Records::remove`],
/// which keep the set in step.
#[derive(Debug, Default)]
struct Records {
    map: HashMap<Key, Entry>,
    due: HashMap<String, BTreeSet<(SystemTime, String)>>,
    /// The paused namespaces: their takes hand out nothing.
    paused: HashSet<String>,
    /// Per namespace and ordering key, the items that have one, by accept
    /// order (I15).
    orders: HashMap<(String, String), BTreeMap<u64, String>>,
    /// Per namespace and ordering key, how many of its items a worker holds.
    held: HashMap<(String, String), usize>,
    /// The accept order's next number.
    next_seq: u64,
}

impl Records {
    /// Where the entry stands in its namespace's set, if it is in it.
    fn slot(entry: &Entry) -> Option<SystemTime> {
        entry
            .item
            .as_ref()
            .filter(|i| i.wait != Wait::Dead && !i.parked)
            .map(|_| entry.expires_at)
    }

    /// The ordering key of an item in its key's queue (waiting, held, or
    /// dead and blocking), if it has one.
    fn queued_order(entry: &Entry) -> Option<String> {
        let item = entry.item.as_ref()?;
        let order = item.ordering.as_ref()?;
        let skipped = item.wait == Wait::Dead && order.when_dead == crate::WhenDead::Skip;
        (!skipped).then(|| order.key.clone())
    }

    /// Makes the first waiting item of ordering key `order` in `namespace`
    /// the key's head, unparked: an item of the key left its queue.
    fn promote(&mut self, namespace: &str, order: String) {
        let at = (namespace.to_string(), order);
        let Some(next) = self.orders.get(&at).and_then(|items| {
            items.values().find_map(|id| {
                let key = Key::new(namespace, id.as_str()).ok()?;
                let waiting = self
                    .map
                    .get(&key)
                    .and_then(|e| e.item.as_ref())
                    .is_some_and(|i| i.wait == Wait::Due);
                waiting.then_some(key)
            })
        }) else {
            return;
        };
        self.unindex(&next);
        if let Some(item) = self.map.get_mut(&next).and_then(|e| e.item.as_mut()) {
            item.parked = false;
            item.head = true;
        }
        self.index(&next);
    }

    /// An item's ordering key, its number, and whether a worker holds it.
    fn ordering_of(entry: &Entry) -> Option<(String, u64, bool)> {
        let item = entry.item.as_ref()?;
        item.ordering
            .as_ref()
            .map(|o| (o.key.clone(), o.seq, item.wait == Wait::Held))
    }

    fn unindex(&mut self, key: &Key) {
        if let Some((order, seq, held)) = self.map.get(key).and_then(Self::ordering_of) {
            let at = (key.namespace().to_string(), order);
            if held {
                if let Some(n) = self.held.get_mut(&at) {
                    *n -= 1;
                    if *n == 0 {
                        self.held.remove(&at);
                    }
                }
            }
            if let Some(items) = self.orders.get_mut(&at) {
                items.remove(&seq);
                if items.is_empty() {
                    self.orders.remove(&at);
                }
            }
        }
        let Some(at) = self.map.get(key).and_then(Self::slot) else {
            return;
        };
        if let Some(set) = self.due.get_mut(key.namespace()) {
            set.remove(&(at, key.id().to_string()));
            if set.is_empty() {
                self.due.remove(key.namespace());
            }
        }
    }

    fn index(&mut self, key: &Key) {
        if let Some((order, seq, held)) = self.map.get(key).and_then(Self::ordering_of) {
            let at = (key.namespace().to_string(), order);
            if held {
                *self.held.entry(at.clone()).or_default() += 1;
            }
            self.orders
                .entry(at)
                .or_default()
                .insert(seq, key.id().to_string());
        }
        if let Some(at) = self.map.get(key).and_then(Self::slot) {
            self.due
                .entry(key.namespace().to_string())
                .or_default()
                .insert((at, key.id().to_string()));
        }
    }

    /// Changes the entry of `key` (if any) with `f`. An item that leaves
    /// its ordering key's queue so (done, dead and skipped) moves the key
    /// on.
    fn change<R>(&mut self, key: &Key, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
        let before = self.map.get(key).and_then(Self::queued_order);
        self.unindex(key);
        let result = self.map.get_mut(key).map(f);
        self.index(key);
        let after = self.map.get(key).and_then(Self::queued_order);
        if let (Some(order), None) = (before, after) {
            self.promote(key.namespace(), order);
        }
        result
    }

    fn insert(&mut self, key: Key, entry: Entry) {
        let before = self.map.get(&key).and_then(Self::queued_order);
        self.unindex(&key);
        self.map.insert(key.clone(), entry);
        self.index(&key);
        if let Some(order) = before {
            self.promote(key.namespace(), order);
        }
    }

    /// Removes the entry of `key`; an item of an ordering key leaves its
    /// queue and moves the key on.
    fn remove(&mut self, key: &Key) -> Option<Entry> {
        self.unindex(key);
        let removed = self.map.remove(key);
        if let Some(order) = removed.as_ref().and_then(Self::queued_order) {
            self.promote(key.namespace(), order);
        }
        removed
    }

    /// Whether an item of an ordering key is held back (I15): another item
    /// of its key is held, or an earlier one waits (pending, failed), or is
    /// dead and blocks.
    fn held_back(&self, key: &Key) -> bool {
        let Some(entry) = self.map.get(key) else {
            return false;
        };
        let Some((order, seq, held)) = Self::ordering_of(entry) else {
            return false;
        };
        let at = (key.namespace().to_string(), order);
        // Another item of the key held (a held item itself is a takeover).
        if self.held.get(&at).copied().unwrap_or(0) > usize::from(held) {
            return true;
        }
        // Held itself, past its lease: the takeover comes first, whatever
        // waits before it (an earlier item replayed while it ran).
        if held {
            return false;
        }
        let Some(items) = self.orders.get(&at) else {
            return false;
        };
        // An earlier item waiting, or dead and blocking; the first earlier
        // item usually settles it.
        items.range(..seq).any(|(_, id)| {
            let Some(other) = Key::new(key.namespace(), id.as_str())
                .ok()
                .and_then(|k| self.map.get(&k))
                .and_then(|e| e.item.as_ref())
            else {
                return false;
            };
            match other.wait {
                Wait::Held | Wait::Due => true,
                Wait::Dead => other
                    .ordering
                    .as_ref()
                    .is_none_or(|o| o.when_dead == crate::WhenDead::Block),
            }
        })
    }

    /// The keys of `namespace`'s items due by `now`, oldest first, at most `max`.
    fn due_by(&self, namespace: &str, now: SystemTime, max: usize) -> Vec<Key> {
        self.due
            .get(namespace)
            .into_iter()
            .flatten()
            .take_while(|(at, _)| *at <= now)
            .take(max)
            .filter_map(|(_, id)| Key::new(namespace, id).ok())
            .collect()
    }
}

impl Records {
    /// Leases the item of `key` if it is due (I10: a takeover is counted).
    fn lease_due(&mut self, key: &Key, now: SystemTime, lease: Duration) -> Option<Taken> {
        self.change(key, |entry| {
            if !entry.is_due(now) {
                return None;
            }
            let item = entry.item.as_mut()?;
            if item.wait == Wait::Held {
                // Its worker's lease passed: a takeover (I10).
                item.takeovers = item.takeovers.saturating_add(1);
            }
            item.wait = Wait::Held;
            let (payload, last_error) = (item.payload.clone(), item.last_error.clone());
            let counts = (item.takeovers, item.max_attempts);
            let ordering_key = item.ordering.as_ref().map(|o| o.key.clone());
            let accepted_at = entry.first_seen;
            entry.token = LeaseToken::generate();
            entry.expires_at = now + lease;
            entry.attempts = entry.attempts.saturating_add(1);
            Some(
                Taken::new(entry.lease(key), payload, last_error, accepted_at)
                    .with_counts(counts.0, counts.1)
                    .with_ordering_key(ordering_key),
            )
        })
        .flatten()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of records held, live or expired-but-not-removed.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.lock().map.is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // No operation panics while holding the lock, so a poisoned map is intact.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn claim_locked(
        map: &mut Records,
        key: &Key,
        opts: &ClaimOptions,
        now: SystemTime,
    ) -> ClaimOutcome {
        let previous = match map.map.get(key) {
            Some(entry) if entry.is_live(now) => {
                return backend::losing_claim(entry.record(key), opts)
            }
            other => other,
        };
        // Absent or expired: this claim wins. Taking over an expired in-flight record
        // counts one more attempt; an expired done record starts over.
        let (attempts, first_seen) = match previous {
            Some(old) if old.done.is_none() => (old.attempts.saturating_add(1), old.first_seen),
            _ => (1, now),
        };
        let entry = Entry {
            token: LeaseToken::generate(),
            claim_id: opts.claim_id.clone(),
            fingerprint: opts.fingerprint.clone(),
            expires_at: now + opts.lease_ttl,
            done: None,
            attempts,
            first_seen,
            item: None,
        };
        let lease = entry.lease(key);
        map.insert(key.clone(), entry);
        ClaimOutcome::Claimed(lease)
    }
}

#[async_trait]
impl DedupeStore for MemoryStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        let now = SystemTime::now();
        Ok(Self::claim_locked(&mut self.lock(), key, opts, now))
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.capabilities().check_outcome(outcome)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        match map.map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                map.change(&lease.key, |entry| {
                    entry.done = Some((now, outcome.to_vec()));
                    entry.expires_at = now + retention;
                    entry.item = None;
                });
                Ok(())
            }
            // This lease already stored this outcome (a retried complete).
            Some(entry) if entry.completed_by(lease, outcome, now) => Ok(()),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let now = SystemTime::now();
        let mut map = self.lock();
        match map.map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                if entry.item.is_some() {
                    // An item is given back, due now, the attempt its take
                    // counted taken back (I5).
                    map.change(&lease.key, |entry| {
                        if let Some(item) = entry.item.as_mut() {
                            item.wait = Wait::Due;
                        }
                        entry.expires_at = now;
                        entry.attempts = entry.attempts.saturating_sub(1);
                    });
                    drop(map);
                    self.wakeups.raise(lease.key.namespace());
                } else {
                    map.remove(&lease.key);
                }
                Ok(())
            }
            // Given back by this very release, sent again.
            Some(entry) if entry.given_back_by(lease, now) => Ok(()),
            // Held by another lease, or done.
            Some(entry) if entry.is_live(now) => Err(Error::lease_lost(&lease.key)),
            // Nothing live holds the key: what release asks for (a retried
            // release lands here). An expired record stays, for its attempts.
            _ => Ok(()),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        match map.map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) => Ok(map
                .change(&lease.key, |entry| {
                    entry.expires_at = now + ttl;
                    entry.lease(&lease.key)
                })
                .unwrap_or_else(|| lease.clone())),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn expire(&self) -> Result<u64> {
        let now = SystemTime::now();
        let mut map = self.lock();
        let gone: Vec<Key> = map
            .map
            .iter()
            .filter(|(_, entry)| entry.is_expired(now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in &gone {
            map.remove(key);
        }
        Ok(gone.len() as u64)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = SystemTime::now();
        Ok(self
            .lock()
            .map
            .get(key)
            .filter(|entry| entry.is_live(now))
            .map(|entry| entry.record(key)))
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let now = SystemTime::now();
        Ok(self
            .lock()
            .remove(key)
            .is_some_and(|entry| entry.is_live(now)))
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        crate::backend::check_batch(keys)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        Ok(keys
            .iter()
            .map(|key| Self::claim_locked(&mut map, key, opts, now))
            .collect())
    }
}

/// The inbox on the same map: an item is an entry with a payload, waiting
/// (`expires_at` is when it is due), held by a worker (`expires_at` is its
/// lease's deadline) or dead, until a completion makes it a done record.
#[async_trait]
impl Inbox for MemoryStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        let previous = match map.map.get(key) {
            Some(entry) if entry.is_live(now) => {
                return Ok(if let Some(item) = entry.item_view(key) {
                    Accepted::Item(item)
                } else if let Some((completed_at, outcome)) = &entry.done {
                    Accepted::Done {
                        outcome: outcome.clone(),
                        completed_at: *completed_at,
                    }
                } else {
                    Accepted::InFlight {
                        deadline: entry.expires_at,
                        attempt: entry.attempts,
                    }
                });
            }
            other => other,
        };
        // A claim whose lease passed keeps its attempts and first sight, as a
        // takeover would; anything else starts over.
        let (attempts, first_seen) = match previous {
            Some(old) if old.done.is_none() => (old.attempts, old.first_seen),
            _ => (0, now),
        };
        map.next_seq += 1;
        let seq = map.next_seq;
        map.insert(
            key.clone(),
            Entry {
                token: LeaseToken::generate(),
                claim_id: None,
                fingerprint: None,
                expires_at: now + options.delay(),
                done: None,
                attempts,
                first_seen,
                item: Some(ItemEntry {
                    payload: payload.to_vec(),
                    wait: Wait::Due,
                    last_error: None,
                    takeovers: 0,
                    max_attempts: options.max_attempts,
                    ordering: options.ordering_key.clone().map(|key| Ordering {
                        key,
                        seq,
                        when_dead: options.when_dead,
                    }),
                    dead_until: None,
                    errors: Default::default(),
                    parked: false,
                    head: false,
                }),
            },
        );
        drop(map);
        self.wakeups.raise(key.namespace());
        Ok(Accepted::New)
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        check_take(max, lease)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        if map.paused.contains(namespace) {
            return Ok(Vec::new());
        }
        // Read at most ORDER_SCAN items held back by their ordering key
        // besides those handed out, and park them (out of the due set until
        // their key moves); a take that parked instead of filling reads again.
        let mut taken = Vec::with_capacity(max);
        loop {
            let due = map.due_by(namespace, now, max - taken.len() + crate::ORDER_SCAN);
            let mut parked = false;
            for key in due {
                if taken.len() == max {
                    break;
                }
                if map.held_back(&key) {
                    parked |= map
                        .change(&key, |entry| match entry.item.as_mut() {
                            Some(item) if item.wait == Wait::Due && !item.head => {
                                item.parked = true;
                                true
                            }
                            _ => false,
                        })
                        .unwrap_or(false);
                    continue;
                }
                taken.extend(map.lease_due(&key, now, lease));
            }
            if !parked || taken.len() >= max {
                return Ok(taken);
            }
        }
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        check_ttl("snooze delay", delay)?;
        let now = SystemTime::now();
        let mut map = self.lock();
        match map.map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) && entry.item.is_some() => {
                // Due after the delay, the attempt its take counted taken
                // back (I12).
                map.change(&lease.key, |entry| {
                    if let Some(item) = entry.item.as_mut() {
                        item.wait = Wait::Due;
                    }
                    entry.expires_at = now + delay;
                    entry.attempts = entry.attempts.saturating_sub(1);
                });
                Ok(())
            }
            // Snoozed by this very call, sent again.
            Some(entry)
                if entry.token == lease.token
                    && entry.item.as_ref().is_some_and(|i| i.wait == Wait::Due) =>
            {
                Ok(())
            }
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        retry.validate()?;
        let error = cut_error(error);
        let now = SystemTime::now();
        let mut map = self.lock();
        match map.map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                if entry.item.is_none() {
                    return Err(Error::config(
                        "fail is for inbox items; a claim is released instead",
                    ));
                }
                map.change(&lease.key, |entry| {
                    let (wait, due) = match retry {
                        Retry::After(delay) => (Wait::Due, now + delay),
                        Retry::Dead { .. } => (Wait::Dead, now),
                    };
                    let attempt = entry.attempts;
                    if let Some(item) = entry.item.as_mut() {
                        item.errors.push_back(crate::FailedAttempt::new(
                            attempt,
                            now,
                            error.as_str(),
                        ));
                        if item.errors.len() > crate::ERROR_HISTORY {
                            item.errors.pop_front();
                        }
                        item.last_error = Some(error);
                        item.wait = wait;
                        item.dead_until = retry.dead_until(now);
                    }
                    entry.expires_at = due;
                });
                Ok(())
            }
            // Failed so by this very fail, sent again: nothing changes.
            Some(entry) if entry.failed_by(lease, &error, retry) => Ok(()),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        Ok(self.lock().map.get(key).and_then(|e| e.item_view(key)))
    }

    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        query.validate()?;
        let map = self.lock();
        let mut items: Vec<Item> = map
            .map
            .iter()
            .filter(|(k, _)| {
                k.namespace() == query.namespace
                    && query.after.as_deref().is_none_or(|after| k.id() > after)
            })
            .filter_map(|(k, e)| e.item_view(k))
            .filter(|i| query.status.is_none_or(|s| s == i.status))
            .collect();
        items.sort_by(|a, b| a.key.id().cmp(b.key.id()));
        let next = (items.len() > query.limit).then(|| items[query.limit - 1].key.id().to_string());
        items.truncate(query.limit);
        Ok(ItemPage::new(items, next))
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let mut map = self.lock();
        // Read under the lock: a replay that read the clock before another
        // replay's write would find that one's due time ahead of it.
        let now = SystemTime::now();
        // A failed item already due is left alone: a second replay (another
        // operator's, at the same time) changes nothing and says so.
        let replayable = map.map.get(key).is_some_and(|e| {
            e.item.as_ref().is_some_and(|item| {
                item.wait == Wait::Dead
                    || (item.wait == Wait::Due
                        && item.last_error.is_some()
                        && (e.expires_at > now || item.parked))
            })
        });
        if replayable {
            map.change(key, |entry| {
                if let Some(item) = entry.item.as_mut() {
                    item.wait = Wait::Due;
                    item.dead_until = None;
                    item.parked = false;
                }
                entry.expires_at = now;
            });
            drop(map);
            self.wakeups.raise(key.namespace());
        }
        Ok(replayable)
    }

    async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool> {
        let mut map = self.lock();
        let seen = map
            .map
            .get(key)
            .and_then(|e| e.item_view(key))
            .is_some_and(|item| item.status == status && item.attempts == attempts);
        if seen {
            map.remove(key);
        }
        Ok(seen)
    }

    async fn wake(&self, namespace: &str) -> Result<crate::Wake> {
        Ok(crate::Wake::in_process(self.wakeups.signal(namespace)))
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        let map = self.lock();
        let mut counts = InboxCounts::default();
        for (_, e) in map.map.iter().filter(|(k, _)| k.namespace() == namespace) {
            let Some(status) = e.item_status() else {
                continue;
            };
            match status {
                ItemStatus::Pending => counts.pending += 1,
                ItemStatus::Running => counts.running += 1,
                ItemStatus::Failed => counts.failed += 1,
                ItemStatus::Dead => counts.dead += 1,
            }
            if matches!(status, ItemStatus::Pending | ItemStatus::Failed) {
                counts.oldest_due = Some(
                    counts
                        .oldest_due
                        .map_or(e.expires_at, |d| d.min(e.expires_at)),
                );
            }
        }
        Ok(counts)
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        Ok(self.lock().paused.insert(namespace.to_string()))
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let resumed = self.lock().paused.remove(namespace);
        if resumed {
            // Its waiting items are takeable again: the workers here look now.
            self.wakeups.raise(namespace);
        }
        Ok(resumed)
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        Ok(self.lock().paused.contains(namespace))
    }
}

/// Nothing to make or remove: the records live in the process, and go with
/// it.
#[async_trait]
impl backend::Admin for MemoryStore {
    async fn migrate(&self) -> Result<()> {
        Ok(())
    }

    async fn check(&self) -> Result<()> {
        Ok(())
    }

    /// The map's record keys in `namespace:id` order (a sort per page: a
    /// tool's read, not a hot path).
    async fn record_keys(&self, query: &backend::RecordQuery) -> Result<backend::KeyPage> {
        let after = query
            .after
            .as_deref()
            .map(backend::parse_key_cursor)
            .transpose()?;
        let mut keys: Vec<Key> = self
            .lock()
            .map
            .iter()
            .filter(|(key, entry)| {
                entry.item.is_none()
                    && query
                        .namespace
                        .as_deref()
                        .is_none_or(|ns| key.namespace() == ns)
                    && after.as_ref().is_none_or(|(ns, id)| {
                        (key.namespace(), key.id()) > (ns.as_str(), id.as_str())
                    })
            })
            .map(|(key, _)| key.clone())
            .collect();
        keys.sort_by(|a, b| (a.namespace(), a.id()).cmp(&(b.namespace(), b.id())));
        keys.truncate(query.limit);
        let next = backend::key_cursor(&keys, query.limit);
        Ok(backend::KeyPage { keys, next })
    }

    async fn remove_namespace(&self) -> Result<()> {
        Ok(())
    }
}
