//! Property tests over the `Idempotency-Key` parser: any bytes give a key or a
//! typed error, never a panic; every key the parser gives is one the layer
//! can store; every printable key comes back from its quoted and bare forms.

use dedupe_http::{IdempotencyKey, KeyError, MAX_KEY_BYTES};
use proptest::prelude::*;

/// The structured-field string form of `key`.
fn quoted(key: &str) -> String {
    let mut out = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_bytes_give_a_key_or_a_typed_error(value in proptest::collection::vec(any::<u8>(), 0..300)) {
        match IdempotencyKey::parse(&value) {
            Ok(key) => {
                let s = key.as_str();
                prop_assert!(!s.is_empty() && s.len() <= MAX_KEY_BYTES);
                prop_assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{s:?}");
            }
            Err(KeyError::Missing | KeyError::Repeated) => prop_assert!(false, "not a one-value error"),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn quoted_keys_round_trip(key in "[ -~]{1,255}") {
        prop_assert_eq!(IdempotencyKey::parse(quoted(&key).as_bytes()).map(|k| k.as_str().to_string()), Ok(key));
    }

    #[test]
    fn bare_keys_round_trip(key in "[!#-+\\--:<-\\[\\]-~]{1,255}") {
        prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()).map(|k| k.as_str().to_string()), Ok(key));
    }

    /// A bare value with a comma is two values joined; with a quote, a
    /// backslash or a `;` it is a malformed structured field: never a key.
    #[test]
    fn bare_values_with_structure_are_refused(head in "[a-z0-9]{0,20}", c in "[,;\\\\\"]", tail in "[a-z0-9]{0,20}") {
        let value = format!("{head}{c}{tail}");
        prop_assume!(!value.starts_with('"'));
        let refused = IdempotencyKey::parse(value.as_bytes());
        prop_assert!(matches!(refused, Err(KeyError::Repeated | KeyError::BadCharacter { .. })), "{value:?}: {refused:?}");
    }

    #[test]
    fn over_long_keys_are_refused(extra in 1usize..100, c in "[a-z]") {
        let key = c.repeat(MAX_KEY_BYTES + extra);
        prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()), Err(KeyError::TooLong { len: MAX_KEY_BYTES + extra }));
        prop_assert_eq!(IdempotencyKey::parse(quoted(&key).as_bytes()), Err(KeyError::TooLong { len: MAX_KEY_BYTES + extra }));
    }
}
