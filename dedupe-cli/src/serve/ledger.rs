//! The business step's ledger: one row per processed event, written together
//! with the completion wherever the store allows it.
//!
//! - SQLite, Postgres and MySQL: the row and `complete_in` commit in one
//!   transaction on the store's own database, so an event is either done with
//!   its row or neither. Postgres and MySQL take one path, written against
//!   [`Transactional`], with their statements in a [`Dialect`].
//! - DynamoDB: the row is a `Put` into a ledger table in the same
//!   `TransactWriteItems` as the completion (`complete_with`).
//! - memory and Redis: the rows are kept in this process; a row is added, the
//!   lease completed, and the row taken back if the completion failed. A crash
//!   between the two loses the row of a completed event (documented in the
//!   README); these stores have no transaction to share.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_core::{async_trait, DedupeStore, Error, Inbox, Lease};
use dedupe_sqlx::sqlx::{self, AssertSqlSafe};
use dedupe_sqlx::{ConnectionOf, Transactional};
use dedupe_url::{Opener, Target};
use dedupe_webhook::WebhookEvent;
use serde::Serialize;

/// One processed event.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Row {
    /// Its place in the ledger: the cursor of `GET /hooks?after=`.
    pub seq: String,
    /// The idempotency key.
    pub key: String,
    /// The provider's event id, if the key came from one.
    pub event_id: Option<String>,
    /// The per-attempt delivery id of the delivery that processed it.
    pub delivery_id: Option<String>,
    /// When, in milliseconds since the epoch.
    pub at_ms: i64,
}

impl Row {
    fn of(event: &WebhookEvent) -> Self {
        Self {
            seq: String::new(),
            key: event.key.to_string(),
            event_id: event.event_id.clone(),
            delivery_id: event.delivery_id.clone(),
            at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
        }
    }
}

/// The ledger's own SQLite connections, opened once and reused (an open and
/// its pragmas per event cost more than the event's write).
pub struct LedgerConns {
    path: std::path::PathBuf,
    idle: Mutex<Vec<dedupe_sqlite::rusqlite::Connection>>,
}

impl LedgerConns {
    /// Most connections kept between uses.
    const KEEP: usize = 4;

    /// Runs `f` on a kept connection (or a new one), on the calling thread:
    /// call it from a blocking task. The connection is kept afterwards, an
    /// unfinished transaction having rolled back when `f` dropped it.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut dedupe_sqlite::rusqlite::Connection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let kept = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        let mut conn = match kept {
            Some(conn) => conn,
            None => sqlite_conn(&self.path)?,
        };
        let result = f(&mut conn);
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < Self::KEEP && conn.is_autocommit() {
                idle.push(conn);
            }
        }
        result
    }
}

/// Where rows go, per store.
pub enum Ledger {
    Sqlite {
        store: dedupe_sqlite::SqliteStore,
        conns: Arc<LedgerConns>,
    },
    /// A store over sqlx: one generic path for Postgres and MySQL.
    Sqlx(Box<dyn SqlxRows>),
    Dynamo {
        store: dedupe_dynamo::DynamoStore,
        client: dedupe_dynamo::aws_sdk_dynamodb::Client,
        table: String,
    },
    InProcess {
        store: Arc<dyn DedupeStore>,
        rows: Mutex<InProcessRows>,
    },
}

/// What [`Ledger::open`] opened.
pub struct Opened {
    /// The store the receiver claims on.
    pub store: Arc<dyn DedupeStore>,
    /// Its inbox, for `--inbox`: `None` on a store that has none.
    pub inbox: Option<Arc<dyn Inbox>>,
    /// Where processed events are written.
    pub ledger: Ledger,
}

impl Opened {
    fn inbox(inbox: Arc<dyn Inbox>, ledger: Ledger) -> Self {
        Self {
            store: inbox.clone(),
            inbox: Some(inbox),
            ledger,
        }
    }
}

/// The in-process ledger: rows in order, numbered from 1.
#[derive(Default)]
pub struct InProcessRows {
    rows: Vec<Row>,
    next: u64,
}

/// Ledger rows a page reads, and the rows a prune deletes per statement.
const PRUNE_BATCH: i64 = 1000;

/// The Dynamo ledger's one partition: rows sort by `sk`, `<at_ms, 15 digits>#<id>`.
const DYNAMO_PARTITION: &str = "rows";

fn sqlite_err(e: dedupe_sqlite::rusqlite::Error) -> Error {
    Error::unavailable("ledger (sqlite)", Some(Box::new(e)))
}

fn sqlx_err(e: sqlx::Error) -> Error {
    Error::unavailable("ledger (sql)", Some(Box::new(e)))
}

fn dynamo_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
    Error::unavailable("ledger (dynamodb)", Some(Box::new(e)))
}

impl Ledger {
    /// The store the receiver claims on, its inbox where it has one, and
    /// the ledger beside it.
    pub async fn open(opener: &Opener) -> Result<Opened, Error> {
        Ok(match opener.url().target() {
            Target::Sqlite { .. } => {
                let store = opener
                    .sqlite(dedupe_sqlite::SqliteStore::DEFAULT_CONNECTION_THREADS)
                    .await?;
                let conns = Arc::new(LedgerConns {
                    path: store.path().to_path_buf(),
                    idle: Mutex::new(Vec::new()),
                });
                let c = Arc::clone(&conns);
                tokio::task::spawn_blocking(move || {
                    c.with(|conn| {
                        conn.execute_batch(
                            "CREATE TABLE IF NOT EXISTS dedupe_ledger (
                            seq INTEGER PRIMARY KEY AUTOINCREMENT,
                            key TEXT NOT NULL, event_id TEXT, delivery_id TEXT,
                            at_ms INTEGER NOT NULL);
                            CREATE INDEX IF NOT EXISTS dedupe_ledger_at ON dedupe_ledger (at_ms)",
                        )
                        .map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::fatal("ledger thread", Some(Box::new(e) as _)))??;
                Opened::inbox(Arc::new(store.clone()), Ledger::Sqlite { store, conns })
            }
            Target::Postgres { connections, .. } => {
                let store = opener.postgres(connections.unwrap_or(16)).await?;
                let schema = store.table_name();
                let schema = schema.split('.').next().unwrap_or("public");
                let table = format!("\"{schema}\".dedupe_ledger");
                let sql = Dialect {
                    create: format!(
                        "CREATE TABLE IF NOT EXISTS {table} (
                            seq bigserial PRIMARY KEY, key text NOT NULL, event_id text,
                            delivery_id text, at_ms bigint NOT NULL);
                         CREATE INDEX IF NOT EXISTS dedupe_ledger_at ON {table} (at_ms)"
                    ),
                    insert: format!(
                        "INSERT INTO {table} (key, event_id, delivery_id, at_ms) \
                         VALUES ($1, $2, $3, $4)"
                    ),
                    page: format!(
                        "SELECT seq, key, event_id, delivery_id, at_ms FROM {table} \
                         WHERE seq > $1 ORDER BY seq LIMIT $2"
                    ),
                    prune: format!(
                        "DELETE FROM {table} WHERE seq IN \
                         (SELECT seq FROM {table} WHERE at_ms < $1 ORDER BY at_ms \
                          LIMIT {PRUNE_BATCH})"
                    ),
                    rows_affected: dedupe_postgres::sqlx::postgres::PgQueryResult::rows_affected,
                };
                SqlxLedger::open(store, sql).await?
            }
            Target::Mysql { connections, .. } => {
                let store = opener.mysql(connections.unwrap_or(16)).await?;
                let table = format!("{}_ledger", store.table_name());
                if table.len() > 64 {
                    return Err(Error::config(format!(
                        "table name {} leaves no room for its ledger {table}: MySQL names \
                         are 64 characters at most",
                        store.table_name()
                    )));
                }
                let text = "VARCHAR(600) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin";
                let sql = Dialect {
                    create: format!(
                        "CREATE TABLE IF NOT EXISTS `{table}` (
                            seq BIGINT AUTO_INCREMENT PRIMARY KEY, `key` {text} NOT NULL,
                            event_id {text}, delivery_id {text}, at_ms BIGINT NOT NULL,
                            KEY at_ms (at_ms)
                         ) ENGINE=InnoDB"
                    ),
                    insert: format!(
                        "INSERT INTO `{table}` (`key`, event_id, delivery_id, at_ms) \
                         VALUES (?, ?, ?, ?)"
                    ),
                    page: format!(
                        "SELECT seq, `key`, event_id, delivery_id, at_ms FROM `{table}` \
                         WHERE seq > ? ORDER BY seq LIMIT ?"
                    ),
                    prune: format!(
                        "DELETE FROM `{table}` WHERE at_ms < ? ORDER BY at_ms LIMIT {PRUNE_BATCH}"
                    ),
                    rows_affected: dedupe_mysql::sqlx::mysql::MySqlQueryResult::rows_affected,
                };
                SqlxLedger::open(store, sql).await?
            }
            Target::Dynamo { .. } => {
                let store = opener.dynamo().await?;
                let client = opener.dynamo_client().await?;
                let table = format!("{}_ledger", store.table_name());
                create_dynamo_ledger(&client, &table).await?;
                Opened::inbox(
                    Arc::new(store.clone()),
                    Ledger::Dynamo {
                        store,
                        client,
                        table,
                    },
                )
            }
            _ => {
                let inbox = opener.inbox_handle().await?.ok_or_else(|| {
                    Error::config(format!("{} stores have no inbox", opener.url().scheme()))
                })?;
                let store: Arc<dyn DedupeStore> = inbox.clone();
                Opened::inbox(
                    inbox,
                    Ledger::InProcess {
                        store,
                        rows: Mutex::new(InProcessRows::default()),
                    },
                )
            }
        })
    }

    /// Writes the event's row and completes its lease with `outcome`, together.
    pub async fn record(&self, event: &WebhookEvent, outcome: &[u8]) -> Result<(), Error> {
        let row = Row::of(event);
        let lease = &event.lease;
        match self {
            Ledger::Sqlite { store, conns } => {
                let (store, conns, lease, outcome, retention) = (
                    store.clone(),
                    Arc::clone(conns),
                    lease.clone(),
                    outcome.to_vec(),
                    event.retention,
                );
                tokio::task::spawn_blocking(move || {
                    use dedupe_sqlite::rusqlite::TransactionBehavior;
                    conns.with(|conn| {
                    let tx = conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)
                        .map_err(sqlite_err)?;
                    tx.execute(
                        "INSERT INTO dedupe_ledger (key, event_id, delivery_id, at_ms) VALUES (?1, ?2, ?3, ?4)",
                        (&row.key, &row.event_id, &row.delivery_id, row.at_ms),
                    )
                    .map_err(sqlite_err)?;
                    store.complete_in(&tx, &lease, &outcome, retention)?;
                    tx.commit().map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::fatal("ledger thread", Some(Box::new(e) as _)))?
            }
            Ledger::Sqlx(ledger) => ledger.record(&row, lease, outcome, event.retention).await,
            Ledger::Dynamo { store, table, .. } => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::{
                    AttributeValue, Put, TransactWriteItem,
                };
                let mut put = Put::builder()
                    .table_name(table.as_str())
                    .item("pk", AttributeValue::S(DYNAMO_PARTITION.into()))
                    .item(
                        "sk",
                        AttributeValue::S(format!("{:015}#{}", row.at_ms, uuid_like())),
                    )
                    .item("key", AttributeValue::S(row.key.clone()))
                    .item("at_ms", AttributeValue::N(row.at_ms.to_string()));
                if let Some(id) = &row.event_id {
                    put = put.item("event_id", AttributeValue::S(id.clone()));
                }
                if let Some(id) = &row.delivery_id {
                    put = put.item("delivery_id", AttributeValue::S(id.clone()));
                }
                let item = TransactWriteItem::builder()
                    .put(put.build().map_err(dynamo_err)?)
                    .build();
                store
                    .complete_with(lease, outcome, event.retention, &[item])
                    .await
            }
            Ledger::InProcess { store, rows } => {
                // The row is added once the completion is known to have landed:
                // when the answer was lost (a timeout), the record says.
                let done = match store.complete(lease, outcome, event.retention).await {
                    Ok(()) => Ok(()),
                    Err(e) if e.is_retryable() => match store.get(&event.key).await {
                        Ok(Some(record)) if completed_by(&record, lease) => Ok(()),
                        _ => Err(e),
                    },
                    Err(e) => Err(e),
                };
                if done.is_ok() {
                    let mut rows = rows.lock().unwrap_or_else(|e| e.into_inner());
                    rows.next += 1;
                    let mut row = row;
                    row.seq = rows.next.to_string();
                    rows.rows.push(row);
                }
                done
            }
        }
    }

    /// Up to `limit` rows after the cursor `after` (a row's `seq`), oldest
    /// first, and the cursor of the next page when there may be one. One
    /// indexed range read per page on every store (no full table read).
    pub async fn page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<Row>, Option<String>), Error> {
        let bad_cursor = || Error::config("?after= is not a cursor of this ledger");
        let mut dynamo_next: Option<String> = None;
        let rows = match self {
            Ledger::Sqlite { conns, .. } => {
                let after: i64 = match after {
                    Some(a) => a.parse().map_err(|_| bad_cursor())?,
                    None => 0,
                };
                let conns = Arc::clone(conns);
                tokio::task::spawn_blocking(move || {
                    conns.with(|conn| {
                        let mut stmt = conn
                            .prepare_cached(
                                "SELECT seq, key, event_id, delivery_id, at_ms FROM dedupe_ledger \
                                 WHERE seq > ?1 ORDER BY seq LIMIT ?2",
                            )
                            .map_err(sqlite_err)?;
                        let rows = stmt
                            .query_map((after, limit as i64), |r| {
                                Ok(Row {
                                    seq: r.get::<_, i64>(0)?.to_string(),
                                    key: r.get(1)?,
                                    event_id: r.get(2)?,
                                    delivery_id: r.get(3)?,
                                    at_ms: r.get(4)?,
                                })
                            })
                            .map_err(sqlite_err)?;
                        rows.collect::<Result<Vec<_>, _>>().map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::fatal("ledger thread", Some(Box::new(e) as _)))??
            }
            Ledger::Sqlx(ledger) => {
                let after: i64 = match after {
                    Some(a) => a.parse().map_err(|_| bad_cursor())?,
                    None => 0,
                };
                ledger.page(after, limit).await?
            }
            Ledger::Dynamo { client, table, .. } => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                if after.is_some_and(|a| a.len() > 200 || !a.contains('#')) {
                    return Err(bad_cursor());
                }
                let mut query = client
                    .query()
                    .table_name(table.as_str())
                    .consistent_read(true)
                    .expression_attribute_values(":p", AttributeValue::S(DYNAMO_PARTITION.into()))
                    .limit(limit.min(i32::MAX as usize) as i32);
                // DynamoDB takes no empty string in a key condition: the first
                // page is the partition from its start.
                query = match after {
                    Some(after) => query
                        .key_condition_expression("pk = :p AND sk > :after")
                        .expression_attribute_values(
                            ":after",
                            AttributeValue::S(after.to_string()),
                        ),
                    None => query.key_condition_expression("pk = :p"),
                };
                let page = query.send().await.map_err(dynamo_err)?;
                // A page also ends at 1 MB: the next cursor is where the
                // service stopped, not only a full page's last row.
                dynamo_next = page
                    .last_evaluated_key()
                    .and_then(|k| k.get("sk"))
                    .and_then(|v| v.as_s().ok())
                    .cloned();
                page.items()
                    .iter()
                    .map(|item| {
                        let s = |name: &str| match item.get(name) {
                            Some(AttributeValue::S(s)) => Some(s.clone()),
                            _ => None,
                        };
                        let at_ms = match item.get("at_ms") {
                            Some(AttributeValue::N(n)) => n.parse().unwrap_or(0),
                            _ => 0,
                        };
                        Row {
                            seq: s("sk").unwrap_or_default(),
                            key: s("key").unwrap_or_default(),
                            event_id: s("event_id"),
                            delivery_id: s("delivery_id"),
                            at_ms,
                        }
                    })
                    .collect()
            }
            Ledger::InProcess { rows, .. } => {
                let after: u64 = match after {
                    Some(a) => a.parse().map_err(|_| bad_cursor())?,
                    None => 0,
                };
                let rows = rows.lock().unwrap_or_else(|e| e.into_inner());
                let start = rows
                    .rows
                    .partition_point(|r| r.seq.parse::<u64>().unwrap_or(0) <= after);
                rows.rows[start..].iter().take(limit).cloned().collect()
            }
        };
        let next = match self {
            Ledger::Dynamo { .. } => dynamo_next,
            _ => (rows.len() == limit)
                .then(|| rows.last().map(|r| r.seq.clone()))
                .flatten(),
        };
        Ok((rows, next))
    }

    /// Deletes the rows older than `cutoff_ms`, in batches; answers how many.
    pub async fn prune(&self, cutoff_ms: i64) -> Result<u64, Error> {
        let mut removed = 0u64;
        match self {
            Ledger::Sqlite { conns, .. } => loop {
                let conns = Arc::clone(conns);
                let n = tokio::task::spawn_blocking(move || {
                    conns.with(|conn| {
                        conn.execute(
                            "DELETE FROM dedupe_ledger WHERE seq IN \
                             (SELECT seq FROM dedupe_ledger WHERE at_ms < ?1 ORDER BY at_ms LIMIT ?2)",
                            (cutoff_ms, PRUNE_BATCH),
                        )
                        .map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::fatal("ledger thread", Some(Box::new(e) as _)))??;
                removed += n as u64;
                if (n as i64) < PRUNE_BATCH {
                    return Ok(removed);
                }
            },
            Ledger::Sqlx(ledger) => loop {
                let n = ledger.prune(cutoff_ms).await?;
                removed += n;
                if (n as i64) < PRUNE_BATCH {
                    return Ok(removed);
                }
            },
            Ledger::Dynamo { client, table, .. } => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                loop {
                    let page = client
                        .query()
                        .table_name(table.as_str())
                        .consistent_read(true)
                        .key_condition_expression("pk = :p AND sk < :cutoff")
                        .expression_attribute_values(
                            ":p",
                            AttributeValue::S(DYNAMO_PARTITION.into()),
                        )
                        .expression_attribute_values(
                            ":cutoff",
                            AttributeValue::S(format!("{cutoff_ms:015}")),
                        )
                        .limit(PRUNE_BATCH as i32)
                        .send()
                        .await
                        .map_err(dynamo_err)?;
                    let items = page.items();
                    for item in items {
                        let Some(sk) = item.get("sk").cloned() else {
                            continue;
                        };
                        client
                            .delete_item()
                            .table_name(table.as_str())
                            .key("pk", AttributeValue::S(DYNAMO_PARTITION.into()))
                            .key("sk", sk)
                            .send()
                            .await
                            .map_err(dynamo_err)?;
                        removed += 1;
                    }
                    if (items.len() as i64) < PRUNE_BATCH {
                        return Ok(removed);
                    }
                }
            }
            Ledger::InProcess { rows, .. } => {
                let mut rows = rows.lock().unwrap_or_else(|e| e.into_inner());
                let before = rows.rows.len();
                rows.rows.retain(|r| r.at_ms >= cutoff_ms);
                Ok((before - rows.rows.len()) as u64)
            }
        }
    }
}

/// The ledger of a store over sqlx, written once for every database: the
/// row and the completion (`complete_in`) commit in one transaction.
#[async_trait]
pub trait SqlxRows: Send + Sync {
    /// Writes `row` and completes `lease` with `outcome`, together.
    async fn record(
        &self,
        row: &Row,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<(), Error>;
    /// Up to `limit` rows after `seq` `after`, oldest first.
    async fn page(&self, after: i64, limit: usize) -> Result<Vec<Row>, Error>;
    /// Deletes up to [`PRUNE_BATCH`] rows older than `cutoff_ms`.
    async fn prune(&self, cutoff_ms: i64) -> Result<u64, Error>;
}

/// The ledger's statements in one database's dialect: `create` makes the
/// table; `insert` binds key, event id, delivery id and time; `page` binds
/// the cursor and the limit; `prune` binds the cutoff.
struct Dialect<DB: sqlx::Database> {
    create: String,
    insert: String,
    page: String,
    prune: String,
    rows_affected: fn(&DB::QueryResult) -> u64,
}

struct SqlxLedger<S: Transactional> {
    store: S,
    sql: Dialect<S::Database>,
}

impl<S: Transactional> SqlxLedger<S>
where
    Self: SqlxRows,
    for<'c> &'c mut ConnectionOf<S>: sqlx::Executor<'c, Database = S::Database>,
{
    /// Makes the table, and answers the store, its inbox and the ledger.
    async fn open(store: S, sql: Dialect<S::Database>) -> Result<Opened, Error>
    where
        S: Inbox,
    {
        sqlx::raw_sql(AssertSqlSafe(sql.create.clone()))
            .execute(store.pool())
            .await
            .map_err(sqlx_err)?;
        let inbox: Arc<dyn Inbox> = Arc::new(store.clone());
        Ok(Opened::inbox(
            inbox,
            Ledger::Sqlx(Box::new(Self { store, sql })),
        ))
    }
}

/// One ledger row as read back: seq, key, event id, delivery id, time.
type Selected = (i64, String, Option<String>, Option<String>, i64);

#[async_trait]
impl<S: Transactional> SqlxRows for SqlxLedger<S>
where
    for<'c> &'c mut ConnectionOf<S>: sqlx::Executor<'c, Database = S::Database>,
    <S::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<S::Database>,
    for<'q> String: sqlx::Encode<'q, S::Database> + sqlx::Type<S::Database>,
    for<'q> Option<String>: sqlx::Encode<'q, S::Database>,
    for<'q> i64: sqlx::Encode<'q, S::Database> + sqlx::Type<S::Database>,
    for<'r> Selected: sqlx::FromRow<'r, <S::Database as sqlx::Database>::Row>,
{
    async fn record(
        &self,
        row: &Row,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<(), Error> {
        let mut tx = self.store.pool().begin().await.map_err(sqlx_err)?;
        sqlx::query(AssertSqlSafe(self.sql.insert.clone()))
            .bind(row.key.clone())
            .bind(row.event_id.clone())
            .bind(row.delivery_id.clone())
            .bind(row.at_ms)
            .execute(&mut *tx)
            .await
            .map_err(sqlx_err)?;
        self.store
            .complete_in(&mut tx, lease, outcome, retention)
            .await?;
        tx.commit().await.map_err(sqlx_err)
    }

    async fn page(&self, after: i64, limit: usize) -> Result<Vec<Row>, Error> {
        let rows: Vec<Selected> = sqlx::query_as(AssertSqlSafe(self.sql.page.clone()))
            .bind(after)
            .bind(limit.min(i64::MAX as usize) as i64)
            .fetch_all(self.store.pool())
            .await
            .map_err(sqlx_err)?;
        Ok(rows
            .into_iter()
            .map(|(seq, key, event_id, delivery_id, at_ms)| Row {
                seq: seq.to_string(),
                key,
                event_id,
                delivery_id,
                at_ms,
            })
            .collect())
    }

    async fn prune(&self, cutoff_ms: i64) -> Result<u64, Error> {
        let done = sqlx::query(AssertSqlSafe(self.sql.prune.clone()))
            .bind(cutoff_ms)
            .execute(self.store.pool())
            .await
            .map_err(sqlx_err)?;
        Ok((self.sql.rows_affected)(&done))
    }
}

/// Whether `record` is the completion of `lease` (done, by its claim).
fn completed_by(record: &dedupe_core::Record, lease: &dedupe_core::Lease) -> bool {
    matches!(record.state, dedupe_core::RecordState::Done { .. }) && record.token == lease.token
}

fn sqlite_conn(path: &std::path::Path) -> Result<dedupe_sqlite::rusqlite::Connection, Error> {
    let conn = dedupe_sqlite::rusqlite::Connection::open(path).map_err(sqlite_err)?;
    conn.busy_timeout(Duration::from_secs(5))
        .map_err(sqlite_err)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sqlite_err)?;
    Ok(conn)
}

/// A unique row id (the ledger must show a second processing as a second row,
/// never overwrite the first).
fn uuid_like() -> String {
    dedupe_core::backend::new_token().to_string()
}

async fn create_dynamo_ledger(
    client: &dedupe_dynamo::aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<(), Error> {
    use dedupe_dynamo::aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    if let Ok(described) = client.describe_table().table_name(table).send().await {
        let keys: Vec<String> = described
            .table()
            .map(|t| {
                t.key_schema()
                    .iter()
                    .map(|k| k.attribute_name().to_string())
                    .collect()
            })
            .unwrap_or_default();
        if keys != ["pk", "sk"] {
            return Err(Error::config(format!(
                "ledger table {table} has the key {keys:?}, not [pk, sk] (an earlier layout): drop it"
            )));
        }
        return Ok(());
    }
    client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .map_err(dynamo_err)?,
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("sk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .map_err(dynamo_err)?,
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .map_err(dynamo_err)?,
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("sk")
                .key_type(KeyType::Range)
                .build()
                .map_err(dynamo_err)?,
        )
        .send()
        .await
        .map_err(dynamo_err)?;
    // A new table takes writes once it is ACTIVE.
    for _ in 0..300 {
        let status = client
            .describe_table()
            .table_name(table)
            .send()
            .await
            .ok()
            .and_then(|t| t.table().and_then(|t| t.table_status().cloned()));
        if status == Some(dedupe_dynamo::aws_sdk_dynamodb::types::TableStatus::Active) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::unavailable(
        format!("ledger table {table} did not become ACTIVE within 30 s"),
        None,
    ))
}
