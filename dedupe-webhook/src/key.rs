//! The idempotency key of a delivery: the provider's stable event id, never a
//! per-attempt value, or the SHA-256 of the raw body where there is no id.

use dedupe_core::Key;
use http::HeaderMap;
use sha2::{Digest, Sha256};

/// Headers that name one HTTP attempt, not the event: a retry carries a new
/// value. They are recorded beside the key (logs, the ledger) and never used as
/// it.
pub const PER_ATTEMPT_HEADERS: &[&str] = &["x-delivery-id", "x-request-id", "x-attempt-id"];

/// Where a delivery's event id comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A header whose value is stable across retries (`webhook-id`,
    /// `X-GitHub-Delivery`, `X-Shopify-Webhook-Id`).
    Header(String),
    /// A JSON pointer into the body (`/id` for Stripe-like bodies).
    JsonPointer(String),
    /// The SHA-256 of the raw body, as `sha256:<hex>`.
    BodyHash,
}

/// Why no key could be derived. Answered as 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The body had to be JSON and is not.
    #[error("body is not JSON: {0}")]
    NotJson(String),
    /// None of the sources gave an id, and hashing the body is not allowed.
    #[error("no event id: looked for {0}")]
    NoId(String),
    /// An id was found but is not a valid key (empty, too long, control
    /// characters, not a string or number).
    #[error("event id is not a valid key: {0}")]
    BadId(String),
}

/// How a delivery's key is derived: the first source that gives an id wins.
///
/// ```
/// use dedupe_webhook::KeyRule;
///
/// let rule = KeyRule::stripe();
/// let key = rule.derive(&http::HeaderMap::new(), br#"{"id":"evt_1","type":"x"}"#)?;
/// assert_eq!(key.key.to_string(), "stripe:evt_1");
/// // No id: the body's hash, so an identical body is still one event.
/// let key = KeyRule::body_id("hooks").derive(&http::HeaderMap::new(), br#"{"n":1}"#)?;
/// assert!(key.key.id().starts_with("sha256:"));
/// # Ok::<(), dedupe_webhook::KeyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRule {
    namespace: String,
    sources: Vec<KeySource>,
}

/// A derived key and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivedKey {
    /// The idempotency key.
    pub key: Key,
    /// The provider's event id, when the key came from one (not a body hash).
    pub event_id: Option<String>,
    /// The per-attempt delivery id, when the request carried one: for logs only.
    pub delivery_id: Option<String>,
}

impl KeyRule {
    /// A rule with `namespace` and the given sources, tried in order.
    pub fn new(namespace: impl Into<String>, sources: Vec<KeySource>) -> Self {
        Self {
            namespace: namespace.into(),
            sources,
        }
    }

    /// Standard Webhooks: the `webhook-id` header (the same on every retry).
    pub fn standard_webhooks() -> Self {
        Self::new("standard", vec![KeySource::Header("webhook-id".into())])
    }

    /// GitHub: `X-GitHub-Delivery` (kept on redelivery); a delivery without it
    /// is refused rather than keyed by its body.
    ///
    /// GitHub signs the body only, not this header: whoever captured a signed
    /// delivery can send it again under another delivery id, and it is then a
    /// new key. The payload fingerprint does not help there; keep the secret
    /// and the transport (TLS) tight.
    pub fn github() -> Self {
        Self::new(
            "github",
            vec![KeySource::Header("x-github-delivery".into())],
        )
    }

    /// Shopify: `X-Shopify-Webhook-Id` (the same on every retry); a delivery
    /// without it is refused. The header is not signed (see [`KeyRule::github`]).
    pub fn shopify() -> Self {
        Self::new(
            "shopify",
            vec![KeySource::Header("x-shopify-webhook-id".into())],
        )
    }

    /// The generic rule of a Standard Webhooks sender or any JSON body: the
    /// `webhook-id` header (signed by Standard Webhooks), else the body's
    /// top-level `id`, else the body hash.
    pub fn generic(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![
                KeySource::Header("webhook-id".into()),
                KeySource::JsonPointer("/id".into()),
                KeySource::BodyHash,
            ],
        )
    }

    /// Stripe: the body's top-level `id` (`evt_...`).
    pub fn stripe() -> Self {
        Self::new("stripe", vec![KeySource::JsonPointer("/id".into())])
    }

    /// Any provider whose body has a top-level `id`; the body hash otherwise.
    pub fn body_id(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![KeySource::JsonPointer("/id".into()), KeySource::BodyHash],
        )
    }

    /// The key namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Whether a source reads the body as JSON.
    pub fn reads_json(&self) -> bool {
        self.sources
            .iter()
            .any(|s| matches!(s, KeySource::JsonPointer(_)))
    }

    /// Derives the key of a delivery. Reads the body as JSON only when a JSON
    /// pointer source is tried.
    pub fn derive(&self, headers: &HeaderMap, body: &[u8]) -> Result<DerivedKey, KeyError> {
        let mut json: Option<serde_json::Value> = None;
        for source in &self.sources {
            let id = match source {
                KeySource::Header(name) => match headers.get(name.as_str()) {
                    None => None,
                    Some(v) => Some(
                        v.to_str()
                            .map_err(|_| KeyError::BadId(format!("{name} is not visible ASCII")))?
                            .trim()
                            .to_string(),
                    ),
                },
                KeySource::JsonPointer(pointer) => {
                    if json.is_none() {
                        json = Some(
                            serde_json::from_slice(body)
                                .map_err(|e| KeyError::NotJson(e.to_string()))?,
                        );
                    }
                    match json.as_ref().and_then(|j| j.pointer(pointer)) {
                        None | Some(serde_json::Value::Null) => None,
                        Some(serde_json::Value::String(s)) => Some(s.clone()),
                        // Integers only: a float (or an integer past 64 bits,
                        // which JSON parsers read as one) is not an exact id.
                        Some(serde_json::Value::Number(n)) if n.is_u64() || n.is_i64() => {
                            Some(n.to_string())
                        }
                        Some(_) => {
                            return Err(KeyError::BadId(format!(
                                "{pointer} is not a string or number"
                            )))
                        }
                    }
                }
                KeySource::BodyHash => {
                    let digest = Sha256::digest(body);
                    let key = Key::new(
                        self.namespace.as_str(),
                        format!("sha256:{}", hex::encode(digest)),
                    )
                    .map_err(|e| KeyError::BadId(e.to_string()))?;
                    return Ok(DerivedKey {
                        key,
                        event_id: None,
                        delivery_id: delivery_id(headers),
                    });
                }
            };
            if let Some(id) = id {
                if id.is_empty() {
                    return Err(KeyError::BadId("empty event id".into()));
                }
                if id.chars().any(char::is_control) {
                    return Err(KeyError::BadId("event id holds control characters".into()));
                }
                let key = Key::new(self.namespace.as_str(), id.as_str())
                    .map_err(|e| KeyError::BadId(e.to_string()))?;
                return Ok(DerivedKey {
                    key,
                    event_id: Some(id),
                    delivery_id: delivery_id(headers),
                });
            }
        }
        let looked: Vec<String> = self
            .sources
            .iter()
            .map(|s| match s {
                KeySource::Header(h) => format!("header {h}"),
                KeySource::JsonPointer(p) => format!("body {p}"),
                KeySource::BodyHash => "the body hash".into(),
            })
            .collect();
        Err(KeyError::NoId(looked.join(", ")))
    }
}

/// The request's per-attempt delivery id (see [`PER_ATTEMPT_HEADERS`]), for logs.
pub fn delivery_id(headers: &HeaderMap) -> Option<String> {
    PER_ATTEMPT_HEADERS.iter().find_map(|name| {
        headers
            .get(*name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(200).collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().expect("value"));
        }
        m
    }

    #[test]
    fn provider_ids_are_the_key_and_delivery_ids_never_are() {
        let body = br#"{"id":"evt_9f3","amount":2500}"#;
        let attempt1 = h(&[("x-delivery-id", "del_a1")]);
        let attempt2 = h(&[("x-delivery-id", "del_b2")]);
        let a = KeyRule::stripe().derive(&attempt1, body).expect("key");
        let b = KeyRule::stripe().derive(&attempt2, body).expect("key");
        assert_eq!(a.key, b.key);
        assert_eq!(a.key.to_string(), "stripe:evt_9f3");
        assert_eq!(a.delivery_id.as_deref(), Some("del_a1"));
        assert_eq!(b.delivery_id.as_deref(), Some("del_b2"));

        let gh = h(&[("x-github-delivery", "72d3162e"), ("x-delivery-id", "x")]);
        let k = KeyRule::github().derive(&gh, b"{}").expect("key");
        assert_eq!(k.key.to_string(), "github:72d3162e");
        let sw = h(&[("webhook-id", "msg_1")]);
        let k = KeyRule::standard_webhooks()
            .derive(&sw, b"{}")
            .expect("key");
        assert_eq!(k.key.to_string(), "standard:msg_1");
        let sh = h(&[("x-shopify-webhook-id", "b54557e4")]);
        let k = KeyRule::shopify().derive(&sh, b"{}").expect("key");
        assert_eq!(k.key.to_string(), "shopify:b54557e4");
    }

    #[test]
    fn no_id_falls_back_to_the_body_hash() {
        let rule = KeyRule::body_id("hooks");
        let a = rule.derive(&HeaderMap::new(), br#"{"n":1}"#).expect("key");
        let b = rule.derive(&HeaderMap::new(), br#"{"n":1}"#).expect("key");
        let c = rule.derive(&HeaderMap::new(), br#"{"n":2}"#).expect("key");
        assert_eq!(a.key, b.key);
        assert_ne!(a.key, c.key);
        assert_eq!(a.event_id, None);
        assert_eq!(
            a.key.id(),
            format!("sha256:{}", hex::encode(Sha256::digest(br#"{"n":1}"#)))
        );
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let rule = KeyRule::stripe();
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"not json"),
            Err(KeyError::NotJson(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"{}"),
            Err(KeyError::NoId(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), br#"{"id":""}"#),
            Err(KeyError::BadId(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), br#"{"id":{"a":1}}"#),
            Err(KeyError::BadId(_))
        ));
        let long = format!(r#"{{"id":"{}"}}"#, "x".repeat(10_000));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), long.as_bytes()),
            Err(KeyError::BadId(_))
        ));
        // Integers are ids too; floats and integers past 64 bits are not exact.
        let k = rule
            .derive(&HeaderMap::new(), br#"{"id":12345}"#)
            .expect("key");
        assert_eq!(k.key.id(), "12345");
        for body in [&br#"{"id":1.5}"#[..], br#"{"id":18446744073709551616}"#] {
            assert!(matches!(
                rule.derive(&HeaderMap::new(), body),
                Err(KeyError::BadId(_))
            ));
        }
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"{\"id\":\"evt\\n1\"}"),
            Err(KeyError::BadId(_))
        ));
        assert!(matches!(
            KeyRule::github().derive(&HeaderMap::new(), b"{}"),
            Err(KeyError::NoId(_))
        ));
    }
}
