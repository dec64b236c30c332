//! `TracedStore` puts a span on every call, the inbox's included: each call
//! below is recorded with its name and its answer by a subscriber of the
//! test's own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedupe_core::{DedupeStore, Inbox, ItemQuery, Key, MemoryStore, Retry, TracedStore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Every span closed, as (name, answer), in order.
#[derive(Clone, Default)]
struct Spans {
    open: Arc<Mutex<HashMap<Id, (String, String)>>>,
    closed: Arc<Mutex<Vec<(String, String)>>>,
}

struct Answer<'a>(&'a mut String);

impl Visit for Answer<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "answer" {
            *self.0 = value.to_string();
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "answer" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>> Layer<S>
    for Spans
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut answer = String::new();
        attrs.record(&mut Answer(&mut answer));
        self.open
            .lock()
            .expect("in the test")
            .insert(id.clone(), (attrs.metadata().name().to_string(), answer));
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some((_, answer)) = self.open.lock().expect("in the test").get_mut(id) {
            values.record(&mut Answer(answer));
        }
    }
    fn on_close(&self, id: Id, _: Context<'_, S>) {
        if let Some(span) = self.open.lock().expect("in the test").remove(&id) {
            self.closed.lock().expect("in the test").push(span);
        }
    }
}

#[tokio::test]
async fn every_inbox_call_is_a_span_with_its_answer() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let inbox = TracedStore::new(MemoryStore::new());
    let key = Key::new("traced", "evt_1").expect("in the test");
    inbox.accept(&key, b"payload").await.expect("in the test");
    inbox.accept(&key, b"payload").await.expect("in the test");
    let taken = inbox
        .take("traced", 10, Duration::from_secs(30))
        .await
        .expect("in the test");
    inbox
        .fail(&taken[0].lease, "boom", Retry::dead())
        .await
        .expect("in the test");
    inbox.item(&key).await.expect("in the test");
    inbox
        .list(&ItemQuery::new("traced"))
        .await
        .expect("in the test");
    inbox.replay(&key).await.expect("in the test");
    inbox.counts("traced").await.expect("in the test");
    let lost = inbox
        .complete(&taken[0].lease, b"late", Duration::from_secs(60))
        .await;
    assert!(lost.is_err());

    let closed = spans.closed.lock().expect("in the test").clone();
    let seen: Vec<(&str, &str)> = closed
        .iter()
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("dedupe.accept", "new"),
            ("dedupe.accept", "item"),
            ("dedupe.take", "1 taken"),
            ("dedupe.fail", "dead"),
            ("dedupe.item", "dead"),
            ("dedupe.list", "1 listed"),
            ("dedupe.replay", "replayed=true"),
            ("dedupe.counts", "0 pending, 0 running, 1 failed, 0 dead"),
            ("dedupe.complete", "error"),
        ]
    );
}
