//! Opening the store a URL names: handles, each with its own connection.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{DedupeStore, Deduper, Error, Inbox, MemoryStore};

use crate::parse::{StoreUrl, Target};
use dedupe_core::backend::Admin;

/// A store opened by URL: the store, the same store as its inbox when it
/// offers one, and its store-wide operations.
#[derive(Debug, Clone)]
pub struct Opened {
    /// A handle with a connection (or pool) of its own.
    pub store: Arc<dyn DedupeStore>,
    /// The same handle as an inbox, when the store offers one.
    pub inbox: Option<Arc<dyn Inbox>>,
    /// Migrate, remove the namespace, durability.
    pub admin: Arc<dyn Admin>,
}

impl Opened {
    /// A store that offers the inbox and is its own admin.
    fn of<S: Inbox + Admin + 'static>(store: S) -> Self {
        let store = Arc::new(store);
        Self {
            store: store.clone(),
            inbox: Some(store.clone()),
            admin: store,
        }
    }
}

/// The bound on each store call when the URL sets no `timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// A store named by a URL, ready to hand out handles: the SQLite file and
/// table exist, the Postgres schema is migrated, the DynamoDB table exists.
/// Every [`handle`](Opener::handle) has a connection (or pool) of its own and
/// sees the same records; `memory:` handles share one map.
#[derive(Debug)]
pub struct Opener {
    url: StoreUrl,
    memory: MemoryStore,
    /// The file of `sqlite:` (the URL's, or a temporary one).
    sqlite_path: Option<PathBuf>,
    /// For `sqlite:` without a path: the settings of a store on a temporary
    /// file, which every handle opened from them keeps until it drops.
    #[cfg(feature = "sqlite")]
    sqlite_temporary: Option<dedupe_sqlite::SqliteBuilder>,
    /// Whether opening may create and migrate (see [`Opener::existing`]).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    create: bool,
}

impl Opener {
    /// Prepares the store `url` names (creates the SQLite file, migrates the
    /// Postgres schema, creates the DynamoDB table when missing) and checks
    /// that it answers.
    pub async fn new(url: StoreUrl) -> Result<Self, Error> {
        let opener = Self::unprepared(url, true)?;
        opener.open().await?.admin.migrate().await?;
        Ok(opener)
    }

    /// Opens the store `url` names as it is, creating and migrating nothing,
    /// for the tools that read records or remove them (`dedupe inspect`,
    /// `forget`, `purge`, `inbox`): a typo in a URL then creates no file,
    /// schema or table. Fails with an `Error::InvalidConfig` naming what is
    /// missing ([`Admin::check`]) and how to make it; `sqlite:` without a
    /// path (a new temporary file) is refused.
    pub async fn existing(url: StoreUrl) -> Result<Self, Error> {
        let opener = Self::unprepared(url, false)?;
        opener.open().await?.admin.check().await?;
        Ok(opener)
    }

    fn unprepared(url: StoreUrl, create: bool) -> Result<Self, Error> {
        let mut opener = Self {
            url,
            memory: MemoryStore::new(),
            sqlite_path: None,
            #[cfg(feature = "sqlite")]
            sqlite_temporary: None,
            create,
        };
        if let Target::Sqlite { path, .. } = opener.url.target() {
            match path {
                Some(path) => opener.sqlite_path = Some(path.clone()),
                #[cfg(feature = "sqlite")]
                None if !create => {
                    return Err(Error::config(
                        "sqlite: without a path names a new temporary file, not an existing \
                         store: give the store's file (sqlite:///path/to/file.db)",
                    ))
                }
                #[cfg(feature = "sqlite")]
                None => {
                    let temporary = dedupe_sqlite::SqliteStore::temporary()?;
                    opener.sqlite_path = Some(temporary.path().to_path_buf());
                    opener.sqlite_temporary = Some(temporary);
                }
                #[cfg(not(feature = "sqlite"))]
                None => {}
            }
        }
        Ok(opener)
    }

    /// The URL (passwords hidden when displayed).
    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    /// The SQLite file, for `sqlite:` URLs.
    pub fn sqlite_path(&self) -> Option<&std::path::Path> {
        self.sqlite_path.as_deref()
    }

    fn timeout(&self) -> Duration {
        self.url.timeout().unwrap_or(DEFAULT_TIMEOUT)
    }

    /// Opens the store anew: a handle with a connection (or pool) of its
    /// own, the same store as its inbox when it offers one, and its
    /// [`Admin`]. This is the one place a URL's store is chosen.
    pub async fn open(&self) -> Result<Opened, Error> {
        Ok(match self.url.target() {
            Target::Memory => Opened::of(self.memory.clone()),
            #[cfg(feature = "sqlite")]
            Target::Sqlite { connections, .. } => {
                let store = self
                    .sqlite(connections.map_or(
                        dedupe_sqlite::SqliteStore::DEFAULT_CONNECTION_THREADS,
                        |n| n as usize,
                    ))
                    .await?;
                Opened::of(store)
            }
            #[cfg(feature = "postgres")]
            Target::Postgres { connections, .. } => {
                Opened::of(self.postgres_dedicated(connections.unwrap_or(4)).await?)
            }
            #[cfg(feature = "mysql")]
            Target::Mysql { connections, .. } => {
                Opened::of(self.mysql_dedicated(connections.unwrap_or(4)).await?)
            }
            #[cfg(feature = "redis")]
            Target::Redis { urls, .. } => {
                let store = Arc::new(self.redis().await?);
                Opened {
                    store: store.clone(),
                    inbox: Some(store.clone()),
                    admin: Arc::new(dedupe_redis::RedisAdmin::new(
                        (*store).clone(),
                        urls.clone(),
                    )),
                }
            }
            #[cfg(feature = "dynamodb")]
            Target::Dynamo { .. } => Opened::of(self.dynamo().await?),
            #[allow(unreachable_patterns)]
            _ => {
                return Err(Error::config(format!(
                    "{} stores are not built in",
                    self.url.scheme()
                )))
            }
        })
    }

    /// A new handle onto the store's inbox ([`Inbox`]), when the store offers
    /// one (a Redis Cluster's needs `?namespace_hash_tags=true`):
    /// [`open`](Self::open)'s `inbox`.
    pub async fn inbox_handle(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(self.open().await?.inbox)
    }

    /// A new handle onto the store, with a connection (or pool) of its own:
    /// [`open`](Self::open)'s `store`.
    pub async fn handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(self.open().await?.store)
    }

    /// A SQLite store with `connections` connections (each on a thread of its
    /// own). Fails on any other URL.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite(&self, connections: usize) -> Result<dedupe_sqlite::SqliteStore, Error> {
        let Target::Sqlite { table, .. } = self.url.target() else {
            return Err(Error::config("not a sqlite URL"));
        };
        let builder = match &self.sqlite_temporary {
            Some(temporary) => temporary.clone(),
            None => {
                dedupe_sqlite::SqliteStore::builder(self.sqlite_path.clone().unwrap_or_default())
            }
        };
        let mut builder = builder
            .busy_timeout(self.timeout())
            .connection_threads(connections)
            .create(self.create);
        if let Some(table) = table {
            builder = builder.table(table);
        }
        builder.open().await
    }

    /// A Postgres store on a pool of `connections` that is its own: it holds
    /// every connection between calls (no return check, one round trip a
    /// call; see `PgBuilder::keep_connections`). Do not run queries of your
    /// own on its pool; take [`postgres`](Self::postgres) for that.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres_dedicated(
        &self,
        connections: u32,
    ) -> Result<dedupe_postgres::PgStore, Error> {
        self.postgres_holding(connections, connections as usize)
            .await
    }

    /// A MySQL / MariaDB store with a pool of `connections`, shared with
    /// whatever else uses [`MySqlStore::pool`](dedupe_mysql::MySqlStore::pool)
    /// (it keeps none of them between calls).
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn mysql(&self, connections: u32) -> Result<dedupe_mysql::MySqlStore, Error> {
        self.mysql_keeping(connections, 0).await
    }

    /// A MySQL / MariaDB store with a pool of `connections` of its own,
    /// every one kept between its calls (no return ping per call).
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn mysql_dedicated(
        &self,
        connections: u32,
    ) -> Result<dedupe_mysql::MySqlStore, Error> {
        self.mysql_keeping(connections, connections as usize).await
    }

    #[cfg(feature = "mysql")]
    async fn mysql_keeping(
        &self,
        connections: u32,
        keep: usize,
    ) -> Result<dedupe_mysql::MySqlStore, Error> {
        let Target::Mysql { url, table, .. } = self.url.target() else {
            return Err(Error::config("not a mysql URL"));
        };
        let pool = dedupe_mysql::MySqlStore::connect_pool(url, connections, self.timeout()).await?;
        let mut builder = dedupe_mysql::MySqlStore::builder(pool)
            .timeout(self.timeout())
            .keep_connections(keep);
        if let Some(table) = table {
            builder = builder.table(table);
        }
        builder.build()
    }

    /// A Postgres store with a pool of `connections`.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres(&self, connections: u32) -> Result<dedupe_postgres::PgStore, Error> {
        self.postgres_holding(connections, 0).await
    }

    #[cfg(feature = "postgres")]
    async fn postgres_holding(
        &self,
        connections: u32,
        hold: usize,
    ) -> Result<dedupe_postgres::PgStore, Error> {
        let Target::Postgres {
            url, schema, table, ..
        } = self.url.target()
        else {
            return Err(Error::config("not a postgres URL"));
        };
        let pool = dedupe_postgres::PgStore::connect_pool(url, connections, self.timeout()).await?;
        let mut builder = dedupe_postgres::PgStore::builder(pool)
            .timeout(self.timeout())
            .keep_connections(hold);
        if let Some(schema) = schema {
            builder = builder.schema(schema);
        }
        if let Some(table) = table {
            builder = builder.table(table);
        }
        builder.build()
    }

    /// A Redis store (standalone or Cluster) with a connection of its own.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub async fn redis(&self) -> Result<dedupe_redis::RedisStore, Error> {
        let Target::Redis {
            urls,
            cluster,
            prefix,
            allow_eviction,
            wait_replicas,
            namespace_hash_tags,
        } = self.url.target()
        else {
            return Err(Error::config("not a redis URL"));
        };
        let mut builder = if *cluster {
            dedupe_redis::RedisStore::cluster_builder(urls.clone())
        } else {
            dedupe_redis::RedisStore::builder(urls[0].clone())
        };
        if let Some(prefix) = prefix {
            builder = builder.prefix(prefix);
        }
        if let Some((replicas, wait)) = wait_replicas {
            builder = builder.wait_for_replicas(*replicas, *wait);
        }
        builder
            .allow_eviction(*allow_eviction)
            .namespace_hash_tags(*namespace_hash_tags)
            .timeout(self.timeout())
            .connect()
            .await
    }

    /// A DynamoDB store on an SDK client of its own: static test credentials
    /// for an `endpoint` when the environment has none, else the AWS chain.
    #[cfg(feature = "dynamodb")]
    #[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
    pub async fn dynamo(&self) -> Result<dedupe_dynamo::DynamoStore, Error> {
        let client = self.dynamo_client().await?;
        let Target::Dynamo {
            table,
            max_clock_skew,
            min_lease,
            allow_global_table,
            ..
        } = self.url.target()
        else {
            return Err(Error::config("not a dynamodb URL"));
        };
        let mut builder = dedupe_dynamo::DynamoStore::builder(client)
            .table(table)
            .allow_global_table(*allow_global_table);
        if let Some(skew) = max_clock_skew {
            builder = builder.max_clock_skew(*skew);
        }
        if let Some(min) = min_lease {
            builder = builder.min_lease(*min);
        }
        builder.build()
    }

    /// The SDK client a DynamoDB handle uses.
    #[cfg(feature = "dynamodb")]
    #[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
    pub async fn dynamo_client(&self) -> Result<dedupe_dynamo::aws_sdk_dynamodb::Client, Error> {
        let Target::Dynamo {
            region, endpoint, ..
        } = self.url.target()
        else {
            return Err(Error::config("not a dynamodb URL"));
        };
        Ok(match endpoint {
            Some(endpoint) if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() => {
                let region = region
                    .clone()
                    .or_else(|| std::env::var("AWS_REGION").ok())
                    .unwrap_or_else(|| "us-east-1".into());
                dedupe_dynamo::client_for_endpoint(endpoint, &region, self.timeout())
            }
            endpoint => {
                if let Some(region) = region {
                    // The chain reads the region from the environment first.
                    let client = dedupe_dynamo::client_from_env(endpoint.as_deref()).await;
                    let config = client
                        .config()
                        .to_builder()
                        .region(dedupe_dynamo::aws_sdk_dynamodb::config::Region::new(
                            region.clone(),
                        ))
                        .build();
                    dedupe_dynamo::aws_sdk_dynamodb::Client::from_conf(config)
                } else {
                    dedupe_dynamo::client_from_env(endpoint.as_deref()).await
                }
            }
        })
    }

    /// Removes the namespace this opener's URL names, with every record in
    /// it: [`Admin::remove_namespace`] of a store [`open`](Self::open)ed anew.
    pub async fn remove_namespace(&self) -> Result<(), Error> {
        self.open().await?.admin.remove_namespace().await
    }

    /// [`Admin::durability`] of a store [`open`](Self::open)ed anew.
    pub async fn durability(&self) -> Option<String> {
        self.open().await.ok()?.admin.durability().await
    }
}

/// Opens the store `url` names and returns one handle: the shortest way from
/// a configuration string to a store.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = dedupe_url::open_store("memory:").await?;
/// let key = dedupe_core::Key::new("stripe", "evt_1")?;
/// assert!(store.get(&key).await?.is_none());
/// # Ok::<(), dedupe_url::OpenError>(()) }).unwrap();
/// ```
pub async fn open_store(url: &str) -> Result<Arc<dyn DedupeStore>, crate::OpenError> {
    let opener = Opener::new(url.parse()?).await?;
    // A handle on a temporary SQLite file holds the file's directory itself.
    Ok(opener.handle().await?)
}

/// Opens the store `url` names and returns a [`Deduper`] over it, with the
/// URL's `?lease=` and `?retention=` ([`StoreUrl::deduper`](crate::StoreUrl::deduper)).
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let deduper = dedupe_url::open_deduper("memory:?lease=30s").await?;
/// assert_eq!(deduper.lease_ttl(), std::time::Duration::from_secs(30));
/// # Ok::<(), dedupe_url::OpenError>(()) }).unwrap();
/// ```
pub async fn open_deduper(url: &str) -> Result<Deduper, crate::OpenError> {
    let opener = Opener::new(url.parse()?).await?;
    let store = opener.handle().await?;
    Ok(opener.url().deduper(store)?)
}
