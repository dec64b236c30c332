//! `Idempotency-Key` for HTTP APIs: a tower layer that runs each request
//! once, on any dedupe store.
//!
//! A client POSTs a payment, the response is lost, the client retries. With
//! the same `Idempotency-Key` header, the retry gets the first response back
//! instead of a second payment. The layer follows the IETF httpapi draft
//! (draft-ietf-httpapi-idempotency-key-header) and what Stripe's clients
//! expect:
//!
//! | request | answer |
//! |---|---|
//! | the first with a key | the handler runs; its response is kept (2xx and most 4xx) |
//! | a retry of the same request | the kept response, byte for byte, with `Idempotent-Replayed: true` |
//! | a retry while the first runs | 409 with `Retry-After` (or, opt-in, it waits for the first's outcome) |
//! | the same key on another request | 422 |
//! | no key where one is required, a malformed key | 400 |
//! | the store unreachable | 503 with `Retry-After`, nothing run |
//! | a 5xx from the handler | sent, not kept: the claim is released and the retry runs again |
//!
//! Errors are RFC 9457 problem details (`application/problem+json`). Keys
//! are scoped per caller ([`Idempotency::scoped`]) plus method and path.
//!
//! Underneath, each request is a claim of the store: one atomic step that
//! exactly one of any number of racing requests wins (fenced by a token,
//! taken over with its attempt counted if the server dies mid-request), and
//! the kept response is that claim's completion: see CONTRACT.md in the
//! repository for what every store guarantees.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use dedupe_core::{Deduper, MemoryStore};
//! use dedupe_http::Idempotency;
//!
//! # async fn run() {
//! // A key required on POST and PATCH; keys per caller (here its bearer token).
//! let idempotency = Idempotency::scoped(Deduper::new(MemoryStore::new()), |req| {
//!     req.headers.get("authorization")?.to_str().ok().map(String::from)
//! });
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "paid" }))
//!     .layer(idempotency.layer());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

mod answer;
mod header;
mod layer;
mod stored;

pub use answer::{count, Answer, OnMismatch, PROBLEM_BASE};
pub use header::{IdempotencyKey, KeyError, IDEMPOTENCY_KEY, MAX_KEY_BYTES};
pub use layer::{
    stored_by_default, Idempotency, IdempotencyLayer, IdempotencyService, Idempotent, KeyPolicy,
    LargeResponse, RequestKey,
};
pub use stored::{CorruptResponse, StoredResponse, NEVER_REPLAYED, REPLAYED};

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
