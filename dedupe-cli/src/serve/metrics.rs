//! Prometheus metrics of the receiver: answers by kind and their latency.

use std::sync::Mutex;
use std::time::Duration;

use dedupe_webhook::Answer;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AnswerLabel {
    answer: &'static str,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    answers: Family<AnswerLabel, Counter>,
    latency: Family<AnswerLabel, Histogram>,
}

impl Metrics {
    pub fn new() -> Self {
        let answers = Family::<AnswerLabel, Counter>::default();
        let latency = Family::<AnswerLabel, Histogram>::new_with_constructor(|| {
            // 100 µs to about 26 s.
            Histogram::new(exponential_buckets(0.0001, 2.0, 19))
        });
        let mut registry = Registry::default();
        registry.register(
            "dedupe_webhook_answers",
            "Webhook deliveries by answer (processed, replayed, in_flight, ...)",
            answers.clone(),
        );
        registry.register(
            "dedupe_webhook_seconds",
            "Time to answer a webhook delivery, by answer",
            latency.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            answers,
            latency,
        }
    }

    pub fn observe(&self, answer: Answer, took: Duration) {
        let label = AnswerLabel {
            answer: answer.as_str(),
        };
        self.answers.get_or_create(&label).inc();
        self.latency
            .get_or_create(&label)
            .observe(took.as_secs_f64());
    }

    pub fn render(&self) -> String {
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if prometheus_client::encoding::text::encode(&mut text, &registry).is_err() {
            text = "# metrics could not be encoded\n".into();
        }
        text
    }
}
