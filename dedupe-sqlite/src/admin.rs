//! The tools' store-wide operations ([`Admin`]) on the store's file.

use dedupe_core::backend::Admin;
use dedupe_core::{async_trait, Error, Result};

use crate::SqliteStore;

/// Migrate is [`SqliteStore::migrate`]; the namespace is the store's table
/// in its file, dropped on a connection of its own.
#[async_trait]
impl Admin for SqliteStore {
    async fn migrate(&self) -> Result<()> {
        SqliteStore::migrate(self).await
    }

    async fn remove_namespace(&self) -> Result<()> {
        let table = self.table_name().to_string();
        let path = self.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(path)?;
            conn.execute_batch(&format!("DROP TABLE IF EXISTS \"{table}\""))
        })
        .await
        .map_err(|e| Error::fatal("dropping the table", Some(Box::new(e) as _)))?
        .map_err(|e| Error::retryable("dropping the table", Some(Box::new(e) as _)))
    }
}
