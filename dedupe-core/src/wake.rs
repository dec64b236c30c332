//! How an idle [`InboxWorker`](crate::InboxWorker) learns that work became
//! due: a signal from the store where it has one, and a poll behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

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
    /// Raised when an item of the namespace may have become due now:
    /// accepted, given back, replayed, or its namespace resumed. Each
    /// change wakes one waiting worker (`notify_one`: sixteen workers woken
    /// for one item would make sixteen takes), and a worker that takes as
    /// many items as it asked for raises it again for the next; a lost
    /// connection, made again, wakes every waiter (`notify_waiters`).
    /// `None`: nothing wakes a worker; it polls.
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
/// [`raise`](Self::raise) wakes one worker waiting on it (an item became
/// due: one worker takes it, the others sleep on; a worker that takes a
/// full batch wakes the next), and is free when no worker ever asked for
/// the topic.
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

    /// Wakes one worker waiting on `topic`'s signal now (or the next to
    /// wait, when none is waiting).
    pub fn raise(&self, topic: &str) {
        let signal = {
            let topics = self.topics.lock().unwrap_or_else(PoisonError::into_inner);
            topics.get(topic).cloned()
        };
        if let Some(signal) = signal {
            signal.notify_one();
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

/// Opens a store's subscription to its change notifications: a stream of
/// the topics notified, which ends (or yields an error) when the connection
/// carrying it is lost.
type Connect = Box<
    dyn FnMut() -> futures_util::future::BoxFuture<
            'static,
            crate::Result<futures_util::stream::BoxStream<'static, crate::Result<String>>>,
        > + Send,
>;

/// A store's subscription to its own change notifications (Postgres
/// `LISTEN`, Redis `SUBSCRIBE`), for [`Inbox::wake`](crate::Inbox::wake):
/// kept in a task of its own, started by the first worker that asks, which
/// raises each notified topic's signal, connects again (backing off from
/// 100 ms to 5 s) whenever the connection is lost, then raises every topic
/// (what was notified while it was away is unknown), and ends when the last
/// clone of the subscription is dropped.
#[derive(Clone)]
pub struct Subscription {
    inner: Arc<Subscribed>,
}

struct Subscribed {
    wakeups: Wakeups,
    /// Taken by the task when it starts.
    connect: Mutex<Option<Connect>>,
    /// Whether the task has its first connection.
    ready: tokio::sync::watch::Receiver<bool>,
    ready_tx: Mutex<Option<tokio::sync::watch::Sender<bool>>>,
    /// Ends the task when the last clone is dropped.
    _stop: tokio_util::sync::DropGuard,
    stop: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("connected", &*self.inner.ready.borrow())
            .finish_non_exhaustive()
    }
}

impl Subscription {
    /// A subscription that opens its stream with `connect` when a worker
    /// first asks ([`wake`](Self::wake)), and again after each loss.
    pub fn new<F, Fut, S>(mut connect: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = crate::Result<S>> + Send + 'static,
        S: futures_util::Stream<Item = crate::Result<String>> + Send + 'static,
    {
        use futures_util::{FutureExt, StreamExt};
        let connect: Connect = Box::new(move || {
            let opened = connect();
            async move { opened.await.map(StreamExt::boxed) }.boxed()
        });
        let (ready_tx, ready) = tokio::sync::watch::channel(false);
        let stop = tokio_util::sync::CancellationToken::new();
        Self {
            inner: Arc::new(Subscribed {
                wakeups: Wakeups::default(),
                connect: Mutex::new(Some(connect)),
                ready,
                ready_tx: Mutex::new(Some(ready_tx)),
                _stop: stop.clone().drop_guard(),
                stop,
            }),
        }
    }

    /// The pushed wake-up of `topic`. The first call starts the
    /// subscription's task and waits up to `wait` for its first connection
    /// (a change committed after that is notified); a subscription not
    /// connected by then goes on trying, and the workers' poll covers the
    /// meantime.
    pub async fn wake(&self, topic: &str, wait: Duration) -> Wake {
        let signal = self.inner.wakeups.signal(topic);
        self.start();
        let mut ready = self.inner.ready.clone();
        if tokio::time::timeout(wait, ready.wait_for(|ready| *ready))
            .await
            .is_err()
        {
            tracing::warn!(
                topic,
                "the store's notifications are not connected yet; polling meanwhile"
            );
        }
        Wake::pushed(signal)
    }

    fn start(&self) {
        let connect = self
            .inner
            .connect
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let ready = self
            .inner
            .ready_tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let (Some(connect), Some(ready)) = (connect, ready) {
            let (wakeups, stop) = (self.inner.wakeups.clone(), self.inner.stop.clone());
            tokio::spawn(async move {
                stop.run_until_cancelled(listen(connect, wakeups, ready))
                    .await;
            });
        }
    }
}

/// The subscription's task: connect, raise what is notified, connect again.
async fn listen(mut connect: Connect, wakeups: Wakeups, ready: tokio::sync::watch::Sender<bool>) {
    use futures_util::StreamExt;
    const FIRST_DELAY: Duration = Duration::from_millis(100);
    let mut delay = FIRST_DELAY;
    loop {
        match connect().await {
            Ok(mut topics) => {
                delay = FIRST_DELAY;
                if *ready.borrow() {
                    // Changes made while it was away were not notified.
                    wakeups.raise_all();
                }
                ready.send_replace(true);
                tracing::debug!("store notifications connected");
                let connected = std::time::Instant::now();
                loop {
                    match topics.next().await {
                        Some(Ok(topic)) => wakeups.raise(&topic),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "store notifications lost; connecting again");
                            break;
                        }
                        None => {
                            tracing::warn!("store notifications ended; connecting again");
                            break;
                        }
                    }
                }
                // A connection that keeps ending at once is not retried in a
                // tight loop.
                if connected.elapsed() < Duration::from_secs(1) {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, ?delay, "store notifications could not connect; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}
