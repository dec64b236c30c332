//! Postgres-specific behaviour on a real server: the transactional example, a
//! server restart, killed connections, statement timeouts, bad names, and a race
//! across OS processes. The transactional claim's checks shared with MySQL
//! (rollback, a killed connection mid-transaction, concurrent transactions, a
//! lost claim holding no lock) are in `dedupe-sqlx/tests/transactional.rs`.

use dedupe_testkit as support;
use sqlx::AssertSqlSafe;

#[path = "../examples/transactional_orders.rs"]
#[allow(dead_code)]
mod example;

use std::sync::Arc;
use std::time::Duration;

use dedupe_conformance::processes::{race_across_processes, run_race_child};
use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key};
use dedupe_postgres::sqlx::{self, PgPool};
use dedupe_postgres::PgStore;
use example::Delivery;

fn key(id: &str) -> Key {
    Key::new("pg", id).expect("valid key")
}

async fn store_on(url: &str, schema: &str, timeout: Duration) -> PgStore {
    let pool = PgStore::connect_pool(url, 8, timeout).await.expect("pool");
    let store = PgStore::builder(pool)
        .schema(schema)
        .timeout(timeout)
        .keep_connections(4)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store
}

/// A pool whose connections use `schema` first, for the example's orders table.
async fn pool_in(url: &str, schema: &str) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(
            options
                .options([("search_path", schema)])
                .application_name(schema),
        )
        .await
        .expect("pool")
}

async fn orders(pool: &PgPool, event: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE event_id = $1")
        .bind(event)
        .fetch_one(pool)
        .await
        .expect("count orders")
}

async fn example_store(url: &str) -> (PgStore, PgPool) {
    let schema = support::unique_schema("orders");
    let pool = pool_in(url, &schema).await;
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&pool)
        .await
        .expect("schema");
    let store = PgStore::builder(pool.clone())
        .schema(&schema)
        .build()
        .expect("store");
    example::setup(&store).await.expect("setup");
    (store, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_claim_commits_with_the_order() {
    let (_server, url) = support::postgres_server();
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

/// The server stops: operations fail with retryable errors, bounded in time; it
/// comes back: the same store works again without being rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_is_retryable_and_recovered() {
    let cluster = support::PgCluster::start();
    let url = cluster.url("postgres");
    let store = store_on(
        &url,
        &support::unique_schema("restart"),
        Duration::from_secs(2),
    )
    .await;
    let before = store
        .claim(&key("before"), &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    cluster.stop();
    let started = std::time::Instant::now();
    match store.claim(&key("during"), &ClaimOptions::default()).await {
        Err(e) => assert!(
            e.is_retryable(),
            "a stopped server gave a non-retryable error: {e}"
        ),
        Ok(answer) => panic!("a stopped server answered {answer:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the failure was not bounded"
    );
    cluster.restart();
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
    // Data written before the stop survived (fsync on, clean restart).
    assert!(matches!(
        store.claim(&key("before"), &ClaimOptions::default()).await,
        Ok(ClaimOutcome::InFlight { .. })
    ));
    store
        .complete(&before, b"done", Duration::from_secs(60))
        .await
        .expect("the old lease still holds");
}

/// Every backend connection is killed under the store; the next calls succeed or
/// fail retryably, and the store carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_are_retryable_and_recovered() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("kill");
    // The store's own connections carry the schema as application name, so only
    // they are killed (other tests may share the server).
    let store = PgStore::builder(pool_in(&url, &schema).await)
        .schema(&schema)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    let warm = store
        .claim(&key("warm"), &ClaimOptions::default())
        .await
        .expect("claim");
    assert!(warm.lease().is_some());
    let admin = PgPool::connect(&url).await.expect("admin pool");
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&schema)
    .fetch_all(&admin)
    .await
    .expect("kill");
    assert!(!killed.is_empty());
    for i in 0..5 {
        match store
            .claim(&key(&format!("after-kill-{i}")), &ClaimOptions::default())
            .await
        {
            Ok(answer) => assert!(answer.lease().is_some()),
            Err(e) => assert!(
                e.is_retryable(),
                "a killed connection gave a non-retryable error: {e}"
            ),
        }
    }
    let recovered = support::eventually(Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            store
                .claim(&key("final"), &ClaimOptions::default())
                .await
                .is_ok()
        }
    })
    .await;
    assert!(recovered);
}

/// A statement stuck behind another transaction's row lock is cancelled at the
/// timeout: a retryable Timeout, and nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_is_retryable_and_changes_nothing() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("timeout");
    let store = store_on(&url, &schema, Duration::from_millis(300)).await;
    let k = key("locked");
    let lease = store
        .claim(&k, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("won");
    let admin = PgPool::connect(&url).await.expect("admin pool");
    let mut blocker = admin.begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM \"{schema}\".dedupe_records WHERE key = 'pg:locked' FOR UPDATE"
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
            // Cancelled by the server's statement_timeout, not abandoned by the client.
            assert!(std::error::Error::source(&e).is_some(), "{e}");
        }
        other => panic!("a statement stuck on a lock answered {other:?}"),
    }
    blocker.rollback().await.expect("unlock");
    let record = store.get(&k).await.expect("get").expect("record");
    assert!(
        matches!(record.state, dedupe_core::RecordState::InFlight { .. }),
        "the timed-out complete took effect"
    );
    store
        .complete(&lease, b"unblocked", Duration::from_secs(60))
        .await
        .expect("complete after the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_and_table_names_must_be_plain_identifiers() {
    let (_server, url) = support::postgres_server();
    let pool = PgPool::connect(&url).await.expect("pool");
    for (schema, table) in [
        ("public", "x; DROP TABLE y"),
        ("a\"b", "t"),
        ("", "t"),
        ("s", "1t"),
        ("s", "dédupe"),
    ] {
        match PgStore::builder(pool.clone())
            .schema(schema)
            .table(table)
            .build()
        {
            Err(Error::InvalidConfig { reason }) => {
                assert!(reason.contains("plain identifier"), "{reason}")
            }
            other => panic!("{schema:?}.{table:?} answered {other:?}"),
        }
    }
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename = 'y' OR tablename LIKE 'x;%'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(n, 0);
    match PgStore::connect("not a url").await {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("a bad URL answered {other:?}"),
    }
    // statement_timeout is whole milliseconds and 0 turns it off: a timeout
    // under 1 ms is refused, not rounded to "no timeout".
    for timeout in [Duration::ZERO, Duration::from_micros(999)] {
        match PgStore::builder(pool.clone()).timeout(timeout).build() {
            Err(Error::InvalidConfig { reason }) => assert!(reason.contains("1 ms"), "{reason}"),
            other => panic!("timeout {timeout:?} answered {other:?}"),
        }
        match PgStore::connect_pool(&url, 1, timeout).await {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("connect_pool with {timeout:?} answered {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_rows_are_reported_not_guessed() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("corrupt");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let far = "now() + interval '1 day'";
    let t = format!("\"{schema}\".dedupe_records");
    for (id, values) in [
        ("done-no-outcome", format!("('pg:done-no-outcome', 1, 't', NULL, NULL, {far}, now(), NULL, 1, now())")),
        ("zero-attempts", format!("('pg:zero-attempts', 0, 't', NULL, NULL, {far}, NULL, NULL, 0, now())")),
        ("unknown-state", format!("('pg:unknown-state', 7, 't', NULL, NULL, {far}, NULL, NULL, 1, now())")),
        ("huge-fingerprint", format!("('pg:huge-fingerprint', 0, 't', NULL, decode(repeat('00', 100), 'hex'), {far}, NULL, NULL, 1, now())")),
    ] {
        sqlx::raw_sql(AssertSqlSafe(format!("INSERT INTO {t} VALUES {values}"))).execute(store.pool()).await.expect("plant");
        match store.claim(&key(id), &ClaimOptions::default()).await {
            Err(Error::CorruptRecord { .. }) => {}
            other => panic!("claim of corrupt row {id} answered {other:?}"),
        }
        assert!(matches!(store.get(&key(id)).await, Err(Error::CorruptRecord { .. })));
    }
}

/// A batch meeting a corrupt record fails and changes nothing, with a claim id
/// and without: its new keys get no row, the expired lease it would have taken
/// over keeps its holder's token and attempt, a key held by another lease and a
/// done key stay exactly as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_meeting_a_corrupt_record_writes_nothing() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("badbatch");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let t = format!("\"{schema}\".dedupe_records");
    let raw = |sql: String| {
        let pool = store.pool().clone();
        async move {
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .expect("raw statement");
        }
    };
    let row_of = |id: String| {
        let (pool, t) = (store.pool().clone(), t.clone());
        async move {
            sqlx::query_as::<_, (String, i32)>(AssertSqlSafe(format!(
                "SELECT token, attempts FROM {t} WHERE key = $1"
            )))
            .bind(format!("pg:{id}"))
            .fetch_optional(&pool)
            .await
            .expect("read row")
        }
    };
    raw(format!(
        "INSERT INTO {t} VALUES ('pg:bad', 7, 't', NULL, NULL, now() + interval '1 day', NULL, NULL, 1, now())"
    ))
    .await;
    let plain = ClaimOptions::default();
    let with_id =
        ClaimOptions::default().with_claim_id(dedupe_core::ClaimId::new("batch-1").expect("id"));
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
        raw(format!(
            "INSERT INTO {t} VALUES ('pg:{}', 0, 'old', NULL, NULL, now() - interval '1 second', NULL, NULL, 2, now() - interval '1 hour')",
            name("expired")
        ))
        .await;
        // The new keys sort before and after the corrupt one, so the
        // statement would have written one of them before it met it.
        let batch = [
            key(&name("a-new")),
            key(&name("held")),
            key(&name("expired")),
            key(&name("done")),
            key("bad"),
            key(&name("z-new")),
        ];
        match store.claim_many(&batch, opts).await {
            Err(Error::CorruptRecord { key, .. }) => assert_eq!(key, "pg:bad"),
            other => panic!("a batch with a corrupt record answered {other:?} ({case})"),
        }
        for new in ["a-new", "z-new"] {
            assert_eq!(row_of(name(new)).await, None, "{new} was written ({case})");
        }
        assert_eq!(
            row_of(name("expired")).await,
            Some(("old".to_string(), 2)),
            "the expired lease was taken over ({case})"
        );
        assert_eq!(
            row_of(name("held")).await,
            Some((held.token.as_str().to_string(), 1)),
            "another holder's lease was touched ({case})"
        );
        assert!(matches!(
            store.claim(&key(&name("done")), &plain).await.expect("claim"),
            ClaimOutcome::Duplicate { outcome, .. } if outcome == b"kept"
        ));
    }
}

/// Waits until some statement on the server waits for a lock.
async fn until_a_statement_waits(pool: &PgPool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted)")
                .fetch_one(pool)
                .await
                .expect("read pg_locks");
        if waiting {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no statement came to wait"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A record committed after a claim statement took its snapshot is met only
/// by the statement's insert (its read could not see it): the claim and the
/// batch answer it from there in the same statement, InFlight for a live
/// lease and CorruptRecord for a record that does not decode. A batch that
/// meets such a corrupt record has written nothing, not even a new key it
/// inserted before it (the statement fails whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_committed_under_a_claim_is_answered_by_its_statement() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("under");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let t = format!("\"{schema}\".dedupe_records");
    let opts = ClaimOptions::default();
    for (state, batch) in [(0, false), (0, true), (7, false), (7, true)] {
        let id = format!("under-{state}-{batch}");
        let first = key(&format!("a-{id}"));
        let mut tx = store.pool().begin().await.expect("begin");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} VALUES ('pg:{id}', {state}, 'theirs', NULL, NULL, now() + interval '1 day', NULL, NULL, 3, now())"
        )))
        .execute(&mut *tx)
        .await
        .expect("insert under the claim");
        let claiming = tokio::spawn({
            let (store, opts, first, under) =
                (store.clone(), opts.clone(), first.clone(), key(&id));
            async move {
                if batch {
                    let mut answers = store.claim_many(&[first, under], &opts).await?;
                    assert!(answers[0].lease().is_some(), "the new key was not won");
                    Ok(answers.pop().expect("two answers"))
                } else {
                    store.claim(&under, &opts).await
                }
            }
        });
        until_a_statement_waits(store.pool()).await;
        tx.commit().await.expect("commit");
        let answer = claiming.await.expect("claim task");
        match (state, &answer) {
            (0, Ok(ClaimOutcome::InFlight { attempt: 3, .. })) => {}
            (7, Err(Error::CorruptRecord { key, .. })) if *key == format!("pg:{id}") => {}
            _ => panic!(
                "a record committed under the claim ({state}, batch {batch}) answered {answer:?}"
            ),
        }
        if batch {
            let won = store.get(&first).await.expect("get");
            assert_eq!(
                won.is_some(),
                state == 0,
                "the batch's new key after its answer {answer:?}: {won:?}"
            );
        }
    }
}

/// Two OS processes, sixteen connections each, race on the same 100 keys: each key
/// is Claimed exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_winner_across_processes() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("procs");
    store_on(&url, &schema, Duration::from_secs(5)).await;
    let env = [
        ("DEDUPE_CHILD_URL", url.clone()),
        ("DEDUPE_CHILD_SCHEMA", schema),
    ];
    tokio::task::spawn_blocking(move || race_across_processes("child_racer", 2, 16, 100, &env))
        .await
        .expect("race")
        .unwrap_or_else(|failure| panic!("{failure}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by single_winner_across_processes in a child process"]
async fn child_racer() {
    let url = std::env::var("DEDUPE_CHILD_URL").expect("child job");
    let schema = std::env::var("DEDUPE_CHILD_SCHEMA").expect("schema");
    let mut handles: Vec<Arc<dyn DedupeStore>> = Vec::new();
    for _ in 0..16 {
        let pool = PgStore::connect_pool(&url, 1, Duration::from_secs(20))
            .await
            .expect("pool");
        handles.push(Arc::new(
            PgStore::builder(pool)
                .schema(&schema)
                .timeout(Duration::from_secs(20))
                .build()
                .expect("store"),
        ));
    }
    run_race_child(handles).await;
}

/// A large purge walks the table in steps and skips rows another transaction
/// holds: it removes every other expired row, never waits, and leaves live rows
/// alone. 30,000 records span several steps of pages, and each step holds more
/// expired rows than one statement deletes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expire_purges_in_batches_and_skips_locked_rows() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("purge");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let t = format!("\"{schema}\".dedupe_records");
    // 29,970 expired records with a live one after every 999 of them.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {t}
         SELECT 'pg:' || CASE WHEN g % 1000 = 0 THEN 'live-' || (g / 1000) ELSE 'old-' || g END,
                1, 't', NULL, NULL,
                CASE WHEN g % 1000 = 0 THEN now() + interval '1 hour' ELSE now() - interval '1 hour' END,
                now(), ''::bytea, 1, now()
         FROM generate_series(1, 30000) g;"
    )))
    .execute(store.pool())
    .await
    .expect("plant rows");
    let admin = PgPool::connect(&url).await.expect("admin pool");
    let mut holder = admin.begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {t} WHERE key = 'pg:old-7' FOR UPDATE"
    )))
    .execute(&mut *holder)
    .await
    .expect("hold one expired row");
    let pages: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_relation_size('{t}') / 8192"
    )))
    .fetch_one(store.pool())
    .await
    .expect("table size");
    assert!(
        pages > 256,
        "the table should span several purge steps: {pages} pages"
    );
    let removed = store.expire().await.expect("expire");
    assert_eq!(
        removed, 29_969,
        "expire() should skip the held row and remove the rest"
    );
    holder.rollback().await.expect("release the row");
    let left: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT key FROM {t} WHERE key LIKE 'pg:old-%'"
    )))
    .fetch_all(store.pool())
    .await
    .expect("left");
    assert_eq!(left, vec!["pg:old-7".to_string()]);
    assert_eq!(store.expire().await.expect("expire again"), 1);
    for i in 1..=30 {
        assert!(store
            .get(&key(&format!("live-{i}")))
            .await
            .expect("get")
            .is_some());
    }
}

/// A table made by `migrate` compares keys byte by byte and has no index a
/// record's claim or completion writes but the primary key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_makes_a_table_with_byte_order_keys_and_one_index() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("shape");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let collations: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT collation_name::text FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'dedupe_records'
           AND column_name IN ('key', 'namespace', 'id') ORDER BY column_name",
    )
    .bind(&schema)
    .fetch_all(store.pool())
    .await
    .expect("collations");
    assert_eq!(
        collations,
        vec![Some("C".to_string())],
        "one key column, compared byte by byte"
    );
    let mut indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes
         WHERE schemaname = $1 AND tablename = 'dedupe_records' ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(store.pool())
    .await
    .expect("indexes");
    // Besides the primary key, only the inbox's partial indexes, which hold
    // no record and cover no column a claim or a completion changes.
    let (due, def) = indexes.remove(0);
    assert_eq!(due, "dedupe_records_due");
    assert!(def.contains("WHERE (due_at IS NOT NULL)"), "{def}");
    assert!(
        !def.contains("expires_at") && !def.contains("state"),
        "{def}"
    );
    let (order, def) = indexes.remove(0);
    assert_eq!(order, "dedupe_records_order");
    assert!(
        def.contains("WHERE ((order_key IS NOT NULL) AND (wait IS NOT NULL))"),
        "{def}"
    );
    assert!(
        !def.contains("expires_at") && !def.contains("state"),
        "{def}"
    );
    let names: Vec<String> = indexes.into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["dedupe_records_pkey".to_string()]);
}

/// Batches over the same keys in different orders, racing: every key is Claimed
/// exactly once overall, and no batch deadlocks or fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_batches_in_any_order_claim_each_key_once() {
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("batches");
    store_on(&url, &schema, Duration::from_secs(10)).await;
    let keys: Vec<Key> = (0..200).map(|i| key(&format!("batch-{i:03}"))).collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for racer in 0..8usize {
        let store = store_on(&url, &schema, Duration::from_secs(10)).await;
        let mut mine = keys.clone();
        // Each racer walks the keys in its own order: rotated, every other one reversed.
        mine.rotate_left(racer * 25);
        if racer % 2 == 1 {
            mine.reverse();
        }
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let answers = store.claim_many(&mine, &ClaimOptions::default()).await;
            (mine, answers)
        }));
    }
    let mut wins = std::collections::HashMap::new();
    for task in tasks {
        let (mine, answers) = task.await.expect("racer");
        let answers = answers.expect("a racing batch failed");
        for (k, answer) in mine.iter().zip(answers) {
            match answer {
                ClaimOutcome::Claimed(_) => *wins.entry(k.clone()).or_insert(0) += 1,
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("{k} answered {other:?}"),
            }
        }
    }
    for k in &keys {
        assert_eq!(
            wins.get(k),
            Some(&1),
            "{k} was Claimed {:?} times",
            wins.get(k)
        );
    }
}

/// The transaction id the current transaction holds, if any: one is taken by the
/// first write or row lock, never by a read.
async fn xid_taken(conn: &mut sqlx::PgConnection) -> bool {
    sqlx::query_scalar::<_, Option<String>>("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(&mut *conn)
        .await
        .expect("xid")
        .is_some()
}

async fn wal_position(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(pool)
        .await
        .expect("wal position")
}

/// A duplicate or in-flight claim is a read: it takes no transaction id (so no row
/// lock, no WAL, no commit flush), and on a quiet private cluster the WAL position
/// does not move across a batch of them. A takeover of an expired record still
/// happens in the same single statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_duplicates_write_nothing() {
    let (server, url) = support::postgres_server();
    let schema = support::unique_schema("nowrite");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let opts = ClaimOptions::default();
    let keys: Vec<Key> = (0..40).map(|i| key(&format!("k{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        let lease = store.claim(k, &opts).await.expect("claim").lease().cloned();
        let lease = lease.expect("a new key is won");
        if i.is_multiple_of(2) {
            store
                .complete(&lease, b"outcome", Duration::from_secs(600))
                .await
                .expect("complete");
        }
    }
    let is_live_loser = |answer: &ClaimOutcome, i: usize| match answer {
        ClaimOutcome::Duplicate { outcome, .. } => {
            i.is_multiple_of(2) && outcome.as_slice() == b"outcome"
        }
        ClaimOutcome::InFlight { .. } => !i.is_multiple_of(2),
        _ => false,
    };

    // Inside one transaction, so the server itself says whether any of them wrote.
    let mut tx = store.pool().begin().await.expect("begin");
    for (i, k) in keys.iter().enumerate() {
        let answer = store.claim_in(&mut tx, k, &opts).await.expect("claim_in");
        assert!(is_live_loser(&answer, i), "key {i} answered {answer:?}");
    }
    let batch = store.claim_many(&keys, &opts).await.expect("claim_many");
    for (i, answer) in batch.iter().enumerate() {
        assert!(
            is_live_loser(answer, i),
            "batch key {i} answered {answer:?}"
        );
    }
    assert!(
        !xid_taken(&mut tx).await,
        "a duplicate claim took a transaction id: it wrote or locked a row"
    );
    tx.rollback().await.expect("rollback");

    if server.is_some() {
        // A private cluster is quiet once autovacuum is off: nothing else writes.
        for statement in [
            "ALTER SYSTEM SET autovacuum = off",
            "SELECT pg_reload_conf()",
        ] {
            sqlx::raw_sql(statement)
                .execute(store.pool())
                .await
                .expect("autovacuum off");
        }
        // Each round claims through a handle of its own: a new handle expects
        // new keys, so its first claims try the bare insert first (which must
        // leave a live row unwritten too), and once it has met records it
        // reads first.
        let handles: Vec<PgStore> = (0..5)
            .map(|_| {
                PgStore::builder(store.pool().clone())
                    .schema(&schema)
                    .timeout(Duration::from_secs(5))
                    .build()
                    .expect("store")
            })
            .collect();
        let before = wal_position(store.pool()).await;
        for handle in &handles {
            let batch = handle.claim_many(&keys, &opts).await.expect("claim_many");
            for (i, answer) in batch.iter().enumerate() {
                assert!(
                    is_live_loser(answer, i),
                    "batch key {i} answered {answer:?}"
                );
            }
            for (i, k) in keys.iter().enumerate() {
                let answer = handle.claim(k, &opts).await.expect("claim");
                assert!(is_live_loser(&answer, i), "key {i} answered {answer:?}");
            }
        }
        let after = wal_position(store.pool()).await;
        assert_eq!(before, after, "duplicate claims moved the WAL");
    }

    // An expired lease is still taken over, in the one statement: it writes.
    let short = ClaimOptions::new(Duration::from_millis(300));
    let first = store.claim(&key("short"), &short).await.expect("claim");
    assert!(first.lease().is_some());
    let taken = support::eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let short = short.clone();
        async move {
            let mut tx = store.pool().begin().await.expect("begin");
            let answer = store.claim_in(&mut tx, &key("short"), &short).await;
            let won = matches!(&answer, Ok(ClaimOutcome::Claimed(lease)) if lease.attempt == 2);
            let wrote = xid_taken(&mut tx).await;
            tx.commit().await.expect("commit");
            assert!(!won || wrote, "a takeover that wrote nothing");
            won
        }
    })
    .await;
    assert!(taken, "the expired lease was not taken over");
}

/// Eight workers claim, complete and release through a loopback proxy that
/// cuts every connection every 150 ms for 2.5 s; every answer is recorded and
/// the whole history is checked against the contract (one live holder, no
/// stale completion, one outcome per key). Every failure is a retryable error,
/// and once the proxy heals the same store answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_under_load_keep_the_history_valid() {
    use support::faults::{cut_repeatedly, FaultRun};
    let (_server, url) = support::postgres_server();
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
    // Healed: the same store object answers again.
    let after = store
        .claim(&key("after-the-cuts"), &ClaimOptions::default())
        .await
        .expect("the store works again");
    assert!(after.lease().is_some());
}

/// The bound on any one call in the fault runs below: the store's timeout, the
/// client's backstop past it, and room for a loaded two-core machine.
fn fault_bound(timeout: Duration) -> Duration {
    timeout + PgStore::BACKSTOP + Duration::from_millis(1500)
}

/// The server is killed with SIGKILL (postmaster and backends, no checkpoint)
/// under eight recorded workers, then started again (crash recovery from the
/// WAL, fsync on): every error typed and retryable within the bound, the same
/// store object works again, the history valid, and every completion
/// acknowledged before the kill is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_server_under_load_loses_nothing() {
    use support::faults::FaultRun;
    let cluster = support::PgCluster::start();
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn DedupeStore> = Arc::new(
        store_on(
            &cluster.url("postgres"),
            &support::unique_schema("crash"),
            timeout,
        )
        .await,
    );
    let run = FaultRun::start(Arc::clone(&store)).await;
    tokio::task::block_in_place(|| {
        cluster.kill();
        // Down for a moment while the load goes on, then crash recovery.
        std::thread::sleep(Duration::from_millis(300));
        cluster.restart();
    });
    let verdict = run.finish().await;
    verdict.assert_sound(fault_bound(timeout));
    verdict.assert_nothing_lost(store).await;
}

/// Through a proxy, the network first swallows every byte (blackhole), then
/// holds every byte and delivers it late (stall), each for longer than the
/// timeout, under eight recorded workers: calls end in retryable timeouts
/// within the bound instead of hanging, connections left out of step are not
/// reused for a wrong answer, and the history stays valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackholed_and_stalled_connections_time_out_and_recover() {
    use support::faults::FaultRun;
    let (_server, url) = support::postgres_server();
    let (proxy, via) = support::proxied(&url).await.expect("proxy");
    let timeout = Duration::from_millis(800);
    let store: Arc<dyn DedupeStore> =
        Arc::new(store_on(&via, &support::unique_schema("hole"), timeout).await);
    let run = FaultRun::start(Arc::clone(&store)).await;
    dedupe_testkit::faults::blackhole_then_stall(&proxy, Duration::from_millis(2500)).await;
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

/// The server runs a claim and the connection dies before the client reads the
/// answer: a retryable error, and the retry with the same claim id is Claimed.
/// One connection in the pool, so the claim runs on the warmed connection
/// (a new one would lose its handshake's answer, not the claim's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_answer_is_reclaimed_by_its_claim_id() {
    let (_server, url) = support::postgres_server();
    let (proxy, via) = support::proxied(&url).await.expect("proxy");
    let timeout = Duration::from_secs(1);
    let pool = PgStore::connect_pool(&via, 1, timeout).await.expect("pool");
    let store = PgStore::builder(pool)
        .schema(support::unique_schema("lost"))
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
        let (server, url) = support::postgres_server();
        let schema = support::unique_schema("crashes");
        tokio::runtime::Runtime::new()
            .expect("runtime")
            .block_on(store_on(&url, &schema, Duration::from_secs(5)));
        let env = vec![("DEDUPE_CHILD_URL", url), ("DEDUPE_CHILD_SCHEMA", schema)];
        (server, env)
    },
    worker: || async {
        let url = std::env::var("DEDUPE_CHILD_URL").expect("child job");
        let schema = std::env::var("DEDUPE_CHILD_SCHEMA").expect("schema");
        let pool = PgStore::connect_pool(&url, 2, Duration::from_secs(5))
            .await
            .expect("pool");
        let store = PgStore::builder(pool).schema(&schema).build().expect("store");
        Arc::new(store) as Arc<dyn DedupeStore>
    },
    inbox_worker: || async {
        let url = std::env::var("DEDUPE_CHILD_URL").expect("child job");
        let schema = std::env::var("DEDUPE_CHILD_SCHEMA").expect("schema");
        let pool = PgStore::connect_pool(&url, 2, Duration::from_secs(5))
            .await
            .expect("pool");
        let store = PgStore::builder(pool).schema(&schema).build().expect("store");
        Arc::new(store) as Arc<dyn dedupe_core::Inbox>
    },
    ordering_keys: true,
}

/// A table made by the first migration alone (before the inbox) is brought up
/// to date by `migrate`: the records in it answer as before, and the inbox
/// works on it; migrating again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_from_before_the_inbox_is_migrated() {
    use dedupe_core::Inbox;
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("pre_inbox");
    let pool = PgStore::connect_pool(&url, 2, Duration::from_secs(5))
        .await
        .expect("pool");
    let first = include_str!("../migrations/0001_records.sql")
        .replace("{schema}", &schema)
        .replace("{table}", "dedupe_records");
    sqlx::raw_sql(sqlx::AssertSqlSafe(first))
        .execute(&pool)
        .await
        .expect("the first migration");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".dedupe_records VALUES
         ('pg:old', 1, 't', NULL, NULL, now() + interval '1 day', now(), 'old', 1, now())"
    )))
    .execute(&pool)
    .await
    .expect("an old record");
    let store = PgStore::builder(pool)
        .schema(&schema)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
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
        .take("pg", 10, Duration::from_secs(30))
        .await
        .expect("take");
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].payload, b"payload");
}

/// Accepts that stream in are each announced: ten accepts started together
/// leave at least one notification that reaches a listener after they all
/// committed, and never more than one each. How few they share depends on
/// how close together they commit, which a loaded machine decides (a gate
/// saw all ten 2 ms apart): the sharing itself is tested on tokio's paused
/// clock in `wake.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_together_are_each_announced_never_twice() {
    use dedupe_core::Inbox;
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("notices");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let mut listener = sqlx::postgres::PgListener::connect(&url)
        .await
        .expect("listener");
    listener.listen("dedupe_wake").await.expect("listen");
    let ours = format!("{schema}.dedupe_records|pg");
    let accepts = (0..10).map(|i| {
        let store = store.clone();
        async move { store.accept(&key(&format!("together-{i}")), b"{}").await }
    });
    for accepted in futures_util::future::join_all(accepts).await {
        assert!(accepted.expect("accept").is_new());
    }
    let mut notes = 0;
    while let Ok(Ok(note)) = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await
    {
        if note.payload() == ours {
            notes += 1;
        }
    }
    assert!(
        (1..=10).contains(&notes),
        "ten accepts together sent {notes} notifications"
    );
}

/// Push wake-ups outlive their connection: with the `LISTEN` connection
/// killed by the server, the store connects and listens again, and
/// accepts made through another pool wake the workers as before. Three
/// rounds after the kill, so the one wake-up a reconnection raises on its
/// own cannot pass for them (the test fails when the store does not
/// listen again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_ups_come_back_after_the_listener_is_killed() {
    use dedupe_core::Inbox;
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("wake");
    // The listening store's connections carry the schema as application
    // name, so only its listener is killed.
    let listening = PgStore::builder(pool_in(&url, &schema).await)
        .schema(&schema)
        .build()
        .expect("store");
    listening.migrate().await.expect("migrate");
    let accepting = store_on(&url, &schema, Duration::from_secs(5)).await;
    let wake = listening.wake("pg").await.expect("wake");
    assert!(wake.everywhere, "Postgres pushes its wake-ups");
    let signal = wake.signal.expect("a signal");
    assert!(
        dedupe_testkit::wakes(
            &signal,
            Duration::from_secs(5),
            accepting.accept(&key("before"), b"{}")
        )
        .await,
        "another pool's accept did not wake the listening store"
    );
    let admin = PgPool::connect(&url).await.expect("admin pool");
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&schema)
    .fetch_all(&admin)
    .await
    .expect("kill");
    assert_eq!(killed, vec![true], "one listener to kill");
    let listening_again = support::eventually(Duration::from_secs(20), || {
        let (admin, schema) = (admin.clone(), schema.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 AND query LIKE 'LISTEN%'",
            )
            .bind(&schema)
            .fetch_one(&admin)
            .await
            .is_ok_and(|n| n == 1)
        }
    })
    .await;
    assert!(listening_again, "the store did not listen again");
    for round in 0..3 {
        assert!(
            dedupe_testkit::wakes(
                &signal,
                Duration::from_secs(5),
                accepting.accept(&key(&format!("after-{round}")), b"{}")
            )
            .await,
            "round {round}: an accept after the kill did not wake the listening store"
        );
    }
}

/// Parked rows of the test's table: waiting items out of the take's index.
async fn parked(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dedupe_records WHERE wait = 1 AND due_at IS NULL")
        .fetch_one(pool)
        .await
        .expect("count parked")
}

/// Items their ordering key holds back are read once (I15): the take that
/// meets a burst of them parks them, out of the take's index, and hands out
/// the free item behind them; the next takes read none of them; completing
/// the item that holds the key makes only the next one due again. Read
/// from the table: fails when a take scans past held-back items instead of
/// parking them, or when a completion leaves the next one parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_items_are_parked_until_their_key_moves() {
    use dedupe_core::{AcceptOptions, Inbox, ORDER_SCAN};
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("park");
    let store = store_on(&url, &schema, Duration::from_secs(5)).await;
    let pool = pool_in(&url, &schema).await;
    let lease = Duration::from_secs(60);
    let ordered = AcceptOptions::new().ordering_key("cus_1");
    store
        .accept_with(&key("first"), b"{}", &ordered)
        .await
        .expect("accept");
    let first = store.take("pg", 1, lease).await.expect("take");
    assert_eq!(first.len(), 1);
    let behind = 3 * i64::try_from(ORDER_SCAN).expect("small");
    for i in 0..behind {
        store
            .accept_with(&key(&format!("behind-{i:04}")), b"{}", &ordered)
            .await
            .expect("accept");
    }
    store.accept(&key("free"), b"{}").await.expect("accept");
    let taken = store.take("pg", 1, lease).await.expect("take");
    assert_eq!(taken.len(), 1, "the free item behind the burst");
    assert_eq!(taken[0].lease.key.id(), "free");
    assert_eq!(parked(&pool).await, behind);
    assert!(store.take("pg", 4, lease).await.expect("take").is_empty());

    store
        .complete(&first[0].lease, b"", Duration::from_secs(60))
        .await
        .expect("complete");
    assert_eq!(parked(&pool).await, behind - 1);
    let next = store.take("pg", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1, "one item of the key at a time");
    assert_eq!(next[0].lease.key.id(), "behind-0000");
    // Dead and skipped, forgotten: each moves the key on by one.
    store
        .fail(&next[0].lease, "gone", dedupe_core::Retry::dead())
        .await
        .expect("fail");
    assert_eq!(parked(&pool).await, behind - 1);
    assert!(store.forget(&key("behind-0000")).await.expect("forget"));
    assert_eq!(parked(&pool).await, behind - 2);
    let next = store.take("pg", 4, lease).await.expect("take");
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].lease.key.id(), "behind-0001");
}

/// Bulk replay and forget by filter over 10,000 dead items, two operators at
/// once (each on its own pool) beside a worker: every matching item replayed
/// and run exactly once, every forgotten one gone (see
/// `dedupe_conformance::bulk`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_replay_and_forget_by_filter() {
    use std::sync::Arc;
    let (_server, url) = support::postgres_server();
    let schema = support::unique_schema("bulk");
    let a = store_on(&url, &schema, Duration::from_secs(10)).await;
    let b = store_on(&url, &schema, Duration::from_secs(10)).await;
    let report = dedupe_conformance::bulk::bulk_by_filter(Arc::new(a), Arc::new(b), 10_000)
        .await
        .unwrap_or_else(|failure| panic!("{failure}"));
    eprintln!("{report}");
}
