//! What an operator does to many items at once: find the items a filter
//! names (state, age, attempts, ordering key, error text), count them, and
//! replay or forget every one of them, a page at a time, with progress and
//! a cancel.
//!
//! Everything here is built on [`Inbox::list`], [`Inbox::item`],
//! [`Inbox::replay`] and [`DedupeStore::forget`](crate::DedupeStore::forget),
//! so it works on every store: the filter's state goes to the store with
//! the page, the rest is checked on the items the page brings.
//!
//! A bulk run is safe beside workers and beside another operator running the
//! same one: a replay is one atomic step that makes a dead or failed item due
//! and answers `false` for anything else, so an item two runs both reach is
//! replayed by one of them, and an item a worker holds is left alone. A
//! forget is [`Inbox::forget_if`]: it removes the item only while it is in
//! the state and at the attempt the page showed (an item another operator
//! replayed in between, or a worker took, is kept).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::inbox::{Inbox, Item, ItemQuery, ItemStatus, MAX_PAGE};
use crate::key::Key;

/// Which items of one namespace an operator means. Every condition given
/// must hold; an empty filter means every item of the namespace.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::{ItemFilter, ItemStatus};
///
/// // The dead letters of `stripe` whose errors mention a 404, older than an hour.
/// let filter = ItemFilter::new("stripe")
///     .status(ItemStatus::Dead)
///     .error("404")
///     .older_than(Duration::from_secs(3600));
/// assert_eq!(filter.namespace, "stripe");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ItemFilter {
    /// The namespace.
    pub namespace: String,
    /// Only items in this state.
    pub status: Option<ItemStatus>,
    /// Only items accepted at least this long ago.
    pub older_than: Option<Duration>,
    /// Only items accepted less than this long ago.
    pub newer_than: Option<Duration>,
    /// Only items taken at least this many times.
    pub min_attempts: Option<u32>,
    /// Only items taken at most this many times.
    pub max_attempts: Option<u32>,
    /// Only items of this ordering key.
    pub ordering_key: Option<String>,
    /// Only items one of whose recorded errors contains this text (ignoring
    /// case).
    pub error: Option<String>,
}

impl ItemFilter {
    /// Every item of `namespace`.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            ..Self::default()
        }
    }

    /// Only items in `status`.
    pub fn status(mut self, status: ItemStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only items one of whose errors contains `text` (ignoring case).
    pub fn error(mut self, text: impl Into<String>) -> Self {
        self.error = Some(text.into());
        self
    }

    /// Only items accepted at least `age` ago.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Only items of the ordering key `key`.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Checks the namespace and the bounds: a filter no item can match is a
    /// mistake worth saying.
    pub fn validate(&self) -> Result<()> {
        Key::new(&self.namespace, "x")
            .map_err(|e| Error::config(format!("the filter's namespace: {e}")))?;
        if let (Some(low), Some(high)) = (self.min_attempts, self.max_attempts) {
            if low > high {
                return Err(Error::config(format!(
                    "attempts at least {low} and at most {high}: no item matches"
                )));
            }
        }
        if let (Some(older), Some(newer)) = (self.older_than, self.newer_than) {
            if older >= newer {
                return Err(Error::config(format!(
                    "accepted more than {older:?} and less than {newer:?} ago: no item matches"
                )));
            }
        }
        Ok(())
    }

    /// Whether `item` matches at `now`.
    pub fn matches(&self, item: &Item, now: SystemTime) -> bool {
        let age = now.duration_since(item.accepted_at).unwrap_or_default();
        let error = self.error.as_deref().map(str::to_lowercase);
        item.key.namespace() == self.namespace
            && self.status.is_none_or(|s| item.status == s)
            && self.older_than.is_none_or(|a| age >= a)
            && self.newer_than.is_none_or(|a| age < a)
            && self.min_attempts.is_none_or(|n| item.attempts >= n)
            && self.max_attempts.is_none_or(|n| item.attempts <= n)
            && self
                .ordering_key
                .as_ref()
                .is_none_or(|k| item.ordering_key.as_ref() == Some(k))
            && error.is_none_or(|text| {
                item.last_error
                    .iter()
                    .chain(item.errors.iter().map(|e| &e.error))
                    .any(|e| e.to_lowercase().contains(&text))
            })
    }
}

/// A page of [`search_items`]: the matching items, where the next page starts,
/// and how many items were read to find them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Found {
    /// The matching items, in id order.
    pub items: Vec<Item>,
    /// The id the next page starts after, when the namespace may hold more.
    pub next: Option<String>,
    /// Items read (matching or not).
    pub scanned: u64,
}

/// Items read per [`Inbox::list`] call of a search: pages carry payloads (up
/// to [`MAX_PAYLOAD_BYTES`](crate::MAX_PAYLOAD_BYTES) each), so a search holds
/// at most this many at once.
const SEARCH_PAGE: usize = 200;

/// At most `limit` items matching `filter` after the id `after`, reading at
/// most `budget` items (so a filter that matches little answers in bounded
/// time, with `next` where it stopped). The state goes to the store; the
/// other conditions are checked on each item read.
pub async fn search_items(
    inbox: &dyn Inbox,
    filter: &ItemFilter,
    after: Option<String>,
    limit: usize,
    budget: u64,
) -> Result<Found> {
    filter.validate()?;
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(Error::config(format!(
            "a page holds 1 to {MAX_PAGE} items, {limit} asked"
        )));
    }
    let mut query = ItemQuery::new(&filter.namespace);
    query.status = filter.status;
    query.after = after;
    let mut found = Found::default();
    let now = SystemTime::now();
    loop {
        query.limit = SEARCH_PAGE;
        let page = inbox.list(&query).await?;
        let read = page.items.len();
        for (i, item) in page.items.into_iter().enumerate() {
            found.scanned += 1;
            query.after = Some(item.key.id().to_string());
            if filter.matches(&item, now) {
                found.items.push(item);
            }
            if found.items.len() == limit || found.scanned >= budget {
                // Stopped inside the page: the next starts after the last
                // item read; at the namespace's last item there is none.
                let last = i + 1 == read && page.next.is_none();
                found.next = if last { None } else { query.after.take() };
                return Ok(found);
            }
        }
        match page.next {
            Some(next) => query.after = Some(next),
            None => return Ok(found),
        }
    }
}

/// How many items match `filter` now (a dry run of a bulk action): reads
/// every item of the namespace in the filter's state, a page at a time.
pub async fn count_items(inbox: &dyn Inbox, filter: &ItemFilter) -> Result<u64> {
    let mut after = None;
    let mut matched = 0;
    loop {
        let found = search_items(inbox, filter, after, MAX_PAGE, MAX_PAGE as u64).await?;
        matched += found.items.len() as u64;
        match found.next {
            Some(next) => after = Some(next),
            None => return Ok(matched),
        }
    }
}

/// What a [`Bulk`] run does to each matching item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BulkAction {
    /// [`Inbox::replay`]: a dead or failed item is due now.
    Replay,
    /// [`DedupeStore::forget`](crate::DedupeStore::forget): the item is
    /// removed, and its next delivery accepted anew.
    Forget,
}

impl BulkAction {
    /// `replay` or `forget`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Forget => "forget",
        }
    }
}

impl std::str::FromStr for BulkAction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "replay" => Ok(Self::Replay),
            "forget" => Ok(Self::Forget),
            other => Err(Error::config(format!(
                "{other:?} is no bulk action (replay or forget)"
            ))),
        }
    }
}

/// Where a [`Bulk`] run stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BulkProgress {
    /// Items read.
    pub scanned: u64,
    /// Items that matched the filter when read.
    pub matched: u64,
    /// Items replayed (or forgotten) by this run.
    pub done: u64,
    /// Matching items this run left alone: another run or a worker changed
    /// them between the read and the action (replayed already, running,
    /// gone).
    pub skipped: u64,
    /// Whether the run is over (finished, cancelled or failed).
    pub finished: bool,
    /// Whether it stopped because it was cancelled.
    pub cancelled: bool,
    /// The error it stopped on, if one.
    pub error: Option<String>,
}

/// One bulk action over the items matching a filter: [`run`](Self::run) it
/// (on a task of its own), read its [`progress`](Self::progress) from
/// anywhere, [`cancel`](Self::cancel) it between two items.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use dedupe_core::{Bulk, BulkAction, DedupeStore, Inbox, ItemFilter, ItemStatus, Key, MemoryStore, Retry};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let inbox = MemoryStore::new();
/// for id in ["evt_1", "evt_2"] {
///     inbox.accept(&Key::new("stripe", id)?, b"{}").await?;
/// }
/// for taken in inbox.take("stripe", 10, Duration::from_secs(30)).await? {
///     inbox.fail(&taken.lease, "HTTP 404 from the API", Retry::dead()).await?;
/// }
/// let filter = ItemFilter::new("stripe").status(ItemStatus::Dead).error("404");
/// let bulk = Bulk::new(filter, BulkAction::Replay);
/// bulk.run(&inbox).await;
/// let progress = bulk.progress();
/// assert_eq!((progress.matched, progress.done, progress.finished), (2, 2, true));
/// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug)]
pub struct Bulk {
    filter: ItemFilter,
    action: BulkAction,
    scanned: AtomicU64,
    matched: AtomicU64,
    done: AtomicU64,
    skipped: AtomicU64,
    finished: AtomicBool,
    cancel: AtomicBool,
    /// Whether the run stopped because it was cancelled (a cancel after
    /// the end changes nothing).
    cancelled: AtomicBool,
    error: Mutex<Option<String>>,
}

impl Bulk {
    /// A run of `action` over the items matching `filter`, not started.
    pub fn new(filter: ItemFilter, action: BulkAction) -> Self {
        Self {
            filter,
            action,
            scanned: AtomicU64::new(0),
            matched: AtomicU64::new(0),
            done: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            finished: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
            error: Mutex::new(None),
        }
    }

    /// Its filter.
    pub fn filter(&self) -> &ItemFilter {
        &self.filter
    }

    /// Its action.
    pub fn action(&self) -> BulkAction {
        self.action
    }

    /// Asks it to stop before its next item.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Where it stands.
    pub fn progress(&self) -> BulkProgress {
        let finished = self.finished.load(Ordering::SeqCst);
        BulkProgress {
            scanned: self.scanned.load(Ordering::SeqCst),
            matched: self.matched.load(Ordering::SeqCst),
            done: self.done.load(Ordering::SeqCst),
            skipped: self.skipped.load(Ordering::SeqCst),
            finished,
            cancelled: self.cancelled.load(Ordering::SeqCst),
            error: self
                .error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        }
    }

    /// Runs it to the end, a page of [`MAX_PAGE`] items at a time: each
    /// matching item replayed (or forgotten) by one atomic call. Stops at the
    /// first error, said in the progress; what it did before stays done.
    pub async fn run(&self, inbox: &dyn Inbox) {
        let ran = self.pages(inbox).await;
        if let Err(e) = ran {
            tracing::warn!(namespace = %self.filter.namespace, action = self.action.as_str(), error = %e, "bulk action stopped");
            *self
                .error
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e.to_string());
        }
        self.finished.store(true, Ordering::SeqCst);
    }

    async fn pages(&self, inbox: &dyn Inbox) -> Result<()> {
        let mut after = None;
        loop {
            if self.cancel.load(Ordering::SeqCst) {
                self.cancelled.store(true, Ordering::SeqCst);
                return Ok(());
            }
            let found = search_items(inbox, &self.filter, after, MAX_PAGE, MAX_PAGE as u64).await?;
            self.scanned.fetch_add(found.scanned, Ordering::SeqCst);
            for item in found.items {
                if self.cancel.load(Ordering::SeqCst) {
                    self.cancelled.store(true, Ordering::SeqCst);
                    return Ok(());
                }
                self.matched.fetch_add(1, Ordering::SeqCst);
                let acted = match self.action {
                    BulkAction::Replay => inbox.replay(&item.key).await?,
                    // Only as it was read: an item replayed by another
                    // operator, or taken by a worker, since is kept.
                    BulkAction::Forget => {
                        inbox
                            .forget_if(&item.key, item.status, item.attempts)
                            .await?
                    }
                };
                if acted && self.action == BulkAction::Replay {
                    crate::count_inbox_outcome(&self.filter.namespace, "replayed");
                }
                let counter = if acted { &self.done } else { &self.skipped };
                counter.fetch_add(1, Ordering::SeqCst);
            }
            match found.next {
                Some(next) => after = Some(next),
                None => return Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStore, Retry};

    /// 400 items, every third dead with a 502: a search a page at a time
    /// finds each match once, never reads past its budget, says where to go
    /// on, and gives no cursor when its budget runs out on the namespace's
    /// last item.
    #[tokio::test]
    async fn searches_page_through_every_match_once_within_their_budget() {
        let inbox = MemoryStore::new();
        for i in 0..400 {
            let key = Key::new("s", format!("evt_{i:03}")).expect("key");
            inbox.accept(&key, b"{}").await.expect("accept");
        }
        loop {
            let taken = inbox
                .take("s", crate::MAX_TAKE, std::time::Duration::from_secs(60))
                .await
                .expect("take");
            if taken.is_empty() {
                break;
            }
            for t in taken {
                let n: usize = t.lease.key.id()[4..].parse().expect("number");
                let error = if n.is_multiple_of(3) {
                    "HTTP 502"
                } else {
                    "HTTP 404"
                };
                inbox
                    .fail(&t.lease, error, Retry::dead())
                    .await
                    .expect("fail");
            }
        }
        let filter = ItemFilter::new("s").status(ItemStatus::Dead).error("502");
        let (mut after, mut seen, mut pages) = (None, Vec::new(), 0);
        loop {
            let found = search_items(&inbox, &filter, after, 40, 100)
                .await
                .expect("search");
            pages += 1;
            assert!(
                found.scanned <= 100,
                "read {} past a budget of 100",
                found.scanned
            );
            assert!(found.items.len() <= 40);
            seen.extend(found.items.iter().map(|i| i.key.id().to_string()));
            match found.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let expected: Vec<String> = (0..400)
            .filter(|n: &usize| n.is_multiple_of(3))
            .map(|n| format!("evt_{n:03}"))
            .collect();
        assert_eq!(seen, expected, "each match once, in id order");
        // 100 read a page: 4 pages, the last ending on the last item with no
        // cursor (no fifth, empty page).
        assert_eq!(pages, 4);
        assert_eq!(count_items(&inbox, &filter).await.expect("count"), 134);
        let refused = search_items(&inbox, &filter, None, 0, 100).await;
        assert!(matches!(refused, Err(Error::InvalidConfig { .. })));
    }
}
