//! A response as the store keeps it, to answer a retry with byte for byte.
//!
//! The outcome bytes of a done record: `dh1` then the status (two bytes, big
//! endian), the number of headers (two bytes), each header as its name's
//! length (two bytes), the name, its value's length (four bytes), the value,
//! and the body to the end.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

const MAGIC: &[u8] = b"dh1";

/// The headers never kept for a replay: hop-by-hop headers (and whatever a
/// response's `Connection` names, RFC 9110 section 7.6.1), the framing
/// (recomputed), the date (a replay is sent now), and cookies (a replay must
/// not hand a first caller's session to whoever retries).
pub static NEVER_REPLAYED: [HeaderName; 12] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TRANSFER_ENCODING,
    http::header::TE,
    http::header::TRAILER,
    http::header::UPGRADE,
    http::header::PROXY_AUTHENTICATE,
    http::header::CONTENT_LENGTH,
    http::header::DATE,
    http::header::SET_COOKIE,
    http::header::AGE,
];

/// The header a replayed response carries (Stripe's name for it).
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response to keep: status, the headers worth replaying, and the body.
///
/// The layer makes one from each response it stores. A handler that
/// completes inside its own transaction makes one itself, stores
/// [`encode`](Self::encode) with `complete_in`, and answers
/// [`into_http`](Self::into_http), so the client sees what a retry
/// will see.
///
/// ```
/// use dedupe_http::StoredResponse;
/// use http::StatusCode;
/// let stored = StoredResponse::new(StatusCode::CREATED)
///     .header(http::header::CONTENT_TYPE, "application/json")
///     .body(&b"{\"id\":1}"[..]);
/// let again = StoredResponse::decode(&stored.encode()).unwrap();
/// assert_eq!(again, stored);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// A stored response that does not decode: a record written by something
/// else under the layer's namespace, or damaged. Answered 500, never run
/// again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the stored response does not decode: {0}")]
pub struct CorruptResponse(&'static str);

impl StoredResponse {
    /// A response with `status`, no headers, an empty body.
    pub fn new(status: StatusCode) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            body: Bytes::new(),
        }
    }

    /// The response's parts as the layer keeps them: its headers but
    /// [`NEVER_REPLAYED`] and `never`.
    pub fn from_parts(
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
        never: &[HeaderName],
    ) -> Self {
        // Fields the response's `Connection` names are hop-by-hop too.
        let named: Vec<HeaderName> = headers
            .get_all(http::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        let mut kept = HeaderMap::new();
        for (name, value) in headers {
            let hop = matches!(name.as_str(), "keep-alive" | "proxy-connection");
            if !hop
                && !NEVER_REPLAYED.contains(name)
                && !never.contains(name)
                && !named.contains(name)
            {
                kept.append(name.clone(), value.clone());
            }
        }
        Self {
            status,
            headers: kept,
            body,
        }
    }

    /// Adds a header. A name or value that is not valid HTTP is skipped.
    pub fn header<V>(mut self, name: HeaderName, value: V) -> Self
    where
        HeaderValue: TryFrom<V>,
    {
        if let Ok(value) = HeaderValue::try_from(value) {
            self.headers.append(name, value);
        }
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers kept.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body_bytes(&self) -> &Bytes {
        &self.body
    }

    /// The outcome bytes to store.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        let headers: Vec<_> = self
            .headers
            .iter()
            .take(usize::from(u16::MAX))
            .filter(|(_, v)| u32::try_from(v.len()).is_ok())
            .collect();
        out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
        for (name, value) in headers {
            // Header names are far under 64 KiB (hyper refuses longer ones).
            let name = name.as_str().as_bytes();
            out.extend_from_slice(&(name.len().min(usize::from(u16::MAX)) as u16).to_be_bytes());
            out.extend_from_slice(&name[..name.len().min(usize::from(u16::MAX))]);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads outcome bytes [`encode`](Self::encode) wrote.
    pub fn decode(stored: &[u8]) -> Result<Self, CorruptResponse> {
        let mut rest = stored
            .strip_prefix(MAGIC)
            .ok_or(CorruptResponse("not a stored response (no dh1 header)"))?;
        let mut take = |n: usize| -> Result<&[u8], CorruptResponse> {
            if rest.len() < n {
                return Err(CorruptResponse("cut short"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u16_at = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
        let status = StatusCode::from_u16(u16_at(take(2)?))
            .map_err(|_| CorruptResponse("a status out of range"))?;
        let count = u16_at(take(2)?);
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let len = usize::from(u16_at(take(2)?));
            let name = HeaderName::from_bytes(take(len)?)
                .map_err(|_| CorruptResponse("a header name that is not HTTP"))?;
            let b = take(4)?;
            let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            let value = HeaderValue::from_bytes(take(len)?)
                .map_err(|_| CorruptResponse("a header value that is not HTTP"))?;
            headers.append(name, value);
        }
        Ok(Self {
            status,
            headers,
            body: Bytes::copy_from_slice(rest),
        })
    }

    /// The response to send, with a body of the type the caller names or
    /// its return type implies: `axum::body::Body` (an axum `Response`),
    /// `http_body_util::Full<Bytes>`. (Not `into_response`: that is axum's
    /// trait method, and a generic one of the same name left `impl
    /// IntoResponse` handlers unable to tell which was meant.)
    ///
    /// ```
    /// use dedupe_http::StoredResponse;
    /// let stored = StoredResponse::new(http::StatusCode::CREATED).body("{\"id\":1}");
    /// let response = stored.into_http::<http_body_util::Full<bytes::Bytes>>();
    /// assert_eq!(response.status(), 201);
    /// ```
    pub fn into_http<B: From<Bytes>>(self) -> Response<B> {
        let mut response = Response::new(B::from(self.body));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hop-by-hop fields are not kept: the listed ones, and those the
    /// response's `Connection` names.
    #[test]
    fn hop_by_hop_fields_are_not_kept() {
        let mut headers = HeaderMap::new();
        headers.append(
            http::header::CONNECTION,
            HeaderValue::from_static("x-hop, close"),
        );
        headers.append("x-hop", HeaderValue::from_static("1"));
        headers.append("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.append("proxy-connection", HeaderValue::from_static("keep-alive"));
        headers.append("x-end", HeaderValue::from_static("2"));
        let stored = StoredResponse::from_parts(StatusCode::OK, &headers, Bytes::new(), &[]);
        let kept: Vec<&str> = stored.headers().keys().map(|n| n.as_str()).collect();
        assert_eq!(kept, ["x-end"]);
    }

    #[test]
    fn round_trip_and_corruption() {
        let mut headers = HeaderMap::new();
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        headers.append(http::header::SET_COOKIE, HeaderValue::from_static("s=1"));
        let stored = StoredResponse::from_parts(
            StatusCode::CREATED,
            &headers,
            Bytes::from_static(b"\x00body\xff"),
            &[],
        );
        assert!(!stored.headers().contains_key(http::header::SET_COOKIE));
        let bytes = stored.encode();
        assert_eq!(StoredResponse::decode(&bytes), Ok(stored));
        for cut in 0..bytes.len() - 7 {
            assert!(
                StoredResponse::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        assert!(StoredResponse::decode(b"{\"json\": 1}").is_err());
    }
}
