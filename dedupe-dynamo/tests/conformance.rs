//! The DynamoDB store runs the whole conformance suite on moto (serving one
//! request at a time), started once per test process; every fixture gets a
//! table of its own, every racing handle an SDK client of its own.

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::{FaultyHandle, Fixture, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error};
use dedupe_dynamo::{client_for_endpoint, DynamoStore};
use dedupe_testkit::dynamo as support;
use tokio::sync::OnceCell;

static MOTO: OnceCell<(Option<support::MotoServer>, String)> = OnceCell::const_new();

const REGION: &str = "us-east-1";

struct MotoFactory;

struct DynamoFixture {
    endpoint: String,
    table: String,
    store: DynamoStore,
}

fn store_on(endpoint: &str, table: &str, timeout: Duration) -> Result<DynamoStore, Error> {
    DynamoStore::builder(client_for_endpoint(endpoint, REGION, timeout))
        .table(table)
        .timeout(timeout)
        .build()
}

#[async_trait]
impl StoreFactory for MotoFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let (_, endpoint) = MOTO
            .get_or_init(|| async {
                tokio::task::spawn_blocking(support::moto_server)
                    .await
                    .expect("moto")
            })
            .await;
        let table = support::unique_table("conf");
        let store = store_on(endpoint, &table, Duration::from_secs(10))?;
        // moto answers its first DynamoDB call slowly: retry until it does.
        let mut tries = 0;
        loop {
            match store.create_table_if_missing().await {
                Ok(()) => break,
                Err(e) if e.is_retryable() && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Box::new(DynamoFixture {
            endpoint: endpoint.clone(),
            table,
            store,
        }))
    }
}

#[async_trait]
impl Fixture for DynamoFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.store.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(store_on(
            &self.endpoint,
            &self.table,
            Duration::from_secs(10),
        )?))
    }

    /// An SDK client through a loopback proxy the fixture owns, bounded by one
    /// second per operation; the fault cuts the proxy.
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        let (proxy, via) = dedupe_testkit::proxied(&self.endpoint)
            .await
            .map_err(|e| Error::unavailable("proxy", Some(Box::new(e))))?;
        let timeout = Duration::from_secs(1);
        Ok(Some(FaultyHandle {
            store: Arc::new(store_on(&via, &self.table, timeout)?),
            switch: Box::new(dedupe_testkit::ProxyFault(proxy)),
            bound: timeout + Duration::from_secs(1),
        }))
    }
}

dedupe_conformance::suite!(MotoFactory);
