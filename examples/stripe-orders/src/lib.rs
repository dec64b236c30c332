//! A Stripe webhook receiver whose business write (an order row) and the
//! event's completion commit in one transaction, on Postgres ([`postgres`])
//! or SQLite ([`sqlite`]): either both are there, or neither is and Stripe's
//! retry does the work. However many copies of an event arrive, together or
//! days apart, one order is written and every copy gets the same answer.
//!
//! The top README's first example is [`postgres`], line for line (a test
//! checks it), and the README's other Rust blocks are this crate's
//! doctests (below).

pub mod postgres;
pub mod sqlite;

#[doc = include_str!("../../../README.md")]
mod readme {}
