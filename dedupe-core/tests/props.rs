//! Property tests of the input the core takes from callers and reads back from
//! storage: any key, claim id or fingerprint text is accepted exactly as given
//! or refused with a typed error, and any stored record, however mangled,
//! decodes to a record or to `CorruptRecord`. Nothing panics.

use dedupe_core::backend::StoredRecord;
use dedupe_core::{ClaimId, Error, Fingerprint, Key, RecordState, MAX_ID_BYTES};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A key is what it was given, byte for byte, or a `KeyError`.
    #[test]
    fn keys_are_exact_or_refused(namespace in "\\PC{0,40}|[a-z:]{0,8}", id in any::<String>()) {
        match Key::new(namespace.clone(), id.clone()) {
            Ok(key) => {
                prop_assert_eq!(key.namespace(), namespace.as_str());
                prop_assert_eq!(key.id(), id.as_str());
                prop_assert!(!namespace.contains(':'), "a namespace with ':' was accepted");
                prop_assert!(!id.contains('\0') && id.len() <= MAX_ID_BYTES);
                prop_assert_eq!(key.to_string(), format!("{namespace}:{id}"));
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// Two keys built from different parts are different keys.
    #[test]
    fn distinct_parts_make_distinct_keys(
        a in ("[a-z]{1,6}", "\\PC{1,12}"),
        b in ("[a-z]{1,6}", "\\PC{1,12}"),
    ) {
        if let (Ok(ka), Ok(kb)) = (Key::new(a.0.clone(), a.1.clone()), Key::new(b.0.clone(), b.1.clone())) {
            prop_assert_eq!(ka == kb, a == b);
        }
    }

    /// A claim id is kept whole or refused; a fingerprint of any bytes is kept.
    #[test]
    fn claim_ids_and_fingerprints(text in any::<String>(), bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(id) = ClaimId::new(text.clone()) {
            prop_assert_eq!(id.as_str(), text.as_str());
        }
        let fp = Fingerprint::sha256(&bytes);
        prop_assert_eq!(fp, Fingerprint::sha256(&bytes));
    }

    /// Any stored record decodes to a record that says what was stored, or to
    /// `CorruptRecord` naming the key; never another error, never a panic.
    #[test]
    fn any_stored_record_decodes_or_is_corrupt(
        state in prop_oneof![Just(0i64), Just(1), any::<i64>()],
        token in "\\PC{0,40}",
        claim_id in proptest::option::of("\\PC{0,20}"),
        fingerprint in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
        expires_ms in prop_oneof![0i64..4_000_000_000_000, any::<i64>()],
        completed_ms in proptest::option::of(prop_oneof![0i64..4_000_000_000_000, any::<i64>()]),
        outcome in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)),
        attempts in prop_oneof![1i64..10, any::<i64>()],
        first_seen_ms in prop_oneof![0i64..4_000_000_000_000, any::<i64>()],
    ) {
        let key = Key::new("props", "k").expect("key");
        let stored = StoredRecord {
            state, token: token.clone(), claim_id, fingerprint, expires_ms, completed_ms,
            outcome: outcome.clone(), attempts, first_seen_ms,
        };
        match stored.decode(&key) {
            Ok(record) => {
                prop_assert_eq!(&record.key, &key);
                prop_assert_eq!(record.token.as_str(), token.as_str());
                prop_assert!(record.attempts >= 1);
                match record.state {
                    RecordState::Done { outcome: got, .. } => {
                        prop_assert_eq!(state, StoredRecord::DONE);
                        prop_assert_eq!(Some(got), outcome);
                    }
                    RecordState::InFlight { .. } => prop_assert_eq!(state, StoredRecord::IN_FLIGHT),
                }
            }
            Err(Error::CorruptRecord { .. }) => {}
            Err(other) => prop_assert!(false, "decode failed with {other:?}, not CorruptRecord"),
        }
    }
}
