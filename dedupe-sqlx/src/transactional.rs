//! The transactional claim, named once for both stores over sqlx.

use std::time::Duration;

use dedupe_core::{
    async_trait, AcceptOptions, Accepted, ClaimOptions, ClaimOutcome, DedupeStore, Inbox, Key,
    Lease, Result,
};

/// The connection type of a store's database.
pub type ConnectionOf<S> = <<S as Transactional>::Database as sqlx::Database>::Connection;

/// A store over sqlx whose claim, completion and release can run on the
/// caller's own connection or transaction, so that the claim, the caller's
/// business writes and the completion commit together or not at all.
///
/// [`PgStore`](https://docs.rs/dedupe-postgres) and
/// [`MySqlStore`](https://docs.rs/dedupe-mysql) implement it (their inherent
/// `claim_in` / `complete_in` / `release_in` are the same calls). Code that
/// runs on either database is written once against this trait: the
/// transactional tests of this crate and `dedupe serve`'s ledger are.
///
/// The calls are not bounded by the store's timeout: the caller owns the
/// transaction. A concurrent transaction claiming the same key waits on the
/// record's row until this one ends, then sees it done (commit) or claims it
/// (rollback).
///
/// ```no_run
/// use std::time::Duration;
///
/// use dedupe_core::{ClaimOptions, ClaimOutcome, Error, Key};
/// use dedupe_sqlx::Transactional;
///
/// /// Runs `event`'s work once, on Postgres or MySQL alike: the claim and
/// /// the completion commit with whatever `work` wrote on the transaction.
/// async fn once<S: Transactional>(store: &S, event: &str) -> dedupe_core::Result<bool> {
///     let driver = |e| Error::retryable("transaction", Some(Box::new(e) as _));
///     let mut tx = store.pool().begin().await.map_err(driver)?;
///     let key = Key::new("stripe", event)?;
///     let ClaimOutcome::Claimed(lease) =
///         store.claim_in(&mut tx, &key, &ClaimOptions::default()).await?
///     else {
///         return Ok(false); // done before, or in flight elsewhere
///     };
///     // ... the business writes, on `&mut *tx` ...
///     let day = Duration::from_secs(86_400);
///     store.complete_in(&mut tx, &lease, b"done", day).await?;
///     tx.commit().await.map_err(driver)?;
///     Ok(true)
/// }
///
/// # async fn run() -> dedupe_core::Result<()> {
/// let pg = dedupe_postgres::PgStore::connect("postgres://localhost/app").await?;
/// once(&pg, "evt_1").await?;
/// let my = dedupe_mysql::MySqlStore::connect("mysql://localhost/app").await?;
/// once(&my, "evt_1").await?;
/// # Ok(())
/// # }
/// ```
#[async_trait]
pub trait Transactional: DedupeStore + Inbox + Clone + 'static {
    /// The sqlx database the store runs on.
    type Database: sqlx::Database;

    /// The pool the store's own calls use; the caller's transactions may
    /// come from it too.
    fn pool(&self) -> &sqlx::Pool<Self::Database>;

    /// Claims `key` on the caller's connection or transaction (`&mut *tx`).
    async fn claim_in(
        &self,
        conn: &mut ConnectionOf<Self>,
        key: &Key,
        opts: &ClaimOptions,
    ) -> Result<ClaimOutcome>;

    /// Completes `lease` with `outcome` on the caller's connection or
    /// transaction, kept for `retention`.
    async fn complete_in(
        &self,
        conn: &mut ConnectionOf<Self>,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()>;

    /// Releases `lease` on the caller's connection or transaction.
    async fn release_in(&self, conn: &mut ConnectionOf<Self>, lease: &Lease) -> Result<()>;

    /// Accepts `payload` into the inbox under `key` on the caller's
    /// transaction (the outbox half): the item and the caller's writes
    /// commit together or not at all; a rollback leaves the key new.
    async fn accept_in(
        &self,
        conn: &mut ConnectionOf<Self>,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted>;
}
