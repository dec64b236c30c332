//! # dedupe-postgres
//!
//! The Postgres store of dedupe, on sqlx (runtime queries, no database needed at
//! build time; rustls for TLS). Every state change is one statement decided by
//! the server's clock; see [`PgStore`] for the primitive it relies on and
//! [`PgStore::claim_in`] for the transactional claim.

mod builder;
mod codec;
mod conn;
mod error;
mod ops;
mod sql;
mod store;

pub use store::{PgBuilder, PgStore};

// The caller's pools and transactions are sqlx's; name the same version.
pub use sqlx;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
