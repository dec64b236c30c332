//! How the suite gets stores to test: a factory of isolated fixtures.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dedupe_core::{DedupeStore, Error, Inbox, MemoryStore};

/// Makes a new, empty store for each check, so checks never see each other's
/// records (a fresh temp file, database, schema, key prefix or table).
#[async_trait]
pub trait StoreFactory: Send + Sync {
    /// Creates an isolated, empty store and returns the fixture that opens
    /// handles onto it.
    async fn create(&self) -> Result<Box<dyn Fixture>, Error>;

    /// How much work the heaviest checks do; [`Scale::Full`] unless the store
    /// under test is an emulator that serves only a few hundred requests a
    /// second. The report names the scale, so a reduced run never passes for a
    /// full one.
    fn scale(&self) -> Scale {
        Scale::Full
    }
}

/// How much work the heaviest checks do (races, big batches, the model-based
/// run). Every check runs at either scale; only the counts change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scale {
    /// 32 racers for 100 rounds, 10,000 distinct keys, 10 rounds of racing
    /// batches, and 5 seeds of the model-based run: for every real store.
    #[default]
    Full,
    /// A quarter of the race rounds, 1,000 distinct keys, 3 rounds of racing
    /// batches and 2 seeds: for emulators (moto, DynamoDB Local) that serve
    /// 200 requests a second, where the full scale takes minutes per check.
    Reduced,
}

impl Scale {
    /// Race rounds of the single-winner checks.
    pub fn race_rounds(self) -> usize {
        match self {
            Scale::Full => 100,
            Scale::Reduced => 25,
        }
    }

    /// Distinct keys of the big-batch check.
    pub fn distinct_keys(self) -> usize {
        match self {
            Scale::Full => dedupe_core::MAX_BATCH_KEYS,
            Scale::Reduced => 1_000,
        }
    }

    /// Rounds of batches racing batches.
    pub fn batch_rounds(self) -> usize {
        match self {
            Scale::Full => 10,
            Scale::Reduced => 3,
        }
    }

    /// Seeds the model-based run starts with (it draws more until every kind of
    /// answer showed up).
    pub fn model_seeds(self) -> usize {
        match self {
            Scale::Full => 5,
            Scale::Reduced => 2,
        }
    }
}

impl fmt::Display for Scale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scale::Full => "full scale",
            Scale::Reduced => "reduced scale (an emulator)",
        })
    }
}

/// One isolated store under test.
#[async_trait]
pub trait Fixture: Send + Sync {
    /// The handle most checks use.
    fn store(&self) -> Arc<dyn DedupeStore>;

    /// A further handle onto the same records with its own connection (or pool)
    /// where the store has them, so races go through separate connections rather
    /// than one shared lock in the client.
    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error>;

    /// A further handle whose way to the records the fixture can break for a
    /// moment (network stores: a loopback proxy the fixture owns; SQLite: another
    /// connection holding the file's write lock), for the check that errors are
    /// never answers (rule 7). The default, `None`, reports that check as skipped.
    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        Ok(None)
    }

    /// The store's inbox, on the same records as [`store`](Self::store), when
    /// it offers one. The default, `None`, reports the inbox checks as
    /// skipped.
    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        None
    }

    /// A further handle onto the same inbox with its own connection (or
    /// pool), for the racing inbox checks. The default is [`inbox`](Self::inbox).
    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        Ok(self.inbox())
    }
}

/// Breaks and heals the way between a [`FaultyHandle`]'s store and its records.
#[async_trait]
pub trait FaultSwitch: Send + Sync {
    /// Breaks the connection (`true`: every call through the handle should now
    /// fail) or heals it (`false`).
    async fn set_broken(&self, broken: bool) -> Result<(), Error>;

    /// Lets the next request through to the store, loses its answer on the way
    /// back and closes that connection, once: the driver sees a dropped
    /// connection after the store did the work, and may send the request again
    /// on a new one. `Ok(false)` (the default) when the switch cannot; the
    /// check of re-sent requests is then skipped.
    async fn lose_next_answer(&self) -> Result<bool, Error> {
        Ok(false)
    }

    /// After a call made under [`lose_next_answer`](Self::lose_next_answer):
    /// whether an answer was indeed lost (a call the store answered from its
    /// own cache, with no request, loses none), disarming the switch either way.
    async fn answer_was_lost(&self) -> Result<bool, Error> {
        Ok(false)
    }
}

/// A handle onto the fixture's records that can be cut off, from
/// [`Fixture::faulty_handle`].
pub struct FaultyHandle {
    /// The handle; configure it with a short timeout.
    pub store: Arc<dyn DedupeStore>,
    /// What breaks and heals its connection.
    pub switch: Box<dyn FaultSwitch>,
    /// The longest one call through the broken handle may take before it must
    /// have failed (its configured timeout, plus what the store documents).
    pub bound: Duration,
}

impl fmt::Debug for FaultyHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyHandle")
            .field("store", &self.store)
            .field("bound", &self.bound)
            .finish_non_exhaustive()
    }
}

/// The factory of [`MemoryStore`]s; handles of one fixture share its records.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryFactory;

struct MemoryFixture(MemoryStore);

#[async_trait]
impl StoreFactory for MemoryFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        Ok(Box::new(MemoryFixture(MemoryStore::new())))
    }
}

#[async_trait]
impl Fixture for MemoryFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.0.clone())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(self.0.clone()))
    }

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        Some(Arc::new(self.0.clone()))
    }
}

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    message: String,
}

impl Failure {
    /// A failure with a message saying what the store did wrong.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let mut message = format!("unexpected store error: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(&format!(": {s}"));
            source = s.source();
        }
        Failure::new(message)
    }
}

/// A check that did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every assertion held.
    Passed,
    /// The store lacks a capability the check needs; nothing was asserted.
    Skipped(String),
}

/// What one check answers.
pub type CheckResult = Result<Verdict, Failure>;
