//! The DynamoDB store: conditional writes on one item per record, decided with
//! the caller's clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::Client;
use dedupe_core::backend::{check_ttl, duration_millis, from_millis, BatchKeys};
use dedupe_core::{
    Capabilities, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record, Result,
    DEFAULT_MAX_OUTCOME_BYTES,
};
use futures_util::StreamExt;

pub use crate::builder::DynamoBuilder;
use crate::clock::{judge, Clock, Offset, ServiceClock};
use crate::codec::{decode, is_inbox_item, n, partition_key, s, AttributeNames, Item};
use crate::error::{is_condition_failure, map_err};
use crate::expressions::*;
use crate::ops::deadline_of;

/// Largest outcome an item can carry next to its other attributes, under
/// DynamoDB's 400 KB item limit.
pub const MAX_ITEM_OUTCOME_BYTES: usize = 350_000;

/// Most items a DynamoDB transaction holds; `claim_with` and `complete_with`
/// add one of their own to the caller's.
pub const MAX_TRANSACTION_ITEMS: usize = 100;

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
///   clock decides deadlines. Claims racing at one instant have one winner
///   whatever the clocks say (the conditional write is atomic); what skew
///   changes is when a lease counts as passed, so a takeover depends on the
///   taker's clock: one `d` ahead of the holder's takes it over `d` early
///   (`work + skew < lease`). The store measures its clock against DynamoDB's
///   from every response's `Date` header and refuses claims, extensions and
///   `expire()` with [`Error::ClockSkew`] when it is surely off by more than
///   [`max_clock_skew`](DynamoBuilder::max_clock_skew) (default 1 s; the
///   measurement's one-second resolution lets up to about a second more
///   through), and leases under [`min_lease`](DynamoBuilder::min_lease)
///   (default 8 s). Retention (hours to days) shifts by the completer's skew,
///   which does not matter.
/// - **Global tables**: refused at the first claim when their replicas are
///   eventually consistent (two regions could each win a claim), unless
///   [`allow_global_table`](DynamoBuilder::allow_global_table).
/// - **Expiry** is logical in every condition and read; the TTL attribute
///   lets DynamoDB reclaim items eventually (its sweeper may run days late).
///   `expire()` scans and deletes what has passed, each delete conditioned on
///   the record not having been claimed again, at a bounded rate.
///
/// Cloning is cheap (the settings and the client are shared).
#[derive(Debug, Clone)]
pub struct DynamoStore {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) table: String,
    pub(crate) names: AttributeNames,
    pub(crate) timeout: Duration,
    pub(crate) grace_ms: i64,
    pub(crate) caps: Capabilities,
    pub(crate) fan_out: usize,
    pub(crate) expire_rate: u32,
    pub(crate) clock: Clock,
    /// DynamoDB's clock, as the responses' `Date` headers show it.
    pub(crate) service_clock: Arc<ServiceClock>,
    pub(crate) max_clock_skew: Duration,
    pub(crate) min_lease: Duration,
    pub(crate) allow_global_table: bool,
    /// Raised when an inbox item becomes due now through this handle or a
    /// clone (I14); other processes' changes are found by the poll.
    pub(crate) wakeups: dedupe_core::backend::Wakeups,
    /// The table's check, once (`DescribeTable`): why claims are refused on
    /// it, if they are.
    pub(crate) table_checked: std::sync::OnceLock<Option<String>>,
    /// `ExpressionAttributeNames` of each of [`REQUESTS`].
    pub(crate) request_names: HashMap<Vec<&'static str>, HashMap<String, String>>,
}

/// What a conditional write of a claim came to.
pub(crate) enum Written {
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
            max_clock_skew: Self::DEFAULT_MAX_CLOCK_SKEW,
            min_lease: None,
            allow_global_table: false,
            timeout: None,
        }
    }

    /// Bounds `op` by the store's timeout ([`DynamoBuilder::timeout`]),
    /// whatever the client's own settings: a call that needs several
    /// requests (a claim that reads, then takes over) is bounded as a whole.
    pub(crate) async fn bounded<T>(
        &self,
        op: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        dedupe_core::backend::within(self.inner.timeout, op).await
    }

    /// Default of [`DynamoBuilder::timeout`] when the client sets no
    /// operation timeout.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    /// Default of [`DynamoBuilder::max_clock_skew`].
    pub const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_secs(1);

    /// The shortest lease a claim or extension may ask for
    /// ([`DynamoBuilder::min_lease`]).
    pub fn min_lease(&self) -> Duration {
        self.inner.min_lease
    }

    /// How far this process's clock is from DynamoDB's, as last measured:
    /// (DynamoDB's clock minus this store's clock) lies in the range, in
    /// milliseconds; `None` before the first response, after five minutes
    /// without one, or when the service sends no `Date` header.
    pub fn clock_offset_ms(&self) -> Option<std::ops::Range<i64>> {
        match self.inner.service_clock.offset(self.now_ms()) {
            Offset::Within { lo, hi } => Some(lo..hi),
            Offset::Unmeasured | Offset::Unmeasurable => None,
        }
    }

    /// Before a call that sets or judges a deadline by this process's clock
    /// (claims, extensions, `expire()`): refuses a lease under the minimum,
    /// checks the table once (global tables), measures the clock against
    /// DynamoDB's when no fresh reading is at hand (one strongly consistent
    /// read of `probe`, which writes nothing), and refuses with
    /// [`Error::ClockSkew`] when the clock is surely off by more than the
    /// tolerance.
    pub(crate) async fn clock_guard(&self, probe: &Key, lease: Option<Duration>) -> Result<()> {
        if let Some(lease) = lease {
            if lease < self.inner.min_lease {
                return Err(Error::config(format!(
                    "a lease of {lease:?} is under this store's minimum of {:?} (4 x (max clock \
                     skew {:?} + 1 s of Date resolution)): clocks that far apart could take it \
                     over while its holder works; lower DynamoBuilder::min_lease only where \
                     the clocks are known to be closer",
                    self.inner.min_lease, self.inner.max_clock_skew
                )));
            }
        }
        self.check_table().await?;
        if self.inner.service_clock.offset(self.now_ms()) == Offset::Unmeasured {
            self.read(probe).await?;
        }
        match self.inner.service_clock.offset(self.now_ms()) {
            Offset::Unmeasurable | Offset::Unmeasured => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        table = %self.inner.table,
                        "the service sends no Date header: this process's clock cannot be \
                         checked against it (DynamoDB itself always sends one)"
                    );
                });
                Ok(())
            }
            offset => judge(offset, self.inner.max_clock_skew),
        }
    }

    /// Checks the table once: an eventually consistent global table is
    /// refused unless allowed. Without `dynamodb:DescribeTable` the check is
    /// skipped, with a warning.
    async fn check_table(&self) -> Result<()> {
        // Set by the first check that gets an answer. Until then every caller
        // asks for itself: a queue behind one check would hold each caller
        // for every failed check before it during an outage.
        if let Some(refusal) = self.inner.table_checked.get() {
            return refusal.clone().map_or(Ok(()), |r| Err(Error::config(r)));
        }
        let described = self
            .inner
            .client
            .describe_table()
            .table_name(&self.inner.table)
            .send()
            .await;
        let refusal = match described {
            Ok(out) => out.table().and_then(|table| {
                crate::table::global_table_refusal(table, self.inner.allow_global_table)
            }),
            Err(e) if e.code() == Some("AccessDeniedException") => {
                tracing::warn!(
                    table = %self.inner.table,
                    "DescribeTable refused: whether the table is an eventually consistent \
                     global table was not checked"
                );
                None
            }
            Err(e) => return Err(self.fail(e)),
        };
        let refusal = self.inner.table_checked.get_or_init(|| refusal);
        refusal.clone().map_or(Ok(()), |r| Err(Error::config(r)))
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        &self.inner.table
    }

    /// The attribute names.
    pub fn attribute_names(&self) -> &AttributeNames {
        &self.inner.names
    }

    pub(crate) fn now_ms(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    pub(crate) fn fail<E>(
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
    pub(crate) fn names(&self, expressions: &[&'static str]) -> Option<HashMap<String, String>> {
        Some(match self.inner.request_names.get(expressions) {
            Some(names) => names.clone(),
            None => self.inner.names.used_in(expressions),
        })
    }
}

#[async_trait]
impl DedupeStore for DynamoStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        self.bounded(async {
            opts.validate()?;
            self.clock_guard(key, Some(opts.lease_ttl)).await?;
            self.claim_loop(key, opts, &[]).await
        })
        .await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        self.bounded(async {
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
                .set_expression_attribute_values(Some(
                    self.complete_values(lease, outcome, now, until),
                ))
                .send()
                .await;
            match done {
                Ok(_) => Ok(()),
                Err(e) if is_condition_failure(&e) => self.completed_already(lease, outcome).await,
                Err(e) => Err(self.fail(e)),
            }
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let released = self
            .bounded(async {
                let done = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .key(&self.inner.names.partition_key, partition_key(&lease.key))
                    .condition_expression(CLAIM_HELD)
                    .set_expression_attribute_names(self.names(&[CLAIM_HELD]))
                    .set_expression_attribute_values(Some(self.held_values(lease, self.now_ms())))
                    .send()
                    .await;
                match done {
                    Ok(_) => Ok(()),
                    // Not a claim held by this lease: an inbox item is given back
                    // instead (due now), else it was released already or lost.
                    Err(e) if is_condition_failure(&e) => self.released_already(lease).await,
                    Err(e) => Err(self.fail(e)),
                }
            })
            .await;
        if released.is_ok() {
            // A held item given back is due now.
            self.inner.wakeups.raise(lease.key.namespace());
        }
        released
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.bounded(async {
            check_ttl("lease ttl", ttl)?;
            self.clock_guard(&lease.key, Some(ttl)).await?;
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
                .condition_expression(CLAIM_HELD)
                .set_expression_attribute_names(self.names(&[EXTEND, CLAIM_HELD]))
                .set_expression_attribute_values(Some(values))
                .send()
                .await;
            match done {
                Ok(_) => Ok(Lease {
                    deadline: from_millis(until),
                    ..lease.clone()
                }),
                // An inbox item is extended without a TTL.
                Err(e) if is_condition_failure(&e) => self.extend_item(lease, ttl).await,
                Err(e) => Err(self.fail(e)),
            }
        })
        .await
    }

    /// Scans for items past their deadline, 100 at a time, and deletes each
    /// one on condition that it still holds the token and deadline the scan saw
    /// (a record claimed again meanwhile is left alone), at most
    /// `expire_rate` deletes a second.
    async fn expire(&self) -> Result<u64> {
        self.clock_guard(&Key::new("dedupe", "expire")?, None)
            .await?;
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
                .expression_attribute_values(":two", n(2))
                .set_exclusive_start_key(start.take())
                .limit(100)
                .send()
                .await
                .map_err(|e| self.fail(e))?;
            for item in page.items() {
                let due =
                    Duration::from_secs_f64(issued as f64 / f64::from(self.inner.expire_rate));
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
                // An ordering key's queue: its finished entries dropped. One
                // that cannot be walked (an item it names is corrupt) is
                // left as it is and named in a warning; the records go on
                // expiring.
                if item.contains_key(&names.order_version) {
                    if let Some(aws_sdk_dynamodb::types::AttributeValue::S(pk)) =
                        item.get(&names.partition_key)
                    {
                        issued += 1;
                        if let Err(e) = self.collect_queue(pk).await {
                            tracing::warn!(queue = %pk, error = %e, "expire() left an ordering key's queue as it was");
                        }
                    }
                    continue;
                }
                let (Some(pk), Some(tk), Some(dl)) = (
                    item.get(&names.partition_key),
                    item.get(&names.token),
                    item.get(&names.deadline),
                ) else {
                    continue;
                };
                issued += 1;
                // A dead item past its retention (I16), still dead under the
                // token read; or a record still as read, expired.
                let delete = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .key(&names.partition_key, pk.clone())
                    .expression_attribute_values(":tk", tk.clone())
                    .expression_attribute_values(":now", n(self.now_ms()));
                let delete = if item.contains_key(&names.wait) {
                    delete
                        .condition_expression(DEAD_UNCHANGED)
                        .set_expression_attribute_names(self.names(&[DEAD_UNCHANGED]))
                        .expression_attribute_values(":two", n(2))
                } else {
                    delete
                        .condition_expression(UNCHANGED)
                        .set_expression_attribute_names(self.names(&[UNCHANGED]))
                        .expression_attribute_values(":dl", dl.clone())
                };
                let gone = delete.send().await;
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
        self.bounded(async {
            let Some(item) = self.read(key).await? else {
                return Ok(None);
            };
            let record = decode(&self.inner.names, key, &item)?;
            let live = is_inbox_item(&self.inner.names, &item)
                || deadline_of(&record) > from_millis(self.now_ms());
            Ok(live.then_some(record))
        })
        .await
    }

    /// Reads the record, then deletes it on condition that it still holds the
    /// token read. A delete the SDK sends again after the first removed the
    /// item finds it gone and answers as the first did; a claim made since is
    /// never removed (the condition fails on its token; it is read again).
    async fn forget(&self, key: &Key) -> Result<bool> {
        self.bounded(async {
            for _ in 0..CLAIM_ROUNDS {
                let Some(item) = self.read(key).await? else {
                    return Ok(false);
                };
                let record = decode(&self.inner.names, key, &item)?;
                let live = is_inbox_item(&self.inner.names, &item)
                    || deadline_of(&record) > from_millis(self.now_ms());
                let gone = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .key(&self.inner.names.partition_key, partition_key(key))
                    .condition_expression(FENCED)
                    .set_expression_attribute_names(self.names(&[FENCED]))
                    .expression_attribute_values(":tk", s(record.token.as_str()))
                    .send()
                    .await;
                match gone {
                    Ok(_) => return Ok(live),
                    Err(e) if is_condition_failure(&e) => match self.read(key).await? {
                        // Removed already: by this very request, sent twice.
                        None => return Ok(live),
                        Some(_) => continue,
                    },
                    Err(e) => return Err(self.fail(e)),
                }
            }
            Err(Error::retryable(
                "the record kept changing under forget; retry",
                None,
            ))
        })
        .await
    }

    /// DynamoDB has no conditional batch write: the claims run concurrently,
    /// `fan_out` at a time, with the same answers as claim-by-claim, each
    /// bounded by the store's timeout. Every claim runs to its end; if any
    /// failed, the claims the batch won are given back (released, so no
    /// record sits in flight with no holder) and the first error is returned.
    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.bounded(self.clock_guard(&keys[0], Some(opts.lease_ttl)))
            .await?;
        let batch = BatchKeys::new(keys);
        let distinct: Vec<Key> = batch.distinct().iter().map(|k| (*k).clone()).collect();
        let results: Vec<Result<ClaimOutcome>> = futures_util::stream::iter(distinct)
            .map(|key: Key| async move { self.bounded(self.claim_loop(&key, opts, &[])).await })
            .buffered(self.inner.fan_out)
            .collect()
            .await;
        if results.iter().all(Result::is_ok) {
            let answers = results.into_iter().collect::<Result<Vec<_>>>()?;
            return batch.answers(answers, opts);
        }
        let mut first_error = None;
        let mut won = Vec::new();
        for result in results {
            match result {
                Ok(answer) => won.extend(answer.lease().cloned()),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let given_back = futures_util::stream::iter(won)
            .map(|lease| async move { (self.release(&lease).await, lease) })
            .buffer_unordered(self.inner.fan_out)
            .collect::<Vec<_>>()
            .await;
        for (released, lease) in given_back {
            if let Err(e) = released {
                tracing::warn!(
                    key = %lease.key,
                    error = %e,
                    "a claim of a failed batch could not be given back; it stands until its lease passes"
                );
            }
        }
        Err(first_error.unwrap_or_else(|| Error::retryable("the batch failed", None)))
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
