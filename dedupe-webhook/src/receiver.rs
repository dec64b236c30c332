//! The receiving path: read the body (bounded), verify the signature, derive the
//! key; then, in a task of its own that the request only awaits, claim it, run
//! the app's handler under the claim, and complete with its response or release
//! on failure. Duplicates are answered with the stored response.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use dedupe_core::{
    ClaimOptions, ClaimOutcome, DedupeStore, Deduper, Drained, Error, Fingerprint, Key, Lease,
    OnFailure, RecordState, Settle, Worked,
};
use http::{header, HeaderValue, Request, StatusCode};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::key::{DerivedKey, KeyRule, OnMismatch};
use crate::signature::Verifier;

/// The header that marks an answer replayed from a stored response.
pub const REPLAY_HEADER: &str = "idempotent-replay";

/// What the receiver answered, put in every response's extensions (for metrics
/// and logs of the app around it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// First delivery: the handler ran and its response was stored.
    Processed,
    /// A duplicate, answered with the stored response.
    Replayed,
    /// The same key is being processed elsewhere (409).
    InFlight,
    /// The same key with another payload (422).
    Mismatch,
    /// The same key with another payload on a route whose policy is
    /// [`OnMismatch::Replay`]: answered as a duplicate (the stored response).
    MismatchReplayed,
    /// Over the receiver's concurrency limit (503 with `Retry-After`); nothing
    /// was claimed.
    Busy,
    /// The body is over the limit (413).
    TooLarge,
    /// The body is not JSON, or holds no usable id (400).
    BadRequest,
    /// The body did not arrive in time (408).
    TimedOut,
    /// Missing, bad or stale signature (401).
    Unauthorized,
    /// The store could not be reached (503); nothing was recorded.
    Unavailable,
    /// Inbox mode: a new event, accepted into the inbox (202); the handler
    /// runs on a worker.
    Queued,
    /// Inbox mode: an event the inbox holds or has done (200); nothing was
    /// stored or run.
    Known,
    /// The handler failed; the claim was released so a retry runs it (its
    /// status, usually 500), or kept with the deduper's
    /// [`OnFailure::Keep`].
    Failed,
    /// The handler panicked; the claim was released (500).
    Panicked,
    /// The handler ran past the deduper's
    /// [`max_work_time`](Deduper::with_max_work_time): it was aborted and its
    /// claim released (503 with `Retry-After`).
    HandlerTimeout,
    /// The handler finished after its lease was taken over by another
    /// delivery: its response is answered, but the event may have been
    /// processed twice (logged at `ERROR`).
    LeaseLost,
    /// The store refused the request for a reason a retry does not fix (500).
    Error,
}

impl Answer {
    /// A short name, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::Processed => "processed",
            Answer::Replayed => "replayed",
            Answer::InFlight => "in_flight",
            Answer::Mismatch => "mismatch",
            Answer::MismatchReplayed => "mismatch_replayed",
            Answer::Busy => "busy",
            Answer::TooLarge => "too_large",
            Answer::BadRequest => "bad_request",
            Answer::TimedOut => "timed_out",
            Answer::Unauthorized => "unauthorized",
            Answer::Unavailable => "unavailable",
            Answer::Queued => "queued",
            Answer::Known => "known",
            Answer::Failed => "failed",
            Answer::Panicked => "panicked",
            Answer::HandlerTimeout => "handler_timeout",
            Answer::LeaseLost => "lease_lost",
            Answer::Error => "error",
        }
    }
}

/// The claimed delivery, handed to the app's handler as a request extension
/// (and as an axum extractor).
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
    /// How long the stored response is kept.
    pub retention: Duration,
}

impl WebhookEvent {
    /// The outcome bytes to store for a response, as the receiver itself stores
    /// them: for a handler that completes the lease itself, in its own
    /// transaction, and then marks its response [`Completed`].
    pub fn outcome_for(status: StatusCode, content_type: Option<&str>, body: &[u8]) -> Vec<u8> {
        StoredResponse::new(status, content_type, body).encode()
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for WebhookEvent {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<WebhookEvent>().cloned().ok_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            "WebhookEvent used on a route without the webhook layer",
        ))
    }
}

/// Marks a response whose handler completed the lease itself (for example with
/// `complete_in`, in the transaction of its own writes): the receiver then
/// neither completes nor releases it.
#[derive(Debug, Clone, Copy)]
pub struct Completed;

impl IntoResponseParts for Completed {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(Completed);
        Ok(res)
    }
}

/// A response as stored in the record's outcome, replayed to duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoredResponse {
    status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_hex: Option<String>,
}

impl StoredResponse {
    fn new(status: StatusCode, content_type: Option<&str>, body: &[u8]) -> Self {
        let (text, hex_body) = match std::str::from_utf8(body) {
            Ok(text) => (Some(text.to_string()), None),
            Err(_) => (None, Some(hex::encode(body))),
        };
        Self {
            status: status.as_u16(),
            content_type: content_type.map(str::to_string),
            body: text,
            body_hex: hex_body,
        }
    }

    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }

    fn into_response(self, key: &Key) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let body = match (self.body, self.body_hex.and_then(|h| hex::decode(h).ok())) {
            (Some(text), _) => text.into_bytes(),
            (None, Some(bytes)) => bytes,
            (None, None) => Vec::new(),
        };
        let mut response = (status, body).into_response();
        if let Some(ct) = self
            .content_type
            .and_then(|c| HeaderValue::from_str(&c).ok())
        {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        mark_replay(&mut response, key);
        response
    }
}

fn mark_replay(response: &mut Response, key: &Key) {
    response
        .headers_mut()
        .insert(REPLAY_HEADER, HeaderValue::from_static("true"));
    if let Ok(k) = HeaderValue::from_str(&key.to_string()) {
        response.headers_mut().insert("idempotency-key", k);
    }
    response.extensions_mut().insert(Answer::Replayed);
}

/// A webhook receiver over one store: its key rule, signature check and limits.
///
/// Use it as a tower layer on an axum route ([`Webhook::layer`]), or call
/// [`Webhook::handle`] from middleware of your own. Clones share the store, the
/// running handlers and the concurrency limit.
///
/// # What a provider sees
///
/// The claim and the handler run in a task of their own, which the request
/// only awaits:
///
/// | what happens | the delivery | a copy meanwhile | a copy afterwards |
/// |---|---|---|---|
/// | the handler answers 2xx | its response | 409 + `Retry-After` | the stored response, `Idempotent-Replay: true` |
/// | the provider gives up (timeout, disconnect) mid-handler | (gone) | 409 + `Retry-After`: the handler goes on | the stored response of the first delivery |
/// | the handler answers non-2xx | its response | 409 | runs again (claim released); with the deduper's [`OnFailure::Keep`], the stored failure |
/// | the handler panics | 500 | 409 | runs again (claim released) |
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
    /// Inbox mode ([`Webhook::inbox`]): deliveries are accepted into it.
    pub(crate) inbox: Option<Arc<dyn dedupe_core::Inbox>>,
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

/// A JSON error answer. `message` is ours: never a store's or a driver's text,
/// which can name hosts, tables or credentials.
pub(crate) fn json_error(status: StatusCode, answer: Answer, message: String) -> Response {
    let mut response = (
        status,
        axum::Json(serde_json::json!({ "error": answer.as_str(), "message": message })),
    )
        .into_response();
    response.extensions_mut().insert(answer);
    response
}

fn retry_after(response: &mut Response, secs: u64) {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
}

/// A 503 with `Retry-After`: come back, nothing was recorded.
fn come_back(answer: Answer, message: &str, secs: u64) -> Response {
    let mut response = json_error(StatusCode::SERVICE_UNAVAILABLE, answer, message.into());
    retry_after(&mut response, secs);
    response
}

/// Counts an answer (`dedupe_webhook_deliveries_total`, by namespace and
/// answer) and its latency (`dedupe_webhook_seconds`, by answer).
fn counted(namespace: &str, started: Instant, response: Response) -> Response {
    let answer = response
        .extensions()
        .get::<Answer>()
        .copied()
        .unwrap_or(Answer::Error);
    metrics::counter!(
        "dedupe_webhook_deliveries_total",
        "namespace" => namespace.to_string(),
        "answer" => answer.as_str()
    )
    .increment(1);
    metrics::histogram!("dedupe_webhook_seconds", "answer" => answer.as_str())
        .record(started.elapsed().as_secs_f64());
    response
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

impl Webhook {
    /// Default largest body accepted, for providers without a larger need of
    /// their own (GitHub's rule asks for 25 MB).
    pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
    /// Default bound on reading a body.
    pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

    /// A receiver keyed by `rule`, with no signature check, whose claims
    /// live as `deduper` says: its store, lease and heartbeat, the bound on a
    /// handler's run ([`Deduper::with_max_work_time`], 10 minutes by
    /// default), how long stored responses answer duplicates (its
    /// [`Retention`](dedupe_core::Retention) for the rule's namespace, 35
    /// days by default), and whether a failed handler's response is kept
    /// ([`OnFailure`]; released by default). Receivers that share a deduper
    /// share its running handlers, and [`shutdown`](Self::shutdown) drains
    /// them all.
    pub fn new(deduper: Deduper, rule: KeyRule) -> Self {
        Self {
            deduper,
            rule,
            verifier: None,
            body_limit: None,
            require_json: true,
            read_timeout: Self::DEFAULT_READ_TIMEOUT,
            slots: None,
            inbox: None,
        }
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
        use tracing::Instrument;
        let started = Instant::now();
        let namespace = rule.namespace();
        let permit = match &self.slots {
            None => None,
            Some(slots) => match Arc::clone(&slots.0).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    tracing::warn!("concurrency limit reached");
                    let busy = come_back(Answer::Busy, "too many deliveries at once", 1);
                    return counted(namespace, started, busy);
                }
            },
        };
        let (parts, body) = req.into_parts();
        let accepted = match self.accept(rule, &parts.headers, body).await {
            Ok(accepted) => accepted,
            Err(refused) => return counted(namespace, started, refused),
        };
        let span = tracing::Span::current();
        span.record("key", tracing::field::display(&accepted.derived.key));
        if let Some(d) = &accepted.derived.delivery_id {
            span.record("delivery", d.as_str());
        }
        if let Some(inbox) = &self.inbox {
            // Inbox mode: one accept, answered at once; the handler runs on
            // a worker.
            let response = Self::enqueue(inbox.as_ref(), accepted, &parts.headers).await;
            drop(permit);
            return counted(namespace, started, response);
        }
        // From here the delivery is a task of its own: dropping this request
        // (the provider gave up) neither stops the handler nor frees its claim.
        let delivery = Delivery {
            deduper: self.deduper.clone(),
            retention: self.deduper.retention().for_namespace(namespace),
        };
        let owned_namespace = namespace.to_string();
        let task = self.deduper.spawn(
            async move {
                let response = delivery.process(accepted, parts, handler).await;
                drop(permit);
                counted(&owned_namespace, started, response)
            }
            .in_current_span(),
        );
        let task = match task {
            Ok(task) => task,
            Err(_) => {
                let closing = come_back(Answer::Unavailable, "the receiver is shutting down", 5);
                return counted(namespace, started, closing);
            }
        };
        match task.await {
            Ok(response) => response,
            Err(e) => {
                tracing::error!(error = %e, "the delivery's task ended early");
                json_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Answer::Error,
                    "the delivery could not be processed".into(),
                )
            }
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
            return Err(json_error(
                StatusCode::REQUEST_TIMEOUT,
                Answer::TimedOut,
                format!("the body did not arrive within {:?}", self.read_timeout),
            ));
        };
        let body = match read {
            Ok(body) => body,
            Err(BodyError::TooLarge) => return Err(self.too_large()),
            Err(BodyError::Broken(e)) => {
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    Answer::BadRequest,
                    format!("could not read the body: {e}"),
                ))
            }
        };
        let verified = match &self.verifier {
            None => None,
            Some(verifier) => match verifier.verify(headers, &body, SystemTime::now()) {
                Ok(verified) => Some(verified),
                Err(e) => {
                    tracing::info!(error = %e, "signature refused");
                    return Err(json_error(
                        StatusCode::UNAUTHORIZED,
                        Answer::Unauthorized,
                        e.to_string(),
                    ));
                }
            },
        };
        let bad =
            |message: String| json_error(StatusCode::BAD_REQUEST, Answer::BadRequest, message);
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
        json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Answer::TooLarge,
            format!("body over {} bytes", self.body_limit_bytes()),
        )
    }
}

/// What a delivery's task needs of its receiver: the claim's lifecycle and
/// what to do with the handler's response (not the rule or the verifier,
/// which have done their part before the task starts).
struct Delivery {
    deduper: Deduper,
    retention: Duration,
}

impl Delivery {
    /// The delivery's task: claim, then run the handler under the claim and
    /// settle it; or answer what the claim found.
    async fn process<F, Fut>(
        self,
        accepted: AcceptedDelivery,
        mut parts: http::request::Parts,
        handler: F,
    ) -> Response
    where
        F: FnOnce(Request<Body>) -> Fut,
        Fut: Future<Output = Response>,
    {
        let AcceptedDelivery {
            body,
            payload,
            derived,
            fingerprint,
            on_mismatch,
        } = accepted;
        let key = derived.key;
        let mut opts = ClaimOptions::new(self.deduper.lease_ttl());
        if let Some(fingerprint) = fingerprint {
            opts = opts.with_fingerprint(fingerprint);
        }
        let lease = match self.deduper.store().claim(&key, &opts).await {
            Ok(ClaimOutcome::Claimed(lease)) => lease,
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => return replay(&key, &outcome),
            Ok(ClaimOutcome::InFlight { deadline, .. }) => return in_flight(&key, deadline),
            Ok(ClaimOutcome::Mismatch { .. }) => return self.mismatch(&key, on_mismatch).await,
            Err(e) => return store_error(&e),
        };
        if body != payload {
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        parts.extensions.insert(WebhookEvent {
            key: key.clone(),
            event_id: derived.event_id,
            delivery_id: derived.delivery_id,
            lease: lease.clone(),
            body,
            payload: payload.clone(),
            retention: self.retention,
        });
        let request = Request::from_parts(parts, Body::from(payload));
        let (retention, on_failure) = (self.retention, self.deduper.on_failure());
        let max_outcome = self.deduper.store().capabilities().max_outcome_bytes;
        let worked = self
            .deduper
            .hold(lease, async move {
                let response = handler(request).await;
                let by_handler = response.extensions().get::<Completed>().is_some();
                let (head, body) = response.into_parts();
                let body = axum::body::to_bytes(body, RESPONSE_LIMIT).await;
                let success = head.status.is_success();
                let settle = if by_handler {
                    Settle::Settled
                } else if success || on_failure == OnFailure::Keep {
                    let content_type = head
                        .headers
                        .get(header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok());
                    let mut outcome = match &body {
                        Ok(bytes) => WebhookEvent::outcome_for(head.status, content_type, bytes),
                        Err(_) => WebhookEvent::outcome_for(head.status, None, b""),
                    };
                    if outcome.len() > max_outcome {
                        tracing::warn!(
                            bytes = outcome.len(),
                            "response too large to store; duplicates get its status and an empty body"
                        );
                        outcome = WebhookEvent::outcome_for(head.status, None, b"");
                    }
                    Settle::Complete { outcome, retention }
                } else {
                    Settle::Release
                };
                let mut head = head;
                if body.is_err() {
                    // The body could not be read (or was over the limit): it
                    // goes out empty, without the length it declared.
                    head.headers.remove(header::CONTENT_LENGTH);
                }
                ((head, body.unwrap_or_default(), success), settle)
            })
            .await;
        match worked {
            Worked::Returned {
                value: (mut head, body, success),
                settled,
            } => {
                let answer = match (&settled, success) {
                    (Err(Error::LeaseLost { .. }), _) => Answer::LeaseLost,
                    (_, true) => Answer::Processed,
                    (_, false) => Answer::Failed,
                };
                // Answering an error after a successful handler would make the
                // provider retry work that is done: the response goes out.
                head.extensions.insert(answer);
                Response::from_parts(head, Body::from(body))
            }
            Worked::Panicked { .. } => json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                Answer::Panicked,
                "the handler panicked; the event will be processed again".into(),
            ),
            Worked::TimedOut { limit, .. } => come_back(
                Answer::HandlerTimeout,
                &format!("the handler ran past {limit:?} and was stopped; retry"),
                1,
            ),
            Worked::Aborted { .. } => come_back(
                Answer::Unavailable,
                "the receiver shut down while the handler ran; retry",
                5,
            ),
            Worked::AlreadyRunning { deadline } => in_flight(&key, deadline),
            _ => json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                Answer::Error,
                "the delivery ended in a way this receiver does not know".into(),
            ),
        }
    }

    /// The same key with another fingerprint: 422, or with
    /// [`OnMismatch::Replay`] the duplicate's answer (logged and counted).
    async fn mismatch(&self, key: &Key, on_mismatch: OnMismatch) -> Response {
        if on_mismatch == OnMismatch::Refuse {
            return json_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                Answer::Mismatch,
                format!("{key} was delivered before with a different payload"),
            );
        }
        tracing::warn!(%key, "a signed delivery of a known key with a different payload: answered as a duplicate");
        match self.deduper.store().get(key).await {
            Ok(Some(record)) => match record.state {
                RecordState::Done { outcome, .. } => {
                    let mut response = replay(key, &outcome);
                    response.extensions_mut().insert(Answer::MismatchReplayed);
                    response
                }
                RecordState::InFlight { lease_deadline } => in_flight(key, lease_deadline),
            },
            // Gone between the claim and the read (released, expired): come
            // back, the next claim decides.
            Ok(None) => in_flight(key, SystemTime::now()),
            Err(e) => store_error(&e),
        }
    }
}

/// The stored response of a done record, marked as a replay.
fn replay(key: &Key, outcome: &[u8]) -> Response {
    match StoredResponse::decode(outcome) {
        Some(stored) => stored.into_response(key),
        None => {
            // Completed by something other than this receiver: the event was
            // processed, and that is all there is to say.
            let mut response = (
                StatusCode::OK,
                axum::Json(serde_json::json!({"duplicate": true, "key": key.to_string()})),
            )
                .into_response();
            mark_replay(&mut response, key);
            response
        }
    }
}

/// 409 with `Retry-After` until the holder's lease passes.
fn in_flight(key: &Key, deadline: SystemTime) -> Response {
    let wait = deadline
        .duration_since(SystemTime::now())
        .map(|d| d.as_secs() + 1)
        .unwrap_or(1);
    let mut response = json_error(
        StatusCode::CONFLICT,
        Answer::InFlight,
        format!("{key} is being processed by another delivery"),
    );
    retry_after(&mut response, wait);
    response
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

/// Largest handler response read (and returned); a larger one is cut, and
/// duplicates get its status with an empty body.
const RESPONSE_LIMIT: usize = 16 * 1024 * 1024;

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

pub(crate) fn store_error(e: &Error) -> Response {
    if e.is_retryable() {
        tracing::warn!(error = %e, "store unavailable");
        come_back(
            Answer::Unavailable,
            "the idempotency store is unavailable; nothing was recorded",
            1,
        )
    } else {
        tracing::error!(error = %e, "store refused the claim");
        json_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            Answer::Error,
            "the idempotency store refused the delivery; see the receiver's log".into(),
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

    #[test]
    fn stored_responses_round_trip() {
        let key = Key::new("t", "k").expect("key");
        for body in [&b"{\"ok\":true}"[..], &[0xff, 0x00, 0x10][..], b""] {
            let bytes = WebhookEvent::outcome_for(StatusCode::ACCEPTED, Some("x/y"), body);
            let stored = StoredResponse::decode(&bytes).expect("decodes");
            let response = stored.into_response(&key);
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            assert_eq!(response.headers()[REPLAY_HEADER], "true");
            assert_eq!(response.headers()[header::CONTENT_TYPE], "x/y");
        }
        assert!(StoredResponse::decode(b"not json").is_none());
    }
}
