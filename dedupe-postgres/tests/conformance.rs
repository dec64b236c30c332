//! The Postgres store runs the whole conformance suite on a real server: each check
//! gets a fresh schema, and each racing handle a pool (connection) of its own.

use dedupe_testkit as support;

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::{FaultyHandle, Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error, Inbox};
use dedupe_postgres::PgStore;
use tokio::sync::OnceCell;

/// Owns the server for the test (a private cluster is stopped when it drops).
struct PgFactory {
    server: OnceCell<(Option<support::PgCluster>, String)>,
}

struct PgFixture {
    url: String,
    schema: String,
    store: PgStore,
}

impl PgFixture {
    async fn handle(url: &str, schema: &str, max_connections: u32) -> Result<PgStore, Error> {
        let pool = PgStore::connect_pool(url, max_connections, Duration::from_secs(20)).await?;
        PgStore::builder(pool)
            .schema(schema)
            .timeout(Duration::from_secs(20))
            .build()
    }
}

#[async_trait]
impl StoreFactory for PgFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let (_, url) = self
            .server
            .get_or_init(|| async {
                tokio::task::spawn_blocking(support::postgres_server)
                    .await
                    .expect("server")
            })
            .await;
        let schema = support::unique_schema("conf");
        let store = PgFixture::handle(url, &schema, 4).await?;
        store.migrate().await?;
        Ok(Box::new(PgFixture {
            url: url.clone(),
            schema,
            store,
        }))
    }
}

#[async_trait]
impl Fixture for PgFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.store.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(
            PgFixture::handle(&self.url, &self.schema, 1).await?,
        ))
    }

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        Some(Arc::new(self.store.clone()))
    }

    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(Some(Arc::new(
            PgFixture::handle(&self.url, &self.schema, 2).await?,
        )))
    }

    /// A handle whose connections go through a loopback proxy the fixture owns,
    /// with a one-second timeout; the fault cuts every connection through it and
    /// refuses new ones, as a server going away would.
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        let (proxy, url) = support::proxied(&self.url)
            .await
            .map_err(|e| Error::unavailable("proxy", Some(Box::new(e))))?;
        let timeout = Duration::from_secs(1);
        let pool = PgStore::connect_pool(&url, 2, timeout).await?;
        let store = PgStore::builder(pool)
            .schema(&self.schema)
            .timeout(timeout)
            .build()?;
        Ok(Some(FaultyHandle {
            store: Arc::new(store),
            switch: Box::new(support::ProxyFault(proxy)),
            // The timeout, then the client's backstop after it.
            bound: timeout + PgStore::BACKSTOP + Duration::from_millis(500),
        }))
    }
}

dedupe_conformance::suite!(PgFactory {
    server: OnceCell::new(),
});
