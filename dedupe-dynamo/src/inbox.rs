//! The inbox on DynamoDB: an item is its key's record with a wait, a payload
//! and a last error, and no TTL attribute while it may run (a dead item has
//! one, and `du`, at the end of its retention, I16). Two sparse
//! global secondary indexes find items without scanning the table:
//!
//! - `dedupe_due` (partition `iq`, sort `dl`, keys only): `<namespace>|w` on
//!   pending and failed items, `<namespace>|o` on those with an ordering key
//!   (the order module), `<namespace>|h` on running ones, absent on dead
//!   items and every other record. A take queries the three partitions for what is
//!   due by now, oldest first, and leases each candidate with an `UpdateItem`
//!   conditioned on the item being due *now* (`attribute_exists(iq) AND dl <=
//!   now`): the index is eventually consistent, the condition is not, so of
//!   two takers reading the same entry one wins and the other moves on.
//! - `dedupe_items` (partition `il` = the namespace, sort `ik` =
//!   `<status letter>:<id>`, keys only), on every item: a page of a status is
//!   one `Query` from the cursor, then a strongly consistent `BatchGetItem`
//!   of the page; a count is a `Select=COUNT` query of the status.
//!
//! Cost: an item's writes touch one or two index entries (a write unit each,
//! on top of the item's); a take is three queries (read units for at most
//! `3 x max + ORDER_SCAN` keys; the ordered partition's is billed even when
//! empty) and one `UpdateItem` per item; counts read every index key of the
//! namespace's items.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure, Select, TransactWriteItem,
};
use dedupe_core::backend::{
    self, check_ttl, duration_millis, from_millis, to_millis, StoredCounts, StoredRecord,
    StoredTaken,
};
use dedupe_core::backend::{accept_columns, check_accept, check_namespace, check_take, cut_error};
use dedupe_core::{
    AcceptOptions, Accepted, Error, Inbox, InboxCounts, ItemPage, ItemQuery, ItemStatus, Key,
    Lease, RecordState, Result, Retry, Taken, Wake, WhenDead,
};
use futures_util::StreamExt;

use crate::codec::{decode, decode_item, is_inbox_item, n, outcome_value, partition_key, s, Item};
use crate::expressions::*;
use crate::ops::deadline_of;
use crate::order::ordered_waiting;
use crate::store::{DynamoStore, Written};

/// The due index: items to take, by namespace and deadline.
pub(crate) const DUE_INDEX: &str = "dedupe_due";
/// The items index: items to list and count, by namespace, status and id.
pub(crate) const ITEMS_INDEX: &str = "dedupe_items";

/// An item a take may hand out: one the due index showed (`true`: held
/// past its lease, a takeover), or an ordering key's free head.
enum Candidate {
    Due(Key, bool),
    Head(crate::order::Head),
}

/// What a conditional update came to.
enum Updated {
    /// Written; the item as it is now, when asked for.
    Done(Option<Item>),
    /// The condition failed; the item as it is (none when absent).
    Failed(Option<Item>),
}

fn letter(status: ItemStatus) -> char {
    match status {
        ItemStatus::Pending => 'p',
        ItemStatus::Running => 'r',
        ItemStatus::Failed => 'f',
        ItemStatus::Dead => 'd',
    }
}

pub(crate) fn list_key(status: ItemStatus, key: &Key) -> AttributeValue {
    s(&format!("{}:{}", letter(status), key.id()))
}

pub(crate) fn waiting(namespace: &str) -> AttributeValue {
    s(&format!("{namespace}|w"))
}

pub(crate) fn held(namespace: &str) -> AttributeValue {
    s(&format!("{namespace}|h"))
}

/// The partition key of the namespace's pause marker (I13): a `|` where a
/// record's key has its `:`, so no record, index scan or `expire()` meets it.
fn pause_marker(namespace: &str) -> AttributeValue {
    s(&format!("{namespace}|paused"))
}

fn values<const N: usize>(pairs: [(&str, AttributeValue); N]) -> HashMap<String, AttributeValue> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

impl DynamoStore {
    /// The due index's partition `item` waits in: the ordered items' own
    /// when it has an ordering key (the order module's walk hands them out).
    fn waiting_for(&self, namespace: &str, item: &Item) -> AttributeValue {
        match item.contains_key(&self.inner.names.ordering_key) {
            true => ordered_waiting(namespace),
            false => waiting(namespace),
        }
    }

    /// One conditional `UpdateItem`, answering the item after it (when `new`)
    /// or, when the condition failed, the item as it is (returned by the
    /// service, or read where an emulator returns nothing).
    async fn update(
        &self,
        key: &Key,
        update: &'static str,
        condition: &'static str,
        values: HashMap<String, AttributeValue>,
        new: bool,
    ) -> Result<Updated> {
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(key))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(self.names(&[update, condition]))
            .set_expression_attribute_values(Some(values))
            .return_values(if new {
                ReturnValue::AllNew
            } else {
                ReturnValue::None
            })
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(out) => Ok(Updated::Done(out.attributes().cloned())),
            Err(e) if crate::error::is_condition_failure(&e) => {
                let old = match e.as_service_error() {
                    Some(UpdateItemError::ConditionalCheckFailedException(c)) => c.item().cloned(),
                    _ => None,
                }
                .filter(|item| !item.is_empty());
                Ok(Updated::Failed(match old {
                    Some(old) => Some(old),
                    None => self.read(key).await?,
                }))
            }
            Err(e) => Err(self.index_error(e)),
        }
    }

    /// A request's error; a missing inbox index is a configuration error
    /// saying how to add it.
    fn index_error<E>(
        &self,
        e: aws_sdk_dynamodb::error::SdkError<E, aws_sdk_dynamodb::config::http::HttpResponse>,
    ) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        // DynamoDB and DynamoDB Local: ValidationException "The table does
        // not have the specified index"; moto: ResourceNotFoundException
        // "Invalid index".
        let missing_index = matches!(
            e.code(),
            Some("ValidationException" | "ResourceNotFoundException")
        ) && e
            .message()
            .is_some_and(|m| m.to_ascii_lowercase().contains("index"));
        if missing_index {
            return Error::config(format!(
                "table {} has no inbox indexes ({DUE_INDEX}, {ITEMS_INDEX}): \
                 create_table_if_missing adds them (dedupe migrate); {}",
                self.inner.table,
                e.message().unwrap_or_default()
            ));
        }
        self.fail(e)
    }

    /// The lease an item read back holds, and its payload and last error.
    pub(crate) fn taken(&self, key: Key, item: &Item) -> Result<Taken> {
        let record = decode(&self.inner.names, &key, item)?;
        let shown = decode_item(&self.inner.names, &key, item)?
            .ok_or_else(|| Error::corrupt(&key, "a taken item is not an inbox item"))?;
        StoredTaken {
            token: record.token.as_str().to_string(),
            deadline_ms: to_millis(deadline_of(&record)),
            attempt: i64::from(shown.attempts),
            accepted_ms: to_millis(shown.accepted_at),
            last_error: shown.last_error,
            payload: Some(shown.payload),
            counts: StoredCounts {
                takeovers: i64::from(shown.takeovers),
                max_attempts: shown.max_attempts.map(i64::from),
            },
            ordering_key: shown.ordering_key,
        }
        .decode(key)
    }

    /// `release` (`delay` zero) or `snooze` of an inbox item held by
    /// `lease` (read as `item`): due `delay` from now, the attempt its take
    /// counted taken back (I9, I12). Waiting under this lease's token already
    /// (the same call sent again): Ok, nothing changed.
    pub(crate) async fn give_back(
        &self,
        lease: &Lease,
        item: &Item,
        delay: Duration,
    ) -> Result<()> {
        let names = &self.inner.names;
        let given_back = |item: &Item| -> Result<bool> {
            let record = decode(names, &lease.key, item)?;
            let shown = decode_item(names, &lease.key, item)?;
            Ok(record.token == lease.token
                && shown
                    .is_some_and(|i| matches!(i.status, ItemStatus::Pending | ItemStatus::Failed)))
        };
        if given_back(item)? {
            return Ok(());
        }
        let status = match item.contains_key(&names.last_error) {
            true => ItemStatus::Failed,
            false => ItemStatus::Pending,
        };
        let now = self.now_ms();
        let vals = values([
            (":tk", s(lease.token.as_str())),
            (":zero", n(0)),
            (":one", n(1)),
            (":now", n(now)),
            (":due", n(now.saturating_add(duration_millis(delay)))),
            (":q", self.waiting_for(lease.key.namespace(), item)),
            (":lk", list_key(status, &lease.key)),
        ]);
        match self
            .update(&lease.key, GIVEN_BACK, ITEM_HELD, vals, false)
            .await?
        {
            Updated::Done(_) => Ok(()),
            Updated::Failed(Some(old)) if is_inbox_item(names, &old) && given_back(&old)? => Ok(()),
            Updated::Failed(_) => Err(Error::lease_lost(&lease.key)),
        }
    }

    /// `extend` of an inbox item held by `lease`: its deadline moves, and no
    /// TTL is set (items never expire).
    pub(crate) async fn extend_item(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let now = self.now_ms();
        let until = now.saturating_add(duration_millis(ttl));
        let vals = values([
            (":tk", s(lease.token.as_str())),
            (":zero", n(0)),
            (":now", n(now)),
            (":until", n(until)),
            (":q", held(lease.key.namespace())),
        ]);
        match self
            .update(&lease.key, ITEM_EXTEND, ITEM_HELD, vals, false)
            .await?
        {
            Updated::Done(_) => Ok(Lease {
                deadline: from_millis(until),
                ..lease.clone()
            }),
            Updated::Failed(_) => Err(Error::lease_lost(&lease.key)),
        }
    }

    /// The keys of the due index's partition `queue` due by `now`, oldest
    /// first, at most `max`, with their deadlines.
    async fn due(&self, queue: AttributeValue, now: i64, max: usize) -> Result<Vec<(i64, Item)>> {
        let out = self
            .inner
            .client
            .query()
            .table_name(&self.inner.table)
            .index_name(DUE_INDEX)
            .key_condition_expression(DUE_QUERY)
            .set_expression_attribute_names(self.names(&[DUE_QUERY]))
            .expression_attribute_values(":q", queue)
            .expression_attribute_values(":now", n(now))
            .scan_index_forward(true)
            .limit(i32::try_from(max).unwrap_or(i32::MAX))
            .send()
            .await
            .map_err(|e| self.index_error(e))?;
        let names = &self.inner.names;
        Ok(out
            .items()
            .iter()
            .filter_map(|item| {
                let dl = match item.get(&names.deadline) {
                    Some(AttributeValue::N(v)) => v.parse().ok()?,
                    _ => return None,
                };
                Some((dl, item.clone()))
            })
            .collect())
    }

    /// The earliest deadline in the due index's partition `queue`.
    async fn oldest(&self, queue: AttributeValue) -> Result<Option<i64>> {
        let first = self
            .inner
            .client
            .query()
            .table_name(&self.inner.table)
            .index_name(DUE_INDEX)
            .key_condition_expression(OLDEST_QUERY)
            .set_expression_attribute_names(self.names(&[OLDEST_QUERY]))
            .expression_attribute_values(":q", queue)
            .scan_index_forward(true)
            .limit(1)
            .send()
            .await
            .map_err(|e| self.index_error(e))?;
        Ok(first
            .items()
            .first()
            .and_then(|item| match item.get(&self.inner.names.deadline) {
                Some(AttributeValue::N(v)) => v.parse::<i64>().ok(),
                _ => None,
            }))
    }

    /// Whether the namespace's pause marker is there (a strongly consistent
    /// read).
    async fn marked(&self, namespace: &str) -> Result<bool> {
        let out = self
            .inner
            .client
            .get_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, pause_marker(namespace))
            .consistent_read(true)
            .projection_expression(NO_MARKER_PROJECTION)
            .set_expression_attribute_names(self.names(&[NO_MARKER_PROJECTION]))
            .send()
            .await
            .map_err(|e| self.fail(e))?;
        Ok(out.item().is_some_and(|item| !item.is_empty()))
    }

    /// The key an index entry points at, in `namespace`.
    fn key_of(&self, namespace: &str, entry: &Item) -> Result<Key> {
        let probe = Key::new(namespace, "-")?;
        let Some(AttributeValue::S(pk)) = entry.get(&self.inner.names.partition_key) else {
            return Err(Error::corrupt(&probe, "an index entry without its key"));
        };
        let id = pk
            .strip_prefix(namespace)
            .and_then(|rest| rest.strip_prefix(':'))
            .ok_or_else(|| Error::corrupt(&probe, format!("an index entry of {pk:?}")))?;
        Key::new(namespace, id).map_err(|e| Error::corrupt(&probe, e.to_string()))
    }

    /// A query of the items index for `namespace`'s items in `status`.
    fn status_query(
        &self,
        namespace: &str,
        status: ItemStatus,
    ) -> aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder {
        self.inner
            .client
            .query()
            .table_name(&self.inner.table)
            .index_name(ITEMS_INDEX)
            .key_condition_expression(LIST_QUERY)
            .set_expression_attribute_names(self.names(&[LIST_QUERY]))
            .expression_attribute_values(":ns", s(namespace))
            .expression_attribute_values(":p", s(&format!("{}:", letter(status))))
    }

    /// Every index key of `status` in `namespace` after `after`, up to
    /// `limit`, in id order.
    async fn listed(
        &self,
        namespace: &str,
        status: ItemStatus,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Key>> {
        let names = &self.inner.names;
        let mut start = after.map(|after| {
            HashMap::from([
                (
                    names.partition_key.clone(),
                    s(&format!("{namespace}:{after}")),
                ),
                (names.list_namespace.clone(), s(namespace)),
                (
                    names.list_key.clone(),
                    s(&format!("{}:{after}", letter(status))),
                ),
            ])
        });
        let mut keys = Vec::new();
        while keys.len() < limit {
            let out = self
                .status_query(namespace, status)
                .set_exclusive_start_key(start.take())
                .limit(i32::try_from(limit - keys.len()).unwrap_or(i32::MAX))
                .send()
                .await
                .map_err(|e| self.index_error(e))?;
            for entry in out.items() {
                keys.push(self.key_of(namespace, entry)?);
            }
            match out.last_evaluated_key() {
                Some(last) if !last.is_empty() => start = Some(last.clone()),
                _ => break,
            }
        }
        Ok(keys)
    }

    /// How many index keys of `status` the namespace has.
    async fn count(&self, namespace: &str, status: ItemStatus) -> Result<u64> {
        let mut start = None;
        let mut total = 0u64;
        loop {
            let out = self
                .status_query(namespace, status)
                .select(Select::Count)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.index_error(e))?;
            total += u64::try_from(out.count()).unwrap_or(0);
            match out.last_evaluated_key() {
                Some(last) if !last.is_empty() => start = Some(last.clone()),
                _ => return Ok(total),
            }
        }
    }

    /// Strongly consistent reads of `keys`, 100 a request.
    async fn read_many(&self, keys: &[Key]) -> Result<HashMap<String, Item>> {
        let pks: Vec<String> = keys
            .iter()
            .map(|k| format!("{}:{}", k.namespace(), k.id()))
            .collect();
        self.read_pks(&pks, None).await
    }
}

/// Every call bounded by the store's timeout; deadlines by the caller's
/// clock, checked against DynamoDB's as claims are.
impl DynamoStore {
    /// Accepts `payload` under `key` in one DynamoDB transaction with the
    /// caller's `items` (at most 99, 98 with an ordering key; the outbox half, CONTRACT.md I1): when
    /// the answer is `New`, the items were written with the item; any other
    /// answer (`Item`, `Done`, `InFlight`) means none of them was. An error
    /// other than a timeout means none was; after a timeout the transaction
    /// may have committed: accept again (a `New` whose transaction the SDK
    /// sent twice is recognised by the item's token). An item of the
    /// caller's whose own condition fails cancels the whole transaction: a
    /// non-retryable error naming the item. `accept_with` is this with no
    /// items (a plain conditional `PutItem`).
    ///
    /// ```no_run
    /// # async fn demo(store: dedupe_dynamo::DynamoStore) -> dedupe_core::Result<()> {
    /// use dedupe_dynamo::aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
    /// use dedupe_core::{AcceptOptions, Key};
    ///
    /// let charge = Put::builder()
    ///     .table_name("charges")
    ///     .item("charge_id", AttributeValue::S("ch_17".into()))
    ///     .build()
    ///     .expect("table and item are set");
    /// let key = Key::new("receipts", "ch_17")?;
    /// let items = [TransactWriteItem::builder().put(charge).build()];
    /// let accepted = store
    ///     .accept_with_writes(&key, b"send the receipt", &AcceptOptions::new(), &items)
    ///     .await?;
    /// // New: the charge and the queued receipt committed together.
    /// assert!(accepted.is_new());
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "dedupe.accept_with_writes", skip_all, fields(store = "dynamodb", key = %key, items = items.len()), err)]
    pub async fn accept_with_writes(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
        items: &[TransactWriteItem],
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let (delay, max_attempts) = accept_columns(options);
        // An ordered item's entry in its key's queue, written with it.
        let nonce = backend::new_token();
        let queue = options
            .ordering_key
            .as_deref()
            .map(|ordering_key| self.queue_append(key, ordering_key, nonce.as_str()))
            .transpose()?;
        let accepted = self
            .bounded(async {
                self.clock_guard(key, None).await?;
                let names = &self.inner.names;
                // What the write requires of the item: absent or done and expired,
                // or exactly the expired claim last read (its attempts are kept).
                let mut replacing: Option<dedupe_core::Record> = None;
                for round in 0..CLAIM_ROUNDS {
                    let now = self.now_ms();
                    let token = backend::new_token();
                    let (attempts, first_seen) = match &replacing {
                        Some(old) => (i64::from(old.attempts), to_millis(old.first_seen)),
                        None => (0, now),
                    };
                    let mut item = Item::from([
                        (names.partition_key.clone(), partition_key(key)),
                        (names.state.clone(), n(StoredRecord::IN_FLIGHT)),
                        (names.token.clone(), s(token.as_str())),
                        (names.deadline.clone(), n(now.saturating_add(delay))),
                        (names.attempts.clone(), n(attempts)),
                        (names.first_seen.clone(), n(first_seen)),
                        (names.wait.clone(), n(1)),
                        (names.payload.clone(), outcome_value(payload)),
                        (
                            names.queue.clone(),
                            match queue {
                                Some(_) => ordered_waiting(key.namespace()),
                                None => waiting(key.namespace()),
                            },
                        ),
                        (names.list_namespace.clone(), s(key.namespace())),
                        (names.list_key.clone(), list_key(ItemStatus::Pending, key)),
                        (names.takeovers.clone(), n(0)),
                    ]);
                    if let Some(limit) = max_attempts {
                        item.insert(names.max_attempts.clone(), n(limit));
                    }
                    if let Some(ordering_key) = &options.ordering_key {
                        item.insert(names.ordering_key.clone(), s(ordering_key));
                        item.insert(names.order_entry.clone(), s(nonce.as_str()));
                        if options.when_dead == WhenDead::Skip {
                            item.insert(names.order_skip.clone(), n(1));
                        }
                    }
                    let (condition, vals) = match &replacing {
                        None => (
                            FRESH,
                            values([(":done", n(StoredRecord::DONE)), (":now", n(now))]),
                        ),
                        Some(old) => (
                            TAKEOVER,
                            values([
                                (":tk", s(old.token.as_str())),
                                (":dl", n(to_millis(deadline_of(old)))),
                            ]),
                        ),
                    };
                    let written = if items.is_empty() && queue.is_none() {
                        self.put(item, condition, vals).await?
                    } else {
                        self.transact_put(item, condition, vals, items, queue.clone())
                            .await?
                    };
                    let old = match written {
                        Written::Won => return Ok(Accepted::New),
                        Written::Conflict => {
                            tokio::time::sleep(Duration::from_millis(5 << round.min(5))).await;
                            continue;
                        }
                        Written::Lost(Some(old)) => Some(old),
                        Written::Lost(None) => self.read(key).await?,
                    };
                    let Some(old) = old else {
                        replacing = None;
                        continue;
                    };
                    let record = decode(names, key, &old)?;
                    if let Some(item) = decode_item(names, key, &old)? {
                        // This very accept, sent again by the SDK after its answer
                        // was lost, met its own item (no take has changed the token).
                        if record.token == token {
                            return Ok(Accepted::New);
                        }
                        return Ok(Accepted::Item(item));
                    }
                    if deadline_of(&record) > from_millis(self.now_ms()) {
                        return Ok(backend::accepted_over(record));
                    }
                    replacing = match record.state {
                        RecordState::InFlight { .. } => Some(record),
                        RecordState::Done { .. } => None,
                    };
                }
                Err(Error::retryable(
                    "the record kept changing under the accept; retry",
                    None,
                ))
            })
            .await?;
        if accepted == Accepted::New {
            self.inner.wakeups.raise(key.namespace());
        }
        Ok(accepted)
    }
}

#[async_trait]
impl Inbox for DynamoStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        self.accept_with_writes(key, payload, options, &[]).await
    }

    /// Three queries of the due index (waiting, held past the lease, and
    /// ordered items waiting, `max + ORDER_SCAN` deep), the ordered ones
    /// narrowed to each ordering key's free head (the order module), merged
    /// oldest due first; then one conditional update per candidate (a
    /// two-item transaction per head), `fan_out` at a time. A candidate the
    /// index showed stale (taken or changed since) is passed over, so a take
    /// may hand out fewer than `max` while more are due; the next take finds
    /// them.
    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        check_take(max, lease)?;
        let probe = Key::new(namespace, "-")?;
        self.bounded(async {
            self.clock_guard(&probe, Some(lease)).await?;
            let now = self.now_ms();
            // The pause marker is read beside the index, strongly consistent:
            // a take that starts after a pause answered sees it.
            let (paused, a, b, c) = futures_util::try_join!(
                self.marked(namespace),
                self.due(waiting(namespace), now, max),
                self.due(held(namespace), now, max),
                self.due(ordered_waiting(namespace), now, max + dedupe_core::ORDER_SCAN)
            )?;
            if paused {
                return Ok(Vec::new());
            }
            let mut first_error = None;
            // The ordered items' heads; their failure leaves the plain
            // candidates to hand out.
            let heads = match c.is_empty() {
                true => Vec::new(),
                false => self
                    .ordered_heads(&probe, &c, now, max)
                    .await
                    .unwrap_or_else(|e| vec![Err(e)]),
            };
            let mut candidates: Vec<(i64, Candidate)> = a
                .into_iter()
                .map(|(dl, item)| Ok((dl, Candidate::Due(self.key_of(namespace, &item)?, false))))
                .chain(
                    b.into_iter()
                        .map(|(dl, item)| Ok((dl, Candidate::Due(self.key_of(namespace, &item)?, true)))),
                )
                .collect::<Result<_>>()?;
            for head in heads {
                match head {
                    Ok(head) => candidates.push((head.due_ms, Candidate::Head(head))),
                    Err(e) => {
                        tracing::warn!(namespace, error = %e, "an ordering key's head could not be read");
                        first_error.get_or_insert(e);
                    }
                }
            }
            candidates.sort_by_key(|(dl, _)| *dl);
            candidates.truncate(max);
            let leased: Vec<Result<Option<Taken>>> = futures_util::stream::iter(candidates)
                .map(|(_, candidate)| async move {
                    let (key, takeover) = match candidate {
                        Candidate::Due(key, takeover) => (key, takeover),
                        Candidate::Head(head) => {
                            return self.lease_head(namespace, head, lease).await
                        }
                    };
                    let now = self.now_ms();
                    let token = backend::new_token();
                    let vals = values([
                        (":now", n(now)),
                        (":tk", s(token.as_str())),
                        (":until", n(now.saturating_add(duration_millis(lease)))),
                        (":one", n(1)),
                        (":zero", n(0)),
                        (":q", held(namespace)),
                        (":lk", list_key(ItemStatus::Running, &key)),
                    ]);
                    let (update, condition) = match takeover {
                        true => (LEASE_TAKEOVER, DUE_HELD),
                        false => (LEASE, DUE_WAITING),
                    };
                    match self.update(&key, update, condition, vals, true).await? {
                        Updated::Done(Some(item)) => self.taken(key, &item).map(Some),
                        Updated::Done(None) => Err(Error::retryable(
                            "the service did not return the item it leased",
                            None,
                        )),
                        // This very update, sent again by the SDK after its
                        // answer was lost, met its own lease.
                        Updated::Failed(Some(old))
                            if decode(&self.inner.names, &key, &old)?.token == token =>
                        {
                            self.taken(key, &old).map(Some)
                        }
                        Updated::Failed(_) => Ok(None),
                    }
                })
                .buffered(self.inner.fan_out)
                .collect()
                .await;
            // Items already leased are handed out even when another
            // candidate's update failed: dropping them would hold them from
            // every worker for their whole lease, an attempt counted.
            let mut taken = Vec::with_capacity(leased.len());
            for result in leased {
                match result {
                    Ok(Some(item)) => taken.push(item),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(namespace, error = %e, "a candidate of a take failed");
                        first_error.get_or_insert(e);
                    }
                }
            }
            match first_error {
                Some(e) if taken.is_empty() => Err(e),
                _ => Ok(taken),
            }
        })
        .await
    }

    /// A read, then the give-back a release makes, due `delay` from now.
    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        check_ttl("snooze delay", delay)?;
        self.bounded(async {
            let Some(item) = self.read(&lease.key).await? else {
                return Err(Error::lease_lost(&lease.key));
            };
            if is_inbox_item(&self.inner.names, &item) {
                return self.give_back(lease, &item, delay).await;
            }
            Err(Error::lease_lost(&lease.key))
        })
        .await
    }

    /// Two requests: the item is read (strongly consistent) for its failure
    /// history, then updated with the failure appended, fenced by the lease
    /// (no other worker can fail it meanwhile: a takeover changes the token,
    /// and the update's condition fails).
    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        retry.validate()?;
        let error = cut_error(error);
        self.bounded(async {
            let key = &lease.key;
            let read = self.read(key).await?;
            let history = match &read {
                Some(item) => match item.get(&self.inner.names.errors) {
                    Some(AttributeValue::S(text)) => Some(text.clone()),
                    None => None,
                    Some(_) => return Err(Error::corrupt(key, "an item's failure history")),
                },
                None => None,
            };
            let queue = match &read {
                Some(item) => self.waiting_for(key.namespace(), item),
                None => waiting(key.namespace()),
            };
            let now = self.now_ms();
            let history = backend::push_error(
                key,
                history.as_deref(),
                dedupe_core::FailedAttempt::new(lease.attempt, from_millis(now), error.as_str()),
            )?;
            let mut vals = values([
                (":tk", s(lease.token.as_str())),
                (":zero", n(0)),
                (":now", n(now)),
                (":le", s(&error)),
                (":eh", s(&history)),
            ]);
            let update = match retry {
                Retry::After(delay) => {
                    vals.insert(":one".into(), n(1));
                    vals.insert(
                        ":due".into(),
                        n(now.saturating_add(duration_millis(delay))),
                    );
                    vals.insert(":q".into(), queue);
                    vals.insert(":lk".into(), list_key(ItemStatus::Failed, key));
                    FAIL_RETRY
                }
                Retry::Dead { keep } => {
                    vals.insert(":two".into(), n(2));
                    vals.insert(":due".into(), n(now));
                    vals.insert(":lk".into(), list_key(ItemStatus::Dead, key));
                    match keep {
                        Some(keep) => {
                            let until = now.saturating_add(duration_millis(keep));
                            vals.insert(":du".into(), n(until));
                            vals.insert(":exp".into(), n(DynamoStore::ttl_seconds(until)));
                            FAIL_DEAD_UNTIL
                        }
                        None => FAIL_DEAD,
                    }
                }
            };
            let old = match self.update(key, update, ITEM_HELD, vals, false).await? {
                Updated::Done(_) => return Ok(()),
                Updated::Failed(None) => return Err(Error::lease_lost(key)),
                Updated::Failed(Some(old)) => old,
            };
            let names = &self.inner.names;
            let record = decode(names, key, &old)?;
            let Some(item) = decode_item(names, key, &old)? else {
                let held = record.token == lease.token
                    && matches!(record.state, RecordState::InFlight { lease_deadline } if lease_deadline > from_millis(now));
                return Err(if held {
                    Error::config("fail is for inbox items; a claim is released instead")
                } else {
                    Error::lease_lost(key)
                });
            };
            // Failed so already by this lease (the same fail sent again).
            let same = record.token == lease.token
                && item.last_error.as_deref() == Some(error.as_str())
                && match retry {
                    Retry::Dead { .. } => item.status == ItemStatus::Dead,
                    Retry::After(_) => item.status == ItemStatus::Failed,
                };
            if same {
                Ok(())
            } else {
                Err(Error::lease_lost(key))
            }
        })
        .await
    }

    /// The item read, then deleted on condition that it is still exactly as
    /// read (its token, wait, attempts and deadline) and in the state seen.
    async fn forget_if(&self, key: &Key, status: ItemStatus, attempts: u32) -> Result<bool> {
        self.bounded(async {
            let Some(item) = self.read(key).await? else {
                return Ok(false);
            };
            let names = &self.inner.names;
            let Some(seen) = decode_item(names, key, &item)? else {
                return Ok(false);
            };
            if seen.status != status || seen.attempts != attempts {
                return Ok(false);
            }
            let value = |name: &String| {
                item.get(name)
                    .cloned()
                    .ok_or_else(|| Error::corrupt(key, format!("an item without {name}")))
            };
            let gone = self
                .inner
                .client
                .delete_item()
                .table_name(&self.inner.table)
                .key(&names.partition_key, crate::codec::partition_key(key))
                .condition_expression(AS_READ)
                .set_expression_attribute_names(self.names(&[AS_READ]))
                .expression_attribute_values(":tk", value(&names.token)?)
                .expression_attribute_values(":wt", value(&names.wait)?)
                .expression_attribute_values(":at", value(&names.attempts)?)
                .expression_attribute_values(":dl", value(&names.deadline)?)
                .send()
                .await;
            match gone {
                Ok(_) => Ok(true),
                // Changed since the read: no longer what was seen.
                Err(e) if crate::error::is_condition_failure(&e) => Ok(false),
                Err(e) => Err(self.fail(e)),
            }
        })
        .await
    }

    async fn item(&self, key: &Key) -> Result<Option<dedupe_core::Item>> {
        self.bounded(async {
            match self.read(key).await? {
                Some(item) => decode_item(&self.inner.names, key, &item),
                None => Ok(None),
            }
        })
        .await
    }

    /// Up to `limit + 1` index keys of each status asked (one query each),
    /// merged in id order, then the page read strongly consistent. An item
    /// whose status changed between the two is shown as it is now, and left
    /// out when it no longer matches the filter.
    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        query.validate()?;
        let statuses: Vec<ItemStatus> = match query.status {
            Some(status) => vec![status],
            None => vec![
                ItemStatus::Pending,
                ItemStatus::Running,
                ItemStatus::Failed,
                ItemStatus::Dead,
            ],
        };
        self.bounded(async {
            let lists = futures_util::future::try_join_all(statuses.iter().map(|status| {
                self.listed(
                    &query.namespace,
                    *status,
                    query.after.as_deref(),
                    query.limit + 1,
                )
            }))
            .await?;
            let mut keys: Vec<Key> = lists.into_iter().flatten().collect();
            // DynamoDB orders string sort keys by their UTF-8 bytes, as this does.
            keys.sort_by(|a, b| a.id().as_bytes().cmp(b.id().as_bytes()));
            keys.dedup();
            let more = keys.len() > query.limit;
            keys.truncate(query.limit);
            let next = more
                .then(|| keys.last().map(|k| k.id().to_string()))
                .flatten();
            let found = self.read_many(&keys).await?;
            let mut items = Vec::with_capacity(keys.len());
            for key in &keys {
                let pk = format!("{}:{}", key.namespace(), key.id());
                let Some(stored) = found.get(&pk) else {
                    continue;
                };
                if let Some(item) = decode_item(&self.inner.names, key, stored)? {
                    if query.status.is_none_or(|s| s == item.status) {
                        items.push(item);
                    }
                }
            }
            Ok(ItemPage::new(items, next))
        })
        .await
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let replayed = self
            .bounded(async {
                let vals = values([
                    (":one", n(1)),
                    (":two", n(2)),
                    (":due", n(self.now_ms())),
                    (":q", waiting(key.namespace())),
                    (":lk", list_key(ItemStatus::Failed, key)),
                ]);
                match self.update(key, WAITING, REPLAYABLE, vals, false).await? {
                    Updated::Done(_) => Ok(true),
                    // An ordered item: replayed with its queue.
                    Updated::Failed(Some(old))
                        if is_inbox_item(&self.inner.names, &old)
                            && old.contains_key(&self.inner.names.ordering_key) =>
                    {
                        self.replay_ordered(key, &old).await
                    }
                    // Not replayable; a stored value that does not decode is
                    // answered as corrupt, never as "no such item".
                    Updated::Failed(Some(old)) => {
                        decode_item(&self.inner.names, key, &old)?;
                        Ok(false)
                    }
                    Updated::Failed(None) => Ok(false),
                }
            })
            .await?;
        if replayed {
            self.inner.wakeups.raise(key.namespace());
        }
        Ok(replayed)
    }

    /// Four `Select=COUNT` queries of the items index (they read every index
    /// key of the namespace's items) and the first entry of the waiting
    /// partition of the due index.
    /// A marker item (`<namespace>|paused`) written unless it is there.
    async fn pause(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        self.bounded(async {
            let marker = HashMap::from([(
                self.inner.names.partition_key.clone(),
                pause_marker(namespace),
            )]);
            let written = self.put(marker, NO_MARKER, HashMap::new()).await?;
            Ok(matches!(written, Written::Won))
        })
        .await
    }

    /// The marker item deleted; `true` when it was there.
    async fn resume(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        let resumed = self
            .bounded(async {
                let out = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .key(&self.inner.names.partition_key, pause_marker(namespace))
                    .return_values(ReturnValue::AllOld)
                    .send()
                    .await
                    .map_err(|e| self.fail(e))?;
                Ok(out.attributes().is_some_and(|old| !old.is_empty()))
            })
            .await?;
        if resumed {
            self.inner.wakeups.raise(namespace);
        }
        Ok(resumed)
    }

    /// In this process only, and backing off while idle: DynamoDB has no
    /// notifications a worker could wait on (Streams are read by polling,
    /// billed per read), and every take is three billed queries and a read,
    /// so an idle worker looks less and less often, up to eight times its
    /// poll interval.
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        check_namespace(namespace)?;
        Ok(Wake::in_process(self.inner.wakeups.signal(namespace)).with_idle_backoff(true))
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        check_namespace(namespace)?;
        self.bounded(self.marked(namespace)).await
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        self.bounded(async {
            let (pending, running, failed, dead) = futures_util::try_join!(
                self.count(namespace, ItemStatus::Pending),
                self.count(namespace, ItemStatus::Running),
                self.count(namespace, ItemStatus::Failed),
                self.count(namespace, ItemStatus::Dead),
            )?;
            let (plain, ordered) = futures_util::try_join!(
                self.oldest(waiting(namespace)),
                self.oldest(ordered_waiting(namespace))
            )?;
            let oldest = plain.into_iter().chain(ordered).min();
            let count = |c: u64| i64::try_from(c).unwrap_or(i64::MAX);
            Ok(backend::stored_counts(
                count(pending),
                count(running),
                count(failed),
                count(dead),
                oldest,
            ))
        })
        .await
    }
}
