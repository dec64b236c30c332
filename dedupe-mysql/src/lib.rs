//! # dedupe-mysql
//!
//! A [`DedupeStore`](dedupe_core::DedupeStore) in a MySQL 8.0+ or MariaDB
//! 10.6+ table, on sqlx's MySQL driver: one `INSERT ... ON DUPLICATE KEY
//! UPDATE` per claim, judged by the server's clock, fenced completions, and
//! claims and completions inside the caller's own transaction, and the
//! inbox ([`Inbox`](dedupe_core::Inbox)) in the same table: takes lock due
//! items with `FOR UPDATE SKIP LOCKED`.
//!
//! ```no_run
//! use dedupe_core::{ClaimOptions, DedupeStore, Key};
//! use dedupe_mysql::MySqlStore;
//! # async fn run() -> Result<(), dedupe_core::Error> {
//! let store = MySqlStore::connect("mysql://app@127.0.0.1:3306/app").await?;
//! store.migrate().await?;
//! let answer = store.claim(&Key::new("stripe", "evt_1")?, &ClaimOptions::default()).await?;
//! # let _ = answer; Ok(()) }
//! ```

mod admin;
mod builder;
mod codec;
mod error;
mod inbox;
mod ops;
mod sql;
mod store;

pub use builder::MySqlBuilder;
pub use dedupe_sqlx::Transactional;
pub use sqlx;
pub use store::MySqlStore;

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
