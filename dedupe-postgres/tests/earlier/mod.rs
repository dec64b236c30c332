//! A table as the first versions of `migrate` made it: two key columns
//! (`namespace`, `id`) in the database's collation, an index on `expires_at`
//! and a CHECK on `state`. Stores must keep working on it unchanged.

/// Creates `schema` and, in it, the earlier `dedupe_records` table.
pub fn create_sql(schema: &str) -> String {
    let t = format!("\"{schema}\".dedupe_records");
    format!(
        "CREATE SCHEMA \"{schema}\";
         CREATE TABLE {t} (
             namespace text NOT NULL, id text NOT NULL,
             state smallint NOT NULL CHECK (state IN (0, 1)), token text NOT NULL,
             claim_id text, fingerprint bytea, expires_at timestamptz NOT NULL,
             completed_at timestamptz, outcome bytea, attempts integer NOT NULL,
             first_seen timestamptz NOT NULL, PRIMARY KEY (namespace, id));
         CREATE INDEX \"dedupe_records_expires_at\" ON {t} (expires_at);"
    )
}
