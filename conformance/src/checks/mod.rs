//! Every rule of the store contract as a named check.
//!
//! Each check takes a [`StoreFactory`], creates its own empty store, and answers
//! [`Verdict::Passed`], [`Verdict::Skipped`] or a [`Failure`] that says what the
//! store did wrong. This file holds the registry ([`CHECKS`]) and the helpers the
//! checks share; the checks themselves are in `rules.rs` (one rule of the
//! contract each), `races.rs` (many handles at the same instant) and
//! `reference.rs` (a store against the reference model).

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedupe_core::{
    ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease, RecordState,
    RecordStateKind, MAX_ID_BYTES, MAX_NAMESPACE_BYTES,
};
use tokio::sync::Barrier;

use crate::harness::{CheckResult, Failure, StoreFactory, Verdict};

/// Lease used where a check needs it to pass quickly.
pub const SHORT_TTL: Duration = Duration::from_millis(250);
/// Lease or retention used where a check needs it to outlive the check.
pub const LONG_TTL: Duration = Duration::from_secs(600);
/// Tasks racing on one key in the race checks.
pub const RACERS: usize = 32;
/// Rounds of each race.
pub const ROUNDS: usize = 100;
/// Slack allowed between the caller's clock and a store's clock when judging a
/// deadline the store reported.
const CLOCK_SLACK: Duration = Duration::from_secs(2);
/// Margin past a deadline before a check relies on it having passed.
const PAST_MARGIN: Duration = Duration::from_millis(30);

type CheckFuture<'a> = Pin<Box<dyn Future<Output = CheckResult> + Send + 'a>>;

/// A named check in the suite.
#[derive(Clone, Copy)]
pub struct Check {
    /// Its name, as the test the [`suite!`](crate::suite) macro generates.
    pub name: &'static str,
    /// Runs it.
    pub run: for<'a> fn(&'a dyn StoreFactory) -> CheckFuture<'a>,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish()
    }
}

crate::__with_check_names!(__check_table!);

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(Failure::new(format!($($arg)+)));
        }
    };
}

fn key(id: &str) -> Result<Key, Failure> {
    Key::new("conf", id).map_err(|e| Failure::new(format!("test key {id:?} refused: {e}")))
}

fn opts(ttl: Duration) -> ClaimOptions {
    ClaimOptions::new(ttl)
}

async fn must_claim(
    store: &dyn DedupeStore,
    key: &Key,
    opts: &ClaimOptions,
) -> Result<Lease, Failure> {
    match store.claim(key, opts).await? {
        ClaimOutcome::Claimed(lease) => {
            ensure!(
                &lease.key == key,
                "Claimed lease names key {} for a claim of {key}",
                lease.key
            );
            Ok(lease)
        }
        other => Err(Failure::new(format!(
            "claim of {key} answered {other:?}, expected Claimed"
        ))),
    }
}

/// Sleeps until `deadline` (of a short lease or retention) has passed by a small
/// margin, on the caller's clock. A deadline further away than a short TTL plus the
/// clock slack is itself a failure: the store did not honour the TTL asked for.
async fn wait_past(deadline: SystemTime) -> Result<(), Failure> {
    let target = deadline + PAST_MARGIN;
    if let Ok(left) = target.duration_since(SystemTime::now()) {
        ensure!(
            left <= SHORT_TTL + CLOCK_SLACK,
            "a deadline set {SHORT_TTL:?} ahead is {left:?} away"
        );
        tokio::time::sleep(left).await;
    }
    Ok(())
}

fn expect_lease_lost(
    what: &str,
    result: Result<impl std::fmt::Debug, Error>,
) -> Result<(), Failure> {
    match result {
        Err(Error::LeaseLost { .. }) => Ok(()),
        other => Err(Failure::new(format!(
            "{what} answered {other:?}, expected LeaseLost"
        ))),
    }
}

fn deadline_near(
    what: &str,
    deadline: SystemTime,
    before: SystemTime,
    after: SystemTime,
    ttl: Duration,
) -> Result<(), Failure> {
    let low = before + ttl - CLOCK_SLACK;
    let high = after + ttl + CLOCK_SLACK;
    ensure!(
        deadline >= low && deadline <= high,
        "{what} deadline {deadline:?} is not now + {ttl:?} (expected between {low:?} and {high:?})"
    );
    Ok(())
}

// After the helpers and `ensure!`, which the checks use.
mod races;
mod reference;
mod rules;

pub use races::*;
pub use reference::*;
pub use rules::*;
