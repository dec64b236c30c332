//! Mapping rusqlite's errors into the core's typed error.

use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{BoxError, Error};
use rusqlite::ErrorCode;

/// Maps a rusqlite error. `database is locked` / busy after the busy timeout is a
/// retryable [`Error::Timeout`]; I/O trouble and a file that cannot be opened are
/// retryable [`Error::Unavailable`], and so is a transaction SQLite aborted (the
/// writes of a group that another write's I/O error rolled back); anything else is a non-retryable backend error.
pub(crate) fn map(e: rusqlite::Error, busy_timeout: Duration) -> Error {
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
            Error::backend("sqlite file is corrupt or not a database", false, Some(e))
        }
        _ => Error::backend("sqlite statement failed", false, Some(e)),
    }
}
