//! # dedupe-core
//!
//! The storage-agnostic half of dedupe: the [`DedupeStore`] trait every backend
//! implements, the [`Key`] of an event, the answers a claim gives, one [`Error`]
//! type, the in-memory reference store [`MemoryStore`], and the [`Deduper`] helper
//! that claims, runs the caller's work, and completes or releases.
//!
//! A webhook provider delivers at least once. Turning every repeat into a no-op
//! takes a key that is stable across retries (the provider's event id, or a
//! SHA-256 of the raw body) claimed atomically before the work, so that exactly one
//! delivery wins. Backends do the claim with their own atomic primitive:
//! `dedupe-sqlite`, `dedupe-postgres`, and the others in the workspace.
//!
//! The crate root is what an application uses. What only a store author needs
//! (decoding stored rows, building answers, time helpers) is in [`backend`].
//!
//! ```
//! use dedupe_core::{Deduper, Handled, Key, MemoryStore};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let deduper = Deduper::new(MemoryStore::new());
//! let body = br#"{"id":"evt_1P9x","type":"payment_intent.succeeded"}"#;
//! let key = Key::from_event_id_or_body("stripe", Some("evt_1P9x"), body)?;
//! let handled = deduper
//!     .run(&key, |_lease| async { Ok::<_, std::io::Error>(b"credited".to_vec()) })
//!     .await?;
//! assert!(matches!(handled, Handled::Ran { .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(()) }).unwrap();
//! ```

pub mod backend;
mod batch;
mod capabilities;
mod claim;
mod deduper;
mod error;
mod expire_task;
mod inbox;
mod inbox_admin;
mod inbox_worker;
mod key;
mod memory;
mod record;
mod retention;
mod store;
mod traced;
mod wake;
mod work;

pub use capabilities::{Capabilities, DEFAULT_MAX_OUTCOME_BYTES};
pub use claim::{ClaimOptions, ClaimOutcome, Lease, MAX_BATCH_KEYS, MAX_TTL, MIN_TTL};
pub use deduper::{Deduper, HandleError, Handled, OnFailure};
pub use error::{BoxError, Error, Result};
pub use expire_task::{spawn_expire_task, ExpireTask};
pub use inbox::{
    AcceptOptions, Accepted, FailedAttempt, Inbox, InboxCounts, Item, ItemPage, ItemQuery,
    ItemStatus, Retry, Taken, WhenDead, DEAD_RETENTION, ERROR_HISTORY, MAX_ERROR_BYTES,
    MAX_ORDERING_KEY_BYTES, MAX_PAGE, MAX_PAYLOAD_BYTES, MAX_TAKE, ORDER_SCAN,
};
pub use inbox_admin::{
    count_items, search_items, Bulk, BulkAction, BulkProgress, Found, ItemFilter,
};
pub use inbox_worker::{
    count_inbox_outcome, record_inbox_gauges, Backoff, InboxWorker, WorkFailure,
};
pub use key::{
    ClaimId, Fingerprint, Key, KeyError, LeaseToken, MAX_CLAIM_ID_BYTES, MAX_FINGERPRINT_BYTES,
    MAX_ID_BYTES, MAX_NAMESPACE_BYTES,
};
pub use memory::MemoryStore;
pub use record::{Record, RecordState, RecordStateKind};
pub use retention::Retention;
pub use store::DedupeStore;
pub use traced::TracedStore;
pub use wake::Wake;
pub use work::{Drained, Settle, Worked};

/// The attribute that implements [`DedupeStore`] (re-exported, so that store
/// crates and their users name one version).
pub use async_trait::async_trait;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
