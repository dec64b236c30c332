//! The settings of a store ([`SqliteBuilder`]), and opening one from them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{Capabilities, Error, Result, DEFAULT_MAX_OUTCOME_BYTES};

use crate::conn::Conns;
use crate::group::FileWriter;
use crate::ops::Settings;
use crate::sql::Statements;
use crate::store::SqliteStore;

/// Settings of a [`SqliteStore`]; build one with [`SqliteStore::builder`].
#[derive(Debug, Clone)]
pub struct SqliteBuilder {
    path: PathBuf,
    table: String,
    busy_timeout: Duration,
    max_outcome_bytes: usize,
    connections: usize,
    /// The temporary directory the file is in, when the store owns it.
    pub(crate) dir: Option<Arc<tempfile::TempDir>>,
    /// Whether `open` creates and migrates (see `create`).
    create: bool,
}

impl SqliteBuilder {
    /// The file the store opens.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Connection threads this handle (and its clones) starts, each owning a
    /// connection (default 4): they run the calls that cannot run on the
    /// caller's thread. SQLite lets one writer in at a time whatever the count;
    /// more threads let reads (duplicates) run beside a write. The handle also
    /// opens as many read connections for reads on the caller's thread, and
    /// more (up to 32) when that many reads run at once, and one or two write
    /// connections for writes on the caller's thread. Writes that must wait go
    /// to one writer thread per file and process, with a connection of its
    /// own, shared by every handle (see the crate's README: group commit).
    pub fn connection_threads(mut self, connections: usize) -> Self {
        self.connections = connections;
        self
    }

    /// Table that holds the records (default `dedupe_records`). Must be a plain
    /// identifier; anything else is refused with `InvalidConfig` at `open`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a call waits for another connection's write lock, or in a
    /// queue for its turn, before it fails with a retryable [`Error::Timeout`]
    /// (default 5 s). The bound holds per step: a claim whose duplicate check
    /// could not run on the caller's thread waits up to this long for that read
    /// on a connection thread, then up to this long again for its write.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Largest outcome `complete` accepts (default 256 KiB).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Whether [`open`](Self::open) creates a missing file and table and
    /// migrates them (the default), or opens only a file whose table is
    /// there with the current migration's columns, and fails naming what is
    /// missing, having created nothing (for tools that only read). Opened,
    /// its connections use the file as any handle does (WAL, with its
    /// `-wal` and `-shm` files).
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Opens (or creates) the database file, switches it to WAL, and creates the
    /// table and index if they are missing (unless [`create`](Self::create)
    /// is off). The work runs on the handle's own connection threads and a
    /// blocking task, never on the async runtime's.
    pub async fn open(self) -> Result<SqliteStore> {
        let sql = Statements::new(&self.table)?;
        if !self.create {
            let (path, table) = (self.path.clone(), self.table.clone());
            tokio::task::spawn_blocking(move || crate::admin::check_file(&path, &table))
                .await
                .map_err(|e| Error::fatal("checking the file", Some(Box::new(e) as _)))??;
        }
        if self.busy_timeout.is_zero() {
            return Err(Error::config("busy timeout must be above zero"));
        }
        if self.connections == 0 {
            return Err(Error::config("a store needs at least one connection"));
        }
        let writer = FileWriter::for_file(&self.path)?;
        let settings = Settings {
            sql,
            turn: Arc::clone(writer.turn()),
            path: self.path,
            busy_timeout: self.busy_timeout,
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
        };
        let store =
            SqliteStore::from_parts(Conns::start(self.connections, settings, writer)?, self.dir);
        if self.create {
            // The first connection opens now, so a bad path or file fails here.
            store.migrate().await?;
        }
        store.conns().open_readers(self.connections).await?;
        Ok(store)
    }
}

impl SqliteStore {
    /// Settings for a store on the file at `path`.
    pub fn builder(path: impl Into<PathBuf>) -> SqliteBuilder {
        SqliteBuilder {
            path: path.into(),
            table: Self::DEFAULT_TABLE.to_string(),
            busy_timeout: Self::DEFAULT_BUSY_TIMEOUT,
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            connections: Self::DEFAULT_CONNECTION_THREADS,
            dir: None,
            create: true,
        }
    }

    /// Settings for a store on a file in a new temporary directory that the
    /// store owns: the directory and the file go when the last handle onto it
    /// (its clones, and the handles [`reopen`](Self::reopen) and
    /// [`rebuild`](Self::rebuild) open) is dropped. For tests, demos and
    /// `sqlite:` URLs without a path.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = dedupe_sqlite::SqliteStore::temporary()?.open().await?;
    /// let dir = store.path().parent().unwrap().to_path_buf();
    /// let other = store.reopen().await?;
    /// drop(store);
    /// assert!(dir.exists(), "another handle still uses it");
    /// drop(other);
    /// assert!(!dir.exists());
    /// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
    /// ```
    pub fn temporary() -> Result<SqliteBuilder> {
        let dir = tempfile::tempdir()
            .map_err(|e| Error::unavailable("a temporary directory", Some(Box::new(e))))?;
        let mut builder = Self::builder(dir.path().join("dedupe.db"));
        builder.dir = Some(Arc::new(dir));
        Ok(builder)
    }

    /// Opens the file at `path` with default settings.
    pub async fn open(path: impl Into<PathBuf>) -> Result<Self> {
        Self::builder(path).open().await
    }
}
