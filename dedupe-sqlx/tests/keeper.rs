//! The connection keeper, one set of checks run on both databases: a
//! private PostgreSQL cluster (`PgStore`) and a private MariaDB server
//! (`MySqlStore`), each store keeping connections of a small pool.
//!
//! - more callers than connections: every call is served, each round well
//!   within the timeout (a finished call hands its connection to a waiter);
//! - kept connections leave the rest of the pool to its other users (the
//!   caller's transactions, a ledger beside the store);
//! - callers in a tight loop are served in turn, none waits out the timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key};
use dedupe_mysql::MySqlStore;
use dedupe_postgres::PgStore;
use dedupe_testkit as support;

fn key(id: &str) -> Key {
    Key::new("keeper", id).expect("valid key")
}

/// 64 calls at once on a pool of 4 whose every connection the store may
/// keep: each call gets one in turn. Parked connections once reached only
/// calls that started later, and the callers already waiting on the pool
/// timed out (27 of 32 on Postgres).
async fn more_callers_than_connections_all_get_one(store: Arc<dyn DedupeStore>, timeout: Duration) {
    for round in 0..3 {
        let started = Instant::now();
        let calls: Vec<_> = (0..64)
            .map(|i| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let k = key(&format!("crowd-{round}-{}", i % 4));
                    store
                        .claim(&k, &ClaimOptions::new(Duration::from_secs(30)))
                        .await
                })
            })
            .collect();
        for call in calls {
            let _ = call
                .await
                .expect("task")
                .expect("every crowded call is served");
        }
        assert!(
            started.elapsed() < timeout,
            "64 calls on 4 connections took {:?}",
            started.elapsed()
        );
    }
}

/// A burst of 32 claims on a store keeping 2 of its pool's 4 connections:
/// afterwards `acquire` (the pool's other users) gets 2 connections at once,
/// and the store still serves with its kept ones.
async fn kept_connections_leave_the_pool_to_its_other_users<F, Fut, C, E>(
    store: Arc<dyn DedupeStore>,
    acquire: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<C, E>>,
    E: std::fmt::Debug,
{
    let calls: Vec<_> = (0..32)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .claim(&key(&format!("burst-{i}")), &ClaimOptions::default())
                    .await
            })
        })
        .collect();
    for call in calls {
        assert!(call.await.expect("task").expect("claim").lease().is_some());
    }
    // Connections given back go through the pool's check in a task of their
    // own; then two slots are the pool's again.
    let mut held = Vec::new();
    for n in 0..2 {
        match tokio::time::timeout(Duration::from_secs(3), acquire()).await {
            Ok(Ok(conn)) => held.push(conn),
            Ok(Err(e)) => panic!("pool user {n} got no connection after the burst: {e:?}"),
            Err(_) => panic!("pool user {n} got no connection within 3 s after the burst"),
        }
    }
    assert!(store
        .claim(&key("after"), &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .is_some());
}

/// 16 tasks calling in a tight loop on a store keeping the one connection of
/// its pool: a finished call hands it to the caller that waited longest, so
/// no caller waits out the 400 ms timeout while others loop.
async fn callers_in_a_loop_are_served_in_turn(store: Arc<dyn DedupeStore>) {
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for i in 0..100 {
                    let k = key(&format!("loop-{t}-{}", i % 3));
                    let answer = store
                        .claim(&k, &ClaimOptions::new(Duration::from_secs(60)))
                        .await
                        .unwrap_or_else(|e| panic!("task {t} call {i}: {e}"));
                    assert!(
                        !matches!(answer, ClaimOutcome::Mismatch { .. }),
                        "{answer:?}"
                    );
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("every caller is served in time");
    }
}

async fn pg_store(url: &str, pool: u32, keep: usize, timeout: Duration) -> PgStore {
    let pool = PgStore::connect_pool(url, pool, timeout)
        .await
        .expect("pool");
    let store = PgStore::builder(pool)
        .schema(support::unique_schema("keeper"))
        .timeout(timeout)
        .keep_connections(keep)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store
}

async fn mysql_store(url: &str, pool: u32, keep: usize, timeout: Duration) -> MySqlStore {
    let pool = MySqlStore::connect_pool(url, pool, timeout)
        .await
        .expect("pool");
    let store = MySqlStore::builder(pool)
        .table(support::unique_schema("keeper"))
        .timeout(timeout)
        .keep_connections(keep)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store
}

/// The three checks for one database: `$server` starts it, `$store` builds
/// a store on a pool of `pool` keeping `keep`.
macro_rules! keeper_checks {
    ($db:ident, $server:path, $store:ident) => {
        mod $db {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn more_callers_than_connections_all_get_one() {
                let (_server, url) = $server();
                let timeout = Duration::from_secs(5);
                let store = $store(&url, 4, 4, timeout).await;
                super::more_callers_than_connections_all_get_one(Arc::new(store), timeout).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn kept_connections_leave_the_pool_to_its_other_users() {
                let (_server, url) = $server();
                let store = $store(&url, 4, 2, Duration::from_secs(2)).await;
                let pool = store.pool().clone();
                super::kept_connections_leave_the_pool_to_its_other_users(Arc::new(store), || {
                    pool.acquire()
                })
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn callers_in_a_loop_are_served_in_turn() {
                let (_server, url) = $server();
                let store = $store(&url, 1, 1, Duration::from_millis(400)).await;
                super::callers_in_a_loop_are_served_in_turn(Arc::new(store)).await;
            }
        }
    };
}

keeper_checks!(postgres, support::postgres_server, pg_store);
keeper_checks!(mariadb, support::mysql_server, mysql_store);
