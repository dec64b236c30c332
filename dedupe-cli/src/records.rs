//! `dedupe inspect`, `purge` and `forget`: an operator's view of the records,
//! on a store as it is (none of them creates or migrates anything), and
//! `dedupe migrate`, the command that does.

use std::time::{SystemTime, UNIX_EPOCH};

use dedupe_core::{Error, Key, Record, RecordState};
use dedupe_url::Opener;
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct KeyArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// The key's namespace (the provider: `stripe`, `github`, ...).
    pub namespace: String,
    /// The key's id (the provider's event id).
    pub id: String,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// The key's namespace (the provider: `stripe`, `github`, ...; with
    /// `--idempotency-key`, the HTTP layer's, default `http`).
    pub namespace: Option<String>,
    /// The key's id (the provider's event id). Not with `--idempotency-key`.
    pub id: Option<String>,
    /// An `Idempotency-Key` a client sent: the record is found from it, the
    /// method, the path and the caller, as the HTTP layer keys it.
    #[arg(long, value_name = "KEY", requires = "path", conflicts_with = "id")]
    pub idempotency_key: Option<String>,
    /// The request's method (with `--idempotency-key`).
    #[arg(long, default_value = "POST", requires = "idempotency_key")]
    pub method: String,
    /// The request's path, without its query (with `--idempotency-key`).
    #[arg(long, requires = "idempotency_key")]
    pub path: Option<String>,
    /// The caller the layer's scope gave the request (its bearer token, API
    /// key or tenant); none for a `single_caller` layer or an anonymous one.
    #[arg(long, value_name = "CALLER", requires = "idempotency_key")]
    pub scope: Option<String>,
}

impl InspectArgs {
    /// The store key the arguments name.
    fn key(&self) -> Result<Key, Error> {
        let Some(client_key) = &self.idempotency_key else {
            let (Some(namespace), Some(id)) = (&self.namespace, &self.id) else {
                return Err(Error::config(
                    "give NAMESPACE and ID, or --idempotency-key with --path",
                ));
            };
            return Ok(Key::new(namespace.clone(), id.clone())?);
        };
        let client_key = dedupe_http::IdempotencyKey::parse(client_key.as_bytes())
            .map_err(|e| Error::config(format!("--idempotency-key: {e}")))?;
        let method = http::Method::from_bytes(self.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| Error::config(format!("--method {}: not an HTTP method", self.method)))?;
        let path = self.path.as_deref().unwrap_or("/");
        if !path.starts_with('/') || path.contains('?') {
            return Err(Error::config(format!(
                "--path {path}: the request's path, from its `/`, without a query"
            )));
        }
        Ok(dedupe_http::Idempotency::key_in(
            self.namespace.as_deref().unwrap_or("http"),
            self.scope.as_deref(),
            &method,
            path,
            &client_key,
        )?)
    }
}

#[derive(clap::Args, Debug)]
pub struct RecordsArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// Only this namespace.
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Only records in this state.
    #[arg(long, value_name = "in_flight|done", value_parser = ["in_flight", "done"])]
    pub state: Option<String>,
    /// Only records first seen within this long before now (30s, 5m, 2h, 7d).
    #[arg(long, value_name = "AGE")]
    pub since: Option<String>,
    /// Keys read a page (1 to 1000; a store that pages by what it scanned,
    /// Redis or DynamoDB, answers about this many).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Go on from this cursor: the `next` a page printed.
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<String>,
    /// Every page, not only one (`next` is then null).
    #[arg(long)]
    pub all: bool,
}

#[derive(clap::Args, Debug)]
pub struct StoreArgs {
    /// The store, as a URL.
    #[arg(long, value_name = "URL")]
    pub store: String,
}

fn millis(t: SystemTime) -> Value {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => json!(d.as_millis() as u64),
        Err(_) => Value::Null,
    }
}

/// A record as JSON: times in epoch milliseconds; the outcome as text when it
/// is UTF-8, else as hex.
pub fn record_json(record: &Record) -> Value {
    let mut out = json!({
        "namespace": record.key.namespace(),
        "id": record.key.id(),
        "state": match record.state { RecordState::InFlight { .. } => "in_flight", RecordState::Done { .. } => "done" },
        "attempts": record.attempts,
        "first_seen_ms": millis(record.first_seen),
        "claim_id": record.claim_id.as_ref().map(|c| c.as_str().to_string()),
        "fingerprint_hex": record.fingerprint.as_ref().map(|f| hex::encode(f.as_bytes())),
    });
    match &record.state {
        RecordState::InFlight { lease_deadline } => {
            out["lease_deadline_ms"] = millis(*lease_deadline);
        }
        RecordState::Done {
            completed_at,
            retention_deadline,
            outcome,
        } => {
            out["completed_at_ms"] = millis(*completed_at);
            out["retention_deadline_ms"] = millis(*retention_deadline);
            // A response kept by the HTTP engine (an Idempotency-Key request
            // or a webhook delivery): its status, headers and body.
            match dedupe_http::StoredResponse::decode(outcome) {
                Ok(response) => out["response"] = response_json(&response),
                Err(_) => match std::str::from_utf8(outcome) {
                    Ok(text) => out["outcome"] = json!(text),
                    Err(_) => out["outcome_hex"] = json!(hex::encode(outcome)),
                },
            }
        }
    }
    out
}

/// Creates the store's file, schema and tables, or brings them to the
/// current migration, and says what it touched.
pub async fn migrate(args: StoreArgs) -> Result<bool, Error> {
    let url = crate::store_url(&args.store)?;
    let shown = url.to_string();
    Opener::new(url).await?;
    println!("{shown}: ready (created or migrated where it was not)");
    Ok(true)
}

/// A kept response as JSON: the status, the headers (values as text), the
/// body as text when it is UTF-8, else as hex.
fn response_json(response: &dedupe_http::StoredResponse) -> Value {
    let headers: serde_json::Map<String, Value> = response
        .headers()
        .iter()
        .map(|(name, value)| {
            (
                name.to_string(),
                json!(String::from_utf8_lossy(value.as_bytes())),
            )
        })
        .collect();
    let mut out = json!({ "status": response.status().as_u16(), "headers": headers });
    let body = response.body_bytes();
    match std::str::from_utf8(body) {
        Ok(text) => out["body"] = json!(text),
        Err(_) => out["body_hex"] = json!(hex::encode(body)),
    }
    out
}

/// Prints `{"records": [...], "next": CURSOR|null}`: a page of the live
/// records (every page with `--all`), filtered by state and age.
pub async fn records(args: RecordsArgs) -> Result<bool, Error> {
    let since = match args.since.as_deref() {
        None => None,
        Some(age) => {
            let age = dedupe_url::parse_duration(age).ok_or_else(|| {
                Error::config(format!(
                    "--since {age}: a duration such as 30s, 5m, 2h or 7d"
                ))
            })?;
            Some(SystemTime::now().checked_sub(age).unwrap_or(UNIX_EPOCH))
        }
    };
    if let Some(namespace) = &args.namespace {
        // A namespace as keys hold them (no `:`), so every store reads the
        // same one.
        Key::new(namespace, "_").map_err(|e| Error::config(format!("--namespace: {e}")))?;
    }
    if !(1..=dedupe_core::backend::MAX_RECORD_PAGE).contains(&args.limit) {
        return Err(Error::config(format!(
            "--limit {}: 1 to {}",
            args.limit,
            dedupe_core::backend::MAX_RECORD_PAGE
        )));
    }
    let opened = Opener::existing(crate::store_url(&args.store)?)
        .await?
        .open()
        .await?;
    let mut query = dedupe_core::backend::RecordQuery::new(args.namespace.clone(), args.limit)
        .after(args.after.clone());
    let mut shown = Vec::new();
    let next = loop {
        let page = opened.admin.record_keys(&query).await?;
        for key in &page.keys {
            let Some(record) = opened.store.get(key).await? else {
                continue; // expired, or gone since the page was read
            };
            let state = match record.state {
                RecordState::InFlight { .. } => "in_flight",
                RecordState::Done { .. } => "done",
            };
            if args.state.as_deref().is_some_and(|wanted| wanted != state)
                || since.is_some_and(|since| record.first_seen < since)
            {
                continue;
            }
            shown.push(record_json(&record));
        }
        match page.next {
            Some(next) if args.all => query = query.after(Some(next)),
            next => break next,
        }
    };
    let out = json!({ "records": shown, "next": next });
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    Ok(true)
}

/// Prints the live record of a key as JSON (`null` when there is none).
/// Exit 0 when there is a record, 1 when there is none.
pub async fn inspect(args: InspectArgs) -> Result<bool, Error> {
    let key = args.key()?;
    let store = Opener::existing(crate::store_url(&args.store)?)
        .await?
        .handle()
        .await?;
    let record = store.get(&key).await?;
    let shown = record.as_ref().map(record_json).unwrap_or(Value::Null);
    println!(
        "{}",
        serde_json::to_string_pretty(&shown).unwrap_or_default()
    );
    Ok(record.is_some())
}

/// Removes every expired record and prints how many (for cron).
pub async fn purge(args: StoreArgs) -> Result<bool, Error> {
    let store = Opener::existing(crate::store_url(&args.store)?)
        .await?
        .handle()
        .await?;
    let removed = store.expire().await?;
    if !store.capabilities().explicit_expire {
        println!("0 (this store expires records itself)");
    } else {
        println!("{removed}");
    }
    Ok(true)
}

/// Removes a key's record whatever its state, so the next delivery runs.
/// Exit 0 when there was a live record, 1 when there was none.
pub async fn forget(args: KeyArgs) -> Result<bool, Error> {
    let key = Key::new(args.namespace, args.id)?;
    let store = Opener::existing(crate::store_url(&args.store)?)
        .await?
        .handle()
        .await?;
    let existed = store.forget(&key).await?;
    println!(
        "{}",
        if existed {
            format!("forgot {key}: its next delivery will run")
        } else {
            format!("{key} had no live record")
        }
    );
    Ok(existed)
}
