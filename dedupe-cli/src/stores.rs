//! Which store a command runs on, and how it opens handles onto it: one per
//! worker, each with its own connection.

use dedupe_postgres::sqlx::AssertSqlSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::ValueEnum;
use dedupe_core::{DedupeStore, Error, MemoryStore};
use dedupe_postgres::PgStore;
use dedupe_sqlite::SqliteStore;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StoreKind {
    /// A SQLite file (the embedded default).
    Sqlite,
    /// A PostgreSQL server (--url or DEDUPE_POSTGRES_URL).
    Postgres,
    /// Process memory.
    Memory,
}

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// Which store to use.
    #[arg(long, value_enum, default_value_t = StoreKind::Sqlite)]
    pub store: StoreKind,
    /// SQLite file (default: a new file in a temporary directory).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// PostgreSQL URL.
    #[arg(long, env = "DEDUPE_POSTGRES_URL")]
    pub url: Option<String>,
    /// PostgreSQL schema (default: a new schema, dropped when the command ends).
    #[arg(long)]
    pub schema: Option<String>,
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// Opens handles onto one store.
#[derive(Debug)]
pub enum Opener {
    Memory(MemoryStore),
    Sqlite {
        file: PathBuf,
        _dir: Option<tempfile::TempDir>,
    },
    Postgres {
        url: String,
        schema: String,
        /// A schema this command created, dropped by `finish`.
        owned: bool,
    },
}

fn fresh_schema() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("dedupe_cli_{}_{nanos}", std::process::id())
}

impl Opener {
    /// Prepares the store (a temp file, a migrated schema).
    pub async fn new(args: &StoreArgs) -> Result<Self, Error> {
        let opener = match args.store {
            StoreKind::Memory => Self::Memory(MemoryStore::new()),
            StoreKind::Sqlite => match &args.file {
                Some(file) => Self::Sqlite {
                    file: file.clone(),
                    _dir: None,
                },
                None => {
                    let dir = tempfile::tempdir()
                        .map_err(|e| Error::unavailable("temp dir", Some(Box::new(e))))?;
                    Self::Sqlite {
                        file: dir.path().join("dedupe.db"),
                        _dir: Some(dir),
                    }
                }
            },
            StoreKind::Postgres => {
                let url = args.url.clone().ok_or_else(|| {
                    Error::config("--store postgres needs --url or DEDUPE_POSTGRES_URL")
                })?;
                let (schema, owned) = match &args.schema {
                    Some(s) => (s.clone(), false),
                    None => (fresh_schema(), true),
                };
                Self::Postgres { url, schema, owned }
            }
        };
        if let Self::Postgres { .. } = opener {
            let store = opener.postgres(4).await?;
            store.migrate().await?;
        }
        Ok(opener)
    }

    async fn postgres(&self, connections: u32) -> Result<PgStore, Error> {
        let Self::Postgres { url, schema, .. } = self else {
            return Err(Error::config("not a postgres store"));
        };
        let pool = PgStore::connect_pool(url, connections, TIMEOUT).await?;
        PgStore::builder(pool)
            .schema(schema)
            .timeout(TIMEOUT)
            .build()
    }

    /// A new handle with its own connection.
    pub async fn open(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(match self {
            Self::Memory(store) => Arc::new(store.clone()),
            Self::Sqlite { file, .. } => Arc::new(SqliteStore::open(file).await?),
            Self::Postgres { .. } => Arc::new(self.postgres(1).await?),
        })
    }

    /// Removes what `new` created outside the process (a Postgres schema).
    pub async fn finish(&self) -> Result<(), Error> {
        if let Self::Postgres {
            schema,
            owned: true,
            ..
        } = self
        {
            let store = self.postgres(1).await?;
            dedupe_postgres::sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP SCHEMA \"{schema}\" CASCADE"
            )))
            .execute(store.pool())
            .await
            .map_err(|e| Error::backend("dropping the schema", true, Some(Box::new(e) as _)))?;
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Memory(_) => "memory".into(),
            Self::Sqlite { file, .. } => format!("sqlite ({})", file.display()),
            Self::Postgres { schema, .. } => format!("postgres (schema {schema})"),
        }
    }
}
