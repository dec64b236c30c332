//! `dedupe`: benchmark, race, check and inspect dedupe stores, each given by
//! URL (`memory:`, `sqlite://...`, `postgres://...`, `redis://...`,
//! `redis+cluster://...`, `dynamodb://...`; see dedupe-url).

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};

mod bench;
mod conformance;
mod inbox;
mod race;
mod records;
mod serve;
mod soak;
mod trace;

#[derive(Parser, Debug)]
#[command(
    name = "dedupe",
    version,
    about = "Process each webhook event once: benchmark, race, check and inspect dedupe stores",
    after_help = "Stores are URLs: memory:, sqlite:[//PATH], postgres://USER@HOST/DB[?schema=S], \
                  redis://HOST:PORT/N[?prefix=P], rediss://..., redis+cluster://HOST:PORT,HOST:PORT, \
                  dynamodb://TABLE[?region=R&endpoint=URL]; every scheme also takes timeout=, \
                  lease= and retention= (250ms, 30s, 5m, 2h, 7d)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure stores side by side, each against its raw driver doing the same
    /// work with its minimal atomic primitive (default: memory: and a SQLite
    /// file in a temporary directory).
    Bench(bench::BenchArgs),
    /// Deliver every event several times, copies at the same instant and later
    /// retries, through the Deduper on one store; report what happened and check
    /// that every event's work ran exactly once.
    Race(race::RaceArgs),
    /// Run the conformance suite against a store and print the report; exit 1
    /// when a check fails.
    Conformance(conformance::ConformanceArgs),
    /// Receive webhooks on a store: verify, derive the key, claim, run a
    /// business step that appends a ledger row, complete (POST /hooks,
    /// POST /hooks/{source}, GET /hooks, GET /healthz, GET /metrics).
    Serve(Box<serve::ServeArgs>),
    /// Minutes of mixed claims, duplicates, completions, releases, expiring and
    /// stalled leases on one store, memory and sockets sampled every second,
    /// every answer checked against the contract; exit 1 on any double win or
    /// lost completion (a soak run, outside the test suite).
    Soak(soak::SoakArgs),
    /// Create the store's file, schema and tables, or bring them to the
    /// current migration (safe to run again, and from several processes).
    /// The commands below never do: a store they cannot find is an error.
    Migrate(records::StoreArgs),
    /// List the live records, a page at a time (namespace, state, age):
    /// JSON with the cursor of the next page.
    Records(records::RecordsArgs),
    /// Print a key's live record as JSON (exit 1 when there is none).
    Inspect(records::InspectArgs),
    /// Remove every expired record and print how many (for cron).
    Purge(records::StoreArgs),
    /// Remove a key's record whatever its state, so its next delivery runs
    /// (exit 1 when there was none).
    Forget(records::KeyArgs),
    /// The inbox's items: list them, replay a dead one, forget one, count
    /// them per state.
    Inbox {
        #[command(subcommand)]
        command: inbox::InboxCommand,
    },
}

/// Parses `--store` here rather than in clap, whose error would repeat the
/// URL, password included.
pub fn store_url(text: &str) -> Result<dedupe_url::StoreUrl, dedupe_core::Error> {
    text.parse()
        .map_err(|e: dedupe_url::UrlError| dedupe_core::Error::config(format!("--store: {e}")))
}

/// A namespace (table, schema, prefix) no other run uses.
pub fn fresh_namespace() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("dedupe_cli_{}_{nanos}", std::process::id())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Spans of every store call, for RUST_LOG=dedupe=debug and the like;
    // exported over OTLP when an endpoint is configured (trace.rs).
    let _tracing = trace::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::bench(args).await,
        Command::Race(args) => race::race(args).await,
        Command::Conformance(args) => conformance::conformance(args).await,
        Command::Serve(args) => serve::serve(*args).await,
        Command::Soak(args) => soak::soak(args).await,
        Command::Migrate(args) => records::migrate(args).await,
        Command::Inspect(args) => records::inspect(args).await,
        Command::Records(args) => records::records(args).await,
        Command::Purge(args) => records::purge(args).await,
        Command::Forget(args) => records::forget(args).await,
        Command::Inbox { command } => inbox::inbox(command).await,
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
