//! The tools' store-wide operations ([`Admin`]) on the store's table.

use dedupe_core::backend::Admin;
use dedupe_core::{async_trait, Error, Result};

use crate::MySqlStore;

/// Migrate is [`MySqlStore::migrate`]; the namespace is the store's table.
#[async_trait]
impl Admin for MySqlStore {
    async fn migrate(&self) -> Result<()> {
        MySqlStore::migrate(self).await
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
