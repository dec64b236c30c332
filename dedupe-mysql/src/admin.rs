//! The tools' store-wide operations ([`Admin`]) on the store's table.

use dedupe_core::backend::{key_cursor, missing, parse_key_cursor, Admin, KeyPage, RecordQuery};
use dedupe_core::Key;
use dedupe_core::{async_trait, Error, Result};

use crate::MySqlStore;

/// Migrate is [`MySqlStore::migrate`]; the namespace is the store's table.
#[async_trait]
impl Admin for MySqlStore {
    async fn migrate(&self) -> Result<()> {
        MySqlStore::migrate(self).await
    }

    /// Reads `information_schema` only: the table in the connection's
    /// database and the newest column of each migration (`sql::GATES`).
    async fn check(&self) -> Result<()> {
        let table = self.table_name();
        let failed = |e| Error::retryable("reading the database's tables", Some(Box::new(e) as _));
        let (database, columns): (Option<String>, Option<String>) = sqlx::query_as(
            "SELECT DATABASE(), (SELECT GROUP_CONCAT(COLUMN_NAME) FROM information_schema.COLUMNS
                                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?)",
        )
        .bind(table)
        .fetch_one(&self.pool)
        .await
        .map_err(failed)?;
        let Some(database) = database else {
            return Err(missing("the URL names no database"));
        };
        let Some(columns) = columns else {
            return Err(missing(format!(
                "no table `{table}` in database `{database}`"
            )));
        };
        for (column, migration) in crate::sql::GATES.into_iter().flatten() {
            if !columns.split(',').any(|c| c == column) {
                return Err(missing(format!(
                    "table `{table}` in `{database}` is from before migration {migration}"
                )));
            }
        }
        let paused: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(format!("{table}_paused"))
        .fetch_one(&self.pool)
        .await
        .map_err(failed)?;
        if paused == 0 {
            return Err(missing(format!(
                "table `{table}` in `{database}` is from before migration 0004_paused"
            )));
        }
        Ok(())
    }

    /// The primary key's order, `(namespace, id)`, one range read of the
    /// primary key a page.
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage> {
        let after = query.after.as_deref().map(parse_key_cursor).transpose()?;
        let table = self.table_name();
        let listing = match &query.namespace {
            Some(namespace) => {
                let after_id = after
                    .filter(|(ns, _)| ns == namespace)
                    .map(|(_, id)| id)
                    .unwrap_or_default();
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT namespace, id FROM `{table}` WHERE namespace = ? AND id > ?
                       AND wait IS NULL ORDER BY id LIMIT ?"
                )))
                .bind(namespace.clone())
                .bind(after_id)
                .bind(query.limit as u64)
            }
            None => {
                let (ns, id) = after.unwrap_or_default();
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT namespace, id FROM `{table}`
                     WHERE (namespace > ? OR (namespace = ? AND id > ?)) AND wait IS NULL
                     ORDER BY namespace, id LIMIT ?"
                )))
                .bind(ns.clone())
                .bind(ns)
                .bind(id)
                .bind(query.limit as u64)
            }
        };
        let rows: Vec<(Vec<u8>, Vec<u8>)> = listing
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::retryable("listing the records", Some(Box::new(e) as _)))?;
        let keys = rows
            .into_iter()
            .map(|(ns, id)| {
                Key::new(String::from_utf8_lossy(&ns), String::from_utf8_lossy(&id))
                    .map_err(Error::from)
            })
            .collect::<Result<Vec<_>>>()?;
        let next = key_cursor(&keys, query.limit);
        Ok(KeyPage { keys, next })
    }

    async fn remove_namespace(&self) -> Result<()> {
        // The name was checked to be a plain identifier when the store was
        // built. The paused namespaces' table goes with the records'.
        let table = self.table_name();
        let statement = format!("DROP TABLE IF EXISTS `{table}`, `{table}_paused`");
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| Error::retryable("dropping the namespace", Some(Box::new(e) as _)))
    }
}
