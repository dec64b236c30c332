//! How an idle [`InboxWorker`](crate::InboxWorker) learns that work became
//! due: a signal from the store where it has one, and a poll behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// How a store wakes the idle workers of one namespace
/// ([`Inbox::wake`](crate::Inbox::wake)).
///
/// A wake-up is a hint, never the only way to work: a worker still polls,
/// and one that missed a signal (a dropped connection, a change made where
/// the signal does not reach) finds the item at its next poll. Nothing is
/// lost to a missed signal; it costs at most the poll.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Wake {
    /// Raised (`notify_waiters`) when an item of the namespace may have
    /// become due now: accepted, given back, replayed, or its namespace
    /// resumed. `None`: nothing wakes a worker; it polls.
    pub signal: Option<Arc<Notify>>,
    /// The signal is pushed by the store, so changes made by any process
    /// raise it (Postgres `LISTEN/NOTIFY`, Redis pub/sub). `false`: only
    /// changes through this handle and its clones raise it (SQLite, memory),
    /// and other processes' changes are found by the poll.
    pub everywhere: bool,
    /// Each read costs money (DynamoDB bills every take): a worker that
    /// keeps finding nothing polls less and less often, up to eight times
    /// its interval, and looks again at once when it finds work or is
    /// signalled.
    pub idle_backoff: bool,
}

impl Wake {
    /// Nothing wakes a worker: it polls at its interval.
    pub fn poll() -> Self {
        Self::default()
    }

    /// Changes through this handle and its clones raise `signal`; other
    /// processes' changes are found by the poll.
    pub fn in_process(signal: Arc<Notify>) -> Self {
        Self {
            signal: Some(signal),
            ..Self::default()
        }
    }

    /// The store pushes every process's changes to `signal`; the poll only
    /// covers a signal lost on the way.
    pub fn pushed(signal: Arc<Notify>) -> Self {
        Self {
            signal: Some(signal),
            everywhere: true,
            ..Self::default()
        }
    }

    /// Sets [`Wake::idle_backoff`].
    pub fn with_idle_backoff(mut self, yes: bool) -> Self {
        self.idle_backoff = yes;
        self
    }
}

/// The wake-up signals of one store handle and its clones, one per topic (a
/// namespace, or whatever names a namespace in the store's notifications),
/// for a store implementing [`Inbox::wake`](crate::Inbox::wake).
///
/// [`signal`](Self::signal) hands out a topic's signal (made on first use);
/// [`raise`](Self::raise) wakes the workers waiting on it, and is free when
/// no worker ever asked for the topic.
///
/// ```
/// use dedupe_core::backend::Wakeups;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().expect("in the test").block_on(async {
/// let wakeups = Wakeups::default();
/// let signal = wakeups.signal("stripe");
/// let woken = signal.notified();
/// tokio::pin!(woken);
/// woken.as_mut().enable();
/// wakeups.raise("github"); // another topic: nothing
/// wakeups.raise("stripe");
/// woken.await;
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct Wakeups {
    topics: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
}

impl Wakeups {
    /// The signal of `topic`, the same one for every call.
    pub fn signal(&self, topic: &str) -> Arc<Notify> {
        let mut topics = self.topics.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(topics.entry(topic.to_string()).or_default())
    }

    /// Wakes the workers waiting on `topic`'s signal now.
    pub fn raise(&self, topic: &str) {
        let signal = {
            let topics = self.topics.lock().unwrap_or_else(PoisonError::into_inner);
            topics.get(topic).cloned()
        };
        if let Some(signal) = signal {
            signal.notify_waiters();
        }
    }

    /// Wakes every waiting worker of every topic: after a store's
    /// subscription was lost and made again, when any change may have been
    /// missed in between.
    pub fn raise_all(&self) {
        let signals: Vec<Arc<Notify>> = {
            let topics = self.topics.lock().unwrap_or_else(PoisonError::into_inner);
            topics.values().cloned().collect()
        };
        for signal in signals {
            signal.notify_waiters();
        }
    }
}
