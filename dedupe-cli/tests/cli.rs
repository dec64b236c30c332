//! The `dedupe` binary end to end.

use std::process::Command;

#[path = "../../dedupe-http/examples/orders.rs"]
#[allow(dead_code)]
mod orders;

fn dedupe(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .args(args)
        .output()
        .expect("run dedupe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn race_on_sqlite_processes_every_event_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("race.db").display());
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        &url,
        "--events",
        "60",
        "--copies",
        "5",
        "--workers",
        "12",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("claims won (work ran):     60"), "{out}");
    assert!(out.contains("duplicates answered:       240"), "{out}");
    assert!(
        out.contains(
            "events whose work ran once: 60 of 60; done before this run: 0; more than once: 0"
        ),
        "{out}"
    );
    // The same file again: every event is now a duplicate and no work runs.
    let (ok, out) = dedupe(&["race", "--store", &url, "--events", "60", "--copies", "2"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("done before this run: 60; more than once: 0"),
        "{out}"
    );
    assert!(out.contains("claims won (work ran):     0"), "{out}");
    assert!(out.contains("duplicates answered:       120"), "{out}");

    // An operator's view of one of those records, then forgetting it.
    let (found, out) = dedupe(&["inspect", "--store", &url, "race", "evt_000007"]);
    assert!(found, "{out}");
    let record: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(record["state"], "done", "{out}");
    // The Deduper's framing byte (0x01: the work succeeded), then its bytes.
    assert_eq!(record["outcome"], "\u{1}done 7", "{out}");
    assert_eq!(record["attempts"], 1, "{out}");
    let (existed, out) = dedupe(&["forget", "--store", &url, "race", "evt_000007"]);
    assert!(existed, "{out}");
    let (found, out) = dedupe(&["inspect", "--store", &url, "race", "evt_000007"]);
    assert!(!found, "{out}");
    assert_eq!(out.trim(), "null");
    let (existed, _) = dedupe(&["forget", "--store", &url, "race", "evt_000007"]);
    assert!(!existed, "a second forget finds nothing");
    // Nothing has expired yet: purge removes nothing.
    let (ok, out) = dedupe(&["purge", "--store", &url]);
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "0");
}

/// Every check through the command, at reduced scale: the plumbing and the
/// report are what this shows (the memory store's own tests run the suite
/// at full scale).
#[test]
fn conformance_report_on_memory() {
    let (ok, out) = dedupe(&["conformance", "--store", "memory:", "--scale", "reduced"]);
    assert!(ok, "{out}");
    assert!(out.contains(&all_but_the_fault_check_passed()), "{out}");
}

/// Checks enough to show the plumbing (the suite itself runs in each store's
/// own tests).
const SOME_CHECKS: [&str; 6] = [
    "--only",
    "fresh_claim",
    "--only",
    "single_winner_race",
    "--only",
    "expire_removes_exactly_expired",
];

fn some_checks_passed(out: &str) -> bool {
    out.contains("3 checks at full scale: 3 passed, 0 skipped, 0 failed")
}

/// The same race and some checks on a real PostgreSQL server; the schemas the
/// commands create are dropped when they end.
#[test]
fn race_and_conformance_on_postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        &url,
        "--fresh",
        "--events",
        "40",
        "--copies",
        "4",
        "--workers",
        "8",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("claims won (work ran):     40"), "{out}");
    assert!(out.contains("duplicates answered:       120"), "{out}");
    let mut args = vec!["conformance", "--store", &url];
    args.extend(SOME_CHECKS);
    let (ok, out) = dedupe(&args);
    assert!(ok, "{out}");
    assert!(some_checks_passed(&out), "{out}");
    let left = Command::new("psql")
        .args([
            url.as_str(),
            "-Atc",
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'dedupe_cli_%'",
        ])
        .output()
        .expect("psql");
    assert_eq!(
        String::from_utf8_lossy(&left.stdout).trim(),
        "0",
        "the commands left schemas behind"
    );
}

/// The race and some checks on a private MariaDB, by `mysql://` and
/// `mariadb://` URLs; the tables the commands create are dropped when they
/// end.
#[test]
fn race_and_conformance_on_mariadb() {
    let (server, url) = dedupe_testkit::mysql_server();
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        &url,
        "--fresh",
        "--events",
        "40",
        "--copies",
        "4",
        "--workers",
        "8",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("claims won (work ran):     40"), "{out}");
    assert!(out.contains("duplicates answered:       120"), "{out}");
    let mariadb = url.replacen("mysql://", "mariadb://", 1);
    let mut args = vec!["conformance", "--store", &mariadb];
    args.extend(SOME_CHECKS);
    let (ok, out) = dedupe(&args);
    assert!(ok, "{out}");
    assert!(some_checks_passed(&out), "{out}");

    // The operator's commands on a table of its own.
    let table = format!("ops_{}", std::process::id());
    let ops = format!("{url}?table={table}");
    let (ok, out) = dedupe(&["race", "--store", &ops, "--events", "10", "--copies", "2"]);
    assert!(ok, "{out}");
    let (found, out) = dedupe(&["inspect", "--store", &ops, "race", "evt_000007"]);
    assert!(found, "{out}");
    let record: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(record["state"], "done", "{out}");
    let (existed, out) = dedupe(&["forget", "--store", &ops, "race", "evt_000007"]);
    assert!(existed, "{out}");
    let (found, out) = dedupe(&["inspect", "--store", &ops, "race", "evt_000007"]);
    assert!(!found, "{out}");
    assert_eq!(out.trim(), "null");
    let (ok, out) = dedupe(&["purge", "--store", &ops]);
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "0");
    // The inbox, on this store too: nothing accepted, nothing counted.
    let (ok, out) = dedupe(&[
        "inbox",
        "stats",
        "--store",
        &ops,
        "--namespace",
        "race",
        "--json",
    ]);
    assert!(ok, "{out}");
    let stats: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        (&stats[0]["pending"], &stats[0]["dead"]),
        (&0.into(), &0.into()),
        "{out}"
    );
    if let Some(server) = server {
        server.sql(&format!(
            "DROP TABLE IF EXISTS test.{table}, test.{table}_paused"
        ));
        let left = server.sql(
            "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'dedupe_cli_%'",
        );
        assert_eq!(left.trim(), "0", "the commands left tables behind");
    }
}

/// User mistakes are one line, exit code 2, and never show a password.
#[test]
fn store_url_mistakes_are_one_clear_line() {
    for (url, says) in [
        ("oracle://db", "unknown store scheme \"oracle\""),
        ("sqlite:?tabel=x", "no option \"tabel\""),
        ("memory:?lease=10", "must be a number with a unit"),
        (
            "postgres://app:s3cret@127.0.0.1:1/db?bogus=1",
            "no option \"bogus\"",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
            .args(["race", "--store", url])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {err}");
        assert!(err.contains(says), "{url}: {err}");
        assert!(!err.contains("s3cret"), "{url}: {err}");
        assert!(!err.contains("panicked"), "{url}: {err}");
    }
    // A server that is not there: one line, the password hidden.
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .args([
            "purge",
            "--store",
            "postgres://app:s3cret@127.0.0.1:1/db?timeout=2s",
        ])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

#[test]
fn bad_arguments_are_refused() {
    let (ok, out) = dedupe(&["race", "--workers", "many"]);
    assert!(!ok);
    assert!(out.contains("invalid value 'many'"), "{out}");
}

/// The report's closing line when every check passed but the two that need a
/// fixture able to break its connection or lose an answer (the CLI's stores
/// have none).
fn all_but_the_fault_check_passed() -> String {
    let n = dedupe_conformance::checks::CHECKS.len();
    format!(
        "{n} checks at reduced scale (an emulator): {} passed, 2 skipped, 0 failed",
        n - 2
    )
}

/// The race and some checks on a Redis server the test starts; the keys the
/// commands write under their own prefix are deleted when they end.
#[test]
fn race_and_conformance_on_redis() {
    let (server, url) = dedupe_testkit::redis::server();
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        &url,
        "--fresh",
        "--events",
        "40",
        "--copies",
        "4",
        "--workers",
        "8",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("claims won (work ran):     40"), "{out}");
    assert!(out.contains("duplicates answered:       120"), "{out}");
    let mut args = vec!["conformance", "--store", &url];
    args.extend(SOME_CHECKS);
    let (ok, out) = dedupe(&args);
    assert!(ok, "{out}");
    assert!(out.contains("durability: not persistent"), "{out}");
    assert!(out.contains("evicted_keys 0"), "{out}");
    // Redis expires records itself: expire() removes nothing, visibly skipped.
    assert!(
        out.contains("3 checks at full scale: 2 passed, 1 skipped, 0 failed"),
        "{out}"
    );
    if let Some(server) = server {
        let left = Command::new("redis-cli")
            .args(["-p", &server.port.to_string(), "DBSIZE"])
            .output()
            .expect("redis-cli");
        assert_eq!(
            String::from_utf8_lossy(&left.stdout).trim(),
            "0",
            "the commands left keys behind"
        );
    }
}

/// The race and two checks of the suite on moto, through the CLI's DynamoDB
/// store; the tables the commands create are deleted when they end.
#[test]
fn race_and_conformance_on_dynamodb() {
    use dedupe_testkit::dynamo::{dynamo_server, list_tables, Emulator};
    let (server, endpoint) = dynamo_server(Emulator::Moto);
    let url = format!("dynamodb://dedupe_cli?endpoint={endpoint}");
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        &url,
        "--fresh",
        "--events",
        "20",
        "--copies",
        "3",
        "--workers",
        "6",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("claims won (work ran):     20"), "{out}");
    assert!(out.contains("duplicates answered:       40"), "{out}");
    let (ok, out) = dedupe(&[
        "conformance",
        "--store",
        &url,
        "--scale",
        "reduced",
        "--only",
        "fresh_claim",
        "--only",
        "single_winner_race",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("2 checks at reduced scale (an emulator): 2 passed, 0 skipped, 0 failed"),
        "{out}"
    );
    if let Some(server) = server {
        let tables: String = list_tables(server.port)
            .expect("ListTables")
            .split_whitespace()
            .collect();
        assert!(
            tables.contains("\"TableNames\":[]"),
            "the commands left tables behind: {tables}"
        );
    }
}

#[test]
fn an_unknown_check_is_a_clear_error() {
    let (ok, out) = dedupe(&[
        "conformance",
        "--store",
        "memory:",
        "--only",
        "no_such_check",
    ]);
    assert!(!ok);
    assert!(out.contains("no check is named \"no_such_check\""), "{out}");
}

/// The JSON a `bench --json` printed: `{"rows": [...], "purges": [...]}`.
fn bench_json(out: &str) -> serde_json::Value {
    let start = out.find('{').expect("a JSON object");
    serde_json::Deserializer::from_str(&out[start..])
        .into_iter::<serde_json::Value>()
        .next()
        .expect("JSON")
        .expect("JSON")
}

fn bench_rows(out: &str) -> Vec<serde_json::Value> {
    bench_json(out)["rows"].as_array().expect("rows").clone()
}

/// The benchmark on the default stores, briefly: every row has figures for
/// the store and its raw driver, no errors, and the files are written.
#[test]
fn bench_on_the_default_stores() {
    let dir = tempfile::tempdir().expect("dir");
    let out_dir = dir.path().join("results");
    let (ok, out) = dedupe(&[
        "bench",
        "--workload",
        "claim,duplicate,cycle,batch,mixed",
        "--concurrency",
        "1,4",
        "--duration",
        "150ms",
        "--warmup",
        "30ms",
        "--done-keys",
        "50",
        "--prefill",
        "200",
        "--purge",
        "300",
        "--json",
        "--out",
        out_dir.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{out}");
    let purges = bench_json(&out)["purges"]
        .as_array()
        .expect("purges")
        .clone();
    assert_eq!(purges.len(), 2, "{out}");
    for purge in &purges {
        assert_eq!(
            purge["removed"], 300,
            "every expired record purged: {purge}"
        );
        assert_eq!(purge["errors"], 0, "{purge}");
        assert!(
            purge["claims_per_sec"].as_f64().unwrap_or(0.0) > 0.0,
            "{purge}"
        );
    }
    let rows = bench_rows(&out);
    assert_eq!(rows.len(), 2 * 5 * 2, "{out}");
    for row in &rows {
        assert!(row["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        assert!(
            row["raw_ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0,
            "{row}"
        );
        assert_eq!(row["errors"], 0, "{row}");
        assert_eq!(row["raw_errors"], 0, "{row}");
        assert!(row["p99_us"].as_u64().unwrap_or(0) >= row["p50_us"].as_u64().unwrap_or(0));
        assert_eq!(row["stored_keys"], 200, "{row}");
    }
    let csv = std::fs::read_to_string(out_dir.join("results.csv")).expect("csv");
    assert_eq!(csv.lines().count(), rows.len() + 1, "{csv}");
    assert!(out_dir.join("results.json").is_file());
    for chart in ["throughput.svg", "latency.svg"] {
        let svg = std::fs::read_to_string(out_dir.join(chart)).expect(chart);
        assert!(
            svg.contains("<svg") && svg.contains("sqlite claim"),
            "{chart}"
        );
    }
}

/// The start workload runs real workers on each default store: every item
/// accepted is started (no errors), one row per store and concurrency, and
/// no raw side.
#[test]
fn bench_start_rows_on_the_default_stores() {
    let (ok, out) = dedupe(&[
        "bench",
        "--workload",
        "start",
        "--concurrency",
        "1,2",
        "--duration",
        "400ms",
        "--warmup",
        "50ms",
        "--json",
    ]);
    assert!(ok, "{out}");
    let rows = bench_rows(&out);
    assert_eq!(rows.len(), 2 * 2, "{out}");
    for row in &rows {
        assert_eq!(row["workload"], "start", "{row}");
        assert!(row["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
        assert!(row["raw_ops_per_sec"].is_null(), "{row}");
        assert!(row["p99_us"].as_u64().unwrap_or(0) >= row["p50_us"].as_u64().unwrap_or(0));
    }
}

/// The benchmark's raw drivers and stores on every server kind: Postgres,
/// MariaDB, Redis (standalone) and DynamoDB (moto), briefly.
#[test]
fn bench_on_every_server() {
    use dedupe_testkit::dynamo::{dynamo_server, Emulator};
    let (_pg, pg) = dedupe_testkit::postgres_server();
    let (_redis, redis) = dedupe_testkit::redis::server();
    let (_moto, endpoint) = dynamo_server(Emulator::Moto);
    let (_mariadb, mysql) = dedupe_testkit::mysql_server();
    let dynamo = format!("dynamodb://bench?endpoint={endpoint}");
    let (ok, out) = dedupe(&[
        "bench",
        "--store",
        &pg,
        "--store",
        &mysql,
        "--store",
        &redis,
        "--store",
        &dynamo,
        "--workload",
        "claim,duplicate,batch",
        "--concurrency",
        "2",
        "--duration",
        "150ms",
        "--warmup",
        "30ms",
        "--done-keys",
        "10",
        "--batch",
        "4",
        "--json",
    ]);
    assert!(ok, "{out}");
    let rows = bench_rows(&out);
    assert_eq!(rows.len(), 4 * 3, "{out}");
    for row in &rows {
        assert!(row["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        assert!(
            row["raw_ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0,
            "{row}"
        );
        assert_eq!(row["errors"], 0, "{row}");
        assert_eq!(row["raw_errors"], 0, "{row}");
    }
}

/// The soak command runs, judges its epochs and reports (the real soak is a
/// command run outside the test suite, for minutes: README).
#[test]
fn a_short_soak_on_sqlite_reports_no_violation() {
    let (ok, out) = dedupe(&[
        "soak",
        "--store",
        "sqlite:",
        "--seconds",
        "3",
        "--epoch-seconds",
        "1",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("0 contract violations, 0 acknowledged completions lost"),
        "{out}"
    );
    let judged: u64 = out
        .split(" epochs judged")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(judged >= 2, "{out}");
}

/// A Redis server that may evict records is refused with the setting named,
/// unless the URL opts in; on `noeviction` it opens.
#[test]
fn inspect_refuses_a_redis_server_that_may_evict() {
    let server = dedupe_testkit::redis::RedisServer::start();
    let url = server.url();
    let config = |name: &str, value: &str| {
        let port = url.rsplit(':').next().expect("port").trim_end_matches("/0");
        let out = Command::new("redis-cli")
            .args(["-p", port, "CONFIG", "SET", name, value])
            .output()
            .expect("redis-cli");
        assert!(out.status.success(), "{out:?}");
    };
    config("maxmemory", "4mb");
    config("maxmemory-policy", "allkeys-lru");
    let inspect = |url: &str| dedupe(&["inspect", "--store", url, "stripe", "evt_1"]);
    let (found, out) = inspect(&url);
    assert!(!found, "{out}");
    assert!(out.contains("maxmemory-policy allkeys-lru"), "{out}");
    assert!(out.contains("noeviction"), "{out}");
    // Opened: the record is looked up, and is not there.
    let (_, out) = inspect(&format!("{url}?allow_eviction=true"));
    assert_eq!(out.trim(), "null", "{out}");
    config("maxmemory-policy", "noeviction");
    let (_, out) = inspect(&url);
    assert_eq!(out.trim(), "null", "{out}");
}

/// The commands that read records or remove them, on `url`.
fn readers(url: &str) -> [Vec<&str>; 5] {
    [
        vec!["inspect", "--store", url, "stripe", "evt_1"],
        vec!["forget", "--store", url, "stripe", "evt_1"],
        vec!["purge", "--store", url],
        vec!["inbox", "list", "--store", url],
        vec!["inbox", "stats", "--store", url],
    ]
}

/// Every reader on `url`, which names `what` that is not there, fails
/// naming it and saying how to make it, and `made()` stays false;
/// `dedupe migrate` makes it, and the readers then answer.
fn readers_create_nothing(url: &str, what: &str, made: &dyn Fn() -> bool) {
    for args in readers(url) {
        let (ok, out) = dedupe(&args);
        assert!(!ok, "{args:?} answered on a missing store: {out}");
        assert!(
            out.contains(what) && out.contains("dedupe migrate --store"),
            "{args:?} did not name {what}: {out}"
        );
        assert!(!made(), "{args:?} made {what}");
    }
    let (ok, out) = dedupe(&["migrate", "--store", url]);
    assert!(ok, "{out}");
    assert!(made(), "migrate did not make {what}: {out}");
    let (found, out) = dedupe(&["inspect", "--store", url, "stripe", "evt_1"]);
    assert!(!found, "{out}");
    assert_eq!(out.trim(), "null", "{out}");
}

/// A SQLite path with a typo, and a file without the store's table.
#[test]
fn readers_create_no_sqlite_file_or_table() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("typo.db");
    let url = format!("sqlite://{}", file.display());
    readers_create_nothing(&url, "no SQLite file at", &|| file.exists());

    let other = dir.path().join("app.db");
    dedupe_sqlite::rusqlite::Connection::open(&other)
        .and_then(|c| c.execute_batch("CREATE TABLE app (x)"))
        .expect("an app's file");
    let tables = || {
        dedupe_sqlite::rusqlite::Connection::open(&other)
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'typo_records'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .expect("read the app's file")
    };
    let url = format!("sqlite://{}?table=typo_records", other.display());
    readers_create_nothing(&url, "no table \"typo_records\"", &|| tables() == 1);
    let (ok, out) = dedupe(&["inspect", "--store", "sqlite:", "stripe", "evt_1"]);
    assert!(!ok && out.contains("temporary file"), "{out}");
}

/// A Postgres schema and a MariaDB table with a typo.
#[test]
fn readers_create_no_postgres_schema_or_mysql_table() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let cluster = dedupe_testkit::PgCluster::start();
    let pg = cluster.url("postgres");
    let schemas = || {
        runtime.block_on(async {
            let pool = dedupe_postgres::sqlx::PgPool::connect(&pg).await.expect("pg");
            dedupe_postgres::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'typo_schema'",
            )
            .fetch_one(&pool)
            .await
            .expect("schemas")
        })
    };
    readers_create_nothing(
        &format!("{pg}?schema=typo_schema"),
        "no schema \"typo_schema\"",
        &|| schemas() == 1,
    );
    // A database that is not there: the server's own words.
    let (ok, out) = dedupe(&["inspect", "--store", &cluster.url("typo_db"), "s", "e"]);
    assert!(
        !ok && out.contains("database \"typo_db\" does not exist"),
        "{out}"
    );
    // A table of its own name in `public` (`?table=`).
    let tables = || {
        runtime.block_on(async {
            let pool = dedupe_postgres::sqlx::PgPool::connect(&pg)
                .await
                .expect("pg");
            dedupe_postgres::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.tables \
                 WHERE table_schema = 'public' AND table_name = 'typo_records'",
            )
            .fetch_one(&pool)
            .await
            .expect("tables")
        })
    };
    readers_create_nothing(
        &format!("{pg}?table=typo_records"),
        "no table \"public\".\"typo_records\"",
        &|| tables() == 1,
    );

    let server = dedupe_testkit::MariaDbServer::start();
    let maria = server.url("test");
    let tables = || {
        runtime.block_on(async {
            let pool = dedupe_mysql::sqlx::MySqlPool::connect(&maria)
                .await
                .expect("mariadb");
            dedupe_mysql::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'typo_records'",
            )
            .fetch_one(&pool)
            .await
            .expect("tables")
        })
    };
    let (ok, out) = dedupe(&["inspect", "--store", &server.url("typo_db"), "s", "e"]);
    assert!(!ok && out.contains("Unknown database 'typo_db'"), "{out}");
    readers_create_nothing(
        &format!("{maria}?table=typo_records"),
        "no table `typo_records`",
        &|| tables() == 1,
    );
}

/// A DynamoDB table with a typo, on DynamoDB Local.
#[test]
fn readers_create_no_dynamodb_table() {
    use dedupe_testkit::dynamo::{dynamo_server, list_tables, Emulator};
    let (_server, endpoint) = dynamo_server(Emulator::DynamoDbLocal);
    let port: u16 = endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("a port in the endpoint");
    let url = format!("dynamodb://typo_table?endpoint={endpoint}");
    readers_create_nothing(&url, "no DynamoDB table typo_table", &|| {
        list_tables(port)
            .expect("ListTables")
            .contains("\"typo_table\"")
    });
}

/// Redis keys need no schema: the readers answer on an empty server, and
/// write no key.
#[test]
fn readers_write_no_redis_key() {
    let server = dedupe_testkit::redis::RedisServer::start();
    let url = server.url();
    for args in readers(&url) {
        let (_, out) = dedupe(&args);
        assert!(!out.contains("error"), "{args:?}: {out}");
    }
    let port = url.rsplit(':').next().expect("port").trim_end_matches("/0");
    let keys = Command::new("redis-cli")
        .args(["-p", port, "DBSIZE"])
        .output()
        .expect("redis-cli");
    assert_eq!(String::from_utf8_lossy(&keys.stdout).trim(), "0");
}

/// An `Idempotency-Key` record made by the orders example, found by `dedupe
/// inspect` from what an operator knows of the request (caller, method,
/// path, key) and shown as the response it keeps: status, headers and the
/// JSON body as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_finds_an_idempotency_key_record_from_the_request() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("orders.db");
    let store = dedupe_sqlite::SqliteStore::open(&file)
        .await
        .expect("store");
    let (router, _) = orders::app(std::sync::Arc::new(store));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let created = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .bearer_auth("alice")
        .header("idempotency-key", "order-7")
        .json(&serde_json::json!({ "item": "book" }))
        .send()
        .await
        .expect("POST /orders");
    assert_eq!(created.status(), 201);
    let body = created.text().await.expect("body");

    let url = format!("sqlite://{}", file.display());
    let inspect = |extra: &[&str]| {
        let mut args = vec![
            "inspect",
            "--store",
            &url,
            "orders",
            "--idempotency-key",
            "order-7",
        ];
        args.extend(extra);
        dedupe(&args)
    };
    let (found, out) = inspect(&["--path", "/orders", "--scope", "alice"]);
    assert!(found, "{out}");
    let record: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(record["state"], "done", "{out}");
    assert_eq!(record["response"]["status"], 201, "{out}");
    assert_eq!(record["response"]["body"], body.as_str(), "{out}");
    assert_eq!(
        record["response"]["headers"]["content-type"], "application/json",
        "{out}"
    );
    // Another caller's key, another path: not this record.
    let (found, out) = inspect(&["--path", "/orders", "--scope", "bob"]);
    assert!(!found && out.trim() == "null", "{out}");
    let (found, _) = inspect(&["--path", "/order", "--scope", "alice"]);
    assert!(!found);
    let (ok, out) = inspect(&["--path", "orders?x=1", "--scope", "alice"]);
    assert!(!ok && out.contains("--path"), "{out}");
}

/// `dedupe records` on `url` after a race left 12 done records in the
/// namespace `race`: pages of 5 followed by their cursors list each record
/// once (a scanning store's pages may be shorter or longer), and the state
/// and age filters hold.
fn records_are_listed_a_page_at_a_time(url: &str) {
    let (ok, out) = dedupe(&["race", "--store", url, "--events", "12", "--copies", "2"]);
    assert!(ok, "{out}");
    // An inbox item in the same namespace: `dedupe inbox list`'s, not a record.
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async {
            let opener = dedupe_url::Opener::new(url.parse().expect("url"))
                .await
                .expect("open");
            let inbox = opener
                .inbox_handle()
                .await
                .expect("open")
                .expect("an inbox");
            let key = dedupe_core::Key::new("race", "an_item").expect("key");
            inbox.accept(&key, b"{}").await.expect("accept");
        });
    let page = |extra: &[&str]| {
        let mut args = vec!["records", "--store", url, "--namespace", "race"];
        args.extend(extra);
        let (ok, out) = dedupe(&args);
        assert!(ok, "{args:?}: {out}");
        serde_json::from_str::<serde_json::Value>(&out).expect("JSON")
    };
    let ids = |page: &serde_json::Value| -> Vec<String> {
        page["records"]
            .as_array()
            .expect("records")
            .iter()
            .map(|r| r["id"].as_str().expect("id").to_string())
            .collect()
    };
    let (mut seen, mut cursor, mut pages) = (Vec::new(), None::<String>, 0);
    loop {
        let mut extra = vec!["--limit", "5"];
        if let Some(cursor) = &cursor {
            extra.extend(["--after", cursor.as_str()]);
        }
        let answered = page(&extra);
        seen.extend(ids(&answered));
        pages += 1;
        assert!(pages < 100, "the pages never end");
        match answered["next"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    seen.sort();
    let expected: Vec<String> = (0..12).map(|i| format!("evt_{i:06}")).collect();
    assert_eq!(
        seen, expected,
        "{url}: each record once, over {pages} pages"
    );
    assert_eq!(ids(&page(&["--all", "--state", "done"])).len(), 12);
    assert!(ids(&page(&["--all", "--state", "in_flight"])).is_empty());
    assert_eq!(ids(&page(&["--all", "--since", "1h"])).len(), 12);
    let done = page(&["--all", "--limit", "1000"]);
    assert_eq!(done["records"][0]["state"], "done", "{done}");
    assert_eq!(done["next"], serde_json::Value::Null);
}

#[test]
fn records_on_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("records.db").display());
    records_are_listed_a_page_at_a_time(&url);
}

#[test]
fn records_on_postgres_and_mariadb() {
    let cluster = dedupe_testkit::PgCluster::start();
    records_are_listed_a_page_at_a_time(&cluster.url("postgres"));
    let server = dedupe_testkit::MariaDbServer::start();
    records_are_listed_a_page_at_a_time(&server.url("test"));
}

#[test]
fn records_on_redis_and_dynamodb_local() {
    let redis = dedupe_testkit::redis::RedisServer::start();
    records_are_listed_a_page_at_a_time(&redis.url());
    use dedupe_testkit::dynamo::{dynamo_server, Emulator};
    let (_server, endpoint) = dynamo_server(Emulator::DynamoDbLocal);
    records_are_listed_a_page_at_a_time(&format!("dynamodb://records?endpoint={endpoint}"));
}

/// The ordered workload on the default stores: items under 64 ordering keys
/// taken and completed by four tasks, with no error and no raw row (raw
/// drivers keep no ordering keys), beside the plain work row.
#[test]
fn bench_ordered_rows_on_the_default_stores() {
    let (ok, out) = dedupe(&[
        "bench",
        "--workload",
        "work,ordered",
        "--concurrency",
        "4",
        "--duration",
        "200ms",
        "--warmup",
        "30ms",
        "--inbox-items",
        "400",
        "--json",
    ]);
    assert!(ok, "{out}");
    let rows = bench_rows(&out);
    let ordered: Vec<_> = rows
        .iter()
        .filter(|row| row["workload"] == "ordered")
        .collect();
    assert_eq!(ordered.len(), 2, "{out}");
    for row in ordered {
        assert!(row["ops_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
        assert!(row["raw_ops_per_sec"].is_null(), "{row}");
    }
}
