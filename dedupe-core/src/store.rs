//! The storage-agnostic store trait.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::claim::{ClaimOptions, ClaimOutcome, Lease};
use crate::error::Result;
use crate::key::Key;
use crate::record::Record;

/// A store of idempotency records: the one place that decides, atomically, which
/// delivery of an event does the work.
///
/// Every implementation must behave as the contract says (the `dedupe-conformance`
/// crate proves it); the guarantees below hold for every store, whatever it is
/// built on. A store is `Send + Sync` and object-safe, so `Arc<dyn DedupeStore>` is
/// the usual way to hold one.
///
/// **Expiry is logical.** A record past its deadline (lease for in-flight, retention
/// for done) counts as absent at once, whether or not it has been removed yet.
///
/// **Errors are never answers.** When a store cannot read or write it returns an
/// [`Error`](crate::Error); it never answers an outcome it did not read from storage.
///
/// Implementing it on a `HashMap` shows the shape (the real reference is
/// [`MemoryStore`](crate::MemoryStore)):
///
/// ```
/// use std::{collections::HashMap, sync::Mutex, time::{Duration, SystemTime}};
/// use async_trait::async_trait;
/// use dedupe_core::*;
/// use dedupe_core::backend::new_token;
///
/// #[derive(Debug, Default)]
/// struct Tiny(Mutex<HashMap<Key, (LeaseToken, SystemTime, Option<Vec<u8>>)>>);
///
/// #[async_trait]
/// impl DedupeStore for Tiny {
///     async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
///         let now = SystemTime::now();
///         let mut map = self.0.lock().unwrap();
///         match map.get(key) {
///             Some((_, until, Some(out))) if *until > now => Ok(ClaimOutcome::Duplicate {
///                 outcome: out.clone(), completed_at: now }),
///             Some((_, until, None)) if *until > now => Ok(ClaimOutcome::InFlight {
///                 deadline: *until, attempt: 1 }),
///             _ => {
///                 let lease = Lease { key: key.clone(), token: new_token(),
///                     deadline: now + opts.lease_ttl, attempt: 1, claim_id: None };
///                 map.insert(key.clone(), (lease.token.clone(), lease.deadline, None));
///                 Ok(ClaimOutcome::Claimed(lease))
///             }
///         }
///     }
///     async fn complete(&self, lease: &Lease, outcome: &[u8], keep: Duration) -> Result<()> {
///         let mut map = self.0.lock().unwrap();
///         match map.get_mut(&lease.key) {
///             Some(rec) if rec.0 == lease.token && rec.2.is_none() => {
///                 *rec = (lease.token.clone(), SystemTime::now() + keep, Some(outcome.to_vec()));
///                 Ok(())
///             }
///             _ => Err(Error::lease_lost(&lease.key)),
///         }
///     }
///     async fn release(&self, lease: &Lease) -> Result<()> {
///         let mut map = self.0.lock().unwrap();
///         match map.get(&lease.key) {
///             Some(rec) if rec.0 == lease.token && rec.2.is_none() => {
///                 map.remove(&lease.key);
///                 Ok(())
///             }
///             _ => Err(Error::lease_lost(&lease.key)),
///         }
///     }
///     async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
///         Err(Error::lease_lost(&lease.key)) // a real store pushes the deadline out
///     }
///     async fn expire(&self) -> Result<u64> { Ok(0) }
///     async fn get(&self, _key: &Key) -> Result<Option<Record>> { Ok(None) }
///     async fn forget(&self, key: &Key) -> Result<bool> {
///         Ok(self.0.lock().unwrap().remove(key).is_some())
///     }
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store: std::sync::Arc<dyn DedupeStore> = std::sync::Arc::new(Tiny::default());
/// let key = Key::new("stripe", "evt_1")?;
/// let lease = store.claim(&key, &ClaimOptions::default()).await?.lease().cloned().unwrap();
/// store.complete(&lease, b"ok", Duration::from_secs(60)).await?;
/// assert!(matches!(store.claim(&key, &ClaimOptions::default()).await?,
///     ClaimOutcome::Duplicate { .. }));
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait DedupeStore: Debug + Send + Sync + 'static {
    /// Claims `key`, atomically, in one step:
    /// - absent, or present but expired: creates an in-flight record with a fresh
    ///   token and `deadline = now + lease_ttl` and answers `Claimed` (a takeover
    ///   of an expired in-flight record counts one more attempt);
    /// - in flight with a live lease held by the same claim id: answers `Claimed`
    ///   with that same lease (re-entrant retry);
    /// - in flight with a live lease: answers `InFlight`;
    /// - done inside its retention: answers `Duplicate` with the stored outcome;
    /// - live, with a fingerprint other than `opts.fingerprint`: answers `Mismatch`.
    ///
    /// However many callers race on one key, over however many handles, processes
    /// or machines, exactly one is answered `Claimed`.
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome>;

    /// Marks the lease's record done and stores `outcome`, kept for `retention`,
    /// atomically and only if the record is in flight and still holds this lease's
    /// token. A live record this lease already completed with the same `outcome`
    /// answers `Ok` and is left as it is (a complete asked again, by its caller
    /// or by a driver whose answer was lost). Otherwise fails with `LeaseLost`
    /// and changes nothing.
    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()>;

    /// Removes the lease's record so the next delivery processes the event,
    /// atomically, if it is in flight and holds this lease's token. When no live
    /// record is under the key (the lease passed, or a release asked again finds
    /// its work done), answers `Ok` and changes nothing: the key is free, as
    /// asked. A live record held by another lease, or done, fails with
    /// `LeaseLost` and is not removed.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Pushes the lease deadline to `now + ttl` (a heartbeat for long work) and
    /// returns the lease with its new deadline, atomically and only if the record
    /// is in flight and still holds the token. Otherwise `LeaseLost`.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease>;

    /// Removes every record whose lease (in flight) or retention (done) has passed
    /// and answers how many were removed. Live records are untouched. A store that
    /// expires natively may remove nothing and answer 0 (see
    /// [`Capabilities::explicit_expire`]).
    async fn expire(&self) -> Result<u64>;

    /// Reads the live record of `key`, or `None` when it is absent or expired.
    /// Never changes anything.
    async fn get(&self, key: &Key) -> Result<Option<Record>>;

    /// Removes the record of `key` whatever its state and answers whether there was
    /// a live one. For an operator replaying an event by hand, not the normal path.
    async fn forget(&self, key: &Key) -> Result<bool>;

    /// Claims each key in order with the same answers as calling [`claim`] for each
    /// (a key twice in one batch: the first wins, the second sees `InFlight`, or
    /// the same lease with a claim id). Stores override this to do it in fewer
    /// round trips.
    ///
    /// The default claims each distinct key once and answers a key's later
    /// places from its first ([`BatchKeys`](crate::backend::BatchKeys)): claiming
    /// a repeat again would take the first place's lease over when the batch
    /// outlasts it, so one key would be won twice in one call.
    ///
    /// [`claim`]: DedupeStore::claim
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        crate::claim::check_batch(keys)?;
        let batch = crate::batch::BatchKeys::new(keys);
        let mut firsts = Vec::with_capacity(batch.distinct().len());
        for key in batch.distinct() {
            firsts.push(self.claim(key, opts).await?);
        }
        batch.answers(firsts, opts)
    }

    /// What this store can do.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }
}

macro_rules! forward {
    ($($ty:ty),*) => {$(
        #[deny(clippy::missing_trait_methods)]
        #[async_trait]
        impl<S: DedupeStore + ?Sized> DedupeStore for $ty {
            async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
                (**self).claim(key, opts).await
            }
            async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
                (**self).complete(lease, outcome, retention).await
            }
            async fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease).await
            }
            async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
                (**self).extend(lease, ttl).await
            }
            async fn expire(&self) -> Result<u64> {
                (**self).expire().await
            }
            async fn get(&self, key: &Key) -> Result<Option<Record>> {
                (**self).get(key).await
            }
            async fn forget(&self, key: &Key) -> Result<bool> {
                (**self).forget(key).await
            }
            async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
                (**self).claim_many(keys, opts).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
        }
    )*};
}

forward!(Arc<S>, Box<S>);
