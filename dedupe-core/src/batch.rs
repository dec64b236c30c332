//! `claim_many`'s bookkeeping for keys repeated inside one batch.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::claim::{ClaimOptions, ClaimOutcome};
use crate::error::{Error, Result};
use crate::key::Key;

/// The keys of one `claim_many` call, each distinct key once.
///
/// A store claims [`distinct`](Self::distinct) keys in its own way (one statement,
/// one pipeline, concurrent requests) and hands the answers, in the same order, to
/// [`answers`](Self::answers), which spreads them back over the batch: a key's
/// first place gets its answer; a later place gets what a claim right after it
/// would (`InFlight` on the lease just won, or the same lease again when the
/// claim carries a claim id).
///
/// ```
/// use dedupe_core::backend::BatchKeys;
/// use dedupe_core::{ClaimOptions, ClaimOutcome, DedupeStore, Key, MemoryStore};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let (a, b) = (Key::new("s", "a")?, Key::new("s", "b")?);
/// let keys = [a.clone(), b, a];
/// let opts = ClaimOptions::default();
/// let batch = BatchKeys::new(&keys);
/// assert_eq!(batch.distinct().len(), 2);
/// let mut first = Vec::new();
/// for key in batch.distinct() {
///     first.push(store.claim(key, &opts).await?);
/// }
/// let answers = batch.answers(first, &opts)?;
/// assert!(matches!(answers[2], ClaimOutcome::InFlight { .. }));
/// # Ok::<(), dedupe_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug)]
pub struct BatchKeys<'a> {
    distinct: Vec<&'a Key>,
    /// Each distinct key's `namespace:id` text to its place in `distinct`
    /// (the text is the key: the namespace holds no `:`), hashed with
    /// foldhash, seeded per map, as SipHash showed in profiles of batches.
    index: HashMap<&'a str, usize, RandomState>,
    /// For each key of the batch, its index in `distinct`.
    slots: Vec<usize>,
}

impl<'a> BatchKeys<'a> {
    /// Indexes a batch.
    pub fn new(keys: &'a [Key]) -> Self {
        let mut index: HashMap<&str, usize, RandomState> =
            HashMap::with_capacity_and_hasher(keys.len(), RandomState::default());
        let mut distinct = Vec::with_capacity(keys.len());
        let slots = keys
            .iter()
            .map(|key| {
                *index.entry(key.joined()).or_insert_with(|| {
                    distinct.push(key);
                    distinct.len() - 1
                })
            })
            .collect();
        Self {
            distinct,
            index,
            slots,
        }
    }

    /// Each distinct key once, in order of first appearance.
    pub fn distinct(&self) -> &[&'a Key] {
        &self.distinct
    }

    /// The position of `key` in [`distinct`](Self::distinct), for stores whose
    /// answers come back keyed rather than in order.
    pub fn position(&self, key: &Key) -> Option<usize> {
        self.position_of(key.joined())
    }

    /// The position of the key whose `namespace:id` text
    /// ([`Key::joined`]) is `joined`, for stores that read keys back in that
    /// form.
    ///
    /// ```
    /// use dedupe_core::backend::BatchKeys;
    /// use dedupe_core::Key;
    /// let keys = [Key::new("s", "a")?, Key::new("s", "b:c")?];
    /// let batch = BatchKeys::new(&keys);
    /// assert_eq!(batch.position_of("s:b:c"), Some(1));
    /// assert_eq!(batch.position_of("s:b"), None);
    /// # Ok::<(), dedupe_core::KeyError>(())
    /// ```
    pub fn position_of(&self, joined: &str) -> Option<usize> {
        self.index.get(joined).copied()
    }

    /// Spreads the answers of the distinct keys (same order as
    /// [`distinct`](Self::distinct)) over the whole batch.
    pub fn answers(
        &self,
        distinct_answers: Vec<ClaimOutcome>,
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        if distinct_answers.len() != self.distinct.len() {
            return Err(Error::fatal(
                format!(
                    "claim_many got {} answers for {} distinct keys",
                    distinct_answers.len(),
                    self.distinct.len()
                ),
                None,
            ));
        }
        if self.slots.len() == self.distinct.len() {
            // No key repeats: the answers are already in the batch's order.
            return Ok(distinct_answers);
        }
        let mut firsts: Vec<Option<ClaimOutcome>> =
            distinct_answers.into_iter().map(Some).collect();
        // Where each distinct key's first answer went in the batch's answers.
        let mut placed = vec![usize::MAX; firsts.len()];
        let mut answers: Vec<ClaimOutcome> = Vec::with_capacity(self.slots.len());
        for &slot in &self.slots {
            let answer = match firsts[slot].take() {
                Some(first) => {
                    placed[slot] = answers.len();
                    first
                }
                None => repeat_answer(&answers[placed[slot]], opts),
            };
            answers.push(answer);
        }
        Ok(answers)
    }
}

/// What a second claim of a key in the same batch answers, given the first one's
/// answer: the record the first left behind, seen again.
fn repeat_answer(first: &ClaimOutcome, opts: &ClaimOptions) -> ClaimOutcome {
    match first {
        ClaimOutcome::Claimed(lease) if opts.claim_id.is_none() => ClaimOutcome::InFlight {
            deadline: lease.deadline,
            attempt: lease.attempt,
        },
        other => other.clone(),
    }
}
