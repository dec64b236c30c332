//! The inbox: its trait, its items and its limits.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::claim::Lease;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::store::DedupeStore;
use crate::wake::Wake;

/// Largest payload [`Inbox::accept`] keeps (the raw body and whatever
/// headers the handler needs, encoded by the caller).
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;

/// Longest error text [`Inbox::fail`] keeps; a longer one is cut at a
/// character boundary.
pub const MAX_ERROR_BYTES: usize = 1024;

/// How many of its failures an item keeps ([`Item::errors`]): the last
/// five, oldest first.
pub const ERROR_HISTORY: usize = 5;

/// One failed attempt of an item, as its history keeps it
/// ([`Item::errors`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailedAttempt {
    /// The attempt that failed (a quarantine's fail counts the attempt of
    /// the take that found the item poisoned).
    pub attempt: u32,
    /// When it failed, on the store's clock.
    pub at: SystemTime,
    /// Its error, as [`Inbox::fail`] kept it (cut to [`MAX_ERROR_BYTES`]).
    pub error: String,
}

impl FailedAttempt {
    /// A failed attempt (for store authors).
    pub fn new(attempt: u32, at: SystemTime, error: impl Into<String>) -> Self {
        Self {
            attempt,
            at,
            error: error.into(),
        }
    }
}

/// Most items one [`Inbox::take`] hands out.
pub const MAX_TAKE: usize = 100;

/// Most items one [`Inbox::list`] page holds.
pub const MAX_PAGE: usize = 1000;

/// Where an item stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemStatus {
    /// Waiting to be taken, never failed (accepted, released, or replayed
    /// before it failed).
    Pending,
    /// Leased to a worker (its lease may have passed: then it is due again).
    Running,
    /// Failed, and due again at its `due_at`.
    Failed,
    /// Failed for the last time: never taken again until replayed.
    Dead,
}

impl ItemStatus {
    /// The status as text: `pending`, `running`, `failed`, `dead`.
    pub fn as_str(self) -> &'static str {
        match self {
            ItemStatus::Pending => "pending",
            ItemStatus::Running => "running",
            ItemStatus::Failed => "failed",
            ItemStatus::Dead => "dead",
        }
    }
}

impl std::str::FromStr for ItemStatus {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "pending" => ItemStatus::Pending,
            "running" => ItemStatus::Running,
            "failed" => ItemStatus::Failed,
            "dead" => ItemStatus::Dead,
            other => {
                return Err(Error::config(format!(
                    "no item status {other:?}: pending, running, failed or dead"
                )))
            }
        })
    }
}

/// An item of the inbox, as [`Inbox::item`] and [`Inbox::list`] show it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Item {
    /// Its key.
    pub key: Key,
    /// Where it stands.
    pub status: ItemStatus,
    /// How many times it was taken (takeovers of a worker that died count).
    pub attempts: u32,
    /// When it was accepted.
    pub accepted_at: SystemTime,
    /// Pending or failed: when it is due; running: when its lease passes;
    /// dead: when it died.
    pub due_at: SystemTime,
    /// The error of its last failure, if it failed.
    pub last_error: Option<String>,
    /// The delivery as accepted.
    pub payload: Vec<u8>,
    /// How many times it was taken over from a worker that died holding it
    /// (its lease passed): a worker quarantines an item past its
    /// `max_takeovers` (CONTRACT.md I10).
    pub takeovers: u32,
    /// The attempts it gets before it is dead, set when it was accepted
    /// ([`AcceptOptions::max_attempts`]); `None`: the worker's setting.
    pub max_attempts: Option<u32>,
    /// Its ordering key ([`AcceptOptions::ordering_key`]), if it has one.
    pub ordering_key: Option<String>,
    /// Its last [`ERROR_HISTORY`] failures, oldest first (the last one's
    /// error is `last_error`); empty when it never failed. Items that failed
    /// before a store kept the history show none of those failures.
    pub errors: Vec<FailedAttempt>,
}

impl Item {
    /// Assembles an item (for store authors).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: Key,
        status: ItemStatus,
        attempts: u32,
        accepted_at: SystemTime,
        due_at: SystemTime,
        last_error: Option<String>,
        payload: Vec<u8>,
    ) -> Self {
        Self {
            key,
            status,
            attempts,
            accepted_at,
            due_at,
            last_error,
            payload,
            takeovers: 0,
            max_attempts: None,
            ordering_key: None,
            errors: Vec::new(),
        }
    }

    /// The item with its takeovers and its own attempt limit (for store
    /// authors).
    pub fn with_counts(mut self, takeovers: u32, max_attempts: Option<u32>) -> Self {
        self.takeovers = takeovers;
        self.max_attempts = max_attempts;
        self
    }

    /// Sets its ordering key (for store authors).
    pub fn with_ordering_key(mut self, key: Option<String>) -> Self {
        self.ordering_key = key;
        self
    }

    /// Sets its failure history, oldest first (for store authors).
    pub fn with_errors(mut self, errors: Vec<FailedAttempt>) -> Self {
        self.errors = errors;
        self
    }
}

/// Longest ordering key ([`AcceptOptions::ordering_key`]), in bytes.
pub const MAX_ORDERING_KEY_BYTES: usize = 256;

/// How many due items a take passes over because an earlier item of their
/// ordering key holds them back (CONTRACT.md I15), beyond the items it
/// hands out: a take reads at most `max + ORDER_SCAN` due items at a time.
/// Memory, SQLite, Postgres and MySQL park the held-back items it reads (out
/// of the due items until their key moves) and read on, so work behind any
/// number of them is handed out. On Redis and DynamoDB, past that many
/// blocked items at the front of a namespace, a take hands out nothing until
/// they move, however much other work waits behind them.
pub const ORDER_SCAN: usize = 100;

/// What a dead item does to the later items of its ordering key
/// (CONTRACT.md I15), set when it is accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WhenDead {
    /// The later items wait until it is replayed and done, or forgotten:
    /// the default, for state an event must not be skipped in (a
    /// `customer.updated` applied without its `customer.created`).
    #[default]
    Block,
    /// The later items go on as if it were done.
    Skip,
}

/// What an [`Inbox::accept_with`] stores beside the delivery.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcceptOptions {
    /// Not taken before this time (delayed work); `None` or a time passed:
    /// due now.
    pub not_before: Option<SystemTime>,
    /// The attempts the item gets before it is dead, whatever the settings of
    /// the worker that takes it (so workers of different versions agree);
    /// `None`: the taking worker's `max_attempts`.
    pub max_attempts: Option<u32>,
    /// Items of one namespace with the same ordering key (a Stripe object's
    /// id, a customer) are handed out one at a time, in accept order
    /// (CONTRACT.md I15); `None`: no order, the item runs beside any other.
    pub ordering_key: Option<String>,
    /// What this item, dead, does to the later items of its ordering key.
    pub when_dead: WhenDead,
}

impl AcceptOptions {
    /// Due now, the worker's attempt limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Not taken before `at`.
    pub fn not_before(mut self, at: SystemTime) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Dead after `attempts` failed attempts (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Handed out after the earlier items of `key` in its namespace, one at
    /// a time (1 to [`MAX_ORDERING_KEY_BYTES`] bytes).
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// What this item, dead, does to the later items of its ordering key
    /// (default [`WhenDead::Block`]).
    pub fn when_dead(mut self, when_dead: WhenDead) -> Self {
        self.when_dead = when_dead;
        self
    }

    /// Checks the options: `max_attempts` at least 1, `not_before` at most
    /// [`MAX_TTL`](crate::MAX_TTL) ahead.
    pub fn validate(&self) -> Result<()> {
        if self.max_attempts == Some(0) {
            return Err(Error::config("an item needs at least 1 attempt, 0 asked"));
        }
        if let Some(key) = &self.ordering_key {
            if key.is_empty() || key.len() > MAX_ORDERING_KEY_BYTES {
                return Err(Error::config(format!(
                    "an ordering key is 1 to {MAX_ORDERING_KEY_BYTES} bytes, {} given",
                    key.len()
                )));
            }
        }
        if let Some(at) = self.not_before {
            let ahead = at
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            if ahead > crate::MAX_TTL {
                return Err(Error::config(format!(
                    "not_before is {ahead:?} ahead, more than the longest delay, {:?}",
                    crate::MAX_TTL
                )));
            }
        }
        Ok(())
    }

    /// The delay from now to `not_before` (zero when due now).
    pub fn delay(&self) -> Duration {
        self.not_before
            .and_then(|at| at.duration_since(SystemTime::now()).ok())
            .unwrap_or(Duration::ZERO)
    }
}

/// What [`Inbox::accept`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Accepted {
    /// The key was new: the delivery is stored as a pending item, due now.
    New,
    /// The inbox holds the key already (pending, running, failed or dead):
    /// nothing was written.
    Item(Item),
    /// The event is done, inside its retention: nothing was written.
    Done {
        /// The outcome stored, byte for byte.
        outcome: Vec<u8>,
        /// When it was completed.
        completed_at: SystemTime,
    },
    /// A synchronous claim holds the key: nothing was written.
    InFlight {
        /// When that claim's lease passes.
        deadline: SystemTime,
        /// Which attempt holds it.
        attempt: u32,
    },
}

impl Accepted {
    /// Whether this accept stored the delivery.
    pub fn is_new(&self) -> bool {
        matches!(self, Accepted::New)
    }

    /// The answer's name, for logs and metrics: `new`, `item`, `done`,
    /// `in_flight`.
    pub fn kind(&self) -> &'static str {
        match self {
            Accepted::New => "new",
            Accepted::Item(_) => "item",
            Accepted::Done { .. } => "done",
            Accepted::InFlight { .. } => "in_flight",
        }
    }
}

/// An item handed to a worker by [`Inbox::take`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Taken {
    /// The worker's lease: complete, fail, extend or release the item with it.
    pub lease: Lease,
    /// The delivery as accepted.
    pub payload: Vec<u8>,
    /// The error of the item's last failure, if any.
    pub last_error: Option<String>,
    /// Takeovers of the item so far, this take's included when it took the
    /// item over from a worker that died (see [`Item::takeovers`]).
    pub takeovers: u32,
    /// The item's own attempt limit, set when it was accepted.
    pub max_attempts: Option<u32>,
    /// When the item was accepted (the start of its snooze window, and of
    /// its accept-to-start latency).
    pub accepted_at: SystemTime,
    /// Its ordering key, if it has one: when it is done (or dead and
    /// skipped) the next item of the key is due, and `InboxWorker` looks for
    /// it at once.
    pub ordering_key: Option<String>,
}

impl Taken {
    /// Assembles a taken item (for store authors).
    pub fn new(
        lease: Lease,
        payload: Vec<u8>,
        last_error: Option<String>,
        accepted_at: SystemTime,
    ) -> Self {
        Self {
            lease,
            payload,
            last_error,
            accepted_at,
            takeovers: 0,
            max_attempts: None,
            ordering_key: None,
        }
    }

    /// The taken item with its takeovers and its own attempt limit (for
    /// store authors).
    pub fn with_counts(mut self, takeovers: u32, max_attempts: Option<u32>) -> Self {
        self.takeovers = takeovers;
        self.max_attempts = max_attempts;
        self
    }

    /// The taken item with its ordering key (for store authors).
    pub fn with_ordering_key(mut self, key: Option<String>) -> Self {
        self.ordering_key = key;
        self
    }
}

/// How long a dead item is kept by default before `expire()` may remove it
/// (CONTRACT.md I16): 35 days, the same as a done record, so an operator
/// back from a long weekend (or a provider's month of manual resends) still
/// finds the dead letters to replay.
pub const DEAD_RETENTION: Duration = Duration::from_secs(35 * 24 * 3600);

/// What [`Inbox::fail`] does with the item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Due again this long from now.
    After(Duration),
    /// Dead: never taken again until [`Inbox::replay`]ed, and kept for
    /// `keep` from now (then removed by [`expire`](crate::DedupeStore::expire)
    /// or the store's own expiry, CONTRACT.md I16), or until forgotten when
    /// `keep` is `None`.
    Dead {
        /// The dead letter's retention (at most [`MAX_TTL`](crate::MAX_TTL)).
        keep: Option<Duration>,
    },
}

impl Retry {
    /// Dead, kept for the default [`DEAD_RETENTION`].
    pub const fn dead() -> Self {
        Retry::Dead {
            keep: Some(DEAD_RETENTION),
        }
    }

    /// Checks the delay or the retention against
    /// [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL):
    /// otherwise `InvalidConfig`, and a store writes nothing.
    pub fn validate(&self) -> Result<()> {
        match self {
            Retry::After(delay) => crate::claim::check_ttl("retry delay", *delay),
            Retry::Dead { keep: Some(keep) } => crate::claim::check_ttl("dead retention", *keep),
            Retry::Dead { keep: None } => Ok(()),
        }
    }

    /// The dead item's retention deadline from `now` (`None`: kept until
    /// forgotten, or not dead).
    pub fn dead_until(&self, now: SystemTime) -> Option<SystemTime> {
        match self {
            Retry::Dead { keep: Some(keep) } => Some(now + *keep),
            _ => None,
        }
    }

    /// Whether the item is dead.
    pub fn is_dead(&self) -> bool {
        matches!(self, Retry::Dead { .. })
    }
}

/// Which items [`Inbox::list`] shows: one namespace, optionally one status,
/// in key order, a page at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemQuery {
    /// The namespace.
    pub namespace: String,
    /// Only items in this status (all statuses when `None`).
    pub status: Option<ItemStatus>,
    /// Only ids after this one (the `next` of the page before).
    pub after: Option<String>,
    /// Most items in the page (1 to [`MAX_PAGE`]).
    pub limit: usize,
}

impl ItemQuery {
    /// The first page of `namespace`, 100 items, every status.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            status: None,
            after: None,
            limit: 100,
        }
    }

    /// Only items in `status`.
    pub fn status(mut self, status: ItemStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Checks the limit.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_PAGE).contains(&self.limit) {
            return Err(Error::config(format!(
                "a page holds 1 to {MAX_PAGE} items, {} asked",
                self.limit
            )));
        }
        Ok(())
    }
}

/// A page of [`Inbox::list`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ItemPage {
    /// The items, in id order.
    pub items: Vec<Item>,
    /// Where the next page starts (`ItemQuery::after`), when there may be one.
    pub next: Option<String>,
}

impl ItemPage {
    /// Assembles a page (for store authors).
    pub fn new(items: Vec<Item>, next: Option<String>) -> Self {
        Self { items, next }
    }
}

/// How many items of a namespace stand where, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct InboxCounts {
    /// Pending items (due or not).
    pub pending: u64,
    /// Items leased to a worker.
    pub running: u64,
    /// Failed items awaiting their retry.
    pub failed: u64,
    /// Dead items.
    pub dead: u64,
    /// When the longest-waiting pending or failed item became due.
    pub oldest_due: Option<SystemTime>,
}

/// An inbox on a store: deliveries accepted at once and processed later, by workers
/// that take them under leases.
///
/// A receiver that holds the provider's connection for its whole handler
/// risks the provider giving up (5 to 30 s) and sending the event again while
/// the first copy still runs. With an inbox the receiver only
/// [`accept`](Inbox::accept)s the delivery (one atomic write, like a claim)
/// and answers 2xx; workers in any number of processes
/// [`take`](Inbox::take) due items, each leased to exactly one of them, run
/// the handler, and [`complete`](crate::DedupeStore::complete) the item or
/// [`fail`](Inbox::fail) it (due again after a backoff, or dead after the
/// last attempt, waiting for an operator to [`replay`](Inbox::replay) it).
///
/// An item lives in the same key space as the claims of the
/// [`DedupeStore`] it extends: a completed item is a done record (later
/// claims and accepts of its key answer it as a duplicate), and a claim of a
/// key the inbox holds answers `InFlight` (the inbox owns it until it is
/// done). Pending, running and failed items never expire; only a completion's
/// retention or [`forget`](crate::DedupeStore::forget) ends them. A dead item
/// is kept for the retention its [`fail`](Inbox::fail) gave it
/// ([`Retry::Dead`], CONTRACT.md I16).
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{Accepted, DedupeStore, Inbox, Key, MemoryStore, Retry};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let inbox = MemoryStore::new();
/// let key = Key::new("stripe", "evt_1P9x")?;
/// // The receiver: store the delivery, answer 2xx at once.
/// assert_eq!(inbox.accept(&key, br#"{"id":"evt_1P9x"}"#).await?, Accepted::New);
/// // A resend of the same event writes nothing.
/// assert!(matches!(inbox.accept(&key, b"resent").await?, Accepted::Item(_)));
///
/// // A worker: take, run, complete (or fail: due again after a backoff).
/// for taken in inbox.take("stripe", 10, Duration::from_secs(30)).await? {
///     if taken.payload.is_empty() {
///         inbox.fail(&taken.lease, "empty body", Retry::After(Duration::from_secs(5))).await?;
///     } else {
///         inbox.complete(&taken.lease, b"credited", Duration::from_secs(86_400)).await?;
///     }
/// }
/// // Done: the event is a done record now.
/// assert!(matches!(inbox.accept(&key, b"late").await?, Accepted::Done { .. }));
/// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
/// ```
///
/// CONTRACT.md has the inbox rules.
///
/// The lease of a taken item is a [`Lease`] of the store: complete it with
/// [`DedupeStore::complete`] (the item becomes a done record), keep it with
/// [`DedupeStore::extend`], give it back with [`DedupeStore::release`] (due
/// again now, the attempt its take counted taken back: a hand-back spends
/// none), remove it with [`DedupeStore::forget`].
/// All of them, and [`fail`](Self::fail), are fenced: a worker whose lease
/// passed or was taken over gets `LeaseLost` and changes nothing.
///
/// A call sent again after its answer was lost is answered as the first was
/// (CONTRACT.md, rule 10): a release that finds the item due under its own
/// token answers Ok, and so does a fail that finds the item failed (or dead)
/// under its token with the same error; neither changes anything.
#[async_trait]
pub trait Inbox: DedupeStore {
    /// Stores `payload` under `key` as a pending item, due now, when nothing
    /// live holds the key; else answers what does, and writes nothing. One
    /// atomic step: two copies accepted at the same instant give one item.
    /// [`accept_with`](Self::accept_with) with the default options.
    async fn accept(&self, key: &Key, payload: &[u8]) -> Result<Accepted> {
        self.accept_with(key, payload, &AcceptOptions::default())
            .await
    }

    /// [`accept`](Self::accept), the item due at `options.not_before` (now
    /// when that has passed) and carrying its own attempt limit.
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted>;

    /// Leases up to `max` due items of `namespace` (pending or failed whose
    /// time came, or running whose lease passed), oldest due first, each to
    /// this caller only: a new token, the deadline `now + lease`, one more
    /// attempt, and one more takeover when its worker's lease had passed.
    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>>;

    /// Gives a taken item back due `delay` from now without spending an
    /// attempt (a snooze: the work could not start yet, nothing failed):
    /// the attempt its take counted is taken back, as a
    /// [`release`](crate::DedupeStore::release) does, and its last error is
    /// kept. A `delay` of zero or past [`MAX_TTL`](crate::MAX_TTL) is
    /// `InvalidConfig`. Sent again under the same lease, it finds the item
    /// waiting under its token and answers Ok, changing nothing; any other
    /// call from a lease that no longer holds the item is `LeaseLost`.
    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()>;

    /// The work of a taken item failed: keeps `error` (cut to
    /// [`MAX_ERROR_BYTES`]) and the attempts, and makes the item due again
    /// after the delay, or dead. Sent again under the same lease with the
    /// same error and decision, it answers Ok and changes nothing; any other
    /// call from a lease that no longer holds the item is `LeaseLost`.
    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()>;

    /// The item under `key`, if the inbox holds one (not once it is done).
    async fn item(&self, key: &Key) -> Result<Option<Item>>;

    /// A page of the namespace's items.
    async fn list(&self, query: &ItemQuery) -> Result<ItemPage>;

    /// Makes a dead item, or a failed item waiting for its retry, due now,
    /// its attempts and last error kept. `false` when the key holds no such
    /// item, and for a failed item that is due already (replayed a moment
    /// ago): of two operators replaying an item at once, one is answered
    /// `true`.
    async fn replay(&self, key: &Key) -> Result<bool>;

    /// Removes the item at `key` as [`forget`](crate::DedupeStore::forget)
    /// does, but only while it is as an operator saw it: in `status`, taken
    /// `attempts` times. An item that moved on since (replayed, taken,
    /// failed again, done) is left alone and answered `false`; one atomic
    /// step, so a bulk forget never removes an item another operator or a
    /// worker has taken up meanwhile.
    async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool>;

    /// How many items of the namespace stand where.
    async fn counts(&self, namespace: &str) -> Result<InboxCounts>;

    /// Pauses the namespace's takes, in the store, for every worker in every
    /// process: from the moment this answers, no take of `namespace` hands
    /// out an item (due, failed or held past its lease) until
    /// [`resume`](Self::resume). Accepts go on, and the items running now
    /// finish (complete, fail, extend, release and snooze as usual).
    /// `true` when this call paused it, `false` when it was paused already
    /// (nothing changed). A namespace a [`Key`] refuses is `InvalidKey`.
    async fn pause(&self, namespace: &str) -> Result<bool>;

    /// Lets the namespace's takes hand out items again. `true` when this
    /// call resumed it, `false` when it was not paused (nothing changed).
    async fn resume(&self, namespace: &str) -> Result<bool>;

    /// Whether the namespace is paused.
    async fn paused(&self, namespace: &str) -> Result<bool>;

    /// How the idle workers of `namespace` are woken when work becomes due
    /// there ([`Wake`]): a signal raised by this handle's changes, one the
    /// store pushes from every process, or none (the default: workers only
    /// poll). A worker asks once, before its first take; on a store that
    /// pushes, the subscription is in place when this answers, so a change
    /// committed afterwards is signalled unless the connection carrying it
    /// drops (and a signal missed so costs at most the worker's poll).
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        let _ = namespace;
        Ok(Wake::poll())
    }
}

macro_rules! forward_inbox {
    ($($ty:ty),*) => {$(
        #[deny(clippy::missing_trait_methods)]
        #[async_trait]
        impl<S: Inbox + ?Sized> Inbox for $ty {
            async fn accept(&self, key: &Key, payload: &[u8]) -> Result<Accepted> {
                (**self).accept(key, payload).await
            }
            async fn accept_with(
                &self,
                key: &Key,
                payload: &[u8],
                options: &AcceptOptions,
            ) -> Result<Accepted> {
                (**self).accept_with(key, payload, options).await
            }
            async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
                (**self).take(namespace, max, lease).await
            }
            async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
                (**self).snooze(lease, delay).await
            }
            async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
                (**self).fail(lease, error, retry).await
            }
            async fn item(&self, key: &Key) -> Result<Option<Item>> {
                (**self).item(key).await
            }
            async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
                (**self).list(query).await
            }
            async fn replay(&self, key: &Key) -> Result<bool> {
                (**self).replay(key).await
            }
            async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool> {
                (**self).forget_if(key, status, attempts).await
            }
            async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
                (**self).counts(namespace).await
            }
            async fn pause(&self, namespace: &str) -> Result<bool> {
                (**self).pause(namespace).await
            }
            async fn resume(&self, namespace: &str) -> Result<bool> {
                (**self).resume(namespace).await
            }
            async fn paused(&self, namespace: &str) -> Result<bool> {
                (**self).paused(namespace).await
            }
            async fn wake(&self, namespace: &str) -> Result<Wake> {
                (**self).wake(namespace).await
            }
        }
    )*};
}

forward_inbox!(std::sync::Arc<S>, Box<S>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_as_text() {
        for s in [
            ItemStatus::Pending,
            ItemStatus::Running,
            ItemStatus::Failed,
            ItemStatus::Dead,
        ] {
            assert_eq!(s.as_str().parse::<ItemStatus>().expect("parses"), s);
        }
        assert!("done".parse::<ItemStatus>().is_err());
    }
}
