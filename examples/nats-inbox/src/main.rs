//! `dedupe-example-nats-inbox --store URL --nats URL --stream NAME --consumer NAME
//! --namespace NS`: accepts the stream's messages into the store's inbox,
//! acks them, and works the items (here: prints each once). See `lib.rs`.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use clap::Parser;
use dedupe_core::InboxWorker;
use dedupe_example_nats_inbox::accept_messages;

#[derive(Parser, Debug)]
struct Args {
    /// The dedupe store, as a URL (`sqlite:///var/lib/app/inbox.db`, ...).
    #[arg(long)]
    store: String,
    /// The NATS server.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// The JetStream stream to read.
    #[arg(long)]
    stream: String,
    /// The durable pull consumer (created when missing, explicit acks).
    #[arg(long, default_value = "dedupe-inbox")]
    consumer: String,
    /// The inbox namespace the messages are keyed in.
    #[arg(long, default_value = "nats")]
    namespace: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args = Args::parse();
    let url: dedupe_url::StoreUrl = args.store.parse()?;
    let opener = dedupe_url::Opener::new(url).await?;
    let inbox = opener
        .inbox_handle()
        .await?
        .ok_or("this store has no inbox")?;
    // The items' lifecycle (lease, heartbeat, time bound, retention): the
    // URL's `?lease=` and `?retention=`, else the deduper's defaults.
    let deduper = opener.url().deduper(Arc::clone(&inbox))?;
    let worker = InboxWorker::new(&deduper, Arc::clone(&inbox), args.namespace.clone());
    let working = tokio::spawn({
        let worker = worker.clone();
        async move {
            worker
                .run(|taken| async move {
                    // The business step: once per message.
                    println!(
                        "{} (attempt {}): {} bytes",
                        taken.lease.key,
                        taken.lease.attempt,
                        taken.payload.len()
                    );
                    Ok::<_, std::io::Error>(b"done".to_vec())
                })
                .await
        }
    });
    let js = jetstream::new(async_nats::connect(&args.nats).await?);
    let consumer = js
        .get_stream(&args.stream)
        .await?
        .get_or_create_consumer(
            &args.consumer,
            jetstream::consumer::pull::Config {
                durable_name: Some(args.consumer.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await?;
    let messages = consumer.messages().await?;
    tokio::select! {
        seen = accept_messages(inbox.as_ref(), &args.namespace, messages, Duration::from_secs(1), |_, _| true) => {
            eprintln!("the stream ended: {:?}", seen?);
        }
        _ = tokio::signal::ctrl_c() => {}
    }
    worker.shutdown(Duration::from_secs(30)).await;
    working.abort();
    Ok(())
}
