//! The store's settings, and building it from them.

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{Capabilities, Error, Result};
use sqlx::PgPool;

use crate::sql::Statements;
use crate::store::PgStore;
use dedupe_sqlx::Kept;

/// Settings of a [`PgStore`]; start with [`PgStore::builder`].
#[derive(Debug, Clone)]
pub struct PgBuilder {
    pub(crate) pool: PgPool,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) timeout: Duration,
    pub(crate) max_outcome_bytes: usize,
    pub(crate) keep: usize,
}

impl PgBuilder {
    /// Schema of the table (default `public`); a plain identifier.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Table name (default `dedupe_records`); a plain identifier.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Bound on each operation (default 5 s). Past it the operation fails with a
    /// retryable [`Error::Timeout`].
    ///
    /// On a pool from [`PgStore::connect_pool`] the server enforces it as
    /// `statement_timeout`: it cancels the statement, so a timed-out statement has
    /// changed nothing. The client gives up only [`PgStore::BACKSTOP`] later, when
    /// the server did not answer at all; only then is the effect unknown (retry
    /// with the same claim id). A claim that takes more than one statement (see
    /// [`PgStore`]) is bounded as a whole: should it time out after its first
    /// statement, that statement has committed or changed nothing on its own,
    /// and the last one may have won the key unanswered; retry with the same
    /// claim id to get such a lease back. On a pool of your own, set `statement_timeout` on
    /// its connections to get the same guarantee.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Keeps up to `n` connections checked out of the pool between calls
    /// (default 0 on a pool you bring; [`PgStore::connect`] holds half of its
    /// ten, leaving the rest to transactions on [`PgStore::pool`]). Drop the
    /// store before closing its pool: `close()` waits for held connections. sqlx tests each connection with a round trip as it goes back to
    /// the pool, before anyone may take it again; a held connection skips that
    /// and goes to the next call directly, which makes a call one round trip
    /// instead of two (measured by `dedupe bench`). Held connections are not
    /// available to other users of the pool: hold only what the pool can
    /// spare, all of them on a pool the store has to itself. A connection
    /// whose call failed is never held.
    pub fn keep_connections(mut self, n: usize) -> Self {
        self.keep = n;
        self
    }

    /// Validates the names and builds the store. No I/O: call
    /// [`PgStore::migrate`] to create the table.
    pub fn build(self) -> Result<PgStore> {
        let sql = Statements::new(&self.schema, &self.table)?;
        // statement_timeout is whole milliseconds, and 0 turns it off.
        if self.timeout < Duration::from_millis(1) {
            return Err(Error::config("timeout must be at least 1 ms"));
        }
        let wake = crate::wake::subscribe(
            &self.pool,
            crate::wake::topic_prefix(&self.schema, &self.table),
            self.timeout,
        );
        let notices = crate::wake::Notices::of(
            &self.pool,
            &crate::wake::topic_prefix(&self.schema, &self.table),
        );
        Ok(PgStore {
            wake,
            notices,
            first: Arc::default(),
            kept: Arc::new(Kept::new(self.keep)),
            pool: self.pool,
            sql: Arc::new(sql),
            timeout: self.timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
        })
    }
}
