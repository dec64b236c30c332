//! The receiver as a tower layer, for `axum::Router::route_layer`.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use futures_util::future::BoxFuture;
use http::Request;
use tower::{Layer, Service, ServiceExt};

use crate::Webhook;

/// Wraps a route so every request goes through [`Webhook::handle`]: the route's
/// handler runs only for the one delivery that claimed the event, and finds it
/// as a [`WebhookEvent`](crate::WebhookEvent) extractor. A handler that reads
/// the body again (`Json`, `Bytes`) may read as much as the receiver accepted
/// ([`Webhook::body_limit`]): the layer sets axum's `DefaultBodyLimit` to it.
#[derive(Debug, Clone)]
pub struct WebhookLayer(Arc<Webhook>);

impl WebhookLayer {
    /// A layer running `hook`.
    pub fn new(hook: Webhook) -> Self {
        Self(Arc::new(hook))
    }
}

impl<S> Layer<S> for WebhookLayer {
    type Service = WebhookService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WebhookService(Arc::clone(&self.0), inner)
    }
}

/// The service [`WebhookLayer`] makes: the receiver, and the route it guards.
#[derive(Debug, Clone)]
pub struct WebhookService<S>(Arc<Webhook>, S);

impl<S> Service<Request<Body>> for WebhookService<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is checked on the clone that runs the request (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let hook = Arc::clone(&self.0);
        let inner =
            axum::extract::DefaultBodyLimit::max(hook.body_limit_bytes()).layer(self.1.clone());
        Box::pin(async move {
            let response = hook
                .handle(req, |req| async move {
                    match inner.oneshot(req).await {
                        Ok(response) => response,
                        Err(never) => match never {},
                    }
                })
                .await;
            Ok(response)
        })
    }
}
