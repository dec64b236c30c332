//! The tools' store-wide operations ([`Admin`]) on the store's file.

use std::path::Path;

use dedupe_core::backend::{key_cursor, missing, parse_key_cursor, Admin, KeyPage, RecordQuery};
use dedupe_core::Key;
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

    /// The primary key's order, `(namespace, id)`, one range read of the
    /// primary key a page.
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage> {
        let after = query.after.as_deref().map(parse_key_cursor).transpose()?;
        let limit = query.limit;
        let table = self.table_name();
        // Two shapes, each a range of the primary key (an `OR` or an
        // `IS NULL` test would make SQLite scan the table on every page).
        let (statement, first, second) = match &query.namespace {
            Some(namespace) => (
                format!(
                    "SELECT namespace, id FROM \"{table}\"
                     WHERE namespace = ?1 AND id > ?2 AND wait IS NULL ORDER BY id LIMIT ?3"
                ),
                namespace.clone(),
                after
                    .filter(|(ns, _)| ns == namespace)
                    .map(|(_, id)| id)
                    .unwrap_or_default(),
            ),
            None => {
                let (ns, id) = after.unwrap_or_default();
                (
                    format!(
                        "SELECT namespace, id FROM \"{table}\"
                         WHERE (namespace, id) > (?1, ?2) AND wait IS NULL
                         ORDER BY namespace, id LIMIT ?3"
                    ),
                    ns,
                    id,
                )
            }
        };
        let rows = self
            .conns()
            .with_conn(move |_, conn| {
                conn.prepare(&statement)
                    .and_then(|mut stmt| {
                        stmt.query_map((first, second, limit as i64), |row| {
                            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
                        })?
                        .collect::<rusqlite::Result<Vec<_>>>()
                    })
                    .map_err(|e| Error::retryable("listing the records", Some(Box::new(e) as _)))
            })
            .await?;
        let keys = rows
            .into_iter()
            .map(|(ns, id)| Key::new(ns, id).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let next = key_cursor(&keys, limit);
        Ok(KeyPage { keys, next })
    }

    async fn remove_namespace(&self) -> Result<()> {
        let table = self.table_name().to_string();
        let path = self.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(path)?;
            conn.execute_batch(&format!(
                "DROP TABLE IF EXISTS \"{table}\"; DROP TABLE IF EXISTS \"{table}_paused\";"
            ))
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
    // The newest column of each migration that adds some (0003 adds
    // indexes only, which reads do not need).
    for (column, migration) in [
        ("wait", "0002_inbox"),
        ("takeovers", "0004_item_counts"),
        ("order_key", "0006_ordering"),
        ("dead_until", "0007_dead_retention"),
        ("errors", "0008_error_history"),
        ("order_head", "0009_order_park"),
    ] {
        if !columns.iter().any(|c| c == column) {
            return Err(missing(format!(
                "table \"{table}\" in {} is from before migration {migration}",
                path.display()
            )));
        }
    }
    let paused: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [format!("{table}_paused")],
            |row| row.get(0),
        )
        .map_err(failed)?;
    if paused == 0 {
        return Err(missing(format!(
            "table \"{table}\" in {} is from before migration 0005_paused",
            path.display()
        )));
    }
    Ok(())
}
