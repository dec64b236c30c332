//! # dedupe-redis
//!
//! The Redis store of dedupe, on redis-rs (async, tokio), for one server or a
//! Cluster. A claim is one Lua script with Redis' own clock: a live record
//! answers (a duplicate with its outcome, a claim in flight, a payload
//! mismatch, a re-entrant claim id) and nothing is written; an absent key is
//! claimed with `SET key record NX PX ms`, an expired one taken over, in the
//! same round trip. See [`RedisStore`].

#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod builder;
mod codec;
mod conn;
mod error;
mod inbox;
mod ops;
mod scripts;
mod server;
mod store;
mod wake;

pub use admin::RedisAdmin;
pub use store::{Durability, RedisBuilder, RedisStore};

// The caller's connections are redis-rs'; name the same version.
pub use redis;

/// Picks rustls' ring provider for the process, once: with more than one
/// provider compiled in (the AWS SDK brings another), rustls cannot choose on
/// its own and `rediss://` connections would panic. An application that
/// installed a provider already keeps its own.
#[cfg(feature = "tls")]
pub(crate) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
