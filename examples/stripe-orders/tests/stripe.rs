//! The example end to end, over real HTTP, on a private PostgreSQL cluster
//! and on a SQLite file: deliveries signed as Stripe signs them, sent again
//! and eight at once, write one order; a forged one is refused; the README's
//! first example is the Postgres receiver, line for line.

use std::future::Future;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use dedupe_example_stripe_orders::{postgres, sqlite};
use dedupe_webhook::{Scheme, Verifier};

const SECRET: &str = "whsec_example_test_secret";

async fn listen(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!(
        "http://{}/hooks/stripe",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    base
}

/// Posts `body` signed with `secret`, as Stripe does; answers the status,
/// the replay header and the body (after its content type).
async fn deliver(url: &str, secret: &str, body: &str) -> (u16, bool, String) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let verifier = Verifier::new(Scheme::Stripe, [secret]).expect("secret");
    let mut request = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    for (name, value) in verifier.sign("", now, body.as_bytes()) {
        request = request.header(name, value);
    }
    let response = request.send().await.expect("delivery");
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap_or("?").to_string())
        .unwrap_or_default();
    let text = response.text().await.expect("body");
    (status, replayed, format!("{content_type} {text}"))
}

/// One event sent once, again, and eight times at once: one order, the same
/// answer for every copy; a delivery signed with another secret: 401.
async fn one_order_per_event<F: Future<Output = i64>>(
    url: &str,
    orders: impl Fn(&'static str) -> F,
) {
    let event =
        r#"{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"amount":2500}}}"#;
    let (status, replayed, first) = deliver(url, SECRET, event).await;
    assert_eq!((status, replayed), (200, false), "{first}");
    // The first answer is as its replays will be: JSON.
    assert!(
        first.starts_with(r#"application/json {"order":"#),
        "{first}"
    );
    let (status, replayed, again) = deliver(url, SECRET, event).await;
    assert_eq!((status, replayed, &again), (200, true, &first));

    let burst =
        r#"{"id":"evt_2","type":"payment_intent.succeeded","data":{"object":{"amount":900}}}"#;
    let copies: Vec<_> = (0..8)
        .map(|_| {
            let url = url.to_string();
            tokio::spawn(async move { deliver(&url, SECRET, burst).await })
        })
        .collect();
    let mut created = 0;
    for copy in copies {
        let (status, replayed, _) = copy.await.expect("copy");
        // A copy that meets the first still running is told to come back.
        assert!(status == 200 || status == 409, "{status}");
        created += usize::from(status == 200 && !replayed);
    }
    assert_eq!(created, 1, "one copy wrote the order");
    assert_eq!(orders("evt_1").await, 1);
    assert_eq!(orders("evt_2").await, 1);

    let forged = r#"{"id":"evt_3","data":{"object":{"amount":1}}}"#;
    let (status, _, _) = deliver(url, "whsec_someone_else", forged).await;
    assert_eq!(status, 401);
    assert_eq!(orders("evt_3").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    let (_server, url) = dedupe_testkit::postgres_server();
    // The store and the orders table in a schema of this run's own.
    let schema = dedupe_testkit::unique_schema("stripe");
    let options: dedupe_postgres::sqlx::postgres::PgConnectOptions = url.parse().expect("url");
    let pool = dedupe_postgres::sqlx::postgres::PgPoolOptions::new()
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await
        .expect("pool");
    dedupe_postgres::sqlx::raw_sql(dedupe_postgres::sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA \"{schema}\""
    )))
    .execute(&pool)
    .await
    .expect("schema");
    let store = dedupe_postgres::PgStore::builder(pool)
        .schema(&schema)
        .build()
        .expect("store");
    postgres::setup(&store).await.expect("setup");
    let base = listen(postgres::router(store.clone(), SECRET).expect("router")).await;
    one_order_per_event(&base, |event| {
        let store = store.clone();
        async move { postgres::orders(&store, event).await.expect("orders") }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    let dir = tempfile::tempdir().expect("dir");
    let store = dedupe_sqlite::SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("store");
    sqlite::setup(&store).await.expect("setup");
    let base = listen(sqlite::router(store.clone(), SECRET).expect("router")).await;
    one_order_per_event(&base, |event| {
        let store = store.clone();
        async move { sqlite::orders(&store, event).await.expect("orders") }
    })
    .await;
}

/// The README's first example is `src/postgres.rs` between its
/// `readme-begin` and `readme-end` lines, so the README shows code the gate
/// compiles and runs.
#[test]
fn the_readme_shows_the_postgres_receiver() {
    let source = include_str!("../src/postgres.rs");
    let (_, rest) = source
        .split_once("// readme-begin\n")
        .expect("begin marker");
    let (shown, _) = rest.split_once("// readme-end").expect("end marker");
    let readme = include_str!("../../../README.md");
    assert!(
        readme.contains(&format!("```rust\n{shown}```")),
        "README.md's first example is not src/postgres.rs's marked lines:\n{shown}"
    );
}
