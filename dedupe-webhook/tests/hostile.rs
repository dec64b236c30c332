//! Hostile input to the webhook parsing: arbitrary headers and bodies never
//! panic, every rejection is a typed error, and a signature made by the scheme
//! verifies for any body and secret while any change to the body breaks it.

use std::time::{SystemTime, UNIX_EPOCH};

use dedupe_webhook::{DeriveError, KeyRule, KeySource, Scheme, SignatureError, Verifier};
use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;

#[path = "support/parse_anything.rs"]
mod parse_anything;

use parse_anything::HEADERS;

fn schemes() -> impl Strategy<Value = Scheme> {
    prop_oneof![
        Just(Scheme::StandardWebhooks),
        Just(Scheme::Stripe),
        Just(Scheme::GitHub),
        Just(Scheme::Shopify),
    ]
}

/// Header maps with the headers the parsers read, holding arbitrary bytes
/// (whatever `HeaderValue` accepts), sometimes repeated.
fn header_maps() -> impl Strategy<Value = HeaderMap> {
    proptest::collection::vec(
        (
            0..HEADERS.len(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..80),
                "[ -~]{0,80}".prop_map(String::into_bytes),
                "(v1,[A-Za-z0-9+/=]{0,60} ?){0,3}".prop_map(String::into_bytes),
                "t=[0-9]{0,14},v1=[0-9a-f]{0,70}".prop_map(String::into_bytes),
                "sha256=[0-9a-fA-F]{0,70}".prop_map(String::into_bytes),
            ],
        ),
        0..6,
    )
    .prop_map(|pairs| {
        let mut map = HeaderMap::new();
        for (i, value) in pairs {
            if let Ok(value) = HeaderValue::from_bytes(&value) {
                map.append(HeaderName::from_static(HEADERS[i]), value);
            }
        }
        map
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The fuzz target's body on proptest's bytes (the same function
    /// `fuzz/fuzz_targets/webhook_parse.rs` runs under libFuzzer): arbitrary
    /// pieces split at 0xFF into headers, a JSON pointer and a body.
    #[test]
    fn the_fuzz_target_body_holds_on_arbitrary_bytes(
        data in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..400),
            proptest::collection::vec(
                prop_oneof![
                    "[ -~]{0,30}".prop_map(String::into_bytes),
                    "\\{\"id\":\"[a-z0-9_]{0,20}\"\\}".prop_map(String::into_bytes),
                    Just(vec![0xFF]),
                ],
                0..16,
            )
            .prop_map(|parts| parts.concat()),
        ],
    ) {
        if let Err(problem) = parse_anything::parse_anything(&data) {
            prop_assert!(false, "{}", problem);
        }
    }

    #[test]
    fn verification_never_panics_and_refuses_with_a_type(
        scheme in schemes(),
        headers in header_maps(),
        body in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let verifier = Verifier::new(scheme, ["whsec_c2VjcmV0LWtleQ=="]).expect("secret");
        match verifier.verify(&headers, &body, SystemTime::now()) {
            // Random bytes matching an HMAC-SHA256 would be a broken MAC.
            Ok(_) => prop_assert!(false, "random headers verified"),
            Err(SignatureError::Missing(_) | SignatureError::Malformed { .. }
                | SignatureError::Stale { .. } | SignatureError::NoMatch) => {}
            Err(other) => prop_assert!(false, "untyped refusal {other:?}"),
        }
    }

    #[test]
    fn key_derivation_never_panics(
        headers in header_maps(),
        body in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            "\\{\"id\":(\"[^\"]{0,40}\"|-?[0-9]{0,25}(\\.[0-9]+)?|null|true|\\{\\}|\\[\\])\\}".prop_map(String::into_bytes),
        ],
        pointer in "(/[a-z~01]{0,4}){0,3}",
    ) {
        for rule in [
            KeyRule::stripe("stripe"),
            KeyRule::github("github"),
            KeyRule::shopify("shopify"),
            KeyRule::standard_webhooks("standard"),
            KeyRule::generic("hooks"),
            KeyRule::new("custom", vec![KeySource::JsonPointer(pointer.clone()), KeySource::BodyHash]),
        ] {
            match rule.derive(&headers, &body) {
                Ok(derived) => {
                    prop_assert_eq!(derived.key.namespace(), rule.namespace());
                    prop_assert!(!derived.key.id().is_empty());
                    prop_assert!(!derived.key.id().chars().any(char::is_control));
                }
                Err(DeriveError::NotJson(_) | DeriveError::NoId(_) | DeriveError::BadId(_) | DeriveError::InvalidKey(_)) => {}
                Err(other) => prop_assert!(false, "untyped refusal {other:?}"),
            }
        }
    }

    #[test]
    fn a_signature_verifies_for_any_body_and_breaks_with_any_change(
        scheme in schemes(),
        key in proptest::collection::vec(any::<u8>(), 1..64),
        body in proptest::collection::vec(any::<u8>(), 0..512),
        flip in any::<proptest::sample::Index>(),
        id in "[A-Za-z0-9_]{1,32}",
    ) {
        use base64::Engine;
        let secret = match scheme {
            Scheme::StandardWebhooks => format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(&key)),
            _ => hex::encode(&key),
        };
        let verifier = Verifier::new(scheme, [secret]).expect("secret");
        let mut headers = HeaderMap::new();
        for (name, value) in verifier.sign(&id, now(), &body) {
            headers.insert(name, value.parse().expect("value"));
        }
        prop_assert!(verifier.verify(&headers, &body, SystemTime::now()).is_ok());
        let mut changed = body.clone();
        if changed.is_empty() {
            changed.push(0);
        } else {
            let i = flip.index(changed.len());
            changed[i] ^= 0x01;
        }
        prop_assert_eq!(
            verifier.verify(&headers, &changed, SystemTime::now()),
            Err(SignatureError::NoMatch)
        );
    }
}
