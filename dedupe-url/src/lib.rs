//! # dedupe-url
//!
//! Any dedupe store from one URL: the configuration string an application, the
//! `dedupe` CLI and the webhook receiver all read.
//!
//! | URL | store |
//! |---|---|
//! | `memory:` | [`MemoryStore`](dedupe_core::MemoryStore), this process only |
//! | `sqlite:///abs/file.db`, `sqlite://relative.db`, `sqlite:` (a new temporary file) | `dedupe-sqlite`; `?table=`, `?connections=` |
//! | `postgres://user:pass@host:port/db` | `dedupe-postgres`; `?schema=`, `?connections=`, and sqlx's `sslmode`, `sslrootcert`, ... |
//! | `redis://host:port/N`, `rediss://...` | `dedupe-redis`; `?prefix=`, `?wait_replicas=N&wait_timeout=`, `?allow_eviction=true`, `?namespace_hash_tags=true` |
//! | `redis+cluster://host:port,host:port` (`rediss+cluster://`) | `dedupe-redis` on a Cluster; the same options (the inbox needs `?namespace_hash_tags=true`) |
//! | `dynamodb://TABLE?region=...&endpoint=http://127.0.0.1:8000` | `dedupe-dynamo` |
//!
//! Every scheme also takes `timeout` (the bound on each call), `lease` and
//! `retention` (for a [`Deduper`](dedupe_core::Deduper):
//! [`open_deduper`], [`StoreUrl::deduper`]), as `250ms`, `30s`,
//! `5m`, `2h` or `7d`. A malformed URL, an unknown scheme or option, or a
//! store not built in (each store is a cargo feature, all on by default) is a
//! [`UrlError`] saying exactly what is wrong, before anything is created.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let store = dedupe_url::open_store("sqlite:?lease=30s").await?;
//! let key = dedupe_core::Key::new("stripe", "evt_1")?;
//! let claimed = store.claim(&key, &Default::default()).await?;
//! assert!(claimed.lease().is_some());
//! # Ok::<(), dedupe_url::OpenError>(()) }).unwrap();
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

mod open;
mod parse;

pub use dedupe_core::backend::Admin;
pub use open::{open_deduper, open_store, Opened, Opener, DEFAULT_TIMEOUT};
pub use parse::{parse_duration, StoreUrl, Target, UrlError};

/// Why a store could not be opened: its URL, or the store itself.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The URL is wrong; nothing was touched.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// The store refused or could not be reached.
    #[error(transparent)]
    Store(#[from] dedupe_core::Error),
}

impl From<dedupe_core::KeyError> for OpenError {
    fn from(e: dedupe_core::KeyError) -> Self {
        Self::Store(e.into())
    }
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
