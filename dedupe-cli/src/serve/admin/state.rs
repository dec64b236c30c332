//! What the admin routes share: the server's parts, the tokens, and the
//! shape of a refusal.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::Json;
use dedupe_core::{Error, Inbox};
use http::StatusCode;
use sha2::{Digest, Sha256};

use super::jobs;
use crate::serve::app::App;
use crate::serve::throughput::Throughput;

/// The name of the dashboard's session cookie.
pub(super) const COOKIE: &str = "dedupe_admin";
/// Largest form a state-changing call may send (the filter fields).
pub(super) const FORM_LIMIT: usize = 64 * 1024;

/// What the admin routes share.
pub(crate) struct Admin {
    pub(super) app: Arc<App>,
    pub(super) inbox: Option<Arc<dyn Inbox>>,
    /// The namespaces this server's routes serve, shown on the dashboard.
    pub(super) namespaces: Vec<String>,
    pub(super) auth: Auth,
    pub(super) jobs: jobs::Jobs,
    pub(super) throughput: Arc<Throughput>,
}

/// The bearer token (if any), the session cookie it gives, and this
/// process's anti-forgery token.
pub(crate) struct Auth {
    pub(super) token: Option<String>,
    pub(super) session: Option<String>,
    pub(super) csrf: String,
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
        None => match std::env::var("DEDUPE_ADMIN_TOKEN") {
            Ok(token) => Some(token),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(Error::config("DEDUPE_ADMIN_TOKEN is not UTF-8 text"))
            }
        },
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
pub(super) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A JSON error: `{"error": kind, "message": ...}`.
pub(crate) fn refuse(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(serde_json::json!({"error": kind, "message": message.into()})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

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
