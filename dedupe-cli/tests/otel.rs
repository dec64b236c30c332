//! Traces across the queue (the `otel` feature, on by default): `dedupe
//! serve --inbox` exports its spans over OTLP/HTTP to a receiver in this
//! test, and the processing span of an item links to the accept span of the
//! request that brought it, itself the child of the sender's `traceparent`.
#![cfg(feature = "otel")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use serde_json::Value;

mod harness;
use harness::{client, Serve};

/// An OTLP/HTTP (JSON) receiver: every span exported to it.
struct Receiver {
    url: String,
    spans: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receiver() -> Receiver {
    let spans: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = Arc::clone(&spans);
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: axum::body::Bytes| {
            let kept = Arc::clone(&kept);
            async move {
                let export: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let mut kept = kept.lock().expect("spans");
                for resource in export["resourceSpans"].as_array().into_iter().flatten() {
                    for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                        kept.extend(scope["spans"].as_array().into_iter().flatten().cloned());
                    }
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Receiver { url, spans, task }
}

/// The value of a span's string attribute.
fn attribute<'a>(span: &'a Value, name: &str) -> Option<&'a str> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == name)?["value"]["stringValue"]
        .as_str()
}

/// Waits up to 30 s for a span `pick` finds.
async fn span_where(receiver: &Receiver, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(span) = receiver
            .spans
            .lock()
            .expect("spans")
            .iter()
            .find(|s| pick(s))
        {
            return span.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {what} among the exported spans: {:#?}",
            receiver.spans.lock().expect("spans")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A delivery sent with a `traceparent`: its accept span is that trace's
/// child, and the worker's processing span links to the accept span. A
/// delivery without one starts a trace of its own, to which its processing
/// links as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processing_links_to_the_accepting_request() {
    let receiver = receiver().await;
    let dir = tempfile::tempdir().expect("dir");
    let store = format!("sqlite://{}", dir.path().join("otel.db").display());
    let serve = Serve::spawn(
        &store,
        0,
        &["--inbox"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let http = client();
    let sender_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let sender_span = "00f067aa0ba902b7";
    for (id, traceparent) in [
        (
            "evt_traced",
            Some(format!("00-{sender_trace}-{sender_span}-01")),
        ),
        ("evt_untraced", None),
    ] {
        let mut req = http
            .post(format!("{}/hooks", serve.base))
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .body(format!(r#"{{"id":"{id}"}}"#));
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        assert_eq!(req.send().await.expect("deliver").status().as_u16(), 202);
    }

    // The sender's trace: its span is the accept's parent.
    let accept = span_where(&receiver, "accept span in the sender's trace", |s| {
        s["name"] == "accept hooks" && s["traceId"] == sender_trace
    })
    .await;
    assert_eq!(accept["parentSpanId"], sender_span, "{accept:#}");
    assert_eq!(attribute(&accept, "messaging.system"), Some("dedupe"));
    assert_eq!(
        attribute(&accept, "messaging.destination.name"),
        Some("hooks")
    );
    let accept_span = accept["spanId"].as_str().expect("a span id").to_string();

    // The processing of that item: linked to the accept.
    let process = span_where(&receiver, "processing span of evt_traced", |s| {
        s["name"] == "process hooks" && attribute(s, "messaging.message.id") == Some("evt_traced")
    })
    .await;
    let links = process["links"].as_array().cloned().unwrap_or_default();
    assert!(
        links
            .iter()
            .any(|l| l["traceId"] == sender_trace && l["spanId"] == accept_span.as_str()),
        "the processing span does not link to the accept {accept_span}: {process:#}"
    );
    assert_eq!(
        attribute(&process, "messaging.operation.type"),
        Some("process")
    );
    assert_eq!(
        attribute(&process, "messaging.destination.name"),
        Some("hooks")
    );

    // No traceparent sent: the accept starts a trace, the processing links
    // to it.
    let process = span_where(&receiver, "processing span of evt_untraced", |s| {
        s["name"] == "process hooks" && attribute(s, "messaging.message.id") == Some("evt_untraced")
    })
    .await;
    let link = process["links"][0].clone();
    let linked = link["spanId"].as_str().expect("a link").to_string();
    let accept = span_where(&receiver, "accept span the link names", |s| {
        s["name"] == "accept hooks" && s["spanId"] == linked.as_str()
    })
    .await;
    assert_eq!(accept["traceId"], link["traceId"]);
    assert_ne!(accept["traceId"], sender_trace);
    drop(serve);
}
