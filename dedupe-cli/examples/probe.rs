// Temporary probe (not committed): client CPU per operation, store vs raw.
use dedupe_core::{ClaimOptions, DedupeStore, Key};
use dedupe_postgres::sqlx::{self, Connection, PgConnection};
use std::time::{Duration, Instant};

fn cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let url = std::env::var("PGURL").unwrap();
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20000);
    let pool = dedupe_postgres::PgStore::connect_pool(&url, 1, Duration::from_secs(5))
        .await
        .unwrap();
    let store = dedupe_postgres::PgStore::builder(pool)
        .hold_connections(1)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let mut raw = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS rawp (k text PRIMARY KEY, exp timestamptz NOT NULL, done boolean NOT NULL DEFAULT false)").execute(&mut raw).await.unwrap();
    let opts = ClaimOptions::default();
    let run = std::process::id();
    let cycle = std::env::var("CYCLE").is_ok();
    let batch: usize = std::env::var("BATCH")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if batch > 0 {
        for round in 0..3 {
            let (c0, t0) = (cpu(), Instant::now());
            for i in 0..n {
                let keys: Vec<Key> = (0..batch)
                    .map(|j| Key::new("probe", format!("bs{run}-{round}-{i}-{j}")).unwrap())
                    .collect();
                let out = store.claim_many(&keys, &opts).await.unwrap();
                assert!(out.iter().all(|o| o.lease().is_some()));
            }
            let (c1, t1) = (cpu(), Instant::now());
            for i in 0..n {
                let keys: Vec<String> = (0..batch)
                    .map(|j| format!("br{run}-{round}-{i}-{j}"))
                    .collect();
                let rows: Vec<(String,)> = sqlx::query_as("INSERT INTO rawp (k, exp) SELECT k, now() + $2::interval FROM unnest($1::text[]) AS k ON CONFLICT DO NOTHING RETURNING k")
                    .bind(&keys).bind(Duration::from_secs(30)).fetch_all(&mut raw).await.unwrap();
                let won: std::collections::HashSet<String> =
                    rows.into_iter().map(|r| r.0).collect();
                assert!(keys.iter().all(|k| won.contains(k)));
            }
            let (c2, t2) = (cpu(), Instant::now());
            println!("batch store: {:.1} us cpu/call, {:.1} us wall/call | raw: {:.1} us cpu/call, {:.1} us wall/call",
                (c1 - c0) * 1e6 / n as f64, (t1 - t0).as_secs_f64() * 1e6 / n as f64,
                (c2 - c1) * 1e6 / n as f64, (t2 - t1).as_secs_f64() * 1e6 / n as f64);
        }
        return;
    }
    for round in 0..2 {
        let (c0, t0) = (cpu(), Instant::now());
        for i in 0..n {
            let key = Key::new("probe", format!("s{run}-{round}-{i}")).unwrap();
            let out = store.claim(&key, &opts).await.unwrap();
            if cycle {
                if let Some(l) = out.lease() {
                    store
                        .complete(l, b"", Duration::from_secs(60))
                        .await
                        .unwrap();
                }
            }
        }
        let (c1, t1) = (cpu(), Instant::now());
        for i in 0..n {
            let k = format!("r{run}-{round}-{i}");
            let row: Option<(String,)> = sqlx::query_as("INSERT INTO rawp (k, exp) VALUES ($1, now() + $2::interval) ON CONFLICT DO NOTHING RETURNING k")
                .bind(&k).bind(Duration::from_secs(30)).fetch_optional(&mut raw).await.unwrap();
            assert!(row.is_some());
            if cycle {
                sqlx::query("UPDATE rawp SET done = true, exp = now() + $2::interval WHERE k = $1")
                    .bind(&k)
                    .bind(Duration::from_secs(60))
                    .execute(&mut raw)
                    .await
                    .unwrap();
            }
        }
        let (c2, t2) = (cpu(), Instant::now());
        println!(
            "store: {:.1} us cpu/op, {:.1} us wall/op | raw: {:.1} us cpu/op, {:.1} us wall/op",
            (c1 - c0) * 1e6 / n as f64,
            (t1 - t0).as_secs_f64() * 1e6 / n as f64,
            (c2 - c1) * 1e6 / n as f64,
            (t2 - t1).as_secs_f64() * 1e6 / n as f64
        );
    }
}
