//! The inbox (CONTRACT.md I1 to I16) in the records table: its `Inbox`
//! implementation, and the statements it runs on a connection of the store's.

use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{
    self, accept_columns, accepted_over, check_accept, check_namespace, check_take, check_ttl,
    cut_error, duration_millis, new_tokens, one_row_changed, status_code, stored_counts,
    StoredCounts, StoredItem, StoredTaken,
};
use dedupe_core::{
    AcceptOptions, Accepted, Error, Inbox, InboxCounts, Item, ItemPage, ItemQuery, Key, Lease,
    Result, Retry, Taken, Wake, WhenDead, ORDER_SCAN,
};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, Connection, MySqlConnection, Row};

use crate::ops::{Ops, TxError, DEADLOCK_RETRIES};
use crate::store::MySqlStore;

impl MySqlStore {
    /// Accepts `payload` under `key` inside the caller's transaction
    /// (`&mut *tx`: the outbox half, CONTRACT.md I1 and "Transactions"): the
    /// item and the application's own writes commit together or not at all.
    /// "Charge recorded, follow-up queued": both, or neither. Answers as
    /// [`Inbox::accept_with`] does. The item is taken only once the
    /// transaction commits; a rollback, or a connection lost before the
    /// commit, leaves no item, so the key is new again. A concurrent accept
    /// of the key waits on its row until this transaction ends, then answers
    /// the item (commit) or stores its own (rollback). This process's
    /// workers are woken at once (before your commit: they find the item at
    /// their next poll, 250 ms by default, if they look too early), other
    /// processes' at their poll. Not bounded by the store's timeout; a
    /// deadlock rolled the caller's whole transaction back and is answered
    /// as a retryable error.
    ///
    /// ```no_run
    /// use dedupe_core::{AcceptOptions, Error, Key};
    /// use dedupe_mysql::MySqlStore;
    /// # async fn run() -> dedupe_core::Result<()> {
    /// let store = MySqlStore::connect("mysql://localhost/app").await?;
    /// let driver = |e| Error::retryable("transaction", Some(Box::new(e) as _));
    /// let mut tx = store.pool().begin().await.map_err(driver)?;
    /// dedupe_mysql::sqlx::query("INSERT INTO charges (id) VALUES ('ch_1')")
    ///     .execute(&mut *tx)
    ///     .await
    ///     .map_err(driver)?;
    /// let key = Key::new("receipts", "ch_1")?;
    /// store.accept_in(&mut tx, &key, b"send the receipt", &AcceptOptions::new()).await?;
    /// tx.commit().await.map_err(driver)?;
    /// # Ok(())
    /// # }
    /// ```
    #[tracing::instrument(name = "dedupe.accept_in", skip_all, fields(store = "mysql", key = %key), err)]
    pub async fn accept_in(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let accepted = self.ops(true).accept(conn, key, payload, options).await?;
        if accepted.is_new() {
            self.wakeups.raise(key.namespace());
        }
        Ok(accepted)
    }
}

/// The inbox in the records table (migration 0002): an item is a row with a
/// payload and a `wait` state (0 held by a worker, 1 due, 2 dead). `accept`
/// is the claim's upsert with the item's columns; `take` locks the oldest
/// due items of a namespace with `FOR UPDATE SKIP LOCKED` (on the `due`
/// index, read in order) and leases them in the same transaction, so racing
/// takers never wait on each other and never share an item; every other
/// change is one `UPDATE` fenced by the token and the deadline. Each call
/// commits before it answers: an accepted delivery is as durable as a
/// completion.
#[async_trait]
impl Inbox for MySqlStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let accepted = self
            .call(async |ops, conn| ops.accept(conn, key, payload, options).await)
            .await?;
        if accepted == Accepted::New {
            self.wakeups.raise(key.namespace());
        }
        Ok(accepted)
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        check_take(max, lease)?;
        self.call(async |ops, conn| ops.take(conn, namespace, max, lease).await)
            .await
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        check_ttl("snooze delay", delay)?;
        self.call(async |ops, conn| ops.snooze(conn, lease, delay).await)
            .await
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        retry.validate()?;
        self.call(async |ops, conn| ops.fail(conn, lease, error, retry).await)
            .await
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        self.call(async |ops, conn| ops.item(conn, key).await).await
    }

    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        query.validate()?;
        self.call(async |ops, conn| ops.list(conn, query).await)
            .await
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let replayed = self
            .call(async |ops, conn| ops.replay(conn, key).await)
            .await?;
        if replayed {
            self.wakeups.raise(key.namespace());
        }
        Ok(replayed)
    }

    async fn forget_if(
        &self,
        key: &Key,
        status: dedupe_core::ItemStatus,
        attempts: u32,
    ) -> Result<bool> {
        self.call(async |ops, conn| ops.forget_if(conn, key, status, attempts).await)
            .await
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        self.call(async |ops, conn| ops.counts(conn, namespace).await)
            .await
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        self.call(async |ops, conn| ops.changes(conn, &ops.sql.pause, namespace).await)
            .await
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let resumed = self
            .call(async |ops, conn| ops.changes(conn, &ops.sql.resume, namespace).await)
            .await?;
        if resumed {
            self.wakeups.raise(namespace);
        }
        Ok(resumed)
    }

    /// In this process only: MySQL has no notifications, so the workers
    /// of a handle hear its own (and its clones') changes at once, and
    /// another process's at their poll.
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        check_namespace(namespace)?;
        Ok(Wake::in_process(self.wakeups.signal(namespace)))
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        self.call(async |ops, conn| {
            let paused: i64 = sqlx::query_scalar(AssertSqlSafe(ops.sql.paused.as_str()))
                .bind(namespace.as_bytes())
                .fetch_one(conn)
                .await
                .map_err(|e| ops.err(e))?;
            Ok(paused == 1)
        })
        .await
    }
}

/// A row of `sql::ITEM` columns, from column `at` on, as an [`Item`] of
/// `namespace`.
fn decode_item(namespace: &str, row: &MySqlRow, at: usize) -> Result<Item> {
    let read = || -> std::result::Result<_, sqlx::Error> {
        Ok((
            row.try_get::<Vec<u8>, _>(at)?,
            row.try_get::<i64, _>(at + 1)?,
            row.try_get::<i64, _>(at + 2)?,
            row.try_get::<i64, _>(at + 3)?,
            row.try_get::<i64, _>(at + 4)?,
            row.try_get::<Option<Vec<u8>>, _>(at + 5)?,
            row.try_get::<Option<Vec<u8>>, _>(at + 6)?,
            StoredCounts {
                takeovers: row.try_get::<i64, _>(at + 7)?,
                max_attempts: row.try_get::<Option<i64>, _>(at + 8)?,
            },
            row.try_get::<Option<Vec<u8>>, _>(at + 9)?,
            row.try_get::<Option<String>, _>(at + 10)?,
        ))
    };
    let (
        id,
        wait,
        attempts,
        accepted_ms,
        due_ms,
        last_error,
        payload,
        counts,
        ordering_key,
        errors,
    ) = read().map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?;
    StoredItem {
        id: utf8(id, "an inbox item's id")?,
        wait,
        attempts,
        accepted_ms,
        due_ms,
        last_error: last_error
            .map(|e| utf8(e, "an inbox item's error"))
            .transpose()?,
        payload,
        counts,
        ordering_key: ordering_key
            .map(|k| utf8(k, "an inbox item's ordering key"))
            .transpose()?,
        errors,
    }
    .decode(namespace)
}

fn utf8(bytes: Vec<u8>, what: &str) -> Result<String> {
    String::from_utf8(bytes).map_err(|_| Error::fatal(format!("{what} is not UTF-8"), None))
}

/// The inbox's statements (CONTRACT.md I1 to I16).
impl Ops<'_> {
    /// The upsert, then the row read back: its token says whether this
    /// accept wrote it.
    pub(crate) async fn accept(
        &self,
        conn: &mut MySqlConnection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        let token = backend::new_token();
        let (delay, max_attempts) = accept_columns(options);
        let mut tries = 0;
        // A deadlock rolled the upsert back whole (a take's locks on the
        // `due` index meet the insert's): on the store's own connections it
        // is sent again, as the claim's upsert is.
        while let Err(e) = sqlx::query(AssertSqlSafe(self.sql.accept.as_str()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .bind(token.as_str().as_bytes())
            .bind(delay)
            .bind(payload)
            .bind(delay)
            .bind(max_attempts)
            .bind(options.ordering_key.as_deref().map(str::as_bytes))
            .bind(options.ordering_key.as_deref().map(str::as_bytes))
            .bind(key.namespace().as_bytes())
            .bind(options.ordering_key.as_deref().map(str::as_bytes))
            .bind(options.when_dead == WhenDead::Skip)
            .bind(token.as_str().as_bytes())
            .execute(&mut *conn)
            .await
        {
            match self.tx_err(e) {
                TxError::Deadlock(_) if !self.in_transaction && tries < DEADLOCK_RETRIES => {
                    tries += 1;
                    tracing::debug!(tries, "inbox accept deadlocked; sending it again");
                }
                TxError::Deadlock(e) => return Err(self.err(e)),
                TxError::Other(e) => return Err(e),
            }
        }
        let row = sqlx::query(AssertSqlSafe(self.sql.accepted.as_str()))
            .bind(token.as_str().as_bytes())
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        if let Some(row) = row {
            let ours: bool = row
                .try_get(0)
                .map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?;
            if ours {
                return Ok(Accepted::New);
            }
            return decode_item(key.namespace(), &row, 1).map(Accepted::Item);
        }
        match self.read(conn, key).await? {
            Some(record) => Ok(accepted_over(record)),
            // Completed, released or forgotten between the two statements.
            None => Err(Error::retryable(
                "the key's record changed between the accept and its read-back; retry",
                None,
            )),
        }
    }

    /// In one transaction: the due items picked and locked, then leased in
    /// one statement. A deadline is the pick's `NOW` plus the lease, a
    /// moment before the lease statement runs: never later than promised.
    /// Leases up to `max` items. A pick that parked items its ordering key
    /// holds back (I15) instead of filling the take is followed by one
    /// park of the front of the namespace and a pick again, until the take
    /// is full or a pick parks nothing: every statement reads a bounded
    /// number of rows, and each held-back item is read by the picks running
    /// when it falls due, then not again until its key moves.
    pub(crate) async fn take(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Taken>> {
        let mut taken = Vec::new();
        let mut tries = 0;
        // The next transaction: a pick (false) or a park of the front.
        let mut park = false;
        loop {
            let step = if park {
                self.park_front(conn, namespace, max).await.map(|parked| {
                    tracing::debug!(
                        namespace,
                        parked,
                        "take parked items their ordering keys hold back"
                    );
                    true
                })
            } else {
                self.take_once(conn, namespace, max - taken.len(), lease)
                    .await
                    .map(|(more, parked)| {
                        taken.extend(more);
                        parked > 0 && taken.len() < max
                    })
            };
            match step {
                // A park is followed by a pick.
                Ok(true) => {
                    park = !park;
                    tries = 0;
                }
                Ok(false) => return Ok(taken),
                // Rolled back whole: it runs again.
                Err(TxError::Deadlock(_)) if tries < DEADLOCK_RETRIES => {
                    tries += 1;
                    tracing::debug!(tries, "inbox take deadlocked; running it again");
                }
                Err(TxError::Deadlock(e)) => return Err(self.err(e)),
                Err(TxError::Other(e)) => return Err(e),
            }
        }
    }

    /// Parks the held-back items among the first `max + ORDER_SCAN` due
    /// items of `namespace` that no one else holds; answers how many.
    async fn park_front(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
        max: usize,
    ) -> std::result::Result<u64, TxError> {
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let ids: Vec<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(self.sql.park_front.as_str()))
            .bind(namespace.as_bytes())
            .bind(namespace.as_bytes())
            .bind(u64::try_from(max + ORDER_SCAN).unwrap_or(u64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.tx_err(e))?;
        let parked = self.park(&mut tx, namespace, &ids).await?;
        tx.commit().await.map_err(|e| self.tx_err(e))?;
        Ok(parked)
    }

    /// Parks the items `ids` of `namespace`, which the caller's transaction
    /// holds.
    async fn park(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
        ids: &[Vec<u8>],
    ) -> std::result::Result<u64, TxError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = self.sql.park_ids(ids.len());
        let mut statement = sqlx::query(AssertSqlSafe(sql.as_str())).bind(namespace.as_bytes());
        for id in ids {
            statement = statement.bind(id.as_slice());
        }
        Ok(statement
            .execute(conn)
            .await
            .map_err(|e| self.tx_err(e))?
            .rows_affected())
    }

    async fn take_once(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
        max: usize,
        lease: Duration,
    ) -> std::result::Result<(Vec<Taken>, u64), TxError> {
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let picked = sqlx::query(AssertSqlSafe(self.sql.pick.as_str()))
            .bind(namespace.as_bytes())
            .bind(namespace.as_bytes())
            .bind(u64::try_from(max).unwrap_or(u64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.tx_err(e))?;
        let mut rows = Vec::with_capacity(picked.len());
        let mut held_back = Vec::new();
        for row in &picked {
            let blocked = row
                .try_get::<Option<i64>, _>(10)
                .map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?;
            if blocked == Some(1) {
                held_back.push(
                    row.try_get::<Vec<u8>, _>(0)
                        .map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?,
                );
                continue;
            }
            let read = || -> std::result::Result<_, sqlx::Error> {
                Ok((
                    row.try_get::<Vec<u8>, _>(0)?,
                    row.try_get::<i64, _>(1)?,
                    row.try_get::<Option<Vec<u8>>, _>(2)?,
                    row.try_get::<Option<Vec<u8>>, _>(3)?,
                    row.try_get::<i64, _>(4)?,
                    StoredCounts {
                        // Counted by the lease below when it was held.
                        takeovers: row.try_get::<i64, _>(6)?
                            + i64::from(row.try_get::<i64, _>(5)? == 0),
                        max_attempts: row.try_get::<Option<i64>, _>(7)?,
                    },
                    row.try_get::<i64, _>(8)?,
                    row.try_get::<Option<Vec<u8>>, _>(9)?,
                ))
            };
            rows.push(
                read().map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?,
            );
        }
        let parked = self.park(&mut tx, namespace, &held_back).await?;
        if rows.is_empty() {
            tx.commit().await.map_err(|e| self.tx_err(e))?;
            return Ok((Vec::new(), parked));
        }
        let deadline = rows[0].4.saturating_add(duration_millis(lease));
        let tokens = new_tokens(rows.len());
        let sql = self.sql.lease_taken(rows.len());
        let mut statement = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(deadline)
            .bind(deadline);
        for ((id, ..), token) in rows.iter().zip(&tokens) {
            statement = statement
                .bind(id.as_slice())
                .bind(token.as_str().as_bytes());
        }
        statement = statement.bind(namespace.as_bytes());
        for (id, ..) in &rows {
            statement = statement.bind(id.as_slice());
        }
        let leased = statement
            .execute(&mut *tx)
            .await
            .map_err(|e| self.tx_err(e))?
            .rows_affected();
        if leased != rows.len() as u64 {
            // Locked rows cannot change under us: this is not a race.
            return Err(Error::fatal(
                format!(
                    "a take leased {leased} of the {} items it locked",
                    rows.len()
                ),
                None,
            )
            .into());
        }
        tx.commit().await.map_err(|e| self.tx_err(e))?;
        let taken: Result<Vec<Taken>> = rows
            .into_iter()
            .zip(tokens)
            .map(
                |(
                    (id, attempts, payload, last_error, _, counts, accepted, ordering_key),
                    token,
                )| {
                    let key = Key::new(namespace, utf8(id, "an inbox item's id")?)?;
                    let last_error = last_error
                        .map(|e| utf8(e, "an inbox item's error"))
                        .transpose()?;
                    let ordering_key = ordering_key
                        .map(|k| utf8(k, "an inbox item's ordering key"))
                        .transpose()?;
                    StoredTaken {
                        token: token.to_string(),
                        deadline_ms: deadline,
                        attempt: attempts.saturating_add(1),
                        accepted_ms: accepted,
                        last_error,
                        payload,
                        counts,
                        ordering_key,
                    }
                    .decode(key)
                },
            )
            .collect();
        Ok((taken?, parked))
    }

    pub(crate) async fn snooze(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        delay: Duration,
    ) -> Result<()> {
        let delay = duration_millis(delay);
        let statement = sqlx::query(AssertSqlSafe(self.sql.snooze.as_str()))
            .bind(delay)
            .bind(delay);
        let changed = self.fenced(conn, statement, lease).await?;
        one_row_changed(changed, &lease.key)
    }

    pub(crate) async fn fail(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        error: &str,
        retry: Retry,
    ) -> Result<()> {
        let (wait, delay) = match retry {
            Retry::After(delay) => (1i8, delay),
            Retry::Dead { .. } => (2i8, Duration::ZERO),
        };
        // NULL (kept until forgotten, or not dead) makes `now + ?` NULL.
        let keep = match retry {
            Retry::Dead { keep } => keep.map(duration_millis),
            Retry::After(_) => None,
        };
        let error = cut_error(error);
        let delay = duration_millis(delay);
        let statement = sqlx::query(AssertSqlSafe(self.sql.fail.as_str()))
            .bind(error.as_bytes())
            .bind(delay)
            .bind(wait)
            .bind(delay)
            .bind(keep)
            .bind(error.as_str())
            .bind(wait);
        let statement = statement
            .bind(lease.key.namespace().as_bytes())
            .bind(lease.key.id().as_bytes())
            .bind(lease.token.as_str().as_bytes())
            .bind(wait)
            .bind(error.as_bytes());
        if wait == 1 {
            let changed = statement
                .execute(conn)
                .await
                .map_err(|e| self.err(e))?
                .rows_affected();
            return one_row_changed(changed, &lease.key);
        }
        // Dead, and to be skipped: the item leaves its ordering key's queue,
        // and in the same transaction the next one is made the key's head.
        let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
        let changed = statement
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        one_row_changed(changed, &lease.key)?;
        let skipped: Option<Vec<u8>> =
            sqlx::query_scalar(AssertSqlSafe(self.sql.skipped_key.as_str()))
                .bind(lease.key.namespace().as_bytes())
                .bind(lease.key.id().as_bytes())
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
        if let Some(order_key) = skipped {
            self.promote(&mut tx, lease.key.namespace(), &order_key)
                .await?;
        }
        tx.commit().await.map_err(|e| self.err(e))
    }

    pub(crate) async fn item(&self, conn: &mut MySqlConnection, key: &Key) -> Result<Option<Item>> {
        let row = sqlx::query(AssertSqlSafe(self.sql.select_item.as_str()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| decode_item(key.namespace(), &row, 0))
            .transpose()
    }

    pub(crate) async fn list(
        &self,
        conn: &mut MySqlConnection,
        query: &ItemQuery,
    ) -> Result<ItemPage> {
        let status = status_code(query.status);
        let mut statement = sqlx::query(AssertSqlSafe(self.sql.list.as_str()))
            .bind(query.namespace.as_bytes())
            .bind(query.after.as_deref().unwrap_or("").as_bytes());
        for _ in 0..5 {
            statement = statement.bind(status);
        }
        let rows = statement
            .bind(u64::try_from(query.limit + 1).unwrap_or(u64::MAX))
            .fetch_all(conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut items = rows
            .iter()
            .map(|row| decode_item(&query.namespace, row, 0))
            .collect::<Result<Vec<_>>>()?;
        let next = (items.len() > query.limit).then(|| items[query.limit - 1].key.id().to_string());
        items.truncate(query.limit);
        Ok(ItemPage::new(items, next))
    }

    pub(crate) async fn replay(&self, conn: &mut MySqlConnection, key: &Key) -> Result<bool> {
        Ok(sqlx::query(AssertSqlSafe(self.sql.replay.as_str()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected()
            > 0)
    }

    /// Runs a pause or resume: `true` when it changed a row.
    pub(crate) async fn changes(
        &self,
        conn: &mut MySqlConnection,
        statement: &str,
        namespace: &str,
    ) -> Result<bool> {
        Ok(sqlx::query(AssertSqlSafe(statement))
            .bind(namespace.as_bytes())
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected()
            == 1)
    }

    pub(crate) async fn counts(
        &self,
        conn: &mut MySqlConnection,
        namespace: &str,
    ) -> Result<InboxCounts> {
        let row = sqlx::query(AssertSqlSafe(self.sql.counts.as_str()))
            .bind(namespace.as_bytes())
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))?;
        let read = || -> std::result::Result<_, sqlx::Error> {
            Ok((
                row.try_get::<i64, _>(0)?,
                row.try_get::<i64, _>(1)?,
                row.try_get::<i64, _>(2)?,
                row.try_get::<i64, _>(3)?,
                row.try_get::<Option<i64>, _>(4)?,
            ))
        };
        let (pending, running, failed, dead, oldest) =
            read().map_err(|e| Error::fatal(format!("undecodable counts: {e}"), None))?;
        Ok(stored_counts(pending, running, failed, dead, oldest))
    }
}
