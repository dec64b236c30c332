//! The two clocks a DynamoDB store depends on: the caller's, which decides
//! every deadline (DynamoDB has no server time in expressions), and the
//! service's, which the caller's is measured against from the `Date` header of
//! every response, so that a claim made with a clock that is far off is
//! refused instead of taking a lease over early or handing out one that ends
//! early.
//!
//! A `Date` header has one-second resolution: the service's clock read `D`
//! (truncated) at some instant between sending the request and receiving the
//! answer. Against the monotonic clock that bounds (service time - monotonic
//! time) to the interval `(D - received, D + 1 s - sent)`, which holds the true
//! value whatever the delays: the guard refuses only when the whole interval
//! lies beyond the tolerance, so it never refuses an accurate clock, and lets
//! a skew through only while it is within the tolerance plus the interval's
//! width (1 s plus the round trip). Kept against the monotonic clock, a
//! reading stays valid when the caller's clock jumps (an NTP step, a VM
//! resumed): the jump shows at the next check.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;
use aws_sdk_dynamodb::primitives::{DateTime, DateTimeFormat};
use aws_smithy_types::config_bag::{Storable, StoreReplace};
use dedupe_core::backend::{self, to_millis};

/// The clock that decides deadlines.
#[derive(Clone, Default)]
pub(crate) struct Clock(Option<Arc<dyn Fn() -> SystemTime + Send + Sync>>);

impl Clock {
    pub(crate) fn custom(clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(clock)))
    }

    pub(crate) fn now_ms(&self) -> i64 {
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

/// How old a reading may be before a claim measures again first.
pub(crate) const READING_LIFETIME: Duration = Duration::from_secs(300);

/// The last reading of the service's clock.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// No response yet.
    Never,
    /// Responses come without a `Date` header (some emulators): nothing to
    /// measure against.
    NoDate,
    /// (service epoch ms - ms since `origin`) lies in `lo..hi`, as of `at`.
    Seen { lo: i64, hi: i64, at: Instant },
}

/// Where the service's clock stands, from the responses the store's client
/// received (shared by the store and the interceptor on its client).
#[derive(Debug)]
pub(crate) struct ServiceClock {
    origin: Instant,
    reading: Mutex<Reading>,
}

/// What a check of the caller's clock against the service's found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offset {
    /// No reading, or one older than [`READING_LIFETIME`].
    Unmeasured,
    /// The service sends no `Date` header.
    Unmeasurable,
    /// (service clock - caller's clock) in ms lies in `lo..hi`.
    Within { lo: i64, hi: i64 },
}

impl ServiceClock {
    pub(crate) fn new() -> Self {
        Self {
            origin: Instant::now(),
            reading: Mutex::new(Reading::Never),
        }
    }

    fn since_origin(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(i64::MAX)
    }

    /// Takes a response: sent at `sent`, received at `received`, with the
    /// service's `Date` (epoch ms) when it had one.
    pub(crate) fn record(&self, sent: Instant, received: Instant, date_ms: Option<i64>) {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        *reading = match (date_ms, *reading) {
            (Some(date), _) => Reading::Seen {
                lo: date - self.since_origin(received),
                hi: date + 1000 - self.since_origin(sent),
                at: received,
            },
            // A response without a date keeps a reading that had one.
            (None, seen @ Reading::Seen { .. }) => seen,
            (None, _) => Reading::NoDate,
        };
    }

    /// The offset of a caller's clock that reads `local_ms` now.
    pub(crate) fn offset(&self, local_ms: i64) -> Offset {
        let reading = *self.reading.lock().unwrap_or_else(|e| e.into_inner());
        match reading {
            Reading::Never => Offset::Unmeasured,
            Reading::NoDate => Offset::Unmeasurable,
            Reading::Seen { at, .. } if at.elapsed() > READING_LIFETIME => Offset::Unmeasured,
            Reading::Seen { lo, hi, .. } => {
                let now = self.since_origin(Instant::now());
                Offset::Within {
                    lo: lo + now - local_ms,
                    hi: hi + now - local_ms,
                }
            }
        }
    }
}

/// Judges an offset against the tolerance: an error when the caller's clock
/// is surely further off than `tolerated`.
pub(crate) fn judge(offset: Offset, tolerated: Duration) -> dedupe_core::Result<()> {
    let Offset::Within { lo, hi } = offset else {
        return Ok(());
    };
    let limit = i64::try_from(tolerated.as_millis()).unwrap_or(i64::MAX);
    let skew = |ms: i64, ahead| dedupe_core::Error::ClockSkew {
        at_least: Duration::from_millis(ms.unsigned_abs()),
        ahead,
        tolerated,
    };
    if lo > limit {
        // The service's clock is ahead of ours by more than `lo`.
        Err(skew(lo, false))
    } else if hi < -limit {
        Err(skew(hi, true))
    } else {
        Ok(())
    }
}

/// When the current attempt went out (kept in the attempt's config bag).
#[derive(Debug, Clone, Copy)]
struct SentAt(Instant);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

/// Reads the `Date` of every response the client receives, errors included,
/// into a [`ServiceClock`].
#[derive(Debug)]
pub(crate) struct DateReader(pub(crate) Arc<ServiceClock>);

impl Intercept for DateReader {
    fn name(&self) -> &'static str {
        "dedupe-dynamo Date reader"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state().store_put(SentAt(Instant::now()));
        Ok(())
    }

    fn read_after_transmit(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let received = Instant::now();
        let Some(&SentAt(sent)) = cfg.load::<SentAt>() else {
            return Ok(());
        };
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|d| DateTime::from_str(d, DateTimeFormat::HttpDate).ok())
            .and_then(|d| d.to_millis().ok());
        self.0.record(sent, received, date);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_accurate_clock_is_never_refused_and_a_far_one_always_is() {
        let clock = ServiceClock::new();
        let sent = Instant::now();
        let local = backend::now_millis();
        // The service's Date truncates its clock, which reads what ours does.
        clock.record(sent, Instant::now(), Some(local - local.rem_euclid(1000)));
        let tolerated = Duration::ZERO;
        assert!(judge(clock.offset(backend::now_millis()), tolerated).is_ok());
        // Our clock 90 s behind: the service is ahead by at least ~89 s.
        let behind = judge(clock.offset(backend::now_millis() - 90_000), tolerated);
        match behind {
            Err(dedupe_core::Error::ClockSkew {
                at_least, ahead, ..
            }) => {
                assert!(!ahead);
                assert!(at_least >= Duration::from_secs(88), "{at_least:?}");
            }
            other => panic!("{other:?}"),
        }
        let ahead = judge(
            clock.offset(backend::now_millis() + 90_000),
            Duration::from_secs(1),
        );
        assert!(
            matches!(
                ahead,
                Err(dedupe_core::Error::ClockSkew { ahead: true, .. })
            ),
            "{ahead:?}"
        );
        // Off by exactly the tolerance: let through, whatever the sub-second.
        assert!(judge(
            clock.offset(backend::now_millis() + 1000),
            Duration::from_secs(1)
        )
        .is_ok());
    }

    #[test]
    fn no_date_means_unmeasurable_until_a_date_comes() {
        let clock = ServiceClock::new();
        assert_eq!(clock.offset(0), Offset::Unmeasured);
        clock.record(Instant::now(), Instant::now(), None);
        assert_eq!(clock.offset(0), Offset::Unmeasurable);
        let now = backend::now_millis();
        clock.record(Instant::now(), Instant::now(), Some(now - now % 1000));
        assert!(matches!(clock.offset(now), Offset::Within { .. }));
        clock.record(Instant::now(), Instant::now(), None);
        assert!(matches!(clock.offset(now), Offset::Within { .. }));
    }
}
