//! Where every claim is decided and every state change is run: the claim
//! loop, the conditional puts and transactions, and the values they carry.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeValue, ConditionCheck, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
    Update,
};
use dedupe_core::backend::{
    self, check_ttl, duration_millis, from_millis, to_millis, StoredRecord,
};
use dedupe_core::{ClaimOptions, ClaimOutcome, Error, Key, Lease, Record, RecordState, Result};

use crate::codec::{decode, is_inbox_item, n, outcome_value, partition_key, s, Item};
use crate::error::{is_condition_failure, retryable_code};

use crate::expressions::*;
use crate::store::{DynamoStore, Written, MAX_TRANSACTION_ITEMS};

impl DynamoStore {
    /// Epoch seconds at which DynamoDB's TTL may delete an item whose logical
    /// deadline is `deadline_ms`.
    pub(crate) fn ttl_seconds(deadline_ms: i64) -> i64 {
        deadline_ms.div_euclid(1000) + 1
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn in_flight_item(
        &self,
        key: &Key,
        token: &str,
        opts: &ClaimOptions,
        deadline: i64,
        attempts: i64,
        first_seen: i64,
    ) -> Item {
        let names = &self.inner.names;
        let mut item = Item::new();
        item.insert(names.partition_key.clone(), partition_key(key));
        item.insert(names.state.clone(), n(StoredRecord::IN_FLIGHT));
        item.insert(names.token.clone(), s(token));
        if let Some(id) = &opts.claim_id {
            item.insert(names.claim_id.clone(), s(id.as_str()));
        }
        if let Some(fp) = &opts.fingerprint {
            item.insert(names.fingerprint.clone(), outcome_value(fp.as_bytes()));
        }
        item.insert(names.deadline.clone(), n(deadline));
        item.insert(names.attempts.clone(), n(attempts));
        item.insert(names.first_seen.clone(), n(first_seen));
        item.insert(
            names.expires_at.clone(),
            n(Self::ttl_seconds(
                deadline.saturating_add(self.inner.grace_ms),
            )),
        );
        item
    }

    pub(crate) async fn read(&self, key: &Key) -> Result<Option<Item>> {
        let out = self
            .inner
            .client
            .get_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.fail(e))?;
        Ok(out.item().cloned())
    }

    /// Claims `key`; with `extra` items, in one transaction with them.
    pub(crate) async fn claim_loop(
        &self,
        key: &Key,
        opts: &ClaimOptions,
        extra: &[TransactWriteItem],
    ) -> Result<ClaimOutcome> {
        let lease_ms = duration_millis(opts.lease_ttl);
        // What the next write requires of the item: absent or done and
        // expired, or exactly the expired in-flight record last read.
        let mut replacing: Option<Record> = None;
        for round in 0..CLAIM_ROUNDS {
            let now = self.now_ms();
            let token = backend::new_token();
            let (attempts, first_seen) = match &replacing {
                Some(old) if matches!(old.state, RecordState::InFlight { .. }) => {
                    (i64::from(old.attempts) + 1, to_millis(old.first_seen))
                }
                _ => (1, now),
            };
            let item = self.in_flight_item(
                key,
                token.as_str(),
                opts,
                now.saturating_add(lease_ms),
                attempts,
                first_seen,
            );
            let mut values = HashMap::new();
            let condition = match &replacing {
                None => {
                    values.insert(":done".to_string(), n(StoredRecord::DONE));
                    values.insert(":now".to_string(), n(now));
                    FRESH
                }
                Some(old) => {
                    values.insert(":tk".to_string(), s(old.token.as_str()));
                    values.insert(":dl".to_string(), n(to_millis(deadline_of(old))));
                    TAKEOVER
                }
            };
            let written = if extra.is_empty() {
                self.put(item.clone(), condition, values).await?
            } else {
                self.transact_put(item.clone(), condition, values, extra, None)
                    .await?
            };
            let old = match written {
                Written::Won => return backend::won_claim(decode(&self.inner.names, key, &item)?),
                Written::Conflict => {
                    // Another transaction holds the item for a moment.
                    tokio::time::sleep(Duration::from_millis(5 << round.min(5))).await;
                    continue;
                }
                Written::Lost(Some(old)) => Some(old),
                // Emulators that do not return the old item: read it.
                Written::Lost(None) => self.read(key).await?,
            };
            let Some(old) = old else {
                // Gone between the write and the read: claim it afresh.
                replacing = None;
                continue;
            };
            let record = decode(&self.inner.names, key, &old)?;
            if is_inbox_item(&self.inner.names, &old) {
                // The inbox holds the key until the item is done.
                return Ok(backend::losing_claim(record, opts));
            }
            if record.token == token {
                // This round's own write: the SDK sent the request again after
                // its answer was lost, and the second sending met the first's
                // record. The claim won.
                return backend::won_claim(record);
            }
            if deadline_of(&record) > from_millis(self.now_ms()) {
                let answer = backend::losing_claim(record, opts);
                if let (ClaimOutcome::Claimed(lease), false) = (&answer, extra.is_empty()) {
                    // The record is held under this call's claim id: an
                    // earlier call's claim, whose answer was lost or timed
                    // out. This call's items were not written with it: write
                    // them now, under a check that the record still holds
                    // that very lease, or look again.
                    match self.transact(extra, None, self.held_check(lease)?).await? {
                        Transacted::Committed => return Ok(answer),
                        Transacted::OursFailed(_) | Transacted::Conflict => {
                            replacing = None;
                            continue;
                        }
                    }
                }
                return Ok(answer);
            }
            replacing = Some(record);
        }
        Err(Error::retryable(
            "the record kept changing under the claim; retry",
            None,
        ))
    }

    pub(crate) async fn put(
        &self,
        item: Item,
        condition: &'static str,
        values: HashMap<String, AttributeValue>,
    ) -> Result<Written> {
        let sent = self
            .inner
            .client
            .put_item()
            .table_name(&self.inner.table)
            .set_item(Some(item))
            .condition_expression(condition)
            .set_expression_attribute_names(self.names(&[condition]))
            // DynamoDB refuses an empty map: a condition on names alone sends none.
            .set_expression_attribute_values((!values.is_empty()).then_some(values))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(_) => Ok(Written::Won),
            Err(e) if is_condition_failure(&e) => {
                let old = match e.as_service_error() {
                    Some(PutItemError::ConditionalCheckFailedException(c)) => c.item().cloned(),
                    _ => None,
                };
                Ok(Written::Lost(old.filter(|item| !item.is_empty())))
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    pub(crate) async fn transact_put(
        &self,
        item: Item,
        condition: &'static str,
        values: HashMap<String, AttributeValue>,
        extra: &[TransactWriteItem],
        queue: Option<TransactWriteItem>,
    ) -> Result<Written> {
        let put = Put::builder()
            .table_name(&self.inner.table)
            .set_item(Some(item))
            .condition_expression(condition)
            .set_expression_attribute_names(self.names(&[condition]))
            .set_expression_attribute_values(Some(values))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        let ours = TransactWriteItem::builder().put(put).build();
        match self.transact(extra, queue, ours).await? {
            Transacted::Committed => Ok(Written::Won),
            Transacted::OursFailed(old) => Ok(Written::Lost(old)),
            Transacted::Conflict => Ok(Written::Conflict),
        }
    }

    /// Runs the caller's items, an ordered item's queue write (an accept's,
    /// CONTRACT.md I15) and ours (last) as one transaction. A conflict with
    /// another transaction on any of them is a `Conflict`: the caller tries
    /// again.
    pub(crate) async fn transact(
        &self,
        extra: &[TransactWriteItem],
        queue: Option<TransactWriteItem>,
        ours: TransactWriteItem,
    ) -> Result<Transacted> {
        let own = 1 + usize::from(queue.is_some());
        if extra.len() + own > MAX_TRANSACTION_ITEMS {
            return Err(Error::config(format!(
                "a transaction holds at most {MAX_TRANSACTION_ITEMS} items, {own} of them ours; {} given",
                extra.len()
            )));
        }
        let queued = queue.is_some();
        let mut items = extra.to_vec();
        items.extend(queue);
        items.push(ours);
        let sent = self
            .inner
            .client
            .transact_write_items()
            .set_transact_items(Some(items))
            .send()
            .await;
        let e = match sent {
            Ok(_) => return Ok(Transacted::Committed),
            Err(e) => e,
        };
        let Some(TransactWriteItemsError::TransactionCanceledException(cancelled)) =
            e.as_service_error()
        else {
            return Err(self.fail(e));
        };
        let reasons = cancelled.cancellation_reasons();
        let code_of = |i: usize| reasons.get(i).and_then(|r| r.code()).unwrap_or("None");
        let ours = extra.len() + usize::from(queued);
        match code_of(ours) {
            "ConditionalCheckFailed" => {
                let old = reasons
                    .get(ours)
                    .and_then(|r| r.item())
                    .filter(|item| !item.is_empty())
                    .cloned();
                return Ok(Transacted::OursFailed(old));
            }
            "TransactionConflict" => return Ok(Transacted::Conflict),
            _ => {}
        }
        if queued && code_of(ours - 1) == "TransactionConflict" {
            return Ok(Transacted::Conflict);
        }
        if let Some((i, reason)) = reasons
            .iter()
            .enumerate()
            .find(|(_, r)| r.code().is_some_and(|c| c != "None"))
        {
            let code = reason.code().unwrap_or_default();
            let message = reason.message().unwrap_or_default();
            let whose = if i == ours {
                "the record's own write".to_string()
            } else if queued && i == ours - 1 {
                // DynamoDB's 400 KB item limit, reached by a key's queue.
                "the write of the item's entry in its ordering key's queue".to_string()
            } else {
                format!("your item {i}")
            };
            let message = format!("the transaction was cancelled by {whose}: {code} {message}");
            let retryable = retryable_code(code);
            let source = Some(Box::new(e) as _);
            return Err(if retryable {
                Error::retryable(message, source)
            } else {
                Error::fatal(message, source)
            });
        }
        Err(self.fail(e))
    }

    /// Claims `key` in one DynamoDB transaction with the caller's `items` (at
    /// most 99): when the answer is `Claimed`, the items were written with the
    /// in-flight record; any other answer (`Duplicate`, `InFlight`,
    /// `Mismatch`) means none of them was. An error other than a timeout
    /// means none was; after a timeout the transaction may have committed:
    /// retry with the same claim id. A retry handed the lease of its claim id
    /// (re-entrant `Claimed`) writes its items then, in a transaction with a
    /// check that the record still holds that lease, so `Claimed` always means
    /// this call's items are written (write items that may be written twice:
    /// a `Put` of the same item, or a condition that allows it). An item of the
    /// caller's whose own condition fails cancels the whole transaction: a
    /// non-retryable error naming the item.
    ///
    /// ```no_run
    /// # async fn demo(store: dedupe_dynamo::DynamoStore) -> dedupe_core::Result<()> {
    /// use dedupe_dynamo::aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
    /// use dedupe_core::{ClaimOptions, ClaimOutcome, Key};
    ///
    /// let order = Put::builder()
    ///     .table_name("orders")
    ///     .item("order_id", AttributeValue::S("ord_17".into()))
    ///     .item("status", AttributeValue::S("paid".into()))
    ///     .build()
    ///     .expect("table and item are set");
    /// let key = Key::new("stripe", "evt_1P9x")?;
    /// let items = [TransactWriteItem::builder().put(order).build()];
    /// match store.claim_with(&key, &ClaimOptions::default(), &items).await? {
    ///     ClaimOutcome::Claimed(lease) => {
    ///         // The order row and the claim committed together.
    ///         store.complete_with(&lease, b"ord_17", std::time::Duration::from_secs(86_400), &[]).await?;
    ///     }
    ///     _ => { /* a duplicate: the order row was not written again */ }
    /// }
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(level = "debug", skip_all, fields(key = %key, items = items.len()), err)]
    pub async fn claim_with(
        &self,
        key: &Key,
        opts: &ClaimOptions,
        items: &[TransactWriteItem],
    ) -> Result<ClaimOutcome> {
        opts.validate()?;
        self.bounded(async {
            self.clock_guard(key, Some(opts.lease_ttl)).await?;
            self.claim_loop(key, opts, items).await
        })
        .await
    }

    /// Completes `lease` in one DynamoDB transaction with the caller's `items`
    /// (at most 99): both land, or neither. Asked again after it committed
    /// (its answer lost or timed out) with the same lease and outcome, it
    /// answers Ok once this call's items are written too, in a transaction
    /// with a check that the record is still done by this lease. `LeaseLost` when the lease has
    /// passed or was taken over (nothing written); an item of the caller's
    /// whose own condition fails cancels everything, as in
    /// [`claim_with`](Self::claim_with).
    #[tracing::instrument(level = "debug", skip_all, fields(key = %lease.key, items = items.len()), err)]
    pub async fn complete_with(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
        items: &[TransactWriteItem],
    ) -> Result<()> {
        check_ttl("retention", retention)?;
        self.inner.caps.check_outcome(outcome)?;
        let now = self.now_ms();
        let until = now.saturating_add(duration_millis(retention));
        let update = Update::builder()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(&lease.key))
            .update_expression(COMPLETE)
            .condition_expression(HELD)
            .set_expression_attribute_names(self.names(&[COMPLETE, HELD]))
            .set_expression_attribute_values(Some(self.complete_values(lease, outcome, now, until)))
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        let ours = TransactWriteItem::builder().update(update).build();
        self.bounded(async {
            match self.transact(items, None, ours).await? {
                Transacted::Committed => Ok(()),
                Transacted::OursFailed(_) => {
                    self.completed_already(lease, outcome).await?;
                    if items.is_empty() {
                        return Ok(());
                    }
                    // Completed already by this lease with this outcome (an
                    // earlier call whose answer was lost or timed out); this
                    // call's items were not written with it: write them now,
                    // under a check that the record is still done by it.
                    let check = ConditionCheck::builder()
                        .table_name(&self.inner.table)
                        .key(&self.inner.names.partition_key, partition_key(&lease.key))
                        .condition_expression(DONE_BY)
                        .set_expression_attribute_names(self.names(&[DONE_BY]))
                        .expression_attribute_values(":tk", s(lease.token.as_str()))
                        .expression_attribute_values(":one", n(StoredRecord::DONE))
                        .build()
                        .map_err(|e| Error::config(e.to_string()))?;
                    let ours = TransactWriteItem::builder().condition_check(check).build();
                    match self.transact(items, None, ours).await? {
                        Transacted::Committed => Ok(()),
                        Transacted::OursFailed(_) => Err(Error::lease_lost(&lease.key)),
                        Transacted::Conflict => Err(Error::retryable(
                            "another transaction held the record; retry",
                            None,
                        )),
                    }
                }
                Transacted::Conflict => Err(Error::retryable(
                    "another transaction held the record; retry",
                    None,
                )),
            }
        })
        .await
    }

    pub(crate) fn complete_values(
        &self,
        lease: &Lease,
        outcome: &[u8],
        now: i64,
        until: i64,
    ) -> HashMap<String, AttributeValue> {
        HashMap::from([
            (":tk".to_string(), s(lease.token.as_str())),
            (":zero".to_string(), n(StoredRecord::IN_FLIGHT)),
            (":one".to_string(), n(StoredRecord::DONE)),
            (":now".to_string(), n(now)),
            (":until".to_string(), n(until)),
            (":oc".to_string(), outcome_value(outcome)),
            (":exp".to_string(), n(Self::ttl_seconds(until))),
        ])
    }

    /// A transaction's check that the record still holds `lease` (its token,
    /// in flight, its deadline ahead).
    pub(crate) fn held_check(&self, lease: &Lease) -> Result<TransactWriteItem> {
        let check = ConditionCheck::builder()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(&lease.key))
            .condition_expression(HELD)
            .set_expression_attribute_names(self.names(&[HELD]))
            .set_expression_attribute_values(Some(self.held_values(lease, self.now_ms())))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| Error::config(e.to_string()))?;
        Ok(TransactWriteItem::builder().condition_check(check).build())
    }

    pub(crate) fn held_values(&self, lease: &Lease, now: i64) -> HashMap<String, AttributeValue> {
        HashMap::from([
            (":tk".to_string(), s(lease.token.as_str())),
            (":zero".to_string(), n(StoredRecord::IN_FLIGHT)),
            (":now".to_string(), n(now)),
        ])
    }
}

impl DynamoStore {
    /// After a `complete` whose condition failed: `Ok` when the record is done,
    /// live, by this lease and with this outcome (the same complete sent
    /// again, by the SDK after a lost answer or by the caller after an error,
    /// met the first one's write), `LeaseLost` otherwise.
    pub(crate) async fn completed_already(&self, lease: &Lease, outcome: &[u8]) -> Result<()> {
        if let Some(item) = self.read(&lease.key).await? {
            let record = decode(&self.inner.names, &lease.key, &item)?;
            let live = deadline_of(&record) > from_millis(self.now_ms());
            if live
                && record.token == lease.token
                && matches!(&record.state, RecordState::Done { outcome: o, .. } if o.as_slice() == outcome)
            {
                return Ok(());
            }
        }
        Err(Error::lease_lost(&lease.key))
    }

    /// After a `release` whose condition failed: `Ok` when no live record is
    /// under the key (the lease passed, or the same release sent again met the
    /// first one's delete), `LeaseLost` for a live record of another lease or
    /// a done one. An inbox item is given back instead.
    pub(crate) async fn released_already(&self, lease: &Lease) -> Result<()> {
        let Some(item) = self.read(&lease.key).await? else {
            return Ok(());
        };
        if is_inbox_item(&self.inner.names, &item) {
            return self.give_back(lease, &item, Duration::ZERO).await;
        }
        let record = decode(&self.inner.names, &lease.key, &item)?;
        if deadline_of(&record) > from_millis(self.now_ms()) {
            Err(Error::lease_lost(&lease.key))
        } else {
            Ok(())
        }
    }
}

/// What a transaction came to.
pub(crate) enum Transacted {
    Committed,
    /// Our item's condition failed; the old item, if the service returned it.
    OursFailed(Option<Item>),
    Conflict,
}

/// The record's deadline: the lease's while in flight, the retention's once done.
pub(crate) fn deadline_of(record: &Record) -> SystemTime {
    match record.state {
        RecordState::InFlight { lease_deadline } => lease_deadline,
        RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
    }
}
