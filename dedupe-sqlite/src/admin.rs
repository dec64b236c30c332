//! The tools' store-wide operations ([`Admin`]) on the store's file.

use std::path::Path;

use dedupe_core::backend::{missing, Admin};
use dedupe_core::{async_trait, Error, Result};
use rusqlite::OpenFlags;

use crate::SqliteStore;

/// Migrate is [`SqliteStore::migrate`]; the namespace is the store's table
/// in its file, dropped on a connection of its own.
#[async_trait]
impl Admin for SqliteStore {
    async fn migrate(&self) -> Result<()> {
        SqliteStore::migrate(self).await
    }

    async fn check(&self) -> Result<()> {
        let (path, table) = (self.path().to_path_buf(), self.table_name().to_string());
        tokio::task::spawn_blocking(move || check_file(&path, &table))
            .await
            .map_err(|e| Error::fatal("checking the file", Some(Box::new(e) as _)))?
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

/// Whether the file at `path` holds `table` at the current migration, read
/// on a read-only connection (it creates no file and changes none).
pub(crate) fn check_file(path: &Path, table: &str) -> Result<()> {
    if !path.is_file() {
        return Err(missing(format!("no SQLite file at {}", path.display())));
    }
    let failed = |e| Error::retryable("reading the file's tables", Some(Box::new(e) as _));
    let conn = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(failed)?;
    let columns = conn
        .prepare("SELECT name FROM pragma_table_info(?1)")
        .and_then(|mut stmt| {
            stmt.query_map([table], |row| row.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<String>>>()
        })
        .map_err(failed)?;
    if columns.is_empty() {
        return Err(missing(format!(
            "no table \"{table}\" in the SQLite file {}",
            path.display()
        )));
    }
    // `wait` is the newest migration's (0002_inbox) column.
    if !columns.iter().any(|c| c == "wait") {
        return Err(missing(format!(
            "table \"{table}\" in {} is from before migration 0002_inbox",
            path.display()
        )));
    }
    Ok(())
}
