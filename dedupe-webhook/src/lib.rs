//! # dedupe-webhook
//!
//! Receiving webhooks exactly once with a dedupe store, in axum. Each request
//! goes through one path:
//!
//! 1. the body is read, at most [`Webhook::body_limit`] bytes (413 past it);
//! 2. its signature is verified, before anything is claimed ([`Verifier`]:
//!    Standard Webhooks and Svix, Stripe, GitHub, Shopify; 401 when missing,
//!    bad or stale);
//! 3. the idempotency key is derived from the provider's stable event id, never
//!    a per-attempt delivery id, or from the SHA-256 of the raw body where there
//!    is no id ([`KeyRule`], one namespace per consumer; 400 for a body that is
//!    not JSON);
//! 4. in a task of its own, which the request only awaits, the key is claimed
//!    with the payload's fingerprint ([`PayloadFingerprint`]): a duplicate is
//!    answered with the kept response and `Idempotent-Replayed: true`, a
//!    delivery still in flight elsewhere with 409 and `Retry-After`, the same
//!    key with another payload with 422 or, on signed routes, as a duplicate
//!    ([`OnMismatch`]), an unreachable store with 503 and `Retry-After`
//!    (nothing recorded);
//! 5. the route's handler runs under the claim, its lease extended beside it;
//!    a 2xx response is stored as the outcome and returned, anything else
//!    releases the claim so the provider's retry runs it again. A provider
//!    that gives up mid-handler does not stop it: its retry is told 409 until
//!    the handler is done, then gets the stored response. See [`Webhook`] for
//!    panics, time bounds, shutdown and crashes.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{routing::post, Json, Router};
//! use dedupe_core::{Deduper, MemoryStore};
//! use dedupe_webhook::{KeyRule, Scheme, Verifier, Webhook, WebhookEvent};
//!
//! async fn on_payment(event: WebhookEvent) -> Json<serde_json::Value> {
//!     // Runs once per event id, however often Stripe delivers it.
//!     Json(serde_json::json!({ "processed": event.key.to_string() }))
//! }
//!
//! let stripe = Webhook::new(Deduper::new(MemoryStore::new()), KeyRule::stripe("payments"))
//!     .verifier(Verifier::new(Scheme::Stripe, ["whsec_test_secret"])?);
//! let app: Router = Router::new().route("/hooks/stripe", post(on_payment).route_layer(stripe.layer()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod inbox;
mod key;
mod layer;
mod receiver;
mod signature;

/// The engine's answers and its replay header, the same for a webhook
/// delivery and an `Idempotency-Key` request.
pub use dedupe_http::{Answer, REPLAYED};
pub use inbox::StoredDelivery;
pub use key::{
    delivery_id, DeriveError, DerivedKey, KeyRule, KeySource, OnMismatch, PayloadFingerprint,
    PER_ATTEMPT_HEADERS,
};
pub use layer::{WebhookLayer, WebhookService};
pub use receiver::{ConcurrencyLimit, Webhook, WebhookEvent};
pub use signature::{Scheme, SecretError, SignatureError, Verified, Verifier};

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
