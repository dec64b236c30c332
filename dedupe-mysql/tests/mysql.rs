//! MySQL-specific behaviour on a private MariaDB: the transactional example
//! and a deadlock between two caller transactions (the checks shared with
//! Postgres are in `dedupe-sqlx/tests/transactional.rs`), the traps of `ON DUPLICATE KEY UPDATE` (assignment
//! order, affected rows), byte-exact keys, corrupt rows, lock waits and
//! timeouts, `max_allowed_packet`, the purge, and the fault runs: a server
//! killed under load, cut connections, a blackhole, a lost answer, killed
//! worker processes.

use dedupe_testkit as support;

#[path = "../examples/mysql_transactional_orders.rs"]
#[allow(dead_code)]
mod example;

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, RecordState};
use dedupe_mysql::sqlx::{self, AssertSqlSafe, MySqlPool};
use dedupe_mysql::MySqlStore;
use example::Delivery;

/// The record columns, for rows written by hand (the inbox's columns after
/// them stay NULL).
const RECORD_COLUMNS: &str = "(namespace, id, state, token, claim_id, fingerprint, expires_at, \
     completed_at, outcome, attempts, first_seen)";

fn key(id: &str) -> Key {
    Key::new("my", id).expect("valid key")
}

async fn store_on(url: &str, table: &str, timeout: Duration) -> MySqlStore {
    let pool = MySqlStore::connect_pool(url, 8, timeout)
        .await
        .expect("pool");
    let store = MySqlStore::builder(pool)
        .table(table)
        .timeout(timeout)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store
}

/// Runs `sql` on `pool` and answers the rows it changed.
async fn raw(pool: &MySqlPool, sql: String) -> u64 {
    sqlx::query(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect("raw statement")
        .rows_affected()
}

/// The token and attempts of a row, as stored.
async fn row_of(pool: &MySqlPool, table: &str, id: &str) -> Option<(Vec<u8>, i32)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT token, attempts FROM `{table}` WHERE namespace = 'my' AND id = ?"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await
    .expect("read row")
}

async fn orders(pool: &MySqlPool, event: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = ?")
        .bind(event)
        .fetch_one(pool)
        .await
        .expect("count orders")
}

/// A store and the example's orders table, in a database of their own.
async fn example_store(url: &str) -> (MySqlStore, MySqlPool) {
    let db = support::unique_schema("orders");
    let admin = MySqlPool::connect(url).await.expect("admin");
    raw(&admin, format!("CREATE DATABASE `{db}`")).await;
    let url = format!("{}/{db}", url.rsplit_once('/').expect("db in url").0);
    let store = MySqlStore::connect(&url).await.expect("store");
    example::setup(&store).await.expect("setup");
    let pool = store.pool().clone();
    (store, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_claim_commits_with_the_order() {
    let (_server, url) = support::mysql_server();
    let (store, pool) = example_store(&url).await;
    let first = example::handle_delivery(&store, &pool, "evt_commit", 2500)
        .await
        .expect("first");
    let Delivery::Created(order) = first else {
        panic!("first delivery answered {first:?}")
    };
    let second = example::handle_delivery(&store, &pool, "evt_commit", 2500)
        .await
        .expect("second");
    assert_eq!(second, Delivery::Duplicate(format!("order {order}")));
    assert_eq!(orders(&pool, "evt_commit").await, 1);
}

/// How many claim upserts the server is running now: one still there while
/// the test holds the key's row lock is waiting for it. (MariaDB's
/// `innodb_trx` did not always list the waiting transaction: it missed it for
/// ten seconds in one run of three.)
async fn lock_waits(pool: &MySqlPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.PROCESSLIST
         WHERE INFO LIKE 'INSERT INTO%ON DUPLICATE KEY UPDATE%'",
    )
    .fetch_one(pool)
    .await
    .expect("lock waits")
}

/// Two caller transactions claim two keys in opposite orders: InnoDB rolls
/// one back as a deadlock, which the store answers as a retryable error (the
/// caller redoes its transaction), and the other claims both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_caller_transactions_is_retryable() {
    let (_server, url) = support::mysql_server();
    let store = store_on(
        &url,
        &support::unique_schema("deadlock"),
        Duration::from_secs(10),
    )
    .await;
    let pool = store.pool().clone();
    let (a, b) = (key("a"), key("b"));
    let opts = ClaimOptions::default();
    let mut one = pool.begin().await.expect("begin");
    let mut two = pool.begin().await.expect("begin");
    assert!(store
        .claim_in(&mut one, &a, &opts)
        .await
        .expect("a")
        .lease()
        .is_some());
    assert!(store
        .claim_in(&mut two, &b, &opts)
        .await
        .expect("b")
        .lease()
        .is_some());
    // `one` now waits for `two`'s row; `two` asking for `one`'s closes the cycle.
    let waiter = {
        let (store, b, opts) = (store.clone(), b.clone(), opts.clone());
        tokio::spawn(async move {
            let answer = store.claim_in(&mut one, &b, &opts).await;
            (one, answer)
        })
    };
    let waiting = support::eventually(Duration::from_secs(10), || {
        let pool = pool.clone();
        async move { lock_waits(&pool).await >= 1 }
    })
    .await;
    assert!(waiting, "the first transaction never waited");
    let second = store.claim_in(&mut two, &a, &opts).await;
    let (one, first) = waiter.await.expect("waiter");
    let (loser, winner) = match (first, second) {
        (Err(e), Ok(answer)) => ((e, one), (answer, two)),
        (Ok(answer), Err(e)) => ((e, two), (answer, one)),
        other => panic!("no deadlock, or two: {other:?}"),
    };
    assert!(loser.0.is_retryable(), "a deadlock answered {:?}", loser.0);
    assert!(loser.0.to_string().contains("deadlock"), "{}", loser.0);
    drop(loser.1);
    // The survivor's claim waited on the rolled-back row and now holds it.
    assert!(winner.0.lease().is_some(), "{:?}", winner.0);
    winner.1.commit().await.expect("commit");
    for k in [&a, &b] {
        assert!(matches!(
            store.get(k).await.expect("get").map(|r| r.state),
            Some(RecordState::InFlight { .. })
        ));
    }
}

/// `ON DUPLICATE KEY UPDATE` assigns left to right, each assignment seeing the
/// ones before it: the takeover must judge every column on the row as it was.
/// An expired in-flight row keeps its first sighting and counts the attempt;
/// an expired done row starts over at attempt 1 with no outcome; a live row is
/// left byte for byte. The affected-rows count is rows matched (the driver
/// sets `CLIENT_FOUND_ROWS`), which the fenced statements rely on: an extend
/// to the deadline the row already has still finds its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_reads_the_row_as_it_was() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("order");
    let store = store_on(&url, &table, Duration::from_secs(5)).await;
    let pool = store.pool().clone();
    let past = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED) - 1000";
    let hour_ago = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED) - 3600000";
    raw(
        &pool,
        format!(
            "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES
           ('my', 'lapsed', 0, 'old', 'c-old', NULL, {past}, NULL, NULL, 4, {hour_ago}),
           ('my', 'done', 1, 'old', NULL, NULL, {past}, {past}, 'gone', 3, {hour_ago})"
        ),
    )
    .await;
    let opts = ClaimOptions::default();
    match store.claim(&key("lapsed"), &opts).await.expect("claim") {
        ClaimOutcome::Claimed(lease) => assert_eq!(lease.attempt, 5, "{lease:?}"),
        other => panic!("an expired lease answered {other:?}"),
    }
    let lapsed = store
        .get(&key("lapsed"))
        .await
        .expect("get")
        .expect("record");
    let age = lapsed.first_seen.elapsed().expect("first seen in the past");
    assert!(
        age >= Duration::from_secs(3500),
        "first sighting lost: {age:?}"
    );
    assert_eq!(
        lapsed.claim_id, None,
        "the old claim id survived the takeover"
    );
    match store.claim(&key("done"), &opts).await.expect("claim") {
        ClaimOutcome::Claimed(lease) => assert_eq!(lease.attempt, 1, "{lease:?}"),
        other => panic!("an expired done record answered {other:?}"),
    }
    let done = store.get(&key("done")).await.expect("get").expect("record");
    assert!(done.first_seen.elapsed().unwrap_or_default() < Duration::from_secs(60));
    assert!(
        matches!(done.state, RecordState::InFlight { .. }),
        "{done:?}"
    );
    let outcome: Option<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT outcome FROM `{table}` WHERE id = 'done'"
    )))
    .fetch_one(&pool)
    .await
    .expect("outcome");
    assert_eq!(outcome, None, "the old outcome survived the takeover");

    // A live row: the upsert matches it and writes nothing.
    let before: Vec<u8> = snapshot(&pool, &table, "lapsed").await;
    assert!(matches!(
        store.claim(&key("lapsed"), &opts).await.expect("claim"),
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(snapshot(&pool, &table, "lapsed").await, before);

    // Rows matched, not rows changed.
    let same = raw(
        &pool,
        format!(
            "UPDATE `{table}` SET attempts = attempts WHERE namespace = 'my' AND id = 'lapsed'"
        ),
    )
    .await;
    assert_eq!(
        same, 1,
        "the driver counts changed rows: the fenced statements need matched rows"
    );
}

/// Every column of a row, as one value.
async fn snapshot(pool: &MySqlPool, table: &str, id: &str) -> Vec<u8> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT CONCAT_WS('|', state, token, HEX(claim_id), HEX(fingerprint), expires_at,
                completed_at, HEX(outcome), attempts, first_seen)
         FROM `{table}` WHERE namespace = 'my' AND id = ?"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .expect("snapshot")
}

/// Keys are compared byte for byte (rule 2): case, accents, trailing spaces
/// and a different Unicode normal form are other keys, whatever collation
/// the server defaults to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_differing_in_case_accents_or_spaces_are_other_keys() {
    let (_server, url) = support::mysql_server();
    let store = store_on(
        &url,
        &support::unique_schema("bytes"),
        Duration::from_secs(5),
    )
    .await;
    let opts = ClaimOptions::default();
    for id in ["evt", "EVT", "evt ", "évt", "e\u{301}vt", "evt\u{3000}"] {
        match store.claim(&key(id), &opts).await.expect("claim") {
            ClaimOutcome::Claimed(_) => {}
            other => panic!("{id:?} was taken as another key's duplicate: {other:?}"),
        }
    }
    let (kind, collation): (String, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT DATA_TYPE, COLLATION_NAME FROM information_schema.COLUMNS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{}' AND COLUMN_NAME = 'id'",
        store.table_name()
    )))
    .fetch_one(store.pool())
    .await
    .expect("column");
    assert_eq!((kind.as_str(), collation), ("varbinary", None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_rows_are_reported_not_guessed() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("corrupt");
    let store = store_on(&url, &table, Duration::from_secs(5)).await;
    let pool = store.pool().clone();
    let far = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED) + 86400000";
    for (id, values) in [
        (
            "done-no-outcome",
            format!("1, 't', NULL, NULL, {far}, {far}, NULL, 1, 0"),
        ),
        (
            "zero-attempts",
            format!("0, 't', NULL, NULL, {far}, NULL, NULL, 0, 0"),
        ),
        (
            "unknown-state",
            format!("7, 't', NULL, NULL, {far}, NULL, NULL, 1, 0"),
        ),
        (
            "empty-token",
            format!("0, '', NULL, NULL, {far}, NULL, NULL, 1, 0"),
        ),
        (
            "empty-fingerprint",
            format!("0, 't', NULL, '', {far}, NULL, NULL, 1, 0"),
        ),
        (
            "empty-claim-id",
            format!("0, 't', '', NULL, {far}, NULL, NULL, 1, 0"),
        ),
        (
            "bad-utf8-token",
            format!("0, X'FF', NULL, NULL, {far}, NULL, NULL, 1, 0"),
        ),
    ] {
        raw(
            &pool,
            format!("INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', '{id}', {values})"),
        )
        .await;
        let before = snapshot(&pool, &table, id).await;
        match store.claim(&key(id), &ClaimOptions::default()).await {
            Err(Error::CorruptRecord { .. }) => {}
            other => panic!("claim of corrupt row {id} answered {other:?}"),
        }
        assert!(
            matches!(store.get(&key(id)).await, Err(Error::CorruptRecord { .. })),
            "{id}"
        );
        assert_eq!(
            snapshot(&pool, &table, id).await,
            before,
            "{id} was written"
        );
        // The operator's way out: forget removes it all the same.
        assert!(
            store.forget(&key(id)).await.expect("forget a corrupt row"),
            "{id}"
        );
        assert_eq!(row_of(&pool, &table, id).await, None, "{id} is still there");
    }
}

/// A batch meeting a live corrupt record fails and changes nothing, with a
/// claim id and without: its new keys get no row, the expired lease it would
/// have taken over keeps its holder's token and attempt, a key held by
/// another lease and a done key stay exactly as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_meeting_a_corrupt_record_writes_nothing() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("badbatch");
    let store = store_on(&url, &table, Duration::from_secs(5)).await;
    let pool = store.pool().clone();
    let now = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    raw(&pool, format!(
        "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', 'bad', 7, 't', NULL, NULL, {now} + 86400000, NULL, NULL, 1, {now})"
    ))
    .await;
    let plain = ClaimOptions::default();
    let with_id = ClaimOptions::default().with_claim_id(ClaimId::new("batch-1").expect("id"));
    for (case, opts) in [("plain", &plain), ("claim-id", &with_id)] {
        let name = |what: &str| format!("{what}-{case}");
        let held = store
            .claim(&key(&name("held")), &plain)
            .await
            .expect("claim");
        let held = held.lease().cloned().expect("held is claimed");
        let done = store
            .claim(&key(&name("done")), &plain)
            .await
            .expect("claim");
        let done = done.lease().cloned().expect("done is claimed");
        store
            .complete(&done, b"kept", Duration::from_secs(600))
            .await
            .expect("complete");
        raw(&pool, format!(
            "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', '{}', 0, 'old', NULL, NULL, {now} - 1000, NULL, NULL, 2, {now} - 3600000)",
            name("expired")
        ))
        .await;
        // The new keys sort before and after the corrupt one, so the
        // statement writes one of them before it meets it.
        let batch = [
            key(&name("a-new")),
            key(&name("held")),
            key(&name("expired")),
            key(&name("done")),
            key("bad"),
            key(&name("z-new")),
        ];
        match store.claim_many(&batch, opts).await {
            Err(Error::CorruptRecord { key, .. }) => assert_eq!(key, "my:bad"),
            other => panic!("a batch with a corrupt record answered {other:?} ({case})"),
        }
        for new in ["a-new", "z-new"] {
            assert_eq!(
                row_of(&pool, &table, &name(new)).await,
                None,
                "{new} was written ({case})"
            );
        }
        assert_eq!(
            row_of(&pool, &table, &name("expired")).await,
            Some((b"old".to_vec(), 2)),
            "the expired lease was taken over ({case})"
        );
        assert_eq!(
            row_of(&pool, &table, &name("held")).await,
            Some((held.token.as_str().as_bytes().to_vec(), 1)),
            "another holder's lease was touched ({case})"
        );
        assert!(matches!(
            store.claim(&key(&name("done")), &plain).await.expect("claim"),
            ClaimOutcome::Duplicate { outcome, .. } if outcome == b"kept"
        ));
    }
}

/// A statement stuck behind another transaction's row lock ends at the
/// store's timeout, on the server too (MariaDB's `max_statement_time`): a
/// retryable `Timeout` with the server's error as its source, and nothing
/// changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_stuck_on_a_lock_times_out_and_changes_nothing() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("timeout");
    let store = store_on(&url, &table, Duration::from_millis(400)).await;
    let k = key("locked");
    let lease = store
        .claim(&k, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    let admin = MySqlPool::connect(&url).await.expect("admin pool");
    let mut blocker = admin.begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM `{table}` WHERE namespace = 'my' AND id = 'locked' FOR UPDATE"
    )))
    .execute(&mut *blocker)
    .await
    .expect("lock the row");
    match store
        .complete(&lease, b"blocked", Duration::from_secs(60))
        .await
    {
        Err(e @ Error::Timeout { .. }) => {
            assert!(e.is_retryable());
            assert!(
                std::error::Error::source(&e).is_some(),
                "stopped by the client, not the server: {e}"
            );
        }
        other => panic!("a statement stuck on a lock answered {other:?}"),
    }
    // No statement of the store's is left running on the server.
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'UPDATE%SET outcome%'",
    )
    .fetch_one(&admin)
    .await
    .expect("processlist");
    assert_eq!(
        running, 0,
        "the timed-out statement still runs on the server"
    );
    blocker.rollback().await.expect("unlock");
    let record = store.get(&k).await.expect("get").expect("record");
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "the timed-out complete took effect"
    );
    store
        .complete(&lease, b"unblocked", Duration::from_secs(60))
        .await
        .expect("complete after the lock");
}

/// The outcome limit against the server's `max_allowed_packet`: `migrate`
/// refuses a limit the server cannot carry, naming both; a too-large
/// statement sent anyway is a typed error that wrote nothing, and the store
/// goes on working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_limit_must_fit_max_allowed_packet() {
    let (server, url) = support::mysql_server();
    let admin = MySqlPool::connect(&url).await.expect("admin pool");
    let packet: u64 = sqlx::query_scalar("SELECT @@GLOBAL.max_allowed_packet")
        .fetch_one(&admin)
        .await
        .expect("packet");
    if server.is_some() {
        // A private server: shrink it (sessions read the global at connect).
        raw(&admin, "SET GLOBAL max_allowed_packet = 65536".into()).await;
    }
    let packet = if server.is_some() { 65536 } else { packet };
    let table = support::unique_schema("packet");
    let pool = MySqlStore::connect_pool(&url, 2, Duration::from_secs(5))
        .await
        .expect("pool");
    let too_big = usize::try_from(packet).expect("packet size") + 1;
    let store = MySqlStore::builder(pool.clone())
        .table(&table)
        .max_outcome_bytes(too_big)
        .build()
        .expect("store");
    match store.migrate().await {
        Err(Error::InvalidConfig { reason }) => {
            assert!(reason.contains("max_allowed_packet"), "{reason}");
            assert!(reason.contains(&too_big.to_string()), "{reason}");
        }
        other => panic!("a limit over max_allowed_packet migrated: {other:?}"),
    }
    // Sent anyway (a store never migrated by this process): refused typed.
    let fits = MySqlStore::builder(pool.clone())
        .table(&table)
        .max_outcome_bytes(1024)
        .build()
        .expect("store");
    fits.migrate().await.expect("the default limit fits");
    let lease = store
        .claim(&key("big"), &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    let outcome = vec![7u8; too_big];
    match store
        .complete(&lease, &outcome, Duration::from_secs(60))
        .await
    {
        Err(e @ Error::Backend { .. }) => {
            assert!(!e.is_retryable(), "sending it again cannot help: {e}");
            assert!(e.to_string().contains("max_allowed_packet"), "{e}");
        }
        other => panic!("a statement over max_allowed_packet answered {other:?}"),
    }
    store
        .complete(&lease, b"small", Duration::from_secs(60))
        .await
        .expect("the lease still holds and the store still works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_must_be_plain_identifiers() {
    let (_server, url) = support::mysql_server();
    let pool = MySqlPool::connect(&url).await.expect("pool");
    for table in ["x; DROP TABLE y", "a`b", "", "1t", "dédupe", "t t"] {
        match MySqlStore::builder(pool.clone()).table(table).build() {
            Err(Error::InvalidConfig { reason }) => assert!(reason.contains("table"), "{reason}"),
            other => panic!("{table:?} answered {other:?}"),
        }
    }
    match MySqlStore::connect("not a url").await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("a bad URL answered {other:?}"),
    }
    for timeout in [Duration::ZERO, Duration::from_micros(999)] {
        assert!(matches!(
            MySqlStore::builder(pool.clone()).timeout(timeout).build(),
            Err(Error::InvalidConfig { .. })
        ));
    }
    // A store whose table was never made says what to do.
    let store = MySqlStore::builder(pool.clone())
        .table(support::unique_schema("missing"))
        .build()
        .expect("store");
    match store.claim(&key("k"), &ClaimOptions::default()).await {
        Err(e) => assert!(e.to_string().contains("migrate"), "{e}"),
        Ok(answer) => panic!("a missing table answered {answer:?}"),
    }
}

/// The purge deletes every expired row, in batches, and nothing live; a
/// claim of another key is not held up by a purge in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expire_purges_every_expired_row_in_batches() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("purge");
    let store = store_on(&url, &table, Duration::from_secs(10)).await;
    let pool = store.pool().clone();
    let now = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    let rows: Vec<String> = (1..=1234)
        .map(|n| format!("('my', 'old-{n}', 1, 't', NULL, NULL, {now} - {n}, 0, 'o', 1, 0)"))
        .collect();
    raw(
        &pool,
        format!(
            "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES {}",
            rows.join(", ")
        ),
    )
    .await;
    let live = store
        .claim(&key("live"), &ClaimOptions::default())
        .await
        .expect("claim");
    assert!(live.lease().is_some());
    // A purge batch left uncommitted in another session: its row locks hold
    // only the rows it deletes (READ COMMITTED, no gap locks).
    let mut purge = pool.begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM `{table}` WHERE expires_at <= CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)
         ORDER BY expires_at LIMIT 500"
    )))
    .execute(&mut *purge)
    .await
    .expect("purge batch");
    let started = std::time::Instant::now();
    let fresh = store
        .claim(&key("fresh"), &ClaimOptions::default())
        .await
        .expect("claim");
    assert!(fresh.lease().is_some());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a claim waited on the purge"
    );
    purge.rollback().await.expect("rollback");
    assert_eq!(store.expire().await.expect("expire"), 1234);
    assert_eq!(store.expire().await.expect("expire"), 0);
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM `{table}`")))
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 2, "live records were purged");
}

/// The server is stopped: calls fail retryably, within the bound; it comes
/// back: the same store works again, and what was written before is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_is_retryable_and_recovered() {
    let mut server = support::MariaDbServer::start();
    let store = store_on(&server.url("test"), "restart", Duration::from_secs(2)).await;
    let before = store
        .claim(&key("before"), &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    tokio::task::block_in_place(|| server.stop());
    let started = std::time::Instant::now();
    match store.claim(&key("during"), &ClaimOptions::default()).await {
        Err(e) => assert!(e.is_retryable(), "a stopped server gave {e}"),
        Ok(answer) => panic!("a stopped server answered {answer:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the failure was not bounded"
    );
    tokio::task::block_in_place(|| server.restart());
    let recovered = support::eventually(Duration::from_secs(20), || {
        let store = store.clone();
        async move {
            store
                .claim(&key("after"), &ClaimOptions::default())
                .await
                .is_ok()
        }
    })
    .await;
    assert!(recovered, "the store did not recover after the restart");
    assert!(matches!(
        store.claim(&key("before"), &ClaimOptions::default()).await,
        Ok(ClaimOutcome::InFlight { .. })
    ));
    store
        .complete(&before, b"done", Duration::from_secs(60))
        .await
        .expect("the old lease still holds");
}

/// The bound on any one call in the fault runs: the store's timeout, and
/// room for a loaded two-core machine.
fn fault_bound(timeout: Duration) -> Duration {
    timeout + Duration::from_millis(1500)
}

/// The server is killed with SIGKILL under eight recorded workers, then
/// started again (InnoDB crash recovery, `innodb_flush_log_at_trx_commit=1`):
/// every error typed and retryable within the bound, the same store works
/// again, the history valid, and every completion acknowledged before the
/// kill is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_server_under_load_loses_nothing() {
    use support::faults::FaultRun;
    let mut server = support::MariaDbServer::start();
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn DedupeStore> =
        Arc::new(store_on(&server.url("test"), "crash", timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    tokio::task::block_in_place(|| {
        server.kill();
        std::thread::sleep(Duration::from_millis(300));
        server.restart();
    });
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// Eight workers through a proxy that cuts every connection every 150 ms:
/// every failure retryable, the history valid, and the store works once the
/// cuts stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_under_load_keep_the_history_valid() {
    use support::faults::{cut_repeatedly, FaultRun};
    let (_server, url) = support::mysql_server();
    let (proxy, via) = support::proxied(&url).await.expect("proxy");
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn DedupeStore> =
        Arc::new(store_on(&via, &support::unique_schema("chaos"), timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    cut_repeatedly(&proxy, 16, Duration::from_millis(150)).await;
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    let won = verdict.history.claims_won();
    assert!(won > 20, "too little work got through: {won} claims won");
    let after = store
        .claim(&key("after-the-cuts"), &ClaimOptions::default())
        .await
        .expect("the store works again");
    assert!(after.lease().is_some());
}

/// The network swallows every byte, then holds every byte and delivers it
/// late, each longer than the timeout: calls end in retryable timeouts within
/// the bound, no connection left out of step gives a wrong answer, and the
/// history stays valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackholed_and_stalled_connections_time_out_and_recover() {
    use support::faults::FaultRun;
    let (_server, url) = support::mysql_server();
    let (proxy, via) = support::proxied(&url).await.expect("proxy");
    let timeout = Duration::from_millis(800);
    let store: Arc<dyn DedupeStore> =
        Arc::new(store_on(&via, &support::unique_schema("hole"), timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    support::faults::blackhole_then_stall(&proxy, Duration::from_millis(2500)).await;
    let verdict = run.finish().await;
    assert!(
        verdict
            .errors
            .iter()
            .any(|e| matches!(e, Error::Timeout { .. })),
        "no call timed out: {:?}",
        verdict.errors.iter().take(5).collect::<Vec<_>>()
    );
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// The server runs a claim and the connection dies before the answer comes
/// back: a retryable error, and the retry with the same claim id is Claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_answer_is_reclaimed_by_its_claim_id() {
    let (_server, url) = support::mysql_server();
    let (proxy, via) = support::proxied(&url).await.expect("proxy");
    let timeout = Duration::from_secs(1);
    let pool = MySqlStore::connect_pool(&via, 1, timeout)
        .await
        .expect("pool");
    let store = MySqlStore::builder(pool)
        .table(support::unique_schema("lost"))
        .timeout(timeout)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    support::faults::lost_answer_is_reclaimed_by_its_claim_id(
        &store,
        &proxy,
        &key("lost-answer"),
        fault_bound(timeout),
    )
    .await;
}

dedupe_testkit::crash_tests! {
    setup: || {
        let (server, url) = support::mysql_server();
        let table = support::unique_schema("crashes");
        tokio::runtime::Runtime::new()
            .expect("runtime")
            .block_on(store_on(&url, &table, Duration::from_secs(5)));
        let env = vec![("DEDUPE_CHILD_URL", url), ("DEDUPE_CHILD_TABLE", table)];
        (server, env)
    },
    worker: || async {
        let url = std::env::var("DEDUPE_CHILD_URL").expect("child job");
        let table = std::env::var("DEDUPE_CHILD_TABLE").expect("table");
        let pool = MySqlStore::connect_pool(&url, 2, Duration::from_secs(5))
            .await
            .expect("pool");
        let store = MySqlStore::builder(pool).table(&table).build().expect("store");
        Arc::new(store) as Arc<dyn DedupeStore>
    },
    inbox_worker: || async {
        let url = std::env::var("DEDUPE_CHILD_URL").expect("child job");
        let table = std::env::var("DEDUPE_CHILD_TABLE").expect("table");
        let pool = MySqlStore::connect_pool(&url, 2, Duration::from_secs(5))
            .await
            .expect("pool");
        let store = MySqlStore::builder(pool).table(&table).build().expect("store");
        Arc::new(store) as Arc<dyn dedupe_core::Inbox>
    },
    ordering_keys: true,
}

/// `forget` removes the record it read, never one written since: here a
/// caller's transaction takes over the expired record while forget's delete
/// waits on its row lock; the takeover commits, forget answers `false`, and
/// the new claim stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_leaves_a_claim_made_after_it_read() {
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("forget");
    let store = store_on(&url, &table, Duration::from_secs(10)).await;
    let pool = store.pool().clone();
    let now = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    raw(&pool, format!(
        "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', 'k', 0, 'old', NULL, NULL, {now} - 1000, NULL, NULL, 1, {now})"
    ))
    .await;
    let k = key("k");
    let mut tx = pool.begin().await.expect("begin");
    let taken = store
        .claim_in(&mut tx, &k, &ClaimOptions::default())
        .await
        .expect("takeover");
    let taken = taken
        .lease()
        .cloned()
        .expect("the expired record is taken over");
    let forget = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move { store.forget(&k).await })
    };
    let waiting = support::eventually(Duration::from_secs(10), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'DELETE FROM%'",
            )
            .fetch_one(&pool)
            .await
            .expect("processlist")
                >= 1
        }
    })
    .await;
    assert!(waiting, "forget's delete never waited on the takeover");
    tx.commit().await.expect("commit the takeover");
    let forgot = forget.await.expect("forget task").expect("forget");
    assert!(!forgot, "forget answered that it removed a live record");
    assert_eq!(
        row_of(&pool, &table, "k").await,
        Some((taken.token.as_str().as_bytes().to_vec(), 2)),
        "forget removed the claim made after it read"
    );
}

/// Once most recent claims met records, a claim reads the key first and a
/// live record answers it; every other answer is still the upsert's: a new
/// key is claimed once, an expired lease taken over with its attempt
/// counted, a retry with the lease's claim id gets that lease, a done key
/// its outcome, and racing claims on shared keys have one winner each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_read_first_while_they_meet_records() {
    let (server, url) = support::mysql_server();
    let table = support::unique_schema("first");
    let store = store_on(&url, &table, Duration::from_secs(5)).await;
    let opts = ClaimOptions::default();
    let done = store
        .claim(&key("done"), &opts)
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    store
        .complete(&done, b"kept", Duration::from_secs(600))
        .await
        .expect("complete");
    // Duplicates: the store now reads first.
    for _ in 0..10 {
        assert!(matches!(
            store.claim(&key("done"), &opts).await.expect("claim"),
            ClaimOutcome::Duplicate { outcome, .. } if outcome == b"kept"
        ));
    }
    if server.is_some() {
        // The only client of this server: the count is the store's.
        let before = inserts(store.pool()).await;
        assert!(matches!(
            store.claim(&key("done"), &opts).await.expect("claim"),
            ClaimOutcome::Duplicate { .. }
        ));
        assert_eq!(
            inserts(store.pool()).await,
            before,
            "a duplicate ran the upsert: claims do not read first"
        );
    }
    let new = key("new");
    assert!(store
        .claim(&new, &opts)
        .await
        .expect("claim")
        .lease()
        .is_some());
    assert!(matches!(
        store.claim(&new, &opts).await.expect("claim"),
        ClaimOutcome::InFlight { .. }
    ));
    let now = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    raw(store.pool(), format!(
        "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', 'lapsed', 0, 'old', NULL, NULL, {now} - 1000, NULL, NULL, 1, {now})"
    ))
    .await;
    match store.claim(&key("lapsed"), &opts).await.expect("claim") {
        ClaimOutcome::Claimed(lease) => assert_eq!(lease.attempt, 2),
        other => panic!("an expired lease answered {other:?}"),
    }
    // An expired record is absent whatever its other columns hold (rule 5):
    // the read does not decode it, the upsert takes it over.
    raw(store.pool(), format!(
        "INSERT INTO `{table}` {RECORD_COLUMNS} VALUES ('my', 'lapsed-bad', 7, '', NULL, NULL, {now} - 1000, NULL, NULL, 0, {now})"
    ))
    .await;
    assert!(matches!(
        store.claim(&key("lapsed-bad"), &opts).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    let with_id = opts
        .clone()
        .with_claim_id(ClaimId::new("delivery-1").expect("id"));
    let first = store.claim(&key("by-id"), &with_id).await.expect("claim");
    let again = store.claim(&key("by-id"), &with_id).await.expect("claim");
    assert_eq!(
        first.lease().map(|l| l.token.clone()),
        again.lease().map(|l| l.token.clone()),
        "the retry with the claim id did not get its lease: {again:?}"
    );
    // Racing claims on shared keys from one store (one count) and its clones.
    let store = Arc::new(store);
    let wins: Vec<_> = (0..8)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut won = Vec::new();
                for i in 0..40 {
                    let k = key(&format!("race-{}", i / 2));
                    if let ClaimOutcome::Claimed(_) =
                        store.claim(&k, &opts_short()).await.expect("claim")
                    {
                        won.push(k.id().to_string());
                    }
                }
                won
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in wins {
        all.extend(w.await.expect("task"));
    }
    all.sort();
    let before = all.len();
    all.dedup();
    assert_eq!(before, all.len(), "a key was won twice");
    assert_eq!(all.len(), 20, "every raced key has a winner");
}

fn opts_short() -> ClaimOptions {
    ClaimOptions::new(Duration::from_secs(60))
}

/// INSERT statements the server has run (an upsert is one), prepared or not.
async fn inserts(pool: &MySqlPool) -> i64 {
    sqlx::query_scalar(
        "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS
         WHERE VARIABLE_NAME = 'COM_INSERT'",
    )
    .fetch_one(pool)
    .await
    .expect("Com_insert")
}

/// A table made by the first migration alone (before the inbox) is brought
/// up to date by `migrate`, run by two stores at once: the records in it
/// answer as before, the inbox works on it, and migrating again changes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_from_before_the_inbox_is_migrated() {
    use dedupe_core::Inbox;
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("pre_inbox");
    let pool = MySqlStore::connect_pool(&url, 4, Duration::from_secs(5))
        .await
        .expect("pool");
    raw(
        &pool,
        include_str!("../migrations/0001_records.sql").replace("{table}", &table),
    )
    .await;
    let now = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    raw(
        &pool,
        format!(
            "INSERT INTO `{table}` VALUES
             ('my', 'old', 1, 't', NULL, NULL, {now} + 86400000, {now}, 'old', 1, {now})"
        ),
    )
    .await;
    let stores: Vec<MySqlStore> = (0..2)
        .map(|_| {
            MySqlStore::builder(pool.clone())
                .table(&table)
                .build()
                .expect("store")
        })
        .collect();
    let (a, b) = tokio::join!(stores[0].migrate(), stores[1].migrate());
    a.expect("migrate");
    b.expect("a concurrent migrate");
    let store = &stores[0];
    store.migrate().await.expect("migrate again");
    match store
        .claim(&key("old"), &ClaimOptions::default())
        .await
        .expect("claim")
    {
        ClaimOutcome::Duplicate { outcome, .. } => assert_eq!(outcome, b"old"),
        other => panic!("the old record answered {other:?}"),
    }
    assert!(store
        .accept(&key("new"), b"payload")
        .await
        .expect("accept")
        .is_new());
    let taken = store
        .take("my", 10, Duration::from_secs(30))
        .await
        .expect("take");
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].payload, b"payload");
}

/// Parked rows of `table`: waiting items out of the take's range.
async fn parked(pool: &MySqlPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{table}` WHERE wait = 1 AND due_at IS NULL"
    )))
    .fetch_one(pool)
    .await
    .expect("count parked")
}

/// Items their ordering key holds back are read once (I15): the take that
/// meets a burst of them parks them, out of the take's range, and hands
/// out the free item behind them; the next takes read none of them; an item
/// done, dead and skipped, or forgotten makes only the next one due again.
/// Read from the table: fails when a take scans past held-back items
/// instead of parking them, or when a completion leaves the next one parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_items_are_parked_until_their_key_moves() {
    use dedupe_core::{AcceptOptions, Inbox, ORDER_SCAN};
    let (_server, url) = support::mysql_server();
    let table = support::unique_schema("park");
    let store = store_on(&url, &table, Duration::from_secs(5)).await;
    let pool = MySqlPool::connect(&url).await.expect("pool");
    let lease = Duration::from_secs(60);
    let ordered = AcceptOptions::new()
        .ordering_key("cus_1")
        .when_dead(dedupe_core::WhenDead::Skip);
    store
        .accept_with(&key("first"), b"{}", &ordered)
        .await
        .expect("accept");
    let first = store.take("my", 1, lease).await.expect("take");
    assert_eq!(first.len(), 1);
    let behind = 3 * i64::try_from(ORDER_SCAN).expect("small");
    for i in 0..behind {
        store
            .accept_with(&key(&format!("behind-{i:04}")), b"{}", &ordered)
            .await
            .expect("accept");
    }
    store.accept(&key("free"), b"{}").await.expect("accept");
    let taken = store.take("my", 1, lease).await.expect("take");
    assert_eq!(taken.len(), 1, "the free item behind the burst");
    assert_eq!(taken[0].lease.key.id(), "free");
    assert_eq!(parked(&pool, &table).await, behind);
    assert!(store.take("my", 4, lease).await.expect("take").is_empty());

    store
        .complete(&first[0].lease, b"", Duration::from_secs(60))
        .await
        .expect("complete");
    assert_eq!(parked(&pool, &table).await, behind - 1);
    let next = store.take("my", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1, "one item of the key at a time");
    assert_eq!(next[0].lease.key.id(), "behind-0000");
    store
        .fail(&next[0].lease, "gone", dedupe_core::Retry::dead())
        .await
        .expect("fail");
    assert_eq!(parked(&pool, &table).await, behind - 2);
    assert!(store.forget(&key("behind-0001")).await.expect("forget"));
    assert_eq!(parked(&pool, &table).await, behind - 3);
    let next = store.take("my", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].lease.key.id(), "behind-0002");
}
