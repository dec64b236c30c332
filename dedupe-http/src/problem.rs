//! The layer's own answers, as RFC 9457 problem details
//! (`application/problem+json`).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::stored::StoredResponse;

/// The `type` of each problem the layer answers, under one base (the IETF
/// draft names none).
pub const PROBLEM_BASE: &str = "https://docs.rs/dedupe-http/latest/dedupe_http/problems#";

/// Which problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Problem {
    /// 400: the key is missing where required, or malformed.
    BadKey,
    /// 409: the first request with this key is still running.
    InFlight,
    /// 413: the request body is over the layer's limit.
    BodyTooLarge,
    /// 422: the key was used for another request.
    KeyReused,
    /// 500: the handler panicked (nothing stored; a retry runs it again).
    HandlerPanicked,
    /// 500: the response was over the size the layer stores.
    ResponseTooLarge,
    /// 500: the stored response does not decode.
    CorruptStored,
    /// 503: the store could not be reached; nothing ran.
    StoreUnavailable,
    /// 400: the request body could not be read.
    BodyUnreadable,
}

impl Problem {
    fn parts(self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Problem::BadKey => (StatusCode::BAD_REQUEST, "bad-key", "Bad Idempotency-Key"),
            Problem::InFlight => (
                StatusCode::CONFLICT,
                "in-flight",
                "A request with this Idempotency-Key is being processed",
            ),
            Problem::BodyTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
            ),
            Problem::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key reused with a different request",
            ),
            Problem::HandlerPanicked => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "handler-panicked",
                "The request's handler failed",
            ),
            Problem::ResponseTooLarge => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-too-large",
                "The response is too large to keep for retries",
            ),
            Problem::CorruptStored => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "corrupt-stored-response",
                "The stored response for this Idempotency-Key cannot be read",
            ),
            Problem::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "The idempotency store is unavailable",
            ),
            Problem::BodyUnreadable => (
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "The request body could not be read",
            ),
        }
    }

    /// The problem as a response saying `detail`, with `Retry-After` when
    /// given.
    pub(crate) fn response<B: From<Bytes>>(
        self,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<B> {
        self.stored(detail, retry_after).into_response()
    }

    /// The same, as a response to keep.
    pub(crate) fn stored(self, detail: &str, retry_after: Option<Duration>) -> StoredResponse {
        let (status, slug, title) = self.parts();
        let body = serde_json::json!({
            "type": format!("{PROBLEM_BASE}{slug}"),
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
