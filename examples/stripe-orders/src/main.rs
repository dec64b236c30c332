//! The receiver as a program.
//!
//! ```sh
//! DATABASE_URL=postgres://app@localhost/app STRIPE_WEBHOOK_SECRET=whsec_... \
//!     cargo run -p dedupe-example-stripe-orders
//! DATABASE_URL=sqlite://orders.db STRIPE_WEBHOOK_SECRET=whsec_... \
//!     cargo run -p dedupe-example-stripe-orders
//! ```
//!
//! It logs through `tracing` (`RUST_LOG=info,dedupe=debug` shows every store
//! call), listens on `LISTEN` (default `127.0.0.1:8080`), and
//! on Ctrl-C stops taking deliveries and lets running ones finish.

use dedupe_example_stripe_orders::{postgres, sqlite};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let secret = std::env::var("STRIPE_WEBHOOK_SECRET").map_err(|_| "set STRIPE_WEBHOOK_SECRET")?;
    // The receivers' Deduper deletes records past their retention every
    // hour, from the first delivery on.
    let app = match url.strip_prefix("sqlite://") {
        Some(path) => {
            let store = dedupe_sqlite::SqliteStore::open(path).await?;
            sqlite::setup(&store).await?;
            sqlite::router(store, &secret)?
        }
        None => {
            let store = dedupe_postgres::PgStore::connect(&url).await?;
            postgres::setup(&store).await?;
            postgres::router(store, &secret)?
        }
    };
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    tracing::info!(%listen, "receiving Stripe webhooks on POST /hooks/stripe");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
