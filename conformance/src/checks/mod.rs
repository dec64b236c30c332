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
    ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Fingerprint, Key, Lease, Record,
    RecordState, RecordStateKind, Retention, MAX_CLAIM_ID_BYTES, MAX_ID_BYTES, MAX_NAMESPACE_BYTES,
    MAX_TTL,
};
use tokio::sync::Barrier;

use crate::harness::{CheckResult, Failure, StoreFactory, Verdict};

/// Lease used where a check needs it to pass quickly.
pub const SHORT_TTL: Duration = Duration::from_millis(250);
/// Lease or retention used where a check needs it to outlive the check.
pub const LONG_TTL: Duration = Duration::from_secs(600);
/// Tasks racing on one key in the race checks.
pub const RACERS: usize = 32;
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

/// How far apart two deadlines that should be the same instant may be when one
/// was stored in milliseconds and the other computed by the test.
const PRECISION: Duration = Duration::from_millis(3);
/// The largest clock offset between the test machine and the store the exact
/// checks accept (a store on another machine must have its clock synchronised).
const MAX_SKEW: Duration = Duration::from_secs(1);

/// Signed milliseconds from `b` to `a` (positive when `a` is later).
fn signed_ms(a: SystemTime, b: SystemTime) -> f64 {
    match a.duration_since(b) {
        Ok(d) => d.as_secs_f64() * 1e3,
        Err(e) => -e.duration().as_secs_f64() * 1e3,
    }
}

/// The store's clock against the test's, measured once per fixture from the
/// deadlines of probe leases, so deadline checks can be exact to a few
/// milliseconds instead of allowing seconds of slack.
#[derive(Debug, Clone, Copy)]
struct Clock {
    /// Bounds of `store clock - test clock`, in milliseconds.
    low: f64,
    high: f64,
}

impl Clock {
    /// Claims three probe keys with a known TTL, some tens of milliseconds apart;
    /// each bounds the offset by the time before and after its call. The bounds
    /// must agree (a store that rounds deadlines to seconds, or adds time of its
    /// own, gives probes that disagree) and stay within [`MAX_SKEW`].
    async fn measure(store: &dyn DedupeStore, label: &str) -> Result<Self, Failure> {
        let ttl = Duration::from_secs(60);
        let slack = PRECISION.as_secs_f64() * 1e3;
        let (mut low, mut high) = (f64::MIN, f64::MAX);
        for (i, pause) in [0u64, 37, 71].into_iter().enumerate() {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let k = key(&format!("clock-probe-{label}-{i}"))?;
            let before = SystemTime::now();
            let lease = must_claim(store, &k, &opts(ttl)).await?;
            let after = SystemTime::now();
            let base = lease.deadline - ttl;
            let (lo, hi) = (
                signed_ms(base, after) - slack,
                signed_ms(base, before) + slack,
            );
            ensure!(
                lo <= high && hi >= low,
                "probe lease {i} puts the store's clock {lo:.1}..{hi:.1} ms from the test's, \
                 earlier probes said {low:.1}..{high:.1} ms: deadlines are not now + ttl to the \
                 millisecond (rounded to seconds? computed from another time?)"
            );
            (low, high) = (low.max(lo), high.min(hi));
            store.release(&lease).await?;
        }
        let skew = MAX_SKEW.as_secs_f64() * 1e3;
        ensure!(
            low > -skew && high < skew,
            "the store's clock is {low:.0}..{high:.0} ms from the test machine's, over {MAX_SKEW:?}"
        );
        Ok(Self { low, high })
    }

    /// The first instant on the test's clock at which the store's clock has
    /// surely passed `deadline` by `by`, whatever the offset within the bounds.
    fn surely_past(&self, deadline: SystemTime, by: Duration) -> SystemTime {
        let shift = by.as_secs_f64() - self.low / 1e3;
        if shift >= 0.0 {
            deadline + Duration::from_secs_f64(shift)
        } else {
            deadline - Duration::from_secs_f64(-shift)
        }
    }

    /// The most the store's clock can be past `deadline` at test time `at`, in ms.
    fn at_most_past(&self, deadline: SystemTime, at: SystemTime) -> f64 {
        signed_ms(at, deadline) + self.high
    }

    /// Checks that `deadline`, reported by a call made between `before` and
    /// `after` on the test's clock, is that call's `now + ttl` on the store's.
    fn expect(
        &self,
        what: &str,
        deadline: SystemTime,
        before: SystemTime,
        after: SystemTime,
        ttl: Duration,
    ) -> Result<(), Failure> {
        let lo = signed_ms(deadline, before + ttl);
        let hi = signed_ms(deadline, after + ttl);
        // deadline - ttl - test time must be a possible clock offset.
        ensure!(
            hi <= self.high && lo >= self.low,
            "{what}: deadline {deadline:?} is {:.1} ms from now + {ttl:?} (the store's clock is \
             {:.1}..{:.1} ms from the test's)",
            (lo + hi) / 2.0 - (self.low + self.high) / 2.0,
            self.low,
            self.high
        );
        Ok(())
    }

    /// The test-clock instant at which the store's clock reads `t`, at the latest.
    /// (With the store's clock behind the test's, that is later than `t`;
    /// ahead, `t` itself is a safe, slightly late, answer.)
    fn local_latest(&self, t: SystemTime) -> SystemTime {
        t + Duration::from_secs_f64((-self.low).max(0.0) / 1e3)
    }
}

/// Sleeps until shortly before `at`, then yields until it has come: timers have
/// a millisecond's grain, the races below need finer.
async fn until(at: SystemTime) {
    if let Ok(wait) = at.duration_since(SystemTime::now()) {
        if wait > Duration::from_millis(2) {
            tokio::time::sleep(wait - Duration::from_millis(2)).await;
        }
    }
    while SystemTime::now() < at {
        tokio::task::yield_now().await;
    }
}

/// Sleeps until the test clock is past `deadline` on the store's clock too.
async fn wait_past_on(clock: &Clock, deadline: SystemTime) -> Result<(), Failure> {
    wait_past(clock.local_latest(deadline)).await
}

/// A pseudo-random byte string of `len` bytes (every byte value occurs), so a
/// truncation or re-encoding anywhere shows.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| ((i ^ seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// The record of `key`, which must be live.
async fn live_record(store: &dyn DedupeStore, key: &Key, when: &str) -> Result<Record, Failure> {
    store
        .get(key)
        .await?
        .ok_or_else(|| Failure::new(format!("get of {key} found nothing {when}")))
}

/// A small deterministic generator (xorshift64*), so a failing sequence replays
/// exactly.
struct Sequence(u64);

impl Sequence {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

// After the helpers and `ensure!`, which the checks use.
mod attacks;
mod faults;
mod inbox;
mod lifecycle;
mod limits;
mod races;
mod reference;
mod rules;

pub use attacks::*;
pub use faults::*;
pub use inbox::*;
pub use lifecycle::*;
pub use limits::*;
pub use races::*;
pub use reference::*;
pub use rules::*;
