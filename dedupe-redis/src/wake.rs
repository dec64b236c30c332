//! Push wake-ups (CONTRACT.md I14): the scripts that make an item due now
//! (accept, a lease given back, replay, resume) `PUBLISH` its namespace on
//! the store's channel in the same atomic step, and each store handle keeps
//! one connection `SUBSCRIBE`d there for the workers of its process. A
//! Cluster broadcasts a `PUBLISH` to every node, so the subscriber may sit
//! on any of them.

use std::time::Duration;

use dedupe_core::backend::Subscription;
use futures_util::StreamExt;

/// The channel of a store with key prefix `prefix`: the namespaces whose
/// items became due now.
pub(crate) fn channel(prefix: &str) -> String {
    format!("{prefix}wake")
}

/// The subscription of a store: a pub/sub connection to one of `clients`
/// (the server; on a Cluster each seed node in turn, so a node that is gone
/// is passed over), `SUBSCRIBE`d to `channel`, each message raising the
/// namespace it names.
pub(crate) fn subscribe(
    clients: Vec<redis::Client>,
    channel: String,
    timeout: Duration,
) -> Subscription {
    let mut next = 0usize;
    Subscription::new(move || {
        let client = clients[next % clients.len()].clone();
        next = next.wrapping_add(1);
        let channel = channel.clone();
        async move {
            let subscribed = async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            let pubsub = tokio::time::timeout(timeout * 2, subscribed)
                .await
                .map_err(|_| dedupe_core::Error::timeout(timeout * 2))?
                .map_err(|e| {
                    crate::error::map(e, timeout, None, crate::error::Topology::Standalone)
                })?;
            // The stream ends when the connection does.
            Ok(pubsub.into_on_message().map(|message| {
                message.get_payload::<String>().map_err(|e| {
                    dedupe_core::Error::fatal(
                        format!("a wake-up message that is not text: {e}"),
                        None,
                    )
                })
            }))
        }
    })
}
