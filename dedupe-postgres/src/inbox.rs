//! The inbox (CONTRACT.md I1 to I16) in the records table: its `Inbox`
//! implementation, and the statements it runs on a connection of the store's.

use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{
    self, accept_columns, check_accept, check_namespace, check_take, check_ttl, cut_error,
    one_row_changed, status_code, stored_counts, StoredCounts, StoredItem, StoredTaken,
};
use dedupe_core::{
    AcceptOptions, Accepted, Error, Inbox, InboxCounts, Item, ItemPage, ItemQuery, Key, Lease,
    Result, Retry, Taken, Wake, WhenDead, ORDER_SCAN,
};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::ops::Ops;
use crate::sql::{text, Sql};
use crate::store::PgStore;

impl PgStore {
    /// Accepts `payload` under `key` on the caller's connection or
    /// transaction (`&mut *tx`: the outbox half, CONTRACT.md I1 and
    /// "Transactions"): the item and the application's own writes commit
    /// together or not at all. "Charge recorded, follow-up queued": both, or
    /// neither. Answers as [`Inbox::accept_with`] does. The item is taken
    /// only once the transaction commits, and workers are woken then (the
    /// `NOTIFY` is sent at the commit, and never on a rollback); a rollback,
    /// or a connection lost before the commit, leaves no item, so the key is
    /// new again. A concurrent accept of the key waits on its row until this
    /// transaction ends, then answers the item (commit) or stores its own
    /// (rollback). Not bounded by the store's timeout: the caller owns the
    /// transaction.
    ///
    /// ```no_run
    /// use dedupe_core::{AcceptOptions, Error, Key};
    /// use dedupe_postgres::PgStore;
    /// # async fn run() -> dedupe_core::Result<()> {
    /// let store = PgStore::connect("postgres://localhost/app").await?;
    /// let driver = |e| Error::retryable("transaction", Some(Box::new(e) as _));
    /// let mut tx = store.pool().begin().await.map_err(driver)?;
    /// dedupe_postgres::sqlx::query("INSERT INTO charges (id) VALUES ('ch_1')")
    ///     .execute(&mut *tx)
    ///     .await
    ///     .map_err(driver)?;
    /// let key = Key::new("receipts", "ch_1")?;
    /// store.accept_in(&mut tx, &key, b"send the receipt", &AcceptOptions::new()).await?;
    /// tx.commit().await.map_err(driver)?;
    /// # Ok(())
    /// # }
    /// ```
    #[tracing::instrument(name = "dedupe.accept_in", skip_all, fields(store = "postgres", key = %key), err)]
    pub async fn accept_in(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        // Delivered at the caller's commit, whenever that comes.
        self.ops().accept(conn, key, payload, options, true).await
    }
}

/// The inbox in the records table (migration 0002): an item is a row with a
/// payload and a `wait` state (0 held by a worker, 1 due at `expires_at`, 2
/// dead). `accept` is the claim's statement with the item's columns; `take`
/// locks the oldest due items of a namespace with `FOR UPDATE SKIP LOCKED`
/// (on a partial index of due items) and leases them in the same statement,
/// so racing takers never wait on each other and never share an item; every
/// other change is one `UPDATE` fenced by the token and the deadline. Each
/// statement commits before it answers: an accepted delivery is as durable as
/// a completion.
#[async_trait]
impl Inbox for PgStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        // One notification a namespace per NOTIFY_WINDOW from this handle:
        // Postgres queues notifications at commit under one lock for the
        // whole cluster, and a notifying accept ran at 0.48-0.51 of a claim
        // against 0.75-0.80 without (bench/README.md, 2026-12-07, later).
        let notify = self.notices.lead(key.namespace());
        let accepted = self
            .call(async |ops, conn| ops.accept(conn, key, payload, options, notify).await)
            .await;
        // An error may have followed a commit (an answer lost): announced
        // too, at the cost of a notification for nothing.
        let due_now = accept_columns(options).0 == 0;
        if !notify && due_now && matches!(accepted, Ok(Accepted::New) | Err(_)) {
            self.notices.trail(key.namespace(), self);
        }
        accepted
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
        self.call(async |ops, conn| ops.replay(conn, key).await)
            .await
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
        self.call(async |ops, conn| ops.changes(conn, &ops.sql.resume, namespace).await)
            .await
    }

    /// Pushed: a `LISTEN` connection of this handle's (opened by the first
    /// worker that asks, with the pool's settings, outside the pool's
    /// count) hears every process's accepts, hand-backs, replays and
    /// resumes as they commit.
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        check_namespace(namespace)?;
        Ok(self.wake.wake(namespace, self.timeout).await)
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        self.call(async |ops, conn| {
            sqlx::query_scalar(text(&ops.sql.paused))
                .bind(namespace)
                .fetch_one(conn)
                .await
                .map_err(|e| ops.err(e))
        })
        .await
    }
}

/// An item row (`sql::Statements::select_item`, `list`) as an [`Item`].
fn decode_item(namespace: &str, row: &PgRow) -> Result<Item> {
    let read = || -> std::result::Result<_, sqlx::Error> {
        Ok((
            row.try_get::<String, _>("key")?,
            StoredItem {
                id: String::new(),
                wait: i64::from(row.try_get::<i16, _>("wait")?),
                attempts: i64::from(row.try_get::<i32, _>("attempts")?),
                accepted_ms: row.try_get("first_seen_ms")?,
                due_ms: row.try_get("expires_ms")?,
                last_error: row.try_get("last_error")?,
                payload: row.try_get("payload")?,
                counts: counts(row)?,
                ordering_key: row.try_get("order_key")?,
                errors: row.try_get("errors")?,
            },
        ))
    };
    let (joined, stored) =
        read().map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?;
    StoredItem {
        id: id_in(namespace, &joined)?.to_string(),
        ..stored
    }
    .decode(namespace)
}

/// An item row's takeovers and attempt limit.
fn counts(row: &PgRow) -> std::result::Result<StoredCounts, sqlx::Error> {
    Ok(StoredCounts {
        takeovers: i64::from(row.try_get::<i32, _>("takeovers")?),
        max_attempts: row
            .try_get::<Option<i32>, _>("max_attempts")?
            .map(i64::from),
    })
}

/// The id of a `namespace:id` key column of `namespace`.
fn id_in<'k>(namespace: &str, joined: &'k str) -> Result<&'k str> {
    joined
        .strip_prefix(namespace)
        .and_then(|rest| rest.strip_prefix(':'))
        .ok_or_else(|| Error::fatal(format!("an inbox row of another namespace: {joined}"), None))
}

/// The inbox's statements (CONTRACT.md I1 to I16), one statement each.
impl Ops<'_> {
    pub(crate) async fn accept(
        &self,
        conn: &mut PgConnection,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
        notify: bool,
    ) -> Result<Accepted> {
        let token = backend::new_token();
        let (delay, max_attempts) = accept_columns(options);
        let stored: Option<String> = sqlx::query_scalar(text(&self.sql.accept))
            .bind(key.namespace())
            .bind(key.id())
            .bind(token.as_str())
            .bind(payload)
            .bind(delay)
            .bind(max_attempts.map(|m| i32::try_from(m).unwrap_or(i32::MAX)))
            .bind(options.ordering_key.as_deref())
            .bind(options.when_dead == WhenDead::Skip)
            .bind(notify)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        if stored.is_some() {
            return Ok(Accepted::New);
        }
        if let Some(item) = self.item(&mut *conn, key).await? {
            return Ok(Accepted::Item(item));
        }
        match self.get(conn, key).await? {
            Some(record) => Ok(backend::accepted_over(record)),
            None => Err(Error::retryable(
                "accept left a record in place but found none live; retry",
                None,
            )),
        }
    }

    /// Leases up to `max` items. A pick that parked items its ordering key
    /// holds back (I15) instead of filling the take is followed by one
    /// `park` of the front of the namespace and a pick again, until the take
    /// is full or a pick parks nothing: every statement reads a bounded
    /// number of rows, and each held-back item is read by the picks running
    /// when it falls due, then not again until its key moves.
    pub(crate) async fn take(
        &self,
        conn: &mut PgConnection,
        namespace: &str,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Taken>> {
        let mut taken = Vec::new();
        loop {
            let (more, parked) = self.pick(conn, namespace, max - taken.len(), lease).await?;
            taken.extend(more);
            if parked == 0 || taken.len() >= max {
                return Ok(taken);
            }
            let scan = i64::try_from(max + ORDER_SCAN).unwrap_or(i64::MAX);
            let parked = sqlx::query(text(&self.sql.park))
                .bind(namespace)
                .bind(scan)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?
                .rows_affected();
            tracing::debug!(
                namespace,
                parked,
                "take parked items their ordering keys hold back"
            );
        }
    }

    /// One `take` statement: the items it leased, and how many it parked.
    async fn pick(
        &self,
        conn: &mut PgConnection,
        namespace: &str,
        max: usize,
        lease: Duration,
    ) -> Result<(Vec<Taken>, i64)> {
        let rows = sqlx::query(text(&self.sql.take))
            .bind(namespace)
            .bind(i64::try_from(max).unwrap_or(i64::MAX))
            .bind(lease)
            .fetch_all(conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut parked = 0;
        let taken = rows
            .iter()
            .filter(|row| match row.try_get::<Option<i64>, _>("parked") {
                Ok(Some(count)) => {
                    parked = count;
                    false
                }
                _ => true,
            })
            .map(|row| {
                let read = || -> std::result::Result<_, sqlx::Error> {
                    Ok((
                        row.try_get::<String, _>("key")?,
                        row.try_get::<String, _>("token")?,
                        row.try_get::<i64, _>("expires_ms")?,
                        row.try_get::<i32, _>("attempts")?,
                        row.try_get::<Option<Vec<u8>>, _>("payload")?,
                        row.try_get::<Option<String>, _>("last_error")?,
                        counts(row)?,
                        row.try_get::<i64, _>("first_seen_ms")?,
                        row.try_get::<Option<String>, _>("order_key")?,
                    ))
                };
                let (
                    joined,
                    token,
                    deadline,
                    attempts,
                    payload,
                    last_error,
                    counts,
                    accepted,
                    ordering_key,
                ) = read()
                    .map_err(|e| Error::fatal(format!("undecodable inbox row: {e}"), None))?;
                let key = Key::new(namespace, id_in(namespace, &joined)?)?;
                StoredTaken {
                    token,
                    deadline_ms: deadline,
                    attempt: i64::from(attempts),
                    accepted_ms: accepted,
                    last_error,
                    payload,
                    counts,
                    ordering_key,
                }
                .decode(key)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((taken, parked))
    }

    pub(crate) async fn snooze(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        delay: Duration,
    ) -> Result<()> {
        let changed = sqlx::query(text(&self.sql.snooze))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(delay)
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        one_row_changed(changed, &lease.key)
    }

    pub(crate) async fn fail(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        error: &str,
        retry: Retry,
    ) -> Result<()> {
        let (wait, delay) = match retry {
            Retry::After(delay) => (1i16, delay),
            Retry::Dead { .. } => (2i16, Duration::ZERO),
        };
        let keep = match retry {
            Retry::Dead { keep } => keep,
            Retry::After(_) => None,
        };
        let changed: i64 = sqlx::query_scalar(text(&self.sql.fail))
            .bind(lease.key.namespace())
            .bind(lease.key.id())
            .bind(lease.token.as_str())
            .bind(wait)
            .bind(delay)
            .bind(cut_error(error))
            .bind(keep)
            .fetch_one(conn)
            .await
            .map_err(|e| self.err(e))?;
        one_row_changed(changed.unsigned_abs(), &lease.key)
    }

    pub(crate) async fn item(&self, conn: &mut PgConnection, key: &Key) -> Result<Option<Item>> {
        let row = sqlx::query(text(&self.sql.select_item))
            .bind(key.namespace())
            .bind(key.id())
            .fetch_optional(conn)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|row| decode_item(key.namespace(), &row))
            .transpose()
    }

    pub(crate) async fn list(
        &self,
        conn: &mut PgConnection,
        query: &ItemQuery,
    ) -> Result<ItemPage> {
        let status = i32::try_from(status_code(query.status)).unwrap_or(-1);
        let rows = sqlx::query(text(&self.sql.list))
            .bind(query.namespace.as_str())
            .bind(query.after.as_deref().unwrap_or(""))
            .bind(status)
            .bind(i64::try_from(query.limit + 1).unwrap_or(i64::MAX))
            .fetch_all(conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut items = rows
            .iter()
            .map(|row| decode_item(&query.namespace, row))
            .collect::<Result<Vec<_>>>()?;
        let next = (items.len() > query.limit).then(|| items[query.limit - 1].key.id().to_string());
        items.truncate(query.limit);
        Ok(ItemPage::new(items, next))
    }

    /// Runs a pause or resume: `true` when it changed a row.
    pub(crate) async fn changes(
        &self,
        conn: &mut PgConnection,
        statement: &Sql,
        namespace: &str,
    ) -> Result<bool> {
        Ok(sqlx::query(text(statement))
            .bind(namespace)
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected()
            == 1)
    }

    pub(crate) async fn replay(&self, conn: &mut PgConnection, key: &Key) -> Result<bool> {
        Ok(sqlx::query(text(&self.sql.replay))
            .bind(key.namespace())
            .bind(key.id())
            .execute(conn)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected()
            > 0)
    }

    pub(crate) async fn counts(
        &self,
        conn: &mut PgConnection,
        namespace: &str,
    ) -> Result<InboxCounts> {
        let row = sqlx::query(text(&self.sql.counts))
            .bind(namespace)
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
