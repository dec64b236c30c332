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
            match std::str::from_utf8(outcome) {
                Ok(text) => out["outcome"] = json!(text),
                Err(_) => out["outcome_hex"] = json!(hex::encode(outcome)),
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

/// Prints the live record of a key as JSON (`null` when there is none).
/// Exit 0 when there is a record, 1 when there is none.
pub async fn inspect(args: KeyArgs) -> Result<bool, Error> {
    let key = Key::new(args.namespace, args.id)?;
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
