//! Which store a command runs on, and how it opens handles onto it: one per
//! worker, each with its own connection.

use dedupe_postgres::sqlx::AssertSqlSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::ValueEnum;
use dedupe_core::{DedupeStore, Error, MemoryStore};
use dedupe_dynamo::DynamoStore;
use dedupe_postgres::PgStore;
use dedupe_redis::RedisStore;
use dedupe_sqlite::SqliteStore;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StoreKind {
    /// A SQLite file (the embedded default).
    Sqlite,
    /// A PostgreSQL server (--url or DEDUPE_POSTGRES_URL).
    Postgres,
    /// A Redis server, or a Cluster given as a comma-separated list of its
    /// masters (--url or DEDUPE_REDIS_URL).
    Redis,
    /// A DynamoDB table: AWS itself through the standard AWS chain
    /// (environment, profile, metadata), or an emulator or compatible service
    /// at --url (or DEDUPE_DYNAMODB_ENDPOINT).
    Dynamodb,
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
    /// Server URL: `postgres://...` (or DEDUPE_POSTGRES_URL), `redis://...`,
    /// `rediss://...`, or several `redis://` masters of a Cluster separated by
    /// commas (or DEDUPE_REDIS_URL).
    #[arg(long)]
    pub url: Option<String>,
    /// PostgreSQL schema (default: a new schema, dropped when the command ends).
    #[arg(long)]
    pub schema: Option<String>,
    /// Redis key prefix (default: a new prefix whose keys are deleted when the
    /// command ends).
    #[arg(long)]
    pub prefix: Option<String>,
    /// DynamoDB table (default: a new table, deleted when the command ends).
    #[arg(long)]
    pub table: Option<String>,
}

/// `--url`, else the store's environment variable.
fn url_of(args: &StoreArgs, var: &str, store: &str) -> Result<String, Error> {
    args.url
        .clone()
        .or_else(|| std::env::var(var).ok().filter(|u| !u.is_empty()))
        .ok_or_else(|| Error::config(format!("--store {store} needs --url or {var}")))
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
    Redis {
        urls: Vec<String>,
        prefix: String,
        /// A prefix this command made up; its keys are deleted by `finish`.
        owned: bool,
    },
    Dynamo {
        /// An endpoint override; none: AWS through the standard chain.
        endpoint: Option<String>,
        table: String,
        /// A table this command created, deleted by `finish`.
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
            StoreKind::Redis => {
                let urls = url_of(args, "DEDUPE_REDIS_URL", "redis")?
                    .split(',')
                    .map(|u| u.trim().to_string())
                    .collect();
                let (prefix, owned) = match &args.prefix {
                    Some(p) => (p.clone(), false),
                    None => (format!("{}:", fresh_schema()), true),
                };
                Self::Redis {
                    urls,
                    prefix,
                    owned,
                }
            }
            StoreKind::Dynamodb => {
                let endpoint = args.url.clone().or_else(|| {
                    std::env::var("DEDUPE_DYNAMODB_ENDPOINT")
                        .ok()
                        .filter(|u| !u.is_empty())
                });
                let (table, owned) = match &args.table {
                    Some(t) => (t.clone(), false),
                    None => (fresh_schema(), true),
                };
                Self::Dynamo {
                    endpoint,
                    table,
                    owned,
                }
            }
            StoreKind::Postgres => {
                let url = url_of(args, "DEDUPE_POSTGRES_URL", "postgres")?;
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
        if let Self::Dynamo { owned: true, .. } = opener {
            opener.dynamo().await?.create_table_if_missing().await?;
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

    async fn redis(&self) -> Result<RedisStore, Error> {
        let Self::Redis { urls, prefix, .. } = self else {
            return Err(Error::config("not a redis store"));
        };
        let builder = match urls.as_slice() {
            [one] => RedisStore::builder(one.clone()),
            many => RedisStore::cluster_builder(many.to_vec()),
        };
        builder.prefix(prefix).timeout(TIMEOUT).connect().await
    }

    async fn dynamo(&self) -> Result<DynamoStore, Error> {
        let Self::Dynamo {
            endpoint, table, ..
        } = self
        else {
            return Err(Error::config("not a dynamodb store"));
        };
        let client = match endpoint {
            // Emulators and compatible services take any credentials.
            Some(endpoint) if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() => {
                let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
                dedupe_dynamo::client_for_endpoint(endpoint, &region, TIMEOUT)
            }
            endpoint => dedupe_dynamo::client_from_env(endpoint.as_deref()).await,
        };
        DynamoStore::builder(client).table(table).build()
    }

    /// A new handle with its own connection.
    pub async fn open(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(match self {
            Self::Memory(store) => Arc::new(store.clone()),
            Self::Sqlite { file, .. } => Arc::new(SqliteStore::open(file).await?),
            Self::Postgres { .. } => Arc::new(self.postgres(1).await?),
            Self::Redis { .. } => Arc::new(self.redis().await?),
            Self::Dynamo { .. } => Arc::new(self.dynamo().await?),
        })
    }

    /// What the store promises about keeping records across a restart, where it
    /// can say (Redis).
    pub async fn durability(&self) -> Option<String> {
        match self {
            Self::Redis { .. } => Some(self.redis().await.ok()?.durability().await.to_string()),
            _ => None,
        }
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
        if let Self::Redis {
            urls,
            prefix,
            owned: true,
        } = self
        {
            // Each URL's own keys (on a Cluster, each master's), by SCAN.
            for url in urls {
                delete_prefixed(url, prefix).await?;
            }
        }
        if let Self::Dynamo { owned: true, .. } = self {
            self.dynamo().await?.delete_table().await?;
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Memory(_) => "memory".into(),
            Self::Sqlite { file, .. } => format!("sqlite ({})", file.display()),
            Self::Postgres { schema, .. } => format!("postgres (schema {schema})"),
            Self::Redis { urls, prefix, .. } if urls.len() > 1 => {
                format!("redis cluster of {} nodes (prefix {prefix})", urls.len())
            }
            Self::Redis { prefix, .. } => format!("redis (prefix {prefix})"),
            Self::Dynamo {
                endpoint: Some(endpoint),
                table,
                ..
            } => format!("dynamodb at {endpoint} (table {table})"),
            Self::Dynamo { table, .. } => format!("dynamodb (table {table})"),
        }
    }
}

/// Deletes the keys under `prefix` held by the server at `url`.
async fn delete_prefixed(url: &str, prefix: &str) -> Result<(), Error> {
    use dedupe_redis::redis::{self, AsyncCommands};
    let fail = |e: redis::RedisError| {
        Error::backend("cleaning up redis keys", true, Some(Box::new(e) as _))
    };
    let client = redis::Client::open(url).map_err(fail)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(fail)?;
    let keys: Vec<String> = {
        let mut iter: redis::AsyncIter<'_, String> =
            conn.scan_match(format!("{prefix}*")).await.map_err(fail)?;
        let mut keys = Vec::new();
        while let Some(key) = iter.next_item().await {
            keys.push(key.map_err(fail)?);
        }
        keys
    };
    for chunk in keys.chunks(500) {
        for key in chunk {
            // One key per call: on a Cluster node, keys of one call must share a slot.
            let _: i64 = conn.del(key).await.map_err(fail)?;
        }
    }
    Ok(())
}
