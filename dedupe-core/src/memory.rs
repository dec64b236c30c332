//! The in-memory store: the reference implementation of the contract.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::claim::{check_ttl, ClaimOptions, ClaimOutcome, Lease, LeaseToken};
use crate::error::{Error, Result};
use crate::key::{ClaimId, Fingerprint, Key};
use crate::record::{Record, RecordState};
use crate::store::DedupeStore;

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
}

impl Entry {
    fn is_live(&self, now: SystemTime) -> bool {
        self.expires_at > now
    }

    fn holds(&self, lease: &Lease, now: SystemTime) -> bool {
        self.done.is_none() && self.token == lease.token && self.is_live(now)
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
            self.attempts,
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
    records: Arc<Mutex<HashMap<Key, Entry>>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of records held, live or expired-but-not-removed.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Entry>> {
        // No operation panics while holding the lock, so a poisoned map is intact.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn claim_locked(
        map: &mut HashMap<Key, Entry>,
        key: &Key,
        opts: &ClaimOptions,
        now: SystemTime,
    ) -> ClaimOutcome {
        let previous = match map.get(key) {
            Some(entry) if entry.is_live(now) => return entry.record(key).into_claim_answer(opts),
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
        match map.get_mut(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                entry.done = Some((now, outcome.to_vec()));
                entry.expires_at = now + retention;
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
        match map.get(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                map.remove(&lease.key);
                Ok(())
            }
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
        match map.get_mut(&lease.key) {
            Some(entry) if entry.holds(lease, now) => {
                entry.expires_at = now + ttl;
                Ok(entry.lease(&lease.key))
            }
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn expire(&self) -> Result<u64> {
        let now = SystemTime::now();
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, entry| entry.is_live(now));
        Ok((before - map.len()) as u64)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = SystemTime::now();
        Ok(self
            .lock()
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
