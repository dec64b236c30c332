//! The SQLite store runs the whole conformance suite twice: on Tokio's
//! multi-thread runtime (calls run in place on the caller's thread where they
//! can) and on the current-thread runtime (every call goes through the
//! connection threads and the file's writer thread). Each check gets a fresh
//! temporary file, and each racing handle its own connections to that file.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedupe_conformance::{FaultSwitch, FaultyHandle, Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error, Inbox};
use dedupe_sqlite::rusqlite::Connection;
use dedupe_sqlite::SqliteStore;

struct SqliteFactory;

struct SqliteFixture {
    store: SqliteStore,
}

#[async_trait]
impl StoreFactory for SqliteFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let store = SqliteStore::temporary()?.open().await?;
        Ok(Box::new(SqliteFixture { store }))
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

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        Some(Arc::new(self.store.clone()))
    }

    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(Some(Arc::new(self.store.reopen().await?)))
    }

    /// A handle with a short busy timeout; the fault is another connection
    /// holding the file's write lock, as a long transaction elsewhere would.
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        let busy = Duration::from_millis(300);
        let store = SqliteStore::builder(self.store.path())
            .busy_timeout(busy)
            .connection_threads(2)
            .open()
            .await?;
        Ok(Some(FaultyHandle {
            store: Arc::new(store),
            switch: Box::new(WriteLock {
                path: self.store.path().to_path_buf(),
                holder: Arc::new(Mutex::new(None)),
            }),
            bound: Duration::from_secs(2),
        }))
    }
}

/// Holds the database's write lock on a connection of its own while broken.
struct WriteLock {
    path: PathBuf,
    holder: Arc<Mutex<Option<Connection>>>,
}

#[async_trait]
impl FaultSwitch for WriteLock {
    async fn set_broken(&self, broken: bool) -> Result<(), Error> {
        let (path, holder) = (self.path.clone(), Arc::clone(&self.holder));
        tokio::task::spawn_blocking(move || {
            let mut held = holder.lock().unwrap_or_else(|e| e.into_inner());
            if !broken {
                // Dropping the connection rolls the open transaction back.
                held.take();
                return Ok(());
            }
            let fail = |e: dedupe_sqlite::rusqlite::Error| {
                Error::unavailable("could not take the write lock", Some(Box::new(e)))
            };
            let conn = Connection::open(&path).map_err(fail)?;
            conn.busy_timeout(Duration::from_secs(5)).map_err(fail)?;
            conn.execute_batch("BEGIN EXCLUSIVE").map_err(fail)?;
            *held = Some(conn);
            Ok(())
        })
        .await
        .map_err(|e| Error::unavailable("lock thread", Some(Box::new(e))))?
    }
}

dedupe_conformance::suite!(SqliteFactory);

mod current_thread {
    dedupe_conformance::suite!(current_thread, super::SqliteFactory);
}
