//! The DynamoDB store: conditional writes on one item per record, decided with
//! the caller's clock.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, Put, ReturnValue,
    ReturnValuesOnConditionCheckFailure, ScalarAttributeType, TableStatus, TimeToLiveSpecification,
    TransactWriteItem, Update,
};
use aws_sdk_dynamodb::Client;
use dedupe_core::backend::{
    self, check_identifier, check_ttl, duration_millis, from_millis, to_millis, BatchKeys,
    StoredRecord,
};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, RecordState,
    Result, DEFAULT_MAX_OUTCOME_BYTES,
};
use futures_util::{StreamExt, TryStreamExt};

use crate::errors::{is_condition_failure, map_err, retryable_code};
use crate::item::{decode, n, outcome_value, partition_key, s, AttributeNames, Item};

/// Largest outcome an item can carry next to its other attributes, under
/// DynamoDB's 400 KB item limit.
pub const MAX_OUTCOME_LIMIT: usize = 350_000;

/// Most items a DynamoDB transaction holds; `claim_with` and `complete_with`
/// add one of their own to the caller's.
pub const MAX_TRANSACTION_ITEMS: usize = 100;

/// How many times a claim re-reads a record that changed under it.
const CLAIM_ROUNDS: usize = 8;

/// A fresh claim: the key is absent, or done and past its retention (an
/// in-flight record past its lease is taken over by [`TAKEOVER`] instead, so
/// the attempt count carries on).
const FRESH: &str = "attribute_not_exists(#pk) OR (#st = :done AND #dl <= :now)";

/// A takeover: the record is still exactly the one read (its token and
/// deadline), whose lease has passed.
const TAKEOVER: &str = "#tk = :tk AND #dl = :dl";

/// Every holder's write: this token, in flight, deadline ahead of `:now`.
const HELD: &str = "#tk = :tk AND #st = :zero AND #dl > :now";

const COMPLETE: &str = "SET #st = :one, #dl = :until, #cm = :now, #oc = :oc, #ex = :exp";
const EXTEND: &str = "SET #dl = :until, #ex = :exp";

/// `expire()`'s scan filter, projection, and delete condition (never a record
/// claimed again since the scan).
const SCAN: &str = "#dl <= :now";
const PROJECTION: &str = "#pk, #tk, #dl";
const UNCHANGED: &str = "#tk = :tk AND #dl = :dl AND #dl <= :now";

/// Every set of expressions one request carries: their attribute names are
/// worked out once, when the store is built, not on every request.
const REQUESTS: [&[&str]; 7] = [
    &[FRESH],
    &[TAKEOVER],
    &[COMPLETE, HELD],
    &[HELD],
    &[EXTEND, HELD],
    &[SCAN, PROJECTION],
    &[UNCHANGED],
];

/// The clock that decides deadlines.
#[derive(Clone, Default)]
struct Clock(Option<Arc<dyn Fn() -> SystemTime + Send + Sync>>);

impl Clock {
    fn now_ms(&self) -> i64 {
        match &self.0 {
            Some(clock) => to_millis(clock()),
            None => backend::now_millis(),
        }
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Clock(custom)"
        } else {
            "Clock(system)"
        })
    }
}

/// Settings of a [`DynamoStore`]; start with [`DynamoStore::builder`].
#[derive(Debug, Clone)]
pub struct DynamoBuilder {
    client: Client,
    table: String,
    names: AttributeNames,
    grace: Duration,
    max_outcome_bytes: usize,
    fan_out: usize,
    expire_rate: u32,
    clock: Clock,
}

impl DynamoBuilder {
    /// Table name (default `dedupe_records`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Attribute names, to fit a table you already have (default
    /// [`AttributeNames::default`]).
    pub fn attribute_names(mut self, names: AttributeNames) -> Self {
        self.names = names;
        self
    }

    /// How long an in-flight item outlives its lease before DynamoDB's TTL may
    /// delete it (default 24 h), so that a late takeover still counts the
    /// attempt.
    pub fn takeover_window(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Largest outcome (default 256 KiB, at most [`MAX_OUTCOME_LIMIT`]).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Claims `claim_many` runs at once (default 16, at least 1).
    pub fn fan_out(mut self, fan_out: usize) -> Self {
        self.fan_out = fan_out;
        self
    }

    /// Most deletes `expire()` issues per second (default 500, at least 1), so
    /// a purge never starves the claims of an on-demand or provisioned table.
    pub fn expire_rate(mut self, per_second: u32) -> Self {
        self.expire_rate = per_second;
        self
    }

    /// The clock that decides deadlines (default: the system clock). DynamoDB
    /// has no server time in expressions, so every client's clock takes part;
    /// see [`DynamoStore`] on skew.
    pub fn clock(mut self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.clock = Clock(Some(Arc::new(clock)));
        self
    }

    /// Validates the settings and builds the store (no I/O).
    pub fn build(self) -> Result<DynamoStore> {
        let table_ok = (3..=255).contains(&self.table.len())
            && self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !table_ok {
            // Says exactly what is wrong with the name.
            check_identifier("table", &self.table)?;
            return Err(Error::config(format!(
                "table name {:?} must be 3 to 255 characters of [A-Za-z0-9_.-]",
                self.table
            )));
        }
        self.names.validate()?;
        check_ttl("takeover window", self.grace)?;
        if self.max_outcome_bytes > MAX_OUTCOME_LIMIT {
            return Err(Error::config(format!(
                "max_outcome_bytes {} is over what a DynamoDB item holds ({MAX_OUTCOME_LIMIT})",
                self.max_outcome_bytes
            )));
        }
        let config = self.client.config();
        let timeout = config
            .timeout_config()
            .and_then(|t| t.operation_timeout().or(t.operation_attempt_timeout()))
            .unwrap_or_default();
        let request_names = REQUESTS
            .iter()
            .map(|exprs| (exprs.to_vec(), self.names.used_in(exprs)))
            .collect();
        Ok(DynamoStore {
            inner: Arc::new(Inner {
                client: self.client,
                table: self.table,
                names: self.names,
                timeout,
                grace_ms: duration_millis(self.grace),
                caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
                fan_out: self.fan_out.max(1),
                expire_rate: self.expire_rate.max(1),
                clock: self.clock,
                request_names,
            }),
        })
    }
}

/// The DynamoDB store.
///
/// - **Atomic primitive**: a claim is one conditional `PutItem` (the key is
///   absent, or done and past its retention) with
///   `ReturnValuesOnConditionCheckFailure = ALL_OLD`, so a duplicate or
///   in-flight answer costs one round trip (where the service does not return
///   the old item, as DynamoDB Local does not, one strongly consistent
///   `GetItem` more). Taking over an in-flight record whose lease has passed is
///   a second `PutItem` conditioned on the token and deadline just read, with
///   one more attempt: of two racers only one replaces it. Complete, release
///   and extend are `UpdateItem`/`DeleteItem` conditioned on the token, the
///   state and the deadline.
/// - **Transactions**: [`claim_with`](DynamoStore::claim_with) and
///   [`complete_with`](DynamoStore::complete_with) add the claim or the
///   completion to the caller's `TransactWriteItems`, so a business write and
///   the record commit together or not at all.
/// - **Time**: DynamoDB has no server clock in expressions, so the caller's
///   clock decides deadlines. Single-winner claims never depend on clocks (the
///   conditional write is atomic whatever the clocks say); what skew changes
///   is when a lease or a retention counts as passed. A client whose clock
///   runs `d` ahead of the holder's sees the holder's lease pass `d` early and
///   may take it over while the holder still works: the holder's `complete`
///   then fails with `LeaseLost` (the token changed), so at most one outcome is
///   ever stored, but both ran for up to `d`. Keep skew far below the lease
///   (NTP keeps it to milliseconds; a lease is seconds to minutes). Retention
///   (hours to days) shifts by the completer's skew, which does not matter.
/// - **Expiry** is logical in every condition and read; the TTL attribute
///   lets DynamoDB reclaim items eventually (its sweeper may run days late).
///   `expire()` scans and deletes what has passed, each delete conditioned on
///   the record not having been claimed again, at a bounded rate.
///
/// Cloning is cheap (the settings and the client are shared).
#[derive(Debug, Clone)]
pub struct DynamoStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    table: String,
    names: AttributeNames,
    timeout: Duration,
    grace_ms: i64,
    caps: Capabilities,
    fan_out: usize,
    expire_rate: u32,
    clock: Clock,
    /// `ExpressionAttributeNames` of each of [`REQUESTS`].
    request_names: HashMap<Vec<&'static str>, HashMap<String, String>>,
}

/// What a conditional write of a claim came to.
enum Written {
    Won,
    /// The condition failed; the item the service returned, if it did.
    Lost(Option<Item>),
    /// A concurrent transaction held the item: try again.
    Conflict,
}

impl DynamoStore {
    /// Default table name.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";

    /// Settings for a store on the caller's client. The client's own retry and
    /// timeout config applies to every call (set an operation timeout on it:
    /// the SDK sets none by default); see [`client_for_endpoint`] for one built
    /// here.
    ///
    /// [`client_for_endpoint`]: crate::client_for_endpoint
    pub fn builder(client: Client) -> DynamoBuilder {
        DynamoBuilder {
            client,
            table: Self::DEFAULT_TABLE.to_string(),
            names: AttributeNames::default(),
            grace: Duration::from_secs(24 * 3600),
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            fan_out: 16,
            expire_rate: 500,
            clock: Clock::default(),
        }
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        &self.inner.table
    }

    /// The attribute names.
    pub fn attribute_names(&self) -> &AttributeNames {
        &self.inner.names
    }

    fn now_ms(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    fn fail<E>(
        &self,
        e: aws_sdk_dynamodb::error::SdkError<E, aws_sdk_dynamodb::config::http::HttpResponse>,
    ) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        map_err(e, self.inner.timeout)
    }

    /// The attribute names a request's expressions use, worked out when the
    /// store was built (one of [`REQUESTS`]).
    fn names(&self, expressions: &[&'static str]) -> Option<HashMap<String, String>> {
        Some(match self.inner.request_names.get(expressions) {
            Some(names) => names.clone(),
            None => self.inner.names.used_in(expressions),
        })
    }

    /// Creates the table if it is missing (on-demand billing, partition key
    /// only, TTL on the expiry attribute) and waits until it is active. For
    /// development and tests; in production create it with infrastructure code
    /// (the README has the definition).
    pub async fn create_table_if_missing(&self) -> Result<()> {
        let Inner {
            client,
            table,
            names,
            ..
        } = &*self.inner;
        let exists = client.describe_table().table_name(table).send().await;
        if let Err(e) = exists {
            if e.code() != Some("ResourceNotFoundException") {
                return Err(self.fail(e));
            }
            let created = client
                .create_table()
                .table_name(table)
                .billing_mode(BillingMode::PayPerRequest)
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name(&names.partition_key)
                        .attribute_type(ScalarAttributeType::S)
                        .build()
                        .map_err(|e| Error::config(e.to_string()))?,
                )
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name(&names.partition_key)
                        .key_type(KeyType::Hash)
                        .build()
                        .map_err(|e| Error::config(e.to_string()))?,
                )
                .send()
                .await;
            if let Err(e) = created {
                if e.code() != Some("ResourceInUseException") {
                    return Err(self.fail(e));
                }
            }
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            let described = client
                .describe_table()
                .table_name(table)
                .send()
                .await
                .map_err(|e| self.fail(e))?;
            if described.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                let ttl = client
                    .update_time_to_live()
                    .table_name(table)
                    .time_to_live_specification(
                        TimeToLiveSpecification::builder()
                            .enabled(true)
                            .attribute_name(&names.expires_at)
                            .build()
                            .map_err(|e| Error::config(e.to_string()))?,
                    )
                    .send()
                    .await;
                match ttl {
                    Ok(_) => return Ok(()),
                    // "TimeToLive is already enabled".
                    Err(e) if e.code() == Some("ValidationException") => return Ok(()),
                    Err(e) => return Err(self.fail(e)),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(Error::unavailable(
            format!("table {table} did not become active within 60 s"),
            None,
        ))
    }

    /// Deletes the table and every record in it (for tests and temporary
    /// tables; needs `dynamodb:DeleteTable`). A missing table is not an error.
    pub async fn delete_table(&self) -> Result<()> {
        match self
            .inner
            .client
            .delete_table()
            .table_name(&self.inner.table)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(()),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Epoch seconds at which DynamoDB's TTL may delete an item whose logical
    /// deadline is `deadline_ms`.
    fn ttl_seconds(deadline_ms: i64) -> i64 {
        deadline_ms.div_euclid(1000) + 1
    }

    #[allow(clippy::too_many_arguments)]
    fn in_flight_item(
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

    async fn read(&self, key: &Key) -> Result<Option<Item>> {
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
    async fn claim_loop(
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
                self.transact_put(item.clone(), condition, values, extra)
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
            if deadline_of(&record) > from_millis(self.now_ms()) {
                return Ok(backend::losing_claim(record, opts));
            }
            replacing = Some(record);
        }
        Err(Error::backend(
            "the record kept changing under the claim; retry",
            true,
            None,
        ))
    }

    async fn put(
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
            .set_expression_attribute_values(Some(values))
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

    async fn transact_put(
        &self,
        item: Item,
        condition: &'static str,
        values: HashMap<String, AttributeValue>,
        extra: &[TransactWriteItem],
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
        match self.transact(extra, ours).await? {
            Transacted::Committed => Ok(Written::Won),
            Transacted::OursFailed(old) => Ok(Written::Lost(old)),
            Transacted::Conflict => Ok(Written::Conflict),
        }
    }

    /// Runs the caller's items and ours (last) as one transaction.
    async fn transact(
        &self,
        extra: &[TransactWriteItem],
        ours: TransactWriteItem,
    ) -> Result<Transacted> {
        if extra.len() >= MAX_TRANSACTION_ITEMS {
            return Err(Error::config(format!(
                "a transaction holds at most {MAX_TRANSACTION_ITEMS} items, ours included; {} given",
                extra.len()
            )));
        }
        let mut items = extra.to_vec();
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
        let ours = extra.len();
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
        if let Some((i, reason)) = reasons
            .iter()
            .enumerate()
            .find(|(_, r)| r.code().is_some_and(|c| c != "None"))
        {
            let code = reason.code().unwrap_or_default();
            let message = reason.message().unwrap_or_default();
            let whose = if i == ours {
                "the record's own write".to_string()
            } else {
                format!("your item {i}")
            };
            return Err(Error::backend(
                format!("the transaction was cancelled by {whose}: {code} {message}"),
                retryable_code(code),
                Some(Box::new(e) as _),
            ));
        }
        Err(self.fail(e))
    }

    /// Claims `key` in one DynamoDB transaction with the caller's `items` (at
    /// most 99): when the answer is `Claimed`, the items were written with the
    /// in-flight record; any other answer (`Duplicate`, `InFlight`,
    /// `Mismatch`) or error means none of them was. An item of the caller's
    /// whose own condition fails cancels the whole transaction: a
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
        self.claim_loop(key, opts, items).await
    }

    /// Completes `lease` in one DynamoDB transaction with the caller's `items`
    /// (at most 99): both land, or neither. `LeaseLost` when the lease has
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
        match self.transact(items, ours).await? {
            Transacted::Committed => Ok(()),
            Transacted::OursFailed(_) => Err(Error::lease_lost(&lease.key)),
            Transacted::Conflict => Err(Error::backend(
                "another transaction held the record; retry",
                true,
                None,
            )),
        }
    }

    fn complete_values(
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

    fn held_values(&self, lease: &Lease, now: i64) -> HashMap<String, AttributeValue> {
        HashMap::from([
            (":tk".to_string(), s(lease.token.as_str())),
            (":zero".to_string(), n(StoredRecord::IN_FLIGHT)),
            (":now".to_string(), n(now)),
        ])
    }
}

/// What a transaction came to.
enum Transacted {
    Committed,
    /// Our item's condition failed; the old item, if the service returned it.
    OursFailed(Option<Item>),
    Conflict,
}

/// The record's deadline: the lease's while in flight, the retention's once done.
fn deadline_of(record: &Record) -> SystemTime {
    match record.state {
        RecordState::InFlight { lease_deadline } => lease_deadline,
        RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
    }
}

#[async_trait]
impl DedupeStore for DynamoStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        self.claim_loop(key, opts, &[]).await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.inner.caps.check_outcome(outcome)?;
        let now = self.now_ms();
        let until = now.saturating_add(duration_millis(retention));
        let done = self
            .inner
            .client
            .update_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(&lease.key))
            .update_expression(COMPLETE)
            .condition_expression(HELD)
            .set_expression_attribute_names(self.names(&[COMPLETE, HELD]))
            .set_expression_attribute_values(Some(self.complete_values(lease, outcome, now, until)))
            .send()
            .await;
        match done {
            Ok(_) => Ok(()),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(self.fail(e)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let done = self
            .inner
            .client
            .delete_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(&lease.key))
            .condition_expression(HELD)
            .set_expression_attribute_names(self.names(&[HELD]))
            .set_expression_attribute_values(Some(self.held_values(lease, self.now_ms())))
            .send()
            .await;
        match done {
            Ok(_) => Ok(()),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(self.fail(e)),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let now = self.now_ms();
        let until = now.saturating_add(duration_millis(ttl));
        let mut values = self.held_values(lease, now);
        values.insert(":until".to_string(), n(until));
        values.insert(
            ":exp".to_string(),
            n(Self::ttl_seconds(until.saturating_add(self.inner.grace_ms))),
        );
        let done = self
            .inner
            .client
            .update_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(&lease.key))
            .update_expression(EXTEND)
            .condition_expression(HELD)
            .set_expression_attribute_names(self.names(&[EXTEND, HELD]))
            .set_expression_attribute_values(Some(values))
            .send()
            .await;
        match done {
            Ok(_) => Ok(Lease {
                deadline: from_millis(until),
                ..lease.clone()
            }),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Scans for items past their deadline, 100 at a time, and deletes each
    /// one on condition that it still holds the token and deadline the scan saw
    /// (a record claimed again meanwhile is left alone), at most
    /// `expire_rate` deletes a second.
    async fn expire(&self) -> Result<u64> {
        let names = &self.inner.names;
        let started = Instant::now();
        let mut issued: u64 = 0;
        let mut removed = 0;
        let mut start: Option<Item> = None;
        loop {
            let page = self
                .inner
                .client
                .scan()
                .table_name(&self.inner.table)
                .filter_expression(SCAN)
                .projection_expression(PROJECTION)
                .set_expression_attribute_names(self.names(&[SCAN, PROJECTION]))
                .expression_attribute_values(":now", n(self.now_ms()))
                .set_exclusive_start_key(start.take())
                .limit(100)
                .send()
                .await
                .map_err(|e| self.fail(e))?;
            for item in page.items() {
                let (Some(pk), Some(tk), Some(dl)) = (
                    item.get(&names.partition_key),
                    item.get(&names.token),
                    item.get(&names.deadline),
                ) else {
                    continue;
                };
                let due =
                    Duration::from_secs_f64(issued as f64 / f64::from(self.inner.expire_rate));
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
                issued += 1;
                let gone = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .key(&names.partition_key, pk.clone())
                    .condition_expression(UNCHANGED)
                    .set_expression_attribute_names(self.names(&[UNCHANGED]))
                    .expression_attribute_values(":tk", tk.clone())
                    .expression_attribute_values(":dl", dl.clone())
                    .expression_attribute_values(":now", n(self.now_ms()))
                    .send()
                    .await;
                match gone {
                    Ok(_) => removed += 1,
                    Err(e) if is_condition_failure(&e) => {}
                    Err(e) => return Err(self.fail(e)),
                }
            }
            match page.last_evaluated_key() {
                Some(last) if !last.is_empty() => start = Some(last.clone()),
                _ => return Ok(removed),
            }
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let Some(item) = self.read(key).await? else {
            return Ok(None);
        };
        let record = decode(&self.inner.names, key, &item)?;
        Ok((deadline_of(&record) > from_millis(self.now_ms())).then_some(record))
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let out = self
            .inner
            .client
            .delete_item()
            .table_name(&self.inner.table)
            .key(&self.inner.names.partition_key, partition_key(key))
            .return_values(ReturnValue::AllOld)
            .send()
            .await
            .map_err(|e| self.fail(e))?;
        match out.attributes() {
            Some(old) if !old.is_empty() => {
                let record = decode(&self.inner.names, key, old)?;
                Ok(deadline_of(&record) > from_millis(self.now_ms()))
            }
            _ => Ok(false),
        }
    }

    /// DynamoDB has no conditional batch write: the claims run concurrently,
    /// `fan_out` at a time, with the same answers as claim-by-claim.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let batch = BatchKeys::new(keys);
        let distinct: Vec<Key> = batch.distinct().iter().map(|k| (*k).clone()).collect();
        let answers: Vec<ClaimOutcome> = futures_util::stream::iter(distinct)
            .map(|key: Key| async move { self.claim_loop(&key, opts, &[]).await })
            .buffered(self.inner.fan_out)
            .try_collect()
            .await?;
        batch.answers(answers, opts)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_has_its_names_worked_out_once() {
        let names = AttributeNames {
            partition_key: "id".into(),
            ..AttributeNames::default()
        };
        for exprs in REQUESTS {
            let used = names.used_in(exprs);
            assert!(!used.is_empty(), "{exprs:?} names no attribute");
            for placeholder in used.keys() {
                assert!(
                    exprs.iter().any(|e| e.contains(placeholder.as_str())),
                    "{exprs:?}: {placeholder} is not used"
                );
            }
        }
        assert_eq!(names.used_in(&[FRESH])["#pk"], "id");
    }
}
