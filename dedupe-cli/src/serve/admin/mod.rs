//! The admin listener (`--admin-listen`): the JSON API under `/api`, the
//! dashboard under `/ui`, the ledger (`/hooks`), the metrics (`/metrics`) and
//! the health check (`/healthz`).
//!
//! Who may call it (`guard` below, before any route):
//! - with a token (`--admin-token-file`, `DEDUPE_ADMIN_TOKEN`), every route
//!   but `/healthz` wants it: `Authorization: Bearer <token>`, or the
//!   dashboard's session cookie, set by `/ui/login` once the token is typed
//!   in. Without a token the listener must be a loopback address, and only
//!   requests naming a loopback host are answered (a page elsewhere cannot
//!   reach it through a DNS name that points at 127.0.0.1);
//! - every state-changing call is a `POST` and carries the anti-forgery
//!   token (`X-CSRF-Token` header, or the `csrf_token` field of a form),
//!   which this process draws at start and hands out at `GET /api/csrf` and
//!   in the dashboard's forms: a page of another site cannot read it, so it
//!   cannot make the operator's browser replay or forget anything.

// The routes' helpers answer the refusal to send as their error: a
// `Response` by value, once per request, where boxing would buy nothing.
#![allow(clippy::result_large_err)]

mod api;
mod jobs;
mod query;
mod state;
mod ui;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use dedupe_core::Inbox;
use http::{header, Method, StatusCode};

use super::app::App;
use super::throughput::Throughput;
use state::{refuse, same, Admin, COOKIE, FORM_LIMIT};
pub(crate) use state::{token, Auth};

/// The admin listener's routes.
pub(crate) fn router(
    app: &Arc<App>,
    inbox: Option<Arc<dyn Inbox>>,
    namespaces: Vec<String>,
    auth: Auth,
    throughput: Arc<Throughput>,
) -> Router {
    let admin = Arc::new(Admin {
        app: Arc::clone(app),
        inbox,
        namespaces,
        auth,
        jobs: jobs::Jobs::default(),
        throughput,
    });
    Router::new()
        .merge(api::routes())
        .merge(ui::routes())
        .route("/hooks", get(api::ledger))
        .route("/metrics", get(api::metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/", get(|| async { Redirect::to("/ui") }))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&admin),
            guard,
        ))
        .with_state(admin)
}

/// Whether the request names a loopback host (`localhost`, `127.x.y.z`,
/// `[::1]`), with or without a port.
fn loopback_host(req: &Request) -> bool {
    // HTTP/2 names the host in the request's authority, not in a header.
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    let Some(host) = host else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether the request carries the token, or the session cookie it gives.
fn authorized(auth: &Auth, req: &Request) -> bool {
    let (Some(token), Some(session)) = (&auth.token, &auth.session) else {
        return true;
    };
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .is_some_and(|given| same(given.trim(), token));
    bearer
        || req
            .headers()
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|h| h.to_str().ok())
            .flat_map(|h| h.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .any(|(name, value)| name == COOKIE && same(value, session))
}

/// Every request passes here first: the host, the token, and on a `POST`
/// the anti-forgery token (read from the form when no header carries it;
/// the form is handed on to the route unchanged).
async fn guard(State(admin): State<Arc<Admin>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if path == "/healthz" {
        return next.run(req).await;
    }
    if admin.auth.token.is_none() && !loopback_host(&req) {
        return refuse(
            StatusCode::FORBIDDEN,
            "not_loopback",
            "without a token the admin surface answers only requests to a loopback host",
        );
    }
    let login = path == "/ui/login" || path == "/ui/style.css";
    if !login && !authorized(&admin.auth, &req) {
        if req.method() == Method::GET && (path == "/ui" || path.starts_with("/ui/")) {
            return Redirect::to("/ui/login").into_response();
        }
        return refuse(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the admin surface wants its token: Authorization: Bearer <token>",
        );
    }
    // The sign-in carries no anti-forgery token: the form that sends it is
    // served to whoever is not signed in yet, so it must not show the
    // token; a forged sign-in can only sign a browser in with the one token.
    if req.method() != Method::POST || path == "/ui/login" {
        return next.run(req).await;
    }
    // A browser says where a request comes from: a page of another site (or
    // another port of this one) never changes anything here.
    if let Some(site) = req
        .headers()
        .get("sec-fetch-site")
        .and_then(|h| h.to_str().ok())
    {
        if !matches!(site, "same-origin" | "none") {
            return refuse(
                StatusCode::FORBIDDEN,
                "csrf",
                format!("a state-changing call from a {site} page is refused"),
            );
        }
    }
    let header_token = req
        .headers()
        .get("x-csrf-token")
        .and_then(|h| h.to_str().ok())
        .map(str::to_string);
    let (req, form_token) = if header_token.is_none() && is_form(&req) {
        let (parts, body) = req.into_parts();
        let bytes = match axum::body::to_bytes(body, FORM_LIMIT).await {
            Ok(bytes) => bytes,
            Err(_) => {
                return refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "form_too_large",
                    format!("a form of the admin surface holds at most {FORM_LIMIT} bytes"),
                )
            }
        };
        let token = form_urlencoded_field(&bytes, "csrf_token");
        (Request::from_parts(parts, Body::from(bytes)), token)
    } else {
        (req, None)
    };
    match header_token.or(form_token) {
        Some(given) if same(&given, &admin.auth.csrf) => next.run(req).await,
        _ => refuse(
            StatusCode::FORBIDDEN,
            "csrf",
            "a state-changing call carries the anti-forgery token (X-CSRF-Token, from GET /api/csrf)",
        ),
    }
}

fn is_form(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|t| t.starts_with("application/x-www-form-urlencoded"))
}

fn form_urlencoded_field(body: &[u8], name: &str) -> Option<String> {
    serde_urlencoded::from_bytes::<Vec<(String, String)>>(body)
        .ok()?
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_host(host: &str) -> Request {
        Request::builder()
            .header(header::HOST, host)
            .body(Body::empty())
            .expect("request")
    }

    #[test]
    fn only_loopback_hosts_pass_without_a_token() {
        for host in [
            "127.0.0.1:8472",
            "localhost:1",
            "LOCALHOST",
            "[::1]:80",
            "127.1.2.3",
        ] {
            assert!(loopback_host(&with_host(host)), "{host}");
        }
        for host in [
            "evil.example:8472",
            "10.0.0.1",
            "[2001:db8::1]:80",
            "localhost.evil:1",
        ] {
            assert!(!loopback_host(&with_host(host)), "{host}");
        }
    }
}
