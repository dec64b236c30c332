//! # dedupe-redis
//!
//! The Redis store of dedupe, on redis-rs (async, tokio), for one server or a
//! Cluster. A claim is `SET key record NX PX ms`; every decision that needs to
//! read and compare (a takeover, a re-entrant claim id, a payload mismatch, a
//! duplicate answered with its outcome) runs in one Lua script in the same round
//! trip, with Redis' own clock. See [`RedisStore`].

mod codec;
mod error;
mod scripts;
mod store;

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
