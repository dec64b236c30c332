//! What the tools do to a store as a whole, beside its records, written once
//! per store: make its tables, remove a namespace, say how durable it is.

use std::fmt;

use dedupe_core::{async_trait, Error};

/// The store-wide operations of a store opened by URL ([`Opened::admin`]):
/// `dedupe` uses them to prepare a store, to remove the namespaces its runs
/// make for themselves, and to report durability.
///
/// [`Opened::admin`]: crate::Opened::admin
#[async_trait]
pub trait Admin: Send + Sync + fmt::Debug {
    /// Makes the store's tables, schema or keyspace ready; safe to run again
    /// and from several processes at once.
    async fn migrate(&self) -> Result<(), Error>;

    /// Removes the namespace the URL names (the SQLite table, the Postgres
    /// schema of `?schema=` or without one the store's table in `public`, the
    /// MySQL table, every key under the Redis prefix, the DynamoDB table),
    /// with every record in it. For namespaces a run made for itself
    /// ([`StoreUrl::in_namespace`](crate::StoreUrl::in_namespace)); never
    /// call it on a live deployment's.
    async fn remove_namespace(&self) -> Result<(), Error>;

    /// One line on what the store promises about keeping records across a
    /// restart, where it can say (Redis: its persistence settings).
    async fn durability(&self) -> Option<String> {
        None
    }
}

/// `memory:`: nothing to make or remove; the records live in the process.
#[derive(Debug)]
pub(crate) struct MemoryAdmin;

#[async_trait]
impl Admin for MemoryAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// `sqlite://`: the store's table in its file.
#[cfg(feature = "sqlite")]
#[derive(Debug)]
pub(crate) struct SqliteAdmin(pub(crate) dedupe_sqlite::SqliteStore);

#[cfg(feature = "sqlite")]
#[async_trait]
impl Admin for SqliteAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        self.0.migrate().await
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        let table = self.0.table_name().to_string();
        let path = self.0.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            let conn = dedupe_sqlite::rusqlite::Connection::open(path)?;
            conn.execute_batch(&format!("DROP TABLE IF EXISTS \"{table}\""))
        })
        .await
        .map_err(|e| Error::fatal("dropping the table", Some(Box::new(e) as _)))?
        .map_err(|e| Error::retryable("dropping the table", Some(Box::new(e) as _)))
    }
}

/// `postgres://`: the schema the URL names, or the store's table in
/// `public`.
#[cfg(feature = "postgres")]
#[derive(Debug)]
pub(crate) struct PgAdmin {
    pub(crate) store: dedupe_postgres::PgStore,
    /// The URL's `?schema=`, a schema of the store's own.
    pub(crate) schema: Option<String>,
}

#[cfg(feature = "postgres")]
#[async_trait]
impl Admin for PgAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        self.store.migrate().await
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        // A URL with `?schema=` names a schema of the store's own: it goes
        // whole. Without one the store's table is in the default schema
        // (`public`), shared with everything else in the database: only
        // that table goes.
        let statement = match &self.schema {
            Some(schema) => format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
            None => format!(
                "DROP TABLE IF EXISTS \"{}\".\"{}\"",
                dedupe_postgres::PgStore::DEFAULT_SCHEMA,
                dedupe_postgres::PgStore::DEFAULT_TABLE
            ),
        };
        dedupe_postgres::sqlx::raw_sql(dedupe_postgres::sqlx::AssertSqlSafe(statement))
            .execute(self.store.pool())
            .await
            .map(|_| ())
            .map_err(|e| Error::retryable("dropping the namespace", Some(Box::new(e) as _)))
    }
}

/// `mysql://`: the store's table, and the ledger `dedupe serve` keeps
/// beside it.
#[cfg(feature = "mysql")]
#[derive(Debug)]
pub(crate) struct MySqlAdmin(pub(crate) dedupe_mysql::MySqlStore);

#[cfg(feature = "mysql")]
#[async_trait]
impl Admin for MySqlAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        self.0.migrate().await
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        let statement = format!(
            "DROP TABLE IF EXISTS `{0}`, `{0}_ledger`",
            self.0.table_name()
        );
        dedupe_mysql::sqlx::raw_sql(dedupe_mysql::sqlx::AssertSqlSafe(statement))
            .execute(self.0.pool())
            .await
            .map(|_| ())
            .map_err(|e| Error::retryable("dropping the namespace", Some(Box::new(e) as _)))
    }
}

/// `redis://`, `redis+cluster://`: every key under the store's prefix, on
/// each server the URL names.
#[cfg(feature = "redis")]
#[derive(Debug)]
pub(crate) struct RedisAdmin {
    pub(crate) store: dedupe_redis::RedisStore,
    pub(crate) urls: Vec<String>,
}

#[cfg(feature = "redis")]
#[async_trait]
impl Admin for RedisAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        for url in &self.urls {
            delete_prefixed(url, self.store.prefix()).await?;
        }
        Ok(())
    }

    async fn durability(&self) -> Option<String> {
        let evicted = match self.store.evicted_keys().await {
            Some(n) => format!("evicted_keys {n}"),
            None => "evicted_keys unknown".into(),
        };
        Some(format!("{}; {evicted}", self.store.durability().await))
    }
}

/// `dynamodb://`: the store's table.
#[cfg(feature = "dynamodb")]
#[derive(Debug)]
pub(crate) struct DynamoAdmin(pub(crate) dedupe_dynamo::DynamoStore);

#[cfg(feature = "dynamodb")]
#[async_trait]
impl Admin for DynamoAdmin {
    async fn migrate(&self) -> Result<(), Error> {
        self.0.create_table_if_missing().await
    }

    async fn remove_namespace(&self) -> Result<(), Error> {
        self.0.delete_table().await
    }
}

/// Deletes the keys under `prefix` held by the server at `url` (on a Cluster,
/// each master's own keys).
#[cfg(feature = "redis")]
async fn delete_prefixed(url: &str, prefix: &str) -> Result<(), Error> {
    use dedupe_redis::redis::{self, AsyncCommands};
    let fail = |e: redis::RedisError| {
        Error::retryable("deleting the prefix's keys", Some(Box::new(e) as _))
    };
    let client = redis::Client::open(url).map_err(fail)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(fail)?;
    let keys: Vec<String> = {
        let mut iter: redis::AsyncIter<'_, String> = conn
            .scan_match(format!("{}*", glob_escape(prefix)))
            .await
            .map_err(fail)?;
        let mut keys = Vec::new();
        while let Some(key) = iter.next_item().await {
            keys.push(key.map_err(fail)?);
        }
        keys
    };
    for key in keys {
        // One key per call: on a Cluster node, keys of one call must share a slot.
        let _: i64 = conn.del(key).await.map_err(fail)?;
    }
    Ok(())
}

/// A prefix as a literal in a SCAN pattern.
#[cfg(feature = "redis")]
fn glob_escape(prefix: &str) -> String {
    let mut escaped = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}
