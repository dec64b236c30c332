//! The receiving path: read the body (bounded), verify the signature, derive the
//! key, claim it, run the app's handler, then complete with its response or
//! release on failure. Duplicates are answered with the stored response.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease};
use http::{header, HeaderValue, Request, StatusCode};
use serde::{Deserialize, Serialize};

use crate::key::{DerivedKey, KeyRule};
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
    /// The handler failed; the claim was released so a retry runs it (its
    /// status, usually 500).
    Failed,
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
            Answer::TooLarge => "too_large",
            Answer::BadRequest => "bad_request",
            Answer::TimedOut => "timed_out",
            Answer::Unauthorized => "unauthorized",
            Answer::Unavailable => "unavailable",
            Answer::Failed => "failed",
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

/// Releases a lease if the handler's future is dropped before it finished (the
/// client went away, the server is shutting down, the handler panicked).
struct ReleaseOnDrop {
    store: Arc<dyn DedupeStore>,
    lease: Option<Lease>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let store = Arc::clone(&self.store);
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    if let Err(e) = store.release(&lease).await {
                        tracing::warn!(key = %lease.key, error = %e, "could not release an abandoned claim; it frees itself when its lease passes");
                    }
                });
            }
        }
    }
}

/// A webhook receiver over one store: its key rule, signature check and limits.
///
/// Use it as a tower layer on an axum route ([`Webhook::layer`]), or call
/// [`Webhook::handle`] from middleware of your own.
#[derive(Clone)]
pub struct Webhook {
    store: Arc<dyn DedupeStore>,
    rule: KeyRule,
    verifier: Option<Verifier>,
    body_limit: usize,
    lease: Duration,
    retention: Duration,
    require_json: bool,
    read_timeout: Duration,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("rule", &self.rule)
            .field("verifier", &self.verifier)
            .field("body_limit", &self.body_limit)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

fn json_error(status: StatusCode, answer: Answer, message: String) -> Response {
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

impl Webhook {
    /// Default largest body accepted.
    pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
    /// Default bound on reading a body.
    pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);
    /// Default lease: longer than a provider waits for an answer. A running
    /// handler's lease is extended every third of it, so this bounds how long a
    /// crashed receiver holds an event, not how long a handler may run.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
    /// Default retention: longer than providers redeliver (Stripe resends for up
    /// to 30 days by hand).
    pub const DEFAULT_RETENTION: Duration = Duration::from_secs(35 * 24 * 3600);

    /// A receiver keyed by `rule` on `store`, with no signature check.
    pub fn new(store: Arc<dyn DedupeStore>, rule: KeyRule) -> Self {
        Self {
            store,
            rule,
            verifier: None,
            body_limit: Self::DEFAULT_BODY_LIMIT,
            lease: Self::DEFAULT_LEASE,
            retention: Self::DEFAULT_RETENTION,
            require_json: true,
            read_timeout: Self::DEFAULT_READ_TIMEOUT,
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

    /// Largest body accepted (default 1 MiB); larger ones answer 413.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// How long a claim holds the event (default 60 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long the stored response answers duplicates (default 35 days).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Whether bodies must be JSON (default yes; no: any bytes, keyed by headers
    /// or the body hash).
    pub fn require_json(mut self, require: bool) -> Self {
        self.require_json = require;
        self
    }

    /// The key rule.
    pub fn rule(&self) -> &KeyRule {
        &self.rule
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn DedupeStore> {
        &self.store
    }

    /// This receiver as a tower layer, for `axum::Router::route_layer`.
    pub fn layer(self) -> crate::WebhookLayer {
        crate::WebhookLayer::new(self)
    }

    /// Runs one request through the receiving path with this receiver's rule.
    pub async fn handle<F, Fut>(&self, req: Request<Body>, handler: F) -> Response
    where
        F: FnOnce(Request<Body>) -> Fut,
        Fut: Future<Output = Response>,
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
        F: FnOnce(Request<Body>) -> Fut,
        Fut: Future<Output = Response>,
    {
        let (mut parts, body) = req.into_parts();
        let body = match self.accept_body(&parts.headers, body).await {
            Ok(body) => body,
            Err(refused) => return refused,
        };
        let DerivedKey {
            key,
            event_id,
            delivery_id,
        } = match rule.derive(&parts.headers, &body) {
            Ok(derived) => derived,
            Err(e) => {
                return json_error(StatusCode::BAD_REQUEST, Answer::BadRequest, e.to_string())
            }
        };
        let span = tracing::Span::current();
        span.record("key", tracing::field::display(&key));
        if let Some(d) = &delivery_id {
            span.record("delivery", d.as_str());
        }
        let lease = match self.claim(&key, &body).await {
            Ok(lease) => lease,
            Err(answered) => return answered,
        };

        let mut guard = ReleaseOnDrop {
            store: Arc::clone(&self.store),
            lease: Some(lease.clone()),
        };
        parts.extensions.insert(WebhookEvent {
            key: key.clone(),
            event_id,
            delivery_id,
            lease: lease.clone(),
            body: body.clone(),
            retention: self.retention,
        });
        let (response, current) = self
            .run_with_heartbeat(lease, handler(Request::from_parts(parts, Body::from(body))))
            .await;

        if response.extensions().get::<Completed>().is_some() {
            guard.lease = None;
            let mut response = response;
            response.extensions_mut().insert(Answer::Processed);
            return response;
        }
        // From here on the guard must not release: a failed handler is released
        // below and a successful one is completed, each in a task of its own so
        // it happens even if this request is dropped while waiting.
        guard.lease = None;
        if !response.status().is_success() {
            self.release_after_failure(current).await;
            let mut response = response;
            response.extensions_mut().insert(Answer::Failed);
            return response;
        }
        self.complete_with_response(current, response).await
    }

    /// Reads the body (bounded in size and time), checks the signature before
    /// anything else, and the JSON when required; a refusal is the response to
    /// send.
    async fn accept_body(
        &self,
        headers: &http::HeaderMap,
        body: Body,
    ) -> Result<axum::body::Bytes, Response> {
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > DRAIN_LIMIT.max(self.body_limit) as u64) {
            return Err(self.too_large()); // not worth reading to answer politely
        }
        let read = tokio::time::timeout(self.read_timeout, read_body(body, self.body_limit)).await;
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
        if let Some(verifier) = &self.verifier {
            if let Err(e) = verifier.verify(headers, &body, SystemTime::now()) {
                tracing::info!(error = %e, "signature refused");
                return Err(json_error(
                    StatusCode::UNAUTHORIZED,
                    Answer::Unauthorized,
                    e.to_string(),
                ));
            }
        }
        if self.require_json {
            if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    Answer::BadRequest,
                    format!("body is not JSON: {e}"),
                ));
            }
        }
        Ok(body)
    }

    /// Claims `key` with the body's SHA-256 as fingerprint: the lease, or the
    /// response every other answer gets (a replay, 409 with `Retry-After`, 422,
    /// or the store's error).
    async fn claim(&self, key: &Key, body: &[u8]) -> Result<Lease, Response> {
        let opts = ClaimOptions::new(self.lease).with_fingerprint(Fingerprint::sha256(body));
        match self.store.claim(key, &opts).await {
            Ok(ClaimOutcome::Claimed(lease)) => Ok(lease),
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => {
                Err(match StoredResponse::decode(&outcome) {
                    Some(stored) => stored.into_response(key),
                    None => {
                        // Completed by something other than this receiver: the event
                        // was processed, and that is all there is to say.
                        let mut response = (
                            StatusCode::OK,
                            axum::Json(
                                serde_json::json!({"duplicate": true, "key": key.to_string()}),
                            ),
                        )
                            .into_response();
                        mark_replay(&mut response, key);
                        response
                    }
                })
            }
            Ok(ClaimOutcome::InFlight { deadline, .. }) => {
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
                Err(response)
            }
            Ok(ClaimOutcome::Mismatch { .. }) => Err(json_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                Answer::Mismatch,
                format!("{key} was delivered before with a different payload"),
            )),
            Err(e) => Err(store_error(&e)),
        }
    }

    /// Runs the handler while the lease is extended every third of its length,
    /// so a slow handler keeps its claim instead of losing it to a retry;
    /// answers its response and the lease as last extended.
    async fn run_with_heartbeat(
        &self,
        lease: Lease,
        run: impl Future<Output = Response>,
    ) -> (Response, Lease) {
        tokio::pin!(run);
        let mut current = lease;
        let beat = (self.lease / 3).max(Duration::from_millis(1));
        let response = loop {
            tokio::select! {
                response = &mut run => break response,
                () = tokio::time::sleep(beat) => {
                    match self.store.extend(&current, self.lease).await {
                        Ok(extended) => current = extended,
                        Err(e) => tracing::warn!(error = %e, "could not extend the lease of a running handler"),
                    }
                }
            }
        };
        (response, current)
    }

    /// Releases the claim of a handler that failed, in a task of its own.
    async fn release_after_failure(&self, lease: Lease) {
        let store = Arc::clone(&self.store);
        match tokio::spawn(async move { store.release(&lease).await }).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not release after a failed handler; the claim frees itself when its lease passes")
            }
            Err(e) => tracing::warn!(error = %e, "the release task failed"),
        }
    }

    /// The work is done: reads the response and stores it as the outcome, in
    /// a task of its own so it finishes even if this request is dropped; then
    /// answers the response.
    async fn complete_with_response(&self, lease: Lease, response: Response) -> Response {
        let this = self.clone();
        let finished = tokio::spawn(async move {
            let (head, body) = response.into_parts();
            let max = this.store.capabilities().max_outcome_bytes;
            let body = axum::body::to_bytes(body, RESPONSE_LIMIT).await;
            let content_type = head
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok());
            let mut outcome = match &body {
                Ok(bytes) => WebhookEvent::outcome_for(head.status, content_type, bytes),
                Err(_) => WebhookEvent::outcome_for(head.status, None, b""),
            };
            if outcome.len() > max {
                tracing::warn!(
                    bytes = outcome.len(),
                    "response too large to store; duplicates get its status and an empty body"
                );
                outcome = WebhookEvent::outcome_for(head.status, None, b"");
            }
            match this.complete(&lease, &outcome).await {
                Ok(()) => {}
                Err(e @ Error::LeaseLost { .. }) => tracing::error!(
                    error = %e,
                    "the handler finished after its lease was taken over: the event may have been processed twice"
                ),
                // Answering an error would make the provider retry work that is done.
                Err(e) => tracing::error!(error = %e, "the handler succeeded but its completion was not stored"),
            }
            (head, body.unwrap_or_default())
        })
        .await;
        match finished {
            Ok((mut head, body)) => {
                head.extensions.insert(Answer::Processed);
                Response::from_parts(head, Body::from(body))
            }
            Err(e) => json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                Answer::Error,
                format!("storing the response failed: {e}"),
            ),
        }
    }

    /// Completes, retrying a store that is briefly unavailable within the lease.
    async fn complete(&self, lease: &Lease, outcome: &[u8]) -> Result<(), Error> {
        let mut wait = Duration::from_millis(50);
        loop {
            match self.store.complete(lease, outcome, self.retention).await {
                Err(e) if e.is_retryable() && SystemTime::now() + wait < lease.deadline => {
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
                other => return other,
            }
        }
    }

    fn too_large(&self) -> Response {
        json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Answer::TooLarge,
            format!("body over {} bytes", self.body_limit),
        )
    }
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

fn store_error(e: &Error) -> Response {
    if e.is_retryable() {
        tracing::warn!(error = %e, "store unavailable");
        let mut response = json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            Answer::Unavailable,
            "the idempotency store is unavailable; nothing was recorded".into(),
        );
        retry_after(&mut response, 1);
        response
    } else {
        tracing::error!(error = %e, "store refused the claim");
        json_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            Answer::Error,
            format!("the idempotency store refused the claim: {e}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
