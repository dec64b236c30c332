//! # dedupe-dynamo
//!
//! The DynamoDB store of dedupe, on aws-sdk-dynamodb: one item per record, every
//! decision a conditional write. See [`DynamoStore`].

#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod builder;
mod clock;
mod codec;
mod error;
mod expressions;
mod inbox;
mod ops;
mod order;
mod store;
mod table;

pub use codec::{AttributeNames, MAX_ATTRIBUTE_NAME_BYTES};
pub use store::{DynamoBuilder, DynamoStore, MAX_ITEM_OUTCOME_BYTES, MAX_TRANSACTION_ITEMS};

// The caller's client is the SDK's; name the same version.
pub use aws_sdk_dynamodb;

/// The SDK's HTTPS client on rustls with the ring provider (one TLS stack, no
/// C crypto build, and no provider clash with the other stores' rustls).
fn https_client() -> aws_sdk_dynamodb::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// A client for a DynamoDB-compatible endpoint (an emulator, a local service)
/// with static credentials. For AWS itself use [`client_from_env`], or build
/// the client your own way and hand it to [`DynamoStore::builder`].
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
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_string()))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("dedupe", "dedupe", None, None, "static"))
        .http_client(https_client())
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

/// A client from the standard AWS chain (`aws-config`): region, credentials,
/// retries and timeouts from the environment, profile files, web identity, or
/// ECS and EC2 metadata, as every AWS SDK reads them; `endpoint` overrides the
/// endpoint (a DynamoDB-compatible service). Where the chain sets no operation
/// timeout, each call is bounded by 5 s, retries included.
///
/// ```no_run
/// # async fn demo() -> dedupe_core::Result<()> {
/// let client = dedupe_dynamo::client_from_env(None).await;
/// let store = dedupe_dynamo::DynamoStore::builder(client).table("dedupe_records").build()?;
/// # Ok(()) }
/// ```
#[cfg(feature = "aws-config")]
#[cfg_attr(docsrs, doc(cfg(feature = "aws-config")))]
pub async fn client_from_env(endpoint: Option<&str>) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
    use aws_sdk_dynamodb::config::BehaviorVersion;
    let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(https_client());
    if let Some(endpoint) = endpoint {
        loader = loader.endpoint_url(endpoint);
    }
    let shared = loader.load().await;
    let mut config = aws_sdk_dynamodb::config::Builder::from(&shared);
    let bounded = shared
        .timeout_config()
        .is_some_and(|t| t.operation_timeout().is_some());
    if !bounded {
        config = config.timeout_config(
            TimeoutConfig::builder()
                .operation_timeout(std::time::Duration::from_secs(5))
                .build(),
        );
    }
    aws_sdk_dynamodb::Client::from_conf(config.build())
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
