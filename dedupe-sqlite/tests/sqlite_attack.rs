//! Adversarial integration tests for `dedupe-sqlite`, written from
//! `CONTRACT.md` and the store's source only (white-box), without reading the
//! crate's own tests or the conformance suite.
//!
//! Every test records each call with its answer and call/return times
//! (`dedupe_testkit::rounds::Log`), and the suite's history checker
//! (`dedupe_conformance::history`) replays the contract over that history: one live winner per key,
//! stale holders fenced, duplicates answered with the exact bytes of the one
//! completion, no phantom or stale `InFlight`, `claim_many` agreeing with
//! `claim`. Each test says what it aims at.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedupe_conformance::checks::{batches_against_reference, cancellation_storm_on, BatchSide};
use dedupe_conformance::history::{Answer, Call, History};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, RecordState,
};
use dedupe_sqlite::rusqlite::{self, Connection, TransactionBehavior};
use dedupe_sqlite::SqliteStore;
use dedupe_testkit::rounds::*;
// ======================================================================
// SQLite-specific helpers
// ======================================================================

const BUSY: Duration = Duration::from_secs(20);
/// Lease of the rounds whose winner lets it lapse.
const SHORT: Duration = Duration::from_millis(80);

async fn open_store(db: &Path, conns: usize) -> dedupe_core::Result<SqliteStore> {
    SqliteStore::builder(db)
        .busy_timeout(BUSY)
        .connection_threads(conns)
        .open()
        .await
}

/// Separate handles on one file: each with connection threads and read/write
/// pools of its own (some by `open`, some by `reopen`), sharing the process's
/// writer thread.
async fn handles(db: &Path, n: usize) -> Vec<SqliteStore> {
    let first = open_store(db, 2).await.expect("open the store");
    let mut v = vec![first];
    for i in 1..n {
        let h = if i % 2 == 0 {
            v[0].reopen().await
        } else {
            open_store(db, 1 + i % 3).await
        };
        v.push(h.expect("open another handle"));
    }
    v
}

fn dyns(stores: &[SqliteStore]) -> Vec<Arc<dyn DedupeStore>> {
    stores
        .iter()
        .map(|s| Arc::new(s.clone()) as Arc<dyn DedupeStore>)
        .collect()
}

/// A connection of the application's own, for `claim_in` and for holding
/// SQLite's write lock.
fn caller_conn(db: &Path) -> Connection {
    let c = Connection::open(db).expect("open a caller connection");
    c.busy_timeout(BUSY).expect("busy timeout");
    c
}

fn plant_corrupt(db: &Path, ns: &str, id: &str) {
    caller_conn(db)
        .execute(
            "INSERT INTO dedupe_records (namespace, id, state, token, claim_id, fingerprint,
                 expires_at, completed_at, outcome, attempts, first_seen)
             VALUES (?1, ?2, 7, 'corrupt-token', NULL, NULL, ?3, NULL, NULL, 1, 0)",
            rusqlite::params![ns, id, i64::MAX / 4],
        )
        .expect("plant a corrupt record");
}

/// (state, token, attempts, expires_at) of a stored row, expired or not.
fn raw_row(db: &Path, k: &Key) -> Option<(i64, String, i64, i64)> {
    caller_conn(db)
        .query_row(
            "SELECT state, token, attempts, expires_at FROM dedupe_records WHERE namespace = ?1 AND id = ?2",
            rusqlite::params![k.namespace(), k.id()],
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
        )
        .ok()
}

/// `claim_in` inside a `BEGIN IMMEDIATE` transaction of the caller's own,
/// committed at once.
fn claim_in_committed(
    store: &SqliteStore,
    conn: &mut Connection,
    k: &Key,
    o: &ClaimOptions,
) -> dedupe_core::Result<ClaimOutcome> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| Error::retryable(format!("BEGIN IMMEDIATE: {e}"), None))?;
    let r = store.claim_in(&tx, k, o);
    tx.commit()
        .map_err(|e| Error::retryable(format!("COMMIT: {e}"), None))?;
    r
}

/// A racer's claim inside a `BEGIN IMMEDIATE` transaction of its own, on a
/// connection of its own (run off the runtime).
fn sqlite_claim_in(store: &SqliteStore, db: &Path) -> ClaimIn {
    let (store, conn) = (store.clone(), Arc::new(Mutex::new(caller_conn(db))));
    Arc::new(move |k, o| {
        let (store, conn) = (store.clone(), Arc::clone(&conn));
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                claim_in_committed(&store, &mut conn, &k, &o)
            })
            .await
            .unwrap_or_else(|e| Err(Error::fatal(format!("claim_in task: {e}"), None)))
        })
    })
}

/// Background traffic on other keys of the same handles: duplicates, fresh
/// claims completed or released, batches with repeats, reads.
async fn noise(log: Log, store: SqliteStore, id: usize, stop: Arc<AtomicBool>) {
    let who = format!("noise{id}");
    let done = key("noise", "done");
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let _ = log.claim(&store, &who, &done, &opts(LONG)).await;
        let f = key("noise", format!("{who}-{n}"));
        if let Ok(ClaimOutcome::Claimed(l)) = log.claim(&store, &who, &f, &opts(LONG)).await {
            if n.is_multiple_of(2) {
                let out = format!("{who}-{n}").into_bytes();
                let _ = log.complete(&store, &who, &l, &out).await;
            } else {
                let _ = log.release(&store, &who, &l).await;
            }
        }
        let batch = [
            done.clone(),
            key("noise", format!("{who}-{n}-b")),
            done.clone(),
            f.clone(),
        ];
        let _ = log.claim_many(&store, &who, &batch, &opts(LONG)).await;
        let _ = store.get(&f).await;
        tokio::time::sleep(Duration::from_millis(3)).await;
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

/// 16 racers on 8 handles (2 of them on a current-thread runtime, so their
/// calls go through connection threads and the writer thread while the others
/// run in place), 80 rounds of: simultaneous claims of a fresh key by seven
/// different paths, the winner completing / releasing / letting a short lease
/// lapse / extending, a second wave (duplicate, fresh claim, or takeover), the
/// first holder's stale calls, a third wave of duplicates. Background noise
/// on the same handles keeps the writer thread's queue busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_handles_keep_one_winner_per_lease() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("race.db");
    let stores = handles(&db, 8).await;
    let log = Log::default();
    let done = key("noise", "done");
    if let Ok(ClaimOutcome::Claimed(l)) = log.claim(&stores[0], "setup", &done, &opts(LONG)).await {
        let _ = log.complete(&stores[0], "setup", &l, b"noise-done").await;
    }
    const RACERS: usize = 16;
    const ON_CURRENT_THREAD: usize = 2;
    let ctx = RaceCtx::new(RACERS, 80, &log, SHORT, Duration::from_millis(3));
    let stop = Arc::new(AtomicBool::new(false));
    let noise_tasks: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(noise(
                log.clone(),
                stores[i * 2 + 1].clone(),
                i,
                Arc::clone(&stop),
            ))
        })
        .collect();
    let mut tasks = Vec::new();
    for id in 0..RACERS - ON_CURRENT_THREAD {
        let store = &stores[id % stores.len()];
        tasks.push(tokio::spawn(racer(
            Arc::clone(&ctx),
            id,
            store.clone(),
            sqlite_claim_in(store, &db),
        )));
    }
    let mut threads = Vec::new();
    for id in RACERS - ON_CURRENT_THREAD..RACERS {
        let (ctx, store) = (Arc::clone(&ctx), stores[id % stores.len()].clone());
        let claim_in = sqlite_claim_in(&store, &db);
        threads.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(racer(ctx, id, store, claim_in));
        }));
    }
    let finished = tokio::time::timeout(Duration::from_secs(150), async {
        for t in tasks {
            t.await.expect("a racer panicked");
        }
        for th in threads {
            tokio::task::spawn_blocking(move || th.join())
                .await
                .expect("join")
                .expect("a current-thread racer panicked");
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for n in noise_tasks {
        let _ = n.await;
    }
    assert!(
        finished.is_ok(),
        "HANG: the racers did not finish 80 rounds within 150 s"
    );
    assert_history("racing handles", &log, STRICT);
    assert_no_errors("racing handles", &log);
}

/// Holds SQLite's write lock from a connection of its own while ~350 writes
/// queue for the process's writer thread: 260 single claims over 150 keys
/// (several claims of one key land in one group), batches of 1, 129, 700,
/// 1,023, 1,024, 1,025 and 2,048 keys (straddling the 1,024-key and 128-write
/// group limits, overlapping each other and the singles, with repeats), a
/// batch of 1,031 keys that fails on a corrupt record, and completions and
/// releases of earlier leases with claims of those keys. Then lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_straddling_group_limits_keep_one_winner() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("group.db");
    let stores = handles(&db, 6).await;
    let n = stores.len();
    let log = Log::default();
    plant_corrupt(&db, "grp", "corrupt");
    let mut held = Vec::new();
    for i in 0..64 {
        let k = key("grp", format!("held{i}"));
        if let Ok(ClaimOutcome::Claimed(l)) =
            log.claim(&stores[i % n], "pre", &k, &opts(LONG)).await
        {
            held.push(l);
        }
    }
    let mut blocker = caller_conn(&db);
    let tx = blocker
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .expect("take the write lock");
    let mut set = tokio::task::JoinSet::new();
    for i in 0..260 {
        let (log, s) = (log.clone(), stores[i % n].clone());
        let k = key("grp", format!("s{}", i % 150));
        let who = format!("single{i}");
        let o = if i % 5 == 0 {
            opts(LONG).with_claim_id(cid(format!("cid-{}", i % 150)))
        } else {
            opts(LONG)
        };
        set.spawn(async move {
            let _ = log.claim(&s, &who, &k, &o).await;
        });
    }
    let pool: Vec<Key> = (0..2500).map(|i| key("grp", format!("b{i}"))).collect();
    for (j, size) in [1023usize, 1024, 1025, 700, 129, 1, 2048]
        .iter()
        .enumerate()
    {
        let mut keys: Vec<Key> = (0..*size)
            .map(|i| pool[(i * (j + 1) * 7 + j * 311) % pool.len()].clone())
            .collect();
        keys.push(keys[0].clone());
        keys.push(key("grp", format!("s{}", j * 3)));
        let o = if j % 2 == 0 {
            opts(LONG)
        } else {
            opts(LONG).with_claim_id(cid(format!("batch-{j}")))
        };
        let (log, s) = (log.clone(), stores[j % n].clone());
        set.spawn(async move {
            let _ = log.claim_many(&s, &format!("batch{j}"), &keys, &o).await;
        });
    }
    let only: Vec<Key> = (0..300)
        .map(|i| key("grp", format!("onlyfail{i}")))
        .collect();
    let mut failing = only.clone();
    failing.insert(150, key("grp", "corrupt"));
    failing.extend(pool[..730].iter().cloned());
    let failed: Arc<Mutex<Option<String>>> = Arc::default();
    {
        let (log, s, failed) = (log.clone(), stores[1].clone(), Arc::clone(&failed));
        set.spawn(async move {
            let r = log.claim_many(&s, "failing", &failing, &opts(LONG)).await;
            *failed.lock().expect("slot") = Some(match r {
                Err(Error::CorruptRecord { .. }) => "ok".into(),
                other => format!("{:?}", other.map(|v| v.len())),
            });
        });
    }
    for (i, l) in held.iter().enumerate() {
        let (log2, s, l2) = (log.clone(), stores[(i + 1) % n].clone(), l.clone());
        set.spawn(async move {
            if i % 2 == 0 {
                let out = format!("held-{i}").into_bytes();
                let _ = log2.complete(&s, "holder", &l2, &out).await;
            } else {
                let _ = log2.release(&s, "holder", &l2).await;
            }
        });
        let (log, s, k) = (log.clone(), stores[(i + 2) % n].clone(), l.key.clone());
        set.spawn(async move {
            let _ = log.claim(&s, "rival", &k, &opts(LONG)).await;
        });
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    tx.rollback().expect("let go of the write lock");
    let joined = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(j) = set.join_next().await {
            j.expect("a task panicked");
        }
    })
    .await;
    assert!(
        joined.is_ok(),
        "HANG: queued writes were not answered within 120 s of the lock being freed"
    );
    let failed = failed.lock().expect("slot").clone();
    assert_eq!(
        failed.as_deref(),
        Some("ok"),
        "a batch meeting a corrupt record answered {failed:?} instead of CorruptRecord"
    );
    for k in &only {
        if let Ok(Some(rec)) = stores[2].get(k).await {
            log.flag(format!("{k}: a batch that failed left it claimed: {rec:?}"));
        }
    }
    // Every Claimed answer of a key never released is what the file holds.
    let calls = log.history().calls();
    let mut winners: HashMap<String, HashSet<String>> = HashMap::new();
    for c in &calls {
        if let Answer::Claimed { token, .. } = &c.answer {
            winners
                .entry(c.key.clone())
                .or_default()
                .insert(token.as_str().to_string());
        }
    }
    let released: HashSet<String> = calls
        .iter()
        .filter(|c| matches!(c.answer, Answer::Released(_) | Answer::ReleaseFailed { .. }))
        .map(|c| c.key.clone())
        .collect();
    let mut lost = 0;
    for k in pool.iter().chain(
        (0..150)
            .map(|i| key("grp", format!("s{i}")))
            .collect::<Vec<_>>()
            .iter(),
    ) {
        let ks = k.to_string();
        let Some(toks) = winners.get(&ks) else {
            continue;
        };
        if released.contains(&ks) {
            continue;
        }
        match stores[3].get(k).await {
            Ok(Some(rec)) if toks.contains(rec.token.as_str()) => {}
            other => {
                lost += 1;
                if lost < 10 {
                    log.flag(format!(
                        "LOST CLAIM: {ks} was answered Claimed but the file holds {other:?}"
                    ));
                }
            }
        }
    }
    assert_history("queued writes", &log, STRICT);
    assert_no_errors("queued writes", &log);
}

// ---------- cross-process ----------

const XP_ENV: &str = "DEDUPE_ADV_XP_CHILD_DB";
const XP_CHILDREN: usize = 4;
const XP_ROUNDS: usize = 30;
const XP_PERIOD_US: i64 = 330_000;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or("00"), 16).unwrap_or(0))
        .collect()
}

fn clean(s: &str) -> String {
    s.replace(['\t', '\n', '\r'], " ")
}

fn at_us(t: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(u64::try_from(t).unwrap_or(0))
}

fn lost_or_err(lease_lost: bool) -> &'static str {
    if lease_lost {
        "lost"
    } else {
        "err"
    }
}

/// One recorded call as a line a child process writes and the parent reads.
fn to_line(who: &str, t_call: i64, t_ret: i64, c: &Call) -> String {
    let tail = match &c.answer {
        Answer::Claimed {
            token,
            attempt,
            deadline,
        } => format!("C\tclaimed\t{token}\t{attempt}\t{}", us(*deadline)),
        Answer::InFlight { attempt, deadline } => {
            format!("C\tinflight\t{attempt}\t{}", us(*deadline))
        }
        Answer::Duplicate(outcome) => format!("C\tdup\t{}", hex(outcome)),
        Answer::Mismatch => "C\tmismatch".to_string(),
        Answer::Failed {
            error,
            nothing_written,
        } => format!("C\terr\t{nothing_written}\t{}", clean(error)),
        Answer::Completed { token, outcome } => format!("F\t{token}\t{}\tok", hex(outcome)),
        Answer::CompleteFailed {
            token,
            outcome,
            lease_lost,
        } => format!("F\t{token}\t{}\t{}", hex(outcome), lost_or_err(*lease_lost)),
        Answer::Released(token) => format!("R\t{token}\tok"),
        Answer::ReleaseFailed { token, lease_lost } => {
            format!("R\t{token}\t{}", lost_or_err(*lease_lost))
        }
        Answer::Extended { token, deadline } => format!("X\t{token}\tok\t{}", us(*deadline)),
        Answer::ExtendFailed { token, lease_lost } => {
            format!("X\t{token}\t{}\t0", lost_or_err(*lease_lost))
        }
    };
    format!(
        "{}\t{}\t{t_call}\t{t_ret}\t{tail}",
        clean(&c.key),
        clean(who)
    )
}

/// A line of [`to_line`]: key, who, call and return times, answer.
fn from_line(line: &str) -> Option<(Key, String, i64, i64, Answer)> {
    let f: Vec<&str> = line.split('\t').collect();
    if f.len() < 5 {
        return None;
    }
    let g = |i: usize| f.get(i).copied().unwrap_or("");
    let tok = |i: usize| dedupe_core::backend::stored_token(g(i));
    let answer = match (g(4), g(5)) {
        ("C", "claimed") => Answer::Claimed {
            token: tok(6),
            attempt: g(7).parse().ok()?,
            deadline: at_us(g(8).parse().ok()?),
        },
        ("C", "inflight") => Answer::InFlight {
            attempt: g(6).parse().ok()?,
            deadline: at_us(g(7).parse().ok()?),
        },
        ("C", "dup") => Answer::Duplicate(unhex(g(6))),
        ("C", "mismatch") => Answer::Mismatch,
        ("C", "err") => Answer::Failed {
            nothing_written: g(6) == "true",
            error: g(7).into(),
        },
        ("F", _) if g(7) == "ok" => Answer::Completed {
            token: tok(5),
            outcome: unhex(g(6)),
        },
        ("F", _) => Answer::CompleteFailed {
            token: tok(5),
            outcome: unhex(g(6)),
            lease_lost: g(7) == "lost",
        },
        ("R", _) if g(6) == "ok" => Answer::Released(tok(5)),
        ("R", _) => Answer::ReleaseFailed {
            token: tok(5),
            lease_lost: g(6) == "lost",
        },
        ("X", _) if g(6) == "ok" => Answer::Extended {
            token: tok(5),
            deadline: at_us(g(7).parse().ok()?),
        },
        ("X", _) => Answer::ExtendFailed {
            token: tok(5),
            lease_lost: g(6) == "lost",
        },
        _ => return None,
    };
    let (ns, id) = g(0).split_once(':')?;
    Some((
        Key::new(ns, id).ok()?,
        g(1).to_string(),
        g(2).parse().ok()?,
        g(3).parse().ok()?,
        answer,
    ))
}

fn xp_outcome(r: usize, who: &str, phase: usize) -> Vec<u8> {
    let mut v = format!("xp|r{r}|{who}|{phase}|").into_bytes();
    v.extend_from_slice(&[0, 1, 255]);
    v
}

/// One task of a child process: rounds at fixed wall-clock instants shared by
/// every process (same machine, same clock).
async fn xp_task(log: Log, store: SqliteStore, db: PathBuf, child: usize, t: usize, t0: i64) {
    let who = format!("p{child}t{t}");
    let claim_in = sqlite_claim_in(&store, &db);
    let me = Claimer {
        log: &log,
        who: &who,
        store: &store,
        claim_in: &claim_in,
    };
    for r in 0..XP_ROUNDS {
        let base = t0 + i64::try_from(r).unwrap_or(0) * XP_PERIOD_US;
        let k = key("xp", format!("r{r}"));
        let kind = r % 3;
        let ttl = if kind == 2 {
            Duration::from_millis(100)
        } else {
            LONG
        };
        let mode = child * 4 + t + r;
        sleep_until_us(base).await;
        let e = claim_by_mode(&me, mode, &format!("{r}a"), &k, ttl).await;
        if let Some(l) = &e.lease {
            match kind {
                0 => {
                    let _ = log.complete(&store, &who, l, &xp_outcome(r, &who, 0)).await;
                }
                1 => {
                    let _ = log.release(&store, &who, l).await;
                }
                _ => {}
            }
        }
        sleep_until_us(base + 170_000).await;
        let e2 = claim_by_mode(&me, mode + 2, &format!("{r}b"), &k, LONG).await;
        if let Some(l) = &e2.lease {
            let _ = log.complete(&store, &who, l, &xp_outcome(r, &who, 1)).await;
        }
        sleep_until_us(base + 270_000).await;
        if let Some(l) = &e.lease {
            let _ = log.complete(&store, &who, l, b"stale").await;
            let _ = log.extend(&store, &who, l, LONG).await;
        }
        let _ = claim_by_mode(&me, mode + 4, &format!("{r}c"), &k, LONG).await;
    }
}

async fn xp_child_main(db: PathBuf, out: PathBuf, child: usize, t0: i64) {
    // Two handles opened at once, by every process at once, on a file that
    // does not exist yet.
    let (a, b) = tokio::join!(open_store(&db, 2), open_store(&db, 1));
    let a = a.unwrap_or_else(|e| {
        panic!(
            "child {child}: opening a fresh file together with other processes failed: {}",
            chain(&e)
        )
    });
    let b = b.unwrap_or_else(|e| {
        panic!(
            "child {child}: opening a fresh file together with other processes failed: {}",
            chain(&e)
        )
    });
    let stores = [a, b];
    let log = Log::default();
    let mut set = tokio::task::JoinSet::new();
    for t in 0..4 {
        let (log, store, db) = (log.clone(), stores[t % 2].clone(), db.clone());
        set.spawn(xp_task(log, store, db, child, t, t0));
    }
    while let Some(j) = set.join_next().await {
        if let Err(e) = j {
            log.flag(format!("child {child}: a task panicked: {e}"));
        }
    }
    let mut text = String::new();
    for (who, t_call, t_ret, c) in log.calls() {
        text.push_str(&to_line(&who, t_call, t_ret, &c));
        text.push('\n');
    }
    for f in log.history().flags() {
        text.push_str("FLAG\t");
        text.push_str(&clean(&f));
        text.push('\n');
    }
    std::fs::write(&out, text).expect("write the history");
}

/// Not a test on its own: the body of each child process of
/// `processes_racing_on_one_fresh_file_keep_one_winner` (does nothing unless
/// started by it).
#[test]
fn xp_child() {
    let Ok(db) = std::env::var(XP_ENV) else {
        return;
    };
    let out = std::env::var("DEDUPE_ADV_XP_OUT").expect("history path");
    let child: usize = std::env::var("DEDUPE_ADV_XP_ID")
        .expect("child id")
        .parse()
        .expect("child id");
    let t0: i64 = std::env::var("DEDUPE_ADV_XP_T0")
        .expect("start time")
        .parse()
        .expect("start time");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(xp_child_main(
        PathBuf::from(db),
        PathBuf::from(out),
        child,
        t0,
    ));
}

/// Four OS processes (this test binary re-run with a filter), each with two
/// handles and four tasks, open one fresh file at the same instant and race
/// 30 rounds on it at shared wall-clock instants: claims by seven paths
/// (including `claim_in`), complete / release / lapse, takeover, stale calls.
/// The parent merges the four histories and checks them as one.
#[test]
fn processes_racing_on_one_fresh_file_keep_one_winner() {
    if std::env::var_os(XP_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("xp.db");
    let exe = std::env::current_exe().expect("the test binary");
    let t0 = now_us() + 3_000_000;
    let mut kids = Vec::new();
    for c in 0..XP_CHILDREN {
        let out = dir.path().join(format!("history-{c}.txt"));
        let log_path = dir.path().join(format!("child-{c}.log"));
        let log_file = std::fs::File::create(&log_path).expect("child log");
        let err_file = log_file.try_clone().expect("child log");
        let child = std::process::Command::new(&exe)
            .args(["xp_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(XP_ENV, &db)
            .env("DEDUPE_ADV_XP_OUT", &out)
            .env("DEDUPE_ADV_XP_ID", c.to_string())
            .env("DEDUPE_ADV_XP_T0", t0.to_string())
            .stdout(log_file)
            .stderr(err_file)
            .spawn()
            .expect("start a child process");
        kids.push((c, child, out, log_path));
    }
    let give_up = Instant::now()
        + Duration::from_secs(3)
        + Duration::from_micros(u64::try_from(XP_PERIOD_US).unwrap_or(0) * XP_ROUNDS as u64)
        + Duration::from_secs(60);
    let mut failures = Vec::new();
    for (c, child, _, log_path) in &mut kids {
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < give_up => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        if status.is_none_or(|s| !s.success()) {
            failures.push(format!(
                "child {c} {}:\n{}",
                if status.is_none() {
                    "HUNG and was killed"
                } else {
                    "failed"
                },
                std::fs::read_to_string(&*log_path).unwrap_or_default()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let log = Log::default();
    for (c, _, out, _) in &kids {
        let text = std::fs::read_to_string(out)
            .unwrap_or_else(|e| panic!("child {c} wrote no history: {e}"));
        for line in text.lines() {
            if let Some(flag) = line.strip_prefix("FLAG\t") {
                log.flag(format!("child {c}: {flag}"));
            } else if let Some((k, who, t_call, t_ret, answer)) = from_line(line) {
                log.record(&k, &who, t_call, t_ret, answer);
            } else if !line.is_empty() {
                log.flag(format!("child {c}: unreadable history line {line:?}"));
            }
        }
    }
    let calls = log.history().calls();
    for r in (0..XP_ROUNDS).filter(|r| r % 3 == 0) {
        let k = format!("xp:r{r}");
        let toks: HashSet<&str> = calls
            .iter()
            .filter(|c| c.key == k)
            .filter_map(|c| match &c.answer {
                Answer::Claimed { token, .. } => Some(token.as_str()),
                _ => None,
            })
            .collect();
        let errors = calls
            .iter()
            .any(|c| c.key == k && matches!(&c.answer, Answer::Failed { .. }));
        if toks.len() != 1 && !errors {
            log.flag(format!(
                "{k}: {} winners across {XP_CHILDREN} processes (exactly one expected: the winner completed at once)",
                toks.len()
            ));
        }
    }
    assert_history("processes on one file", &log, STRICT);
    assert_no_errors("processes on one file", &log);
}

// ---------- transactions ----------

fn tx_worker(
    w: usize,
    store: &SqliteStore,
    db: &Path,
    keys: &[Key],
    log: &Log,
    commits: &Mutex<Vec<Commit>>,
) {
    let mut conn = caller_conn(db);
    let who = format!("tx{w}");
    for pass in 0..30 {
        let mut open = false;
        for i in 0..keys.len() {
            let k = &keys[(i + w * 7) % keys.len()];
            let slow = (pass * 5 + i + w).is_multiple_of(13);
            let ttl = if slow {
                Duration::from_millis(40)
            } else {
                LONG
            };
            let t_call = now_us();
            let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
                Ok(tx) => tx,
                Err(e) => {
                    log.record(
                        k,
                        &who,
                        t_call,
                        now_us(),
                        Answer::Failed {
                            nothing_written: false,
                            error: format!("BEGIN IMMEDIATE: {e}"),
                        },
                    );
                    open = true;
                    continue;
                }
            };
            match store.claim_in(&tx, k, &opts(ttl)) {
                Ok(ClaimOutcome::Claimed(lease)) => {
                    open = true;
                    if let Err(e) = tx.execute(
                        "INSERT INTO app_orders (k, worker) VALUES (?1, ?2)",
                        rusqlite::params![k.to_string(), who],
                    ) {
                        log.flag(format!("{who}: the application's insert failed: {e}"));
                    }
                    if slow {
                        std::thread::sleep(Duration::from_millis(90));
                    }
                    let out = format!("tx|{k}|{who}|{pass}").into_bytes();
                    let t_complete = now_us();
                    let done = store.complete_in(&tx, &lease, &out, RETAIN);
                    if slow {
                        if done.is_ok() {
                            log.flag(format!(
                                "{k}: STALE HOLDER: complete_in succeeded 90 ms into a 40 ms lease (the deadline had passed)"
                            ));
                        }
                        let _ = tx.rollback();
                        continue;
                    }
                    if let Err(e) = &done {
                        log.flag(format!(
                            "{who}: complete_in of a fresh live lease failed: {}",
                            chain(e)
                        ));
                        let _ = tx.rollback();
                        continue;
                    }
                    if (w + i + pass).is_multiple_of(3) {
                        let _ = tx.rollback();
                        continue;
                    }
                    match tx.commit() {
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
                    let _ = tx.rollback();
                    log.record_claim(k, &who, t_call, t_ret, &other);
                }
            }
        }
        if !open {
            break;
        }
    }
}

/// Transactions of the application's own (`BEGIN IMMEDIATE`, `claim_in`, its
/// own insert, `complete_in`, then commit or roll back) on four connections,
/// racing plain claims and batches on other handles over 36 keys; some
/// transactions outlive their 40 ms lease before `complete_in`. Each event is
/// committed exactly once, the application's rows match, and the stored
/// outcome is the winner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_commit_each_event_exactly_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("tx.db");
    let stores = handles(&db, 4).await;
    let log = Log::default();
    caller_conn(&db)
        .execute_batch("CREATE TABLE app_orders (k TEXT NOT NULL, worker TEXT NOT NULL)")
        .expect("the application's table");
    let keys: Arc<Vec<Key>> = Arc::new((0..36).map(|i| key("tx", format!("k{i}"))).collect());
    let commits: Arc<Mutex<Vec<Commit>>> = Arc::default();
    let mut blocking = Vec::new();
    for w in 0..4 {
        let (store, db, keys, log, commits) = (
            stores[w % stores.len()].clone(),
            db.clone(),
            Arc::clone(&keys),
            log.clone(),
            Arc::clone(&commits),
        );
        blocking.push(tokio::task::spawn_blocking(move || {
            tx_worker(w, &store, &db, &keys, &log, &commits);
        }));
    }
    let all = dyns(&stores);
    let mut plain = Vec::new();
    for a in 0..3 {
        plain.push(tokio::spawn(plain_claimer(
            a,
            Arc::clone(&all[(a + 1) % all.len()]),
            Arc::clone(&keys),
            log.clone(),
        )));
    }
    let finished = tokio::time::timeout(Duration::from_secs(150), async {
        for b in blocking {
            b.await.expect("a transaction worker panicked");
        }
        for p in plain {
            p.await.expect("a plain claimer panicked");
        }
    })
    .await;
    assert!(
        finished.is_ok(),
        "HANG: transactions did not finish within 150 s"
    );
    let rows: HashMap<String, i64> = {
        let conn = caller_conn(&db);
        let mut stmt = conn
            .prepare("SELECT k, count(*) FROM app_orders GROUP BY k")
            .expect("count rows");
        let counted: Vec<(String, i64)> = stmt
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .expect("count rows")
            .collect::<Result<_, _>>()
            .expect("count rows");
        counted.into_iter().collect()
    };
    let mut stored = HashMap::new();
    for k in keys.iter() {
        let out = match stores[0].get(k).await {
            Ok(Some(rec)) => match rec.state {
                RecordState::Done { outcome, .. } => Some(outcome),
                _ => None,
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

// ---------- claim_many against claim ----------

/// `claim_many` routed through the writer thread: each call takes SQLite's
/// write lock from another connection first and lets go 100 ms later, so the
/// batch (when it has to write) is queued and committed by the group.
#[derive(Debug, Clone)]
struct QueuedBatches {
    inner: SqliteStore,
    db: PathBuf,
}

// A wrapper forwards every method: one it forgets would silently fall back
// to the trait's default instead of the wrapped store's.
#[deny(clippy::missing_trait_methods)]
#[dedupe_core::async_trait]
impl DedupeStore for QueuedBatches {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> dedupe_core::Result<ClaimOutcome> {
        self.inner.claim(key, opts).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> dedupe_core::Result<()> {
        self.inner.complete(lease, outcome, retention).await
    }
    async fn release(&self, lease: &Lease) -> dedupe_core::Result<()> {
        self.inner.release(lease).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> dedupe_core::Result<Lease> {
        self.inner.extend(lease, ttl).await
    }
    async fn expire(&self) -> dedupe_core::Result<u64> {
        self.inner.expire().await
    }
    async fn get(&self, key: &Key) -> dedupe_core::Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn forget(&self, key: &Key) -> dedupe_core::Result<bool> {
        self.inner.forget(key).await
    }
    async fn claim_many(
        &self,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> dedupe_core::Result<Vec<ClaimOutcome>> {
        let db = self.db.clone();
        let (locked_tx, locked_rx) = std::sync::mpsc::channel::<()>();
        let blocker = std::thread::spawn(move || {
            let mut c = caller_conn(&db);
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .expect("take the write lock");
            let _ = locked_tx.send(());
            std::thread::sleep(Duration::from_millis(100));
            tx.rollback().expect("let go of the write lock");
        });
        let _ = tokio::task::spawn_blocking(move || locked_rx.recv()).await;
        let r = self.inner.claim_many(keys, opts).await;
        let _ = tokio::task::spawn_blocking(move || blocker.join()).await;
        r
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// 24 random scenarios (10 keys in random states: absent, in flight with or
/// without claim id and fingerprint, done with or without fingerprint,
/// lapsed, retention passed; a batch of up to 24 places with repeats, with or
/// without claim id and fingerprint): `claim_many` in place, `claim_many`
/// queued for the writer thread, and `claim` place by place must all answer
/// as `claim`s on the reference `MemoryStore`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_many_answers_as_claim_would_multi_thread() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("diff.db");
    let stores = handles(&db, 3).await;
    let side = |name: &str, store: Arc<dyn DedupeStore>, many: bool| BatchSide {
        name: name.to_string(),
        store,
        many,
        warm: None,
    };
    let sides = vec![
        side(
            "sqlite claim_many (caller's thread)",
            Arc::new(stores[0].clone()),
            true,
        ),
        side(
            "sqlite claim_many (queued behind a held write lock)",
            Arc::new(QueuedBatches {
                inner: stores[1].clone(),
                db: db.clone(),
            }),
            true,
        ),
        side(
            "sqlite claim, place by place",
            Arc::new(stores[2].clone()),
            false,
        ),
    ];
    if let Err(f) = batches_against_reference(sides, 0x5EED_0001, 24).await {
        panic!("{f}");
    }
}

/// The same on a current-thread runtime: every call goes through the
/// connection threads and the writer thread.
#[tokio::test]
async fn claim_many_answers_as_claim_would_current_thread() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("diff-ct.db");
    let stores = handles(&db, 2).await;
    let side = |i: usize, name: &str, many: bool| BatchSide {
        name: name.to_string(),
        store: Arc::new(stores[i].clone()),
        many,
        warm: None,
    };
    let sides = vec![
        side(0, "sqlite claim_many (connection/writer threads)", true),
        side(
            1,
            "sqlite claim, place by place (connection/writer threads)",
            false,
        ),
    ];
    if let Err(f) = batches_against_reference(sides, 0x5EED_0002, 16).await {
        panic!("{f}");
    }
}

/// Rule 8 for a batch: a `claim_many` that meets a corrupt record answers
/// `CorruptRecord` and writes nothing, not even the takeover of an expired
/// lease among its keys (the next claim is then attempt 2, not 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_failing_on_a_corrupt_record_writes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("nothing.db");
    let stores = handles(&db, 3).await;
    let mut bad = Vec::new();
    for (round, corrupt_first) in [(0, false), (1, true)] {
        let ns = format!("gb{round}");
        let slow = key(&ns, "slow");
        let l = match stores[0]
            .claim(&slow, &opts(Duration::from_millis(60)))
            .await
        {
            Ok(ClaimOutcome::Claimed(l)) => l,
            other => panic!("a fresh claim answered {other:?}"),
        };
        sleep_until_us(us(l.deadline) + 20_000).await;
        let before = raw_row(&db, &slow);
        plant_corrupt(&db, &ns, "corrupt");
        let fresh: Vec<Key> = (0..3).map(|i| key(&ns, format!("fresh{i}"))).collect();
        let mut batch = vec![
            fresh[0].clone(),
            slow.clone(),
            fresh[1].clone(),
            key(&ns, "corrupt"),
            fresh[2].clone(),
        ];
        if corrupt_first {
            batch.rotate_left(3);
        }
        match stores[1].claim_many(&batch, &opts(LONG)).await {
            Err(Error::CorruptRecord { .. }) => {}
            other => bad.push(format!(
                "a batch meeting a corrupt record answered {other:?}"
            )),
        }
        let after = raw_row(&db, &slow);
        if before != after {
            bad.push(format!(
                "{slow}: a claim_many that failed on a corrupt record still wrote it: {before:?} -> {after:?}"
            ));
        }
        for f in &fresh {
            if let Some(row) = raw_row(&db, f) {
                bad.push(format!("{f}: a failed batch left a row behind: {row:?}"));
            }
        }
        match stores[2].claim(&slow, &opts(LONG)).await {
            Ok(ClaimOutcome::Claimed(l2)) if l2.attempt == 2 => {}
            other => bad.push(format!(
                "{slow}: after a failed batch the takeover answered {other:?} (expected Claimed attempt 2)"
            )),
        }
    }
    assert!(
        bad.is_empty(),
        "{} violations:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
}

/// A batch that will fail on a corrupt record waits in the writer thread's
/// queue (the write lock held elsewhere) while other handles hammer its fresh
/// keys, one of them with the batch's own claim id. Nobody may see the failed
/// batch's claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_is_never_seen_half_done() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("half.db");
    let stores = handles(&db, 4).await;
    let log = Log::default();
    plant_corrupt(&db, "hd", "corrupt");
    let fresh: Vec<Key> = (0..6).map(|i| key("hd", format!("f{i}"))).collect();
    let mut batch_keys = fresh.clone();
    batch_keys.insert(3, key("hd", "corrupt"));
    let mut blocker = caller_conn(&db);
    let tx = blocker
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .expect("take the write lock");
    let batch = {
        let (log, s) = (log.clone(), stores[0].clone());
        tokio::spawn(async move {
            log.claim_many(
                &s,
                "batch",
                &batch_keys,
                &opts(LONG).with_claim_id(cid("batch-cid")),
            )
            .await
            .map(|v| v.len())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let st = dyns(&stores);
    let mut observers = Vec::new();
    for o in 0..3 {
        // observer0 carries the batch's claim id (the same logical caller
        // retrying) on half the keys, and works 400 ms before completing.
        let (keys, same, work) = if o == 0 {
            (
                fresh[..3].to_vec(),
                Some("batch-cid"),
                Duration::from_millis(400),
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
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.rollback().expect("let go of the write lock");
    let r = batch.await.expect("the batch task");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for o in observers {
        o.await.expect("an observer panicked");
    }
    assert!(
        matches!(r, Err(Error::CorruptRecord { .. })),
        "a batch meeting a corrupt record answered {r:?}"
    );
    assert_history("a failed batch and its observers", &log, LOOSE);
}

/// Twelve tasks on four handles call with timeouts of 0 to 4 ms (futures
/// dropped while queued, between a read and a write, or mid-write) while
/// another connection keeps taking and dropping the write lock. Whatever was
/// answered must fit the contract, no lease outlives its deadline, and
/// every handle still answers afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_leave_a_sound_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("cancel.db");
    let stores = handles(&db, 4).await;
    let st = dyns(&stores);
    let stop = Arc::new(AtomicBool::new(false));
    let locker = {
        let (db, stop) = (db.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut c = caller_conn(&db);
            while !stop.load(Ordering::Relaxed) {
                if let Ok(tx) = c.transaction_with_behavior(TransactionBehavior::Immediate) {
                    std::thread::sleep(Duration::from_millis(15));
                    let _ = tx.rollback();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let history = History::new(Duration::from_millis(5)).every_in_flight_seen();
    let storm = cancellation_storm_on(&st, 12, Duration::from_secs(3), &history).await;
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || locker.join()).await;
    if let Err(f) = storm
        .map(drop)
        .and_then(|()| history.verdict("cancellation storm"))
    {
        panic!("{f}");
    }
}
