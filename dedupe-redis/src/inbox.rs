//! The inbox on Redis: an item is its key's record (`i2:`, no TTL), and each
//! namespace keeps three index keys beside the records, written by the same
//! script that writes the item, in the same atomic step:
//!
//! - `<base>|wait`, a sorted set of the pending and failed items scored by
//!   their due time, and `<base>|held`, of the running items scored by their
//!   lease's deadline: a take reads the first due of each (`ZRANGEBYSCORE
//!   -inf now LIMIT 0 max`, O(log n + max)), merges them by score and leases
//!   each in the same script, so no two takers ever get one item;
//! - `<base>|ids`, every item as `<status>:<id>` at score 0: a page of a
//!   status is one `ZRANGEBYLEX` from the cursor (O(log n + page)), a count
//!   one `ZLEXCOUNT` (O(log n)).
//!
//! Each item has two index entries. On a Cluster the records and the index must share a slot: the
//! store needs [`namespace_hash_tags`](crate::RedisBuilder::namespace_hash_tags)
//! (a namespace's keys then live on one node), and refuses the inbox without.

use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::backend::{self, check_ttl, duration_millis, new_tokens, StoredTaken};
use dedupe_core::backend::{accept_columns, check_accept, check_take, cut_error, StoredCounts};
use dedupe_core::{
    AcceptOptions, Accepted, Error, Inbox, InboxCounts, Item, ItemPage, ItemQuery, ItemStatus, Key,
    Lease, Result, Retry, Taken, Wake, WhenDead,
};
use redis::Value;

use crate::codec;
use crate::ops::parts;
use crate::scripts::SCRIPTS;
use crate::store::RedisStore;

/// The status letters of the `ids` index, in the order of [`InboxCounts`].
const STATUSES: [(ItemStatus, char); 4] = [
    (ItemStatus::Pending, 'p'),
    (ItemStatus::Running, 'r'),
    (ItemStatus::Failed, 'f'),
    (ItemStatus::Dead, 'd'),
];

impl RedisStore {
    /// The index keys of `namespace`, or the configuration error of a Cluster
    /// store without hash tags.
    fn inbox_keys(&self, namespace: &str) -> Result<[String; 6]> {
        self.index_keys(namespace).ok_or_else(|| {
            Error::config(
                "the inbox on a Redis Cluster needs namespace_hash_tags(true) (URL: \
                 ?namespace_hash_tags=true), so a namespace's items and their index share a slot",
            )
        })
    }

    /// An invocation on one item: its record key and the namespace's index.
    fn item_invocation<'s>(
        &self,
        script: &'s redis::Script,
        key: &Key,
    ) -> Result<redis::ScriptInvocation<'s>> {
        let index = self.inbox_keys(key.namespace())?;
        let mut invocation = script.prepare_invoke();
        invocation.key(self.record_key(key));
        for k in index {
            invocation.key(k);
        }
        invocation.arg(key.id());
        Ok(invocation)
    }

    /// The namespace's pause key (`<base>|paused`, I13), in its index's
    /// slot.
    fn paused_key(&self, namespace: &str) -> Result<String> {
        self.inbox_keys(namespace)?;
        Ok(format!("{}|paused", self.namespace_base(namespace)))
    }

    /// Runs a pause script on the namespace's pause key (a write waits for
    /// the replicas asked for): its 0 or 1.
    async fn pause_script(
        &self,
        script: &redis::Script,
        namespace: &str,
        what: &str,
        writes: bool,
    ) -> Result<bool> {
        // The namespace checked as a key's would be.
        let probe = Key::new(namespace, "-")?;
        let mut invocation = script.prepare_invoke();
        invocation
            .key(self.paused_key(namespace)?)
            .arg(self.wake_channel.as_str())
            .arg(namespace);
        let answer = if writes {
            let (answer, acked) = self.write(invocation, &probe).await?;
            self.replicated(acked, what, &format!("{what} again"))?;
            answer
        } else {
            self.run(invocation, &probe).await?
        };
        match Self::code(answer, &probe, what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Self::unexpected(&probe, what)),
        }
    }

    /// The script's integer answer.
    fn code(answer: Value, key: &Key, what: &str) -> Result<i64> {
        match parts(answer) {
            Some((code, _)) => Ok(code),
            None => Err(Self::unexpected(key, what)),
        }
    }
}

fn bulk(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Each script is one round trip that decides on Redis' clock and writes the
/// item and its index together; the writes wait for replicas as claims do
/// ([`wait_for_replicas`](crate::RedisBuilder::wait_for_replicas)).
#[async_trait]
impl Inbox for RedisStore {
    async fn accept_with(
        &self,
        key: &Key,
        payload: &[u8],
        options: &AcceptOptions,
    ) -> Result<Accepted> {
        check_accept(payload, options)?;
        let (delay, max_attempts) = accept_columns(options);
        let token = new_tokens(1).remove(0);
        let mut invocation = self.item_invocation(&SCRIPTS.accept, key)?;
        invocation
            .arg(payload)
            .arg(token.as_str())
            .arg(delay)
            .arg(max_attempts.map_or_else(|| "-".to_string(), |m| m.to_string()))
            .arg(self.wake_channel.as_str())
            .arg(key.namespace())
            .arg(options.ordering_key.as_deref().unwrap_or(""))
            .arg(
                if options.ordering_key.is_some() && options.when_dead == WhenDead::Skip {
                    "1"
                } else {
                    "0"
                },
            );
        let (answer, acked) = self.write(invocation, key).await?;
        match parts(answer) {
            Some((1, None)) => {
                self.replicated(
                    acked,
                    "accept",
                    "accept again (it answers the item it finds, which this accept stored)",
                )?;
                Ok(Accepted::New)
            }
            Some((2, Some(value))) => match codec::decode_item(key, &value)? {
                Some(item) => Ok(Accepted::Item(item)),
                None => Err(Self::unexpected(key, "accept")),
            },
            Some((3, Some(value))) => Ok(backend::accepted_over(codec::decode(key, &value)?)),
            Some((-1, value)) => {
                codec::decode(key, &value.unwrap_or_default())?;
                Err(Error::corrupt(key, "not a dedupe record"))
            }
            _ => Err(Self::unexpected(key, "accept")),
        }
    }

    async fn take(&self, namespace: &str, max: usize, lease: Duration) -> Result<Vec<Taken>> {
        check_take(max, lease)?;
        let [wait, held, ids, dead, ord, _] = self.inbox_keys(namespace)?;
        let probe = Key::new(namespace, "-").map_err(|e| Error::config(e.to_string()))?;
        let mut invocation = SCRIPTS.take.prepare_invoke();
        invocation
            .key(wait)
            .key(held)
            .key(ids)
            .key(self.paused_key(namespace)?)
            .key(dead)
            .key(ord)
            .arg(self.record_base(namespace))
            .arg(max)
            .arg(duration_millis(lease));
        for token in new_tokens(max) {
            invocation.arg(token.as_str());
        }
        let (answer, acked) = self.write(invocation, &probe).await?;
        let Value::Array(values) = answer else {
            return Err(Self::unexpected(&probe, "take"));
        };
        let corrupt = match values.first() {
            Some(Value::Int(n)) => {
                usize::try_from(*n).map_err(|_| Self::unexpected(&probe, "take"))?
            }
            _ => return Err(Self::unexpected(&probe, "take")),
        };
        if values.len() < 1 + corrupt || (values.len() - 1 - corrupt) % 10 != 0 {
            return Err(Self::unexpected(&probe, "take"));
        }
        for id in &values[1..1 + corrupt] {
            // Left in place, not handed out, and not in the way of the
            // others: an operator removes it (`DEL` of its key).
            tracing::error!(
                namespace,
                id = text(id).unwrap_or_default(),
                "an inbox item that does not decode; left in place for an operator"
            );
        }
        let values = &values[1 + corrupt..];
        let taken = values
            .chunks_exact(10)
            .map(|v| {
                let bad = || Self::unexpected(&probe, "take");
                let key = Key::new(namespace, text(&v[0]).ok_or_else(bad)?)
                    .map_err(|e| Error::corrupt(&probe, format!("an index entry: {e}")))?;
                let token = text(&v[1]).ok_or_else(bad)?;
                let deadline = text(&v[2])
                    .and_then(|t| t.parse::<i64>().ok())
                    .ok_or_else(bad)?;
                let Value::Int(attempt) = v[3] else {
                    return Err(bad());
                };
                let payload = bulk(&v[4]).map(<[u8]>::to_vec);
                let last_error = match &v[5] {
                    Value::Nil => None,
                    other => Some(text(other).ok_or_else(bad)?),
                };
                let counts = StoredCounts {
                    takeovers: text(&v[6])
                        .and_then(|t| t.parse::<i64>().ok())
                        .ok_or_else(bad)?,
                    max_attempts: match text(&v[7]).ok_or_else(bad)?.as_str() {
                        "-" => None,
                        limit => Some(limit.parse::<i64>().map_err(|_| bad())?),
                    },
                };
                let accepted = text(&v[8])
                    .and_then(|t| t.parse::<i64>().ok())
                    .ok_or_else(bad)?;
                let ordering_key = match text(&v[9]).ok_or_else(bad)? {
                    key if key.is_empty() => None,
                    key => Some(key),
                };
                StoredTaken {
                    token,
                    deadline_ms: deadline,
                    attempt,
                    accepted_ms: accepted,
                    last_error,
                    payload,
                    counts,
                    ordering_key,
                }
                .decode(key)
            })
            .collect::<Result<Vec<_>>>()?;
        if !taken.is_empty() {
            // The items are leased on the primary; an error here would keep
            // them from every worker for their whole lease. They are handed
            // out: a failover that loses the take hands them out again, as a
            // lease that passed would.
            if let Err(e) = self.replicated(acked, "take", "the items are handed out anyway") {
                tracing::warn!(namespace, error = %e, "a take reached fewer replicas than asked");
            }
        }
        Ok(taken)
    }

    async fn snooze(&self, lease: &Lease, delay: Duration) -> Result<()> {
        check_ttl("snooze delay", delay)?;
        let mut invocation = self.item_invocation(&SCRIPTS.snooze, &lease.key)?;
        invocation
            .arg(lease.token.as_str())
            .arg(duration_millis(delay).to_string());
        let (answer, acked) = self.write(invocation, &lease.key).await?;
        match Self::code(answer, &lease.key, "snooze")? {
            1 => self.replicated(acked, "snooze", "snooze again (it answers Ok again)"),
            0 => Err(Error::lease_lost(&lease.key)),
            -2 => Err(Error::config(
                "snooze is for inbox items; a claim is released instead",
            )),
            -1 => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "snooze")),
        }
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: Retry) -> Result<()> {
        retry.validate()?;
        let (delay, keep) = match retry {
            Retry::After(delay) => (duration_millis(delay).to_string(), String::new()),
            Retry::Dead { keep } => (
                String::new(),
                keep.map(|keep| duration_millis(keep).to_string())
                    .unwrap_or_default(),
            ),
        };
        let mut invocation = self.item_invocation(&SCRIPTS.fail, &lease.key)?;
        invocation
            .arg(lease.token.as_str())
            .arg(cut_error(error))
            .arg(delay)
            .arg(keep)
            .arg(dedupe_core::ERROR_HISTORY);
        let (answer, acked) = self.write(invocation, &lease.key).await?;
        match Self::code(answer, &lease.key, "fail")? {
            1 => self.replicated(acked, "failure", "fail again (it answers Ok again)"),
            0 => Err(Error::lease_lost(&lease.key)),
            -2 => Err(Error::config(
                "fail is for inbox items; a claim is released instead",
            )),
            -1 => Err(Error::corrupt(&lease.key, "not a dedupe record")),
            _ => Err(Self::unexpected(&lease.key, "fail")),
        }
    }

    async fn item(&self, key: &Key) -> Result<Option<Item>> {
        let invocation = SCRIPTS.get.key(self.record_key(key));
        match parts(self.run(invocation, key).await?) {
            Some((1, Some(value))) => codec::decode_item(key, &value),
            Some((0, _)) => Ok(None),
            Some((-1, value)) => {
                codec::decode_item(key, &value.unwrap_or_default())?;
                Err(Error::corrupt(key, "not a dedupe record"))
            }
            _ => Err(Self::unexpected(key, "get")),
        }
    }

    /// Two reads: the ids of the page from the `ids` index (up to `limit +
    /// 1` of each status asked, merged in id order here), then their items.
    /// An item that changed status between the two is shown as it is now,
    /// and left out when it no longer matches the filter.
    async fn list(&self, query: &ItemQuery) -> Result<ItemPage> {
        query.validate()?;
        let [_, _, ids, ..] = self.inbox_keys(&query.namespace)?;
        let probe = Key::new(&query.namespace, "-").map_err(|e| Error::config(e.to_string()))?;
        let letters: String = STATUSES
            .iter()
            .filter(|(s, _)| query.status.is_none_or(|q| q == *s))
            .map(|(_, c)| *c)
            .collect();
        let mut invocation = SCRIPTS.list.prepare_invoke();
        invocation
            .key(&ids)
            .arg(letters)
            .arg(query.after.as_deref().unwrap_or(""))
            .arg(query.limit + 1);
        let Value::Array(members) = self.run(invocation, &probe).await? else {
            return Err(Self::unexpected(&probe, "list"));
        };
        let mut found: Vec<Vec<u8>> = members
            .iter()
            .map(|m| {
                bulk(m)
                    .and_then(|m| m.get(2..))
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| Self::unexpected(&probe, "list"))
            })
            .collect::<Result<_>>()?;
        // Redis orders a set's members byte by byte, as this sort does.
        found.sort();
        found.dedup();
        let more = found.len() > query.limit;
        found.truncate(query.limit);
        if found.is_empty() {
            return Ok(ItemPage::new(Vec::new(), None));
        }
        let mut invocation = SCRIPTS.values.prepare_invoke();
        invocation.key(&ids).arg(self.record_base(&query.namespace));
        for id in &found {
            invocation.arg(id.as_slice());
        }
        let Value::Array(values) = self.run(invocation, &probe).await? else {
            return Err(Self::unexpected(&probe, "list"));
        };
        if values.len() != found.len() {
            return Err(Self::unexpected(&probe, "list"));
        }
        let mut items = Vec::with_capacity(found.len());
        for (id, value) in found.iter().zip(&values) {
            let id = String::from_utf8(id.clone())
                .map_err(|_| Error::corrupt(&probe, "an index entry that is not UTF-8"))?;
            let key = Key::new(&query.namespace, &id)
                .map_err(|e| Error::corrupt(&probe, format!("an index entry: {e}")))?;
            let Some(value) = bulk(value) else {
                continue;
            };
            if let Some(item) = codec::decode_item(&key, value)? {
                if query.status.is_none_or(|s| s == item.status) {
                    items.push(item);
                }
            }
        }
        let next = more.then(|| {
            found
                .last()
                .map(|id| String::from_utf8_lossy(id).into_owned())
        });
        Ok(ItemPage::new(items, next.flatten()))
    }

    async fn forget_if(
        &self,
        key: &Key,
        status: dedupe_core::ItemStatus,
        attempts: u32,
    ) -> Result<bool> {
        let mut invocation = self.item_invocation(&SCRIPTS.forget_if, key)?;
        invocation
            .arg(dedupe_core::backend::status_code(Some(status)))
            .arg(attempts);
        let (answer, acked) = self.write(invocation, key).await?;
        match Self::code(answer, key, "forget_if")? {
            1 => {
                self.replicated(acked, "forget", "retry the forget")?;
                Ok(true)
            }
            0 => Ok(false),
            -1 => Err(Error::corrupt(key, "not a dedupe record")),
            _ => Err(Self::unexpected(key, "forget_if")),
        }
    }

    async fn replay(&self, key: &Key) -> Result<bool> {
        let mut invocation = self.item_invocation(&SCRIPTS.replay, key)?;
        invocation
            .arg(self.wake_channel.as_str())
            .arg(key.namespace());
        let (answer, acked) = self.write(invocation, key).await?;
        match Self::code(answer, key, "replay")? {
            1 => {
                self.replicated(acked, "replay", "replay again")?;
                Ok(true)
            }
            0 => Ok(false),
            -1 => Err(Error::corrupt(key, "not a dedupe record")),
            _ => Err(Self::unexpected(key, "replay")),
        }
    }

    async fn pause(&self, namespace: &str) -> Result<bool> {
        self.pause_script(&SCRIPTS.pause, namespace, "pause", true)
            .await
    }

    async fn resume(&self, namespace: &str) -> Result<bool> {
        self.pause_script(&SCRIPTS.resume, namespace, "resume", true)
            .await
    }

    /// Pushed where the store opened its own connections: a pub/sub
    /// connection of this handle's (opened by the first worker that asks)
    /// hears every process's accepts, hand-backs, replays and resumes. A
    /// store on a connection the caller made (`RedisStore::on_connection`)
    /// has no way to open another: its workers poll.
    async fn wake(&self, namespace: &str) -> Result<Wake> {
        Key::new(namespace, "-")?;
        Ok(match &self.wake {
            Some(subscription) => subscription.wake(namespace, self.timeout).await,
            None => Wake::poll(),
        })
    }

    async fn paused(&self, namespace: &str) -> Result<bool> {
        self.pause_script(&SCRIPTS.paused, namespace, "paused", false)
            .await
    }

    async fn counts(&self, namespace: &str) -> Result<InboxCounts> {
        let [wait, _, ids, dead, ..] = self.inbox_keys(namespace)?;
        let probe = Key::new(namespace, "-").map_err(|e| Error::config(e.to_string()))?;
        let mut invocation = SCRIPTS.counts.prepare_invoke();
        invocation.key(wait).key(ids).key(dead);
        let Value::Array(values) = self.run(invocation, &probe).await? else {
            return Err(Self::unexpected(&probe, "counts"));
        };
        let [Value::Int(pending), Value::Int(running), Value::Int(failed), Value::Int(dead), oldest] =
            values.as_slice()
        else {
            return Err(Self::unexpected(&probe, "counts"));
        };
        let oldest_due = match oldest {
            Value::Nil => None,
            other => Some(
                text(other)
                    .and_then(|t| t.parse::<f64>().ok())
                    .ok_or_else(|| Self::unexpected(&probe, "counts"))?,
            ),
        };
        Ok(dedupe_core::backend::stored_counts(
            *pending,
            *running,
            *failed,
            *dead,
            oldest_due.map(|ms| ms as i64),
        ))
    }
}
