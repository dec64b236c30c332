//! `dedupe serve`'s flags.

use std::net::SocketAddr;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The store, as a URL (default: a SQLite file dedupe-serve.db here).
    #[arg(long, value_name = "URL", default_value = "sqlite://dedupe-serve.db")]
    pub(super) store: String,
    /// Address to listen on for deliveries (port 0: any free port; the
    /// address is printed).
    #[arg(long, default_value = "127.0.0.1:8471")]
    pub(super) listen: SocketAddr,
    /// Address of the admin surface: the dashboard (`/ui`), the JSON API
    /// (`/api`), the ledger (`GET /hooks`, paginated with `?limit=&after=`),
    /// the metrics (`GET /metrics`, Prometheus) and `GET /healthz`. Once any
    /// secret is configured the ledger and metrics are served only here. A
    /// loopback address unless the surface has a token (--admin-token-file,
    /// or DEDUPE_ADMIN_TOKEN).
    #[arg(long, value_name = "ADDR")]
    pub(super) admin_listen: Option<SocketAddr>,
    /// A file holding the admin surface's bearer token (else the variable
    /// DEDUPE_ADMIN_TOKEN; never on the command line): every admin route but
    /// /healthz then wants `Authorization: Bearer <token>`, or the
    /// dashboard's session cookie, set by signing in with it at /ui/login.
    #[arg(long, value_name = "PATH", requires = "admin_listen")]
    pub(super) admin_token_file: Option<std::path::PathBuf>,
    /// A named route: `NAME=PROVIDER` (stripe, github, shopify, standard)
    /// serves `/hooks/NAME` with that provider's key rule and signature
    /// scheme, keyed in its own namespace NAME: two routes of one provider are
    /// two consumers, and each runs its own handler for every event.
    #[arg(long = "route", value_name = "NAME=PROVIDER")]
    pub(super) routes: Vec<String>,
    /// How long the business step takes, to widen race windows (in inbox
    /// mode: on the worker).
    #[arg(long, default_value_t = 0)]
    pub(super) work_ms: u64,
    /// Inbox mode: each verified delivery is stored in the store's inbox and
    /// answered 202 at once (a resend of a known event 200, nothing run); the
    /// business step runs on workers in this process, retried with a backoff
    /// and dead after --max-attempts (see `dedupe inbox`).
    #[arg(long)]
    pub(super) inbox: bool,
    /// Inbox mode: items worked at once, per route.
    #[arg(long, value_name = "N", default_value_t = 8, requires = "inbox")]
    pub(super) workers: usize,
    /// The lease of a claim (or, in inbox mode, of a taken item), in
    /// milliseconds, extended while the step runs (default: the URL's
    /// `lease=`, else 60 s).
    #[arg(long, value_name = "MS")]
    pub(super) lease_ms: Option<u64>,
    /// Inbox mode: attempts before an item is dead, stored with each item it
    /// accepts (a server started with another value agrees on that item).
    #[arg(long, value_name = "N", default_value_t = 8, requires = "inbox")]
    pub(super) max_attempts: u32,
    /// Inbox mode: the delay after an item's first failure, in milliseconds;
    /// it doubles per attempt (jittered, at most 10 minutes).
    #[arg(long, value_name = "MS", default_value_t = 1000, requires = "inbox")]
    pub(super) retry_backoff_ms: u64,
    /// Inbox mode: how long after its accept an item may still be snoozed
    /// (a snooze spends no attempt; past this window it counts as a failure,
    /// so an item that snoozes forever still ends dead).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 86_400,
        requires = "inbox"
    )]
    pub(super) max_snooze_secs: u64,
    /// Inbox mode: how long a dead item is kept for an operator to replay,
    /// in seconds, before `dedupe purge` (`expire()`) may remove it; 0 keeps
    /// dead items until they are replayed or forgotten. Default 35 days.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 35 * 86_400,
        requires = "inbox",
        value_parser = clap::value_parser!(u64).range(0..=10 * 365 * 86_400)
    )]
    pub(super) dead_retention_secs: u64,
    /// Inbox mode: the longest an idle worker waits before looking for work
    /// when nothing woke it, in milliseconds: what a missed wake-up costs at
    /// most. By default 2000 on Postgres and Redis (every process's accepts
    /// wake the workers), 250 otherwise (SQLite, MySQL and memory wake only
    /// this process's workers; DynamoDB backs off to 2000 while idle).
    #[arg(long, value_name = "MS", requires = "inbox", value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub(super) poll_ms: Option<u64>,
    /// Inbox mode: how often the queue's gauges (`dedupe_inbox_items`, the
    /// oldest due item's age, paused) are read from the store, in
    /// milliseconds; a scrape reads the last values, never the store.
    #[arg(long, value_name = "MS", default_value_t = 10_000, requires = "inbox",
          value_parser = clap::value_parser!(u64).range(50..=3_600_000))]
    pub(super) gauges_every_ms: u64,
    /// Inbox mode: the JSON pointer (RFC 6901) of each event's ordering key,
    /// e.g. `/data/object/id` for Stripe: events with the same value are
    /// processed one at a time, in the order they were accepted (an event
    /// without one runs unordered). Needs SQLite, Postgres or MySQL.
    #[arg(long, value_name = "JSON_POINTER", requires = "inbox", value_parser = json_pointer)]
    pub(super) order_by: Option<String>,
    /// Inbox mode, with --order-by: a dead event does not hold back the
    /// later events of its key (by default they wait until it is replayed
    /// and done, or forgotten).
    #[arg(long, requires = "order_by")]
    pub(super) skip_dead: bool,
    /// A signing secret: `ROUTE=SECRET`, where ROUTE is `stripe`, `github`,
    /// `shopify`, `standard` (for /hooks and /hooks/standard) or a --route
    /// name (which otherwise takes its provider's secret); a bare secret is a
    /// Standard Webhooks one. Repeat for rotation. Visible to `ps`: prefer
    /// --secret-file or DEDUPE_SECRET_{ROUTE} variables.
    #[arg(long = "secret", value_name = "[ROUTE=]SECRET")]
    pub(super) secrets: Vec<String>,
    /// A file of secrets, one `[ROUTE=]SECRET` a line (`#` starts a comment).
    /// Secrets are also read from the environment: DEDUPE_SECRET_{ROUTE}
    /// (upper case, `-` and `.` as `_`), several separated by white space.
    #[arg(long, value_name = "PATH")]
    pub(super) secret_file: Vec<std::path::PathBuf>,
    /// Largest body accepted, in bytes (default: each provider's own need:
    /// GitHub 25 MB, the others 1 MiB).
    #[arg(long)]
    pub(super) body_limit: Option<usize>,
    /// Replay tolerance of signed timestamps, in seconds.
    #[arg(long, default_value_t = 300)]
    pub(super) tolerance_secs: u64,
    /// Serve this route without a signature check even though other routes
    /// have secrets: `hooks` (for /hooks and /hooks/standard), `stripe`,
    /// `github`, `shopify` or a --route name. Without any secret every route
    /// is unsigned.
    #[arg(long = "unsigned", value_name = "ROUTE")]
    pub(super) unsigned: Vec<String>,
    /// Longest a handler may run, in seconds: past it the handler is aborted,
    /// its claim released and the delivery answered 503 (default 600).
    #[arg(long, value_name = "SECS")]
    pub(super) max_handler_secs: Option<f64>,
    /// Most deliveries processed at once, all routes together; past it a
    /// delivery gets 503 with Retry-After instead of queueing (unlimited by
    /// default).
    #[arg(long, value_name = "N")]
    pub(super) max_concurrency: Option<usize>,
    /// On SIGTERM or Ctrl-C: how long running handlers may take to finish
    /// before they are aborted and their claims released.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub(super) shutdown_grace_secs: f64,
    /// Test hook, not for production: a request carrying this header fails in
    /// its business step (500), as a crashing handler would; in inbox mode
    /// the stored delivery keeps the header, so it fails on every attempt,
    /// retried on the backoff, or as the header's value says: `permanent`
    /// (dead at once), `retry-after=SECS` (due again that long after) or
    /// `snooze=SECS` (due again that long after, no attempt spent, within
    /// --max-snooze-secs).
    #[arg(long, value_name = "HEADER")]
    pub(super) fail_on_header: Option<String>,
    /// Test hook, not for production: once this file exists, the
    /// --fail-on-header hook no longer fails anything (a fix deployed): a
    /// dead item replayed then completes.
    #[arg(long, value_name = "PATH", requires = "fail_on_header")]
    pub(super) healed_when: Option<std::path::PathBuf>,
    /// Test hook, not for production: the business step appends a line
    /// `<key> <delivery id>` to this file when it starts, before any wait: a
    /// side effect outside the store, counted by tests across processes.
    #[arg(long, value_name = "PATH")]
    pub(super) effect_log: Option<std::path::PathBuf>,
}

/// A JSON pointer: empty (the whole document, refused: it is no key) or
/// starting with `/`.
fn json_pointer(text: &str) -> Result<String, String> {
    if text.starts_with('/') {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a JSON pointer to a field (it starts with '/', e.g. /data/object/id)"
        ))
    }
}
