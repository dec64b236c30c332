//! The tools' store-wide operations ([`Admin`]) on the store's table.

use dedupe_core::backend::{missing, Admin};
use dedupe_core::{async_trait, Error, Result};

use crate::MySqlStore;

/// Migrate is [`MySqlStore::migrate`]; the namespace is the store's table.
#[async_trait]
impl Admin for MySqlStore {
    async fn migrate(&self) -> Result<()> {
        MySqlStore::migrate(self).await
    }

    /// Reads `information_schema` only: the table in the connection's
    /// database and the newest migration's column (`due_at`, 0002_inbox).
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
        if !columns.split(',').any(|c| c == "due_at") {
            return Err(missing(format!(
                "table `{table}` in `{database}` is from before migration 0002_inbox"
            )));
        }
        Ok(())
    }

    async fn remove_namespace(&self) -> Result<()> {
        // The name was checked to be a plain identifier when the store was
        // built.
        let statement = format!("DROP TABLE IF EXISTS `{}`", self.table_name());
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| Error::retryable("dropping the namespace", Some(Box::new(e) as _)))
    }
}
