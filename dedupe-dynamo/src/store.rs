//! The DynamoDB store: conditional writes on one item per record, decided with
//! the caller's clock.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ReturnValue,
    ReturnValuesOnConditionCheckFailure, ScalarAttributeType, TableStatus, TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use dedupe_core::backend::{
    self, check_identifier, check_ttl, duration_millis, from_millis, BatchKeys, StoredRecord,
};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use futures_util::{StreamExt, TryStreamExt};

/// Item attribute names (short: every byte counts against the 400 KB item limit).
mod attr {
    pub(crate) const PK: &str = "pk";
    pub(crate) const STATE: &str = "st";
    pub(crate) const TOKEN: &str = "tk";
    pub(crate) const CLAIM_ID: &str = "ci";
    pub(crate) const FINGERPRINT: &str = "fp";
    pub(crate) const DEADLINE: &str = "dl";
    pub(crate) const COMPLETED: &str = "cm";
    pub(crate) const OUTCOME: &str = "oc";
    pub(crate) const ATTEMPTS: &str = "at";
    pub(crate) const FIRST_SEEN: &str = "fs";
    /// Epoch seconds for DynamoDB's own TTL sweeper (which runs up to days late:
    /// the store never relies on it).
    pub(crate) const EXPIRES: &str = "expires_at";
}

/// Largest outcome an item can carry next to its other attributes, under
/// DynamoDB's 400 KB item limit.
pub const MAX_OUTCOME_LIMIT: usize = 350_000;

/// How many times a claim re-reads a record that changed under it.
const CLAIM_ROUNDS: usize = 8;

type Item = HashMap<String, AttributeValue>;

fn n(v: i64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_string())
}

/// Maps an SDK error: throttling, request limits, 5xx, timeouts and connection
/// trouble are retryable; a missing table or a refused request is not.
fn map_err<E>(e: SdkError<E, HttpResponse>, timeout: Duration) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let code = e.code().map(str::to_string);
    let status = e.raw_response().map(|r| r.status().as_u16());
    match &e {
        SdkError::TimeoutError(_) => Error::Timeout {
            after: timeout,
            source: Some(Box::new(e)),
        },
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            Error::unavailable("dynamodb unreachable", Some(Box::new(e)))
        }
        _ => match code.as_deref() {
            Some(
                "ProvisionedThroughputExceededException"
                | "ThrottlingException"
                | "RequestLimitExceeded"
                | "InternalServerError"
                | "ServiceUnavailable"
                | "TransactionConflictException",
            ) => Error::unavailable("dynamodb throttled or unavailable", Some(Box::new(e))),
            Some("ResourceNotFoundException") => Error::backend(
                "dynamodb table missing: create it (create_table_if_missing)",
                false,
                Some(Box::new(e) as _),
            ),
            _ if status.is_some_and(|s| s >= 500) => {
                Error::unavailable("dynamodb server error", Some(Box::new(e)))
            }
            _ => Error::backend("dynamodb request failed", false, Some(Box::new(e) as _)),
        },
    }
}

fn is_condition_failure<E: ProvideErrorMetadata>(e: &SdkError<E, HttpResponse>) -> bool {
    e.code() == Some("ConditionalCheckFailedException")
}

/// Reads an item into a record; anything missing or malformed is corrupt.
fn decode(key: &Key, item: &Item) -> Result<Record> {
    let corrupt =
        |what: &str| Error::corrupt(key, format!("item attribute {what} missing or malformed"));
    let num = |name: &str| -> Result<i64> {
        match item.get(name) {
            Some(AttributeValue::N(v)) => v.parse().map_err(|_| corrupt(name)),
            _ => Err(corrupt(name)),
        }
    };
    let opt_num = |name: &str| -> Result<Option<i64>> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::N(v)) => v.parse().map(Some).map_err(|_| corrupt(name)),
            Some(_) => Err(corrupt(name)),
        }
    };
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
            Some(_) => Err(corrupt(name)),
        }
    };
    StoredRecord {
        state: num(attr::STATE)?,
        token: opt_str(attr::TOKEN)?.ok_or_else(|| corrupt(attr::TOKEN))?,
        claim_id: opt_str(attr::CLAIM_ID)?,
        fingerprint: opt_bytes(attr::FINGERPRINT)?,
        expires_ms: num(attr::DEADLINE)?,
        completed_ms: opt_num(attr::COMPLETED)?,
        outcome: opt_bytes(attr::OUTCOME)?,
        attempts: num(attr::ATTEMPTS)?,
        first_seen_ms: num(attr::FIRST_SEEN)?,
    }
    .decode(key)
}

/// Settings of a [`DynamoStore`]; start with [`DynamoStore::builder`].
#[derive(Debug, Clone)]
pub struct DynamoBuilder {
    client: Client,
    table: String,
    timeout: Duration,
    grace: Duration,
    max_outcome_bytes: usize,
    fan_out: usize,
}

impl DynamoBuilder {
    /// Table name (default `dedupe_records`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The bound reported by timeouts (the SDK's own timeout config decides when
    /// a call gives up; set it on the client).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long an in-flight item outlives its lease before DynamoDB's TTL may
    /// delete it (default 24 h), so a takeover still counts the attempt.
    pub fn takeover_window(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Largest outcome (default 256 KiB, at most [`MAX_OUTCOME_LIMIT`]).
    pub fn max_outcome_bytes(mut self, limit: usize) -> Self {
        self.max_outcome_bytes = limit;
        self
    }

    /// Claims `claim_many` runs at once (default 16).
    pub fn fan_out(mut self, fan_out: usize) -> Self {
        self.fan_out = fan_out;
        self
    }

    /// Validates the settings and builds the store (no I/O).
    pub fn build(self) -> Result<DynamoStore> {
        if self.table.len() < 3
            || self.table.len() > 255
            || !self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            check_identifier("table", &self.table)?;
        }
        check_ttl("takeover window", self.grace)?;
        if self.max_outcome_bytes > MAX_OUTCOME_LIMIT {
            return Err(Error::config(format!(
                "max_outcome_bytes {} is over what a DynamoDB item holds ({MAX_OUTCOME_LIMIT})",
                self.max_outcome_bytes
            )));
        }
        Ok(DynamoStore {
            client: self.client,
            table: self.table,
            timeout: self.timeout,
            grace_ms: duration_millis(self.grace),
            caps: Capabilities::new().with_max_outcome_bytes(self.max_outcome_bytes),
            fan_out: self.fan_out.max(1),
        })
    }
}

/// The DynamoDB store.
///
/// - **Atomic primitive**: a claim is one conditional `PutItem`
///   (`attribute_not_exists(pk)`), with `ReturnValuesOnConditionCheckFailure =
///   ALL_OLD` so a duplicate or in-flight answer costs one round trip (where the
///   service does not return the old item, one strongly consistent `GetItem`).
///   Taking over an expired record is a second `PutItem` conditioned on the token
///   and deadline just read, so of two racers only one can replace it. Complete,
///   release and extend are `UpdateItem`/`DeleteItem` conditioned on the token,
///   the state and the deadline.
/// - **Time**: DynamoDB has no server clock in expressions, so the caller's clock
///   decides deadlines. Clients must keep their clocks in sync (NTP): a client
///   whose clock runs ahead by `d` sees leases pass `d` early and may take over a
///   live lease; keep `d` well below the lease TTL.
/// - **Expiry** is logical in every condition and read; the `expires_at`
///   attribute lets DynamoDB's TTL reclaim items eventually. `expire()` scans and
///   deletes what has passed, each delete conditioned on the record not having
///   been claimed again.
#[derive(Debug, Clone)]
pub struct DynamoStore {
    client: Client,
    table: String,
    timeout: Duration,
    grace_ms: i64,
    caps: Capabilities,
    fan_out: usize,
}

impl DynamoStore {
    /// Default table name.
    pub const DEFAULT_TABLE: &'static str = "dedupe_records";

    /// Settings for a store on the caller's client.
    pub fn builder(client: Client) -> DynamoBuilder {
        DynamoBuilder {
            client,
            table: Self::DEFAULT_TABLE.to_string(),
            timeout: Duration::from_secs(5),
            grace: Duration::from_secs(24 * 3600),
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            fan_out: 16,
        }
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    fn pk(key: &Key) -> AttributeValue {
        s(&format!("{}:{}", key.namespace(), key.id()))
    }

    /// Creates the table (on-demand billing, TTL on `expires_at`) if it is
    /// missing, and waits until it is active. For development and tests; in
    /// production create it with infrastructure code (see the README).
    pub async fn create_table_if_missing(&self) -> Result<()> {
        let exists = self
            .client
            .describe_table()
            .table_name(&self.table)
            .send()
            .await;
        if let Err(e) = exists {
            if e.code() != Some("ResourceNotFoundException") {
                return Err(map_err(e, self.timeout));
            }
            let created = self
                .client
                .create_table()
                .table_name(&self.table)
                .billing_mode(BillingMode::PayPerRequest)
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name(attr::PK)
                        .attribute_type(ScalarAttributeType::S)
                        .build()
                        .map_err(|e| Error::config(e.to_string()))?,
                )
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name(attr::PK)
                        .key_type(KeyType::Hash)
                        .build()
                        .map_err(|e| Error::config(e.to_string()))?,
                )
                .send()
                .await;
            if let Err(e) = created {
                if e.code() != Some("ResourceInUseException") {
                    return Err(map_err(e, self.timeout));
                }
            }
        }
        for _ in 0..200 {
            let described = self
                .client
                .describe_table()
                .table_name(&self.table)
                .send()
                .await
                .map_err(|e| map_err(e, self.timeout))?;
            if described.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                let ttl = self
                    .client
                    .update_time_to_live()
                    .table_name(&self.table)
                    .time_to_live_specification(
                        TimeToLiveSpecification::builder()
                            .enabled(true)
                            .attribute_name(attr::EXPIRES)
                            .build()
                            .map_err(|e| Error::config(e.to_string()))?,
                    )
                    .send()
                    .await;
                if let Err(e) = ttl {
                    // Already enabled is fine.
                    if e.code() != Some("ValidationException") {
                        return Err(map_err(e, self.timeout));
                    }
                }
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(Error::unavailable("the table never became active", None))
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
        let mut item = Item::new();
        item.insert(attr::PK.into(), Self::pk(key));
        item.insert(attr::STATE.into(), n(StoredRecord::IN_FLIGHT));
        item.insert(attr::TOKEN.into(), s(token));
        if let Some(id) = &opts.claim_id {
            item.insert(attr::CLAIM_ID.into(), s(id.as_str()));
        }
        if let Some(fp) = &opts.fingerprint {
            item.insert(
                attr::FINGERPRINT.into(),
                AttributeValue::B(Blob::new(fp.as_bytes())),
            );
        }
        item.insert(attr::DEADLINE.into(), n(deadline));
        item.insert(attr::ATTEMPTS.into(), n(attempts));
        item.insert(attr::FIRST_SEEN.into(), n(first_seen));
        item.insert(
            attr::EXPIRES.into(),
            n((deadline.saturating_add(self.grace_ms)) / 1000 + 1),
        );
        item
    }

    async fn read(&self, key: &Key) -> Result<Option<Item>> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| map_err(e, self.timeout))?;
        Ok(out.item().cloned())
    }

    async fn claim_one(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        self.claim_loop(key, opts, duration_millis(opts.lease_ttl))
            .await
    }

    async fn claim_loop(
        &self,
        key: &Key,
        opts: &ClaimOptions,
        lease_ms: i64,
    ) -> Result<ClaimOutcome> {
        // What the next put requires of the item: absent, or exactly the expired
        // record last read (its token and deadline).
        let mut replacing: Option<Record> = None;
        for _ in 0..CLAIM_ROUNDS {
            let now = backend::now_millis();
            let token = backend::new_token();
            let (attempts, first_seen) = match &replacing {
                Some(old) => match old.state {
                    dedupe_core::RecordState::InFlight { .. } => (
                        i64::from(old.attempts) + 1,
                        backend::to_millis(old.first_seen),
                    ),
                    dedupe_core::RecordState::Done { .. } => (1, now),
                },
                None => (1, now),
            };
            let item = self.in_flight_item(
                key,
                token.as_str(),
                opts,
                now + lease_ms,
                attempts,
                first_seen,
            );
            let mut put = self
                .client
                .put_item()
                .table_name(&self.table)
                .set_item(Some(item.clone()))
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                );
            put = match &replacing {
                None => put.condition_expression("attribute_not_exists(pk)"),
                Some(old) => {
                    let deadline = deadline_of(old);
                    put.condition_expression("tk = :tk AND dl = :dl")
                        .expression_attribute_values(":tk", s(old.token.as_str()))
                        .expression_attribute_values(":dl", n(backend::to_millis(deadline)))
                }
            };
            match put.send().await {
                Ok(_) => return backend::won_claim(decode(key, &item)?),
                Err(e) if is_condition_failure(&e) => {
                    let old = e
                        .as_service_error()
                        .and_then(|se| match se {
                            aws_sdk_dynamodb::operation::put_item::PutItemError::ConditionalCheckFailedException(c) => c.item().cloned(),
                            _ => None,
                        });
                    // Emulators that do not return the old item: read it.
                    let old = match old {
                        Some(item) => Some(item),
                        None => self.read(key).await?,
                    };
                    let Some(old) = old else {
                        replacing = None;
                        continue;
                    };
                    let record = decode(key, &old)?;
                    let live = deadline_of(&record) > from_millis(backend::now_millis());
                    if live {
                        return Ok(backend::losing_claim(record, opts));
                    }
                    replacing = Some(record);
                }
                Err(e) => return Err(map_err(e, self.timeout)),
            }
        }
        Err(Error::backend(
            "the record kept changing under the claim; retry",
            true,
            None,
        ))
    }
}

/// The record's deadline: the lease's while in flight, the retention's once done.
fn deadline_of(record: &Record) -> std::time::SystemTime {
    match record.state {
        dedupe_core::RecordState::InFlight { lease_deadline } => lease_deadline,
        dedupe_core::RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
    }
}

/// The condition every holder's write carries: this token, in flight, deadline
/// ahead of `:now`.
const HELD: &str = "tk = :tk AND st = :zero AND dl > :now";

#[async_trait]
impl DedupeStore for DynamoStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        self.claim_one(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        check_ttl("retention", retention)?;
        self.caps.check_outcome(outcome)?;
        let now = backend::now_millis();
        let until = now.saturating_add(duration_millis(retention));
        let done = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(&lease.key))
            .update_expression("SET st = :one, dl = :until, cm = :now, oc = :oc, expires_at = :exp")
            .condition_expression(HELD)
            .expression_attribute_values(":tk", s(lease.token.as_str()))
            .expression_attribute_values(":zero", n(StoredRecord::IN_FLIGHT))
            .expression_attribute_values(":one", n(StoredRecord::DONE))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":until", n(until))
            .expression_attribute_values(":oc", AttributeValue::B(Blob::new(outcome)))
            .expression_attribute_values(":exp", n(until / 1000 + 1))
            .send()
            .await;
        match done {
            Ok(_) => Ok(()),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(map_err(e, self.timeout)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let done = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(&lease.key))
            .condition_expression(HELD)
            .expression_attribute_values(":tk", s(lease.token.as_str()))
            .expression_attribute_values(":zero", n(StoredRecord::IN_FLIGHT))
            .expression_attribute_values(":now", n(backend::now_millis()))
            .send()
            .await;
        match done {
            Ok(_) => Ok(()),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(map_err(e, self.timeout)),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        let now = backend::now_millis();
        let until = now.saturating_add(duration_millis(ttl));
        let done = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(&lease.key))
            .update_expression("SET dl = :until, expires_at = :exp")
            .condition_expression(HELD)
            .expression_attribute_values(":tk", s(lease.token.as_str()))
            .expression_attribute_values(":zero", n(StoredRecord::IN_FLIGHT))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":until", n(until))
            .expression_attribute_values(":exp", n(until.saturating_add(self.grace_ms) / 1000 + 1))
            .send()
            .await;
        match done {
            Ok(_) => Ok(Lease {
                deadline: from_millis(until),
                ..lease.clone()
            }),
            Err(e) if is_condition_failure(&e) => Err(Error::lease_lost(&lease.key)),
            Err(e) => Err(map_err(e, self.timeout)),
        }
    }

    /// Scans for items past their deadline, a page at a time, and deletes each
    /// one on condition that it still holds the token and deadline the scan saw
    /// (a record claimed again meanwhile is left alone).
    async fn expire(&self) -> Result<u64> {
        let mut removed = 0;
        let mut start: Option<Item> = None;
        loop {
            let now = backend::now_millis();
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .filter_expression("dl <= :now")
                .projection_expression("pk, tk, dl")
                .expression_attribute_values(":now", n(now))
                .set_exclusive_start_key(start.take())
                .limit(200)
                .send()
                .await
                .map_err(|e| map_err(e, self.timeout))?;
            for item in page.items() {
                let (Some(pk), Some(tk), Some(dl)) = (
                    item.get(attr::PK),
                    item.get(attr::TOKEN),
                    item.get(attr::DEADLINE),
                ) else {
                    continue;
                };
                let gone = self
                    .client
                    .delete_item()
                    .table_name(&self.table)
                    .key(attr::PK, pk.clone())
                    .condition_expression("tk = :tk AND dl = :dl AND dl <= :now")
                    .expression_attribute_values(":tk", tk.clone())
                    .expression_attribute_values(":dl", dl.clone())
                    .expression_attribute_values(":now", n(backend::now_millis()))
                    .send()
                    .await;
                match gone {
                    Ok(_) => removed += 1,
                    Err(e) if is_condition_failure(&e) => {}
                    Err(e) => return Err(map_err(e, self.timeout)),
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
        let record = decode(key, &item)?;
        Ok((deadline_of(&record) > from_millis(backend::now_millis())).then_some(record))
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        let out = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .return_values(ReturnValue::AllOld)
            .send()
            .await
            .map_err(|e| map_err(e, self.timeout))?;
        match out.attributes() {
            None => Ok(false),
            Some(old) if old.is_empty() => Ok(false),
            Some(old) => {
                let record = decode(key, old)?;
                Ok(deadline_of(&record) > from_millis(backend::now_millis()))
            }
        }
    }

    /// DynamoDB has no conditional batch write: the claims run concurrently,
    /// `fan_out` at a time, with the same answers as claim-by-claim.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let batch = BatchKeys::new(keys);
        let distinct: Vec<Key> = batch.distinct().iter().map(|k| (*k).clone()).collect();
        let answers: Vec<ClaimOutcome> = futures_util::stream::iter(distinct)
            .map(|key: Key| async move { self.claim_one(&key, opts).await })
            .buffered(self.fan_out)
            .try_collect()
            .await?;
        batch.answers(answers, opts)
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}
