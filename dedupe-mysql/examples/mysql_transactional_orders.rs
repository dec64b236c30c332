//! The transactional claim on MySQL or MariaDB: the claim, the business write
//! (an `INSERT` into an orders table) and the completion commit together or
//! not at all.
//!
//! ```sh
//! DATABASE_URL=mysql://root@127.0.0.1:3306/test \
//!     cargo run -p dedupe-mysql --example mysql_transactional_orders
//! ```
//!
//! Deliver the same event twice (and once more concurrently): one order is
//! written, the other deliveries see `Duplicate`.

use std::time::Duration;

use dedupe_core::{ClaimOptions, ClaimOutcome, Key};
use dedupe_mysql::sqlx::MySqlPool;
use dedupe_mysql::MySqlStore;

/// What a delivery did.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// This delivery wrote the order.
    Created(u64),
    /// An earlier delivery wrote it; here is what it stored.
    Duplicate(String),
    /// Another delivery holds the event right now.
    InFlight,
}

/// Creates the orders table next to the dedupe table.
pub async fn setup(store: &MySqlStore) -> Result<(), Box<dyn std::error::Error>> {
    store.migrate().await?;
    dedupe_mysql::sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
             id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
             event_id VARCHAR(255) NOT NULL,
             amount_cents BIGINT NOT NULL
         ) ENGINE=InnoDB",
    )
    .execute(store.pool())
    .await?;
    Ok(())
}

/// Handles one delivery of a `payment_intent.succeeded` event.
pub async fn handle_delivery(
    store: &MySqlStore,
    pool: &MySqlPool,
    event_id: &str,
    amount_cents: i64,
) -> Result<Delivery, Box<dyn std::error::Error>> {
    let key = Key::new("stripe", event_id)?;
    let mut tx = pool.begin().await?;
    let lease = match store
        .claim_in(&mut tx, &key, &ClaimOptions::default())
        .await?
    {
        ClaimOutcome::Claimed(lease) => lease,
        ClaimOutcome::Duplicate { outcome, .. } => {
            return Ok(Delivery::Duplicate(
                String::from_utf8_lossy(&outcome).into(),
            ))
        }
        ClaimOutcome::InFlight { .. } => return Ok(Delivery::InFlight),
        ClaimOutcome::Mismatch { .. } => return Err("same event id, different payload".into()),
    };
    let order_id =
        dedupe_mysql::sqlx::query("INSERT INTO orders (event_id, amount_cents) VALUES (?, ?)")
            .bind(event_id)
            .bind(amount_cents)
            .execute(&mut *tx)
            .await?
            .last_insert_id();
    let outcome = format!("order {order_id}");
    store
        .complete_in(
            &mut tx,
            &lease,
            outcome.as_bytes(),
            Duration::from_secs(35 * 86_400),
        )
        .await?;
    tx.commit().await?;
    Ok(Delivery::Created(order_id))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let store = MySqlStore::connect(&url).await?;
    setup(&store).await?;
    let pool = store.pool().clone();
    let event = format!("evt_{}", std::process::id());
    println!(
        "first delivery:  {:?}",
        handle_delivery(&store, &pool, &event, 2500).await?
    );
    println!(
        "second delivery: {:?}",
        handle_delivery(&store, &pool, &event, 2500).await?
    );
    let concurrent = format!("{event}-b");
    let (a, b) = tokio::join!(
        handle_delivery(&store, &pool, &concurrent, 900),
        handle_delivery(&store, &pool, &concurrent, 900)
    );
    println!("two at once:     {:?} / {:?}", a?, b?);
    Ok(())
}
