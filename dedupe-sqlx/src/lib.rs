//! # dedupe-sqlx
//!
//! What dedupe's two stores over sqlx share, written once: the connection
//! keeper of [`PgStore`](https://docs.rs/dedupe-postgres) and
//! [`MySqlStore`](https://docs.rs/dedupe-mysql), and [`Transactional`], the
//! claim and completion in the caller's transaction that both offer.
//! Applications use those crates; code written once for either database
//! names [`Transactional`].
//!
//! sqlx sends a round trip on every connection going back to its pool (a
//! `Sync` on Postgres, a ping on MySQL) before the next caller may have it.
//! A store whose calls are one statement each would wait for that second
//! round trip on every call. [`Kept`] keeps up to `keep` finished
//! connections out of the pool and hands each to the next call as it is:
//!
//! - **at most `keep` connections** ever bypass the pool, parked or in use;
//!   every other connection goes back through the pool, whose fair queue
//!   also serves the pool's other users (the caller's own transactions, a
//!   ledger beside the store);
//! - **first come, first served**: a finished call hands its connection to
//!   the call that has waited longest, and parks it only when none waits;
//! - **only a clean connection is kept**: one whose call answered, or
//!   answered an error of the store's own (a lost lease, bad input, a
//!   corrupt record). One whose call met a server or driver error goes back
//!   through the pool's check, bounded by the store's timeout; one whose
//!   call was stopped part-way (its timeout fired, its future was dropped)
//!   is closed, never reused;
//! - a connection parked longer than 30 s, or older than
//!   [`MAX_CONNECTION_LIFETIME`], goes back to the pool, which checks or
//!   renews it.

mod conn;
mod transactional;

pub use conn::{Checkout, Kept, MAX_CONNECTION_LIFETIME};
pub use sqlx;
pub use transactional::{ConnectionOf, Transactional};
