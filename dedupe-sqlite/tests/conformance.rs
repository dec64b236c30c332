//! The SQLite store runs the whole conformance suite: each check gets a fresh file
//! in a temp dir, and each racing handle its own connection to that file.

use std::sync::Arc;

use dedupe_conformance::{Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error};
use dedupe_sqlite::SqliteStore;

struct SqliteFactory;

struct SqliteFixture {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

#[async_trait]
impl StoreFactory for SqliteFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let dir =
            tempfile::tempdir().map_err(|e| Error::unavailable("temp dir", Some(Box::new(e))))?;
        let store = SqliteStore::open(dir.path().join("conformance.db")).await?;
        Ok(Box::new(SqliteFixture { store, _dir: dir }))
    }
}

#[async_trait]
impl Fixture for SqliteFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.store.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(self.store.reopen().await?))
    }
}

dedupe_conformance::suite!(SqliteFactory);
