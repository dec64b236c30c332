//! Each store's raw driver doing its minimal atomic primitive on the same kind
//! of connection the store uses: the baseline the store is measured against.
//!
//! - memory: a locked map insert;
//! - SQLite: `INSERT ... ON CONFLICT DO NOTHING RETURNING` on a connection of
//!   its own, WAL and `synchronous=FULL` as the store, called synchronously on
//!   the benchmark task's own thread (no hand-off at all: the floor any async
//!   SQLite store is measured against);
//! - Postgres: the same statement on a bare connection of its own (no pool);
//! - Redis: `SET key 1 NX PX ms` (standalone or Cluster);
//! - DynamoDB: `PutItem` conditioned on `attribute_not_exists(pk)`.
//!
//! A claim answers whether it won; `complete` marks the key done (an `UPDATE`,
//! a `SET ... XX`, an `UpdateItem`) for the `cycle` workload.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedupe_core::Error;
use dedupe_url::{Opener, Target};

fn fail(what: &'static str) -> impl Fn(Box<dyn std::error::Error + Send + Sync>) -> Error {
    move |e| Error::backend(what, true, Some(e))
}

/// The raw baseline's shared setup (a table, a key prefix).
#[derive(Debug, Clone)]
pub enum RawStore {
    Memory(Arc<Mutex<HashMap<String, bool>>>),
    Sqlite {
        path: std::path::PathBuf,
    },
    Postgres {
        url: String,
        table: String,
    },
    Redis {
        urls: Vec<String>,
        cluster: bool,
        prefix: String,
    },
    Dynamo {
        table: String,
    },
}

/// One task's raw connection.
pub enum RawHandle {
    Memory(Arc<Mutex<HashMap<String, bool>>>),
    Sqlite(dedupe_sqlite::rusqlite::Connection),
    Postgres {
        conn: dedupe_postgres::sqlx::PgConnection,
        table: String,
    },
    Redis(dedupe_redis::redis::aio::ConnectionManager, String),
    RedisCluster(
        dedupe_redis::redis::cluster_async::ClusterConnection,
        String,
    ),
    Dynamo(dedupe_dynamo::aws_sdk_dynamodb::Client, String),
}

impl RawStore {
    /// Creates what the baseline needs beside the store's own records.
    pub async fn prepare(opener: &Opener) -> Result<Self, Error> {
        Ok(match opener.url().target() {
            Target::Memory => Self::Memory(Arc::default()),
            Target::Sqlite { .. } => {
                let path = opener
                    .sqlite_path()
                    .ok_or_else(|| Error::config("no sqlite file"))?
                    .to_path_buf();
                let p = path.clone();
                tokio::task::spawn_blocking(move || {
                    let conn = sqlite_conn(&p)?;
                    conn.execute_batch(
                        "CREATE TABLE IF NOT EXISTS dedupe_raw_bench \
                         (k TEXT PRIMARY KEY, exp INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0)",
                    )
                    .map_err(|e| fail("sqlite")(Box::new(e)))
                })
                .await
                .map_err(|e| fail("sqlite")(Box::new(e)))??;
                Self::Sqlite { path }
            }
            Target::Postgres { url, schema, .. } => {
                let table = format!(
                    "\"{}\".dedupe_raw_bench",
                    schema.clone().unwrap_or_else(|| "public".into())
                );
                let store = opener.postgres(1).await?;
                dedupe_postgres::sqlx::raw_sql(dedupe_postgres::sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE IF NOT EXISTS {table} \
                     (k text PRIMARY KEY, exp timestamptz NOT NULL, done boolean NOT NULL DEFAULT false)"
                )))
                .execute(store.pool())
                .await
                .map_err(|e| fail("postgres")(Box::new(e)))?;
                Self::Postgres {
                    url: url.clone(),
                    table,
                }
            }
            Target::Redis {
                urls,
                cluster,
                prefix,
                ..
            } => Self::Redis {
                urls: urls.clone(),
                cluster: *cluster,
                prefix: format!("{}raw:", prefix.clone().unwrap_or_else(|| "dedupe:".into())),
            },
            Target::Dynamo { table, .. } => {
                let raw = format!("{table}_raw");
                let client = opener.dynamo_client().await?;
                dedupe_dynamo::DynamoStore::builder(client)
                    .table(&raw)
                    .build()?
                    .create_table_if_missing()
                    .await?;
                Self::Dynamo { table: raw }
            }
            _ => return Err(Error::config("no raw baseline for this store")),
        })
    }

    /// A connection of its own for one task.
    pub async fn handle(&self, opener: &Opener) -> Result<RawHandle, Error> {
        Ok(match self {
            Self::Memory(map) => RawHandle::Memory(Arc::clone(map)),
            Self::Sqlite { path } => RawHandle::Sqlite(sqlite_conn(path)?),
            Self::Postgres { url, table } => {
                use dedupe_postgres::sqlx::Connection;
                RawHandle::Postgres {
                    conn: dedupe_postgres::sqlx::PgConnection::connect(url)
                        .await
                        .map_err(|e| fail("postgres")(Box::new(e)))?,
                    table: table.clone(),
                }
            }
            Self::Redis {
                urls,
                cluster: false,
                prefix,
            } => {
                let client = dedupe_redis::redis::Client::open(urls[0].as_str())
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                let manager = dedupe_redis::redis::aio::ConnectionManager::new(client)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                RawHandle::Redis(manager, prefix.clone())
            }
            Self::Redis {
                urls,
                cluster: true,
                prefix,
            } => {
                let client = dedupe_redis::redis::cluster::ClusterClient::new(urls.clone())
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                let conn = client
                    .get_async_connection()
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                RawHandle::RedisCluster(conn, prefix.clone())
            }
            Self::Dynamo { table } => {
                RawHandle::Dynamo(opener.dynamo_client().await?, table.clone())
            }
        })
    }

    /// Removes the baseline's table (the namespace removal takes the rest).
    pub async fn finish(&self, opener: &Opener) -> Result<(), Error> {
        if let Self::Dynamo { table } = self {
            dedupe_dynamo::DynamoStore::builder(opener.dynamo_client().await?)
                .table(table)
                .build()?
                .delete_table()
                .await?;
        }
        Ok(())
    }
}

fn sqlite_conn(path: &std::path::Path) -> Result<dedupe_sqlite::rusqlite::Connection, Error> {
    let sqlite = |e: dedupe_sqlite::rusqlite::Error| fail("sqlite")(Box::new(e));
    let conn = dedupe_sqlite::rusqlite::Connection::open(path).map_err(sqlite)?;
    conn.busy_timeout(Duration::from_secs(10)).map_err(sqlite)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(sqlite)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sqlite)?;
    Ok(conn)
}

/// `SET prefix+key 1 NX|XX PX ms`: the claim (`NX`) or the completion (`XX`).
fn set(prefix: &str, key: &str, mode: &str, ms: i64) -> dedupe_redis::redis::Cmd {
    let mut cmd = dedupe_redis::redis::cmd("SET");
    cmd.arg(format!("{prefix}{key}"))
        .arg(1)
        .arg(mode)
        .arg("PX")
        .arg(ms);
    cmd
}

fn now_ms() -> i64 {
    dedupe_core::backend::now_millis()
}

impl RawHandle {
    /// Claims `keys` (one, or a batch): which of them this call won.
    pub async fn claim(&mut self, keys: &[String], lease: Duration) -> Result<Vec<bool>, Error> {
        let lease_ms = lease.as_millis() as i64;
        match self {
            Self::Memory(map) => {
                let mut map = map.lock().map_err(|_| Error::config("poisoned"))?;
                Ok(keys
                    .iter()
                    .map(|k| {
                        if map.contains_key(k) {
                            false
                        } else {
                            map.insert(k.clone(), false);
                            true
                        }
                    })
                    .collect())
            }
            Self::Sqlite(conn) => {
                let sqlite = |e: dedupe_sqlite::rusqlite::Error| fail("sqlite")(Box::new(e));
                const CLAIM: &str = "INSERT INTO dedupe_raw_bench (k, exp) VALUES (?1, ?2) \
                                     ON CONFLICT DO NOTHING RETURNING k";
                if let [k] = keys {
                    // One statement in autocommit, as a single claim is.
                    let mut stmt = conn.prepare_cached(CLAIM).map_err(sqlite)?;
                    let mut rows = stmt.query((k, now_ms() + lease_ms)).map_err(sqlite)?;
                    return Ok(vec![rows.next().map_err(sqlite)?.is_some()]);
                }
                let tx = conn.transaction().map_err(sqlite)?;
                let mut won = Vec::with_capacity(keys.len());
                {
                    let mut stmt = tx.prepare_cached(CLAIM).map_err(sqlite)?;
                    for k in keys {
                        let mut rows = stmt.query((k, now_ms() + lease_ms)).map_err(sqlite)?;
                        won.push(rows.next().map_err(sqlite)?.is_some());
                    }
                }
                tx.commit().map_err(sqlite)?;
                Ok(won)
            }
            Self::Postgres { conn, table } => {
                if let [k] = keys {
                    let sql = format!(
                        "INSERT INTO {table} (k, exp) VALUES ($1, now() + $2::interval) \
                         ON CONFLICT DO NOTHING RETURNING k"
                    );
                    let row: Option<(String,)> =
                        dedupe_postgres::sqlx::query_as(dedupe_postgres::sqlx::AssertSqlSafe(sql))
                            .bind(k)
                            .bind(lease)
                            .fetch_optional(&mut *conn)
                            .await
                            .map_err(|e| fail("postgres")(Box::new(e)))?;
                    return Ok(vec![row.is_some()]);
                }
                let sql = format!(
                    "INSERT INTO {table} (k, exp) SELECT k, now() + $2::interval FROM unnest($1::text[]) AS k \
                     ON CONFLICT DO NOTHING RETURNING k"
                );
                let rows: Vec<(String,)> =
                    dedupe_postgres::sqlx::query_as(dedupe_postgres::sqlx::AssertSqlSafe(sql))
                        .bind(keys)
                        .bind(lease)
                        .fetch_all(&mut *conn)
                        .await
                        .map_err(|e| fail("postgres")(Box::new(e)))?;
                let won: std::collections::HashSet<String> =
                    rows.into_iter().map(|r| r.0).collect();
                Ok(keys.iter().map(|k| won.contains(k)).collect())
            }
            Self::Redis(conn, prefix) => {
                let mut pipe = dedupe_redis::redis::pipe();
                for k in keys {
                    pipe.add_command(set(prefix, k, "NX", lease_ms));
                }
                let answers: Vec<Option<String>> = pipe
                    .query_async(conn)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                Ok(answers.into_iter().map(|a| a.is_some()).collect())
            }
            Self::RedisCluster(conn, prefix) => {
                let mut won = Vec::with_capacity(keys.len());
                for k in keys {
                    let answer: Option<String> = set(prefix, k, "NX", lease_ms)
                        .query_async(conn)
                        .await
                        .map_err(|e| fail("redis")(Box::new(e)))?;
                    won.push(answer.is_some());
                }
                Ok(won)
            }
            Self::Dynamo(client, table) => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                use futures_util::StreamExt;
                let mut puts = Vec::with_capacity(keys.len());
                for k in keys {
                    puts.push(
                        client
                            .put_item()
                            .table_name(table.as_str())
                            .item("pk", AttributeValue::S(k.clone()))
                            .item("dl", AttributeValue::N((now_ms() + lease_ms).to_string()))
                            .condition_expression("attribute_not_exists(pk)")
                            .send(),
                    );
                }
                let answers: Vec<_> = futures_util::stream::iter(puts)
                    .buffered(16)
                    .collect()
                    .await;
                answers
                    .into_iter()
                    .map(|a| match a {
                        Ok(_) => Ok(true),
                        Err(e)
                            if dedupe_dynamo::aws_sdk_dynamodb::error::ProvideErrorMetadata::code(
                                &e,
                            )
                                == Some("ConditionalCheckFailedException") =>
                        {
                            Ok(false)
                        }
                        Err(e) => Err(fail("dynamodb")(Box::new(e))),
                    })
                    .collect()
            }
        }
    }

    /// Marks a key done.
    pub async fn complete(&mut self, key: &str, retention: Duration) -> Result<(), Error> {
        let ms = retention.as_millis() as i64;
        match self {
            Self::Memory(map) => {
                map.lock()
                    .map_err(|_| Error::config("poisoned"))?
                    .insert(key.to_string(), true);
                Ok(())
            }
            Self::Sqlite(conn) => conn
                .prepare_cached("UPDATE dedupe_raw_bench SET done = 1, exp = ?2 WHERE k = ?1")
                .and_then(|mut s| s.execute((key, now_ms() + ms)))
                .map(|_| ())
                .map_err(|e| fail("sqlite")(Box::new(e))),
            Self::Postgres { conn, table } => {
                let sql = format!(
                    "UPDATE {table} SET done = true, exp = now() + $2::interval WHERE k = $1"
                );
                dedupe_postgres::sqlx::query(dedupe_postgres::sqlx::AssertSqlSafe(sql))
                    .bind(key)
                    .bind(retention)
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| fail("postgres")(Box::new(e)))
            }
            Self::Redis(conn, prefix) => set(prefix, key, "XX", ms)
                .query_async::<Option<String>>(conn)
                .await
                .map(|_| ())
                .map_err(|e| fail("redis")(Box::new(e))),
            Self::RedisCluster(conn, prefix) => set(prefix, key, "XX", ms)
                .query_async::<Option<String>>(conn)
                .await
                .map(|_| ())
                .map_err(|e| fail("redis")(Box::new(e))),
            Self::Dynamo(client, table) => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                client
                    .update_item()
                    .table_name(table.as_str())
                    .key("pk", AttributeValue::S(key.to_string()))
                    .update_expression("SET dn = :one, dl = :until")
                    .expression_attribute_values(":one", AttributeValue::N("1".into()))
                    .expression_attribute_values(
                        ":until",
                        AttributeValue::N((now_ms() + ms).to_string()),
                    )
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| fail("dynamodb")(Box::new(e)))
            }
        }
    }
}
