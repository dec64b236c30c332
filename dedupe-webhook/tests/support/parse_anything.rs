// Shared by the stable property test (`tests/hostile.rs`) and the cargo-fuzz
// target (`fuzz/fuzz_targets/webhook_parse.rs`): one function that feeds
// arbitrary bytes to every parser a webhook request meets before anything is
// claimed, and says what went wrong, if anything did.

use std::time::SystemTime;

use dedupe_webhook::{DeriveError, KeyRule, KeySource, Scheme, SignatureError, Verifier};
use http::{HeaderMap, HeaderName, HeaderValue};

/// The headers the parsers read, in the order the input fills them.
pub const HEADERS: &[&str] = &[
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "stripe-signature",
    "x-hub-signature-256",
    "x-shopify-hmac-sha256",
    "x-github-delivery",
    "x-shopify-webhook-id",
    "x-delivery-id",
];

/// Splits `data` at each `0xFF` byte: the first pieces are header values (in
/// [`HEADERS`] order, skipped where `HeaderValue` refuses them), the last the
/// body. Then verifies with every scheme and derives a key with every rule
/// (one reading the body at a pointer the input also picks). Answers an error
/// when a refusal is not one of the typed ones, when random input verifies
/// against a secret, or when a derived key is empty, has control characters or
/// lands in another namespace.
pub fn parse_anything(data: &[u8]) -> Result<(), String> {
    let mut pieces: Vec<&[u8]> = data.split(|b| *b == 0xFF).collect();
    let body = pieces.pop().unwrap_or_default();
    let mut headers = HeaderMap::new();
    for (name, value) in HEADERS.iter().zip(&pieces) {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(HeaderName::from_static(name), value);
        }
    }
    for scheme in [
        Scheme::StandardWebhooks,
        Scheme::Stripe,
        Scheme::GitHub,
        Scheme::Shopify,
    ] {
        let verifier = Verifier::new(scheme, ["whsec_c2VjcmV0LWtleQ=="])
            .map_err(|e| format!("the test secret was refused: {e}"))?;
        match verifier.verify(&headers, body, SystemTime::now()) {
            Ok(_) => return Err(format!("{scheme:?}: random input verified")),
            Err(
                SignatureError::Missing(_)
                | SignatureError::Malformed { .. }
                | SignatureError::Stale { .. }
                | SignatureError::NoMatch,
            ) => {}
            Err(other) => return Err(format!("{scheme:?}: untyped refusal {other:?}")),
        }
    }
    let pointer = pieces
        .get(HEADERS.len())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_else(|| "/id".to_string());
    for rule in [
        KeyRule::stripe("stripe"),
        KeyRule::github("github"),
        KeyRule::shopify("shopify"),
        KeyRule::standard_webhooks("standard"),
        KeyRule::generic("hooks"),
        KeyRule::new(
            "custom",
            vec![KeySource::JsonPointer(pointer), KeySource::BodyHash],
        ),
    ] {
        match rule.derive(&headers, body) {
            Ok(derived) => {
                let key = &derived.key;
                if key.namespace() != rule.namespace()
                    || key.id().is_empty()
                    || key.id().chars().any(char::is_control)
                {
                    return Err(format!("{}: derived a bad key {key:?}", rule.namespace()));
                }
            }
            Err(
                DeriveError::NotJson(_)
                | DeriveError::NoId(_)
                | DeriveError::BadId(_)
                | DeriveError::InvalidKey(_),
            ) => {}
            Err(other) => return Err(format!("{}: untyped refusal {other:?}", rule.namespace())),
        }
    }
    Ok(())
}
