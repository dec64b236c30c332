//! Building a store on a pool.

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{Capabilities, Error, Result};
use sqlx::MySqlPool;

use crate::sql::Statements;
use crate::store::MySqlStore;
use dedupe_sqlx::Kept;

/// Settings of a [`MySqlStore`] on a pool.
#[derive(Debug, Clone)]
pub struct MySqlBuilder {
    pool: MySqlPool,
    table: String,
    timeout: Duration,
    max_outcome_bytes: usize,
    keep: usize,
}

impl MySqlBuilder {
    pub(crate) fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            table: MySqlStore::DEFAULT_TABLE.into(),
            timeout: MySqlStore::DEFAULT_TIMEOUT,
            max_outcome_bytes: dedupe_core::DEFAULT_MAX_OUTCOME_BYTES,
            keep: 0,
        }
    }

    /// The table (default `dedupe_records`), in the pool's database: a letter
    /// or `_`, then letters, digits or `_`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a call may take, in all (default 5 s): past it the call
    /// fails with a retryable `Timeout`. On a pool from
    /// [`MySqlStore::connect_pool`] the server stops a statement running
    /// longer (MariaDB's `max_statement_time`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB; the server's
    /// `max_allowed_packet`, 16 MiB on MariaDB and 64 MiB on MySQL by
    /// default, must hold it with the statement around it).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// How many finished connections the store keeps out of the pool for its
    /// next calls (default 0). A connection going back to a sqlx pool is
    /// pinged first, a third round trip after a claim's two; a kept one is
    /// handed to the next call as it is (claims from one task 2,082/s
    /// through the pool, 2,467/s kept, on MariaDB here). A kept connection
    /// holds its pool slot: keep fewer than the pool has when anything else
    /// uses the pool (your transactions, `claim_in`), all of them when the
    /// pool is the store's alone.
    pub fn keep_connections(mut self, keep: usize) -> Self {
        self.keep = keep;
        self
    }

    /// Validates the names and builds the store. No I/O: call
    /// [`MySqlStore::migrate`] to create the table.
    pub fn build(self) -> Result<MySqlStore> {
        if self.timeout < Duration::from_millis(1) {
            return Err(Error::config("timeout must be at least 1 ms"));
        }
        Ok(MySqlStore {
            wakeups: Default::default(),
            pool: self.pool,
            sql: Arc::new(Statements::new(&self.table)?),
            timeout: self.timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
            kept: Arc::new(Kept::new(self.keep)),
            first: Arc::default(),
        })
    }
}
