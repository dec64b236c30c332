//! The stored form of a record: compact, versioned (`d1`; `i2` for an inbox
//! item, `i1` for one written before takeovers were counted), binary-safe, and decoded strictly: anything else at a record's key
//! is a corrupt record, never a fresh claim.

use dedupe_core::backend::{StoredCounts, StoredItem, StoredRecord};
use dedupe_core::{Error, Item, Key, Record, Result};

fn corrupt(key: &Key, value: &[u8]) -> Error {
    Error::corrupt(
        key,
        format!(
            "the value at this key is not a dedupe record ({} bytes, starting {:?})",
            value.len(),
            String::from_utf8_lossy(&value[..value.len().min(16)])
        ),
    )
}

/// Decodes the value stored at `key`'s record. An inbox item reads as a
/// record in flight until its due time (its lease's deadline while a worker
/// holds it), at attempt 1 or more, as on every store.
pub(crate) fn decode(key: &Key, value: &[u8]) -> Result<Record> {
    if is_item(value) {
        let item = parse_item(key, value).ok_or_else(|| corrupt(key, value))?;
        return StoredRecord {
            state: StoredRecord::IN_FLIGHT,
            token: item.token,
            expires_ms: item.stored.due_ms,
            attempts: item.stored.attempts.max(1),
            first_seen_ms: item.stored.accepted_ms,
            ..StoredRecord::default()
        }
        .decode(key);
    }
    parse(value).ok_or_else(|| corrupt(key, value))?.decode(key)
}

/// Decodes the value at `key`'s record as an inbox item: `None` for a
/// record that is not one (a claim, a done record).
pub(crate) fn decode_item(key: &Key, value: &[u8]) -> Result<Option<Item>> {
    if !is_item(value) {
        decode(key, value)?;
        return Ok(None);
    }
    let item = parse_item(key, value).ok_or_else(|| corrupt(key, value))?;
    item.stored.decode(key.namespace()).map(Some)
}

/// An item as written today: `i3:` then the fields of `i2:` up to the
/// attempt limit, its place in its ordering key's order (`-`: no key) and
/// whether it is skipped when dead (`0`/`1`), then five length-prefixed
/// fields: token, last error, payload, failure history (JSON, empty when
/// none) and ordering key (empty when none).
const ITEM: &[u8] = b"i3:";
/// An item written before the history was kept: the fields of `i1:`, the
/// takeovers and the item's own attempt limit (`-`: none) after `has error`.
const ITEM_V2: &[u8] = b"i2:";
/// An item written before takeovers were counted: none, and no limit.
const ITEM_V1: &[u8] = b"i1:";

fn is_item(value: &[u8]) -> bool {
    value.starts_with(ITEM) || value.starts_with(ITEM_V2) || value.starts_with(ITEM_V1)
}

/// An item's fields, and its token (which [`StoredItem`] does not carry).
struct ParsedItem {
    stored: StoredItem,
    token: String,
}

fn parse_item(key: &Key, value: &[u8]) -> Option<ParsedItem> {
    let (mut rest, counted, history) = if let Some(rest) = value.strip_prefix(ITEM) {
        (rest, true, true)
    } else if let Some(rest) = value.strip_prefix(ITEM_V2) {
        (rest, true, false)
    } else {
        (value.strip_prefix(ITEM_V1)?, false, false)
    };
    let wait = match next(&mut rest)? {
        b"0" => 0,
        b"1" => 1,
        b"2" => 2,
        _ => return None,
    };
    let due_ms = number(next(&mut rest)?)?;
    let attempts = number(next(&mut rest)?)?;
    let accepted_ms = number(next(&mut rest)?)?;
    let has_error = match next(&mut rest)? {
        b"0" => false,
        b"1" => true,
        _ => return None,
    };
    let counts = match counted {
        true => StoredCounts {
            takeovers: number(next(&mut rest)?)?,
            max_attempts: match next(&mut rest)? {
                b"-" => None,
                text => Some(number(text)?),
            },
        },
        false => StoredCounts::default(),
    };
    // The order's place and skip flag (`i3`): read, checked against the key.
    let order = match history {
        true => {
            let seq = match next(&mut rest)? {
                b"-" => None,
                text => Some(number(text)?),
            };
            let skip = match next(&mut rest)? {
                b"0" => false,
                b"1" => true,
                _ => return None,
            };
            Some((seq, skip))
        }
        false => None,
    };
    let token = String::from_utf8(field(&mut rest)?.to_vec()).ok()?;
    let error = field(&mut rest)?;
    let last_error = match has_error {
        true => Some(String::from_utf8(error.to_vec()).ok()?),
        false if error.is_empty() => None,
        false => return None,
    };
    let payload = field(&mut rest)?.to_vec();
    let errors = match history {
        true => match field(&mut rest)? {
            b"" => None,
            text => Some(String::from_utf8(text.to_vec()).ok()?),
        },
        false => None,
    };
    let ordering_key = match order {
        Some((seq, skip)) => match (field(&mut rest)?, seq) {
            (b"", None) if !skip => None,
            (text, Some(_)) if !text.is_empty() => Some(String::from_utf8(text.to_vec()).ok()?),
            _ => return None,
        },
        None => None,
    };
    if !rest.is_empty() || token.is_empty() {
        return None;
    }
    Some(ParsedItem {
        stored: StoredItem {
            id: key.id().to_string(),
            wait,
            attempts,
            accepted_ms,
            due_ms,
            last_error,
            payload: Some(payload),
            counts,
            ordering_key,
            errors,
        },
        token,
    })
}

fn number(text: &[u8]) -> Option<i64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) || text.len() > 18 {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// Splits off the text up to the next `:`.
fn next<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let at = rest.iter().position(|b| *b == b':')?;
    let (head, tail) = rest.split_at(at);
    *rest = &tail[1..];
    Some(head)
}

/// A length-prefixed field.
fn field<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = usize::try_from(number(next(rest)?)?).ok()?;
    if rest.len() < len {
        return None;
    }
    let (value, tail) = rest.split_at(len);
    *rest = tail;
    Some(value)
}

fn parse(value: &[u8]) -> Option<StoredRecord> {
    let mut rest = value.strip_prefix(b"d1:")?;
    let state = match next(&mut rest)? {
        b"0" => StoredRecord::IN_FLIGHT,
        b"1" => StoredRecord::DONE,
        _ => return None,
    };
    let expires_ms = number(next(&mut rest)?)?;
    let completed_ms = match next(&mut rest)? {
        b"-" => None,
        text => Some(number(text)?),
    };
    let attempts = number(next(&mut rest)?)?;
    let first_seen_ms = number(next(&mut rest)?)?;
    let token = String::from_utf8(field(&mut rest)?.to_vec()).ok()?;
    let claim_id = match field(&mut rest)? {
        b"" => None,
        id => Some(String::from_utf8(id.to_vec()).ok()?),
    };
    let fingerprint = match field(&mut rest)? {
        b"" => None,
        fp => Some(fp.to_vec()),
    };
    let outcome = field(&mut rest)?;
    if !rest.is_empty() {
        return None;
    }
    let outcome = match state {
        StoredRecord::DONE => Some(outcome.to_vec()),
        _ if outcome.is_empty() => None,
        _ => return None,
    };
    Some(StoredRecord {
        state,
        token,
        claim_id,
        fingerprint,
        expires_ms,
        completed_ms,
        outcome,
        attempts,
        first_seen_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::new("t", "k").expect("key")
    }

    fn encode(r: &StoredRecord) -> Vec<u8> {
        let mut v = format!(
            "d1:{}:{}:{}:{}:{}:",
            r.state,
            r.expires_ms,
            r.completed_ms.map_or("-".to_string(), |c| c.to_string()),
            r.attempts,
            r.first_seen_ms
        )
        .into_bytes();
        for f in [
            r.token.as_bytes(),
            r.claim_id.as_deref().unwrap_or("").as_bytes(),
            r.fingerprint.as_deref().unwrap_or(b""),
            r.outcome.as_deref().unwrap_or(b""),
        ] {
            v.extend_from_slice(format!("{}:", f.len()).as_bytes());
            v.extend_from_slice(f);
        }
        v
    }

    #[test]
    fn round_trips_binary_outcomes_and_refuses_anything_else() {
        let done = StoredRecord {
            state: StoredRecord::DONE,
            token: "abc".into(),
            claim_id: Some("c:1".into()),
            fingerprint: Some(vec![0, b':', 255]),
            expires_ms: 1_700_000_000_123,
            completed_ms: Some(1_700_000_000_000),
            outcome: Some(b"12:x:\0\xff".to_vec()),
            attempts: 3,
            first_seen_ms: 1_600_000_000_000,
        };
        let bytes = encode(&done);
        let record = decode(&key(), &bytes).expect("decodes");
        assert_eq!(record.attempts, 3);
        assert!(matches!(
            record.state,
            dedupe_core::RecordState::Done { ref outcome, .. } if outcome == b"12:x:\0\xff"
        ));
        let mut cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"hello".to_vec(),
            b"d2:0:1:-:1:1:3:abc0:0:0:".to_vec(),
            b"d1:2:1:-:1:1:3:abc0:0:0:".to_vec(),
            b"d1:0:x:-:1:1:3:abc0:0:0:".to_vec(),
            b"d1:0:1:-:1:1:9:abc0:0:0:".to_vec(),
            b"d1:0:1:-:1:1:3:abc0:0:0:trailing".to_vec(),
            b"d1:0:1:-:1:1:3:abc0:0:1:x".to_vec(),
            b"d1:0:1:-:0:1:3:abc0:0:0:".to_vec(),
            b"d1:0:1:-:1:1:0:0:0:0:".to_vec(),
        ];
        cases.push(bytes[..bytes.len() - 1].to_vec());
        for case in cases {
            assert!(
                matches!(decode(&key(), &case), Err(Error::CorruptRecord { .. })),
                "accepted {:?}",
                String::from_utf8_lossy(&case)
            );
        }
    }

    #[test]
    fn items_decode_as_items_and_as_records_in_flight() {
        let value = b"i1:2:1700000000000:3:1600000000000:1:5:tok-14:boom3:a\0b";
        let item = decode_item(&key(), value)
            .expect("decodes")
            .expect("an item");
        assert_eq!(item.status, dedupe_core::ItemStatus::Dead);
        assert_eq!(
            (item.attempts, item.last_error.as_deref()),
            (3, Some("boom"))
        );
        assert_eq!(item.payload, b"a\0b");
        let record = decode(&key(), value).expect("a record");
        assert!(matches!(
            record.state,
            dedupe_core::RecordState::InFlight { .. }
        ));
        let fresh = b"i1:1:1700000000000:0:1600000000000:0:5:tok-10:0:";
        assert_eq!(decode(&key(), fresh).expect("a record").attempts, 1);
        for bad in [
            &b"i1:3:1:0:1:0:1:t0:0:"[..],
            b"i1:1:1:0:1:0:1:t3:err0:",
            b"i1:1:1:0:1:0:0:0:0:",
            b"i1:1:1:0:1:0:1:t0:1:",
            b"i1:1:1:0:1:0:1:t0:0:x",
            b"i1:1:1:0:1:1:1:t2:\xff\xfe0:",
        ] {
            assert!(
                matches!(decode_item(&key(), bad), Err(Error::CorruptRecord { .. })),
                "accepted {:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let claim = b"d1:0:1:-:1:1:3:abc0:0:0:";
        assert_eq!(decode_item(&key(), claim).expect("a record"), None);
    }

    /// `i2` items carry their takeovers and attempt limit (`-`: none); an
    /// `i1` item written before reads as none of either.
    #[test]
    fn items_carry_their_takeovers_and_limit() {
        let counted = decode_item(
            &key(),
            b"i2:0:1700000000000:4:1600000000000:0:2:5:5:tok-10:1:x",
        )
        .expect("decodes")
        .expect("an item");
        assert_eq!((counted.takeovers, counted.max_attempts), (2, Some(5)));
        let unlimited = decode_item(
            &key(),
            b"i2:1:1700000000000:0:1600000000000:0:0:-:5:tok-10:1:x",
        )
        .expect("decodes")
        .expect("an item");
        assert_eq!((unlimited.takeovers, unlimited.max_attempts), (0, None));
        let old = decode_item(&key(), b"i1:1:1700000000000:0:1600000000000:0:5:tok-10:1:x")
            .expect("decodes")
            .expect("an item");
        assert_eq!((old.takeovers, old.max_attempts), (0, None));
        let failed = decode_item(
            &key(),
            b"i3:2:1700000000000:2:1600000000000:1:0:-:7:1:5:tok-16:second1:x47:[[1,1700000000000,\"first\"],[2,1.7e12,\"second\"]]5:cus_1",
        )
        .expect("decodes")
        .expect("an item");
        assert_eq!(failed.ordering_key.as_deref(), Some("cus_1"));
        assert_eq!(
            failed
                .errors
                .iter()
                .map(|e| (e.attempt, e.error.as_str()))
                .collect::<Vec<_>>(),
            [(1, "first"), (2, "second")]
        );
        for bad in [
            &b"i3:1:1:0:1:0:0:-:-:0:5:tok-10:1:x2:{}0:"[..],
            b"i3:1:1:0:1:0:0:-:-:0:5:tok-10:1:x",
            b"i3:1:1:0:1:0:0:-:-:0:5:tok-10:1:x0:5:cus_1",
            b"i3:1:1:0:1:0:0:-:3:0:5:tok-10:1:x0:0:",
            b"i3:1:1:0:1:0:0:-:-:1:5:tok-10:1:x0:0:",
            &b"i2:1:1:0:1:0:x:-:5:tok-10:1:x"[..],
            b"i2:1:1:0:1:0:0:0:5:tok-10:1:x",
            b"i2:1:1:0:1:0:0:5:tok-10:1:x",
        ] {
            assert!(
                matches!(decode_item(&key(), bad), Err(Error::CorruptRecord { .. })),
                "accepted {:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Any bytes at a record's key decode to a record or to
        /// `CorruptRecord`; never a panic, never another error.
        #[test]
        fn any_value_decodes_or_is_corrupt(value in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120)) {
            match decode(&key(), &value) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
            let mut item = b"i1:".to_vec();
            item.extend_from_slice(&value);
            match decode_item(&key(), &item) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
        }

        /// A real record with one byte changed, cut short or extended decodes
        /// to a record or to `CorruptRecord`, and a record that still decodes
        /// after a cut or an extension is refused (the length prefixes and the
        /// end of the value must agree).
        #[test]
        fn mangled_records_are_corrupt_or_still_records(
            at in 0usize..200,
            byte in proptest::prelude::any::<u8>(),
            outcome in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
        ) {
            let good = encode(&StoredRecord {
                state: StoredRecord::DONE,
                token: "tok-1".into(),
                claim_id: Some("c".into()),
                fingerprint: Some(vec![7; 32]),
                expires_ms: 2_000_000_000_000,
                completed_ms: Some(1_900_000_000_000),
                outcome: Some(outcome.clone()),
                attempts: 2,
                first_seen_ms: 1_800_000_000_000,
            });
            proptest::prop_assert!(decode(&key(), &good).is_ok());
            let at = at % good.len();
            let mut changed = good.clone();
            changed[at] = byte;
            match decode(&key(), &changed) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
            let short = &good[..at];
            let cut = matches!(decode(&key(), short), Err(Error::CorruptRecord { .. }));
            proptest::prop_assert!(cut, "a record cut at {} decoded", at);
            let mut long = good.clone();
            long.push(byte);
            let extended = matches!(decode(&key(), &long), Err(Error::CorruptRecord { .. }));
            proptest::prop_assert!(extended, "a record with a byte more decoded");
        }
    }
}
