//! Adversarial integration tests for `dedupe-postgres`, written from
//! `CONTRACT.md` and the store's source only (white-box), without reading the
//! crate's own tests or the conformance suite. Each test starts a private
//! cluster through `dedupe-testkit` (or uses `DEDUPE_TEST_POSTGRES_URL`).
//!
//! Every test records each call with its answer and call/return times
//! (`dedupe_testkit::rounds::Log`), and the suite's history checker
//! (`dedupe_conformance::history`) replays the contract over that history: one live winner per key,
//! stale holders fenced, duplicates answered with the exact bytes of the one
//! completion, no phantom or stale `InFlight`, `claim_many` agreeing with
//! `claim` whichever first statement (insert first / select first) a handle
//! picked. Each test says what it aims at.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedupe_conformance::checks::{cancellation_storm_on, deadline_edge_races_on, lease_rules_on};
use dedupe_conformance::history::{Answer, History, Recorder};
use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, RecordState};
use dedupe_postgres::sqlx::{self, AssertSqlSafe, Row};
use dedupe_postgres::PgStore;
use dedupe_testkit::rounds::*;
// ======================================================================
// Postgres-specific helpers
// ======================================================================

const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// Lease of the rounds whose winner lets it lapse.
const SHORT: Duration = Duration::from_millis(100);

/// A private cluster (kept alive by the guard) and its URL.
async fn server() -> (Option<dedupe_testkit::PgCluster>, String) {
    tokio::task::spawn_blocking(dedupe_testkit::postgres_server)
        .await
        .expect("start a private PostgreSQL cluster")
}

/// A store handle with a pool of its own (so its own `Seen` count, its own
/// held connections, its own connections).
async fn pg_handle(url: &str, schema: &str, conns: u32, hold: usize) -> PgStore {
    let pool = PgStore::connect_pool(url, conns, OP_TIMEOUT)
        .await
        .expect("connect a pool");
    PgStore::builder(pool)
        .schema(schema)
        .timeout(OP_TIMEOUT)
        .keep_connections(hold)
        .build()
        .expect("build a store")
}

/// `n` handles on one table.
async fn pg_handles(url: &str, schema: &str, n: usize) -> Vec<PgStore> {
    let first = pg_handle(url, schema, 6, 2).await;
    first.migrate().await.expect("migrate");
    let mut v = vec![first];
    for i in 1..n {
        v.push(pg_handle(url, schema, 4 + (i % 3) as u32, i % 3).await);
    }
    v
}

fn dyns(stores: &[PgStore]) -> Vec<Arc<dyn DedupeStore>> {
    stores
        .iter()
        .map(|s| Arc::new(s.clone()) as Arc<dyn DedupeStore>)
        .collect()
}

fn table(schema: &str) -> String {
    format!("\"{schema}\".\"dedupe_records\"")
}

/// How the table names a key bound as `$1` (namespace) and `$2` (id): one
/// `key` column, `namespace:id`.
struct KeySql {
    cols: &'static str,
    values: &'static str,
    is: &'static str,
}

async fn key_sql(_store: &PgStore, _schema: &str) -> KeySql {
    KeySql {
        cols: "key",
        values: "$1::text || ':' || $2::text",
        is: "key = $1::text || ':' || $2::text",
    }
}

/// A record that does not decode (done, without outcome or completion time;
/// allowed by every layout's constraints), live for an hour.
async fn plant_corrupt(store: &PgStore, schema: &str, ns: &str, id: &str) {
    let k = key_sql(store, schema).await;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} ({}, state, token, claim_id, fingerprint, expires_at,
                         completed_at, outcome, attempts, first_seen)
         VALUES ({}, 1, 'corrupt-token', NULL, NULL, now() + interval '1 hour', NULL, NULL, 1, now())",
        table(schema),
        k.cols,
        k.values
    )))
    .bind(ns.to_string())
    .bind(id.to_string())
    .execute(store.pool())
    .await
    .expect("plant a corrupt record");
}

/// (state, token, attempts, expires_at in µs) of a stored row, expired or not.
async fn raw_row(store: &PgStore, schema: &str, k: &Key) -> Option<(i16, String, i32, i64)> {
    let ks = key_sql(store, schema).await;
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT state, token, attempts, floor(extract(epoch FROM expires_at) * 1000000)::int8
         FROM {} WHERE {}",
        table(schema),
        ks.is
    )))
    .bind(k.namespace().to_string())
    .bind(k.id().to_string())
    .fetch_optional(store.pool())
    .await
    .expect("read a row");
    row.map(|r| {
        (
            r.try_get::<i16, _>(0).expect("state"),
            r.try_get::<String, _>(1).expect("token"),
            r.try_get::<i32, _>(2).expect("attempts"),
            r.try_get::<i64, _>(3).expect("expires_at"),
        )
    })
}

/// Pushes a handle's recent-claims count up (a storm of duplicates: it then
/// reads first) or down (new keys: it then inserts first).
async fn warm_handle(store: &PgStore, read_first: bool, done: &Key, tag: &str) {
    for i in 0..9 {
        if read_first {
            let _ = store.claim(done, &opts(LONG)).await;
        } else {
            let _ = store
                .claim(
                    &key("warm", format!("{tag}-{i}-{}", now_us())),
                    &opts(Duration::from_secs(1)),
                )
                .await;
        }
    }
}

async fn make_done(log: &Log, store: &PgStore, k: &Key, outcome: &[u8]) {
    match log.claim(store, "setup", k, &opts(LONG)).await {
        Ok(ClaimOutcome::Claimed(l)) => {
            log.complete(store, "setup", &l, outcome)
                .await
                .expect("setup complete");
        }
        other => panic!("setup claim of {k:?} answered {other:?}"),
    }
}

/// `claim_in` inside a transaction of the caller's own, committed at once.
async fn pg_claim_in(
    store: &PgStore,
    k: &Key,
    o: &ClaimOptions,
) -> dedupe_core::Result<ClaimOutcome> {
    let mut tx = store
        .pool()
        .begin()
        .await
        .map_err(|e| Error::retryable(format!("BEGIN: {e}"), None))?;
    let r = store.claim_in(&mut tx, k, o).await;
    match tx.commit().await {
        Ok(()) => r,
        Err(e) => Err(Error::retryable(format!("COMMIT: {e}"), None)),
    }
}

/// A racer's claim inside a transaction of its own.
fn pg_claim_in_tx(store: &PgStore) -> ClaimIn {
    let store = store.clone();
    Arc::new(move |k, o| {
        let store = store.clone();
        Box::pin(async move { pg_claim_in(&store, &k, &o).await })
    })
}

/// Flips a handle between its two first statements while the racers use it:
/// bursts of duplicates (push the count up: select first) alternating every
/// 120 ms with bursts of new keys (push it down: insert first), plus batches.
async fn seen_storm(log: Log, store: PgStore, id: usize, stop: Arc<AtomicBool>) {
    let who = format!("storm{id}");
    let done = key("noise", "done");
    let started = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let duplicates = (started.elapsed().as_millis() / 120).is_multiple_of(2);
        for _ in 0..6 {
            n += 1;
            if duplicates {
                let _ = log.claim(&store, &who, &done, &opts(LONG)).await;
            } else {
                let f = key("noise", format!("{who}-{n}"));
                if let Ok(ClaimOutcome::Claimed(l)) = log.claim(&store, &who, &f, &opts(LONG)).await
                {
                    if n.is_multiple_of(2) {
                        let out = format!("{who}-{n}").into_bytes();
                        let _ = log.complete(&store, &who, &l, &out).await;
                    } else {
                        let _ = log.release(&store, &who, &l).await;
                    }
                }
            }
        }
        let batch = [
            done.clone(),
            key("noise", format!("{who}-{n}-b")),
            done.clone(),
        ];
        let _ = log.claim_many(&store, &who, &batch, &opts(LONG)).await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

const STRICT: CheckOpts = CheckOpts {
    strict_inflight: true,
    distinct_attempts: true,
};

const LOOSE: CheckOpts = CheckOpts {
    strict_inflight: true,
    distinct_attempts: false,
};

// ======================================================================
// Tests
// ======================================================================

async fn race_rounds() {
    let (_cluster, url) = server().await;
    let schema = dedupe_testkit::unique_schema("advrace");
    let stores = pg_handles(&url, &schema, 6).await;
    let log = Log::default();
    let done = key("noise", "done");
    make_done(&log, &stores[0], &done, b"noise-done").await;
    for s in stores.iter().skip(1).step_by(2) {
        warm_handle(s, true, &done, "race").await;
    }
    const RACERS: usize = 12;
    let ctx = RaceCtx::new(RACERS, 60, &log, SHORT, Duration::from_millis(5));
    let stop = Arc::new(AtomicBool::new(false));
    let storms: Vec<_> = [0usize, 3, 4]
        .iter()
        .map(|&i| {
            tokio::spawn(seen_storm(
                log.clone(),
                stores[i].clone(),
                i,
                Arc::clone(&stop),
            ))
        })
        .collect();
    let tasks: Vec<_> = (0..RACERS)
        .map(|id| {
            let store = &stores[id % stores.len()];
            tokio::spawn(racer(
                Arc::clone(&ctx),
                id,
                store.clone(),
                pg_claim_in_tx(store),
            ))
        })
        .collect();
    let finished = tokio::time::timeout(Duration::from_secs(150), async {
        for t in tasks {
            t.await.expect("a racer panicked");
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for s in storms {
        let _ = s.await;
    }
    assert!(
        finished.is_ok(),
        "HANG: the racers did not finish 60 rounds within 150 s"
    );
    let what = "racing handles";
    assert_history(what, &log, STRICT);
    assert_no_errors(what, &log);
}

/// 12 racers on 6 handles (separate pools; half of them start reading
/// first, half inserting first, and three storms flip their handles between
/// the two every 120 ms), 60 rounds of: simultaneous claims of a fresh key by
/// seven paths (including `claim_in` in a transaction and `claim_many` with
/// repeats), the winner completing / releasing / letting a 100 ms lease lapse
/// / extending, a second wave (duplicate, fresh claim, or takeover), the
/// first holder's stale calls, a third wave of duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_racing_handles_keep_one_winner_while_claim_modes_flip() {
    race_rounds().await;
}

/// Rule 4, `extend`, claim ids, fingerprints and refused input, acting on a
/// handle that inserts first and watching from one that reads first, then
/// the other way round; then holder and takers aimed at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_rules_hold_in_both_claim_modes() {
    let (_cluster, url) = server().await;
    let schema = dedupe_testkit::unique_schema("advrules");
    let stores = pg_handles(&url, &schema, 6).await;
    let log = Log::default();
    let done = key("warm", "done");
    make_done(&log, &stores[0], &done, b"warm").await;
    for s in stores.iter().skip(1).step_by(2) {
        warm_handle(s, true, &done, "rules").await;
    }
    let st = dyns(&stores);
    let mut rotated = st[1..].to_vec();
    rotated.push(Arc::clone(&st[0]));
    let rounds = async {
        lease_rules_on(&st, "rules1").await?;
        lease_rules_on(&rotated, "rules2").await?;
        deadline_edge_races_on(&st, 40).await
    };
    if let Err(f) = rounds.await {
        panic!("{f}");
    }
}

/// Rule 8 for a batch, in both first-statement modes: a `claim_many` that
/// meets a corrupt record answers `CorruptRecord` and writes nothing. Its
/// batch also holds an in-flight record whose lease passed: after the failed
/// batch, that row must be as it was and the next claim must be attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_batch_failing_on_a_corrupt_record_writes_nothing() {
    let (_cluster, url) = server().await;
    let mut bad = Vec::new();
    writes_nothing_on(&url, &mut bad).await;
    assert!(
        bad.is_empty(),
        "{} violations:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
}

async fn writes_nothing_on(url: &str, bad: &mut Vec<String>) {
    let schema = dedupe_testkit::unique_schema("advnothing");
    let stores = pg_handles(url, &schema, 2).await;
    let log = Log::default();
    let done = key("warm", "done");
    make_done(&log, &stores[0], &done, b"warm").await;
    for (round, read_first) in [(0, false), (1, true), (2, false), (3, true)] {
        let mode = if read_first {
            "select first"
        } else {
            "insert first"
        };
        let batcher = pg_handle(url, &schema, 2, 0).await;
        if read_first {
            warm_handle(&batcher, true, &done, "nothing").await;
        }
        let ns = format!("gb{round}");
        let slow = key(&ns, "slow");
        let l = match stores[0]
            .claim(&slow, &opts(Duration::from_millis(60)))
            .await
        {
            Ok(ClaimOutcome::Claimed(l)) => l,
            other => panic!("a fresh claim answered {other:?}"),
        };
        sleep_until_us(us(l.deadline) + 30_000).await;
        let before = raw_row(&stores[0], &schema, &slow).await;
        plant_corrupt(&stores[0], &schema, &ns, "corrupt").await;
        let fresh: Vec<Key> = (0..3).map(|i| key(&ns, format!("fresh{i}"))).collect();
        let mut batch = vec![
            fresh[0].clone(),
            slow.clone(),
            fresh[1].clone(),
            key(&ns, "corrupt"),
            fresh[2].clone(),
        ];
        if round >= 2 {
            batch.rotate_left(3);
        }
        match batcher.claim_many(&batch, &opts(LONG)).await {
            Err(Error::CorruptRecord { .. }) => {}
            other => bad.push(format!(
                "[{mode}] a batch meeting a corrupt record answered {other:?}"
            )),
        }
        let after = raw_row(&stores[0], &schema, &slow).await;
        if before != after {
            bad.push(format!(
                "[{mode}] RULE 8 (nothing is written): a claim_many that failed on a corrupt record still rewrote {slow}: \
                 (state, token, attempts, expires_at µs) {before:?} -> {after:?}"
            ));
        }
        for f in &fresh {
            if let Some(row) = raw_row(&stores[0], &schema, f).await {
                bad.push(format!(
                    "[{mode}] {f}: a failed batch left a row behind: {row:?}"
                ));
            }
        }
        match stores[1].claim(&slow, &opts(LONG)).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 2 => {}
            other => bad.push(format!(
                "[{mode}] {slow}: after the failed batch, the takeover of the lapsed attempt-1 lease answered {other:?} \
                 (expected Claimed attempt 2: the failed batch must not count as a claim that won it)"
            )),
        }
    }
}

/// The window between `claim_many`'s bare batch insert (committed on its own)
/// and its second statement: the second statement is made to wait on a row
/// lock (an expired record of the batch, locked `FOR UPDATE` by another
/// transaction) until the batch handle's statement timeout cancels it, so the
/// batch fails after its first statement committed. Meanwhile observers claim
/// the batch's fresh keys; one of them carries the batch's claim id (the same
/// logical caller retrying) and works 1.5 s before completing. No lease
/// handed out from the batch may be given away while still live: the batch
/// once gave its keys back after a same-claim-id retry had been handed one of
/// them, and a third caller won the key while that one worked.
///
/// The store's answer since: a failed batch with a claim id gives nothing
/// back, and a batch with a claim id runs one statement (never the bare
/// insert first), so none of its keys is visible before that statement
/// commits, and a statement that fails leaves nothing. The test checks both:
/// the keys never show, and the history holds one winner per lease.
///
/// (The first version of this test failed the batch on a corrupt record; the
/// batch statement now writes nothing while a record it reads would not
/// decode, so it no longer waits on the lock, and the window closed too fast
/// to observe.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_failed_batch_is_never_seen_half_done() {
    let (_cluster, url) = server().await;
    let schema = dedupe_testkit::unique_schema("advhalf");
    let stores = pg_handles(&url, &schema, 4).await;
    let st = dyns(&stores);
    let log = Log::default();
    // A new handle inserts first; its statements are cancelled after 800 ms.
    let batch_timeout = Duration::from_millis(800);
    let batcher = PgStore::builder(
        PgStore::connect_pool(&url, 2, batch_timeout)
            .await
            .expect("connect a pool"),
    )
    .schema(&schema)
    .timeout(batch_timeout)
    .build()
    .expect("build a store");
    let slow = key("hd", "slow");
    let l = match stores[0]
        .claim(&slow, &opts(Duration::from_millis(60)))
        .await
    {
        Ok(ClaimOutcome::Claimed(l)) => l,
        other => panic!("a fresh claim answered {other:?}"),
    };
    sleep_until_us(us(l.deadline) + 30_000).await;
    let fresh: Vec<Key> = (0..6).map(|i| key("hd", format!("f{i}"))).collect();
    let mut batch_keys = fresh.clone();
    batch_keys.push(slow.clone());
    let ks = key_sql(&stores[0], &schema).await;
    let mut locker = stores[0].pool().begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE {} FOR UPDATE",
        table(&schema),
        ks.is
    )))
    .bind("hd".to_string())
    .bind("slow".to_string())
    .execute(&mut *locker)
    .await
    .expect("lock the lapsed record's row");
    let batch = {
        let (log, b) = (log.clone(), batcher.clone());
        tokio::spawn(async move {
            log.claim_many(
                &b,
                "batch",
                &batch_keys,
                &opts(LONG).with_claim_id(cid("batch-cid")),
            )
            .await
            .map(|v| v.len())
        })
    };
    // Until well past the batch's timeout (800 ms).
    let shown = dedupe_testkit::eventually(Duration::from_millis(1500), || {
        let (s, k) = (stores[0].clone(), fresh[0].clone());
        async move { matches!(s.get(&k).await, Ok(Some(_))) }
    })
    .await;
    assert!(
        !shown,
        "a batch with a claim id runs one statement: none of its keys may be \
         visible before it fails"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut observers = Vec::new();
    for o in 0..3 {
        let (keys, same, work) = if o == 0 {
            (
                fresh[..3].to_vec(),
                Some("batch-cid"),
                Duration::from_millis(1500),
            )
        } else {
            (fresh.clone(), None, Duration::ZERO)
        };
        observers.push(tokio::spawn(observe(
            log.clone(),
            Arc::clone(&st[1 + o]),
            o,
            keys,
            same,
            work,
            Arc::clone(&stop),
        )));
    }
    let r = batch.await.expect("the batch task");
    // Past the end of the same-claim-id observer's work (1.5 s from its claim).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    locker.commit().await.expect("let go of the row");
    stop.store(true, Ordering::Relaxed);
    for o in observers {
        o.await.expect("an observer panicked");
    }
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "a batch whose second statement waited past its timeout answered {r:?}"
    );
    assert_history("a failed batch and its observers", &log, LOOSE);
}

async fn pg_tx_worker(
    w: usize,
    store: PgStore,
    keys: Arc<Vec<Key>>,
    log: Log,
    commits: Arc<Mutex<Vec<Commit>>>,
    app: String,
) {
    let who = format!("tx{w}");
    for pass in 0..30 {
        let mut open = false;
        for i in 0..keys.len() {
            let k = &keys[(i + w * 7) % keys.len()];
            let t_call = now_us();
            let mut tx = match store.pool().begin().await {
                Ok(tx) => tx,
                Err(e) => {
                    log.record(
                        k,
                        &who,
                        t_call,
                        now_us(),
                        Answer::Failed {
                            nothing_written: false,
                            error: format!("BEGIN: {e}"),
                        },
                    );
                    open = true;
                    continue;
                }
            };
            let claimed = store.claim_in(&mut tx, k, &opts(LONG)).await;
            match claimed {
                Ok(ClaimOutcome::Claimed(lease)) => {
                    open = true;
                    let insert = sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO {app} (k, worker) VALUES ($1, $2)"
                    )))
                    .bind(k.to_string())
                    .bind(who.clone())
                    .execute(&mut *tx)
                    .await;
                    if let Err(e) = insert {
                        log.flag(format!("{who}: the application's insert failed: {e}"));
                    }
                    let out = format!("tx|{k}|{who}|{pass}").into_bytes();
                    let t_complete = now_us();
                    if let Err(e) = store.complete_in(&mut tx, &lease, &out, RETAIN).await {
                        log.flag(format!(
                            "{who}: complete_in of a fresh live lease failed: {}",
                            chain(&e)
                        ));
                        let _ = tx.rollback().await;
                        continue;
                    }
                    if (w + i + pass).is_multiple_of(3) {
                        let _ = tx.rollback().await;
                        continue;
                    }
                    match tx.commit().await {
                        Ok(()) => {
                            let t_ret = now_us();
                            log.record_claim(
                                k,
                                &who,
                                t_call,
                                t_ret,
                                &Ok(ClaimOutcome::Claimed(lease.clone())),
                            );
                            log.record(
                                k,
                                &who,
                                t_complete,
                                t_ret,
                                Answer::Completed {
                                    token: lease.token.clone(),
                                    outcome: out.clone(),
                                },
                            );
                            commits.lock().expect("commits").push((
                                k.to_string(),
                                who.clone(),
                                out,
                            ));
                        }
                        Err(e) => log.flag(format!("{who}: COMMIT failed: {e}")),
                    }
                }
                other => {
                    if !matches!(other, Ok(ClaimOutcome::Duplicate { .. })) {
                        open = true;
                    }
                    let t_ret = now_us();
                    let _ = tx.rollback().await;
                    log.record_claim(k, &who, t_call, t_ret, &other);
                }
            }
        }
        if !open {
            break;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

/// Transactions of the application's own (`claim_in`, its own insert,
/// `complete_in`, then commit or roll back) on four handles, racing plain
/// claims and batches (in both first-statement modes) on other handles over
/// 30 keys. Each event is committed exactly once, the application's rows
/// match, and the stored outcome is the winner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_transactions_commit_each_event_exactly_once() {
    let (_cluster, url) = server().await;
    let schema = dedupe_testkit::unique_schema("advtx");
    let stores = pg_handles(&url, &schema, 6).await;
    let log = Log::default();
    let done = key("warm", "done");
    make_done(&log, &stores[0], &done, b"warm").await;
    warm_handle(&stores[5], true, &done, "tx").await;
    let app = format!("\"{schema}\".\"app_orders\"");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {app} (k text NOT NULL, worker text NOT NULL)"
    )))
    .execute(stores[0].pool())
    .await
    .expect("the application's table");
    let keys: Arc<Vec<Key>> = Arc::new((0..30).map(|i| key("tx", format!("k{i}"))).collect());
    let commits: Arc<Mutex<Vec<Commit>>> = Arc::default();
    let mut workers = Vec::new();
    for (w, store) in stores.iter().enumerate().take(4) {
        workers.push(tokio::spawn(pg_tx_worker(
            w,
            store.clone(),
            Arc::clone(&keys),
            log.clone(),
            Arc::clone(&commits),
            app.clone(),
        )));
    }
    let st = dyns(&stores);
    for a in 0..2 {
        workers.push(tokio::spawn(plain_claimer(
            a,
            Arc::clone(&st[4 + a]),
            Arc::clone(&keys),
            log.clone(),
        )));
    }
    let finished = tokio::time::timeout(Duration::from_secs(150), async {
        for w in workers {
            w.await.expect("a worker panicked");
        }
    })
    .await;
    assert!(
        finished.is_ok(),
        "HANG: transactions did not finish within 150 s"
    );
    let rows: HashMap<String, i64> = sqlx::query(AssertSqlSafe(format!(
        "SELECT k, count(*)::int8 FROM {app} GROUP BY k"
    )))
    .fetch_all(stores[0].pool())
    .await
    .expect("count rows")
    .iter()
    .map(|r| {
        (
            r.try_get::<String, _>(0).expect("k"),
            r.try_get::<i64, _>(1).expect("count"),
        )
    })
    .collect();
    let mut stored = HashMap::new();
    for k in keys.iter() {
        let out = match stores[1].get(k).await {
            Ok(Some(rec)) => match rec.state {
                RecordState::Done { outcome, .. } => Some(outcome),
                RecordState::InFlight { .. } => None,
            },
            _ => None,
        };
        stored.insert(k.to_string(), out);
    }
    let commits = commits.lock().expect("commits").clone();
    judge_transactions(&log, &keys, &commits, &rows, &stored);
    assert_history("transactions", &log, LOOSE);
    assert_no_errors("transactions", &log);
}

/// Ten tasks on four handles that each keep three connections checked out
/// between calls call with timeouts of 0 to 4 ms, so futures are dropped
/// mid-statement and between the statements of one claim. Whatever was
/// answered must fit the contract (a connection handed on out of step would
/// answer another call's rows: wrong outcomes), no lease outlives its
/// deadline, and every handle still answers afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_cancelled_calls_leave_held_connections_sound() {
    let (_cluster, url) = server().await;
    let schema = dedupe_testkit::unique_schema("advcancel");
    let first = pg_handle(&url, &schema, 5, 3).await;
    first.migrate().await.expect("migrate");
    let mut stores = vec![first];
    for _ in 1..4 {
        stores.push(pg_handle(&url, &schema, 5, 3).await);
    }
    let st = dyns(&stores);
    let history = History::new(Duration::from_millis(5)).every_in_flight_seen();
    let done = match cancellation_storm_on(&st, 10, Duration::from_secs(3), &history).await {
        Ok(done) => done,
        Err(f) => panic!("{f}"),
    };
    // Every handle, on its held connections, answers every done key with
    // that key's own outcome.
    for (i, s) in st.iter().enumerate() {
        let probe = Recorder::new(Arc::clone(s), history.clone(), 2000 + i);
        for round in 0..10 {
            for k in &done {
                let _ = probe.claim(k, &opts(LONG)).await;
            }
            let _ = probe.claim_many(&done, &opts(LONG)).await;
            if round % 3 == 0 {
                let _ = s.get(&done[round % done.len()]).await;
            }
        }
    }
    if let Err(f) = history.verdict("cancellation storm") {
        panic!("{f}");
    }
}
