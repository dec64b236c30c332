//! A broker consumer on the inbox: each NATS JetStream message is accepted
//! into a dedupe [`Inbox`] (one atomic write) and then acked; workers take
//! the items and run the handler once per message, however often the broker
//! delivers it.
//!
//! A JetStream consumer redelivers a message whose ack did not arrive within
//! its `ack_wait`: the consumer crashed after processing, the ack was lost,
//! the network split. Processing in the loop that acks turns each of those
//! into a second run. Here the loop only accepts and acks, so a redelivery
//! meets the item already accepted (pending, running or done) and is acked
//! with nothing run; the work itself runs on an [`InboxWorker`], retried on
//! its backoff and dead after its last attempt.
//!
//! The key is the message's `Nats-Msg-Id` header (the id its publisher gave
//! it, which JetStream also uses to drop a publisher's resends within its
//! duplicate window), else the SHA-256 of the payload.
//!
//! [`InboxWorker`]: dedupe_core::InboxWorker

use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::Message;
use dedupe_core::{Accepted, Error, Inbox, Key};
use futures_util::{Stream, StreamExt};

/// What [`accept_messages`] did, message by message.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accepting {
    /// Messages accepted as new items.
    pub new: u64,
    /// Deliveries of a message the inbox had already (redeliveries and
    /// publishers' resends), acked with nothing stored.
    pub known: u64,
    /// Deliveries the inbox could not take for now (the store unavailable):
    /// nak'ed, so the broker delivers them again after `retry`.
    pub retried: u64,
    /// Messages the inbox refuses for good (over its size limit): terminated.
    pub refused: u64,
}

/// The idempotency key of a message: its `Nats-Msg-Id`, else its payload's
/// SHA-256.
pub fn key_of(namespace: &str, message: &Message) -> Result<Key, Error> {
    let id = message
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_string());
    Ok(Key::from_event_id_or_body(
        namespace,
        id.as_deref(),
        &message.payload,
    )?)
}

/// Accepts every message of `messages` into `namespace` of `inbox`, then
/// acks it; a message the store cannot take now is nak'ed (redelivered after
/// `retry`), one it refuses for good is terminated. Runs until the stream
/// ends; `on_accept` sees each delivery's answer (for metrics, or a test).
pub async fn accept_messages<S, E>(
    inbox: &dyn Inbox,
    namespace: &str,
    messages: S,
    retry: Duration,
    mut on_accept: impl FnMut(&Message, &Result<Accepted, Error>) -> bool,
) -> Result<Accepting, Error>
where
    S: Stream<Item = Result<Message, E>>,
    E: std::fmt::Display,
{
    let mut seen = Accepting::default();
    futures_util::pin_mut!(messages);
    while let Some(next) = messages.next().await {
        let message = match next {
            Ok(message) => message,
            Err(e) => {
                tracing::warn!(error = %e, "the broker's stream failed; pulling again");
                continue;
            }
        };
        let answer = match key_of(namespace, &message) {
            Ok(key) => inbox.accept(&key, &message.payload).await,
            Err(e) => Err(e),
        };
        // The caller may hold the ack back (a test simulating a lost one).
        let ack = on_accept(&message, &answer);
        let kind = match &answer {
            Ok(Accepted::New) => {
                seen.new += 1;
                AckKind::Ack
            }
            Ok(_) => {
                seen.known += 1;
                AckKind::Ack
            }
            Err(e) if e.is_retryable() => {
                seen.retried += 1;
                tracing::warn!(error = %e, "the inbox is unavailable; the broker will redeliver");
                AckKind::Nak(Some(retry))
            }
            Err(e) => {
                seen.refused += 1;
                tracing::error!(error = %e, "a message the inbox refuses; terminated");
                AckKind::Term
            }
        };
        if !ack {
            continue;
        }
        if let Err(e) = message.ack_with(kind).await {
            // The broker redelivers it: the accept answers it as known.
            tracing::warn!(error = %e, "an ack was not sent");
        }
    }
    Ok(seen)
}
