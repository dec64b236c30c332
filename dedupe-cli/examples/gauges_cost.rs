//! What one refresh of the queue's gauges costs (`record_inbox_gauges`: an
//! `Inbox::counts` and an `Inbox::paused`) with many items in a namespace,
//! on any store. `dedupe serve` runs one per namespace every
//! `--gauges-every-ms`; bench/README.md has the figures.
//!
//! ```sh
//! cargo run --release -p dedupe-cli --example gauges_cost -- postgres://.../bench 1000000
//! ```
//!
//! Fills the namespace `gauges` up to the count asked (accepts, 64 at a
//! time; a third of them then taken, so the counts have running items), then
//! times ten refreshes and prints the median and the slowest.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{Inbox, Key};
use dedupe_url::Opener;
use futures_util::StreamExt;

const NAMESPACE: &str = "gauges";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(items)) = (args.next(), args.next()) else {
        eprintln!("usage: gauges_cost STORE_URL ITEMS");
        std::process::exit(2);
    };
    let items: u64 = items.parse()?;
    let opener = Opener::new(url.parse()?).await?;
    let inbox: Arc<dyn Inbox> = opener
        .inbox_handle()
        .await?
        .ok_or("this store has no inbox")?;
    let have = {
        let c = inbox.counts(NAMESPACE).await?;
        c.pending + c.running + c.failed + c.dead
    };
    if have < items {
        let started = Instant::now();
        let accepted = futures_util::stream::iter(have..items)
            .map(|i| {
                let inbox = Arc::clone(&inbox);
                async move {
                    let key = Key::new(NAMESPACE, format!("evt_{i:09}"))?;
                    inbox.accept(&key, br#"{"type":"invoice.paid"}"#).await
                }
            })
            .buffer_unordered(64);
        tokio::pin!(accepted);
        let mut done = have;
        while let Some(answer) = accepted.next().await {
            answer?;
            done += 1;
            if done.is_multiple_of(100_000) {
                eprintln!("{done} accepted ({:.0?})", started.elapsed());
            }
        }
        // A third running: takes of 100 until that many are held.
        let mut held = 0;
        while held < items / 3 {
            let taken = inbox
                .take(NAMESPACE, 100, Duration::from_secs(86_400))
                .await?;
            if taken.is_empty() {
                break;
            }
            held += taken.len() as u64;
        }
        eprintln!("filled in {:.1?}", started.elapsed());
    }
    let mut times = Vec::new();
    let mut counts = None;
    for _ in 0..10 {
        let started = Instant::now();
        counts = Some(dedupe_core::record_inbox_gauges(inbox.as_ref(), NAMESPACE).await?);
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "{url}: {counts:?}; one refresh: median {:.1?}, slowest {:.1?}",
        times[times.len() / 2],
        times[times.len() - 1]
    );
    Ok(())
}
