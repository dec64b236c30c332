//! `dedupe inbox list|replay|forget|stats|pause|resume`: an operator's view of the inbox
//! (what `dedupe serve --inbox` and any `InboxWorker` work through).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Subcommand;
use dedupe_core::{Error, Inbox, InboxCounts, Item, ItemQuery, ItemStatus, Key};
use dedupe_url::Opener;
use serde_json::{json, Value};

/// The namespaces `dedupe serve` keys its built-in routes in: what `list`
/// and `stats` show without `--namespace`.
const SERVE_NAMESPACES: [&str; 4] = ["hooks", "stripe", "github", "shopify"];

#[derive(Subcommand, Debug)]
pub enum InboxCommand {
    /// List items (pending, running, failed, dead) in id order, with their
    /// attempts, last error and due time.
    List(ListArgs),
    /// Make a dead item, or a failed one waiting for its retry, due now, its
    /// attempts and last error kept (exit 1 when the key holds no such item,
    /// or a failed item due already).
    Replay(ItemArgs),
    /// Remove an item whatever its state (exit 1 when there was none).
    Forget(ItemArgs),
    /// Counts per state, the oldest due item's age and whether it is
    /// paused, per namespace.
    Stats(StatsArgs),
    /// Stop every worker (in every process) taking the namespace's items,
    /// until `resume`: accepts go on, running items finish. Kept in the
    /// store; exit 0 whether or not it was paused already.
    Pause(PauseArgs),
    /// Let workers take the namespace's items again (exit 0 whether or not
    /// it was paused).
    Resume(PauseArgs),
}

#[derive(clap::Args, Debug)]
pub struct PauseArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    store: String,
    /// The namespace.
    namespace: String,
    /// One JSON object (`namespace`, `paused`, `changed`) instead of a line.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    store: String,
    /// The namespace (repeat for several; default: the namespaces of
    /// `dedupe serve`'s built-in routes: hooks, stripe, github, shopify; a
    /// `--route NAME=PROVIDER` keeps its items in NAME, shown only when
    /// named here).
    #[arg(long = "namespace", value_name = "NS")]
    namespaces: Vec<String>,
    /// Only items in this state.
    #[arg(long, value_name = "pending|failed|dead|running")]
    state: Option<ItemStatus>,
    /// Most items shown (all when not given).
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// A JSON array of objects (`namespace`, `id`, `state`, `attempts`,
    /// `max_attempts` (null: the worker's), `takeovers`, `ordering_key`
    /// (null: none), `last_error`, `errors` (the last five failures, oldest
    /// first: `attempt`, `at_ms`, `error`), `due_at`, `due_at_ms`,
    /// `accepted_at_ms`, `payload_bytes`) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ItemArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    store: String,
    /// The item's namespace.
    namespace: String,
    /// The item's id (the provider's event id).
    id: String,
}

#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    store: String,
    /// The namespace (repeat for several; default as for `list`).
    #[arg(long = "namespace", value_name = "NS")]
    namespaces: Vec<String>,
    /// One JSON object per namespace instead of a table.
    #[arg(long)]
    json: bool,
}

async fn open(store: &str) -> Result<Arc<dyn Inbox>, Error> {
    let url = crate::store_url(store)?;
    let scheme = url.scheme().to_string();
    Opener::existing(url)
        .await?
        .inbox_handle()
        .await?
        .ok_or_else(|| Error::config(format!("{scheme} stores have no inbox")))
}

/// The namespaces to read: those given, or serve's built-in ones, said on
/// stderr (a `--route NAME=PROVIDER` keys its items in `NAME`, which only
/// `--namespace NAME` shows).
fn namespaces(given: Vec<String>) -> Vec<String> {
    if given.is_empty() {
        eprintln!(
            "namespaces: {} (dedupe serve's built-in routes; a --route NAME=PROVIDER \
             keeps its items in NAME: add --namespace NAME)",
            SERVE_NAMESPACES.join(", ")
        );
        SERVE_NAMESPACES.iter().map(|n| n.to_string()).collect()
    } else {
        given
    }
}

fn millis(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// `t` as RFC 3339 in UTC, to the millisecond (`1970-01-01T00:00:00.000Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let ms = millis(t);
    let (days, in_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

pub(crate) fn item_json(item: &Item) -> Value {
    json!({
        "namespace": item.key.namespace(),
        "id": item.key.id(),
        "state": item.status.as_str(),
        "attempts": item.attempts,
        "max_attempts": item.max_attempts,
        "takeovers": item.takeovers,
        "ordering_key": item.ordering_key,
        "last_error": item.last_error,
        "errors": item.errors.iter().map(|e| json!({
            "attempt": e.attempt,
            "at_ms": millis(e.at),
            "error": e.error,
        })).collect::<Vec<_>>(),
        "due_at": rfc3339(item.due_at),
        "due_at_ms": millis(item.due_at),
        "accepted_at_ms": millis(item.accepted_at),
        "payload_bytes": item.payload.len(),
    })
}

pub async fn inbox(command: InboxCommand) -> Result<bool, Error> {
    match command {
        InboxCommand::List(args) => list(args).await,
        InboxCommand::Replay(args) => replay(args).await,
        InboxCommand::Forget(args) => forget(args).await,
        InboxCommand::Stats(args) => stats(args).await,
        InboxCommand::Pause(args) => pause(args, true).await,
        InboxCommand::Resume(args) => pause(args, false).await,
    }
}

/// Pauses (`pause`) or resumes the namespace, and says what it is now.
async fn pause(args: PauseArgs, pause: bool) -> Result<bool, Error> {
    let inbox = open(&args.store).await?;
    let namespace = args.namespace;
    let changed = if pause {
        inbox.pause(&namespace).await?
    } else {
        inbox.resume(&namespace).await?
    };
    if args.json {
        println!(
            "{}",
            json!({"namespace": namespace, "paused": pause, "changed": changed})
        );
    } else {
        let state = if pause { "paused" } else { "running" };
        let already = if changed { "" } else { " (it was already)" };
        println!("{namespace} is {state}{already}");
    }
    Ok(true)
}

/// Every page of every namespace asked, up to the limit.
async fn list(args: ListArgs) -> Result<bool, Error> {
    let inbox = open(&args.store).await?;
    let mut items = Vec::new();
    let limit = args.limit.unwrap_or(usize::MAX);
    'namespaces: for namespace in namespaces(args.namespaces) {
        Key::new(&namespace, "x").map_err(|e| Error::config(format!("--namespace: {e}")))?;
        let mut query = ItemQuery::new(namespace);
        query.status = args.state;
        query.limit = dedupe_core::MAX_PAGE;
        loop {
            let page = inbox.list(&query).await?;
            for item in page.items {
                if items.len() == limit {
                    break 'namespaces;
                }
                items.push(item);
            }
            match page.next {
                Some(next) => query.after = Some(next),
                None => break,
            }
        }
    }
    if args.json {
        let shown: Vec<Value> = items.iter().map(item_json).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&shown).unwrap_or_default()
        );
    } else if items.is_empty() {
        println!("no items");
    } else {
        println!(
            "{:<12} {:<40} {:<8} {:>8} {:>9}  {:<24}  last error",
            "namespace", "id", "state", "attempts", "takeovers", "due at"
        );
        for item in &items {
            // Attempts of the item's own limit, when it has one.
            let attempts = match item.max_attempts {
                Some(limit) => format!("{}/{limit}", item.attempts),
                None => item.attempts.to_string(),
            };
            println!(
                "{:<12} {:<40} {:<8} {:>8} {:>9}  {:<24}  {}",
                item.key.namespace(),
                item.key.id(),
                item.status.as_str(),
                attempts,
                item.takeovers,
                rfc3339(item.due_at),
                item.last_error.as_deref().unwrap_or("-").replace('\n', " ")
            );
        }
    }
    Ok(true)
}

async fn replay(args: ItemArgs) -> Result<bool, Error> {
    let key = Key::new(args.namespace, args.id)?;
    let replayed = open(&args.store).await?.replay(&key).await?;
    println!(
        "{}",
        if replayed {
            format!("{key} is due now")
        } else {
            format!("{key} is no dead item nor a failed one waiting for its retry")
        }
    );
    Ok(replayed)
}

async fn forget(args: ItemArgs) -> Result<bool, Error> {
    let key = Key::new(args.namespace, args.id)?;
    let inbox = open(&args.store).await?;
    let was_item = inbox.item(&key).await?.is_some();
    let existed = inbox.forget(&key).await?;
    println!(
        "{}",
        match (existed, was_item) {
            (true, true) => format!("forgot the item {key}: its next delivery is accepted anew"),
            (true, false) => format!("forgot {key} (a record, not an item)"),
            (false, _) => format!("{key} had no item"),
        }
    );
    Ok(existed)
}

fn age(oldest: Option<SystemTime>) -> Option<Duration> {
    oldest.map(|t| SystemTime::now().duration_since(t).unwrap_or_default())
}

pub(crate) fn counts_json(namespace: &str, c: &InboxCounts, paused: bool) -> Value {
    json!({
        "namespace": namespace,
        "paused": paused,
        "pending": c.pending,
        "running": c.running,
        "failed": c.failed,
        "dead": c.dead,
        "depth": c.pending + c.failed,
        "oldest_due_at": c.oldest_due.map(rfc3339),
        "oldest_due_age_ms": age(c.oldest_due).map(|d| d.as_millis() as u64),
    })
}

async fn stats(args: StatsArgs) -> Result<bool, Error> {
    let inbox = open(&args.store).await?;
    let mut rows = Vec::new();
    for namespace in namespaces(args.namespaces) {
        Key::new(&namespace, "x").map_err(|e| Error::config(format!("--namespace: {e}")))?;
        let counts = inbox.counts(&namespace).await?;
        let paused = inbox.paused(&namespace).await?;
        rows.push((namespace, counts, paused));
    }
    if args.json {
        let shown: Vec<Value> = rows
            .iter()
            .map(|(n, c, paused)| counts_json(n, c, *paused))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&shown).unwrap_or_default()
        );
    } else {
        println!(
            "{:<12} {:<7} {:>8} {:>8} {:>8} {:>8}  oldest due",
            "namespace", "takes", "pending", "running", "failed", "dead"
        );
        for (namespace, c, paused) in &rows {
            println!(
                "{:<12} {:<7} {:>8} {:>8} {:>8} {:>8}  {}",
                namespace,
                if *paused { "paused" } else { "on" },
                c.pending,
                c.running,
                c.failed,
                c.dead,
                age(c.oldest_due)
                    .map_or("-".to_string(), |d| format!("{:.1} s ago", d.as_secs_f64()))
            );
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_in_utc() {
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(rfc3339(at(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(at(951_782_400_123)), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(at(1_796_169_599_999)), "2026-12-01T23:59:59.999Z");
        assert_eq!(rfc3339(at(4_107_542_400_000)), "2100-03-01T00:00:00.000Z");
    }
}
