//! The tools' store-wide operations ([`Admin`]) on the store's table.

use dedupe_core::backend::{Admin, KeyPage, RecordQuery};
use dedupe_core::{async_trait, Result};

use crate::DynamoStore;

/// Migrate makes the table with its indexes when it is missing
/// ([`DynamoStore::create_table_if_missing`]), check describes it
/// ([`DynamoStore::check_ready`]); the namespace is the table
/// ([`DynamoStore::delete_table`]).
#[async_trait]
impl Admin for DynamoStore {
    async fn migrate(&self) -> Result<()> {
        self.create_table_if_missing().await
    }

    async fn check(&self) -> Result<()> {
        self.check_ready().await
    }

    /// A `Scan` a page ([`DynamoStore::scan_record_keys`]).
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage> {
        self.scan_record_keys(query).await
    }

    async fn remove_namespace(&self) -> Result<()> {
        self.delete_table().await
    }
}
