//! Items this process's workers finished, per namespace and minute, for the
//! dashboard's "last minutes" (the store keeps no history of completions;
//! each server counts its own).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Minutes kept.
pub(crate) const MINUTES: usize = 15;

/// Per namespace, a ring of per-minute counts.
#[derive(Default)]
pub(crate) struct Throughput {
    rings: Mutex<HashMap<String, Ring>>,
}

#[derive(Default, Clone)]
struct Ring {
    /// The minute (since the epoch) of each slot, and its count.
    slots: [(u64, u64); MINUTES],
}

fn minute(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() / 60
}

impl Throughput {
    /// One item of `namespace` finished now.
    pub(crate) fn finished(&self, namespace: &str) {
        self.finished_at(namespace, SystemTime::now());
    }

    fn finished_at(&self, namespace: &str, at: SystemTime) {
        let now = minute(at);
        let mut rings = self
            .rings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = &mut rings.entry(namespace.to_string()).or_default().slots
            [(now % MINUTES as u64) as usize];
        if slot.0 != now {
            *slot = (now, 0);
        }
        slot.1 += 1;
    }

    /// The counts of the last [`MINUTES`] minutes, oldest first (the last is
    /// the minute under way).
    pub(crate) fn last_minutes(&self, namespace: &str) -> [u64; MINUTES] {
        self.last_minutes_at(namespace, SystemTime::now())
    }

    fn last_minutes_at(&self, namespace: &str, at: SystemTime) -> [u64; MINUTES] {
        let now = minute(at);
        let rings = self
            .rings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = [0; MINUTES];
        if let Some(ring) = rings.get(namespace) {
            for (i, out) in out.iter_mut().enumerate() {
                let m = now + 1 + i as u64 - MINUTES as u64;
                let slot = ring.slots[(m % MINUTES as u64) as usize];
                if slot.0 == m {
                    *out = slot.1;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn counts_fall_in_their_minute_and_age_out() {
        let t = Throughput::default();
        let start = UNIX_EPOCH + Duration::from_secs(60 * 1_000_000);
        t.finished_at("stripe", start);
        t.finished_at("stripe", start + Duration::from_secs(59));
        t.finished_at("stripe", start + Duration::from_secs(60));
        t.finished_at("github", start);
        let later = start + Duration::from_secs(60);
        let seen = t.last_minutes_at("stripe", later);
        assert_eq!(seen[MINUTES - 2..], [2, 1]);
        assert_eq!(seen.iter().sum::<u64>(), 3);
        assert_eq!(t.last_minutes_at("github", later)[MINUTES - 2], 1);
        // Fifteen minutes on, the old ones are gone, though their slots are
        // reused only when written.
        let gone = start + Duration::from_secs(60 * MINUTES as u64 + 60);
        assert_eq!(t.last_minutes_at("stripe", gone).iter().sum::<u64>(), 0);
        assert_eq!(t.last_minutes_at("unknown", later), [0; MINUTES]);
    }
}
