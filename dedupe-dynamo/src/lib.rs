//! # dedupe-dynamo
//!
//! The DynamoDB store of dedupe, on aws-sdk-dynamodb: one item per record, every
//! decision a conditional write. See [`DynamoStore`].

mod errors;
mod item;
mod store;

pub use item::{AttributeNames, MAX_ATTRIBUTE_NAME_BYTES};
pub use store::{DynamoBuilder, DynamoStore, MAX_OUTCOME_LIMIT, MAX_TRANSACTION_ITEMS};

// The caller's client is the SDK's; name the same version.
pub use aws_sdk_dynamodb;

/// A client for a DynamoDB-compatible endpoint (an emulator, a local service)
/// with static credentials, on the SDK's HTTPS client with rustls and the ring
/// provider. For AWS itself, build the client from `aws-config`'s default chain
/// and hand it to [`DynamoStore::builder`].
///
/// Each operation is bounded by `timeout` (the SDK's operation timeout), with
/// the SDK's standard retries (3 attempts) inside it for throttling and
/// transient errors.
pub fn client_for_endpoint(
    endpoint: &str,
    region: &str,
    timeout: std::time::Duration,
) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::retry::RetryConfig;
    use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("dedupe", "dedupe", None, None, "static"))
        .http_client(http)
        .timeout_config(
            TimeoutConfig::builder()
                .operation_timeout(timeout)
                .connect_timeout(timeout)
                .build(),
        )
        .retry_config(RetryConfig::standard().with_max_attempts(3))
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
