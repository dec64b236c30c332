//! The claim in the caller's transaction ([`Transactional`]), one set of
//! checks run on both databases: a private PostgreSQL cluster (`PgStore`)
//! and a private MariaDB server (`MySqlStore`). Each delivery claims, writes
//! an order and completes in one transaction, as an application does.
//!
//! - a rolled-back claim leaves no record and no order: the event is
//!   claimable again;
//! - a connection killed mid-transaction (the worker died) leaves neither,
//!   and the next delivery claims the event at attempt 1;
//! - two transactions on one key: the second waits on the row, then sees the
//!   first's work done (commit) or claims it (rollback); one order either way;
//! - a transaction whose claim lost holds no lock: the holder completes while
//!   it is still open;
//! - the outbox half: an item accepted in the transaction (`accept_in`) is
//!   there with the order or not at all (commit, rollback, a killed
//!   connection), is not taken before the commit, and a concurrent accept of
//!   its key waits, then answers the item (commit) or stores its own
//!   (rollback).
//!
//! What differs between the databases (the orders table's SQL, how a session
//! is killed, how a lock wait shows) is in each one's [`Db`] impl.

use std::time::Duration;

use dedupe_core::{
    async_trait, AcceptOptions, Accepted, ClaimOptions, ClaimOutcome, DedupeStore, Inbox, Key,
};
use dedupe_mysql::sqlx::{MySql, MySqlConnection};
use dedupe_mysql::MySqlStore;
use dedupe_postgres::sqlx::PgConnection;
use dedupe_postgres::PgStore;
use dedupe_sqlx::sqlx::{self, AssertSqlSafe};
use dedupe_sqlx::{ConnectionOf, Transactional};
use dedupe_testkit as support;

const RETENTION: Duration = Duration::from_secs(3600);

/// One database: its store and the few statements the checks need.
#[async_trait]
trait Db: Send + Sync + 'static {
    type Store: Transactional;
    /// A migrated store alone in a schema (a database on MySQL) of its own,
    /// beside an empty `orders (event_id, amount_cents)` table.
    async fn fresh(url: &str) -> Self::Store;
    /// Writes an order for `event` on `conn`.
    async fn insert_order(conn: &mut ConnectionOf<Self::Store>, event: &str);
    /// How many orders `event` has.
    async fn orders(store: &Self::Store, event: &str) -> i64;
    /// The server's id of `conn`'s session.
    async fn session(conn: &mut ConnectionOf<Self::Store>) -> i64;
    /// Kills session `id` from another connection.
    async fn kill(store: &Self::Store, id: i64);
    /// Whether a statement of this store waits on a row lock now.
    async fn waits_on_a_lock(store: &Self::Store) -> bool;
}

struct Pg;

#[async_trait]
impl Db for Pg {
    type Store = PgStore;

    async fn fresh(url: &str) -> PgStore {
        let schema = support::unique_schema("tx");
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect_with(
                options
                    .options([("search_path", schema.as_str())])
                    .application_name(&schema),
            )
            .await
            .expect("pool");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".orders (id bigserial PRIMARY KEY, event_id text NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("schema");
        let store = PgStore::builder(pool)
            .schema(&schema)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        store
    }

    async fn insert_order(conn: &mut PgConnection, event: &str) {
        sqlx::query("INSERT INTO orders (event_id) VALUES ($1)")
            .bind(event)
            .execute(conn)
            .await
            .expect("order");
    }

    async fn orders(store: &PgStore, event: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1")
            .bind(event)
            .fetch_one(store.pool())
            .await
            .expect("count orders")
    }

    async fn session(conn: &mut PgConnection) -> i64 {
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pid")
            .into()
    }

    async fn kill(store: &PgStore, id: i64) {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1::int)")
            .bind(id)
            .fetch_one(store.pool())
            .await
            .expect("kill");
        assert!(killed, "no session {id} to kill");
    }

    async fn waits_on_a_lock(store: &PgStore) -> bool {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND application_name = current_setting('application_name')",
        )
        .fetch_one(store.pool())
        .await
        .map(|n| n >= 1)
        .unwrap_or(false)
    }
}

struct Maria;

#[async_trait]
impl Db for Maria {
    type Store = MySqlStore;

    async fn fresh(url: &str) -> MySqlStore {
        let db = support::unique_schema("tx");
        let admin = dedupe_mysql::sqlx::MySqlPool::connect(url)
            .await
            .expect("admin");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE DATABASE `{db}`;
             CREATE TABLE `{db}`.orders (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                 event_id VARCHAR(255) NOT NULL) ENGINE=InnoDB"
        )))
        .execute(&admin)
        .await
        .expect("database");
        let url = format!("{}/{db}", url.rsplit_once('/').expect("db in url").0);
        let store = MySqlStore::connect(&url).await.expect("store");
        store.migrate().await.expect("migrate");
        store
    }

    async fn insert_order(conn: &mut MySqlConnection, event: &str) {
        sqlx::query("INSERT INTO orders (event_id) VALUES (?)")
            .bind(event)
            .execute(conn)
            .await
            .expect("order");
    }

    async fn orders(store: &MySqlStore, event: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = ?")
            .bind(event)
            .fetch_one(store.pool())
            .await
            .expect("count orders")
    }

    async fn session(conn: &mut MySqlConnection) -> i64 {
        sqlx::query_scalar::<MySql, u64>("SELECT CONNECTION_ID()")
            .fetch_one(conn)
            .await
            .expect("connection id") as i64
    }

    async fn kill(store: &MySqlStore, id: i64) {
        sqlx::raw_sql(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(store.pool())
            .await
            .expect("kill");
    }

    /// A claim's upsert still running while the test holds the key's row
    /// lock is waiting for it. (MariaDB's `innodb_trx` did not always list
    /// the waiting transaction: it missed it for ten seconds in one run of
    /// three.)
    async fn waits_on_a_lock(store: &MySqlStore) -> bool {
        sqlx::query_scalar::<MySql, i64>(
            "SELECT count(*) FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO%ON DUPLICATE KEY UPDATE%'",
        )
        .fetch_one(store.pool())
        .await
        .map(|n| n >= 1)
        .unwrap_or(false)
    }
}

/// What a delivery did.
#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    /// It wrote the order.
    Created,
    /// An earlier delivery did; here is the outcome it stored.
    Duplicate(Vec<u8>),
    /// Another delivery holds the event.
    InFlight,
}

fn stripe(event: &str) -> Key {
    Key::new("stripe", event).expect("key")
}

/// One delivery: claim, order and completion in one transaction.
async fn deliver<D: Db>(store: &D::Store, event: &str) -> Delivery {
    let mut tx = store.pool().begin().await.expect("begin");
    let lease = match store
        .claim_in(&mut tx, &stripe(event), &ClaimOptions::default())
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(lease) => lease,
        ClaimOutcome::Duplicate { outcome, .. } => return Delivery::Duplicate(outcome),
        ClaimOutcome::InFlight { .. } => return Delivery::InFlight,
        other => panic!("{event}: {other:?}"),
    };
    D::insert_order(&mut tx, event).await;
    store
        .complete_in(&mut tx, &lease, b"ordered", RETENTION)
        .await
        .expect("complete");
    tx.commit().await.expect("commit");
    Delivery::Created
}

async fn commit_then_duplicate_and_rollback_leaves_it_claimable<D: Db>(url: &str) {
    let store = D::fresh(url).await;
    assert_eq!(deliver::<D>(&store, "evt_commit").await, Delivery::Created);
    assert_eq!(
        deliver::<D>(&store, "evt_commit").await,
        Delivery::Duplicate(b"ordered".to_vec())
    );
    assert_eq!(D::orders(&store, "evt_commit").await, 1);

    let k = stripe("evt_rollback");
    let mut tx = store.pool().begin().await.expect("begin");
    let answer = store
        .claim_in(&mut tx, &k, &ClaimOptions::default())
        .await
        .expect("claim");
    assert!(answer.lease().is_some(), "{answer:?}");
    D::insert_order(&mut tx, k.id()).await;
    tx.rollback().await.expect("rollback");
    assert_eq!(D::orders(&store, k.id()).await, 0);
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "a rolled-back claim left a record"
    );
    assert_eq!(deliver::<D>(&store, k.id()).await, Delivery::Created);
}

async fn a_killed_connection_leaves_nothing_half_done<D: Db>(url: &str) {
    let store = D::fresh(url).await;
    let k = stripe("evt_killed");
    let mut tx = store.pool().begin().await.expect("begin");
    let session = D::session(&mut tx).await;
    let lease = store
        .claim_in(&mut tx, &k, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    D::insert_order(&mut tx, k.id()).await;
    store
        .complete_in(&mut tx, &lease, b"never committed", RETENTION)
        .await
        .expect("complete");
    D::kill(&store, session).await;
    assert!(tx.commit().await.is_err(), "a killed connection committed");
    assert_eq!(
        D::orders(&store, k.id()).await,
        0,
        "the order of a killed transaction survived"
    );
    match store
        .claim(&k, &ClaimOptions::default())
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(lease) => assert_eq!(lease.attempt, 1),
        other => panic!("after the kill the event answers {other:?}"),
    }
}

async fn concurrent_transactions_on_one_key_have_one_winner<D: Db>(url: &str) {
    for first_commits in [true, false] {
        let store = D::fresh(url).await;
        let event = "evt_contended";
        let mut first = store.pool().begin().await.expect("begin");
        let lease = store
            .claim_in(&mut first, &stripe(event), &ClaimOptions::default())
            .await
            .expect("claim")
            .lease()
            .cloned()
            .expect("won");
        D::insert_order(&mut first, event).await;
        store
            .complete_in(&mut first, &lease, b"first", RETENTION)
            .await
            .expect("complete");
        let second = {
            let store = store.clone();
            tokio::spawn(async move { deliver::<D>(&store, event).await })
        };
        let waiting = support::eventually(Duration::from_secs(10), || {
            let store = store.clone();
            async move { D::waits_on_a_lock(&store).await }
        })
        .await;
        assert!(
            waiting || !second.is_finished(),
            "the second delivery did not wait: {:?}",
            second.await
        );
        assert!(waiting, "the second transaction never waited on the key");
        assert!(!second.is_finished());
        if first_commits {
            first.commit().await.expect("commit");
        } else {
            first.rollback().await.expect("rollback");
        }
        let answer = second.await.expect("second task");
        if first_commits {
            assert_eq!(answer, Delivery::Duplicate(b"first".to_vec()));
        } else {
            assert_eq!(answer, Delivery::Created);
        }
        assert_eq!(D::orders(&store, event).await, 1);
    }
}

async fn a_lost_claim_holds_no_lock<D: Db>(url: &str) {
    let store = D::fresh(url).await;
    let k = stripe("evt_held");
    let lease = store
        .claim(&k, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    let mut tx = store.pool().begin().await.expect("begin");
    let answer = store.claim_in(&mut tx, &k, &ClaimOptions::default()).await;
    assert!(
        matches!(answer, Ok(ClaimOutcome::InFlight { .. })),
        "{answer:?}"
    );
    tokio::time::timeout(
        Duration::from_secs(5),
        store.complete(&lease, b"done", RETENTION),
    )
    .await
    .expect("the holder waited on the loser's open transaction")
    .expect("complete");
    let answer = store.claim_in(&mut tx, &k, &ClaimOptions::default()).await;
    assert!(
        matches!(answer, Ok(ClaimOutcome::Duplicate { .. })),
        "{answer:?}"
    );
    tx.rollback().await.expect("rollback");
}

fn receipt(event: &str) -> Key {
    Key::new("receipts", event).expect("key")
}

/// Records an order and queues its receipt in one transaction; commits or
/// rolls back as asked. Answers what the accept answered.
async fn order_with_receipt<D: Db>(store: &D::Store, event: &str, commit: bool) -> Accepted {
    let mut tx = store.pool().begin().await.expect("begin");
    D::insert_order(&mut tx, event).await;
    let accepted = store
        .accept_in(&mut tx, &receipt(event), b"send it", &AcceptOptions::new())
        .await
        .expect("accept_in");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    accepted
}

async fn an_accept_in_commits_with_the_callers_writes_or_not_at_all<D: Db>(url: &str) {
    let store = D::fresh(url).await;
    let event = "evt_outbox";
    assert_eq!(
        order_with_receipt::<D>(&store, event, false).await,
        Accepted::New
    );
    assert_eq!(D::orders(&store, event).await, 0);
    assert!(
        store.item(&receipt(event)).await.expect("item").is_none(),
        "a rolled-back accept left an item"
    );

    let mut tx = store.pool().begin().await.expect("begin");
    D::insert_order(&mut tx, event).await;
    let accepted = store
        .accept_in(&mut tx, &receipt(event), b"send it", &AcceptOptions::new())
        .await
        .expect("accept_in");
    assert_eq!(accepted, Accepted::New);
    let early = store
        .take("receipts", 10, Duration::from_secs(30))
        .await
        .expect("take");
    assert!(early.is_empty(), "an uncommitted item was taken: {early:?}");
    tx.commit().await.expect("commit");
    assert_eq!(D::orders(&store, event).await, 1);
    let taken = store
        .take("receipts", 10, Duration::from_secs(30))
        .await
        .expect("take");
    assert_eq!(taken.len(), 1, "the committed item was not taken once");
    assert_eq!(taken[0].payload, b"send it");
    let again = order_with_receipt::<D>(&store, event, true).await;
    assert!(
        matches!(again, Accepted::Item(_)),
        "a second accept_in of the key answered {again:?}"
    );
}

async fn a_killed_connection_leaves_no_item<D: Db>(url: &str) {
    let store = D::fresh(url).await;
    let event = "evt_outbox_killed";
    let mut tx = store.pool().begin().await.expect("begin");
    let session = D::session(&mut tx).await;
    D::insert_order(&mut tx, event).await;
    store
        .accept_in(&mut tx, &receipt(event), b"send it", &AcceptOptions::new())
        .await
        .expect("accept_in");
    D::kill(&store, session).await;
    assert!(tx.commit().await.is_err(), "a killed connection committed");
    assert_eq!(D::orders(&store, event).await, 0);
    assert!(
        store.item(&receipt(event)).await.expect("item").is_none(),
        "the item of a killed transaction survived"
    );
    assert_eq!(
        store
            .accept(&receipt(event), b"again")
            .await
            .expect("accept"),
        Accepted::New
    );
}

async fn a_concurrent_accept_waits_for_the_transactions_end<D: Db>(url: &str) {
    for first_commits in [true, false] {
        let store = D::fresh(url).await;
        let event = "evt_outbox_contended";
        let mut first = store.pool().begin().await.expect("begin");
        D::insert_order(&mut first, event).await;
        let accepted = store
            .accept_in(&mut first, &receipt(event), b"first", &AcceptOptions::new())
            .await
            .expect("accept_in");
        assert_eq!(accepted, Accepted::New);
        let second = {
            let store = store.clone();
            tokio::spawn(async move { store.accept(&receipt(event), b"second").await })
        };
        let waiting = support::eventually(Duration::from_secs(10), || {
            let store = store.clone();
            async move { D::waits_on_a_lock(&store).await }
        })
        .await;
        assert!(
            waiting && !second.is_finished(),
            "the second accept did not wait on the first's transaction"
        );
        if first_commits {
            first.commit().await.expect("commit");
        } else {
            first.rollback().await.expect("rollback");
        }
        let answer = second.await.expect("second task").expect("second accept");
        let item = store
            .item(&receipt(event))
            .await
            .expect("item")
            .expect("one item either way");
        if first_commits {
            assert!(matches!(answer, Accepted::Item(_)), "{answer:?}");
            assert_eq!(item.payload, b"first");
        } else {
            assert_eq!(answer, Accepted::New);
            assert_eq!(item.payload, b"second");
        }
    }
}

/// The checks for one database: `$server` starts it.
macro_rules! transactional_checks {
    ($db:ident, $server:path, $impl:ty) => {
        mod $db {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn commit_then_duplicate_and_rollback_leaves_it_claimable() {
                let (_server, url) = $server();
                super::commit_then_duplicate_and_rollback_leaves_it_claimable::<$impl>(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_connection_leaves_nothing_half_done() {
                let (_server, url) = $server();
                super::a_killed_connection_leaves_nothing_half_done::<$impl>(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_transactions_on_one_key_have_one_winner() {
                let (_server, url) = $server();
                super::concurrent_transactions_on_one_key_have_one_winner::<$impl>(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lost_claim_holds_no_lock() {
                let (_server, url) = $server();
                super::a_lost_claim_holds_no_lock::<$impl>(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_accept_in_commits_with_the_callers_writes_or_not_at_all() {
                let (_server, url) = $server();
                super::an_accept_in_commits_with_the_callers_writes_or_not_at_all::<$impl>(&url)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_connection_leaves_no_item() {
                let (_server, url) = $server();
                super::a_killed_connection_leaves_no_item::<$impl>(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_accept_waits_for_the_transactions_end() {
                let (_server, url) = $server();
                super::a_concurrent_accept_waits_for_the_transactions_end::<$impl>(&url).await;
            }
        }
    };
}

transactional_checks!(postgres, support::postgres_server, Pg);
transactional_checks!(mariadb, support::mysql_server, Maria);
