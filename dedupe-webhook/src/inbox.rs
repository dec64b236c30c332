//! The receiver's inbox mode: verify, derive the key, accept the delivery
//! into an [`Inbox`] and answer 202 at once; the handler runs later, on an
//! [`InboxWorker`](dedupe_core::InboxWorker), from the stored delivery.
//!
//! A provider then never waits on the handler (no timeout, no resend while
//! it runs), a failing handler is retried on the worker's backoff with its
//! attempts counted and ends dead after the last one (for an operator to
//! replay), and the delivery's bytes are kept until it is done.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use dedupe_core::{Accepted, DedupeStore, Error, Inbox, Key, Taken};
use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use dedupe_http::Answer;

use crate::receiver::{store_error, AcceptedDelivery, Webhook, WebhookEvent};
use crate::KeyRule;

/// Headers never kept with a delivery: credentials and the connection's own.
const NOT_KEPT: [HeaderName; 9] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::COOKIE,
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::CONTENT_LENGTH,
];

/// The first bytes of a stored delivery, and its format's version.
const MAGIC: &[u8] = b"dwi1\n";

/// A header as kept: its value as text, or as hex when it is not text.
#[derive(Debug, Serialize, Deserialize)]
struct StoredHeader {
    n: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    x: Option<String>,
}

/// What is kept of a delivery besides its bytes (one JSON line).
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    event_id: Option<String>,
    delivery_id: Option<String>,
    headers: Vec<StoredHeader>,
    body_len: usize,
    /// The payload's length when it is not the body (a form-encoded one).
    payload_len: Option<usize>,
}

/// `MAGIC`, the meta line, the body, then the payload when it differs.
fn encode(delivery: &AcceptedDelivery, headers: &HeaderMap) -> Vec<u8> {
    let kept = headers
        .iter()
        .filter(|(name, _)| !NOT_KEPT.contains(name))
        .map(|(name, value)| match value.to_str() {
            Ok(text) => StoredHeader {
                n: name.as_str().to_string(),
                v: Some(text.to_string()),
                x: None,
            },
            Err(_) => StoredHeader {
                n: name.as_str().to_string(),
                v: None,
                x: Some(hex::encode(value.as_bytes())),
            },
        })
        .collect();
    let distinct = delivery.payload != delivery.body;
    let meta = Meta {
        event_id: delivery.derived.event_id.clone(),
        delivery_id: delivery.derived.delivery_id.clone(),
        headers: kept,
        body_len: delivery.body.len(),
        payload_len: distinct.then_some(delivery.payload.len()),
    };
    let mut out = MAGIC.to_vec();
    out.extend(serde_json::to_vec(&meta).unwrap_or_default());
    out.push(b'\n');
    out.extend_from_slice(&delivery.body);
    if distinct {
        out.extend_from_slice(&delivery.payload);
    }
    out
}

/// A delivery as the inbox keeps it (what [`Webhook::inbox`] stores as an
/// item's payload), read back: for an operator's view of an item, and for
/// the worker that runs it.
///
/// ```
/// use dedupe_webhook::StoredDelivery;
///
/// assert!(StoredDelivery::parse(b"not a stored delivery").is_err());
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StoredDelivery {
    /// The provider's event id, when the key rule found one.
    pub event_id: Option<String>,
    /// The id of this delivery attempt, when the provider sends one.
    pub delivery_id: Option<String>,
    /// The headers it carried, but credentials and connection headers.
    pub headers: HeaderMap,
    /// The raw body, as received.
    pub body: Bytes,
    /// The event's payload (the body, or the form field carrying it).
    pub payload: Bytes,
}

impl StoredDelivery {
    /// Reads a stored delivery; the error says what is wrong with it.
    pub fn parse(stored: &[u8]) -> Result<Self, String> {
        let rest = stored
            .strip_prefix(MAGIC)
            .ok_or_else(|| "no dwi1 header".to_string())?;
        let line_end = rest
            .iter()
            .position(|b| *b == b'\n')
            .ok_or_else(|| "no meta line".to_string())?;
        let meta: Meta = serde_json::from_slice(&rest[..line_end]).map_err(|e| e.to_string())?;
        let bytes = &rest[line_end + 1..];
        let expected = meta.body_len + meta.payload_len.unwrap_or(0);
        if bytes.len() != expected {
            return Err("its length does not match".to_string());
        }
        let body = Bytes::copy_from_slice(&bytes[..meta.body_len]);
        let payload = match meta.payload_len {
            Some(_) => Bytes::copy_from_slice(&bytes[meta.body_len..]),
            None => body.clone(),
        };
        let mut headers = HeaderMap::new();
        for h in meta.headers {
            let name = HeaderName::try_from(h.n.as_str()).map_err(|e| e.to_string())?;
            let value = match (h.v, h.x) {
                (Some(text), None) => HeaderValue::try_from(text).map_err(|e| e.to_string())?,
                (None, Some(hexed)) => {
                    let raw = hex::decode(hexed).map_err(|e| e.to_string())?;
                    HeaderValue::from_bytes(&raw).map_err(|e| e.to_string())?
                }
                _ => return Err("a header with no value".to_string()),
            };
            headers.append(name, value);
        }
        Ok(Self {
            event_id: meta.event_id,
            delivery_id: meta.delivery_id,
            headers,
            body,
            payload,
        })
    }
}

/// A stored delivery read back: the event (under `taken`'s lease) and the
/// headers kept.
fn decode(taken: &Taken, retention: Duration) -> Result<(WebhookEvent, HeaderMap), Error> {
    let key = &taken.lease.key;
    let stored = StoredDelivery::parse(&taken.payload)
        .map_err(|why| Error::corrupt(key, format!("not a stored delivery: {why}")))?;
    Ok((
        WebhookEvent::from_parts(
            taken.lease.clone(),
            stored.event_id,
            stored.delivery_id,
            stored.body,
            stored.payload,
            retention,
        ),
        stored.headers,
    ))
}

impl WebhookEvent {
    /// The event of an item taken from the inbox a receiver in inbox mode
    /// ([`Webhook::inbox`]) accepted it into: the delivery as it arrived
    /// (verified, its key derived), under the item's lease, with the headers
    /// it carried (but credentials and connection headers). `retention` is
    /// how long its outcome will be kept.
    ///
    /// A payload the receiver did not write is `CorruptRecord`: fail the item
    /// (it will never decode).
    pub fn from_item(taken: &Taken, retention: Duration) -> Result<(Self, HeaderMap), Error> {
        decode(taken, retention)
    }
}

impl Webhook {
    /// A receiver in inbox mode on `inbox`: each verified delivery is
    /// accepted into the inbox (one atomic write) and answered at once, and
    /// the route's handler is not called in the request; run it on an
    /// [`InboxWorker`](dedupe_core::InboxWorker) over the rule's namespace,
    /// with [`WebhookEvent::from_item`].
    ///
    /// | the delivery | answer |
    /// |---|---|
    /// | a new event | 202 `{"accepted": true, "key": ...}` |
    /// | an event the inbox holds (pending, running, failed, dead) or has done | 200 `{"accepted": false, "key": ..., "state": ...}`: nothing stored, nothing run |
    /// | an event a synchronous claim holds (another receiver of the same namespace not in inbox mode) | 409 with `Retry-After` |
    /// | over the inbox's limit ([`MAX_PAYLOAD_BYTES`](dedupe_core::MAX_PAYLOAD_BYTES), body and headers together) | 413 |
    /// | the store unreachable | 503 with `Retry-After`, nothing stored |
    ///
    /// A resend carrying another body under the same key is answered as the
    /// event it repeats (the first delivery's bytes are what the worker
    /// runs).
    ///
    /// The handler's lifecycle (lease, heartbeat, time bound, retention) is
    /// the worker's deduper's; this receiver only accepts.
    pub fn inbox(inbox: Arc<dyn Inbox>, rule: KeyRule) -> Self {
        let store: Arc<dyn DedupeStore> = inbox.clone();
        let mut hook = Self::new(dedupe_core::Deduper::new(store), rule);
        // Traced as the receiver's claims are (`Self::new` wraps those).
        hook.inbox = Some(Arc::new(dedupe_core::TracedStore::new(inbox)));
        hook
    }

    /// In inbox mode, the attempts each accepted event gets before it is dead
    /// (at least 1), stored with the item (CONTRACT.md I11): every worker
    /// that takes it applies this limit, whatever its own `max_attempts`.
    /// Unset, the taking worker's limit applies.
    pub fn with_item_attempts(mut self, attempts: u32) -> Self {
        self.accept_options = self.accept_options.max_attempts(attempts.max(1));
        self
    }

    /// In inbox mode, the JSON pointer (RFC 6901) of each event's ordering
    /// key (CONTRACT.md I15): events of one key (Stripe's
    /// `/data/object/id`, one object; `/data/object/customer`, one
    /// customer; GitHub's `/repository/full_name`) are processed one at a
    /// time, in the order they were accepted, and what one that ends dead
    /// does to the later ones is `when_dead`. A string or a number at the
    /// pointer is the key (one over 256 bytes is used as its SHA-256); an
    /// event with nothing there, or a body that is not JSON, is accepted
    /// without one. Needs a store that keeps ordering keys (SQLite,
    /// Postgres, MySQL, Redis, memory): on DynamoDB such an accept is refused (500).
    pub fn order_by(
        mut self,
        pointer: impl Into<String>,
        when_dead: dedupe_core::WhenDead,
    ) -> Self {
        self.order_by = Some(pointer.into());
        self.accept_options = self.accept_options.when_dead(when_dead);
        self
    }

    /// Whether this receiver is in inbox mode.
    pub fn is_inbox(&self) -> bool {
        self.inbox.is_some()
    }

    /// Accepts a checked delivery into the inbox and answers for it.
    pub(crate) async fn enqueue(
        inbox: &dyn Inbox,
        delivery: AcceptedDelivery,
        headers: &HeaderMap,
        options: &dedupe_core::AcceptOptions,
        order_by: Option<&str>,
    ) -> Response {
        let key = delivery.derived.key.clone();
        let stored = encode(&delivery, headers);
        let ordered;
        let options = match order_by.and_then(|pointer| ordering_key(&delivery.payload, pointer)) {
            Some(order) => {
                ordered = options.clone().ordering_key(order);
                &ordered
            }
            None => options,
        };
        match inbox.accept_with(&key, &stored, options).await {
            Ok(Accepted::New) => answer(StatusCode::ACCEPTED, Answer::Queued, &key, None),
            Ok(Accepted::Item(item)) => answer(
                StatusCode::OK,
                Answer::Known,
                &key,
                Some(item.status.as_str()),
            ),
            Ok(Accepted::Done { .. }) => answer(StatusCode::OK, Answer::Known, &key, Some("done")),
            Ok(Accepted::InFlight { .. }) => Answer::InFlight.problem(
                &format!("{key} is being processed by a synchronous receiver"),
                Some(Duration::from_secs(1)),
            ),
            Ok(_) => store_error(&Error::fatal("an unknown accept answer", None)),
            Err(Error::PayloadTooLarge { size, limit }) => Answer::TooLarge.problem(
                &format!(
                    "the delivery ({size} bytes with its headers) is over the inbox's {limit}"
                ),
                None,
            ),
            Err(e) => store_error(&e),
        }
    }
}

fn answer(status: StatusCode, kind: Answer, key: &Key, state: Option<&str>) -> Response {
    let mut body =
        serde_json::json!({ "accepted": kind == Answer::Queued, "key": key.to_string() });
    if let Some(state) = state {
        body["state"] = serde_json::json!(state);
    }
    let mut response = (status, axum::Json(body)).into_response();
    if let Ok(k) = HeaderValue::from_str(&key.to_string()) {
        response.headers_mut().insert("idempotency-key", k);
    }
    response.extensions_mut().insert(kind);
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DerivedKey;
    use dedupe_core::Lease;

    fn taken(payload: Vec<u8>) -> Taken {
        let key = Key::new("stripe", "evt_1").expect("key");
        Taken::new(
            Lease {
                key,
                token: dedupe_core::backend::new_token(),
                deadline: std::time::SystemTime::now(),
                attempt: 1,
                claim_id: None,
            },
            payload,
            None,
            std::time::SystemTime::now(),
        )
    }

    #[test]
    fn deliveries_round_trip_and_keep_no_credentials() {
        let mut headers = HeaderMap::new();
        headers.insert("stripe-signature", HeaderValue::from_static("t=1,v1=ab"));
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret"),
        );
        headers.insert(header::COOKIE, HeaderValue::from_static("a=b"));
        headers.insert("x-raw", HeaderValue::from_bytes(b"caf\xe9").expect("bytes"));
        headers.append("x-twice", HeaderValue::from_static("1"));
        headers.append("x-twice", HeaderValue::from_static("2"));
        let delivery = AcceptedDelivery::for_tests(
            Bytes::from_static(b"payload=%7B%7D"),
            Bytes::from_static(b"{}"),
            DerivedKey {
                key: Key::new("stripe", "evt_1").expect("key"),
                event_id: Some("evt_1".into()),
                delivery_id: Some("d-9".into()),
                signed: true,
            },
        );
        let stored = encode(&delivery, &headers);
        let (event, kept) =
            decode(&taken(stored.clone()), Duration::from_secs(60)).expect("decodes");
        assert_eq!(event.body, Bytes::from_static(b"payload=%7B%7D"));
        assert_eq!(event.payload, Bytes::from_static(b"{}"));
        assert_eq!(event.event_id.as_deref(), Some("evt_1"));
        assert_eq!(event.delivery_id.as_deref(), Some("d-9"));
        assert_eq!(kept.get("stripe-signature").expect("kept"), "t=1,v1=ab");
        assert_eq!(kept.get("x-raw").expect("kept").as_bytes(), b"caf\xe9");
        assert_eq!(kept.get_all("x-twice").iter().count(), 2);
        assert!(kept.get(header::AUTHORIZATION).is_none() && kept.get(header::COOKIE).is_none());
        for bad in [
            b"".to_vec(),
            b"dwi1\n{}".to_vec(),
            stored[..stored.len() - 1].to_vec(),
            [stored.clone(), b"x".to_vec()].concat(),
            b"dwi1\n{\"event_id\":null,\"delivery_id\":null,\"headers\":[{\"n\":\"a b\",\"v\":\"1\"}],\"body_len\":0,\"payload_len\":null}\n".to_vec(),
        ] {
            assert!(
                matches!(decode(&taken(bad.clone()), Duration::from_secs(1)), Err(Error::CorruptRecord { .. })),
                "decoded {:?}",
                String::from_utf8_lossy(&bad)
            );
        }
    }

    proptest::proptest! {
        /// Any bytes decode to a delivery or to `CorruptRecord`, never a panic.
        #[test]
        fn any_payload_decodes_or_is_corrupt(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let payload = [MAGIC.to_vec(), tail].concat();
            match decode(&taken(payload), Duration::from_secs(1)) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}

/// The ordering key at `pointer` in a JSON payload: a string, or a number's
/// text; one over [`MAX_ORDERING_KEY_BYTES`](dedupe_core::MAX_ORDERING_KEY_BYTES)
/// as `sha256:<hex>` of it. `None` for a payload that is not JSON or has no
/// string or number there.
fn ordering_key(payload: &[u8], pointer: &str) -> Option<String> {
    use sha2::{Digest, Sha256};
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let key = match value.pointer(pointer)? {
        serde_json::Value::String(s) if !s.is_empty() => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => return None,
    };
    if key.len() > dedupe_core::MAX_ORDERING_KEY_BYTES {
        return Some(format!(
            "sha256:{}",
            hex::encode(Sha256::digest(key.as_bytes()))
        ));
    }
    Some(key)
}

#[cfg(test)]
mod ordering_tests {
    use super::ordering_key;

    #[test]
    fn the_ordering_key_is_read_at_the_pointer() {
        let event = br#"{"id":"evt_2","data":{"object":{"id":"cus_9","n":7,"o":{}}}}"#;
        assert_eq!(
            ordering_key(event, "/data/object/id").as_deref(),
            Some("cus_9")
        );
        assert_eq!(ordering_key(event, "/data/object/n").as_deref(), Some("7"));
        assert_eq!(ordering_key(event, "/data/object/o"), None);
        assert_eq!(ordering_key(event, "/data/object/missing"), None);
        assert_eq!(ordering_key(b"not json", "/id"), None);
        let long = format!(r#"{{"k":"{}"}}"#, "x".repeat(300));
        let hashed = ordering_key(long.as_bytes(), "/k").expect("a key");
        assert!(
            hashed.starts_with("sha256:") && hashed.len() == 71,
            "{hashed}"
        );
    }
}
