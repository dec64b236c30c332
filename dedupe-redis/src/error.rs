//! Mapping redis-rs errors into the core's typed error.

use std::time::Duration;

use dedupe_core::{Error, Key};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// Maps a redis-rs error by what retrying can do about it:
/// - a response that did not come in time is a retryable [`Error::Timeout`];
/// - connection trouble (refused, dropped, I/O, a cluster that is reshaping or
///   down, a server loading its data or busy with a script) is a retryable
///   [`Error::Unavailable`];
/// - a refused password or client setting is a configuration error;
/// - `WRONGTYPE` means something else owns the record's key: a corrupt record;
/// - anything else is a non-retryable backend error.
pub(crate) fn map(e: RedisError, timeout: Duration, key: Option<&Key>) -> Error {
    if matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig
    ) {
        return Error::config(format!("redis refused the connection's settings: {e}"));
    }
    if e.is_timeout() {
        return Error::Timeout {
            after: timeout,
            source: Some(Box::new(e)),
        };
    }
    if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
            )
        )
    {
        return Error::unavailable(format!("redis unavailable: {e}"), Some(Box::new(e)));
    }
    if e.code() == Some("WRONGTYPE") {
        if let Some(key) = key {
            return Error::corrupt(key, format!("the key holds another type of value: {e}"));
        }
    }
    if e.code() == Some("BUSY") {
        return Error::unavailable("redis is busy running a script", Some(Box::new(e)));
    }
    Error::backend("redis command failed", false, Some(Box::new(e) as _))
}
