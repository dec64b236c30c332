//! Each store's raw driver doing its minimal atomic primitive on the same kind
//! of connection the store uses: the baseline the store is measured against.
//!
//! - memory: a locked map insert;
//! - SQLite: `INSERT ... ON CONFLICT DO NOTHING RETURNING` on a connection of
//!   its own, WAL and `synchronous=FULL` as the store, called synchronously on
//!   the benchmark task's own thread (no hand-off at all: the floor any async
//!   SQLite store is measured against);
//! - Postgres: the same statement on a bare connection of its own (no pool);
//! - MySQL / MariaDB: `INSERT IGNORE` on a bare connection of its own (one
//!   row affected: won), a batch as one `INSERT IGNORE` per key in one
//!   transaction (a multi-row one says how many won, not which);
//! - Redis: `SET key 1 NX PX ms` (standalone or Cluster);
//! - DynamoDB: `PutItem` conditioned on `attribute_not_exists(pk)`.
//!
//! A claim answers whether it won; `complete` marks the key done (an `UPDATE`,
//! a `SET ... XX`, an `UpdateItem`) for the `cycle` workload.
//!
//! For the inbox workloads, `accept` is the same insert with the key put in a
//! due queue (a `due` column under a partial index; a sorted set beside the
//! key; the table's due index on DynamoDB; a queue in memory), and `take`
//! the minimal taking of the oldest due key (`UPDATE ... WHERE k = (SELECT
//! ... ORDER BY due LIMIT 1 [FOR UPDATE SKIP LOCKED]) RETURNING k`; on
//! MySQL, which has no `UPDATE ... RETURNING`, that `SELECT` then the `UPDATE`
//! in one transaction;
//! `ZPOPMIN`; a query of the index then an `UpdateItem` conditioned on the
//! key still being due), completed by `complete`. The raw take keeps no
//! lease a dead worker's key could be taken over by: it is the floor.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedupe_core::Error;
use dedupe_url::{Opener, Target};

fn fail(what: &'static str) -> impl Fn(Box<dyn std::error::Error + Send + Sync>) -> Error {
    move |e| Error::retryable(what, Some(e))
}

/// The raw baseline's shared setup (a table, a key prefix).
#[derive(Debug, Clone)]
pub enum RawStore {
    Memory(Arc<Mutex<HashMap<String, bool>>>, Queue),
    Sqlite {
        path: std::path::PathBuf,
    },
    Postgres {
        url: String,
        table: String,
    },
    Mysql {
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

/// The memory baseline's due queue.
pub type Queue = Arc<Mutex<std::collections::VecDeque<String>>>;

/// One task's raw connection.
pub enum RawHandle {
    Memory(Arc<Mutex<HashMap<String, bool>>>, Queue),
    Sqlite(dedupe_sqlite::rusqlite::Connection),
    Postgres {
        conn: dedupe_postgres::sqlx::PgConnection,
        table: String,
    },
    Mysql {
        conn: dedupe_mysql::sqlx::MySqlConnection,
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
    pub async fn prepare(opener: &Opener) -> Result<Option<Self>, Error> {
        Ok(Some(match opener.url().target() {
            Target::Memory => Self::Memory(Arc::default(), Arc::default()),
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
                         (k TEXT PRIMARY KEY, exp INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0, \
                          due INTEGER); \
                         CREATE INDEX IF NOT EXISTS dedupe_raw_bench_due ON dedupe_raw_bench (due) \
                          WHERE due IS NOT NULL",
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
                     (k text PRIMARY KEY, exp timestamptz NOT NULL, done boolean NOT NULL DEFAULT false, \
                      due timestamptz); \
                     CREATE INDEX IF NOT EXISTS dedupe_raw_bench_due ON {table} (due) WHERE due IS NOT NULL"
                )))
                .execute(store.pool())
                .await
                .map_err(|e| fail("postgres")(Box::new(e)))?;
                Self::Postgres {
                    url: url.clone(),
                    table,
                }
            }
            Target::Mysql { url, .. } => {
                let store = opener.mysql(1).await?;
                let table = format!("{}_raw_bench", store.table_name());
                if table.len() > 64 {
                    return Err(Error::config(format!(
                        "table name {} leaves no room for the raw baseline's {table}: MySQL \
                         names are 64 characters at most",
                        store.table_name()
                    )));
                }
                dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE IF NOT EXISTS `{table}` (k VARBINARY(600) PRIMARY KEY, \
                     exp BIGINT NOT NULL, done BOOLEAN NOT NULL DEFAULT FALSE, due BIGINT NULL, \
                     KEY due (due)) ENGINE=InnoDB"
                )))
                .execute(store.pool())
                .await
                .map_err(|e| fail("mysql")(Box::new(e)))?;
                Self::Mysql {
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
            // A store without a raw driver here is measured alone: its rows
            // have no raw figures and no ratio.
            _ => return Ok(None),
        }))
    }

    /// A connection of its own for one task.
    pub async fn handle(&self, opener: &Opener) -> Result<RawHandle, Error> {
        Ok(match self {
            Self::Memory(map, queue) => RawHandle::Memory(Arc::clone(map), Arc::clone(queue)),
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
            Self::Mysql { url, table } => {
                use dedupe_mysql::sqlx::Connection;
                RawHandle::Mysql {
                    conn: dedupe_mysql::sqlx::MySqlConnection::connect(url)
                        .await
                        .map_err(|e| fail("mysql")(Box::new(e)))?,
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
        if let Self::Mysql { table, .. } = self {
            let store = opener.mysql(1).await?;
            dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(format!(
                "DROP TABLE IF EXISTS `{table}`"
            )))
            .execute(store.pool())
            .await
            .map_err(|e| fail("mysql")(Box::new(e)))?;
        }
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
            Self::Memory(map, _) => {
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
            Self::Mysql { conn, table } => {
                use dedupe_mysql::sqlx::Connection;
                let sql = format!("INSERT IGNORE INTO `{table}` (k, exp) VALUES (?, ?)");
                let mysql = |e| fail("mysql")(Box::new(e));
                if let [k] = keys {
                    let done = dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(sql))
                        .bind(k)
                        .bind(now_ms() + lease_ms)
                        .execute(&mut *conn)
                        .await
                        .map_err(mysql)?;
                    return Ok(vec![done.rows_affected() == 1]);
                }
                let mut tx = conn.begin().await.map_err(mysql)?;
                let mut won = Vec::with_capacity(keys.len());
                for k in keys {
                    let done =
                        dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(sql.as_str()))
                            .bind(k)
                            .bind(now_ms() + lease_ms)
                            .execute(&mut *tx)
                            .await
                            .map_err(mysql)?;
                    won.push(done.rows_affected() == 1);
                }
                tx.commit().await.map_err(mysql)?;
                Ok(won)
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
            Self::Memory(map, _) => {
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
            Self::Mysql { conn, table } => {
                let sql = format!("UPDATE `{table}` SET done = TRUE, exp = ? WHERE k = ?");
                dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(sql))
                    .bind(now_ms() + ms)
                    .bind(key)
                    .execute(&mut *conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| fail("mysql")(Box::new(e)))
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

    /// Inserts `key` due now (the inbox's accept): whether it was new.
    pub async fn accept(&mut self, key: &str) -> Result<bool, Error> {
        let now = now_ms();
        match self {
            Self::Mysql { conn, table } => {
                let sql = format!("INSERT IGNORE INTO `{table}` (k, exp, due) VALUES (?, 0, ?)");
                let done = dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(sql))
                    .bind(key)
                    .bind(now)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| fail("mysql")(Box::new(e)))?;
                Ok(done.rows_affected() == 1)
            }
            Self::Memory(map, queue) => {
                let mut map = map.lock().map_err(|_| Error::config("poisoned"))?;
                if map.contains_key(key) {
                    return Ok(false);
                }
                map.insert(key.to_string(), false);
                queue
                    .lock()
                    .map_err(|_| Error::config("poisoned"))?
                    .push_back(key.to_string());
                Ok(true)
            }
            Self::Sqlite(conn) => {
                let sqlite = |e: dedupe_sqlite::rusqlite::Error| fail("sqlite")(Box::new(e));
                let mut stmt = conn
                    .prepare_cached(
                        "INSERT INTO dedupe_raw_bench (k, exp, due) VALUES (?1, 0, ?2) \
                         ON CONFLICT DO NOTHING RETURNING k",
                    )
                    .map_err(sqlite)?;
                let mut rows = stmt.query((key, now)).map_err(sqlite)?;
                Ok(rows.next().map_err(sqlite)?.is_some())
            }
            Self::Postgres { conn, table } => {
                let sql = format!(
                    "INSERT INTO {table} (k, exp, due) VALUES ($1, now(), now()) \
                     ON CONFLICT DO NOTHING RETURNING k"
                );
                let row: Option<(String,)> =
                    dedupe_postgres::sqlx::query_as(dedupe_postgres::sqlx::AssertSqlSafe(sql))
                        .bind(key)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| fail("postgres")(Box::new(e)))?;
                Ok(row.is_some())
            }
            Self::Redis(conn, prefix) => {
                let (set, _): (Option<String>, i64) = dedupe_redis::redis::pipe()
                    .cmd("SET")
                    .arg(format!("{prefix}{key}"))
                    .arg(0)
                    .arg("NX")
                    .cmd("ZADD")
                    .arg(format!("{prefix}{{queue}}"))
                    .arg("NX")
                    .arg(now)
                    .arg(key)
                    .query_async(conn)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                Ok(set.is_some())
            }
            Self::RedisCluster(conn, prefix) => {
                let set: Option<String> = dedupe_redis::redis::cmd("SET")
                    .arg(format!("{prefix}{key}"))
                    .arg(0)
                    .arg("NX")
                    .query_async(conn)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                if set.is_some() {
                    dedupe_redis::redis::cmd("ZADD")
                        .arg(format!("{prefix}{{queue}}"))
                        .arg("NX")
                        .arg(now)
                        .arg(key)
                        .query_async::<i64>(conn)
                        .await
                        .map_err(|e| fail("redis")(Box::new(e)))?;
                }
                Ok(set.is_some())
            }
            Self::Dynamo(client, table) => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                let put = client
                    .put_item()
                    .table_name(table.as_str())
                    .item("pk", AttributeValue::S(key.to_string()))
                    .item("dl", AttributeValue::N(now.to_string()))
                    .item("iq", AttributeValue::S("q".into()))
                    .condition_expression("attribute_not_exists(pk)")
                    .send()
                    .await;
                match put {
                    Ok(_) => Ok(true),
                    Err(e)
                        if dedupe_dynamo::aws_sdk_dynamodb::error::ProvideErrorMetadata::code(
                            &e,
                        ) == Some("ConditionalCheckFailedException") =>
                    {
                        Ok(false)
                    }
                    Err(e) => Err(fail("dynamodb")(Box::new(e))),
                }
            }
        }
    }

    /// Takes the oldest due key out of the queue, leased: `None` when none
    /// is due.
    pub async fn take(&mut self, lease: Duration) -> Result<Option<String>, Error> {
        let lease_ms = lease.as_millis() as i64;
        match self {
            Self::Mysql { conn, table } => {
                use dedupe_mysql::sqlx::Connection;
                let mysql = |e| fail("mysql")(Box::new(e));
                let now = now_ms();
                let mut tx = conn.begin().await.map_err(mysql)?;
                let picked: Option<(Vec<u8>,)> =
                    dedupe_mysql::sqlx::query_as(dedupe_mysql::sqlx::AssertSqlSafe(format!(
                        "SELECT k FROM `{table}` FORCE INDEX (due) WHERE due <= ? ORDER BY due LIMIT 1 \
                         FOR UPDATE SKIP LOCKED"
                    )))
                    .bind(now)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(mysql)?;
                if let Some((k,)) = &picked {
                    dedupe_mysql::sqlx::query(dedupe_mysql::sqlx::AssertSqlSafe(format!(
                        "UPDATE `{table}` SET exp = ?, due = NULL WHERE k = ?"
                    )))
                    .bind(now + lease_ms)
                    .bind(k.as_slice())
                    .execute(&mut *tx)
                    .await
                    .map_err(mysql)?;
                }
                tx.commit().await.map_err(mysql)?;
                Ok(picked.map(|(k,)| String::from_utf8_lossy(&k).into_owned()))
            }
            Self::Memory(_, queue) => Ok(queue
                .lock()
                .map_err(|_| Error::config("poisoned"))?
                .pop_front()),
            Self::Sqlite(conn) => {
                let sqlite = |e: dedupe_sqlite::rusqlite::Error| fail("sqlite")(Box::new(e));
                let now = now_ms();
                let mut stmt = conn
                    .prepare_cached(
                        "UPDATE dedupe_raw_bench SET exp = ?1, due = NULL WHERE k = \
                         (SELECT k FROM dedupe_raw_bench WHERE due IS NOT NULL AND due <= ?2 \
                          ORDER BY due LIMIT 1) RETURNING k",
                    )
                    .map_err(sqlite)?;
                let mut rows = stmt.query((now + lease_ms, now)).map_err(sqlite)?;
                match rows.next().map_err(sqlite)? {
                    Some(row) => Ok(Some(row.get(0).map_err(sqlite)?)),
                    None => Ok(None),
                }
            }
            Self::Postgres { conn, table } => {
                let sql = format!(
                    "UPDATE {table} SET exp = now() + $1::interval, due = NULL WHERE k = \
                     (SELECT k FROM {table} WHERE due IS NOT NULL AND due <= now() \
                      ORDER BY due LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING k"
                );
                let row: Option<(String,)> =
                    dedupe_postgres::sqlx::query_as(dedupe_postgres::sqlx::AssertSqlSafe(sql))
                        .bind(lease)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| fail("postgres")(Box::new(e)))?;
                Ok(row.map(|r| r.0))
            }
            Self::Redis(conn, prefix) => {
                let popped: Vec<String> = dedupe_redis::redis::cmd("ZPOPMIN")
                    .arg(format!("{prefix}{{queue}}"))
                    .query_async(conn)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                Ok(popped.into_iter().next())
            }
            Self::RedisCluster(conn, prefix) => {
                let popped: Vec<String> = dedupe_redis::redis::cmd("ZPOPMIN")
                    .arg(format!("{prefix}{{queue}}"))
                    .query_async(conn)
                    .await
                    .map_err(|e| fail("redis")(Box::new(e)))?;
                Ok(popped.into_iter().next())
            }
            Self::Dynamo(client, table) => {
                use dedupe_dynamo::aws_sdk_dynamodb::types::AttributeValue;
                for _ in 0..8 {
                    let now = now_ms();
                    let found = client
                        .query()
                        .table_name(table.as_str())
                        .index_name("dedupe_due")
                        .key_condition_expression("iq = :q AND dl <= :now")
                        .expression_attribute_values(":q", AttributeValue::S("q".into()))
                        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
                        .limit(1)
                        .send()
                        .await
                        .map_err(|e| fail("dynamodb")(Box::new(e)))?;
                    let Some(pk) = found.items().first().and_then(|i| i.get("pk")).cloned() else {
                        return Ok(None);
                    };
                    let leased = client
                        .update_item()
                        .table_name(table.as_str())
                        .key("pk", pk.clone())
                        .update_expression("SET dl = :until REMOVE iq")
                        .condition_expression("attribute_exists(iq) AND dl <= :now")
                        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
                        .expression_attribute_values(
                            ":until",
                            AttributeValue::N((now + lease_ms).to_string()),
                        )
                        .send()
                        .await;
                    match leased {
                        Ok(_) => return Ok(pk.as_s().ok().cloned()),
                        Err(e)
                            if dedupe_dynamo::aws_sdk_dynamodb::error::ProvideErrorMetadata::code(
                                &e,
                            )
                                == Some("ConditionalCheckFailedException") => {}
                        Err(e) => return Err(fail("dynamodb")(Box::new(e))),
                    }
                }
                Ok(None)
            }
        }
    }
}
