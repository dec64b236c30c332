//! SDK errors as the core's typed errors.

use std::time::Duration;

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use dedupe_core::Error;

/// Error codes DynamoDB answers when the same request may succeed later.
const RETRYABLE_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionConflictException",
    "TransactionInProgressException",
    // A global table's replica took a conflicting write to the same item
    // in another region at the same time (multi-region strong consistency).
    "ReplicatedWriteConflictException",
    // A transaction's cancellation reason for throttling.
    "ThrottlingError",
];

/// Whether an error code (also a transaction's cancellation reason, which
/// drops the `Exception` suffix) means "try again later".
pub(crate) fn retryable_code(code: &str) -> bool {
    RETRYABLE_CODES
        .iter()
        .any(|c| *c == code || c.strip_suffix("Exception") == Some(code))
}

/// Maps an SDK error, after the SDK's own retries: throttling, request limits,
/// 5xx, timeouts and connection trouble are retryable; a missing table or a
/// refused request is not. `timeout` is the bound reported by a timeout.
pub(crate) fn map_err<E>(e: SdkError<E, HttpResponse>, timeout: Duration) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let code = e.code().map(str::to_string);
    let status = e.raw_response().map(|r| r.status().as_u16());
    match &e {
        SdkError::TimeoutError(_) => Error::Timeout {
            after: timeout,
            source: Some(Box::new(e)),
        },
        SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            // Say what happened (refused, reset, no such host): the SDK's own
            // message is only "dispatch failure"; the cause is at the root.
            let mut root: &dyn std::error::Error = &e;
            while let Some(next) = root.source() {
                root = next;
            }
            let why = root.to_string();
            Error::unavailable(format!("dynamodb unreachable: {why}"), Some(Box::new(e)))
        }
        _ => match code.as_deref() {
            Some(code) if retryable_code(code) => {
                Error::unavailable("dynamodb throttled or unavailable", Some(Box::new(e)))
            }
            Some("ResourceNotFoundException") => Error::fatal(
                "dynamodb table missing: create it (see create_table_if_missing)",
                Some(Box::new(e) as _),
            ),
            _ if status.is_some_and(|s| s >= 500) => {
                Error::unavailable("dynamodb server error", Some(Box::new(e)))
            }
            _ => Error::fatal("dynamodb refused the request", Some(Box::new(e) as _)),
        },
    }
}

pub(crate) fn is_condition_failure<E: ProvideErrorMetadata>(e: &SdkError<E, HttpResponse>) -> bool {
    e.code() == Some("ConditionalCheckFailedException")
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::error::ErrorMetadata;
    use aws_sdk_dynamodb::operation::put_item::PutItemError;
    use aws_sdk_dynamodb::types::error::{
        ConditionalCheckFailedException, ProvisionedThroughputExceededException,
        RequestLimitExceeded, ResourceNotFoundException,
    };
    use aws_smithy_runtime_api::http::StatusCode;
    use aws_smithy_types::body::SdkBody;

    fn response(status: u16) -> HttpResponse {
        HttpResponse::new(
            StatusCode::try_from(status).expect("status"),
            SdkBody::empty(),
        )
    }

    /// The metadata the SDK's deserializer sets from a response.
    fn code(code: &str) -> ErrorMetadata {
        ErrorMetadata::builder().code(code).build()
    }

    fn mapped(err: PutItemError, status: u16) -> Error {
        map_err(
            SdkError::service_error(err, response(status)),
            Duration::from_secs(1),
        )
    }

    #[test]
    fn throttling_and_limits_are_retryable() {
        let throttled = mapped(
            PutItemError::ProvisionedThroughputExceededException(
                ProvisionedThroughputExceededException::builder()
                    .message("slow down")
                    .meta(code("ProvisionedThroughputExceededException"))
                    .build(),
            ),
            400,
        );
        assert!(throttled.is_retryable(), "{throttled}");
        let limited = mapped(
            PutItemError::RequestLimitExceeded(
                RequestLimitExceeded::builder()
                    .meta(code("RequestLimitExceeded"))
                    .build(),
            ),
            400,
        );
        assert!(limited.is_retryable(), "{limited}");
    }

    #[test]
    fn a_replicated_write_conflict_is_retryable() {
        let conflict = mapped(
            PutItemError::generic(code("ReplicatedWriteConflictException")),
            400,
        );
        assert!(conflict.is_retryable(), "{conflict}");
        assert!(retryable_code("ReplicatedWriteConflict"));
    }

    #[test]
    fn a_server_error_is_retryable_a_refusal_is_not() {
        let validation = || PutItemError::generic(code("ValidationException"));
        assert!(mapped(validation(), 500).is_retryable());
        assert!(!mapped(validation(), 400).is_retryable());
    }

    #[test]
    fn a_missing_table_is_not_retryable() {
        let missing = mapped(
            PutItemError::ResourceNotFoundException(
                ResourceNotFoundException::builder()
                    .meta(code("ResourceNotFoundException"))
                    .build(),
            ),
            400,
        );
        assert!(!missing.is_retryable());
        assert!(missing.to_string().contains("table missing"), "{missing}");
    }

    #[test]
    fn a_condition_failure_is_recognised() {
        let err = SdkError::service_error(
            PutItemError::ConditionalCheckFailedException(
                ConditionalCheckFailedException::builder()
                    .meta(code("ConditionalCheckFailedException"))
                    .build(),
            ),
            response(400),
        );
        assert!(is_condition_failure(&err));
    }

    #[test]
    fn cancellation_reasons_use_short_codes() {
        assert!(retryable_code("ThrottlingError"));
        assert!(retryable_code("TransactionConflict"));
        assert!(retryable_code("ProvisionedThroughputExceeded"));
        assert!(!retryable_code("ConditionalCheckFailed"));
    }
}
