//! # dedupe-postgres
//!
//! The Postgres store of dedupe, on sqlx (runtime queries, no database needed at
//! build time; TLS through the `rustls` or `native-tls` feature, or a pool of
//! your own). Every decision is made by one statement judged by the server's
//! clock (a claim on the store's own connections may run a cheaper statement
//! first, which changes nothing unless it wins); see [`PgStore`] for the
//! primitive it relies on and [`PgStore::claim_in`] for the transactional
//! claim.

mod admin;
mod builder;
mod codec;
mod error;
mod inbox;
mod ops;
mod sql;
mod store;
mod wake;

pub use store::{PgBuilder, PgStore};

// The caller's pools and transactions are sqlx's; name the same version.
pub use dedupe_sqlx::Transactional;
pub use sqlx;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
