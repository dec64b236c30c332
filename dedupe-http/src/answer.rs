//! What a front door answered: one name per answer, for the response's
//! extensions, the metrics and the RFC 9457 problem bodies
//! (`application/problem+json`) of every refusal.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::stored::StoredResponse;

/// The `type` of each problem answered, this base followed by the answer's
/// [`slug`](Answer::slug): `...#in-flight`, `...#mismatch`.
pub const PROBLEM_BASE: &str = "https://docs.rs/dedupe-http/latest/dedupe_http/enum.Answer.html#";

/// What a request (or a webhook delivery) was answered. Every response of the
/// layer carries one in its extensions; it labels the metrics
/// `dedupe_requests_total{namespace, answer}` and
/// `dedupe_request_seconds{answer}`, and a refusal's problem `type` ends with
/// its [`slug`](Self::slug).
///
/// The answers after "a verifying layer's" are given by a layer in front of
/// the engine (dedupe-webhook's signature check and inbox mode), with the
/// same names, bodies and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Answer {
    /// The handler ran and its response was kept (or the handler settled the
    /// claim itself).
    Processed,
    /// A retry, answered with the kept response (`Idempotent-Replayed: true`).
    Replayed,
    /// 409 with `Retry-After`: the first request with the key is still running.
    InFlight,
    /// 422 `mismatch`: the key was used with another request or payload.
    Mismatch,
    /// The key with another payload where [`OnMismatch::Replay`] says a
    /// mismatch is a duplicate: answered with the kept response.
    MismatchReplayed,
    /// The handler ran and its status is not kept: sent, and the claim
    /// released, so a retry runs it again.
    Failed,
    /// 500 `panicked`: the handler panicked; nothing kept, a retry runs it.
    Panicked,
    /// 503 `handler-timeout` with `Retry-After`: the handler ran past the
    /// deduper's bound and was stopped; its claim released.
    HandlerTimeout,
    /// The handler finished after its lease was taken over: its response is
    /// sent, but the request may have run twice (logged at `ERROR`).
    LeaseLost,
    /// 500 `response-too-large`: the handler ran, and its response is over
    /// what is kept; this problem is kept in its place.
    ResponseTooLarge,
    /// 500 `corrupt-stored-response`: the kept outcome does not decode.
    CorruptStored,
    /// 503 `unavailable` with `Retry-After`: the store could not be reached,
    /// or the server is shutting down; nothing was run.
    Unavailable,
    /// 500 `error`: the store refused for a reason a retry does not fix.
    Error,
    /// 400 `bad-key`: no key where one is required, or a malformed one.
    BadKey,
    /// 413 `too-large`: the request body is over the limit.
    TooLarge,
    /// 400 `bad-request`: the body could not be read, or (a verifying
    /// layer's) is not what the route takes.
    BadRequest,
    /// A verifying layer's: 408 `timed-out`, the body did not arrive in time.
    TimedOut,
    /// A verifying layer's: 401 `unauthorized`, a missing, bad or stale
    /// signature.
    Unauthorized,
    /// A verifying layer's: 503 `busy` with `Retry-After`, over its
    /// concurrency limit; nothing was read or claimed.
    Busy,
    /// A verifying layer's (inbox mode): 202, accepted into the inbox.
    Queued,
    /// A verifying layer's (inbox mode): 200, the inbox holds or has done the
    /// event; nothing stored or run.
    Known,
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
            Answer::Failed => "failed",
            Answer::Panicked => "panicked",
            Answer::HandlerTimeout => "handler_timeout",
            Answer::LeaseLost => "lease_lost",
            Answer::ResponseTooLarge => "response_too_large",
            Answer::CorruptStored => "corrupt_stored_response",
            Answer::Unavailable => "unavailable",
            Answer::Error => "error",
            Answer::BadKey => "bad_key",
            Answer::TooLarge => "too_large",
            Answer::BadRequest => "bad_request",
            Answer::TimedOut => "timed_out",
            Answer::Unauthorized => "unauthorized",
            Answer::Busy => "busy",
            Answer::Queued => "queued",
            Answer::Known => "known",
        }
    }

    /// The name in a problem's `type`: [`as_str`](Self::as_str) with `-`
    /// for `_`.
    pub fn slug(self) -> String {
        self.as_str().replace('_', "-")
    }

    /// The status of this answer's problem, and its title; `None` for the
    /// answers that are not refusals.
    fn problem_parts(self) -> Option<(StatusCode, &'static str)> {
        Some(match self {
            Answer::InFlight => (
                StatusCode::CONFLICT,
                "A request with this key is being processed",
            ),
            Answer::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "The key was used with a different request",
            ),
            Answer::Panicked => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The request's handler failed",
            ),
            Answer::HandlerTimeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "The request's handler ran past its time bound",
            ),
            Answer::ResponseTooLarge => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The response is too large to keep for retries",
            ),
            Answer::CorruptStored => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The kept response for this key cannot be read",
            ),
            Answer::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "The idempotency store is unavailable",
            ),
            Answer::Error => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The idempotency store refused the request",
            ),
            Answer::BadKey => (StatusCode::BAD_REQUEST, "Bad idempotency key"),
            Answer::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "Request body too large"),
            Answer::BadRequest => (StatusCode::BAD_REQUEST, "Bad request"),
            Answer::TimedOut => (
                StatusCode::REQUEST_TIMEOUT,
                "The request body did not arrive in time",
            ),
            Answer::Unauthorized => (StatusCode::UNAUTHORIZED, "Bad signature"),
            Answer::Busy => (StatusCode::SERVICE_UNAVAILABLE, "Too many requests at once"),
            Answer::Processed
            | Answer::Replayed
            | Answer::MismatchReplayed
            | Answer::Failed
            | Answer::LeaseLost
            | Answer::Queued
            | Answer::Known => return None,
        })
    }

    /// This answer as a problem response saying `detail` (never a store's or
    /// a driver's text, which can name hosts, tables or credentials), with
    /// `Retry-After` when given, and the answer in its extensions. An answer
    /// that is no refusal gets a 500 problem naming it.
    pub fn problem<B: From<Bytes>>(
        self,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<B> {
        let mut response: Response<B> = self.stored_problem(detail, retry_after).into_http();
        response.extensions_mut().insert(self);
        response
    }

    /// The same, as a response to keep.
    pub(crate) fn stored_problem(
        self,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> StoredResponse {
        let (status, title) = self
            .problem_parts()
            .unwrap_or((StatusCode::INTERNAL_SERVER_ERROR, "Unexpected answer"));
        let body = serde_json::json!({
            "type": format!("{PROBLEM_BASE}{}", self.slug()),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut stored = StoredResponse::new(status)
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            )
            .body(Bytes::from(body.to_string()));
        if let Some(after) = retry_after {
            // Whole seconds, rounded up, at least one.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            stored = stored.header(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        stored
    }
}

/// Counts a response by the [`Answer`] in its extensions
/// (`dedupe_requests_total{namespace, answer}`) and its time since `started`
/// (`dedupe_request_seconds{answer}`). A response without an answer (a
/// request the layer let through untouched) is not counted. For a layer in
/// front of the engine that answers requests itself.
pub fn count<B>(namespace: &str, started: Instant, response: &Response<B>) {
    let Some(answer) = response.extensions().get::<Answer>().copied() else {
        return;
    };
    metrics::counter!(
        "dedupe_requests_total",
        "namespace" => namespace.to_string(),
        "answer" => answer.as_str()
    )
    .increment(1);
    metrics::histogram!("dedupe_request_seconds", "answer" => answer.as_str())
        .record(started.elapsed().as_secs_f64());
}

/// What a request whose key is known with another fingerprint gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnMismatch {
    /// 422: the key was used before with a different request (the default).
    #[default]
    Refuse,
    /// Answer it as the duplicate it is (the kept response, or 409 while the
    /// first is in flight), and log and count it (`mismatch_replayed`). For
    /// a sender that is authenticated and re-renders what it resends (a
    /// webhook provider whose signature covered the key).
    Replay,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_is_a_problem_with_its_slug() {
        for answer in [
            Answer::InFlight,
            Answer::Mismatch,
            Answer::Panicked,
            Answer::HandlerTimeout,
            Answer::ResponseTooLarge,
            Answer::CorruptStored,
            Answer::Unavailable,
            Answer::Error,
            Answer::BadKey,
            Answer::TooLarge,
            Answer::BadRequest,
            Answer::TimedOut,
            Answer::Unauthorized,
            Answer::Busy,
        ] {
            let response: Response<Bytes> =
                answer.problem("detail", Some(Duration::from_millis(1500)));
            assert!(!response.status().is_success(), "{answer:?}");
            assert_eq!(response.extensions().get::<Answer>(), Some(&answer));
            assert_eq!(response.headers()[header::RETRY_AFTER], "2");
            let body: serde_json::Value =
                serde_json::from_slice(response.body()).expect("a JSON body");
            assert_eq!(
                body["type"],
                format!("{PROBLEM_BASE}{}", answer.slug()),
                "{answer:?}"
            );
            assert_eq!(body["status"], response.status().as_u16());
        }
    }
}
