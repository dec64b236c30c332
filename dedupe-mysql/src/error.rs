//! Mapping sqlx's errors into the core's typed error.

use std::time::Duration;

use dedupe_core::Error;

/// Maps a sqlx error by what retrying can do about it.
///
/// - connection trouble (I/O, TLS, a closed connection, the server going
///   away: 2006, 2013, 1053, too many connections 1040) is a retryable
///   [`Error::Unavailable`];
/// - a pool that gave no connection in time, a statement stopped by
///   `max_statement_time` (MariaDB 1969) or `max_execution_time` (MySQL
///   3024), a lock wait timeout (1205) is a retryable [`Error::Timeout`];
/// - a deadlock (1213) rolled back the whole statement: a retryable backend
///   error (the store retries its own statements first);
/// - a statement over `max_allowed_packet` (1153) cannot succeed again;
/// - a missing table (1146) says to run `migrate()`; anything else is not
///   retryable.
pub(crate) fn map(e: sqlx::Error, timeout: Duration) -> Error {
    match &e {
        sqlx::Error::PoolTimedOut => Error::Timeout {
            after: timeout,
            source: Some(Box::new(e)),
        },
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => {
            Error::unavailable(format!("mysql connection failed: {e}"), Some(Box::new(e)))
        }
        sqlx::Error::Database(_) => match number(&e).unwrap_or_default() {
            1969 | 3024 | 1205 => Error::Timeout {
                after: timeout,
                source: Some(Box::new(e)),
            },
            1040 | 1053 | 2006 | 2013 | 1927 => {
                Error::unavailable("mysql server unavailable", Some(Box::new(e)))
            }
            1213 => Error::retryable("mysql deadlock", Some(Box::new(e) as _)),
            1153 => Error::fatal(
                "statement larger than the server's max_allowed_packet",
                Some(Box::new(e) as _),
            ),
            1146 => Error::fatal(
                "dedupe table missing: run MySqlStore::migrate()",
                Some(Box::new(e) as _),
            ),
            // The server's own words: "Unknown database 'x'", "Access
            // denied for user ...", a permission.
            n => Error::fatal(
                format!("mysql refused: {} (error {n})", database_message(&e)),
                Some(Box::new(e) as _),
            ),
        },
        _ => Error::fatal(format!("mysql client error: {e}"), Some(Box::new(e) as _)),
    }
}

/// The server's error number of `e`, if the server answered one.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

/// Whether `e` is a deadlock, which rolled back the statement whole.
pub(crate) fn is_deadlock(e: &sqlx::Error) -> bool {
    number(e) == Some(1213)
}

/// The server's message of a database error.
fn database_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_string(),
        other => other.to_string(),
    }
}
