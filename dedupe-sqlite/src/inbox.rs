//! The inbox (CONTRACT.md I1 to I16) in the records table: its `Inbox`
//! implementation, and the statements it runs on a connection.

use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{
    self, accept_columns, check_accept, check_namespace, check_take, check_ttl, cut_error,
    one_row_changed, status_code, stored_counts, StoredCounts, StoredTaken,
};
use dedupe_core::{
    AcceptOptions, Accepted, Error, Inbox, InboxCounts, Item, ItemPage, ItemQuery, Key, Lease,
    Result, Retry, Taken, Wake, WhenDead, ORDER_SCAN,
};
use rusqlite::{named_params, Connection, OptionalExtension};

use crate::codec::read_item;
use crate::ops::{deadline, Ops};
use crate::store::SqliteStore;

impl SqliteStore {
    /// Accepts `payload` under `key` inside the caller's transaction (the
    /// outbox half, CONTRACT.md I1 and "Transactions"): the item, and the
    /// application's own writes on the same file, commit together or not at
    /// all. "Charge recorded, follow-up queued": both, or neither. Answers as
    /// [`Inbox::accept_with`] does; the item is taken only once the
    /// transaction commits, and a rollback (or a crash before the commit)
    /// leaves no item, so the key is new again.
    ///
    /// Start the transaction with [`TransactionBehavior::Immediate`](rusqlite::TransactionBehavior::Immediate)
    /// (it takes the write lock up front: a concurrent accept of the key
    /// waits for the commit, then answers the item, or for the rollback,
    /// then stores its own). This process's workers are woken: a take waits
    /// on the write lock and finds the item when the transaction commits.
    /// Other processes' workers find it at their next poll.
    ///
    /// ```
    /// use dedupe_core::{AcceptOptions, Inbox, Key};
    /// use dedupe_sqlite::SqliteStore;
    /// use rusqlite::TransactionBehavior;
    /// # tokio::runtime::Runtime::new().expect("runtime").block_on(async {
    /// let dir = tempfile::tempdir().expect("dir");
    /// let path = dir.path().join("app.db");
    /// let store = SqliteStore::open(&path).await?;
    /// let mut conn = rusqlite::Connection::open(&path).expect("open");
    /// conn.execute_batch("CREATE TABLE charges (id TEXT PRIMARY KEY)").expect("table");
    /// let tx = conn
    ///     .transaction_with_behavior(TransactionBehavior::Immediate)
    ///     .expect("begin");
    /// tx.execute("INSERT INTO charges VALUES ('ch_1')", []).expect("charge");
    /// let key = Key::new("receipts", "ch_1")?;
    /// let accepted = store.accept_in(&tx, &key, b"send the receipt", &AcceptOptions::new())?;
    /// assert!(accepted.is_new());
    /// tx.commit().expect("commit");
    /// assert!(store.item(&key).await?.is_some());
    /// # Ok::<(), dedupe_core::Error>(()) }).expect("in the example");
    /// ```
    #[tracing::instrument(name = "dedupe.accept_in", skip_all, fields(store = "sqlite", key = %key), err)]
    pub fn accept_in(
        &self,
        conn: &Connection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let accepted = self.ops().accept(conn, key, payload, options)?;
        if accepted.is_new() {
            self.wakeups().raise(key.namespace());
        }
        Ok(accepted)
    }
}

/// The inbox in the records table: an item is a row with a payload and a
/// `wait` state (0 held by a worker, 1 due at `expires_at`, 2 dead). Each
/// operation is one statement; writes go through the file's writer thread
/// (group commit), reads through a connection thread. `take` is an `UPDATE
/// ... WHERE (namespace, id) IN (SELECT ... ORDER BY expires_at LIMIT n)
/// RETURNING` under the write lock, on a partial index of the due items of a
/// namespace, so each due item goes to one taker. Durable as a completion
/// is: committed before it answers.
#[async_trait]
impl Inbox for SqliteStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let (owned, payload, options) = (key.clone(), payload.to_vec(), options.clone());
        let accepted = self
            .conns()
            .write(1, move |ops, conn| {
                ops.accept(conn, &owned, &payload, &options)
            })
            .await?;
        if matches!(accepted, Accepted::New) {
            self.wakeups().raise(key.namespace());
        }
        Ok(accepted)
    }

    /// Changes made through this handle and its clones wake its workers;
    /// another process on the same file (or a handle opened apart) is found
    /// by the poll: SQLite has no way to tell one connection of another's
    /// commit.
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        Ok(Wake::in_process(self.wakeups().signal(namespace)))
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        check_take(max, lease)?;
        let namespace = namespace.to_string();
        self.conns()
            .write(max, move |ops, conn| ops.take(conn, &namespace, max, lease))
            .await
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        check_ttl("snooze delay", delay)?;
        let lease = lease.clone();
        self.conns()
            .write(1, move |ops, conn| ops.snooze(conn, &lease, delay))
            .await
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        retry.validate()?;
        let (lease, error) = (lease.clone(), error.to_string());
        self.conns()
            .write(1, move |ops, conn| ops.fail(conn, &lease, &error, retry))
            .await
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        let key = key.clone();
        self.conns()
            .with_conn(move |ops, conn| ops.item(conn, &key))
            .await
    }

    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        query.validate()?;
        let query = query.clone();
        self.conns()
            .with_conn(move |ops, conn| ops.list(conn, &query))
            .await
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let owned = key.clone();
        let replayed = self
            .conns()
            .write(1, move |ops, conn| ops.replay(conn, &owned))
            .await?;
        if replayed {
            self.wakeups().raise(key.namespace());
        }
        Ok(replayed)
    }

    async fn forget_if(
        &self,
        key: &Key,
        status: dedupe_core::ItemStatus,
        attempts: u32,
    ) -> Result<bool> {
        // On the writer, in one transaction: the removal and the promotion
        // of the key's next item commit together.
        let key = key.clone();
        self.conns()
            .write(1, move |ops, conn| {
                ops.forget_where(conn, &key, Some((status, attempts)))
            })
            .await
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        let namespace = namespace.to_string();
        self.conns()
            .with_conn(move |ops, conn| ops.counts(conn, &namespace))
            .await
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let namespace = namespace.to_string();
        self.conns()
            .write(1, move |ops, conn| ops.set_paused(conn, &namespace, true))
            .await
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let owned = namespace.to_string();
        let resumed = self
            .conns()
            .write(1, move |ops, conn| ops.set_paused(conn, &owned, false))
            .await?;
        if resumed {
            // Its waiting items are takeable again: the workers here look now.
            self.wakeups().raise(namespace);
        }
        Ok(resumed)
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let namespace = namespace.to_string();
        self.conns()
            .with_conn(move |ops, conn| {
                conn.prepare_cached(&ops.sql.paused)
                    .and_then(|mut stmt| {
                        stmt.query_row(named_params! {":ns": namespace}, |row| row.get(0))
                    })
                    .map_err(|e| ops.err(e))
            })
            .await
    }
}

/// The inbox's statements (CONTRACT.md I1 to I16), each one statement on the
/// caller's connection (writes in the writer's transaction).
impl Ops<'_> {
    /// Pauses (or resumes) the namespace; `true` when that changed anything.
    pub(crate) fn set_paused(
        &self,
        conn: &Connection,
        namespace: &str,
        paused: bool,
    ) -> Result<bool> {
        let changed = if paused {
            conn.prepare_cached(&self.sql.pause).and_then(|mut stmt| {
                stmt.execute(named_params! {":ns": namespace, ":now": backend::now_millis()})
            })
        } else {
            conn.prepare_cached(&self.sql.resume)
                .and_then(|mut stmt| stmt.execute(named_params! {":ns": namespace}))
        };
        Ok(changed.map_err(|e| self.err(e))? == 1)
    }

    pub(crate) fn accept(
        &self,
        conn: &Connection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        let now = backend::now_millis();
        let (delay, max_attempts) = accept_columns(options);
        let token = backend::new_token();
        let stored: Option<String> = conn
            .prepare_cached(&self.sql.accept)
            .and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {
                        ":ns": key.namespace(),
                        ":id": key.id(),
                        ":token": token.as_str(),
                        ":now": now,
                        ":due": now.saturating_add(delay),
                        ":payload": payload,
                        ":max_attempts": max_attempts,
                        ":order": options.ordering_key.as_deref(),
                        ":skip": options.when_dead == WhenDead::Skip,
                    },
                    |row| row.get(0),
                )
                .optional()
            })
            .map_err(|e| self.err(e))?;
        if stored.is_some() {
            return Ok(Accepted::New);
        }
        if let Some(item) = self.item(conn, key)? {
            return Ok(Accepted::Item(item));
        }
        match self.get_at(conn, key, now)? {
            Some(record) => Ok(match record.state {
                dedupe_core::RecordState::Done {
                    outcome,
                    completed_at,
                    ..
                } => Accepted::Done {
                    outcome,
                    completed_at,
                },
                dedupe_core::RecordState::InFlight { lease_deadline } => Accepted::InFlight {
                    deadline: lease_deadline,
                    attempt: record.attempts,
                },
            }),
            None => Err(Error::retryable(
                "accept left a record in place but found none live",
                None,
            )),
        }
    }

    pub(crate) fn take(
        &self,
        conn: &Connection,
        namespace: &str,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Taken>> {
        let now = backend::now_millis();
        let until = deadline(now, lease);
        let mut taken = Vec::with_capacity(max);
        // A pick that parked items their ordering key holds back instead of
        // filling the take runs again: the parked ones are out of its index.
        loop {
            let mut held_back = Vec::new();
            let mut free = Vec::new();
            {
                let mut stmt = conn
                    .prepare_cached(&self.sql.take_pick)
                    .map_err(|e| self.err(e))?;
                let mut rows = stmt
                    .query(named_params! {
                        ":ns": namespace,
                        ":now": now,
                        ":max": i64::try_from(max).unwrap_or(i64::MAX),
                        ":scan": i64::try_from(ORDER_SCAN).unwrap_or(i64::MAX),
                    })
                    .map_err(|e| self.err(e))?;
                while taken.len() + free.len() < max {
                    let Some(row) = rows.next().map_err(|e| self.err(e))? else {
                        break;
                    };
                    let read = || -> rusqlite::Result<(String, bool, bool)> {
                        Ok((row.get(0)?, row.get(1)?, row.get(2)?))
                    };
                    let (id, head, blocked) = read().map_err(|e| self.err(e))?;
                    match (blocked, head) {
                        (false, _) => free.push(id),
                        (true, false) => held_back.push(id),
                        // A head held back: it goes when its key moves.
                        (true, true) => {}
                    }
                }
            }
            let mut parked = 0;
            for id in held_back {
                parked += conn
                    .prepare_cached(&self.sql.park)
                    .and_then(|mut stmt| {
                        stmt.execute(named_params! {":ns": namespace, ":id": id.as_str()})
                    })
                    .map_err(|e| self.err(e))?;
            }
            self.lease_picked(conn, namespace, free, now, until, &mut taken)?;
            if parked == 0 || taken.len() >= max {
                return Ok(taken);
            }
        }
    }

    /// Leases the items `ids` picked, in order, into `taken`.
    fn lease_picked(
        &self,
        conn: &Connection,
        namespace: &str,
        ids: Vec<String>,
        now: i64,
        until: i64,
        taken: &mut Vec<Taken>,
    ) -> Result<()> {
        for id in ids {
            let key = Key::new(namespace, &id)?;
            let token = backend::new_token();
            type Leased = (
                String,
                i64,
                i64,
                Option<Vec<u8>>,
                Option<String>,
                StoredCounts,
                i64,
                Option<String>,
            );
            let row: Option<Leased> = conn
                .prepare_cached(&self.sql.take_one)
                .and_then(|mut stmt| {
                    stmt.query_row(
                        named_params! {
                            ":ns": namespace,
                            ":id": id.as_str(),
                            ":token": token.as_str(),
                            ":now": now,
                            ":until": until,
                        },
                        |row| {
                            Ok((
                                row.get(0)?,
                                row.get(1)?,
                                row.get(2)?,
                                row.get(3)?,
                                row.get(4)?,
                                StoredCounts {
                                    takeovers: row.get(5)?,
                                    max_attempts: row.get(6)?,
                                },
                                row.get(7)?,
                                row.get(8)?,
                            ))
                        },
                    )
                    .optional()
                })
                .map_err(|e| self.err(e))?;
            // Picked and leased in one write transaction: it is there.
            let Some((
                stored,
                deadline,
                attempts,
                payload,
                last_error,
                counts,
                accepted_at,
                ordering_key,
            )) = row
            else {
                continue;
            };
            taken.push(
                StoredTaken {
                    token: stored,
                    deadline_ms: deadline,
                    attempt: attempts,
                    accepted_ms: accepted_at,
                    last_error,
                    payload,
                    counts,
                    ordering_key,
                }
                .decode(key)?,
            );
        }
        Ok(())
    }

    pub(crate) fn snooze(&self, conn: &Connection, lease: &Lease, delay: Duration) -> Result<()> {
        let now = backend::now_millis();
        let changed = conn
            .prepare_cached(&self.sql.snooze)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": lease.key.namespace(),
                    ":id": lease.key.id(),
                    ":token": lease.token.as_str(),
                    ":now": now,
                    ":due": deadline(now, delay),
                })
            })
            .map_err(|e| self.err(e))?;
        one_row_changed(changed as u64, &lease.key)
    }

    pub(crate) fn fail(
        &self,
        conn: &Connection,
        lease: &Lease,
        error: &str,
        retry: Retry,
    ) -> Result<()> {
        let now = backend::now_millis();
        let (wait, due) = match retry {
            Retry::After(delay) => (1, deadline(now, delay)),
            Retry::Dead { .. } => (2, now),
        };
        let dead_until = match retry {
            Retry::Dead { keep: Some(keep) } => Some(deadline(now, keep)),
            _ => None,
        };
        // The ordering key of an item dead and to be skipped comes back:
        // its next item is made the key's head.
        let skipped: Vec<Option<String>> = conn
            .prepare_cached(&self.sql.fail)
            .and_then(|mut stmt| {
                stmt.query_map(
                    named_params! {
                        ":ns": lease.key.namespace(),
                        ":id": lease.key.id(),
                        ":token": lease.token.as_str(),
                        ":now": now,
                        ":wait": wait,
                        ":due": due,
                        ":error": cut_error(error),
                        ":dead_until": dead_until,
                    },
                    |row| row.get(0),
                )?
                .collect()
            })
            .map_err(|e| self.err(e))?;
        one_row_changed(skipped.len() as u64, &lease.key)?;
        if let Some(Some(order_key)) = skipped.first() {
            self.promote(conn, &lease.key, order_key)?;
        }
        Ok(())
    }

    pub(crate) fn item(&self, conn: &Connection, key: &Key) -> Result<Option<Item>> {
        conn.prepare_cached(&self.sql.select_item)
            .and_then(|mut stmt| {
                stmt.query_row(
                    named_params! {":ns": key.namespace(), ":id": key.id()},
                    read_item,
                )
                .optional()
            })
            .map_err(|e| self.err(e))?
            .map(|row| row.decode(key.namespace()))
            .transpose()
    }

    pub(crate) fn list(&self, conn: &Connection, query: &ItemQuery) -> Result<ItemPage> {
        let mut stmt = conn
            .prepare_cached(&self.sql.list)
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(
                named_params! {
                    ":ns": query.namespace.as_str(),
                    ":after": query.after.as_deref().unwrap_or(""),
                    ":st": status_code(query.status),
                    ":limit": i64::try_from(query.limit + 1).unwrap_or(i64::MAX),
                },
                read_item,
            )
            .map_err(|e| self.err(e))?;
        let mut items = Vec::new();
        for row in rows {
            items.push(row.map_err(|e| self.err(e))?.decode(&query.namespace)?);
        }
        let next = (items.len() > query.limit).then(|| items[query.limit - 1].key.id().to_string());
        items.truncate(query.limit);
        Ok(ItemPage::new(items, next))
    }

    pub(crate) fn replay(&self, conn: &Connection, key: &Key) -> Result<bool> {
        conn.prepare_cached(&self.sql.replay)
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":ns": key.namespace(),
                    ":id": key.id(),
                    ":now": backend::now_millis(),
                })
            })
            .map(|changed| changed > 0)
            .map_err(|e| self.err(e))
    }

    pub(crate) fn counts(&self, conn: &Connection, namespace: &str) -> Result<InboxCounts> {
        let (pending, running, failed, dead, oldest): (i64, i64, i64, i64, Option<i64>) = conn
            .prepare_cached(&self.sql.counts)
            .and_then(|mut stmt| {
                stmt.query_row(named_params! {":ns": namespace}, |row| {
                    Ok((
                        row.get(0)?,
                        row.get(1)?,
                        row.get(2)?,
                        row.get(3)?,
                        row.get(4)?,
                    ))
                })
            })
            .map_err(|e| self.err(e))?;
        Ok(stored_counts(pending, running, failed, dead, oldest))
    }
}
