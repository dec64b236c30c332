//! Logs, and traces over OTLP (the `otel` feature, on by default): with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! set, the spans of the `dedupe` crates are exported there over OTLP/HTTP
//! (JSON), batched; without it, nothing is exported and nothing is paid.
//!
//! A trace follows an event across the queue of `dedupe serve --inbox`:
//! - each delivery gets an accept span (`accept {route}`, kind producer),
//!   the child of the sender's W3C `traceparent` when it sent one; the
//!   request's `traceparent` header is then set to this span's, so the
//!   stored delivery carries it (the inbox keeps a delivery's headers);
//! - the worker's processing span (`process {namespace}`, kind consumer) links to
//!   the stored `traceparent`: from a slow or failed run to the delivery
//!   that brought it, and from there to the sender.
//!
//! Names and attributes follow OpenTelemetry's messaging conventions
//! (`messaging.system`, `messaging.operation.type`,
//! `messaging.operation.name`, `messaging.destination.name`,
//! `messaging.message.id`); the attempt is `dedupe.attempt`.

use http::HeaderMap;

/// Keeps the exporter until the process ends; dropped, it flushes what is
/// batched.
pub struct Tracing {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Tracing {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                eprintln!("traces not all exported at exit: {e}");
            }
        }
    }
}

/// Logs to stderr as `RUST_LOG` says (errors only without it), and, with
/// the `otel` feature and an OTLP endpoint in the environment, the `dedupe`
/// crates' spans to it.
pub fn init() -> Tracing {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::EnvFilter::from_default_env());
    #[cfg(feature = "otel")]
    {
        let (otel, provider) = match otlp::provider() {
            Some(provider) => {
                use opentelemetry::trace::TracerProvider as _;
                let layer = tracing_opentelemetry::layer()
                    .with_tracer(provider.tracer("dedupe"))
                    .with_filter(otlp::targets());
                (Some(layer), Some(provider))
            }
            None => (None, None),
        };
        tracing_subscriber::registry().with(logs).with(otel).init();
        Tracing { provider }
    }
    #[cfg(not(feature = "otel"))]
    {
        tracing_subscriber::registry().with(logs).init();
        Tracing {}
    }
}

/// The span of a delivery's accept on `route`. With the `otel` feature: the
/// child of the `traceparent` in `headers` (when the sender sent one), and
/// that header replaced by this span's, so the stored delivery carries it.
pub fn accept_span(headers: &mut HeaderMap, route: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "dedupe.delivery",
        "otel.name" = format!("accept {route}"),
        "otel.kind" = "producer",
        "messaging.system" = "dedupe",
        "messaging.operation.type" = "send",
        "messaging.operation.name" = "accept",
        "messaging.destination.name" = route,
    );
    #[cfg(feature = "otel")]
    otlp::adopt_and_stamp(&span, headers);
    #[cfg(not(feature = "otel"))]
    let _ = headers;
    span
}

/// The span of an item's run on a worker: linked (with the `otel` feature)
/// to the accept whose `traceparent` the stored delivery's `headers` carry.
pub fn process_span(headers: &HeaderMap, namespace: &str, id: &str, attempt: u32) -> tracing::Span {
    let span = tracing::info_span!(
        "dedupe.process",
        "otel.name" = format!("process {namespace}"),
        "otel.kind" = "consumer",
        "messaging.system" = "dedupe",
        "messaging.operation.type" = "process",
        "messaging.operation.name" = "process",
        "messaging.destination.name" = namespace,
        "messaging.message.id" = id,
        "dedupe.attempt" = attempt,
    );
    #[cfg(feature = "otel")]
    otlp::link(&span, headers);
    #[cfg(not(feature = "otel"))]
    let _ = headers;
    span
}

#[cfg(feature = "otel")]
mod otlp {
    use http::{HeaderMap, HeaderName, HeaderValue};
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// The provider exporting to the environment's OTLP endpoint, if one.
    pub(super) fn provider() -> Option<SdkTracerProvider> {
        let configured = [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
        if !configured {
            return None;
        }
        use opentelemetry_otlp::{Protocol, WithExportConfig};
        let exporter = match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .build()
        {
            Ok(exporter) => exporter,
            Err(e) => {
                eprintln!("no OTLP export: {e}");
                return None;
            }
        };
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(
                std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "dedupe".to_string()),
            )
            .build();
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    }

    /// The `dedupe` crates' spans, at info and above.
    pub(super) fn targets() -> tracing_subscriber::filter::Targets {
        [
            "dedupe",
            "dedupe_core",
            "dedupe_webhook",
            "dedupe_http",
            "dedupe_sqlite",
            "dedupe_postgres",
            "dedupe_mysql",
            "dedupe_redis",
            "dedupe_dynamo",
        ]
        .into_iter()
        .fold(tracing_subscriber::filter::Targets::new(), |t, target| {
            t.with_target(target, tracing::Level::INFO)
        })
    }

    struct Read<'a>(&'a HeaderMap);

    impl Extractor for Read<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(HeaderName::as_str).collect()
        }
    }

    struct Write<'a>(&'a mut HeaderMap);

    impl Injector for Write<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(name), Ok(value)) = (HeaderName::try_from(key), HeaderValue::try_from(value))
            {
                self.0.insert(name, value);
            }
        }
    }

    /// Makes `span` the child of the sender's context in `headers` (if
    /// valid), then writes `span`'s own context there.
    pub(super) fn adopt_and_stamp(span: &tracing::Span, headers: &mut HeaderMap) {
        let propagator = TraceContextPropagator::new();
        let parent = propagator.extract(&Read(headers));
        if parent.span().span_context().is_valid() {
            let _ = span.set_parent(parent);
        }
        let own = span.context();
        if own.span().span_context().is_valid() {
            headers.remove("tracestate");
            propagator.inject_context(&own, &mut Write(headers));
        }
    }

    /// Links `span` to the context in `headers`, when valid.
    pub(super) fn link(span: &tracing::Span, headers: &HeaderMap) {
        let accepted = TraceContextPropagator::new().extract(&Read(headers));
        let context = accepted.span().span_context().clone();
        if context.is_valid() {
            span.add_link(context);
        }
    }
}
