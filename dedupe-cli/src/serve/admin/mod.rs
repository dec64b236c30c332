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
mod throughput;
mod ui;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Json, Router};
use dedupe_core::{Error, Inbox};
use http::{header, Method, StatusCode};
use sha2::{Digest, Sha256};

use super::app::App;
pub(crate) use throughput::Throughput;

/// The name of the dashboard's session cookie.
const COOKIE: &str = "dedupe_admin";
/// Largest form a state-changing call may send (the filter fields).
const FORM_LIMIT: usize = 64 * 1024;

/// What the admin routes share.
pub(crate) struct Admin {
    app: Arc<App>,
    inbox: Option<Arc<dyn Inbox>>,
    /// The namespaces this server's routes serve, shown on the dashboard.
    namespaces: Vec<String>,
    auth: Auth,
    jobs: jobs::Jobs,
    throughput: Arc<Throughput>,
}

/// The bearer token (if any), the session cookie it gives, and this
/// process's anti-forgery token.
pub(crate) struct Auth {
    token: Option<String>,
    session: Option<String>,
    csrf: String,
}

/// The admin token: read from `file`, else from `DEDUPE_ADMIN_TOKEN`, white
/// space around it dropped.
pub(crate) fn token(file: Option<&std::path::Path>) -> Result<Option<String>, Error> {
    Ok(match file {
        Some(path) => {
            Some(std::fs::read_to_string(path).map_err(|e| {
                Error::config(format!("--admin-token-file {}: {e}", path.display()))
            })?)
        }
        None => std::env::var("DEDUPE_ADMIN_TOKEN").ok(),
    }
    .map(|t| t.trim().to_string()))
}

impl Auth {
    /// With `token` (none: loopback only); refused on a listener that is not
    /// loopback without one.
    pub(crate) fn new(token: Option<String>, listen: SocketAddr) -> Result<Self, Error> {
        if token.as_deref() == Some("") {
            return Err(Error::config(
                "the admin token is empty (--admin-token-file or DEDUPE_ADMIN_TOKEN)",
            ));
        }
        if token.is_none() && !listen.ip().is_loopback() {
            return Err(Error::config(format!(
                "--admin-listen {listen} is not a loopback address: give the admin surface a \
                 token (--admin-token-file, or DEDUPE_ADMIN_TOKEN) to serve it there"
            )));
        }
        let mut csrf = [0u8; 32];
        getrandom::fill(&mut csrf)
            .map_err(|e| Error::config(format!("no randomness for the anti-forgery token: {e}")))?;
        Ok(Self {
            session: token.as_deref().map(|t| {
                hex::encode(Sha256::digest(
                    format!("dedupe admin session\0{t}").as_bytes(),
                ))
            }),
            token,
            csrf: hex::encode(csrf),
        })
    }
}

/// Whether `a` and `b` are equal, in time that does not depend on where they
/// differ.
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

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

/// A JSON error: `{"error": kind, "message": ...}`.
pub(crate) fn refuse(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(serde_json::json!({"error": kind, "message": message.into()})),
    )
        .into_response()
}

/// Whether the request names a loopback host (`localhost`, `127.x.y.z`,
/// `[::1]`), with or without a port.
fn loopback_host(req: &Request) -> bool {
    let Some(host) = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
    else {
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
    if req.method() != Method::POST {
        return next.run(req).await;
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

    #[test]
    fn tokens_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert!(!same("", "a"));
    }

    #[test]
    fn a_public_listener_without_a_token_is_refused() {
        let public: SocketAddr = "0.0.0.0:8472".parse().expect("address");
        let refused = Auth::new(None, public).err().expect("refused");
        assert!(refused.to_string().contains("not a loopback address"));
        assert!(Auth::new(None, "127.0.0.1:0".parse().expect("address")).is_ok());
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").expect("write");
        let auth = Auth::new(token(Some(&file)).expect("read"), public).expect("with a token");
        assert_eq!(auth.token.as_deref(), Some("s3cret"));
        std::fs::write(&file, " \n").expect("write");
        assert!(Auth::new(token(Some(&file)).expect("read"), public).is_err());
    }
}
