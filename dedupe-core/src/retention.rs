//! How long done records are kept.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::claim::check_ttl;
use crate::error::Result;

/// How long done records are kept, with per-namespace overrides.
///
/// The default is [`Retention::DEFAULT`], 35 days: a done record must outlive the
/// longest window in which a provider can send the event again. Stripe retries
/// automatically for 3 days, lets an operator resend from the dashboard for 15 and
/// from its CLI for 30; GitHub redelivers for 3. Thirty days plus a margin for
/// clock skew and slow operators gives 35. A record kept too short turns a late
/// resend into a second charge; one kept too long costs a few bytes.
///
/// ```
/// use std::time::Duration;
/// use dedupe_core::Retention;
/// let retention = Retention::default().with_namespace("github", Duration::from_secs(7 * 86_400))?;
/// assert_eq!(retention.for_namespace("github"), Duration::from_secs(7 * 86_400));
/// assert_eq!(retention.for_namespace("stripe"), Retention::DEFAULT);
/// # Ok::<(), dedupe_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    default: Duration,
    per_namespace: BTreeMap<String, Duration>,
}

impl Retention {
    /// 35 days (see the type's docs for the reasoning).
    pub const DEFAULT: Duration = Duration::from_secs(35 * 24 * 3600);

    /// A policy with the given default and no overrides.
    pub fn new(default: Duration) -> Result<Self> {
        check_ttl("retention", default)?;
        Ok(Self {
            default,
            per_namespace: BTreeMap::new(),
        })
    }

    /// Overrides the retention of one namespace.
    pub fn with_namespace(mut self, namespace: impl Into<String>, keep: Duration) -> Result<Self> {
        check_ttl("retention", keep)?;
        self.per_namespace.insert(namespace.into(), keep);
        Ok(self)
    }

    /// The retention of a namespace.
    pub fn for_namespace(&self, namespace: &str) -> Duration {
        self.per_namespace
            .get(namespace)
            .copied()
            .unwrap_or(self.default)
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            default: Self::DEFAULT,
            per_namespace: BTreeMap::new(),
        }
    }
}
