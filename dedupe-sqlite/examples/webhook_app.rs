//! An app on the SQLite store: each webhook delivery goes through the `Deduper`,
//! so the work runs once per event however many copies arrive.
//!
//! ```sh
//! cargo run -p dedupe-sqlite --example webhook_app
//! ```

use dedupe_core::{Deduper, HandleError, Handled, Key};
use dedupe_sqlite::SqliteStore;

/// Handles one delivery (after the provider's signature was verified) and answers
/// the HTTP status to send back.
async fn on_webhook(deduper: &Deduper, event_id: Option<&str>, body: &[u8]) -> u16 {
    let Ok(key) = Key::from_event_id_or_body("stripe", event_id, body) else {
        return 400;
    };
    let handled = deduper
        .run(&key, |_lease| async {
            // Charge, ship, email: exactly once per event.
            Ok::<_, std::io::Error>(b"order 17".to_vec())
        })
        .await;
    match handled {
        Ok(Handled::Ran { .. } | Handled::Duplicate { .. }) => 200,
        // Another copy is being processed: ask the provider to retry later.
        Ok(Handled::InFlight { .. }) => 409,
        // Same event id, different payload.
        Ok(Handled::Mismatch) => 422,
        // Processed before, and its failure was kept (OnFailure::Keep): never a success.
        Ok(Handled::Failed { .. }) => 500,
        Err(HandleError::Store(e)) if e.is_retryable() => 503,
        // An answer added in a later version, or the work failed.
        Ok(_) | Err(_) => 500,
    }
}

#[tokio::main]
async fn main() -> Result<(), dedupe_core::Error> {
    let path = std::env::temp_dir().join(format!("dedupe-example-{}.db", std::process::id()));
    let store = SqliteStore::open(&path).await?;
    let deduper = Deduper::new(store);
    let body = br#"{"id":"evt_1P9x","type":"payment_intent.succeeded"}"#;
    println!(
        "first delivery:  HTTP {}",
        on_webhook(&deduper, Some("evt_1P9x"), body).await
    );
    println!(
        "second delivery: HTTP {}",
        on_webhook(&deduper, Some("evt_1P9x"), body).await
    );
    println!(
        "no event id:     HTTP {}",
        on_webhook(&deduper, None, b"raw body").await
    );
    let _ = std::fs::remove_file(&path);
    Ok(())
}
