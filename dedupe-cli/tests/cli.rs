//! The `dedupe` binary end to end.

use std::process::Command;

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
    let file = dir.path().join("race.db");
    let file = file.to_str().expect("utf-8 path");
    let (ok, out) = dedupe(&[
        "race",
        "--file",
        file,
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
    let (ok, out) = dedupe(&["race", "--file", file, "--events", "60", "--copies", "2"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("done before this run: 60; more than once: 0"),
        "{out}"
    );
    assert!(out.contains("claims won (work ran):     0"), "{out}");
    assert!(out.contains("duplicates answered:       120"), "{out}");
}

#[test]
fn conformance_report_on_memory() {
    let (ok, out) = dedupe(&["conformance", "--store", "memory"]);
    assert!(ok, "{out}");
    assert!(out.contains(&all_but_the_fault_check_passed()), "{out}");
}

/// The same race and the suite on a real PostgreSQL server; the schemas the
/// commands create are dropped when they end.
#[test]
fn race_and_conformance_on_postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        "postgres",
        "--url",
        &url,
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
    let (ok, out) = dedupe(&["conformance", "--store", "postgres", "--url", &url]);
    assert!(ok, "{out}");
    assert!(out.contains(&all_but_the_fault_check_passed()), "{out}");
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

#[test]
fn postgres_without_a_url_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .args(["race", "--store", "postgres"])
        .env_remove("DEDUPE_POSTGRES_URL")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --url or DEDUPE_POSTGRES_URL"));
}

#[test]
fn bad_arguments_are_refused() {
    let (ok, out) = dedupe(&["race", "--store", "oracle"]);
    assert!(!ok);
    assert!(out.contains("invalid value 'oracle'"), "{out}");
}

/// The report's closing line when every check passed but the one that needs a
/// fixture able to break its connection (the CLI's stores have none).
fn all_but_the_fault_check_passed() -> String {
    let n = dedupe_conformance::checks::CHECKS.len();
    format!(
        "{n} checks at full scale: {} passed, 1 skipped, 0 failed",
        n - 1
    )
}

/// The race and the suite on a Redis server the test starts; the keys the
/// commands write under their own prefix are deleted when they end.
#[test]
fn race_and_conformance_on_redis() {
    let (server, url) = dedupe_testkit::redis::server();
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        "redis",
        "--url",
        &url,
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
    let (ok, out) = dedupe(&["conformance", "--store", "redis", "--url", &url]);
    assert!(ok, "{out}");
    assert!(out.contains("durability: not persistent"), "{out}");
    let n = dedupe_conformance::checks::CHECKS.len();
    // Redis expires natively (no expire() count), and the CLI cannot cut its
    // connection: two checks are skipped, visibly.
    assert!(
        out.contains(&format!(
            "{n} checks at full scale: {} passed, 2 skipped, 0 failed",
            n - 2
        )),
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
    let (ok, out) = dedupe(&[
        "race",
        "--store",
        "dynamodb",
        "--url",
        &endpoint,
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
        "dynamodb",
        "--url",
        &endpoint,
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
        "memory",
        "--only",
        "no_such_check",
    ]);
    assert!(!ok);
    assert!(out.contains("no check is named \"no_such_check\""), "{out}");
}
