//! The idempotency key of a delivery: the provider's stable event id, never a
//! per-attempt value, or the SHA-256 of the raw body where there is no id.

use dedupe_core::{Fingerprint, Key};
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::signature::Verified;

/// Headers that name one HTTP attempt, not the event: a retry carries a new
/// value. They are recorded beside the key (logs, the ledger) and never used as
/// it.
pub const PER_ATTEMPT_HEADERS: &[&str] = &["x-delivery-id", "x-request-id", "x-attempt-id"];

/// Where a delivery's event id comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A header whose value is stable across retries (`X-Shopify-Webhook-Id`).
    Header(String),
    /// Several headers, all required, their values joined with `/` (GitHub's
    /// `X-GitHub-Hook-ID` and `X-GitHub-Delivery`).
    Headers(Vec<String>),
    /// The Standard Webhooks message id: on a signed route, exactly the id
    /// the verified signature covered (from `webhook-id` or `svix-id`,
    /// whichever was signed), never an unsigned header beside it; on an
    /// unsigned route, the `webhook-id` or `svix-id` header (refused when both
    /// are sent and differ).
    SignedId,
    /// A JSON pointer into the body (`/id` for Stripe-like bodies).
    JsonPointer(String),
    /// The SHA-256 of the raw body, as `sha256:<hex>`.
    BodyHash,
}

/// Why no key could be derived from a delivery. Answered as 400.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeriveError {
    /// The body had to be JSON and is not.
    #[error("body is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// None of the sources gave an id, and hashing the body is not allowed.
    #[error("no event id: looked for {0}")]
    NoId(String),
    /// An id was found but cannot be one (empty, control characters, not a
    /// string or an integer, a header sent twice or not visible ASCII).
    #[error("event id is not a valid key: {0}")]
    BadId(String),
    /// An id was found but the key it makes is refused (too long, a NUL
    /// byte, a namespace outside the allowed characters).
    #[error("event id is not a valid key: {0}")]
    InvalidKey(#[from] dedupe_core::KeyError),
}

/// What a delivery's payload fingerprint covers. A claim whose fingerprint
/// differs from the stored one is a *mismatch* (see [`OnMismatch`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PayloadFingerprint {
    /// The SHA-256 of the whole raw body (the default).
    #[default]
    Body,
    /// The values at these JSON pointers (`/type`, `/data`), encoded
    /// canonically (object keys sorted, so key order does not count): fields
    /// a provider re-renders between attempts (Stripe's `pending_webhooks`, an
    /// attempt counter, a render time) are left out. A pointer with nothing
    /// there counts as absent. Numbers compare as serde_json reads them (an
    /// integer past 64 bits as the nearest float). A payload that is not JSON
    /// is fingerprinted whole.
    JsonPointers(Vec<String>),
    /// No fingerprint: the key alone decides; a mismatch cannot happen.
    Nothing,
}

/// What a delivery whose key is known with another payload fingerprint gets
/// (the engine's setting): 422 ([`OnMismatch::Refuse`], the default on routes
/// without a signature check, where a mismatch is someone reusing an id), or
/// the duplicate's answer ([`OnMismatch::Replay`], the default where the
/// signature covered the key: a Standard Webhooks or Svix message id, a
/// Stripe body `id`; the sender is authenticated, and a provider that
/// re-rendered the body of a resend must not get a 4xx, a retry storm).
/// Where the key comes from unsigned headers (GitHub, Shopify), whoever holds
/// one old signed body could send it under a future event's id and have the
/// real event answered as a duplicate, so there the default stays `Refuse`;
/// those providers resend the same body.
pub use dedupe_http::OnMismatch;

/// How a delivery's key is derived: the first source that gives an id wins.
///
/// ```
/// use dedupe_webhook::KeyRule;
///
/// let rule = KeyRule::stripe("billing");
/// let key = rule.derive(&http::HeaderMap::new(), br#"{"id":"evt_1","type":"x"}"#)?;
/// assert_eq!(key.key.to_string(), "billing:evt_1");
/// // No id: the body's hash, so an identical body is still one event.
/// let key = KeyRule::body_id("hooks").derive(&http::HeaderMap::new(), br#"{"n":1}"#)?;
/// assert!(key.key.id().starts_with("sha256:"));
/// # Ok::<(), dedupe_webhook::DeriveError>(())
/// ```
///
/// Every preset takes the consumer's namespace: **one namespace per
/// consumer**. Two routes that receive the same provider's events for two
/// purposes (`/hooks/stripe/billing`, `/hooks/stripe/fulfilment`) on one store
/// take two namespaces, or the second never runs its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRule {
    namespace: String,
    sources: Vec<KeySource>,
    fingerprint: PayloadFingerprint,
    on_mismatch: Option<OnMismatch>,
    body_limit: Option<usize>,
    form_payload: bool,
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
    /// Whether the verified signature covered what the key came from (a
    /// signed message id, or the body); `false` for header keys (GitHub's and
    /// Shopify's headers are not signed) and on unsigned routes.
    pub signed: bool,
}

impl KeyRule {
    /// A rule with `namespace` and the given sources, tried in order.
    pub fn new(namespace: impl Into<String>, sources: Vec<KeySource>) -> Self {
        Self {
            namespace: namespace.into(),
            sources,
            fingerprint: PayloadFingerprint::Body,
            on_mismatch: None,
            body_limit: None,
            form_payload: false,
        }
    }

    /// Standard Webhooks senders, Svix among them: the message id the
    /// signature covered (`webhook-id`, or Svix's `svix-id`), the same on every
    /// retry ([`KeySource::SignedId`]).
    pub fn standard_webhooks(namespace: impl Into<String>) -> Self {
        Self::new(namespace, vec![KeySource::SignedId])
    }

    /// GitHub: `X-GitHub-Hook-ID` and `X-GitHub-Delivery`, joined
    /// (`<hook id>/<delivery guid>`). The delivery GUID alone is not enough:
    /// GitHub sends one GUID per event to every hook and App that receives it,
    /// with different payloads, so two hooks on one store would share keys. A
    /// redelivery keeps both headers. A delivery without them is refused
    /// rather than keyed by its body. Bodies up to 25 MB (GitHub's cap) are
    /// accepted by default: GitHub never retries, so a 413 loses the event.
    ///
    /// GitHub signs the body only, not these headers: whoever captured a
    /// signed delivery can send it again under another delivery id, and it is
    /// then a new key. Keep the secret and the transport (TLS) tight.
    pub fn github(namespace: impl Into<String>) -> Self {
        let mut rule = Self::new(
            namespace,
            vec![KeySource::Headers(vec![
                "x-github-hook-id".into(),
                "x-github-delivery".into(),
            ])],
        );
        rule.body_limit = Some(GITHUB_BODY_LIMIT);
        rule.form_payload = true;
        rule
    }

    /// Shopify: `X-Shopify-Webhook-Id`, the same on every retry of one
    /// delivery; a delivery without it is refused. The header is not signed
    /// (see [`KeyRule::github`]).
    ///
    /// Shopify may also deliver one event more than once under different
    /// webhook ids (it documents duplicates); [`KeyRule::shopify_event`] keys
    /// on the event instead.
    pub fn shopify(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![KeySource::Header("x-shopify-webhook-id".into())],
        )
    }

    /// Shopify, keyed on the event: `X-Shopify-Topic` and
    /// `X-Shopify-Event-Id`, joined. This also folds copies of one event that
    /// Shopify sent under different webhook ids, which [`KeyRule::shopify`]
    /// processes each time. The trade-off: two subscriptions to the same topic
    /// that point at this route are processed once between them, and
    /// deliveries without `X-Shopify-Event-Id` (older API versions) are
    /// refused; give such a route [`KeyRule::shopify`].
    pub fn shopify_event(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![KeySource::Headers(vec![
                "x-shopify-topic".into(),
                "x-shopify-event-id".into(),
            ])],
        )
    }

    /// The generic rule of a Standard Webhooks sender or any JSON body: the
    /// message id the signature covered (or the `webhook-id` / `svix-id`
    /// header on an unsigned route), else the body's top-level `id`, else the
    /// body hash.
    pub fn generic(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![
                KeySource::SignedId,
                KeySource::JsonPointer("/id".into()),
                KeySource::BodyHash,
            ],
        )
    }

    /// Stripe: the body's top-level `id` (`evt_...`).
    pub fn stripe(namespace: impl Into<String>) -> Self {
        Self::new(namespace, vec![KeySource::JsonPointer("/id".into())])
    }

    /// Any provider whose body has a top-level `id`; the body hash otherwise.
    pub fn body_id(namespace: impl Into<String>) -> Self {
        Self::new(
            namespace,
            vec![KeySource::JsonPointer("/id".into()), KeySource::BodyHash],
        )
    }

    /// Sets what the payload fingerprint covers (default: the whole body).
    ///
    /// ```
    /// use dedupe_webhook::{KeyRule, PayloadFingerprint};
    /// // Stripe re-renders live fields such as `pending_webhooks` between
    /// // attempts; the event's type and data do not change.
    /// let rule = KeyRule::stripe("billing")
    ///     .fingerprint(PayloadFingerprint::JsonPointers(vec!["/type".into(), "/data".into()]));
    /// let a = rule.fingerprint_of(br#"{"id":"evt_1","type":"x","data":{"a":1},"pending_webhooks":2}"#);
    /// let b = rule.fingerprint_of(br#"{"pending_webhooks":1,"data":{"a":1},"type":"x","id":"evt_1"}"#);
    /// assert_eq!(a, b);
    /// ```
    pub fn fingerprint(mut self, fingerprint: PayloadFingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Sets what a mismatch gets; by default [`OnMismatch::Replay`] on a route
    /// with a signature check and [`OnMismatch::Refuse`] without.
    pub fn on_mismatch(mut self, on_mismatch: OnMismatch) -> Self {
        self.on_mismatch = Some(on_mismatch);
        self
    }

    /// What a mismatch gets for a key the signature covered (`signed`, see
    /// [`DerivedKey::signed`]) or did not.
    pub fn mismatch_policy(&self, signed: bool) -> OnMismatch {
        self.on_mismatch.unwrap_or(if signed {
            OnMismatch::Replay
        } else {
            OnMismatch::Refuse
        })
    }

    /// Accepts form-encoded deliveries (`application/x-www-form-urlencoded`,
    /// the body exactly one field `payload` holding the JSON), as GitHub sends
    /// them when a hook is set to that content type; on by default for
    /// [`KeyRule::github`] only. Off, the content type is ignored and the body
    /// read as it is: a body whose signature covers text an attacker wrote
    /// (an issue's title) can then never be reread as a payload of their
    /// choosing by relabelling its unsigned content type.
    pub fn form_payload(mut self, accept: bool) -> Self {
        self.form_payload = accept;
        self
    }

    /// Whether form-encoded deliveries are accepted.
    pub fn accepts_form_payload(&self) -> bool {
        self.form_payload
    }

    /// The body limit this provider needs, when it is not the receiver's
    /// default (GitHub: 25 MB).
    pub fn provider_body_limit(&self) -> Option<usize> {
        self.body_limit
    }

    /// The payload fingerprint of `payload` under this rule (`None` with
    /// [`PayloadFingerprint::Nothing`]). A payload that is not JSON has its
    /// pointers all absent.
    pub fn fingerprint_of(&self, payload: &[u8]) -> Option<Fingerprint> {
        match &self.fingerprint {
            PayloadFingerprint::Body => Some(Fingerprint::sha256(payload)),
            PayloadFingerprint::Nothing => None,
            PayloadFingerprint::JsonPointers(pointers) => {
                // A payload serde_json cannot read (not JSON, a number out
                // of range, nesting past its limit) has no pointers to take:
                // the whole of it is the fingerprint, so two such payloads
                // never look alike.
                let Ok(json) = serde_json::from_slice::<serde_json::Value>(payload) else {
                    return Some(Fingerprint::sha256(payload));
                };
                let json = Some(json);
                let mut canonical = Vec::new();
                for pointer in pointers {
                    canonical.extend_from_slice(pointer.as_bytes());
                    canonical.push(0);
                    match json.as_ref().and_then(|j| j.pointer(pointer)) {
                        Some(value) => {
                            canonical.push(1);
                            write_canonical(value, &mut canonical);
                        }
                        None => canonical.push(0),
                    }
                    canonical.push(0);
                }
                Some(Fingerprint::sha256(&canonical))
            }
        }
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

    /// Derives the key of a delivery on an unsigned route. Reads the body as
    /// JSON only when a JSON pointer source is tried.
    pub fn derive(&self, headers: &HeaderMap, body: &[u8]) -> Result<DerivedKey, DeriveError> {
        self.derive_verified(headers, body, None)
    }

    /// Derives the key of a delivery whose signature was checked: `verified`
    /// is what the check found ([`KeySource::SignedId`] takes its id and reads
    /// no header). `None` for an unsigned route.
    pub fn derive_verified(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        verified: Option<&Verified>,
    ) -> Result<DerivedKey, DeriveError> {
        let mut json: Option<serde_json::Value> = None;
        for source in &self.sources {
            let id = match source {
                KeySource::SignedId => match verified {
                    Some(verified) => verified.id.clone(),
                    None => unsigned_message_id(headers)?,
                },
                KeySource::Headers(names) => {
                    let mut parts = Vec::with_capacity(names.len());
                    for name in names {
                        match header_text(headers, name)? {
                            Some(v) => parts.push(v),
                            None => break,
                        }
                    }
                    if parts.len() == names.len() {
                        Some(join_parts(names, &parts)?)
                    } else {
                        None
                    }
                }
                KeySource::Header(name) => header_text(headers, name)?,
                KeySource::JsonPointer(pointer) => {
                    if json.is_none() {
                        json = Some(serde_json::from_slice(body).map_err(DeriveError::NotJson)?);
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
                            return Err(DeriveError::BadId(format!(
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
                    )?;
                    return Ok(DerivedKey {
                        key,
                        event_id: None,
                        delivery_id: delivery_id(headers),
                        signed: verified.is_some(),
                    });
                }
            };
            if let Some(id) = id {
                if id.is_empty() {
                    return Err(DeriveError::BadId("empty event id".into()));
                }
                if id.chars().any(char::is_control) {
                    return Err(DeriveError::BadId(
                        "event id holds control characters".into(),
                    ));
                }
                let key = Key::new(self.namespace.as_str(), escape_id(&id))?;
                let signed = verified.is_some()
                    && matches!(source, KeySource::SignedId | KeySource::JsonPointer(_));
                return Ok(DerivedKey {
                    key,
                    event_id: Some(id),
                    delivery_id: delivery_id(headers),
                    signed,
                });
            }
        }
        let looked: Vec<String> = self
            .sources
            .iter()
            .map(|s| match s {
                KeySource::Header(h) => format!("header {h}"),
                KeySource::Headers(hs) => format!("headers {}", hs.join(" + ")),
                KeySource::SignedId => "the signed webhook-id / svix-id".into(),
                KeySource::JsonPointer(p) => format!("body {p}"),
                KeySource::BodyHash => "the body hash".into(),
            })
            .collect();
        Err(DeriveError::NoId(looked.join(", ")))
    }
}

/// Largest body GitHub sends (its documented cap: 25 MB).
pub(crate) const GITHUB_BODY_LIMIT: usize = 25 * 1024 * 1024;

/// A provider's id as the key's id. Body-hash keys are `sha256:<hex>`: an id
/// that starts with `sha256:` (or with the escape's own `id:`) gets `id:` in
/// front, so no provider id can ever equal a body-hash key, and two different
/// ids never map to one key.
fn escape_id(id: &str) -> std::borrow::Cow<'_, str> {
    if id.starts_with("sha256:") || id.starts_with("id:") {
        std::borrow::Cow::Owned(format!("id:{id}"))
    } else {
        std::borrow::Cow::Borrowed(id)
    }
}

/// A header's value, trimmed; refused when not visible ASCII or sent twice.
fn header_text(headers: &HeaderMap, name: &str) -> Result<Option<String>, DeriveError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(DeriveError::BadId(format!("{name} sent more than once")));
    }
    let text = value
        .to_str()
        .map_err(|_| DeriveError::BadId(format!("{name} is not visible ASCII")))?;
    // Not trimmed: keys are exact, and `a` and `a ` are two ids.
    Ok(Some(text.to_string()))
}

/// Header values joined into one id with `/`, each value's own `%` and `/`
/// written `%25` and `%2F` first, so two different lists of values never
/// join to the same id (`orders/create` + `e` is not `orders` + `create/e`).
/// An empty value is refused.
fn join_parts(names: &[String], parts: &[String]) -> Result<String, DeriveError> {
    let mut joined = String::new();
    for (i, (name, part)) in names.iter().zip(parts).enumerate() {
        if part.is_empty() {
            return Err(DeriveError::BadId(format!("{name} is empty")));
        }
        if i > 0 {
            joined.push('/');
        }
        joined.push_str(&part.replace('%', "%25").replace('/', "%2F"));
    }
    Ok(joined)
}

/// The Standard Webhooks message id of an unsigned delivery: `webhook-id` or
/// Svix's `svix-id`; both with different values is ambiguous and refused.
fn unsigned_message_id(headers: &HeaderMap) -> Result<Option<String>, DeriveError> {
    match (
        header_text(headers, "webhook-id")?,
        header_text(headers, "svix-id")?,
    ) {
        (Some(a), Some(b)) if a != b => Err(DeriveError::BadId(
            "webhook-id and svix-id name different messages".into(),
        )),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// JSON written with object keys sorted and no white space, whatever the
/// order they arrived in.
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        other => out.extend_from_slice(other.to_string().as_bytes()),
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
        let a = KeyRule::stripe("stripe")
            .derive(&attempt1, body)
            .expect("key");
        let b = KeyRule::stripe("stripe")
            .derive(&attempt2, body)
            .expect("key");
        assert_eq!(a.key, b.key);
        assert_eq!(a.key.to_string(), "stripe:evt_9f3");
        assert_eq!(a.delivery_id.as_deref(), Some("del_a1"));
        assert_eq!(b.delivery_id.as_deref(), Some("del_b2"));

        let gh = h(&[
            ("x-github-delivery", "72d3162e"),
            ("x-github-hook-id", "101"),
            ("x-delivery-id", "x"),
        ]);
        let k = KeyRule::github("github").derive(&gh, b"{}").expect("key");
        assert_eq!(k.key.to_string(), "github:101/72d3162e");
        // One GUID, two hooks: two keys.
        let other_hook = h(&[
            ("x-github-delivery", "72d3162e"),
            ("x-github-hook-id", "202"),
        ]);
        let k2 = KeyRule::github("github")
            .derive(&other_hook, b"{}")
            .expect("key");
        assert_ne!(k.key, k2.key);
        let sw = h(&[("webhook-id", "msg_1")]);
        let k = KeyRule::standard_webhooks("standard")
            .derive(&sw, b"{}")
            .expect("key");
        assert_eq!(k.key.to_string(), "standard:msg_1");
        let svix = h(&[("svix-id", "msg_2")]);
        let k = KeyRule::standard_webhooks("standard")
            .derive(&svix, b"{}")
            .expect("key");
        assert_eq!(k.key.to_string(), "standard:msg_2");
        let both = h(&[("svix-id", "msg_2"), ("webhook-id", "msg_3")]);
        assert!(matches!(
            KeyRule::standard_webhooks("standard").derive(&both, b"{}"),
            Err(DeriveError::BadId(_))
        ));
        // Signed: the verified id, whatever unsigned header sits beside it.
        let verified = Verified {
            id: Some("msg_signed".into()),
        };
        let k = KeyRule::standard_webhooks("standard")
            .derive_verified(&both, b"{}", Some(&verified))
            .expect("key");
        assert_eq!(k.key.to_string(), "standard:msg_signed");
        let sh = h(&[("x-shopify-webhook-id", "b54557e4")]);
        let k = KeyRule::shopify("shopify").derive(&sh, b"{}").expect("key");
        assert_eq!(k.key.to_string(), "shopify:b54557e4");
        let sh = h(&[
            ("x-shopify-topic", "orders/create"),
            ("x-shopify-event-id", "e-1"),
        ]);
        let k = KeyRule::shopify_event("shop")
            .derive(&sh, b"{}")
            .expect("key");
        assert_eq!(k.key.to_string(), "shop:orders%2Fcreate/e-1");
    }

    #[test]
    fn no_provider_id_equals_a_body_hash_key() {
        let body = br#"{"n":1}"#;
        let hashed = KeyRule::body_id("hooks")
            .derive(&HeaderMap::new(), body)
            .expect("key");
        let forged = format!(r#"{{"id":"{}"}}"#, hashed.key.id());
        let from_id = KeyRule::body_id("hooks")
            .derive(&HeaderMap::new(), forged.as_bytes())
            .expect("key");
        assert_ne!(from_id.key, hashed.key);
        assert_eq!(from_id.key.id(), format!("id:{}", hashed.key.id()));
        // The escape is one to one: an id that starts with the escape differs.
        let escaped = format!(r#"{{"id":"id:{}"}}"#, hashed.key.id());
        let other = KeyRule::body_id("hooks")
            .derive(&HeaderMap::new(), escaped.as_bytes())
            .expect("key");
        assert_ne!(other.key, from_id.key);
        assert_eq!(from_id.event_id.as_deref(), Some(hashed.key.id()));
    }

    #[test]
    fn joined_header_ids_are_one_to_one_and_exact() {
        let gh = KeyRule::github("g");
        let a = h(&[("x-github-hook-id", "1/2"), ("x-github-delivery", "3")]);
        let b = h(&[("x-github-hook-id", "1"), ("x-github-delivery", "2/3")]);
        assert_ne!(
            gh.derive(&a, b"{}").expect("a").key,
            gh.derive(&b, b"{}").expect("b").key
        );
        let shop = KeyRule::shopify_event("s");
        let a = h(&[
            ("x-shopify-topic", "orders/create"),
            ("x-shopify-event-id", "e"),
        ]);
        let b = h(&[
            ("x-shopify-topic", "orders"),
            ("x-shopify-event-id", "create/e"),
        ]);
        let (ka, kb) = (
            shop.derive(&a, b"{}").expect("a").key,
            shop.derive(&b, b"{}").expect("b").key,
        );
        assert_ne!(ka, kb);
        assert_eq!(ka.id(), "orders%2Fcreate/e");
        let empty = h(&[("x-github-hook-id", ""), ("x-github-delivery", "x")]);
        assert!(matches!(
            gh.derive(&empty, b"{}"),
            Err(DeriveError::BadId(_))
        ));
        let mut spaced = HeaderMap::new();
        spaced.insert("x-shopify-webhook-id", http::HeaderValue::from_static("a "));
        let plain = h(&[("x-shopify-webhook-id", "a")]);
        let rule = KeyRule::shopify("s");
        assert_ne!(
            rule.derive(&spaced, b"{}").expect("spaced").key,
            rule.derive(&plain, b"{}").expect("plain").key
        );
    }

    #[test]
    fn pointer_fingerprints_ignore_what_they_do_not_cover() {
        let rule = KeyRule::stripe("s").fingerprint(PayloadFingerprint::JsonPointers(vec![
            "/type".into(),
            "/data".into(),
        ]));
        let a = rule.fingerprint_of(br#"{"type":"t","data":{"x":1,"y":[1,2]},"attempt":1}"#);
        let b = rule.fingerprint_of(br#"{"attempt":2,"data":{"y":[1,2],"x":1},"type":"t"}"#);
        let c = rule.fingerprint_of(br#"{"type":"t","data":{"x":2,"y":[1,2]}}"#);
        let absent = rule.fingerprint_of(br#"{"type":"t"}"#);
        let null = rule.fingerprint_of(br#"{"type":"t","data":null}"#);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(absent, null, "absent and null are two payloads");
        // What serde_json cannot read is fingerprinted whole.
        let data = KeyRule::stripe("s")
            .fingerprint(PayloadFingerprint::JsonPointers(vec!["/data".into()]));
        assert_ne!(
            data.fingerprint_of(br#"{"data":1e400}"#),
            data.fingerprint_of(br#"{"data":2e400}"#)
        );
        assert_ne!(
            data.fingerprint_of(br#"{"data":1e400}"#),
            data.fingerprint_of(b"{}")
        );
        assert_ne!(
            data.fingerprint_of(b"garbage1"),
            data.fingerprint_of(b"garbage2")
        );
        assert_eq!(
            KeyRule::stripe("s")
                .fingerprint(PayloadFingerprint::Nothing)
                .fingerprint_of(b"x"),
            None
        );
        assert_ne!(
            KeyRule::stripe("s").fingerprint_of(br#"{"a":1}"#),
            KeyRule::stripe("s").fingerprint_of(br#"{"a": 1}"#),
            "the default covers the raw bytes"
        );
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
        let rule = KeyRule::stripe("stripe");
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"not json"),
            Err(DeriveError::NotJson(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"{}"),
            Err(DeriveError::NoId(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), br#"{"id":""}"#),
            Err(DeriveError::BadId(_))
        ));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), br#"{"id":{"a":1}}"#),
            Err(DeriveError::BadId(_))
        ));
        let long = format!(r#"{{"id":"{}"}}"#, "x".repeat(10_000));
        assert!(matches!(
            rule.derive(&HeaderMap::new(), long.as_bytes()),
            Err(DeriveError::InvalidKey(_))
        ));
        // Integers are ids too; floats and integers past 64 bits are not exact.
        let k = rule
            .derive(&HeaderMap::new(), br#"{"id":12345}"#)
            .expect("key");
        assert_eq!(k.key.id(), "12345");
        for body in [&br#"{"id":1.5}"#[..], br#"{"id":18446744073709551616}"#] {
            assert!(matches!(
                rule.derive(&HeaderMap::new(), body),
                Err(DeriveError::BadId(_))
            ));
        }
        assert!(matches!(
            rule.derive(&HeaderMap::new(), b"{\"id\":\"evt\\n1\"}"),
            Err(DeriveError::BadId(_))
        ));
        assert!(matches!(
            KeyRule::github("github").derive(&HeaderMap::new(), b"{}"),
            Err(DeriveError::NoId(_))
        ));
    }
}
