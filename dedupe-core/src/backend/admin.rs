//! The store-wide operations the tools run, implemented by each store in its
//! own crate.

use std::fmt;

use async_trait::async_trait;

use crate::error::Error;

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
