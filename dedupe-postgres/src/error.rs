//! Mapping sqlx's errors into the core's typed error.

use std::time::Duration;

use dedupe_core::Error;

use crate::sql::{UNDECODABLE, UNDECODABLE_END};

/// Maps a sqlx error by what retrying can do about it.
///
/// - connection trouble (I/O, TLS, a closed or crashed connection, the server
///   shutting down or refusing connections) is a retryable [`Error::Unavailable`];
/// - a pool that gave no connection in time, or a statement cancelled by
///   `statement_timeout`, is a retryable [`Error::Timeout`];
/// - serialization failures and deadlocks are retryable backend errors;
/// - anything else (a missing table, a permission error) is not retryable.
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
        | sqlx::Error::Protocol(_) => Error::unavailable(
            format!("postgres connection failed: {e}"),
            Some(Box::new(e)),
        ),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                // query_canceled: statement_timeout or a cancel request.
                "57014" => Error::Timeout {
                    after: timeout,
                    source: Some(Box::new(e)),
                },
                // admin/crash shutdown, cannot connect now, too many connections,
                // and the whole class 08 of connection exceptions.
                "57P01" | "57P02" | "57P03" | "53300" => {
                    Error::unavailable("postgres server unavailable", Some(Box::new(e)))
                }
                c if c.starts_with("08") => {
                    Error::unavailable("postgres connection exception", Some(Box::new(e)))
                }
                // serialization_failure, deadlock_detected, lock_not_available.
                "40001" | "40P01" | "55P03" => {
                    Error::retryable("postgres transaction conflict", Some(Box::new(e) as _))
                }
                // invalid_text_representation: a claim statement that met a
                // live record it would not decode fails on purpose with one.
                "22P02" => match undecodable_key(db.message()) {
                    Some(key) => Error::corrupt(
                        key,
                        "the stored record does not decode (its state, token, attempts, \
                         claim id or fingerprint is out of range); the claim wrote nothing",
                    ),
                    None => Error::fatal("postgres statement failed", Some(Box::new(e) as _)),
                },
                // undefined_column: a table this version did not make.
                "42703" => Error::fatal(
                    "the dedupe table lacks a column the statement names: it was not made \
                     by PgStore::migrate() of this version",
                    Some(Box::new(e) as _),
                ),
                "42P01" => Error::fatal(
                    "dedupe table missing: run PgStore::migrate()",
                    Some(Box::new(e) as _),
                ),
                // The server's own words: "database \"x\" does not exist",
                // "password authentication failed for user ...", a permission.
                _ => Error::fatal(
                    format!("postgres refused: {} (SQLSTATE {code})", db.message()),
                    Some(Box::new(e) as _),
                ),
            }
        }
        _ => Error::fatal(
            format!("postgres client error: {e}"),
            Some(Box::new(e) as _),
        ),
    }
}

/// The key in the error a claim statement raises on purpose (see
/// [`UNDECODABLE`]): the server quotes the text it could not read as a
/// number, `"<UNDECODABLE><key><UNDECODABLE_END>"`, as it is.
fn undecodable_key(message: &str) -> Option<&str> {
    let (_, quoted) = message.split_once(UNDECODABLE)?;
    quoted.strip_suffix('"')?.strip_suffix(UNDECODABLE_END)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_key_of_an_undecodable_record() {
        let message = format!(
            "invalid input syntax for type smallint: \"{UNDECODABLE}acme:a \" does not decode{UNDECODABLE_END}\""
        );
        assert_eq!(undecodable_key(&message), Some("acme:a \" does not decode"));
        assert_eq!(
            undecodable_key("invalid input syntax for type smallint: \"x\""),
            None
        );
    }
}
