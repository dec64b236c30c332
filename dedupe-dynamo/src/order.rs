//! Per-key order on DynamoDB (CONTRACT.md I15).
//!
//! Each ordering key of a namespace has a queue item (partition key
//! `<namespace>|o|<ordering key>`: a `|` where a record's key has its `:`,
//! so no record, index or `record_keys` scan meets it) holding the entries
//! of its items in accept order (each the item's id and the nonce it was
//! accepted with), the entry last handed out, and a version.
//!
//! - **Accept** appends the item's entry in the transaction that puts the
//!   item, so the queue's order is the order the service settled the
//!   accepts in.
//! - **Take**: ordered items wait in a partition of the due index of their
//!   own (`<namespace>|o`), read `max + ORDER_SCAN` deep. For each ordering
//!   key among them the take reads the queue, then the items its front
//!   names (strongly consistent, 100 a request): an entry whose item is
//!   gone, done, accepted again since (another nonce) or dead past its
//!   retention is *finished*; a dead one accepted with `WhenDead::Skip` is
//!   *passed*; the first other one is the key's head. The head is handed out
//!   only when it is waiting and due and the entry last handed out is not
//!   running, in one transaction: the item's lease (conditioned on it being
//!   due, waiting, and the entry's nonce) and the queue rewritten without the
//!   finished entries before the head, with the head as the one handed out,
//!   on condition that the queue is still the version read.
//! - Nothing else writes the queue. Completing, failing, giving back,
//!   forgetting and expiring an item change the item only, and the next walk
//!   reads what they did; each of them only ever moves an entry towards
//!   finished. The one change that makes an entry block again, the replay of
//!   a dead item, raises the queue's version in the replay's transaction, so
//!   a take that read the item dead fails its condition.
//! - A held item past its lease is taken over from the due index's held
//!   partition as any other is, without the queue: it stays the one handed
//!   out, so nothing else of its key runs meanwhile.
//! - `expire()` drops the finished entries of every queue and deletes a
//!   queue with none left.
//!
//! Cost: an accept with an ordering key is a two-item transaction (twice a
//! put's write units); a take that meets ordered items reads their ordering
//! keys (one batch read), each key's queue (one read) and the items at its
//! front with the last one handed out (one batch read per 100 entries), and
//! hands out each head in a two-item transaction and a read.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{AttributeValue, KeysAndAttributes, Put, TransactWriteItem, Update};
use dedupe_core::backend::{self, duration_millis};
use dedupe_core::{Error, ItemStatus, Key, Result, Taken};

use crate::codec::{n, s, AttributeNames, Item};
use crate::error::is_condition_failure;
use crate::expressions::*;
use crate::inbox::{held, list_key};
use crate::store::DynamoStore;

/// Most entries one batch read of the walk asks for (`BatchGetItem`'s limit).
const READ_CHUNK: usize = 100;

/// Entries a take's walk reads first: a key's head is nearly always its
/// first entry or close behind (a take drops the finished ones in front), and
/// reading a hundred for it made an ordered take on DynamoDB Local 87 ms.
const FIRST_READ: usize = 4;

/// The partition key of `namespace`'s queue of `ordering_key`.
pub(crate) fn queue_pk(namespace: &str, ordering_key: &str) -> String {
    format!("{namespace}|o|{ordering_key}")
}

/// The due index's partition of `namespace`'s ordered items waiting.
pub(crate) fn ordered_waiting(namespace: &str) -> AttributeValue {
    s(&format!("{namespace}|o"))
}

/// An item's place in its key's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) id: String,
    pub(crate) nonce: String,
}

impl Entry {
    fn value(&self) -> AttributeValue {
        AttributeValue::M(HashMap::from([
            ("i".to_string(), s(&self.id)),
            ("n".to_string(), s(&self.nonce)),
        ]))
    }

    fn from_value(value: &AttributeValue) -> Option<Self> {
        let map = value.as_m().ok()?;
        Some(Self {
            id: map.get("i")?.as_s().ok()?.clone(),
            nonce: map.get("n")?.as_s().ok()?.clone(),
        })
    }

    fn pk(&self, namespace: &str) -> String {
        format!("{namespace}:{}", self.id)
    }
}

/// The holder of a queue none of whose items was handed out yet: as long
/// as a nonce, so that handing one out never makes the queue item larger.
pub(crate) const NOBODY: &str = "--------------------------------";

/// An ordering key's queue as read. Its version and holder are fixed-size
/// strings (a version is a fresh token, not a counter), so that every
/// rewrite of the queue after an accept is no larger than the queue the
/// accept left: an accept that fits under DynamoDB's 400 KB item limit
/// never leaves a queue its take cannot write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Queue {
    pub(crate) version: String,
    /// The nonce of the entry last handed out, or [`NOBODY`].
    pub(crate) holder: String,
    pub(crate) entries: Vec<Entry>,
}

impl Queue {
    /// The queue item as stored; anything malformed is corrupt (reported
    /// against `probe`, a key of the namespace).
    pub(crate) fn decode(names: &AttributeNames, probe: &Key, item: &Item) -> Result<Self> {
        let corrupt = |what: &str| {
            Error::corrupt(
                probe,
                format!("an ordering key's queue: {what} missing or malformed"),
            )
        };
        let version = match item.get(&names.order_version) {
            Some(AttributeValue::S(v)) => v.clone(),
            _ => return Err(corrupt("version")),
        };
        let holder = match item.get(&names.order_holder) {
            Some(AttributeValue::S(v)) => v.clone(),
            _ => return Err(corrupt("holder")),
        };
        let entries = match item.get(&names.order_queue) {
            None => Vec::new(),
            Some(AttributeValue::L(list)) => list
                .iter()
                .map(|v| Entry::from_value(v).ok_or_else(|| corrupt("entry")))
                .collect::<Result<_>>()?,
            Some(_) => return Err(corrupt("entries")),
        };
        Ok(Self {
            version,
            holder,
            entries,
        })
    }

    /// The queue item to write under `pk`.
    fn to_item(&self, names: &AttributeNames, pk: &str) -> Item {
        Item::from([
            (names.partition_key.clone(), s(pk)),
            (names.order_version.clone(), s(&self.version)),
            (names.order_holder.clone(), s(&self.holder)),
            (
                names.order_queue.clone(),
                AttributeValue::L(self.entries.iter().map(Entry::value).collect()),
            ),
        ])
    }

    /// The entry last handed out, while the queue holds it (once finished it
    /// is dropped, and runs no more).
    fn holder(&self) -> Option<&Entry> {
        self.entries.iter().find(|e| e.nonce == self.holder)
    }

    /// The queue after `head` is handed out: the entries at `finished` gone.
    fn handing_out(&self, head: usize, finished: &HashSet<usize>) -> Self {
        Self {
            version: backend::new_token().as_str().to_string(),
            holder: self.entries[head].nonce.clone(),
            entries: self.without(finished),
        }
    }

    /// The queue without the entries at `finished`, under a new version.
    fn pruned(&self, finished: &HashSet<usize>) -> Self {
        Self {
            version: backend::new_token().as_str().to_string(),
            holder: self.holder.clone(),
            entries: self.without(finished),
        }
    }

    fn without(&self, finished: &HashSet<usize>) -> Vec<Entry> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(i, _)| !finished.contains(i))
            .map(|(_, e)| e.clone())
            .collect()
    }
}

/// Where an entry stands, from its item as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Gone, done, accepted again, or dead past its retention: it never
    /// blocks again.
    Finished,
    /// Dead, accepted to be skipped.
    Passed,
    /// Held by a worker (past its lease or not).
    Running,
    /// Pending or failed and retrying, due at `due_ms`.
    Waiting { due_ms: i64 },
    /// Dead, blocking the rest.
    Dead,
}

/// The place of `entry` whose item was read as `item` (`None`: absent), at
/// `now`.
pub(crate) fn place(
    names: &AttributeNames,
    probe: &Key,
    entry: &Entry,
    item: Option<&Item>,
    now: i64,
) -> Result<Place> {
    let Some(item) = item else {
        return Ok(Place::Finished);
    };
    match item.get(&names.order_entry) {
        Some(AttributeValue::S(nonce)) if *nonce == entry.nonce => {}
        _ => return Ok(Place::Finished),
    }
    let corrupt = |what: &str| {
        Error::corrupt(
            probe,
            format!(
                "ordered item {:?}: attribute {what} missing or malformed",
                entry.id
            ),
        )
    };
    let num = |name: &str| -> Result<Option<i64>> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::N(v)) => v.parse().map(Some).map_err(|_| corrupt(name)),
            Some(_) => Err(corrupt(name)),
        }
    };
    Ok(match num(&names.wait)? {
        None => Place::Finished,
        Some(0) => Place::Running,
        Some(1) => Place::Waiting {
            due_ms: num(&names.deadline)?.ok_or_else(|| corrupt(&names.deadline))?,
        },
        Some(2) => match num(&names.dead_until)? {
            Some(until) if until <= now => Place::Finished,
            _ if item.contains_key(&names.order_skip) => Place::Passed,
            _ => Place::Dead,
        },
        Some(_) => return Err(corrupt(&names.wait)),
    })
}

/// What a walk of a queue found.
#[derive(Debug, Default)]
struct Walked {
    /// The entries found finished (all of them, or those before the head).
    finished: HashSet<usize>,
    /// The first entry neither finished nor passed, and its place.
    head: Option<(usize, Place)>,
    /// The entry last handed out is running.
    holder_running: bool,
}

/// An ordering key's next item, free to hand out.
pub(crate) struct Head {
    pub(crate) key: Key,
    pub(crate) entry: Entry,
    pub(crate) due_ms: i64,
    pk: String,
    read: String,
    next: Queue,
}

impl DynamoStore {
    /// Strongly consistent reads of the items under `pks` (repeats asked
    /// once), 100 a request, the service's unprocessed keys asked again;
    /// with `projection`, only those attributes.
    pub(crate) async fn read_pks(
        &self,
        pks: &[String],
        projection: Option<&'static str>,
    ) -> Result<HashMap<String, Item>> {
        let names = &self.inner.names;
        let mut unique: Vec<&String> = Vec::with_capacity(pks.len());
        let mut seen = HashSet::with_capacity(pks.len());
        for pk in pks {
            if seen.insert(pk) {
                unique.push(pk);
            }
        }
        let mut found = HashMap::new();
        for chunk in unique.chunks(READ_CHUNK) {
            let mut pending = Some(
                KeysAndAttributes::builder()
                    .set_keys(Some(
                        chunk
                            .iter()
                            .map(|pk| HashMap::from([(names.partition_key.clone(), s(pk))]))
                            .collect(),
                    ))
                    .consistent_read(true)
                    .set_projection_expression(projection.map(str::to_string))
                    .set_expression_attribute_names(projection.and_then(|p| self.names(&[p])))
                    .build()
                    .map_err(|e| Error::config(e.to_string()))?,
            );
            let mut rounds = 0;
            while let Some(ask) = pending.take() {
                rounds += 1;
                if rounds > 8 {
                    return Err(Error::retryable(
                        "the service kept keys of a batch read unprocessed; retry",
                        None,
                    ));
                }
                let out = self
                    .inner
                    .client
                    .batch_get_item()
                    .request_items(&self.inner.table, ask)
                    .send()
                    .await
                    .map_err(|e| self.fail(e))?;
                for item in out
                    .responses()
                    .and_then(|r| r.get(&self.inner.table))
                    .into_iter()
                    .flatten()
                {
                    if let Some(AttributeValue::S(pk)) = item.get(&names.partition_key) {
                        found.insert(pk.clone(), item.clone());
                    }
                }
                pending = out
                    .unprocessed_keys()
                    .and_then(|u| u.get(&self.inner.table))
                    .filter(|k| !k.keys().is_empty())
                    .cloned();
                if pending.is_some() {
                    tokio::time::sleep(Duration::from_millis(20 << rounds.min(4))).await;
                }
            }
        }
        Ok(found)
    }

    /// The queue stored under `pk`, read strongly consistent.
    async fn queue(&self, probe: &Key, pk: &str) -> Result<Option<Queue>> {
        let out = self
            .inner
            .client
            .get_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, s(pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.fail(e))?;
        match out.item() {
            Some(item) if !item.is_empty() => {
                Queue::decode(&self.inner.names, probe, item).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Reads the items `queue` names, 100 at a time with the one last
    /// handed out, and places each, up to its head (`whole`: every entry).
    async fn walk(&self, probe: &Key, queue: &Queue, now: i64, whole: bool) -> Result<Walked> {
        let namespace = probe.namespace();
        let names = &self.inner.names;
        let mut walked = Walked::default();
        let mut start = 0;
        while start < queue.entries.len() {
            let read = match (start, whole) {
                (0, false) => FIRST_READ,
                _ => READ_CHUNK,
            };
            let end = (start + read).min(queue.entries.len());
            let chunk = &queue.entries[start..end];
            let mut pks: Vec<String> = chunk.iter().map(|e| e.pk(namespace)).collect();
            let holder = queue.holder().filter(|_| start == 0);
            if let Some(holder) = holder {
                pks.push(holder.pk(namespace));
            }
            let items = self.read_pks(&pks, Some(ORDER_PROJECTION)).await?;
            if let Some(holder) = holder {
                let read = items.get(&holder.pk(namespace));
                walked.holder_running = place(names, probe, holder, read, now)? == Place::Running;
                if walked.holder_running && !whole {
                    return Ok(walked);
                }
            }
            for (offset, entry) in chunk.iter().enumerate() {
                let index = start + offset;
                match place(names, probe, entry, items.get(&entry.pk(namespace)), now)? {
                    Place::Finished => {
                        walked.finished.insert(index);
                    }
                    Place::Passed => {}
                    other => {
                        walked.head.get_or_insert((index, other));
                        if !whole {
                            return Ok(walked);
                        }
                    }
                }
            }
            start = end;
        }
        Ok(walked)
    }

    /// Writes `queue` over the version `read` (`None`: deletes it); `false`
    /// when it changed since.
    async fn rewrite(&self, pk: &str, read: &str, queue: Option<&Queue>) -> Result<bool> {
        let condition_failed = match queue {
            Some(queue) => match self
                .inner
                .client
                .put_item()
                .table_name(&self.inner.table)
                .set_item(Some(queue.to_item(&self.inner.names, pk)))
                .condition_expression(QUEUE_UNCHANGED)
                .set_expression_attribute_names(self.names(&[QUEUE_UNCHANGED]))
                .expression_attribute_values(":v", s(read))
                .send()
                .await
            {
                Ok(_) => false,
                Err(e) if is_condition_failure(&e) => true,
                Err(e) => return Err(self.fail(e)),
            },
            None => match self
                .inner
                .client
                .delete_item()
                .table_name(&self.inner.table)
                .key(&self.inner.names.partition_key, s(pk))
                .condition_expression(QUEUE_UNCHANGED)
                .set_expression_attribute_names(self.names(&[QUEUE_UNCHANGED]))
                .expression_attribute_values(":v", s(read))
                .send()
                .await
            {
                Ok(_) => false,
                Err(e) if is_condition_failure(&e) => true,
                Err(e) => return Err(self.fail(e)),
            },
        };
        Ok(!condition_failed)
    }

    /// The next item of `ordering_key`, when it is free to hand out; a
    /// queue found with finished entries in front of a blocked head is
    /// rewritten without them (the next walk reads less).
    async fn head_of(&self, probe: &Key, ordering_key: &str, now: i64) -> Result<Option<Head>> {
        let pk = queue_pk(probe.namespace(), ordering_key);
        let Some(queue) = self.queue(probe, &pk).await? else {
            return Ok(None);
        };
        let walked = self.walk(probe, &queue, now, false).await?;
        if !walked.holder_running {
            if let Some((index, Place::Waiting { due_ms })) = walked.head {
                if due_ms <= now {
                    let entry = queue.entries[index].clone();
                    let key = Key::new(probe.namespace(), &entry.id)
                        .map_err(|e| Error::corrupt(probe, e.to_string()))?;
                    return Ok(Some(Head {
                        key,
                        due_ms,
                        next: queue.handing_out(index, &walked.finished),
                        entry,
                        pk,
                        read: queue.version,
                    }));
                }
            }
        }
        if !walked.finished.is_empty() {
            let pruned = queue.pruned(&walked.finished);
            self.rewrite(&pk, &queue.version, Some(&pruned)).await?;
        }
        Ok(None)
    }

    /// The heads free to hand out among the ordered items `found` due (the
    /// due index's ordered partition), at most `max`, one per ordering key,
    /// earliest due first; each key's error in its place.
    pub(crate) async fn ordered_heads(
        &self,
        probe: &Key,
        found: &[(i64, Item)],
        now: i64,
        max: usize,
    ) -> Result<Vec<Result<Head>>> {
        use futures_util::StreamExt;
        let names = &self.inner.names;
        let pks: Vec<String> = found
            .iter()
            .filter_map(|(_, entry)| match entry.get(&names.partition_key) {
                Some(AttributeValue::S(pk)) => Some(pk.clone()),
                _ => None,
            })
            .collect();
        // The window in waves, earliest due first: the ordering keys of the
        // next few candidates read, then walked a few at a time, as many
        // as heads are still wanted, twice as many each wave (a held or
        // blocked key is passed over to the keys behind it); a take of one
        // from a window of 64 free keys reads one queue, not 64.
        let mut heads = Vec::new();
        let mut found = 0;
        let mut walked: HashSet<String> = HashSet::new();
        let mut read = 0;
        let mut wave = max;
        while found < max && read < pks.len() {
            let upto = (read + wave + FIRST_READ).min(pks.len());
            let items = self
                .read_pks(&pks[read..upto], Some(ORDER_PROJECTION))
                .await?;
            let mut keys: Vec<String> = Vec::new();
            for pk in &pks[read..upto] {
                if let Some(AttributeValue::S(ordering_key)) =
                    items.get(pk).and_then(|item| item.get(&names.ordering_key))
                {
                    if walked.insert(ordering_key.clone()) {
                        keys.push(ordering_key.clone());
                    }
                }
            }
            read = upto;
            let mut walks = futures_util::stream::iter(keys)
                .map(|ordering_key| async move { self.head_of(probe, &ordering_key, now).await })
                .buffered((max - found).clamp(1, self.inner.fan_out));
            while let Some(head) = walks.next().await {
                match head {
                    Ok(None) => {}
                    Ok(Some(head)) => {
                        heads.push(Ok(head));
                        found += 1;
                        if found == max {
                            break;
                        }
                    }
                    Err(e) => heads.push(Err(e)),
                }
            }
            wave = (wave * 2).min(READ_CHUNK);
        }
        Ok(heads)
    }

    /// Hands `head` out for `lease` in one transaction with its queue; the
    /// item read back after it (the answer of a transaction that committed
    /// may be lost: the token read back says whose it is).
    pub(crate) async fn lease_head(
        &self,
        namespace: &str,
        head: Head,
        lease: Duration,
    ) -> Result<Option<Taken>> {
        let names = &self.inner.names;
        let now = self.now_ms();
        let token = backend::new_token();
        let leased = Update::builder()
            .table_name(&self.inner.table)
            .key(&names.partition_key, crate::codec::partition_key(&head.key))
            .update_expression(LEASE)
            .condition_expression(DUE_ORDERED)
            .set_expression_attribute_names(self.names(&[LEASE, DUE_ORDERED]))
            .set_expression_attribute_values(Some(HashMap::from([
                (":now".to_string(), n(now)),
                (":tk".to_string(), s(token.as_str())),
                (
                    ":until".to_string(),
                    n(now.saturating_add(duration_millis(lease))),
                ),
                (":one".to_string(), n(1)),
                (":zero".to_string(), n(0)),
                (":q".to_string(), held(namespace)),
                (":lk".to_string(), list_key(ItemStatus::Running, &head.key)),
                (":oe".to_string(), s(&head.entry.nonce)),
            ])))
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        let queue = Put::builder()
            .table_name(&self.inner.table)
            .set_item(Some(head.next.to_item(names, &head.pk)))
            .condition_expression(QUEUE_UNCHANGED)
            .set_expression_attribute_names(self.names(&[QUEUE_UNCHANGED]))
            .expression_attribute_values(":v", s(&head.read))
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        let sent = self
            .transact_pair(
                TransactWriteItem::builder().update(leased).build(),
                TransactWriteItem::builder().put(queue).build(),
            )
            .await;
        let cancelled = match &sent {
            Ok(_) => false,
            Err(e) => matches!(
                e.as_service_error(),
                Some(TransactWriteItemsError::TransactionCanceledException(_))
            ),
        };
        let item = self.read(&head.key).await?;
        let ours = item.as_ref().is_some_and(|item| {
            matches!(item.get(&names.token), Some(AttributeValue::S(t)) if t == token.as_str())
        });
        match (ours, item, sent) {
            (true, Some(item), _) => self.taken(head.key, &item).map(Some),
            (_, _, Err(e)) if !cancelled => Err(self.fail(e)),
            _ => Ok(None),
        }
    }

    /// An item's write and its queue's, as one transaction.
    async fn transact_pair(
        &self,
        item: TransactWriteItem,
        queue: TransactWriteItem,
    ) -> std::result::Result<
        aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsOutput,
        aws_sdk_dynamodb::error::SdkError<
            TransactWriteItemsError,
            aws_sdk_dynamodb::config::http::HttpResponse,
        >,
    > {
        self.inner
            .client
            .transact_write_items()
            .transact_items(item)
            .transact_items(queue)
            .send()
            .await
    }

    /// The write that appends `key`'s entry (`nonce`) to its ordering key's
    /// queue, created if missing: a part of the accept's transaction.
    pub(crate) fn queue_append(
        &self,
        key: &Key,
        ordering_key: &str,
        nonce: &str,
    ) -> Result<TransactWriteItem> {
        let entry = Entry {
            id: key.id().to_string(),
            nonce: nonce.to_string(),
        };
        let update = Update::builder()
            .table_name(&self.inner.table)
            .key(
                &self.inner.names.partition_key,
                s(&queue_pk(key.namespace(), ordering_key)),
            )
            .update_expression(QUEUE_APPEND)
            .set_expression_attribute_names(self.names(&[QUEUE_APPEND]))
            .expression_attribute_values(":empty", AttributeValue::L(Vec::new()))
            .expression_attribute_values(":entry", AttributeValue::L(vec![entry.value()]))
            .expression_attribute_values(":v", s(backend::new_token().as_str()))
            .expression_attribute_values(":nobody", s(NOBODY))
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        Ok(TransactWriteItem::builder().update(update).build())
    }

    /// The replay of an ordered item read as `old` (dead or failed): made
    /// due now in one transaction with a new version of its queue, on
    /// condition that the queue still holds its entry (the version read). An
    /// item whose entry a walk dropped (dead past its retention, by the
    /// walker's clock) is not replayed: `false`, as for an item removed.
    pub(crate) async fn replay_ordered(&self, key: &Key, old: &Item) -> Result<bool> {
        let names = &self.inner.names;
        let (Some(AttributeValue::S(ordering_key)), Some(AttributeValue::S(nonce))) =
            (old.get(&names.ordering_key), old.get(&names.order_entry))
        else {
            return Err(Error::corrupt(
                key,
                "an ordered item without its ordering key or entry",
            ));
        };
        let pk = queue_pk(key.namespace(), ordering_key);
        for round in 0..CLAIM_ROUNDS {
            let Some(queue) = self.queue(key, &pk).await? else {
                return Ok(false);
            };
            if !queue.entries.iter().any(|e| e.nonce == *nonce) {
                return Ok(false);
            }
            let now = self.now_ms();
            let item = Update::builder()
                .table_name(&self.inner.table)
                .key(&names.partition_key, crate::codec::partition_key(key))
                .update_expression(WAITING)
                .condition_expression(REPLAYABLE_ORDERED)
                .set_expression_attribute_names(self.names(&[WAITING, REPLAYABLE_ORDERED]))
                .set_expression_attribute_values(Some(HashMap::from([
                    (":one".to_string(), n(1)),
                    (":two".to_string(), n(2)),
                    (":due".to_string(), n(now)),
                    (":now".to_string(), n(now)),
                    (":q".to_string(), ordered_waiting(key.namespace())),
                    (":lk".to_string(), list_key(ItemStatus::Failed, key)),
                    (":oe".to_string(), s(nonce)),
                ])))
                .build()
                .map_err(|e| Error::config(e.to_string()))?;
            let renewed = Update::builder()
                .table_name(&self.inner.table)
                .key(&names.partition_key, s(&pk))
                .update_expression(QUEUE_RENEW)
                .condition_expression(QUEUE_UNCHANGED)
                .set_expression_attribute_names(self.names(&[QUEUE_RENEW, QUEUE_UNCHANGED]))
                .expression_attribute_values(":v", s(&queue.version))
                .expression_attribute_values(":new", s(backend::new_token().as_str()))
                .build()
                .map_err(|e| Error::config(e.to_string()))?;
            let sent = self
                .transact_pair(
                    TransactWriteItem::builder().update(item).build(),
                    TransactWriteItem::builder().update(renewed).build(),
                )
                .await;
            let e = match sent {
                Ok(_) => return Ok(true),
                Err(e) => e,
            };
            let Some(TransactWriteItemsError::TransactionCanceledException(cancelled)) =
                e.as_service_error()
            else {
                return Err(self.fail(e));
            };
            let code = |i: usize| {
                cancelled
                    .cancellation_reasons()
                    .get(i)
                    .and_then(|r| r.code())
                    .unwrap_or("None")
                    .to_string()
            };
            if code(0) == "ConditionalCheckFailed" {
                return Ok(false);
            }
            // The queue changed since it was read, or a conflict: read again.
            tokio::time::sleep(Duration::from_millis(5 << round.min(5))).await;
        }
        Err(Error::retryable(
            "the item or its queue kept changing under the replay; retry",
            None,
        ))
    }

    /// `expire()`'s part: the queue under `pk` without its finished
    /// entries, deleted when none is left. `false` when it changed under
    /// the walk (the next `expire()` looks again).
    pub(crate) async fn collect_queue(&self, pk: &str) -> Result<bool> {
        let Some(namespace) = pk.split_once('|').map(|(ns, _)| ns) else {
            return Ok(false);
        };
        let probe = Key::new(namespace, "-")
            .map_err(|e| Error::config(format!("a queue item {pk:?}: {e}")))?;
        let Some(queue) = self.queue(&probe, pk).await? else {
            return Ok(false);
        };
        let walked = self.walk(&probe, &queue, self.now_ms(), true).await?;
        if walked.finished.is_empty() {
            return Ok(true);
        }
        let next = Some(queue.pruned(&walked.finished)).filter(|q| !q.entries.is_empty());
        self.rewrite(pk, &queue.version, next.as_ref()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, nonce: &str) -> Entry {
        Entry {
            id: id.into(),
            nonce: nonce.into(),
        }
    }

    fn item(pairs: &[(&str, AttributeValue)]) -> Item {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn a_queue_reads_back_as_written_and_malformed_ones_are_corrupt() {
        let names = AttributeNames::default();
        let probe = Key::new("ns", "-").expect("key");
        let queue = Queue {
            version: "v1".into(),
            holder: "n1".into(),
            entries: vec![entry("a", "n1"), entry("b", "n2")],
        };
        let stored = queue.to_item(&names, "ns|o|cus_1");
        assert_eq!(
            Queue::decode(&names, &probe, &stored).expect("decodes"),
            queue
        );
        let mut broken = stored.clone();
        broken.insert("oq".into(), AttributeValue::L(vec![s("a")]));
        assert!(matches!(
            Queue::decode(&names, &probe, &broken),
            Err(Error::CorruptRecord { .. })
        ));
        let mut broken = stored;
        broken.remove("ov");
        assert!(matches!(
            Queue::decode(&names, &probe, &broken),
            Err(Error::CorruptRecord { .. })
        ));
    }

    #[test]
    fn each_item_state_has_its_place() {
        let names = AttributeNames::default();
        let probe = Key::new("ns", "-").expect("key");
        let e = entry("a", "n1");
        let at = |pairs: &[(&str, AttributeValue)]| {
            place(&names, &probe, &e, Some(&item(pairs)), 1_000).expect("places")
        };
        assert_eq!(
            place(&names, &probe, &e, None, 1_000).expect("places"),
            Place::Finished
        );
        // Accepted again since: another nonce.
        assert_eq!(
            at(&[("oe", s("n2")), ("wt", n(1)), ("dl", n(5))]),
            Place::Finished
        );
        // Done: no wait.
        assert_eq!(at(&[("oe", s("n1")), ("st", n(1))]), Place::Finished);
        assert_eq!(at(&[("oe", s("n1")), ("wt", n(0))]), Place::Running);
        assert_eq!(
            at(&[("oe", s("n1")), ("wt", n(1)), ("dl", n(5))]),
            Place::Waiting { due_ms: 5 }
        );
        assert_eq!(at(&[("oe", s("n1")), ("wt", n(2))]), Place::Dead);
        assert_eq!(
            at(&[("oe", s("n1")), ("wt", n(2)), ("du", n(2_000))]),
            Place::Dead
        );
        assert_eq!(
            at(&[("oe", s("n1")), ("wt", n(2)), ("du", n(1_000))]),
            Place::Finished
        );
        assert_eq!(
            at(&[("oe", s("n1")), ("wt", n(2)), ("os", n(1))]),
            Place::Passed
        );
        assert!(matches!(
            place(
                &names,
                &probe,
                &e,
                Some(&item(&[("oe", s("n1")), ("wt", n(7))])),
                1_000
            ),
            Err(Error::CorruptRecord { .. })
        ));
    }

    #[test]
    fn handing_out_drops_the_finished_entries_and_names_the_head() {
        let queue = Queue {
            version: "v".into(),
            holder: "1".into(),
            entries: vec![entry("a", "1"), entry("b", "2"), entry("c", "3")],
        };
        assert_eq!(queue.holder(), Some(&entry("a", "1")));
        let next = queue.handing_out(1, &HashSet::from([0]));
        assert_ne!(next.version, queue.version);
        assert_eq!(next.version.len(), NOBODY.len(), "versions are fixed-size");
        assert_eq!(next.holder, "2");
        assert_eq!(next.entries, vec![entry("b", "2"), entry("c", "3")]);
        // The holder finished: dropped, it is no one's.
        let pruned = Queue {
            holder: "1".into(),
            ..next.pruned(&HashSet::from([]))
        }
        .pruned(&HashSet::from([]));
        assert_eq!(pruned.holder(), None);
    }
}
