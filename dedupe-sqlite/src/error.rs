//! Mapping rusqlite's errors into the core's typed error.

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{BoxError, Error};
use rusqlite::ErrorCode;

/// Maps a rusqlite error. `database is locked` / busy after the busy timeout is a
/// retryable [`Error::Timeout`]; I/O trouble and a file that cannot be opened are
/// retryable [`Error::Unavailable`], and so is a transaction SQLite aborted (the
/// writes of a group that another write's I/O error rolled back); anything else is a non-retryable backend error.
///
/// One kind of busy is not a wait that ran out: `SQLITE_BUSY_SNAPSHOT`, a
/// write in a transaction that read first (`BEGIN DEFERRED`) after another
/// connection committed. SQLite answers it at once, and no retry inside that
/// transaction can succeed: it is a retryable backend error that says to roll
/// back and begin again.
pub(crate) fn map(e: rusqlite::Error, busy_timeout: Duration) -> Error {
    if let rusqlite::Error::SqliteFailure(failure, _) = &e {
        if failure.extended_code == rusqlite::ffi::SQLITE_BUSY_SNAPSHOT {
            return Error::retryable(
                "sqlite: the transaction read before another connection committed, so it \
                 cannot write; roll it back and begin again (BEGIN IMMEDIATE takes the \
                 write lock first and avoids this)",
                Some(Box::new(e) as BoxError),
            );
        }
    }
    classify(e.sqlite_error_code(), Box::new(e), busy_timeout)
}

/// [`map`] for an error that answers several calls (every write of a group that
/// failed together): each answer keeps it as its source.
pub(crate) fn map_shared(e: &Arc<rusqlite::Error>, busy_timeout: Duration) -> Error {
    classify(e.sqlite_error_code(), Box::new(Arc::clone(e)), busy_timeout)
}

fn classify(code: Option<ErrorCode>, e: BoxError, busy_timeout: Duration) -> Error {
    match code {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Error::Timeout {
            after: busy_timeout,
            source: Some(e),
        },
        Some(
            ErrorCode::OperationAborted
            | ErrorCode::CannotOpen
            | ErrorCode::SystemIoFailure
            | ErrorCode::DiskFull
            | ErrorCode::OutOfMemory
            | ErrorCode::FileLockingProtocolFailed,
        ) => Error::unavailable("sqlite database cannot be used right now", Some(e)),
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
            Error::fatal("sqlite file is corrupt or not a database", Some(e))
        }
        _ => Error::fatal("sqlite statement failed", Some(e)),
    }
}
