//! The store's settings, and building it from them.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_sdk_dynamodb::Client;
use dedupe_core::backend::{check_identifier, check_ttl, duration_millis};
use dedupe_core::{Capabilities, Error, Result};

use crate::clock::{Clock, DateReader, ServiceClock};
use crate::codec::AttributeNames;
use crate::expressions::*;
use crate::store::{DynamoStore, Inner, MAX_ITEM_OUTCOME_BYTES};

/// Settings of a [`DynamoStore`]; start with [`DynamoStore::builder`].
#[derive(Debug, Clone)]
pub struct DynamoBuilder {
    pub(crate) client: Client,
    pub(crate) table: String,
    pub(crate) names: AttributeNames,
    pub(crate) grace: Duration,
    pub(crate) max_outcome_bytes: usize,
    pub(crate) fan_out: usize,
    pub(crate) expire_rate: u32,
    pub(crate) clock: Clock,
    pub(crate) max_clock_skew: Duration,
    pub(crate) min_lease: Option<Duration>,
    pub(crate) allow_global_table: bool,
    pub(crate) timeout: Option<Duration>,
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

    /// Largest outcome (default 256 KiB, at most [`MAX_ITEM_OUTCOME_BYTES`]).
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
        self.clock = Clock::custom(clock);
        self
    }

    /// Bound on each operation as a whole (a claim may need several
    /// requests), whatever the client's own timeouts: past it, a retryable
    /// [`Error::Timeout`]. Default: the client's operation timeout, else its
    /// attempt timeout, else 5 s. `expire()` is not bounded (it scans at
    /// `expire_rate`); each of its requests is, by the client.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The largest skew between this process's clock and DynamoDB's that
    /// claims, extensions and `expire()` go through with (default 1 s). The
    /// store measures the skew from the `Date` of every response; past this,
    /// those calls fail with a retryable [`Error::ClockSkew`] and write
    /// nothing. The measurement has one-second resolution, so a skew up to
    /// this plus about a second (and the round trip) can go unseen.
    pub fn max_clock_skew(mut self, tolerated: Duration) -> Self {
        self.max_clock_skew = tolerated;
        self
    }

    /// The shortest lease a claim or an extension may ask for (default
    /// 4 × (max_clock_skew + 1 s): 8 s). Two stores whose clocks pass the guard
    /// may still be `2 × (max_clock_skew + 1 s)` apart, and a lease taken over
    /// by the faster one ends that much early for its holder: the default
    /// leaves the holder at least half its lease. Lower it only where the
    /// clocks are known to be closer (one machine, an emulator, tests).
    pub fn min_lease(mut self, min: Duration) -> Self {
        self.min_lease = Some(min);
        self
    }

    /// Claims on a global table whose replicas are eventually consistent
    /// (multi-region, `MultiRegionConsistency` not `STRONG`), which the store
    /// otherwise refuses at its first claim: conditional writes are atomic in
    /// one region only, so two regions can each hand out a claim of the same
    /// key. For a deployment that writes to one region only.
    pub fn allow_global_table(mut self, allow: bool) -> Self {
        self.allow_global_table = allow;
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
        if self.max_outcome_bytes > MAX_ITEM_OUTCOME_BYTES {
            return Err(Error::config(format!(
                "max_outcome_bytes {} is over what a DynamoDB item holds ({MAX_ITEM_OUTCOME_BYTES})",
                self.max_outcome_bytes
            )));
        }
        let config = self.client.config();
        let timeout = self
            .timeout
            .or_else(|| {
                config
                    .timeout_config()
                    .and_then(|t| t.operation_timeout().or(t.operation_attempt_timeout()))
            })
            .unwrap_or(DynamoStore::DEFAULT_TIMEOUT);
        if timeout.is_zero() {
            return Err(Error::config("timeout must be above zero"));
        }
        let min_lease = self
            .min_lease
            .unwrap_or((self.max_clock_skew + Duration::from_secs(1)).saturating_mul(4));
        // The caller's client, with one interceptor more that reads the
        // `Date` of every response.
        let service_clock = Arc::new(ServiceClock::new());
        let client = Client::from_conf(
            config
                .to_builder()
                .interceptor(DateReader(Arc::clone(&service_clock)))
                .build(),
        );
        let request_names = REQUESTS
            .iter()
            .map(|exprs| (exprs.to_vec(), self.names.used_in(exprs)))
            .collect();
        Ok(DynamoStore {
            inner: Arc::new(Inner {
                wakeups: Default::default(),
                client,
                table: self.table,
                names: self.names,
                timeout,
                grace_ms: duration_millis(self.grace),
                // TTL deletes expired items (within days); `expire()` is
                // a full Scan, for `dedupe purge`, never an hourly task.
                caps: Capabilities::new()
                    .with_max_outcome_bytes(self.max_outcome_bytes)
                    .with_expires_by_itself(true),
                fan_out: self.fan_out.max(1),
                expire_rate: self.expire_rate.max(1),
                clock: self.clock,
                service_clock,
                max_clock_skew: self.max_clock_skew,
                min_lease,
                allow_global_table: self.allow_global_table,
                table_checked: std::sync::OnceLock::new(),
                request_names,
            }),
        })
    }
}
