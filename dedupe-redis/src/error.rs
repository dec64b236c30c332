//! Mapping redis-rs errors into the core's typed error.

use std::time::Duration;

use dedupe_core::{Error, Key};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// Where a call ran: a standalone server, or a Cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Topology {
    Standalone,
    Cluster,
}

/// Maps a redis-rs error by what retrying can do about it:
/// - a response that did not come in time is a retryable [`Error::Timeout`];
/// - connection trouble (refused, dropped, I/O, a cluster that is reshaping or
///   down, a server loading its data or busy with a script) is a retryable
///   [`Error::Unavailable`];
/// - so is a server that cannot take the write for now: out of memory under
///   `noeviction` (`OOM`), too few replicas for `min-replicas-to-write`
///   (`NOREPLICAS`), a failed snapshot blocking writes (`MISCONF`), its client
///   limit reached, or a script cache flushed under the call (`NOSCRIPT` after
///   the driver loaded the script again);
/// - a refused password or client setting, and a `MOVED`/`ASK` redirect on a
///   store opened as standalone (the URL names a Cluster node: use
///   `redis+cluster://`), are configuration errors;
/// - `WRONGTYPE` means something else owns the record's key: a corrupt record;
/// - anything else is a non-retryable backend error.
pub(crate) fn map(
    e: RedisError,
    timeout: Duration,
    key: Option<&Key>,
    topology: Topology,
) -> Error {
    if matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig
    ) {
        return Error::config(format!("redis refused the connection's settings: {e}"));
    }
    let redirect = matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
    );
    if redirect && topology == Topology::Standalone {
        return Error::config(format!(
            "redis redirected a call ({e}): the server is a Cluster node; open it as a Cluster \
             (redis+cluster://host:port,host:port)"
        ));
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
        || redirect
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::NoScript
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
    if matches!(e.code(), Some("BUSY")) {
        return Error::unavailable("redis is busy running a script", Some(Box::new(e)));
    }
    if matches!(e.code(), Some("OOM" | "NOREPLICAS" | "MISCONF"))
        || e.to_string().contains("max number of clients")
    {
        return Error::unavailable(
            format!("redis cannot take the write now: {e}"),
            Some(Box::new(e)),
        );
    }
    Error::fatal("redis command failed", Some(Box::new(e) as _))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's error reply, as the driver parses it off the wire.
    fn reply(line: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(redis::Value::ServerError(e)) => e.into(),
            other => panic!("{line}: {other:?}"),
        }
    }

    fn mapped(line: &str, topology: Topology) -> Error {
        map(reply(line), Duration::from_secs(1), None, topology)
    }

    #[test]
    fn a_server_that_cannot_write_for_now_is_retryable() {
        for line in [
            "OOM command not allowed when used memory > 'maxmemory'.",
            "NOREPLICAS Not enough good replicas to write.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "ERR max number of clients reached",
            "NOSCRIPT No matching script. Please use EVAL.",
            "LOADING Redis is loading the dataset in memory",
            "READONLY You can't write against a read only replica.",
        ] {
            for topology in [Topology::Standalone, Topology::Cluster] {
                let e = mapped(line, topology);
                assert!(e.is_retryable(), "{line}: {e:?}");
            }
        }
    }

    #[test]
    fn a_redirect_is_a_configuration_error_on_a_standalone_store() {
        let e = mapped("MOVED 3999 127.0.0.1:6381", Topology::Standalone);
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
        assert!(e.to_string().contains("redis+cluster://"), "{e}");
        let e = mapped("MOVED 3999 127.0.0.1:6381", Topology::Cluster);
        assert!(e.is_retryable(), "{e:?}");
    }

    #[test]
    fn a_script_error_is_not_retryable() {
        let e = mapped(
            "ERR user_script:1: Script attempted to access nonexistent global variable",
            Topology::Standalone,
        );
        assert!(!e.is_retryable(), "{e:?}");
    }
}
