//! The tools' store-wide operations ([`Admin`]) on the store's schema.

use dedupe_core::backend::Admin;
use dedupe_core::{async_trait, Error, Result};

use crate::PgStore;

/// Migrate is [`PgStore::migrate`]. The namespace is the store's schema,
/// dropped whole, unless that is `public` (shared with everything else in
/// the database), where only the store's table goes.
#[async_trait]
impl Admin for PgStore {
    async fn migrate(&self) -> Result<()> {
        PgStore::migrate(self).await
    }

    async fn remove_namespace(&self) -> Result<()> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        let statement = if schema == Self::DEFAULT_SCHEMA {
            format!("DROP TABLE IF EXISTS \"{schema}\".\"{table}\"")
        } else {
            format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")
        };
        // Both names were checked to be plain identifiers when the store was
        // built.
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| Error::retryable("dropping the namespace", Some(Box::new(e) as _)))
    }
}
