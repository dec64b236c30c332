//! # dedupe-sqlite
//!
//! The embedded default store of dedupe: idempotency records in one table of a
//! SQLite file (rusqlite, bundled SQLite), safe when several threads and several
//! processes open the same file. See [`SqliteStore`] for the atomic primitive it
//! relies on, and [`SqliteStore::claim_in`] for the transactional claim.

mod admin;
mod builder;
mod codec;
mod conn;
mod error;
mod group;
mod inbox;
mod ops;
mod sql;
mod store;
mod workers;

pub use store::{SqliteBuilder, SqliteStore};

// The caller's transactions are rusqlite's; name the same version.
pub use rusqlite;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
