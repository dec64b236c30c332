//! Push wake-ups (CONTRACT.md I14): every statement that makes an item due
//! now (`accept`, a lease given back, `replay`, `resume`) also runs
//! `pg_notify` on [`CHANNEL`], delivered when it commits, and each store
//! handle keeps one connection `LISTEN`ing there for the workers of its
//! process.

use std::time::Duration;

use dedupe_core::backend::Subscription;
use futures_util::stream;
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;

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
