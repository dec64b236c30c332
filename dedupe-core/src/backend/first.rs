//! Whether a store's recent claims met records already there.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// A count, shared by a store's clones, of whether its recent claims met a
/// record already there (a duplicate, a claim in flight, an expired lease):
/// 0 to [`LIMIT`](Self::LIMIT), one up for a claim that met one, one down
/// for one that did not. A store that has a cheaper first statement for each
/// case (a bare insert for new keys, a plain read for keys with records)
/// picks by [`expect_records`](Self::expect_records); the count saturates,
/// so a long storm is forgotten within a few claims. The Postgres and MySQL
/// stores use it.
#[derive(Debug, Default)]
pub struct FirstStatement(AtomicU8);

impl FirstStatement {
    /// The count's top.
    pub const LIMIT: u8 = 8;

    /// Whether most recent claims met records: the next claim should read
    /// first.
    pub fn expect_records(&self) -> bool {
        self.0.load(Relaxed) > Self::LIMIT / 2
    }

    /// Counts a claim that met a record (`true`) or did not.
    pub fn note(&self, had_record: bool) {
        let _ = self.0.fetch_update(Relaxed, Relaxed, |n| {
            Some(if had_record {
                n.saturating_add(1).min(Self::LIMIT)
            } else {
                n.saturating_sub(1)
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::FirstStatement;

    /// A handle starts out expecting new keys, turns to reading first once
    /// most recent claims met records, and back once they stop; the count
    /// saturates, so a long storm is forgotten within a few claims.
    #[test]
    fn recent_claims_pick_the_first_statement() {
        let seen = FirstStatement::default();
        assert!(!seen.expect_records(), "a new handle expects new keys");
        for _ in 0..FirstStatement::LIMIT / 2 {
            seen.note(true);
        }
        assert!(!seen.expect_records(), "half of the count is not most");
        seen.note(true);
        assert!(seen.expect_records(), "most recent claims met records");
        for _ in 0..1000 {
            seen.note(true);
        }
        for _ in 0..FirstStatement::LIMIT / 2 {
            seen.note(false);
        }
        assert!(
            !seen.expect_records(),
            "a storm of 1,000 is forgotten after {} new keys",
            FirstStatement::LIMIT / 2
        );
        for _ in 0..1000 {
            seen.note(false);
        }
        seen.note(true);
        assert!(!seen.expect_records());
    }
}
