//! The receiving path: read the body (bounded), verify the signature, derive
//! the key; then hand the delivery, keyed by its provider's event id, to the
//! one engine every front door runs on (dedupe-http's `Idempotency`), which
//! claims it, runs the app's handler under the claim in a task of its own,
//! and keeps or releases its response. Duplicates get the kept response.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::response::Response;
use dedupe_core::{DedupeStore, Deduper, Drained, Error, Fingerprint, Key, Lease, OnFailure};
use dedupe_http::{
    count, Answer, Idempotency, IdempotencyLayer, Idempotent, OnMismatch, RequestKey,
    StoredResponse,
};
use futures_util::future::BoxFuture;
use http::{header, HeaderValue, Request, StatusCode};
use tokio::sync::Semaphore;
use tower::{Layer, Service, ServiceExt};

use crate::key::{DerivedKey, KeyRule};
use crate::signature::Verifier;

/// The claimed delivery, handed to the app's handler: an axum extractor (and,
/// for a handler called through [`Webhook::handle`],
/// [`WebhookEvent::of`] on its request's extensions).
#[derive(Debug, Clone)]
pub struct WebhookEvent {
    /// The idempotency key.
    pub key: Key,
    /// The provider's event id, when the key came from one.
    pub event_id: Option<String>,
    /// The per-attempt delivery id, if the request carried one (never the key).
    pub delivery_id: Option<String>,
    /// The lease won by this delivery.
    pub lease: Lease,
    /// The raw body, as verified.
    pub body: Bytes,
    /// The event's JSON: the body itself, or for a form-encoded delivery
    /// (GitHub's `application/x-www-form-urlencoded` content type) its
    /// `payload` field. The handler's request carries this as its body.
    pub payload: Bytes,
    /// How long the kept response is kept.
    pub retention: Duration,
    /// The engine's hold on the claim, for [`completed`](Self::completed)
    /// (none for an event taken from the inbox: its worker settles it).
    claim: Option<Idempotent>,
}

/// What the verifying half leaves in the request's extensions for the
/// handler's [`WebhookEvent`].
#[derive(Debug, Clone)]
struct Delivered {
    event_id: Option<String>,
    delivery_id: Option<String>,
    body: Bytes,
    payload: Bytes,
}

impl WebhookEvent {
    /// The outcome bytes to keep for a response, as the engine keeps them
    /// (dedupe-http's [`StoredResponse`]): for a handler that completes the
    /// lease itself, in its own transaction, and then says so with
    /// [`completed`](Self::completed).
    pub fn outcome_for(status: StatusCode, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
        let mut stored = StoredResponse::new(status).body(Bytes::copy_from_slice(body));
        if let Some(content_type) = content_type {
            stored = stored.header(header::CONTENT_TYPE, content_type);
        }
        stored.encode()
    }

    /// Says the handler completed (or released) the lease itself, for
    /// example with `complete_in` in the transaction of its own writes: the
    /// receiver sends the handler's response as it is and settles nothing.
    /// Call it after the commit. On an event taken from the inbox it does
    /// nothing: the worker completes the item with the handler's outcome,
    /// which answers Ok when the handler already did with the same one.
    pub fn completed(&self) {
        if let Some(claim) = &self.claim {
            claim.completed();
        }
    }

    /// The event of a request the receiver claimed, from its extensions;
    /// `None` on a request that did not come through a receiver.
    pub fn of(extensions: &http::Extensions) -> Option<Self> {
        let delivered = extensions.get::<Delivered>()?;
        let claim = extensions.get::<Idempotent>()?;
        Some(Self {
            key: claim.lease().key.clone(),
            event_id: delivered.event_id.clone(),
            delivery_id: delivered.delivery_id.clone(),
            lease: claim.lease().clone(),
            body: delivered.body.clone(),
            payload: delivered.payload.clone(),
            retention: claim.retention(),
            claim: Some(claim.clone()),
        })
    }

    /// An event taken from the inbox ([`WebhookEvent::from_item`]).
    pub(crate) fn from_parts(
        lease: Lease,
        event_id: Option<String>,
        delivery_id: Option<String>,
        body: Bytes,
        payload: Bytes,
        retention: Duration,
    ) -> Self {
        Self {
            key: lease.key.clone(),
            event_id,
            delivery_id,
            lease,
            body,
            payload,
            retention,
            claim: None,
        }
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for WebhookEvent {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Self::of(&parts.extensions).ok_or_else(|| {
            Answer::Error.problem(
                "WebhookEvent used on a route without the webhook layer",
                None,
            )
        })
    }
}

/// A webhook receiver over one store: its key rule, signature check and limits.
///
/// Use it as a tower layer on an axum route ([`Webhook::layer`]), or call
/// [`Webhook::handle`] from middleware of your own. Clones share the store, the
/// running handlers and the concurrency limit.
///
/// The receiver verifies and keys each delivery, then hands it to
/// dedupe-http's [`Idempotency`] engine keyed by that key
/// ([`Idempotency::keyed_by_extension`]): a delivery and an
/// `Idempotency-Key` request take the same path from the claim on, with the
/// same answers ([`Answer`]), the same kept-response format, RFC 9457
/// problem bodies for every refusal, and the same metrics
/// (`dedupe_requests_total{namespace, answer}`,
/// `dedupe_request_seconds{answer}`).
///
/// # What a provider sees
///
/// The claim and the handler run in a task of their own, which the request
/// only awaits:
///
/// | what happens | the delivery | a copy meanwhile | a copy afterwards |
/// |---|---|---|---|
/// | the handler answers 2xx | its response | 409 + `Retry-After` | the kept response, `Idempotent-Replayed: true` |
/// | the provider gives up (timeout, disconnect) mid-handler | (gone) | 409 + `Retry-After`: the handler goes on | the stored response of the first delivery |
/// | the handler answers non-2xx | its response | 409 | runs again (claim released); with the deduper's [`OnFailure::Keep`], the stored failure |
/// | the handler panics | 500 `panicked` | 409 | runs again (claim released) |
/// | past the deduper's [`max_work_time`](Deduper::with_max_work_time) (10 minutes by default) | 503 + `Retry-After` (handler aborted) | 409 | runs again (claim released) |
/// | [`shutdown`](Self::shutdown) | new deliveries 503 + `Retry-After`; running handlers finish within the grace, then are aborted and released | | |
/// | the process crashes | (connection reset) | 409 until the lease passes | runs again as a takeover (attempt 2) |
///
/// A crash mid-handler is the one case where a handler runs twice. Give the
/// services your handler calls the event's key as their own idempotency key
/// (Stripe's `Idempotency-Key` header, say):
///
/// ```
/// use dedupe_webhook::WebhookEvent;
///
/// async fn refund(event: WebhookEvent, http: &reqwest_like::Client) {
///     // The takeover after a crash sends the same key: Stripe answers it
///     // with the first refund instead of making a second.
///     http.post("https://api.stripe.com/v1/refunds")
///         .header("Idempotency-Key", event.key.to_string())
///         .send();
/// }
/// # mod reqwest_like {
/// #     pub struct Client;
/// #     pub struct Request;
/// #     impl Client { pub fn post(&self, _: &str) -> Request { Request } }
/// #     impl Request { pub fn header(self, _: &str, _: String) -> Self { self } pub fn send(self) {} }
/// # }
/// ```
#[derive(Clone)]
pub struct Webhook {
    deduper: Deduper,
    rule: KeyRule,
    verifier: Option<Verifier>,
    body_limit: Option<usize>,
    require_json: bool,
    read_timeout: Duration,
    slots: Option<ConcurrencyLimit>,
    /// The engine's settings, and the layer built from them.
    engine: (Idempotency, IdempotencyLayer),
    /// Inbox mode ([`Webhook::inbox`]): deliveries are accepted into it.
    pub(crate) inbox: Option<Arc<dyn dedupe_core::Inbox>>,
    /// What each accepted item carries ([`Webhook::with_item_attempts`]).
    pub(crate) accept_options: dedupe_core::AcceptOptions,
    /// The JSON pointer of each event's ordering key ([`Webhook::order_by`]).
    pub(crate) order_by: Option<String>,
}

/// A bound on the deliveries processed at once, which several receivers may
/// share (one limit for a whole server): [`Webhook::concurrency_limit`].
#[derive(Debug, Clone)]
pub struct ConcurrencyLimit(Arc<Semaphore>);

impl ConcurrencyLimit {
    /// At most `n` deliveries at once.
    pub fn new(n: usize) -> Self {
        Self(Arc::new(Semaphore::new(n)))
    }
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("rule", &self.rule)
            .field("verifier", &self.verifier)
            .field("body_limit", &self.body_limit_bytes())
            .field("deduper", &self.deduper)
            .finish_non_exhaustive()
    }
}

/// A request that passed every check before the claim.
pub(crate) struct AcceptedDelivery {
    pub(crate) body: Bytes,
    pub(crate) payload: Bytes,
    pub(crate) derived: DerivedKey,
    fingerprint: Option<Fingerprint>,
    on_mismatch: OnMismatch,
}

impl AcceptedDelivery {
    #[cfg(test)]
    pub(crate) fn for_tests(body: Bytes, payload: Bytes, derived: DerivedKey) -> Self {
        Self {
            body,
            payload,
            derived,
            fingerprint: None,
            on_mismatch: OnMismatch::Refuse,
        }
    }
}

/// The route's handler, called once, as the service the engine runs.
struct Once<F>(Arc<Mutex<Option<F>>>);

impl<F> Clone for Once<F> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<F, Fut> Service<Request<Body>> for Once<F>
where
    F: FnOnce(Request<Body>) -> Fut + Send + 'static,
    Fut: Future<Output = Response> + Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let handler = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        Box::pin(async move {
            Ok(match handler {
                Some(handler) => handler(req).await,
                // The engine calls the handler once per delivery.
                None => Answer::Error.problem("the handler was asked twice", None),
            })
        })
    }
}

impl Webhook {
    /// Default largest body accepted, for providers without a larger need of
    /// their own (GitHub's rule asks for 25 MB).
    pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
    /// Default bound on reading a body.
    pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

    /// A receiver keyed by `rule`, with no signature check, whose claims
    /// live as `deduper` says: its store, lease and heartbeat, the bound on a
    /// handler's run ([`Deduper::with_max_work_time`], 10 minutes by
    /// default), how long kept responses answer duplicates (its
    /// [`Retention`](dedupe_core::Retention) for the rule's namespace, 35
    /// days by default), and whether a failed handler's response is kept
    /// ([`OnFailure`]; released by default, so the provider's retry runs the
    /// handler again). Receivers that share a deduper share its running
    /// handlers, and [`shutdown`](Self::shutdown) drains them all.
    pub fn new(deduper: Deduper, rule: KeyRule) -> Self {
        let keep_failures = deduper.on_failure() == OnFailure::Keep;
        let engine = Idempotency::keyed_by_extension(deduper.clone())
            .namespace(rule.namespace())
            // A provider's retry of a non-2xx runs the handler again, unless
            // failures are kept.
            .stored_statuses(move |status| keep_failures || status.is_success())
            .acknowledge_foreign_outcomes();
        let mut hook = Self {
            deduper,
            rule,
            verifier: None,
            body_limit: None,
            require_json: true,
            read_timeout: Self::DEFAULT_READ_TIMEOUT,
            slots: None,
            engine: (engine.clone(), engine.layer()),
            inbox: None,
            accept_options: dedupe_core::AcceptOptions::default(),
            order_by: None,
        };
        hook.set_engine_body_limit();
        hook
    }

    /// The engine reads bodies as large as this receiver accepts.
    fn set_engine_body_limit(&mut self) {
        let engine = self
            .engine
            .0
            .clone()
            .max_request_bytes(self.body_limit_bytes());
        self.engine = (engine.clone(), engine.layer());
    }

    /// How long the whole body may take to arrive (default 30 s); a slower one
    /// answers 408.
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }

    /// Checks every request's signature before anything else is done with it.
    pub fn verifier(mut self, verifier: Verifier) -> Self {
        self.verifier = Some(verifier);
        self
    }

    /// Largest body accepted; larger ones answer 413. Default: what the key
    /// rule's provider needs ([`KeyRule::provider_body_limit`]: GitHub 25 MB),
    /// else [`DEFAULT_BODY_LIMIT`](Self::DEFAULT_BODY_LIMIT) (1 MiB).
    ///
    /// Through [`layer`](Self::layer), a handler that reads the body again
    /// (`Json`, `Bytes`) gets this limit too, in place of axum's own 2 MB
    /// `DefaultBodyLimit`. A handler called from [`handle`](Self::handle) in
    /// middleware of your own should sit under
    /// `axum::extract::DefaultBodyLimit::max(limit)`, or read
    /// [`WebhookEvent::payload`] instead of the body.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = Some(bytes);
        self.set_engine_body_limit();
        self
    }

    /// The body limit in force.
    pub fn body_limit_bytes(&self) -> usize {
        self.body_limit
            .or(self.rule.provider_body_limit())
            .unwrap_or(Self::DEFAULT_BODY_LIMIT)
    }

    /// Whether bodies must be JSON (default yes; no: any bytes, keyed by headers
    /// or the body hash).
    pub fn require_json(mut self, require: bool) -> Self {
        self.require_json = require;
        self
    }

    /// At most `limit` deliveries at once (across clones), counted from the
    /// first byte of the body to the end of the handler: a delivery past it is
    /// answered 503 with `Retry-After` before its body is read or anything is
    /// claimed, instead of queueing (and buffering bodies) without bound.
    /// Unlimited by default.
    pub fn max_concurrency(self, limit: usize) -> Self {
        self.concurrency_limit(ConcurrencyLimit::new(limit))
    }

    /// The same, with a limit shared with other receivers.
    pub fn concurrency_limit(mut self, limit: ConcurrencyLimit) -> Self {
        self.slots = Some(limit);
        self
    }

    /// Stops taking deliveries (new ones get 503 with `Retry-After`) and waits
    /// up to `grace` for the running handlers of this receiver and its clones;
    /// handlers still running then are aborted and their claims released. Call
    /// it after the server stopped accepting connections.
    pub async fn shutdown(&self, grace: Duration) -> Drained {
        self.deduper.shutdown(grace).await
    }

    /// The key rule.
    pub fn rule(&self) -> &KeyRule {
        &self.rule
    }

    /// The store (behind the `TracedStore` every call goes through).
    pub fn store(&self) -> &Arc<dyn DedupeStore> {
        self.deduper.store()
    }

    /// This receiver as a tower layer, for `axum::Router::route_layer`.
    pub fn layer(self) -> crate::WebhookLayer {
        crate::WebhookLayer::new(self)
    }

    /// Runs one request through the receiving path with this receiver's rule.
    pub async fn handle<F, Fut>(&self, req: Request<Body>, handler: F) -> Response
    where
        F: FnOnce(Request<Body>) -> Fut + Send + 'static,
        Fut: Future<Output = Response> + Send + 'static,
    {
        self.handle_with_rule(&self.rule, req, handler).await
    }

    /// The same with another key rule (a namespace taken from the path, say).
    #[tracing::instrument(name = "dedupe.webhook", skip_all, fields(namespace = rule.namespace(), key, delivery))]
    pub async fn handle_with_rule<F, Fut>(
        &self,
        rule: &KeyRule,
        req: Request<Body>,
        handler: F,
    ) -> Response
    where
        F: FnOnce(Request<Body>) -> Fut + Send + 'static,
        Fut: Future<Output = Response> + Send + 'static,
    {
        let started = Instant::now();
        let namespace = rule.namespace();
        let refused = |response: Response| {
            count(namespace, started, &response);
            response
        };
        let permit = match &self.slots {
            None => None,
            Some(slots) => match Arc::clone(&slots.0).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    tracing::warn!("concurrency limit reached");
                    return refused(Answer::Busy.problem(
                        "too many deliveries at once; nothing was read or claimed",
                        Some(Duration::from_secs(1)),
                    ));
                }
            },
        };
        let (mut parts, body) = req.into_parts();
        let accepted = match self.accept(rule, &parts.headers, body).await {
            Ok(accepted) => accepted,
            Err(refusal) => return refused(refusal),
        };
        let span = tracing::Span::current();
        span.record("key", tracing::field::display(&accepted.derived.key));
        if let Some(d) = &accepted.derived.delivery_id {
            span.record("delivery", d.as_str());
        }
        if let Some(inbox) = &self.inbox {
            // Inbox mode: one accept, answered at once; the handler runs on
            // a worker.
            return refused(
                Self::enqueue(
                    inbox.as_ref(),
                    accepted,
                    &parts.headers,
                    &self.accept_options,
                    self.order_by.as_deref(),
                )
                .await,
            );
        }
        // From here the engine's: the claim, the handler in a task of its
        // own (dropping this request does not stop it or free its claim),
        // the kept response.
        let AcceptedDelivery {
            body,
            payload,
            derived,
            fingerprint,
            on_mismatch,
        } = accepted;
        if body != payload {
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        parts.extensions.insert(RequestKey {
            key: derived.key,
            fingerprint,
            on_mismatch,
        });
        parts.extensions.insert(Delivered {
            event_id: derived.event_id,
            delivery_id: derived.delivery_id,
            body,
            payload: payload.clone(),
        });
        let request = Request::from_parts(parts, Body::from(payload));
        // The concurrency slot goes with the handler into the engine's task
        // and is freed when the handler ends (or, when it never runs, with
        // the task): a provider that gives up mid-handler does not free it.
        let handler = move |req| async move {
            let response = handler(req).await;
            drop(permit);
            response
        };
        let engine = self
            .engine
            .1
            .layer(Once(Arc::new(Mutex::new(Some(handler)))));
        match engine.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        }
    }

    /// Reads the body (bounded in size and time), checks the signature before
    /// anything else, unwraps a form-encoded payload, checks the JSON when
    /// required, and derives the key and fingerprint; a refusal is the
    /// response to send.
    async fn accept(
        &self,
        rule: &KeyRule,
        headers: &http::HeaderMap,
        body: Body,
    ) -> Result<AcceptedDelivery, Response> {
        let limit = self.body_limit_bytes();
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > DRAIN_LIMIT.max(limit) as u64) {
            return Err(self.too_large()); // not worth reading to answer politely
        }
        let read = tokio::time::timeout(self.read_timeout, read_body(body, limit)).await;
        let Ok(read) = read else {
            return Err(Answer::TimedOut.problem(
                &format!("the body did not arrive within {:?}", self.read_timeout),
                None,
            ));
        };
        let body = match read {
            Ok(body) => body,
            Err(BodyError::TooLarge) => return Err(self.too_large()),
            Err(BodyError::Broken(e)) => {
                return Err(
                    Answer::BadRequest.problem(&format!("could not read the body: {e}"), None)
                )
            }
        };
        let verified = match &self.verifier {
            None => None,
            Some(verifier) => match verifier.verify(headers, &body, SystemTime::now()) {
                Ok(verified) => Some(verified),
                Err(e) => {
                    tracing::info!(error = %e, "signature refused");
                    return Err(Answer::Unauthorized.problem(&e.to_string(), None));
                }
            },
        };
        let bad = |message: String| Answer::BadRequest.problem(&message, None);
        let form = if rule.accepts_form_payload() {
            form_payload(headers, &body)
        } else {
            None
        };
        let payload = match form {
            Some(Ok(payload)) => payload,
            Some(Err(message)) => return Err(bad(message)),
            None => body.clone(),
        };
        if self.require_json {
            if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&payload) {
                return Err(bad(format!("body is not JSON: {e}")));
            }
        }
        let derived = rule
            .derive_verified(headers, &payload, verified.as_ref())
            .map_err(|e| bad(e.to_string()))?;
        Ok(AcceptedDelivery {
            fingerprint: rule.fingerprint_of(&payload),
            on_mismatch: rule.mismatch_policy(derived.signed),
            body,
            payload,
            derived,
        })
    }

    fn too_large(&self) -> Response {
        Answer::TooLarge.problem(
            &format!(
                "body over {} bytes; nothing was claimed",
                self.body_limit_bytes()
            ),
            None,
        )
    }
}

/// The `payload` field of a form-encoded delivery (GitHub's
/// `application/x-www-form-urlencoded` content type); `None` for any other
/// content type. The body must be that one field and nothing else: a JSON
/// body relabelled as a form (its content type is not signed) holds `&` or
/// no `payload=` at its start, and is refused rather than mined for a field.
fn form_payload(headers: &http::HeaderMap, body: &[u8]) -> Option<Result<Bytes, String>> {
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        return None;
    }
    // Checked on the raw bytes: the form parser skips empty pairs and decodes
    // names, so `&payload=...` or `pay%6Coad=...` would pass it as one field.
    Some(match body.strip_prefix(b"payload=") {
        Some(value) if !value.contains(&b'&') => {
            let decoded: String = form_urlencoded::parse(body)
                .map(|(_, value)| value.into_owned())
                .collect();
            Ok(Bytes::from(decoded.into_bytes()))
        }
        _ => Err("a form-encoded delivery must be exactly one field, payload".to_string()),
    })
}

enum BodyError {
    TooLarge,
    Broken(axum::Error),
}

/// How much of an oversized body is read (and thrown away) before answering
/// 413, so that the client, still sending, reads the answer instead of a reset
/// connection. Past it the connection is simply closed.
const DRAIN_LIMIT: usize = 8 * 1024 * 1024;

/// Reads the body, at most `limit` bytes; an oversized one is drained up to
/// [`DRAIN_LIMIT`] (for at most two seconds) and refused.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut buf = Vec::new();
    let mut seen = 0usize;
    let mut over = false;
    let drain_until = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let next = if over {
            match tokio::time::timeout_at(drain_until, body.frame()).await {
                Ok(next) => next,
                Err(_) => return Err(BodyError::TooLarge),
            }
        } else {
            body.frame().await
        };
        let Some(frame) = next else { break };
        let frame = frame.map_err(BodyError::Broken)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > limit {
            over = true;
            buf = Vec::new();
            if seen > DRAIN_LIMIT.max(limit) {
                return Err(BodyError::TooLarge);
            }
        } else {
            buf.extend_from_slice(&data);
        }
    }
    if over {
        return Err(BodyError::TooLarge);
    }
    Ok(Bytes::from(buf))
}

/// A store error of an inbox accept: 503 when a retry may get through, else
/// 500. The store's text goes to the log only: it can name hosts, tables or
/// credentials.
pub(crate) fn store_error(e: &Error) -> Response {
    if e.is_retryable() {
        tracing::warn!(error = %e, "store unavailable");
        Answer::Unavailable.problem(
            "the idempotency store is unavailable; nothing was recorded",
            Some(Duration::from_secs(1)),
        )
    } else {
        tracing::error!(error = %e, "store refused the delivery");
        Answer::Error.problem(
            "the idempotency store refused the delivery; see the receiver's log",
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_form_is_exactly_one_payload_field() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        let ok = form_payload(&headers, b"payload=%7B%22a%22%3A1%7D").expect("a form");
        assert_eq!(ok.expect("accepted"), Bytes::from_static(br#"{"a":1}"#));
        for body in [
            &b"&payload=x"[..],
            b"payload=x&&",
            b"pay%6Coad=x",
            b"payload",
            b"a=1&payload=x",
        ] {
            assert!(
                form_payload(&headers, body).expect("a form").is_err(),
                "{:?} was taken as one payload field",
                String::from_utf8_lossy(body)
            );
        }
    }
}
