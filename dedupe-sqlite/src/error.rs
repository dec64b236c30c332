//! Mapping rusqlite's errors into the core's typed error.

use std::time::Duration;

use dedupe_core::Error;
use rusqlite::ErrorCode;

/// Maps a rusqlite error. `database is locked` / busy after the busy timeout is a
/// retryable [`Error::Timeout`]; I/O trouble and a file that cannot be opened are
/// retryable [`Error::Unavailable`]; anything else is a non-retryable backend error.
pub(crate) fn map(e: rusqlite::Error, busy_timeout: Duration) -> Error {
    let code = e.sqlite_error_code();
    match code {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Error::Timeout {
            after: busy_timeout,
            source: Some(Box::new(e)),
        },
        Some(
            ErrorCode::CannotOpen
            | ErrorCode::SystemIoFailure
            | ErrorCode::DiskFull
            | ErrorCode::OutOfMemory
            | ErrorCode::FileLockingProtocolFailed,
        ) => Error::unavailable(
            "sqlite database cannot be used right now",
            Some(Box::new(e)),
        ),
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => Error::backend(
            "sqlite file is corrupt or not a database",
            false,
            Some(Box::new(e) as _),
        ),
        _ => Error::backend("sqlite statement failed", false, Some(Box::new(e) as _)),
    }
}
