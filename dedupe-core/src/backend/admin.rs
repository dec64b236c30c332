//! The store-wide operations the tools run, implemented by each store in its
//! own crate.

use std::fmt;

use async_trait::async_trait;

use crate::error::Error;
use crate::key::Key;

/// What the tools do to a store as a whole, beside its records: make its
/// tables, remove a namespace a run made for itself, say how durable it is.
/// Each store implements it once, in its own crate (`admin.rs`);
/// `dedupe-url` hands it out with the store, and `dedupe` (bench, race,
/// conformance, soak) prepares and cleans up through it.
///
/// ```
/// use dedupe_core::backend::Admin;
/// use dedupe_core::MemoryStore;
/// # async fn run() -> Result<(), dedupe_core::Error> {
/// let admin: &dyn Admin = &MemoryStore::new();
/// admin.migrate().await?; // nothing to make: the records live in the process
/// admin.check().await?;
/// assert_eq!(admin.durability().await, None);
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
/// ```
#[async_trait]
pub trait Admin: Send + Sync + fmt::Debug {
    /// Makes the store's tables, schema or keyspace ready; safe to run again
    /// and from several processes at once.
    async fn migrate(&self) -> Result<(), Error>;

    /// Checks, writing nothing, that the store's file, schema and tables
    /// exist and are at the current migration: the read-only tools
    /// (`dedupe inspect`, `dedupe inbox list`, ...) run it where the others
    /// run [`migrate`](Self::migrate), so a typo in a URL creates nothing.
    /// What is missing is an [`Error::InvalidConfig`] built by [`missing`].
    async fn check(&self) -> Result<(), Error>;

    /// Removes the store's namespace (its SQLite table, its Postgres schema
    /// unless that is `public`, where only its table goes, its MySQL table,
    /// every key under its Redis prefix, its DynamoDB table), with every
    /// record in it. For namespaces a run made for itself; never call it on
    /// a live deployment's.
    async fn remove_namespace(&self) -> Result<(), Error>;

    /// The keys of the store's records (never its inbox items), in pages:
    /// for `dedupe records`, which reads each with `get` (live ones only).
    /// A page may hold fewer keys than the limit and still have a `next`
    /// (a store that pages by what it scanned); the listing ends when
    /// `next` is `None`. Read only; safe while the store is in use (a record written
    /// meanwhile may or may not be listed).
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage, Error>;

    /// One line on what the store promises about keeping records across a
    /// restart, where it can say (Redis: its persistence settings).
    async fn durability(&self) -> Option<String> {
        None
    }
}

/// The error of [`Admin::check`]: `what` (a file, a schema, a table, a
/// migration) is missing, nothing was created, and how to create it.
///
/// ```
/// let e = dedupe_core::backend::missing("no table \"public\".\"dedupe_records\"");
/// assert!(e.to_string().contains("dedupe migrate --store"));
/// ```
pub fn missing(what: impl fmt::Display) -> Error {
    Error::config(format!(
        "{what}; nothing was created: check the URL for a typo, and if the name is \
         right make it with `dedupe migrate --store URL` (or the store's `migrate()`)"
    ))
}

/// Which record keys [`Admin::record_keys`] lists.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordQuery {
    /// One namespace, or every one.
    pub namespace: Option<String>,
    /// Where to go on from: the `next` of the page before (opaque).
    pub after: Option<String>,
    /// About this many keys (1 to [`MAX_RECORD_PAGE`]): at most this many
    /// from a store that pages by key; a store that pages by what it
    /// scanned (Redis' `SCAN`, DynamoDB's `Scan`) answers what one step
    /// found.
    pub limit: usize,
}

/// The most keys one page of [`Admin::record_keys`] holds.
pub const MAX_RECORD_PAGE: usize = 1000;

impl RecordQuery {
    /// The first page of `namespace` (every namespace for `None`), `limit`
    /// keys at most, cut to 1 to [`MAX_RECORD_PAGE`].
    pub fn new(namespace: Option<String>, limit: usize) -> Self {
        Self {
            namespace,
            after: None,
            limit: limit.clamp(1, MAX_RECORD_PAGE),
        }
    }

    /// The page after the one whose `next` was `cursor`.
    pub fn after(mut self, cursor: Option<String>) -> Self {
        self.after = cursor;
        self
    }
}

/// One page of record keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPage {
    /// The keys, in the store's order.
    pub keys: Vec<Key>,
    /// The cursor of the next page; `None` at the end.
    pub next: Option<String>,
}

/// The cursor of a store that lists keys in `namespace:id` order: the last
/// key of a full page.
pub fn key_cursor(keys: &[Key], limit: usize) -> Option<String> {
    (keys.len() >= limit)
        .then(|| keys.last().map(|k| k.to_string()))
        .flatten()
}

/// A cursor of [`key_cursor`] read back as `(namespace, id)`; a bad one is
/// a configuration error.
pub fn parse_key_cursor(cursor: &str) -> Result<(String, String), Error> {
    cursor
        .split_once(':')
        .map(|(ns, id)| (ns.to_string(), id.to_string()))
        .ok_or_else(|| Error::config(format!("{cursor:?} is not a cursor of this store")))
}
