//! Push wake-ups (CONTRACT.md I14): every statement that makes an item due
//! now (`accept`, a lease given back, `replay`, `resume`) also runs
//! `pg_notify` on [`CHANNEL`], delivered when it commits, and each store
//! handle keeps one connection `LISTEN`ing there for the workers of its
//! process.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use dedupe_core::backend::Subscription;
use futures_util::stream;
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;

use crate::sql::text;
use crate::store::PgStore;

/// The channel every dedupe table of a database notifies on. A
/// notification's payload is `<schema>.<table>|<namespace>`; a listener
/// keeps those of its own table.
pub(crate) const CHANNEL: &str = "dedupe_wake";

/// The payload prefix of `schema.table`'s notifications.
pub(crate) fn topic_prefix(schema: &str, table: &str) -> String {
    format!("{schema}.{table}|")
}

/// The subscription of a store on `pool`: a connection of its own (a
/// one-connection pool with `pool`'s settings, so the listener never holds
/// one of the application's connections), `LISTEN`ing on [`CHANNEL`], each
/// notification of this table's prefix raising its namespace.
pub(crate) fn subscribe(pool: &PgPool, prefix: String, timeout: Duration) -> Subscription {
    let options = pool.connect_options();
    Subscription::new(move || {
        let listening = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(timeout)
            .connect_lazy_with((*options).clone());
        let prefix = prefix.clone();
        async move {
            let mut listener = PgListener::connect_with(&listening)
                .await
                .map_err(|e| crate::error::map(e, timeout))?;
            listener
                .listen(CHANNEL)
                .await
                .map_err(|e| crate::error::map(e, timeout))?;
            Ok(stream::unfold(Some(listener), move |listener| {
                let prefix = prefix.clone();
                async move {
                    let mut listener = listener?;
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(note)) => {
                                if let Some(namespace) = note.payload().strip_prefix(&prefix) {
                                    return Some((Ok(namespace.to_string()), Some(listener)));
                                }
                            }
                            // The connection was lost: the stream ends, and
                            // the subscription connects again.
                            Ok(None) => return None,
                            Err(e) => return Some((Err(crate::error::map(e, timeout)), None)),
                        }
                    }
                }
            }))
        }
    })
}

/// How long after an accept of this handle notified a namespace its next
/// accepts there leave their notification out: one trailing notification at
/// the end of the window announces them all, so a handle sends at most one
/// a window a namespace while accepts stream in, and an accept after a
/// quiet spell notifies at once (in its own statement).
pub(crate) const NOTIFY_WINDOW: Duration = Duration::from_millis(2);

/// Per namespace, when this handle's accepts last notified, and whether a
/// trailing notification is on its way.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    namespaces: std::sync::Mutex<std::collections::HashMap<String, Notice>>,
}

/// Namespaces a [`Notices`] holds before it drops the quiet ones.
const FORGET_AT: usize = 1024;

/// A trailing notification on its way; dropped (sent, or its task dropped
/// with its runtime), the namespace is free to arm the next.
struct Armed {
    notices: Arc<Notices>,
    namespace: String,
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(notice) = self.notices.namespaces().get_mut(&self.namespace) {
            notice.trailing = false;
            notice.last = Instant::now();
        }
    }
}

#[derive(Debug)]
struct Notice {
    last: Instant,
    trailing: bool,
}

/// The [`Notices`] of every table of every database this process's store
/// handles use, by server, database and table: handles of one table share
/// them (an application that opens several, as the bench does with one a
/// task, sends one notification a window, not one a handle).
static SHARED: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, Arc<Notices>>>,
> = std::sync::LazyLock::new(Default::default);

impl Notices {
    /// Those of the table whose notifications start with `prefix`, in the
    /// database `pool` connects to.
    pub(crate) fn of(pool: &PgPool, prefix: &str) -> Arc<Self> {
        let options = pool.connect_options();
        // The socket's directory too: two clusters on one port and database
        // name, reached through sockets in different directories, are two.
        let table = format!(
            "{}:{}:{:?}/{}/{prefix}",
            options.get_host(),
            options.get_port(),
            options.get_socket(),
            options.get_database().unwrap_or_default()
        );
        let mut shared = SHARED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Arc::clone(shared.entry(table).or_default())
    }

    fn namespaces(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Notice>> {
        // A panic elsewhere while it was held leaves plain data behind.
        self.namespaces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether an accept into `namespace` starting now notifies in its own
    /// statement (none from this handle within the window).
    pub(crate) fn lead(&self, namespace: &str) -> bool {
        let now = Instant::now();
        let mut namespaces = self.namespaces();
        // Namespaces quiet for a window hold nothing worth keeping: dropped
        // once the map grows, so per-tenant namespaces do not pile up.
        if namespaces.len() >= FORGET_AT {
            namespaces.retain(|_, n| n.trailing || now.duration_since(n.last) < NOTIFY_WINDOW);
        }
        match namespaces.get_mut(namespace) {
            Some(notice) if now.duration_since(notice.last) < NOTIFY_WINDOW => false,
            Some(notice) => {
                notice.last = now;
                true
            }
            None => {
                namespaces.insert(
                    namespace.to_string(),
                    Notice {
                        last: now,
                        trailing: false,
                    },
                );
                true
            }
        }
    }

    /// When a trailing notification for `namespace` is to be sent (the end
    /// of the window its last notification opened), or `None` when one is
    /// already on its way; marks it on its way.
    fn arm(&self, namespace: &str) -> Option<Instant> {
        let mut namespaces = self.namespaces();
        let notice = namespaces
            .entry(namespace.to_string())
            .or_insert_with(|| Notice {
                last: Instant::now(),
                trailing: false,
            });
        if notice.trailing {
            return None;
        }
        notice.trailing = true;
        Some(notice.last + NOTIFY_WINDOW)
    }

    /// After an accept into `namespace` that left its notification out has
    /// committed: one notification at the end of the window, unless one is
    /// on its way that has not been sent yet (it is sent after this commit,
    /// so it announces this item too). One that fails is logged: a worker's
    /// fallback poll finds the item (I14).
    ///
    /// It runs on a connection of `store`'s, as its calls do (a pool the
    /// store keeps whole still serves it). Dropped before it is sent (its
    /// runtime shut down), it marks itself gone, so the next accept arms
    /// another.
    pub(crate) fn trail(self: &Arc<Self>, namespace: &str, store: &PgStore) {
        let Some(at) = self.arm(namespace) else {
            return;
        };
        let (store, namespace) = (store.clone(), namespace.to_string());
        let armed = Armed {
            notices: Arc::clone(self),
            namespace: namespace.clone(),
        };
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            // Marked before it is sent: an accept that commits from here on
            // arms a notification of its own.
            drop(armed);
            let sent = store
                .call(async |ops, conn| {
                    sqlx::query(text(&ops.sql.notify))
                        .bind(&namespace)
                        .execute(conn)
                        .await
                        .map_err(|e| ops.err(e))
                })
                .await;
            if let Err(e) = sent {
                tracing::warn!(namespace, error = %e, "a trailing wake-up notification was not sent");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The clock is tokio's, paused: these tests decide what falls within a
    // window, not the machine's load.

    #[tokio::test(start_paused = true)]
    async fn accepts_within_a_window_share_one_leading_notification() {
        let notices = Notices::default();
        let leads = (0..10).filter(|_| notices.lead("orders")).count();
        assert_eq!(leads, 1, "ten accepts in one window");
        assert!(
            notices.lead("refunds"),
            "another namespace has its own window"
        );
        tokio::time::advance(NOTIFY_WINDOW).await;
        assert!(
            notices.lead("orders"),
            "the first accept after the window leads"
        );
        assert!(!notices.lead("orders"));
    }

    #[tokio::test(start_paused = true)]
    async fn one_trailing_notification_is_on_its_way_at_a_time() {
        let notices = Arc::new(Notices::default());
        assert!(notices.lead("orders"));
        let opened = Instant::now();
        tokio::time::advance(Duration::from_micros(500)).await;
        assert_eq!(notices.arm("orders"), Some(opened + NOTIFY_WINDOW));
        assert_eq!(notices.arm("orders"), None, "a second while one waits");
        // Sent (its guard dropped): the window starts again from the send,
        // and the next accept that leaves its notification out arms another.
        tokio::time::advance(NOTIFY_WINDOW).await;
        drop(Armed {
            notices: Arc::clone(&notices),
            namespace: "orders".into(),
        });
        let sent = Instant::now();
        assert!(!notices.lead("orders"), "within the window the send opened");
        assert_eq!(notices.arm("orders"), Some(sent + NOTIFY_WINDOW));
    }
}
