//! The business step's ledger: one row per processed event, written together
//! with the completion wherever the store allows it.
//!
//! - SQLite and Postgres: the row and `complete_in` commit in one transaction on
//!   the store's own database, so an event is either done with its row or
//!   neither.
//! - DynamoDB: the row is a `Put` into a ledger table in the same
//!   `TransactWriteItems` as the completion (`complete_with`).
//! - memory and Redis: the rows are kept in this process; a row is added, the
//!   lease completed, and the row taken back if the completion failed. A crash
//!   between the two loses the row of a completed event (documented in the
//!   README); these stores have no transaction to share.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedupe_core::{DedupeStore, Error};
use dedupe_url::{Opener, Target};
use dedupe_webhook::WebhookEvent;
use serde::Serialize;

/// One processed event.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Row {
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
    Postgres {
        store: dedupe_postgres::PgStore,
        table: String,
    },
    Dynamo {
        store: dedupe_dynamo::DynamoStore,
        client: dedupe_dynamo::aws_sdk_dynamodb::Client,
        table: String,
    },
    InProcess {
        store: Arc<dyn DedupeStore>,
        rows: Mutex<Vec<Row>>,
    },
}

fn sqlite_err(e: dedupe_sqlite::rusqlite::Error) -> Error {
    Error::unavailable("ledger (sqlite)", Some(Box::new(e)))
}

fn pg_err(e: dedupe_postgres::sqlx::Error) -> Error {
    Error::unavailable("ledger (postgres)", Some(Box::new(e)))
}

fn dynamo_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
    Error::unavailable("ledger (dynamodb)", Some(Box::new(e)))
}

impl Ledger {
    /// The store the receiver claims on, and the ledger beside it.
    pub async fn open(opener: &Opener) -> Result<(Arc<dyn DedupeStore>, Self), Error> {
        Ok(match opener.url().target() {
            Target::Sqlite { .. } => {
                let store = opener
                    .sqlite(dedupe_sqlite::SqliteStore::DEFAULT_CONNECTIONS)
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
                            at_ms INTEGER NOT NULL)",
                        )
                        .map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::backend("ledger thread", false, Some(Box::new(e) as _)))??;
                (Arc::new(store.clone()), Ledger::Sqlite { store, conns })
            }
            Target::Postgres { connections, .. } => {
                let store = opener.postgres(connections.unwrap_or(16)).await?;
                let schema = store
                    .table_name()
                    .split('.')
                    .next()
                    .unwrap_or("public")
                    .to_string();
                let table = format!("\"{schema}\".dedupe_ledger");
                dedupe_postgres::sqlx::raw_sql(dedupe_postgres::sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE IF NOT EXISTS {table} (
                        seq bigserial PRIMARY KEY, key text NOT NULL, event_id text,
                        delivery_id text, at_ms bigint NOT NULL)"
                )))
                .execute(store.pool())
                .await
                .map_err(pg_err)?;
                (Arc::new(store.clone()), Ledger::Postgres { store, table })
            }
            Target::Dynamo { .. } => {
                let store = opener.dynamo().await?;
                let client = opener.dynamo_client().await?;
                let table = format!("{}_ledger", store.table_name());
                create_dynamo_ledger(&client, &table).await?;
                (
                    Arc::new(store.clone()),
                    Ledger::Dynamo {
                        store,
                        client,
                        table,
                    },
                )
            }
            _ => {
                let store = opener.handle().await?;
                (
                    Arc::clone(&store),
                    Ledger::InProcess {
                        store,
                        rows: Mutex::new(Vec::new()),
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
                .map_err(|e| Error::backend("ledger thread", false, Some(Box::new(e) as _)))?
            }
            Ledger::Postgres { store, table } => {
                let mut tx = store.pool().begin().await.map_err(pg_err)?;
                dedupe_postgres::sqlx::query(dedupe_postgres::sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (key, event_id, delivery_id, at_ms) VALUES ($1, $2, $3, $4)"
                )))
                .bind(&row.key)
                .bind(&row.event_id)
                .bind(&row.delivery_id)
                .bind(row.at_ms)
                .execute(&mut *tx)
                .await
                .map_err(pg_err)?;
                store
                    .complete_in(&mut tx, lease, outcome, event.retention)
                    .await?;
                tx.commit().await.map_err(pg_err)
            }
            Ledger::Dynamo { store, table, .. } => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::{
                    AttributeValue, Put, TransactWriteItem,
                };
                let mut put = Put::builder()
                    .table_name(table.as_str())
                    .item("pk", AttributeValue::S(uuid_like()))
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
                    rows.lock().unwrap_or_else(|e| e.into_inner()).push(row);
                }
                done
            }
        }
    }

    /// Every row, oldest first.
    pub async fn rows(&self) -> Result<Vec<Row>, Error> {
        match self {
            Ledger::Sqlite { conns, .. } => {
                let conns = Arc::clone(conns);
                tokio::task::spawn_blocking(move || {
                    conns.with(|conn| {
                    let mut stmt = conn
                        .prepare("SELECT key, event_id, delivery_id, at_ms FROM dedupe_ledger ORDER BY seq")
                        .map_err(sqlite_err)?;
                    let rows = stmt
                        .query_map([], |r| {
                            Ok(Row {
                                key: r.get(0)?,
                                event_id: r.get(1)?,
                                delivery_id: r.get(2)?,
                                at_ms: r.get(3)?,
                            })
                        })
                        .map_err(sqlite_err)?;
                    rows.collect::<Result<Vec<_>, _>>().map_err(sqlite_err)
                    })
                })
                .await
                .map_err(|e| Error::backend("ledger thread", false, Some(Box::new(e) as _)))?
            }
            Ledger::Postgres { store, table } => {
                let rows: Vec<(String, Option<String>, Option<String>, i64)> =
                    dedupe_postgres::sqlx::query_as(dedupe_postgres::sqlx::AssertSqlSafe(format!(
                        "SELECT key, event_id, delivery_id, at_ms FROM {table} ORDER BY seq"
                    )))
                    .fetch_all(store.pool())
                    .await
                    .map_err(pg_err)?;
                Ok(rows
                    .into_iter()
                    .map(|(key, event_id, delivery_id, at_ms)| Row {
                        key,
                        event_id,
                        delivery_id,
                        at_ms,
                    })
                    .collect())
            }
            Ledger::Dynamo { client, table, .. } => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                let mut rows = Vec::new();
                let mut start = None;
                loop {
                    let page = client
                        .scan()
                        .table_name(table.as_str())
                        .consistent_read(true)
                        .set_exclusive_start_key(start)
                        .send()
                        .await
                        .map_err(dynamo_err)?;
                    for item in page.items() {
                        let s = |name: &str| match item.get(name) {
                            Some(AttributeValue::S(s)) => Some(s.clone()),
                            _ => None,
                        };
                        let at_ms = match item.get("at_ms") {
                            Some(AttributeValue::N(n)) => n.parse().unwrap_or(0),
                            _ => 0,
                        };
                        rows.push(Row {
                            key: s("key").unwrap_or_default(),
                            event_id: s("event_id"),
                            delivery_id: s("delivery_id"),
                            at_ms,
                        });
                    }
                    match page.last_evaluated_key() {
                        Some(k) if !k.is_empty() => start = Some(k.clone()),
                        _ => break,
                    }
                }
                rows.sort_by_key(|r| r.at_ms);
                Ok(rows)
            }
            Ledger::InProcess { rows, .. } => {
                Ok(rows.lock().unwrap_or_else(|e| e.into_inner()).clone())
            }
        }
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
    let exists = client
        .describe_table()
        .table_name(table)
        .send()
        .await
        .is_ok();
    if exists {
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
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
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
