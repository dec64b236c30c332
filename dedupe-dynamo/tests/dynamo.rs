//! The DynamoDB store on the two emulators each test starts: races across OS
//! processes, clients whose clocks disagree, transactions with the caller's
//! items, the item size limit, attribute names of an existing table, items that
//! are not records, and what each emulator does with a failed condition.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedupe_conformance::processes::{race_across_processes, run_race_child};
use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key};
use dedupe_dynamo::aws_sdk_dynamodb::types::{
    AttributeValue, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
};
use dedupe_dynamo::aws_sdk_dynamodb::Client;
use dedupe_dynamo::{
    client_for_endpoint, AttributeNames, DynamoStore, MAX_ITEM_OUTCOME_BYTES, MAX_TRANSACTION_ITEMS,
};
use dedupe_testkit::dynamo::{dynamo_server, unique_table, DynamoServer, Emulator};

const REGION: &str = "us-east-1";
const TIMEOUT: Duration = Duration::from_secs(10);

fn key(id: &str) -> Key {
    Key::new("dynamo", id).expect("valid key")
}

fn opts(lease: Duration) -> ClaimOptions {
    ClaimOptions::new(lease)
}

/// An emulator and a fresh table on it.
struct Setup {
    endpoint: String,
    table: String,
    store: DynamoStore,
    _server: Option<DynamoServer>,
}

impl Setup {
    async fn start(emulator: Emulator) -> Self {
        let (server, endpoint) = tokio::task::spawn_blocking(move || dynamo_server(emulator))
            .await
            .expect("emulator");
        let table = unique_table("dyn");
        let store = Self::store_on(&endpoint, &table);
        store.create_table_if_missing().await.expect("table");
        Self {
            endpoint,
            table,
            store,
            _server: server,
        }
    }

    fn store_on(endpoint: &str, table: &str) -> DynamoStore {
        DynamoStore::builder(client_for_endpoint(endpoint, REGION, TIMEOUT))
            .table(table)
            .min_lease(dedupe_core::MIN_TTL)
            .build()
            .expect("store")
    }

    fn client(&self) -> Client {
        client_for_endpoint(&self.endpoint, REGION, TIMEOUT)
    }

    /// A second store on the same table whose clock is `ahead` of the system's.
    fn skewed(&self, ahead: Duration) -> DynamoStore {
        DynamoStore::builder(self.client())
            .table(&self.table)
            .clock(move || SystemTime::now() + ahead)
            .min_lease(dedupe_core::MIN_TTL)
            .build()
            .expect("store")
    }
}

fn racing_processes(emulator: Emulator) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let setup = runtime.block_on(Setup::start(emulator));
    race_across_processes(
        "child_racer",
        2,
        8,
        25,
        &[
            ("DEDUPE_CHILD_DYNAMO_ENDPOINT", setup.endpoint.clone()),
            ("DEDUPE_CHILD_DYNAMO_TABLE", setup.table.clone()),
        ],
    )
    .unwrap_or_else(|failure| panic!("{emulator:?}: {failure}"));
}

/// Two OS processes, eight SDK clients each, race on the same 25 keys of
/// DynamoDB Local: each key is Claimed exactly once.
#[test]
fn single_winner_across_processes_on_dynamodb_local() {
    racing_processes(Emulator::DynamoDbLocal);
}

/// The same on moto.
#[test]
fn single_winner_across_processes_on_moto() {
    racing_processes(Emulator::Moto);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by the single_winner_across_processes tests in a child process"]
async fn child_racer() {
    let endpoint = std::env::var("DEDUPE_CHILD_DYNAMO_ENDPOINT").expect("child job");
    let table = std::env::var("DEDUPE_CHILD_DYNAMO_TABLE").expect("child job");
    let handles: Vec<Arc<dyn DedupeStore>> = (0..8)
        .map(|_| Arc::new(Setup::store_on(&endpoint, &table)) as Arc<dyn DedupeStore>)
        .collect();
    run_race_child(handles).await;
}

/// DynamoDB has no server clock in expressions. Where the service sends no
/// `Date` header (DynamoDB Local), the store cannot measure its clock against
/// the service's, and the guard lets every claim through: a client whose clock runs
/// ahead of the holder's by more than the lease sees the lease passed and
/// takes it over. The conditional write still lets exactly one of them store
/// an outcome: the holder's complete fails with LeaseLost. A skew below the
/// lease changes nothing; a client ahead makes its own leases last longer for
/// the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_moves_deadlines_never_the_single_winner() {
    let setup = Setup::start(Emulator::DynamoDbLocal).await;
    let on_time = &setup.store;
    let ahead_5s = setup.skewed(Duration::from_secs(5));
    let ahead_500ms = setup.skewed(Duration::from_millis(500));

    // Skew (5 s) beyond the lease (2 s): a takeover, then one outcome.
    let k = key("skew-beyond-lease");
    let holder = on_time
        .claim(&k, &opts(Duration::from_secs(2)))
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    let taker = match ahead_5s
        .claim(&k, &opts(Duration::from_secs(60)))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("a client 5 s ahead sees a 2 s lease passed, got {other:?}"),
    };
    assert_eq!(taker.attempt, 2, "a takeover counts the attempt");
    assert!(matches!(
        on_time
            .complete(&holder, b"holder", Duration::from_secs(600))
            .await,
        Err(Error::LeaseLost { .. })
    ));
    ahead_5s
        .complete(&taker, b"taker", Duration::from_secs(600))
        .await
        .expect("the taker completes");
    match on_time
        .claim(&k, &opts(Duration::from_secs(2)))
        .await
        .expect("claim")
    {
        ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"taker"),
        other => panic!("expected the taker's outcome, got {other:?}"),
    }

    // Skew (500 ms) well below the lease (10 s): nothing changes.
    let k = key("skew-below-lease");
    on_time
        .claim(&k, &opts(Duration::from_secs(10)))
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    assert!(matches!(
        ahead_500ms
            .claim(&k, &opts(Duration::from_secs(10)))
            .await
            .expect("claim"),
        ClaimOutcome::InFlight { attempt: 1, .. }
    ));

    // A lease taken by the client ahead ends 5 s later on the true clock.
    let k = key("skew-ahead-holds");
    let long = ahead_5s
        .claim(&k, &opts(Duration::from_secs(2)))
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    let lasts = long
        .deadline
        .duration_since(SystemTime::now())
        .expect("deadline ahead");
    assert!(
        lasts > Duration::from_secs(6),
        "a 2 s lease of a clock 5 s ahead lasts {lasts:?} on the true clock"
    );
    assert!(matches!(
        on_time
            .claim(&k, &opts(Duration::from_secs(2)))
            .await
            .expect("claim"),
        ClaimOutcome::InFlight { .. }
    ));
}

/// Two stores on moto (which sends a `Date` with every response), one with a
/// clock 90 s behind, a 60 s lease: without the guard both would be Claimed
/// (the slow one's lease has passed on the true clock the moment it is
/// written, so the on-time store takes it over at once). The slow store is
/// refused with a retryable `ClockSkew` that names how far off it is, and
/// writes nothing; so is a store 90 s ahead, which would take a live lease
/// over; its extensions and `expire()` too. A store 500 ms ahead is within
/// the tolerance and sees the live claim. The default minimum lease refuses a
/// lease too short for the tolerance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_far_from_the_services_is_refused() {
    let setup = Setup::start(Emulator::Moto).await;
    let on_time = &setup.store;
    let behind = |by: Duration| {
        DynamoStore::builder(setup.client())
            .table(&setup.table)
            .clock(move || SystemTime::now() - by)
            .build()
            .expect("store")
    };
    let slow = behind(Duration::from_secs(90));
    let fast = setup.skewed(Duration::from_secs(90));
    let lease = opts(Duration::from_secs(60));
    let skew_of = |result: Result<ClaimOutcome, Error>, ahead: bool| match result {
        Err(e @ Error::ClockSkew { .. }) => {
            assert!(e.is_retryable(), "{e}");
            let Error::ClockSkew {
                at_least,
                ahead: seen_ahead,
                tolerated,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(seen_ahead, ahead);
            assert_eq!(tolerated, DynamoStore::DEFAULT_MAX_CLOCK_SKEW);
            assert!(at_least >= Duration::from_secs(88), "{at_least:?}");
        }
        other => panic!("a clock 90 s off answered {other:?}"),
    };

    let k = key("slow-clock");
    skew_of(slow.claim(&k, &lease).await, false);
    assert!(on_time.get(&k).await.expect("get").is_none(), "written");
    let won = on_time.claim(&k, &lease).await.expect("claim");
    assert!(
        matches!(won, ClaimOutcome::Claimed(ref l) if l.attempt == 1),
        "{won:?}"
    );
    let held = won.lease().cloned().expect("claimed");

    skew_of(fast.claim(&k, &lease).await, true);
    skew_of(
        fast.claim_many(&[key("fast-batch")], &lease)
            .await
            .map(|mut a| a.remove(0)),
        true,
    );
    match fast.extend(&held, Duration::from_secs(60)).await {
        Err(Error::ClockSkew { ahead: true, .. }) => {}
        other => panic!("an extension with a clock 90 s ahead answered {other:?}"),
    }
    match fast.expire().await {
        Err(Error::ClockSkew { ahead: true, .. }) => {}
        other => panic!("expire() with a clock 90 s ahead answered {other:?}"),
    }
    let still = on_time.get(&k).await.expect("get").expect("record");
    assert_eq!(still.token, held.token, "the live lease was touched");
    assert!(
        slow.clock_offset_ms().is_some_and(|r| r.start >= 88_000),
        "{:?}",
        slow.clock_offset_ms()
    );

    let near = setup.skewed(Duration::from_millis(500));
    assert!(matches!(
        near.claim(&k, &lease).await.expect("claim"),
        ClaimOutcome::InFlight { attempt: 1, .. }
    ));

    let defaults = DynamoStore::builder(setup.client())
        .table(&setup.table)
        .build()
        .expect("store");
    assert_eq!(defaults.min_lease(), Duration::from_secs(8));
    match defaults
        .claim(&key("short"), &opts(Duration::from_secs(2)))
        .await
    {
        Err(Error::InvalidConfig { reason }) => assert!(reason.contains("minimum"), "{reason}"),
        other => panic!("a 2 s lease answered {other:?}"),
    }
    assert!(defaults
        .claim(&key("long enough"), &opts(Duration::from_secs(8)))
        .await
        .expect("claim")
        .lease()
        .is_some());
}

fn order(table: &str, id: &str) -> TransactWriteItem {
    let put = Put::builder()
        .table_name(table)
        .item("pk", AttributeValue::S(format!("order:{id}")))
        .item("status", AttributeValue::S("paid".into()))
        .condition_expression("attribute_not_exists(pk)")
        .build()
        .expect("put");
    TransactWriteItem::builder().put(put).build()
}

async fn exists(client: &Client, table: &str, pk: &str) -> bool {
    client
        .get_item()
        .table_name(table)
        .key("pk", AttributeValue::S(pk.to_string()))
        .consistent_read(true)
        .send()
        .await
        .expect("get")
        .item()
        .is_some()
}

async fn transactions_commit_with_the_callers_items(emulator: Emulator) {
    let setup = Setup::start(emulator).await;
    let (store, client) = (&setup.store, setup.client());
    // The business table: a second table of the caller's.
    let orders_table = unique_table("orders");
    Setup::store_on(&setup.endpoint, &orders_table)
        .create_table_if_missing()
        .await
        .expect("orders table");
    let k = key("txn");
    let lease = match store
        .claim_with(
            &k,
            &opts(Duration::from_secs(60)),
            &[order(&orders_table, "1")],
        )
        .await
        .expect("claim_with")
    {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("{emulator:?}: expected Claimed, got {other:?}"),
    };
    assert!(exists(&client, &orders_table, "order:1").await);

    // A second delivery while the first works: InFlight, and its order is not
    // written.
    let again = store
        .claim_with(
            &k,
            &opts(Duration::from_secs(60)),
            &[order(&orders_table, "2")],
        )
        .await
        .expect("claim_with");
    assert!(matches!(again, ClaimOutcome::InFlight { .. }), "{again:?}");
    assert!(!exists(&client, &orders_table, "order:2").await);

    // Completing with a ledger row: both land.
    store
        .complete_with(
            &lease,
            b"order 1",
            Duration::from_secs(600),
            &[order(&orders_table, "ledger-1")],
        )
        .await
        .expect("complete_with");
    assert!(exists(&client, &orders_table, "order:ledger-1").await);
    let dup = store
        .claim_with(
            &k,
            &opts(Duration::from_secs(60)),
            &[order(&orders_table, "3")],
        )
        .await
        .expect("claim_with");
    match dup {
        ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"order 1"),
        other => panic!("{emulator:?}: expected Duplicate, got {other:?}"),
    }
    assert!(!exists(&client, &orders_table, "order:3").await);

    // The completed lease cannot complete again, nor write its items.
    assert!(matches!(
        store
            .complete_with(
                &lease,
                b"again",
                Duration::from_secs(600),
                &[order(&orders_table, "4")]
            )
            .await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(!exists(&client, &orders_table, "order:4").await);

    // The caller's own condition fails (order 1 exists): a clear error naming
    // the item, and no claim record either.
    let fresh = key("txn-refused");
    let refused = store
        .claim_with(
            &fresh,
            &opts(Duration::from_secs(60)),
            &[order(&orders_table, "1")],
        )
        .await
        .expect_err("the order exists");
    assert!(!refused.is_retryable(), "{refused}");
    assert!(refused.to_string().contains("your item 0"), "{refused}");
    assert!(store.get(&fresh).await.expect("get").is_none());

    // A retry with the claim id of a claim that committed (its answer lost
    // or timed out): handed the same lease, and its own items are written
    // then, under a check that the record still holds that lease.
    let retried = key("txn-retried");
    let with_id =
        opts(Duration::from_secs(60)).with_claim_id(ClaimId::new("delivery-7").expect("id"));
    let first = store
        .claim_with(&retried, &with_id, &[order(&orders_table, "r1")])
        .await
        .expect("claim_with")
        .lease()
        .cloned()
        .expect("claimed");
    let again = store
        .claim_with(&retried, &with_id, &[order(&orders_table, "r2")])
        .await
        .expect("claim_with again");
    assert_eq!(again.lease(), Some(&first), "{again:?}");
    assert!(
        exists(&client, &orders_table, "order:r2").await,
        "{emulator:?}: Claimed, but the retry's items were not written"
    );
    // Completed with a ledger row; asked again (the first answer lost) with
    // another row: Ok once that row is written too.
    store
        .complete_with(
            &first,
            b"r",
            Duration::from_secs(600),
            &[order(&orders_table, "c1")],
        )
        .await
        .expect("complete_with");
    store
        .complete_with(
            &first,
            b"r",
            Duration::from_secs(600),
            &[order(&orders_table, "c2")],
        )
        .await
        .expect("complete_with again");
    assert!(
        exists(&client, &orders_table, "order:c2").await,
        "{emulator:?}: Ok, but the second completion's items were not written"
    );
    // Once the lease is completed, a retry is a Duplicate and writes nothing.
    let late = store
        .claim_with(&retried, &with_id, &[order(&orders_table, "r3")])
        .await
        .expect("claim_with late");
    assert!(matches!(late, ClaimOutcome::Duplicate { .. }), "{late:?}");
    assert!(!exists(&client, &orders_table, "order:r3").await);

    // Too many items: refused before any request.
    let many: Vec<TransactWriteItem> = (0..MAX_TRANSACTION_ITEMS)
        .map(|i| order(&orders_table, &format!("many-{i}")))
        .collect();
    assert!(matches!(
        store
            .claim_with(&key("txn-many"), &opts(Duration::from_secs(60)), &many)
            .await,
        Err(Error::InvalidConfig { .. })
    ));
    assert!(!exists(&client, &orders_table, "order:many-0").await);
    assert!(store.get(&key("txn-many")).await.expect("get").is_none());
}

/// The outbox half on DynamoDB: an accept with the caller's items commits
/// both (`New`), or neither: a second accept of the key answers the item and
/// writes none of its items; a caller's item whose condition fails cancels
/// the accept too (no item, the key new). A transaction whose answer is lost
/// after it committed (the SDK sends it again) answers `New` once, with one
/// item and the caller's write.
async fn accepts_commit_with_the_callers_items(emulator: Emulator) {
    use dedupe_core::{AcceptOptions, Accepted, Inbox};
    let setup = Setup::start(emulator).await;
    let (store, client) = (&setup.store, setup.client());
    let orders_table = unique_table("orders");
    Setup::store_on(&setup.endpoint, &orders_table)
        .create_table_if_missing()
        .await
        .expect("orders table");
    let k = key("outbox");
    let accepted = store
        .accept_with_writes(
            &k,
            b"receipt",
            &AcceptOptions::new(),
            &[order(&orders_table, "o1")],
        )
        .await
        .expect("accept_with_writes");
    assert_eq!(accepted, Accepted::New, "{emulator:?}");
    assert!(exists(&client, &orders_table, "order:o1").await);
    assert!(store.item(&k).await.expect("item").is_some());
    let again = store
        .accept_with_writes(
            &k,
            b"twice",
            &AcceptOptions::new(),
            &[order(&orders_table, "o2")],
        )
        .await
        .expect("accept_with_writes again");
    assert!(
        matches!(again, Accepted::Item(_)),
        "{emulator:?}: {again:?}"
    );
    assert!(!exists(&client, &orders_table, "order:o2").await);

    // The caller's own condition fails (order o1 exists): the whole
    // transaction is cancelled, the item with it.
    let refused_key = key("outbox-refused");
    let refused = store
        .accept_with_writes(
            &refused_key,
            b"never",
            &AcceptOptions::new(),
            &[order(&orders_table, "o1")],
        )
        .await
        .expect_err("the order exists");
    assert!(refused.to_string().contains("your item 0"), "{refused}");
    assert!(store.item(&refused_key).await.expect("item").is_none());
    assert_eq!(
        store.accept(&refused_key, b"later").await.expect("accept"),
        Accepted::New
    );

    // The answer of a committed transaction lost: the SDK sends it again.
    let (proxy, via) = dedupe_testkit::proxied(&setup.endpoint)
        .await
        .expect("proxy");
    let through = DynamoStore::builder(client_for_endpoint(&via, REGION, TIMEOUT))
        .table(&setup.table)
        .min_lease(dedupe_core::MIN_TTL)
        .build()
        .expect("store");
    let lost = key("outbox-lost");
    proxy.lose_next_answer();
    let answer = through
        .accept_with_writes(
            &lost,
            b"once",
            &AcceptOptions::new(),
            &[order(&orders_table, "lost")],
        )
        .await;
    assert!(!proxy.answer_pending_loss(), "no answer was lost");
    assert_eq!(
        answer.expect("the resent transaction"),
        Accepted::New,
        "{emulator:?}"
    );
    assert!(exists(&client, &orders_table, "order:lost").await);
    let taken = store
        .take("dynamo", 10, Duration::from_secs(30))
        .await
        .expect("take");
    let ids: Vec<&str> = taken.iter().map(|t| t.lease.key.id()).collect();
    assert_eq!(
        ids.iter().filter(|id| **id == "outbox-lost").count(),
        1,
        "{ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_with_writes_on_dynamodb_local() {
    accepts_commit_with_the_callers_items(Emulator::DynamoDbLocal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_with_writes_on_moto() {
    accepts_commit_with_the_callers_items(Emulator::Moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_on_dynamodb_local() {
    transactions_commit_with_the_callers_items(Emulator::DynamoDbLocal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_on_moto() {
    transactions_commit_with_the_callers_items(Emulator::Moto).await;
}

/// The largest outcome the store accepts fits in one item next to the longest
/// key, claim id and fingerprint; one byte more is refused before any request,
/// and the record stays as it was. A limit above what an item holds is refused
/// when the store is built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_item_limit_is_checked_before_the_request() {
    let setup = Setup::start(Emulator::DynamoDbLocal).await;
    assert!(matches!(
        DynamoStore::builder(setup.client())
            .max_outcome_bytes(MAX_ITEM_OUTCOME_BYTES + 1)
            .build(),
        Err(Error::InvalidConfig { .. })
    ));
    let store = DynamoStore::builder(setup.client())
        .table(&setup.table)
        .max_outcome_bytes(MAX_ITEM_OUTCOME_BYTES)
        .build()
        .expect("store");
    let long = Key::new("n".repeat(64), "i".repeat(512)).expect("longest key");
    let claim = ClaimOptions::new(Duration::from_secs(60))
        .with_claim_id(ClaimId::new("c".repeat(128)).expect("claim id"))
        .with_fingerprint(Fingerprint::from_bytes(vec![7u8; 64]).expect("fingerprint"));
    let lease = store
        .claim(&long, &claim)
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    let too_big = vec![1u8; MAX_ITEM_OUTCOME_BYTES + 1];
    assert!(matches!(
        store
            .complete(&lease, &too_big, Duration::from_secs(600))
            .await,
        Err(Error::OutcomeTooLarge { .. })
    ));
    assert!(matches!(
        store.get(&long).await.expect("get").map(|r| r.state),
        Some(dedupe_core::RecordState::InFlight { .. })
    ));
    let biggest = vec![2u8; MAX_ITEM_OUTCOME_BYTES];
    store
        .complete(&lease, &biggest, Duration::from_secs(600))
        .await
        .expect("the largest outcome fits in an item");
    match store.claim(&long, &claim).await.expect("claim") {
        ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, biggest),
        other => panic!("expected Duplicate, got {other:?}"),
    }
}

/// A table with its own names (partition key `id`, TTL attribute `ttl`): the
/// store writes and reads exactly those attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_names_fit_an_existing_table() {
    let setup = Setup::start(Emulator::Moto).await;
    let table = unique_table("named");
    let names = AttributeNames {
        partition_key: "id".into(),
        expires_at: "ttl".into(),
        outcome: "result".into(),
        ..AttributeNames::default()
    };
    let store = DynamoStore::builder(setup.client())
        .table(&table)
        .attribute_names(names)
        .build()
        .expect("store");
    store.create_table_if_missing().await.expect("table");
    let k = key("named");
    let lease = store
        .claim(&k, &opts(Duration::from_secs(60)))
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    store
        .complete(&lease, b"done", Duration::from_secs(600))
        .await
        .expect("complete");
    let item = setup
        .client()
        .get_item()
        .table_name(&table)
        .key("id", AttributeValue::S("dynamo:named".into()))
        .send()
        .await
        .expect("get")
        .item()
        .cloned()
        .expect("the record is under id");
    let mut attributes: Vec<&str> = item.keys().map(String::as_str).collect();
    attributes.sort_unstable();
    assert_eq!(
        attributes,
        ["at", "cm", "dl", "fs", "id", "result", "st", "tk", "ttl"]
    );
    assert!(matches!(
        store
            .claim(&k, &opts(Duration::from_secs(60)))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate { .. }
    ));
}

/// An item at a record's key that the store did not write answers
/// CorruptRecord on claim and get, never a guess, and is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_that_are_not_records_are_corrupt() {
    let setup = Setup::start(Emulator::Moto).await;
    let client = setup.client();
    let broken: [(&str, HashMap<String, AttributeValue>); 3] = [
        (
            "no-state",
            HashMap::from([("tk".into(), AttributeValue::S("t".into()))]),
        ),
        (
            "text-deadline",
            HashMap::from([
                ("st".into(), AttributeValue::N("0".into())),
                ("tk".into(), AttributeValue::S("t".into())),
                ("dl".into(), AttributeValue::S("tomorrow".into())),
                ("at".into(), AttributeValue::N("1".into())),
                ("fs".into(), AttributeValue::N("1".into())),
            ]),
        ),
        (
            "unknown-state",
            HashMap::from([
                ("st".into(), AttributeValue::N("7".into())),
                ("tk".into(), AttributeValue::S("t".into())),
                ("dl".into(), AttributeValue::N(i64::MAX.to_string())),
                ("at".into(), AttributeValue::N("1".into())),
                ("fs".into(), AttributeValue::N("1".into())),
            ]),
        ),
    ];
    for (id, mut item) in broken {
        item.insert("pk".into(), AttributeValue::S(format!("dynamo:{id}")));
        client
            .put_item()
            .table_name(&setup.table)
            .set_item(Some(item.clone()))
            .send()
            .await
            .expect("raw put");
        let k = key(id);
        let claimed = setup.store.claim(&k, &opts(Duration::from_secs(60))).await;
        assert!(
            matches!(claimed, Err(Error::CorruptRecord { .. })),
            "{id}: claim answered {claimed:?}"
        );
        let got = setup.store.get(&k).await;
        assert!(
            matches!(got, Err(Error::CorruptRecord { .. })),
            "{id}: get answered {got:?}"
        );
        let after = client
            .get_item()
            .table_name(&setup.table)
            .key("pk", AttributeValue::S(format!("dynamo:{id}")))
            .send()
            .await
            .expect("get")
            .item()
            .cloned();
        assert_eq!(after.as_ref(), Some(&item), "{id}: the item was changed");
    }

    // A batch with one of them among fresh keys: the batch fails with the
    // corrupt record's error, and the claims it won are given back (no
    // record is left in flight with no holder).
    let fresh: Vec<Key> = (0..6).map(|i| key(&format!("batch-fresh-{i}"))).collect();
    let mut batch = fresh.clone();
    batch.insert(3, key("unknown-state"));
    let answered = setup
        .store
        .claim_many(&batch, &opts(Duration::from_secs(60)))
        .await;
    assert!(
        matches!(answered, Err(Error::CorruptRecord { .. })),
        "the batch answered {answered:?}"
    );
    for k in &fresh {
        assert!(
            setup.store.get(k).await.expect("get").is_none(),
            "{k}: a claim of the failed batch was left in flight"
        );
    }
}

/// What each emulator does with a failed condition and `ALL_OLD`: moto
/// returns the old item (the store answers in one round trip); DynamoDB Local
/// does not (the store reads it). The suite passes on both; this pins down
/// that both paths are really exercised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_moto_returns_the_old_item_of_a_failed_condition() {
    for (emulator, returns_old) in [(Emulator::Moto, true), (Emulator::DynamoDbLocal, false)] {
        let setup = Setup::start(emulator).await;
        let client = setup.client();
        let put = || {
            client
                .put_item()
                .table_name(&setup.table)
                .item("pk", AttributeValue::S("probe".into()))
                .condition_expression("attribute_not_exists(pk)")
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                )
                .send()
        };
        put().await.expect("first put");
        let failed = put().await.expect_err("the condition fails");
        let old = failed
            .as_service_error()
            .and_then(|e| match e {
                dedupe_dynamo::aws_sdk_dynamodb::operation::put_item::PutItemError::ConditionalCheckFailedException(c) => c.item().cloned(),
                _ => None,
            })
            .filter(|item| !item.is_empty());
        assert_eq!(old.is_some(), returns_old, "{emulator:?}: {old:?}");
    }
}

/// A client from the standard AWS chain (here: credentials and region from
/// the environment) with the endpoint overridden works like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_from_the_aws_chain_works() {
    let setup = Setup::start(Emulator::Moto).await;
    // nextest runs each test in a process of its own: these variables are
    // this test's alone.
    std::env::set_var("AWS_ACCESS_KEY_ID", "dedupe");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "dedupe");
    std::env::set_var("AWS_REGION", REGION);
    let client = dedupe_dynamo::client_from_env(Some(&setup.endpoint)).await;
    let store = DynamoStore::builder(client)
        .table(&setup.table)
        .build()
        .expect("store");
    let k = key("from-env");
    assert!(matches!(
        store
            .claim(&k, &opts(Duration::from_secs(60)))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed(_)
    ));
    assert!(matches!(
        setup
            .store
            .claim(&k, &opts(Duration::from_secs(60)))
            .await
            .expect("claim"),
        ClaimOutcome::InFlight { .. }
    ));
}

/// The bound on any one call in the fault runs below: the client's operation
/// timeout (retries included) and room for a loaded two-core machine.
fn fault_bound(timeout: Duration) -> Duration {
    timeout + Duration::from_millis(1500)
}

/// A store on `endpoint` whose client gives up after `timeout`, its table made.
async fn fault_store(endpoint: &str, timeout: Duration) -> Arc<dyn DedupeStore> {
    let store = DynamoStore::builder(client_for_endpoint(endpoint, REGION, timeout))
        .table(unique_table("faults"))
        .min_lease(dedupe_core::MIN_TTL)
        .build()
        .expect("store");
    store.create_table_if_missing().await.expect("table");
    Arc::new(store)
}

/// DynamoDB Local keeping its tables on disk is killed with SIGKILL under
/// eight recorded workers and started again on the same files: every error
/// typed and retryable within the bound, the same store object works again,
/// the history valid, and every completion acknowledged is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_emulator_under_load_loses_nothing() {
    use dedupe_testkit::faults::FaultRun;
    let mut server =
        tokio::task::spawn_blocking(|| DynamoServer::start(Emulator::DynamoDbLocalOnDisk))
            .await
            .expect("emulator");
    let timeout = Duration::from_secs(2);
    let store = fault_store(&server.endpoint(), timeout).await;
    let run = FaultRun::start(Arc::clone(&store)).await;
    let server = tokio::task::spawn_blocking(move || {
        server.kill();
        // Down for longer than the client's operation timeout, so its retries
        // cannot bridge the outage and the fault is felt.
        std::thread::sleep(timeout + Duration::from_millis(500));
        server.start_again();
        server
    })
    .await
    .expect("restart");
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
    drop(server);
}

/// Through a proxy, the network swallows every byte (blackhole), then holds
/// every byte and delivers it late (stall), each for longer than the client's
/// timeout, under eight recorded workers: calls end in retryable errors within
/// the bound, and the history is valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackholed_and_stalled_connections_time_out_and_recover() {
    use dedupe_testkit::faults::FaultRun;
    let (_server, endpoint) =
        tokio::task::spawn_blocking(|| dynamo_server(Emulator::DynamoDbLocal))
            .await
            .expect("emulator");
    let (proxy, via) = dedupe_testkit::proxied(&endpoint).await.expect("proxy");
    let timeout = Duration::from_millis(800);
    let store = fault_store(&via, timeout).await;
    let run = FaultRun::start(Arc::clone(&store)).await;
    dedupe_testkit::faults::blackhole_then_stall(&proxy, Duration::from_millis(2500)).await;
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// DynamoDB Local runs a claim and the connection dies before the client reads
/// the answer (every retry the same): a retryable error, and the retry with
/// the same claim id is Claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_answer_is_reclaimed_by_its_claim_id() {
    let (_server, endpoint) =
        tokio::task::spawn_blocking(|| dynamo_server(Emulator::DynamoDbLocal))
            .await
            .expect("emulator");
    let (proxy, via) = dedupe_testkit::proxied(&endpoint).await.expect("proxy");
    let timeout = Duration::from_secs(2);
    let store = fault_store(&via, timeout).await;
    dedupe_testkit::faults::lost_answer_is_reclaimed_by_its_claim_id(
        store.as_ref(),
        &proxy,
        &key("lost-answer"),
        fault_bound(timeout),
    )
    .await;
}

dedupe_testkit::crash_tests! {
    setup: || {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let setup = runtime.block_on(Setup::start(Emulator::DynamoDbLocal));
        let env = vec![
            ("DEDUPE_CHILD_DYNAMO_ENDPOINT", setup.endpoint.clone()),
            ("DEDUPE_CHILD_DYNAMO_TABLE", setup.table.clone()),
        ];
        ((runtime, setup), env)
    },
    worker: || async {
        let endpoint = std::env::var("DEDUPE_CHILD_DYNAMO_ENDPOINT").expect("child job");
        let table = std::env::var("DEDUPE_CHILD_DYNAMO_TABLE").expect("child job");
        Arc::new(Setup::store_on(&endpoint, &table)) as Arc<dyn DedupeStore>
    },
    inbox_worker: || async {
        let endpoint = std::env::var("DEDUPE_CHILD_DYNAMO_ENDPOINT").expect("child job");
        let table = std::env::var("DEDUPE_CHILD_DYNAMO_TABLE").expect("child job");
        Arc::new(Setup::store_on(&endpoint, &table)) as Arc<dyn dedupe_core::Inbox>
    },
    ordering_keys: true,
}

/// A client with no timeouts at all (the SDK sets none by default) through a
/// black-holed connection: every call is still bounded by the store's own
/// timeout, as a whole, and fails with a retryable `Timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_bounds_calls_whatever_the_client() {
    use dedupe_dynamo::aws_sdk_dynamodb::config::timeout::TimeoutConfig;
    let setup = Setup::start(Emulator::DynamoDbLocal).await;
    let (proxy, via) = dedupe_testkit::proxied(&setup.endpoint)
        .await
        .expect("proxy");
    let unbounded = client_for_endpoint(&via, REGION, TIMEOUT)
        .config()
        .to_builder()
        .timeout_config(TimeoutConfig::disabled())
        .build();
    let bound = Duration::from_millis(600);
    let store = DynamoStore::builder(Client::from_conf(unbounded))
        .table(&setup.table)
        .timeout(bound)
        .min_lease(dedupe_core::MIN_TTL)
        .build()
        .expect("store");
    let k = key("bounded");
    assert!(store.get(&k).await.expect("get").is_none());
    proxy.blackhole();
    let started = std::time::Instant::now();
    let claimed = store.claim(&k, &opts(Duration::from_secs(60))).await;
    let took = started.elapsed();
    assert!(
        matches!(claimed, Err(Error::Timeout { after, .. }) if after == bound),
        "{claimed:?}"
    );
    assert!(took < bound + Duration::from_millis(400), "took {took:?}");
    let started = std::time::Instant::now();
    let batch = store
        .claim_many(&[key("b1"), key("b2")], &opts(Duration::from_secs(60)))
        .await;
    assert!(matches!(batch, Err(Error::Timeout { .. })), "{batch:?}");
    assert!(
        started.elapsed() < bound * 3,
        "took {:?}",
        started.elapsed()
    );
    proxy.heal();
}

/// A table made before the inbox (partition key only): claims work, the
/// inbox's take answers a configuration error that says how to add its
/// indexes, and `create_table_if_missing` adds them; then an accepted item is
/// taken. An item carries no TTL attribute (items never expire); the done
/// record it becomes carries no item attribute, and has its TTL.
async fn a_table_from_before_the_inbox_gets_its_indexes(emulator: Emulator) {
    use dedupe_core::Inbox;
    use dedupe_dynamo::aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    let setup = Setup::start(emulator).await;
    let client = setup.client();
    let table = unique_table("old");
    client
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("definition"),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .expect("key"),
        )
        .send()
        .await
        .expect("old table");
    let store = Setup::store_on(&setup.endpoint, &table);
    let claimed = store
        .claim(&key("old-claim"), &opts(Duration::from_secs(60)))
        .await
        .expect("claim");
    assert!(claimed.lease().is_some(), "{claimed:?}");
    let item_key = key("old-item");
    assert!(store
        .accept(&item_key, b"body")
        .await
        .expect("accept")
        .is_new());
    let refused = store.take("dynamo", 10, Duration::from_secs(60)).await;
    match refused {
        Err(Error::InvalidConfig { reason }) => {
            assert!(reason.contains("create_table_if_missing"), "{reason}")
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    store
        .create_table_if_missing()
        .await
        .expect("indexes added");
    let raw = |pk: &'static str| {
        let client = setup.client();
        let table = table.clone();
        async move {
            let item = client
                .get_item()
                .table_name(&table)
                .key("pk", AttributeValue::S(pk.into()))
                .consistent_read(true)
                .send()
                .await
                .expect("get")
                .item()
                .cloned()
                .expect("present");
            let mut names: Vec<String> = item.keys().cloned().collect();
            names.sort_unstable();
            names
        }
    };
    let attributes = raw("dynamo:old-item").await;
    assert!(
        !attributes.contains(&"expires_at".to_string()),
        "{attributes:?}"
    );
    // The index is eventually consistent: the item shows up in a take soon.
    let mut taken = Vec::new();
    for _ in 0..100 {
        taken = store
            .take("dynamo", 10, Duration::from_secs(60))
            .await
            .expect("take");
        if !taken.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(
        (taken[0].lease.key.id(), taken[0].payload.as_slice()),
        ("old-item", &b"body"[..])
    );
    store
        .complete(&taken[0].lease, b"done", Duration::from_secs(600))
        .await
        .expect("complete");
    assert_eq!(
        raw("dynamo:old-item").await,
        ["at", "cm", "dl", "expires_at", "fs", "oc", "pk", "st", "tk"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_from_before_the_inbox_gets_its_indexes_on_moto() {
    a_table_from_before_the_inbox_gets_its_indexes(Emulator::Moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_from_before_the_inbox_gets_its_indexes_on_dynamodb_local() {
    a_table_from_before_the_inbox_gets_its_indexes(Emulator::DynamoDbLocal).await;
}

/// The queue item of `ordering_key` in namespace `ordq`, read raw.
async fn queue_item(setup: &Setup, ordering_key: &str) -> Option<HashMap<String, AttributeValue>> {
    setup
        .client()
        .get_item()
        .table_name(&setup.table)
        .key("pk", AttributeValue::S(format!("ordq|o|{ordering_key}")))
        .consistent_read(true)
        .send()
        .await
        .expect("get")
        .item()
        .cloned()
}

/// An ordering key's queue item goes once every item it named is finished
/// (`expire()` deletes it); one with a dead item that blocks stays, and goes
/// once that item is forgotten. An accept after that starts a new queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expire_collects_the_queues_of_finished_ordering_keys() {
    use dedupe_core::{AcceptOptions, Inbox, Retry};
    let setup = Setup::start(Emulator::DynamoDbLocal).await;
    let store = &setup.store;
    let ordered = |k: &str| AcceptOptions::new().ordering_key(k);
    for id in ["a1", "a2"] {
        let key = Key::new("ordq", id).expect("key");
        store
            .accept_with(&key, b"x", &ordered("a"))
            .await
            .expect("accept");
    }
    let key = Key::new("ordq", "b1").expect("key");
    store
        .accept_with(&key, b"x", &ordered("b"))
        .await
        .expect("accept");
    let lease = Duration::from_secs(30);
    // a1 and b1 come first; b1 dies and blocks its key.
    for taken in store.take("ordq", 10, lease).await.expect("take") {
        match taken.lease.key.id() {
            "b1" => store
                .fail(&taken.lease, "poison", Retry::Dead { keep: None })
                .await
                .expect("fail"),
            _ => store
                .complete(&taken.lease, b"", lease)
                .await
                .expect("complete"),
        }
    }
    let a2 = store.take("ordq", 10, lease).await.expect("take");
    assert_eq!(a2.len(), 1, "a2 is next");
    store
        .complete(&a2[0].lease, b"", lease)
        .await
        .expect("complete");
    assert!(
        queue_item(&setup, "a").await.is_some(),
        "the queue is kept until expire()"
    );
    store.expire().await.expect("expire");
    assert!(
        queue_item(&setup, "a").await.is_none(),
        "a finished key's queue is collected"
    );
    assert!(
        queue_item(&setup, "b").await.is_some(),
        "a queue with a dead item that blocks is kept"
    );
    assert!(store
        .forget(&Key::new("ordq", "b1").expect("key"))
        .await
        .expect("forget"));
    store.expire().await.expect("expire");
    assert!(
        queue_item(&setup, "b").await.is_none(),
        "the queue goes with its last item"
    );
    let again = Key::new("ordq", "a3").expect("key");
    store
        .accept_with(&again, b"x", &ordered("a"))
        .await
        .expect("accept");
    let taken = store.take("ordq", 10, lease).await.expect("take");
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].lease.key, again);
    assert_eq!(taken[0].ordering_key.as_deref(), Some("a"));
}

/// A queue is one item: an ordering key with as many items waiting as its
/// 400 KB holds refuses the next accept with an error saying so, and stores
/// nothing; the items it holds are still handed out in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ordering_queue_refuses_the_accept_and_stores_nothing() {
    use dedupe_core::{AcceptOptions, Inbox};
    let setup = Setup::start(Emulator::DynamoDbLocal).await;
    let store = &setup.store;
    let options = AcceptOptions::new().ordering_key("full");
    // The longest ids fill the queue soonest.
    let id = |i: usize| format!("{i:05}{}", "x".repeat(dedupe_core::MAX_ID_BYTES - 5));
    let mut accepted = 0;
    let refused = loop {
        let key = Key::new("ordq", id(accepted)).expect("key");
        match store.accept_with(&key, b"x", &options).await {
            Ok(answer) => {
                assert!(answer.is_new(), "{answer:?}");
                accepted += 1;
                assert!(
                    accepted < 2_000,
                    "a queue of 2,000 long entries was not refused"
                );
            }
            Err(e) => break (key, e),
        }
    };
    let (key, error) = refused;
    println!("accepted {accepted} before: {error}");
    assert!(accepted > 500, "refused after {accepted} accepts: {error}");
    assert!(!error.is_retryable(), "{error:?}");
    assert!(
        error.to_string().contains("ordering key's queue"),
        "the error names the queue: {error}"
    );
    assert!(
        store.item(&key).await.expect("item").is_none(),
        "the refused item was stored"
    );
    let first = store
        .take("ordq", 4, Duration::from_secs(30))
        .await
        .expect("take");
    assert_eq!(first.len(), 1, "one item of the key at a time");
    assert_eq!(first[0].lease.key.id(), id(0));
}
