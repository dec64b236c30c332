//! The item a record is stored as: attribute names (configurable), the
//! expression placeholders that stand for them, and decoding.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use dedupe_core::backend::StoredRecord;
use dedupe_core::{Error, Key, Record, Result};

pub(crate) type Item = HashMap<String, AttributeValue>;

/// Longest attribute name accepted, in bytes (names count against the 400 KB
/// item limit, so they are kept short).
pub const MAX_ATTRIBUTE_NAME_BYTES: usize = 64;

/// The names of the attributes a record is stored in. The defaults are short,
/// since every byte of a name counts against DynamoDB's 400 KB item limit;
/// change them to fit a table you already have (its partition key, its TTL
/// attribute).
///
/// ```
/// let names = dedupe_dynamo::AttributeNames {
///     partition_key: "id".into(),
///     expires_at: "ttl".into(),
///     ..Default::default()
/// };
/// assert!(names.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttributeNames {
    /// The partition key, a string `namespace:id` (default `pk`).
    pub partition_key: String,
    /// 0 in flight, 1 done (default `st`).
    pub state: String,
    /// The lease token of the current holder (default `tk`).
    pub token: String,
    /// The claim id of the current holder, if it gave one (default `ci`).
    pub claim_id: String,
    /// The payload fingerprint, if the claim gave one (default `fp`).
    pub fingerprint: String,
    /// Epoch milliseconds: the lease deadline in flight, the retention
    /// deadline once done (default `dl`).
    pub deadline: String,
    /// Epoch milliseconds of completion (default `cm`).
    pub completed: String,
    /// The outcome bytes; `NULL` for an empty outcome (default `oc`).
    pub outcome: String,
    /// Attempts so far (default `at`).
    pub attempts: String,
    /// Epoch milliseconds of the first claim (default `fs`).
    pub first_seen: String,
    /// Epoch seconds after which DynamoDB's TTL may delete the item (default
    /// `expires_at`; enable TTL on this attribute).
    pub expires_at: String,
    /// An inbox item's wait: 0 held by a worker, 1 due, 2 dead; absent on
    /// every record that is not an item (default `wt`).
    pub wait: String,
    /// An inbox item's payload; `NULL` for an empty one (default `pl`).
    pub payload: String,
    /// An inbox item's last error (default `le`).
    pub last_error: String,
    /// The partition key of the due index: `<namespace>|w` on a pending or
    /// failed item, `<namespace>|h` on a running one, absent on dead items
    /// and records (default `iq`; the index sorts by the deadline).
    pub queue: String,
    /// The partition key of the items index: the namespace, on every item
    /// (default `il`).
    pub list_namespace: String,
    /// The sort key of the items index: `<status letter>:<id>` (default `ik`).
    pub list_key: String,
    /// An inbox item's takeovers of workers that died holding it; absent
    /// reads as 0 (default `to`).
    pub takeovers: String,
    /// An inbox item's own attempt limit, set at accept; absent: the
    /// worker's (default `ma`).
    pub max_attempts: String,
    /// A dead item's retention deadline, epoch milliseconds: `expire()`
    /// removes it past then (the TTL attribute is set too); absent: kept
    /// until forgotten (default `du`).
    pub dead_until: String,
    /// An inbox item's failure history, a JSON array of `[attempt, ms,
    /// error]`, its last five failures (default `eh`).
    pub errors: String,
    /// An inbox item's ordering key (CONTRACT.md I15; default `ok`).
    pub ordering_key: String,
    /// An ordered item's place in its key's queue: a nonce written at
    /// accept, which the queue's entry names (default `oe`).
    pub order_entry: String,
    /// 1 on an ordered item the later items of its key go past once it is
    /// dead (`WhenDead::Skip`); absent: it blocks them (default `os`).
    pub order_skip: String,
    /// An ordering key's queue item: its entries in accept order, each the
    /// item's id and nonce (default `oq`).
    pub order_queue: String,
    /// An ordering key's queue item: its version, raised by every change
    /// (default `ov`).
    pub order_version: String,
    /// An ordering key's queue item: the entry last handed out (default
    /// `oh`).
    pub order_holder: String,
}

impl Default for AttributeNames {
    fn default() -> Self {
        Self {
            partition_key: "pk".into(),
            state: "st".into(),
            token: "tk".into(),
            claim_id: "ci".into(),
            fingerprint: "fp".into(),
            deadline: "dl".into(),
            completed: "cm".into(),
            outcome: "oc".into(),
            attempts: "at".into(),
            first_seen: "fs".into(),
            expires_at: "expires_at".into(),
            wait: "wt".into(),
            payload: "pl".into(),
            last_error: "le".into(),
            queue: "iq".into(),
            list_namespace: "il".into(),
            list_key: "ik".into(),
            takeovers: "to".into(),
            max_attempts: "ma".into(),
            dead_until: "du".into(),
            errors: "eh".into(),
            ordering_key: "ok".into(),
            order_entry: "oe".into(),
            order_skip: "os".into(),
            order_queue: "oq".into(),
            order_version: "ov".into(),
            order_holder: "oh".into(),
        }
    }
}

impl AttributeNames {
    /// Placeholders (`#pk`, ...) paired with the names they stand for.
    fn pairs(&self) -> [(&'static str, &str); 27] {
        [
            ("#pk", &self.partition_key),
            ("#st", &self.state),
            ("#tk", &self.token),
            ("#ci", &self.claim_id),
            ("#fp", &self.fingerprint),
            ("#dl", &self.deadline),
            ("#cm", &self.completed),
            ("#oc", &self.outcome),
            ("#at", &self.attempts),
            ("#fs", &self.first_seen),
            ("#ex", &self.expires_at),
            ("#wt", &self.wait),
            ("#pl", &self.payload),
            ("#le", &self.last_error),
            ("#iq", &self.queue),
            ("#il", &self.list_namespace),
            ("#ik", &self.list_key),
            ("#to", &self.takeovers),
            ("#ma", &self.max_attempts),
            ("#du", &self.dead_until),
            ("#eh", &self.errors),
            ("#ok", &self.ordering_key),
            ("#oe", &self.order_entry),
            ("#os", &self.order_skip),
            ("#oq", &self.order_queue),
            ("#ov", &self.order_version),
            ("#oh", &self.order_holder),
        ]
    }

    /// Every name is 1 to 64 bytes, and no two are the same.
    pub fn validate(&self) -> Result<()> {
        let pairs = self.pairs();
        for (i, (_, name)) in pairs.iter().enumerate() {
            if name.is_empty() || name.len() > MAX_ATTRIBUTE_NAME_BYTES {
                return Err(Error::config(format!(
                    "attribute name {name:?} must be 1 to {MAX_ATTRIBUTE_NAME_BYTES} bytes"
                )));
            }
            if pairs[..i].iter().any(|(_, other)| other == name) {
                return Err(Error::config(format!(
                    "attribute name {name:?} is used for two attributes"
                )));
            }
        }
        Ok(())
    }

    /// `ExpressionAttributeNames` for the placeholders the expressions use
    /// (DynamoDB refuses names an expression does not use).
    pub(crate) fn used_in(&self, expressions: &[&str]) -> HashMap<String, String> {
        let mut used = HashMap::new();
        for expression in expressions {
            for token in expression.split(|c: char| !(c.is_ascii_alphanumeric() || c == '#')) {
                if let Some((placeholder, name)) = self.pairs().iter().find(|(p, _)| *p == token) {
                    used.insert((*placeholder).to_string(), (*name).to_string());
                }
            }
        }
        used
    }
}

pub(crate) fn n(v: i64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

/// An outcome as an attribute value: bytes, or `NULL` for none (DynamoDB Local
/// refuses empty binary values, which DynamoDB itself has allowed since 2020).
pub(crate) fn outcome_value(outcome: &[u8]) -> AttributeValue {
    if outcome.is_empty() {
        AttributeValue::Null(true)
    } else {
        AttributeValue::B(Blob::new(outcome))
    }
}

/// The partition key of a record.
pub(crate) fn partition_key(key: &Key) -> AttributeValue {
    s(&format!("{}:{}", key.namespace(), key.id()))
}

/// Whether the stored item is an inbox item (it has a wait).
pub(crate) fn is_inbox_item(names: &AttributeNames, item: &Item) -> bool {
    item.contains_key(&names.wait)
}

/// Reads a stored item into an inbox item: `None` for a record that is not
/// one; anything missing or malformed is corrupt.
pub(crate) fn decode_item(
    names: &AttributeNames,
    key: &Key,
    item: &Item,
) -> Result<Option<dedupe_core::Item>> {
    if !is_inbox_item(names, item) {
        decode(names, key, item)?;
        return Ok(None);
    }
    let record = decode(names, key, item)?;
    let corrupt =
        |what: &str| Error::corrupt(key, format!("item attribute {what} missing or malformed"));
    let num = |name: &str| -> Result<i64> {
        match item.get(name) {
            Some(AttributeValue::N(v)) => v.parse().map_err(|_| corrupt(name)),
            _ => Err(corrupt(name)),
        }
    };
    let last_error = match item.get(&names.last_error) {
        None => None,
        Some(AttributeValue::S(v)) => Some(v.clone()),
        Some(_) => return Err(corrupt(&names.last_error)),
    };
    let payload = match item.get(&names.payload) {
        Some(AttributeValue::B(v)) => Some(v.as_ref().to_vec()),
        Some(AttributeValue::Null(true)) => Some(Vec::new()),
        _ => return Err(corrupt(&names.payload)),
    };
    let opt_num = |name: &str| -> Result<Option<i64>> {
        match item.get(name) {
            None => Ok(None),
            Some(_) => num(name).map(Some),
        }
    };
    let errors = match item.get(&names.errors) {
        None => None,
        Some(AttributeValue::S(v)) => Some(v.clone()),
        Some(_) => return Err(corrupt(&names.errors)),
    };
    dedupe_core::backend::StoredItem {
        id: key.id().to_string(),
        wait: num(&names.wait)?,
        attempts: num(&names.attempts)?,
        accepted_ms: dedupe_core::backend::to_millis(record.first_seen),
        due_ms: num(&names.deadline)?,
        last_error,
        payload,
        counts: dedupe_core::backend::StoredCounts {
            takeovers: opt_num(&names.takeovers)?.unwrap_or(0),
            max_attempts: opt_num(&names.max_attempts)?,
        },
        ordering_key: match item.get(&names.ordering_key) {
            None => None,
            Some(AttributeValue::S(v)) => Some(v.clone()),
            Some(_) => return Err(corrupt(&names.ordering_key)),
        },
        errors,
    }
    .decode(key.namespace())
    .map(Some)
}

/// Reads an item into a record; anything missing or malformed is corrupt,
/// never guessed. An inbox item reads as a record in flight until its due
/// time (its lease's deadline while held), at attempt 1 or more.
pub(crate) fn decode(names: &AttributeNames, key: &Key, item: &Item) -> Result<Record> {
    let corrupt =
        |what: &str| Error::corrupt(key, format!("item attribute {what} missing or malformed"));
    let opt_num = |name: &str| -> Result<Option<i64>> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::N(v)) => v.parse().map(Some).map_err(|_| corrupt(name)),
            Some(_) => Err(corrupt(name)),
        }
    };
    let num = |name: &str| -> Result<i64> { opt_num(name)?.ok_or_else(|| corrupt(name)) };
    let opt_str = |name: &str| -> Result<Option<String>> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::S(v)) => Ok(Some(v.clone())),
            Some(_) => Err(corrupt(name)),
        }
    };
    let opt_bytes = |name: &str| -> Result<Option<Vec<u8>>> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::B(v)) => Ok(Some(v.as_ref().to_vec())),
            Some(AttributeValue::Null(true)) => Ok(Some(Vec::new())),
            Some(_) => Err(corrupt(name)),
        }
    };
    match item.get(&names.partition_key) {
        Some(found) if *found == partition_key(key) => {}
        _ => return Err(corrupt(&names.partition_key)),
    }
    StoredRecord {
        state: num(&names.state)?,
        token: opt_str(&names.token)?.ok_or_else(|| corrupt(&names.token))?,
        claim_id: opt_str(&names.claim_id)?,
        fingerprint: opt_bytes(&names.fingerprint)?,
        expires_ms: num(&names.deadline)?,
        completed_ms: opt_num(&names.completed)?,
        outcome: opt_bytes(&names.outcome)?,
        attempts: match is_inbox_item(names, item) {
            true => num(&names.attempts)?.max(1),
            false => num(&names.attempts)?,
        },
        first_seen_ms: num(&names.first_seen)?,
    }
    .decode(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_used_placeholders_are_named() {
        let names = AttributeNames::default();
        let used = names.used_in(&["#tk = :tk AND #st = :zero", "SET #dl = :until"]);
        let mut keys: Vec<_> = used.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["#dl", "#st", "#tk"]);
    }

    #[test]
    fn names_must_be_distinct_and_short() {
        let names = AttributeNames {
            token: "st".into(),
            ..Default::default()
        };
        assert!(names.validate().is_err());
        let names = AttributeNames {
            outcome: String::new(),
            ..Default::default()
        };
        assert!(names.validate().is_err());
        let names = AttributeNames {
            outcome: "o".repeat(65),
            ..Default::default()
        };
        assert!(names.validate().is_err());
        assert!(AttributeNames::default().validate().is_ok());
    }

    #[test]
    fn an_item_of_another_key_is_corrupt() {
        let names = AttributeNames::default();
        let key = Key::new("ns", "a").expect("key");
        let other = Key::new("ns", "b").expect("key");
        let mut item = Item::new();
        item.insert("pk".into(), partition_key(&other));
        item.insert("st".into(), n(0));
        item.insert("tk".into(), s("t"));
        item.insert("dl".into(), n(1));
        item.insert("at".into(), n(1));
        item.insert("fs".into(), n(1));
        assert!(matches!(
            decode(&names, &key, &item),
            Err(Error::CorruptRecord { .. })
        ));
        item.insert("pk".into(), partition_key(&key));
        assert!(decode(&names, &key, &item).is_ok());
        item.insert("at".into(), s("1"));
        assert!(matches!(
            decode(&names, &key, &item),
            Err(Error::CorruptRecord { .. })
        ));
    }

    /// Any value an attribute may hold, from the right kind to the wrong one.
    fn any_value() -> impl proptest::strategy::Strategy<Value = AttributeValue> {
        use proptest::prelude::*;
        prop_oneof![
            any::<i64>().prop_map(n),
            "\\PC{0,12}".prop_map(AttributeValue::N),
            "\\PC{0,12}".prop_map(AttributeValue::S),
            proptest::collection::vec(any::<u8>(), 0..16)
                .prop_map(|b| AttributeValue::B(Blob::new(b))),
            any::<bool>().prop_map(AttributeValue::Null),
            any::<bool>().prop_map(AttributeValue::Bool),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// An item with any of its attributes missing or holding anything
        /// decodes to a record or to `CorruptRecord`; never a panic, never
        /// another error.
        #[test]
        fn any_item_decodes_or_is_corrupt(
            values in proptest::collection::vec(proptest::option::of(any_value()), 13),
            right_key in proptest::prelude::any::<bool>(),
        ) {
            let names = AttributeNames::default();
            let key = Key::new("ns", "a").expect("key");
            let mut item = Item::new();
            let attrs = [
                &names.state, &names.token, &names.claim_id, &names.fingerprint, &names.deadline,
                &names.completed, &names.outcome, &names.attempts, &names.first_seen,
                &names.wait, &names.payload, &names.last_error,
            ];
            for (name, value) in attrs.iter().zip(&values) {
                if let Some(v) = value {
                    item.insert((*name).clone(), v.clone());
                }
            }
            if right_key {
                item.insert(names.partition_key.clone(), partition_key(&key));
            } else if let Some(v) = &values[12] {
                item.insert(names.partition_key.clone(), v.clone());
            }
            match decode(&names, &key, &item) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
            match decode_item(&names, &key, &item) {
                Ok(_) | Err(Error::CorruptRecord { .. }) => {}
                Err(other) => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}
