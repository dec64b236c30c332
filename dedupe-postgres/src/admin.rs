//! The tools' store-wide operations ([`Admin`]) on the store's schema.

use dedupe_core::backend::{key_cursor, missing, Admin, KeyPage, RecordQuery};
use dedupe_core::Key;
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

    /// Reads `information_schema` only: the schema, the table and the
    /// newest migration's column (`takeovers`, 0003_item_counts).
    async fn check(&self) -> Result<()> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        let failed = |e| Error::retryable("reading the schema's tables", Some(Box::new(e) as _));
        let (schemas, columns): (i64, Vec<String>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1),
                    ARRAY(SELECT column_name::text FROM information_schema.columns
                          WHERE table_schema = $1 AND table_name = $2)",
        )
        .bind(schema)
        .bind(table)
        .fetch_one(&self.pool)
        .await
        .map_err(failed)?;
        if schemas == 0 {
            return Err(missing(format!("no schema \"{schema}\" in the database")));
        }
        if columns.is_empty() {
            return Err(missing(format!("no table \"{schema}\".\"{table}\"")));
        }
        for (column, migration) in [
            ("due_at", "0002_inbox"),
            ("takeovers", "0003_item_counts"),
            ("order_key", "0005_ordering"),
            ("dead_until", "0006_dead_retention"),
            ("errors", "0007_error_history"),
        ] {
            if !columns.iter().any(|c| c == column) {
                return Err(missing(format!(
                    "table \"{schema}\".\"{table}\" is from before migration {migration}"
                )));
            }
        }
        let paused: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.tables
                            WHERE table_schema = $1 AND table_name = $2)",
        )
        .bind(schema)
        .bind(format!("{table}_paused"))
        .fetch_one(&self.pool)
        .await
        .map_err(failed)?;
        if !paused {
            return Err(missing(format!(
                "table \"{schema}\".\"{table}\" is from before migration 0004_paused"
            )));
        }
        Ok(())
    }

    /// The primary key's order (`namespace:id`, byte order), one index
    /// range read a page.
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        let statement = format!(
            "SELECT key FROM \"{schema}\".\"{table}\" WHERE wait IS NULL AND key > $1
               AND ($2::text IS NULL OR (key > $2 || ':' AND key < $2 || ';'))
             ORDER BY key LIMIT $3"
        );
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(statement))
            .bind(query.after.as_deref().unwrap_or(""))
            .bind(query.namespace.as_deref())
            .bind(query.limit as i64)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::retryable("listing the records", Some(Box::new(e) as _)))?;
        let keys = rows
            .iter()
            .map(|k| {
                let (ns, id) = k.split_once(':').unwrap_or((k, ""));
                Key::new(ns, id).map_err(Error::from)
            })
            .collect::<Result<Vec<_>>>()?;
        let next = key_cursor(&keys, query.limit);
        Ok(KeyPage { keys, next })
    }

    async fn remove_namespace(&self) -> Result<()> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        let statement = if schema == Self::DEFAULT_SCHEMA {
            format!(
                "DROP TABLE IF EXISTS \"{schema}\".\"{table}\", \"{schema}\".\"{table}_paused\""
            )
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
