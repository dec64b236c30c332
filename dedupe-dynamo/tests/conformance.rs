//! The DynamoDB store runs the conformance suite on both emulators, one test
//! each, each starting its emulator once and running every check it takes
//! against it, each check on tables of its own and every racing handle on an
//! SDK client of its own:
//! - DynamoDB Local runs the whole suite. It serves requests concurrently, so
//!   its races are real races, and it never returns the old item of a failed
//!   condition, so every losing claim takes the fallback read.
//! - moto runs every check but the races and the big batch. It returns the old
//!   item of a failed condition (as the service does), so every losing claim
//!   answers from it in one round trip, which the other checks cover; it
//!   serves one request at a time, so racing on it would prove less than on
//!   DynamoDB Local, at a minute of the gate's time.
//!
//! Both emulators serve about 200 requests a second here, so the suite runs at
//! [`Scale::Reduced`] (a quarter of the race rounds, a thousand keys instead of
//! ten thousand); every check still runs on DynamoDB Local.

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::{run_selected, FaultyHandle, Fixture, Scale, StoreFactory};
use dedupe_core::{async_trait, DedupeStore, Error, Inbox};
use dedupe_dynamo::{client_for_endpoint, DynamoStore};
use dedupe_testkit::dynamo::{dynamo_server, unique_table, DynamoServer, Emulator};

const REGION: &str = "us-east-1";

struct DynamoFactory {
    endpoint: String,
    _server: Option<DynamoServer>,
}

struct DynamoFixture {
    endpoint: String,
    table: String,
    store: DynamoStore,
}

fn store_on(endpoint: &str, table: &str, timeout: Duration) -> Result<DynamoStore, Error> {
    // The suite's leases are milliseconds long; the clock guard stays on.
    DynamoStore::builder(client_for_endpoint(endpoint, REGION, timeout))
        .table(table)
        .min_lease(dedupe_core::MIN_TTL)
        .build()
}

#[async_trait]
impl StoreFactory for DynamoFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let table = unique_table("conf");
        let store = store_on(&self.endpoint, &table, Duration::from_secs(10))?;
        store.create_table_if_missing().await?;
        Ok(Box::new(DynamoFixture {
            endpoint: self.endpoint.clone(),
            table,
            store,
        }))
    }

    fn scale(&self) -> Scale {
        Scale::Reduced
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

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        Some(Arc::new(self.store.clone()))
    }

    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(Some(Arc::new(store_on(
            &self.endpoint,
            &self.table,
            Duration::from_secs(10),
        )?)))
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

/// The checks moto leaves to DynamoDB Local: the races (moto serves one
/// request at a time) and the thousand-key batch (volume, not behaviour).
const RACES_AND_VOLUME: &[&str] = &[
    "single_winner_race",
    "single_winner_takeover_race",
    "stale_holders_race_takeovers",
    "batches_race_batches",
    "expire_races_takeovers",
    "ten_thousand_distinct_keys",
    "inbox_one_taker_race",
    "inbox_accepts_race_claims",
];

async fn suite_on(emulator: Emulator, select: impl Fn(&str) -> bool) {
    let (server, endpoint) = tokio::task::spawn_blocking(move || dynamo_server(emulator))
        .await
        .expect("emulator");
    let factory = DynamoFactory {
        endpoint,
        _server: server,
    };
    let report = run_selected(&factory, |name| select(name)).await;
    println!("{emulator:?}:\n{report}");
    assert!(report.all_passed(), "{emulator:?}:\n{report}");
    assert_eq!(report.skipped().count(), 0, "{emulator:?}:\n{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moto_passes_the_suite_but_races_and_volume() {
    suite_on(Emulator::Moto, |name| !RACES_AND_VOLUME.contains(&name)).await;
}

/// DynamoDB Local runs the whole suite, in two tests (two processes with an
/// emulator each) so that the gate's longest test is half as long: the races
/// and the volume, then the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_local_passes_the_races_and_volume() {
    suite_on(Emulator::DynamoDbLocal, |name| {
        RACES_AND_VOLUME.contains(&name)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamodb_local_passes_the_rest_of_the_suite() {
    suite_on(Emulator::DynamoDbLocal, |name| {
        !RACES_AND_VOLUME.contains(&name)
    })
    .await;
}

/// Every name moto leaves out is a check of the suite (a renamed check would
/// otherwise run on moto again, or silently nowhere).
#[test]
fn the_checks_moto_leaves_out_exist() {
    let names: Vec<&str> = dedupe_conformance::checks::CHECKS
        .iter()
        .map(|c| c.name)
        .collect();
    for name in RACES_AND_VOLUME {
        assert!(names.contains(name), "no conformance check is named {name}");
    }
}
