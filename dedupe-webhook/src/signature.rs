//! Signature verification, done before anything is claimed, so a forged request
//! can claim no real event id.
//!
//! | scheme | header | signed bytes | encoding | replay window |
//! |---|---|---|---|---|
//! | Standard Webhooks | `webhook-signature: v1,<b64> v1,<b64>` with `webhook-id`, `webhook-timestamp` (Svix: the same as `svix-signature`, `svix-id`, `svix-timestamp`) | `{id}.{timestamp}.{body}` | base64; secret `whsec_<base64 key>` | yes |
//! | Stripe | `Stripe-Signature: t=<ts>,v1=<hex>,v1=<hex>` | `{t}.{body}` | hex; the secret string is the key | yes |
//! | GitHub | `X-Hub-Signature-256: sha256=<hex>` | the body | hex | none signed |
//! | Shopify | `X-Shopify-Hmac-Sha256: <b64>` | the body | base64 | none signed |
//!
//! All are HMAC-SHA256, compared in constant time (`hmac`'s `verify_slice`).
//! Several secrets may be configured at once, for rotation: a signature made
//! with any of them is accepted. GitHub and Shopify sign no timestamp, so a
//! captured request can be replayed; the idempotency key (their stable event
//! id) turns such a replay into a duplicate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Why a request's signature was refused. Every variant answers 401.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// A header the scheme needs is absent.
    #[error("missing {0} header")]
    Missing(&'static str),
    /// A header is present but not in the scheme's format.
    #[error("malformed {header} header: {reason}")]
    Malformed {
        /// Which header.
        header: &'static str,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// The signed timestamp is further from now than the tolerance.
    #[error("timestamp is {skew_secs} s from now, outside the {tolerance_secs} s tolerance")]
    Stale {
        /// Distance from now, in seconds.
        skew_secs: u64,
        /// The configured tolerance, in seconds.
        tolerance_secs: u64,
    },
    /// No signature in the request matches any configured secret.
    #[error("no signature matches")]
    NoMatch,
}

/// What a signature check found: the parts of the request the signature
/// covered that the key may come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Verified {
    /// The message id the signature covered (Standard Webhooks and Svix:
    /// `webhook-id` or `svix-id`, whichever header set was signed); `None` for
    /// schemes that sign no id.
    pub id: Option<String>,
}

/// The header names of Standard Webhooks, and Svix's names for the same
/// three headers: a request is checked with one set, never a mix.
const STANDARD_HEADERS: [[&str; 3]; 2] = [
    ["webhook-id", "webhook-timestamp", "webhook-signature"],
    ["svix-id", "svix-timestamp", "svix-signature"],
];

/// A configuration error: a secret that is not in its scheme's format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {scheme} secret: {reason}")]
pub struct SecretError {
    scheme: &'static str,
    reason: &'static str,
}

/// A signature scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scheme {
    /// Standard Webhooks (Svix and others).
    StandardWebhooks,
    /// Stripe.
    Stripe,
    /// GitHub (`X-Hub-Signature-256`).
    GitHub,
    /// Shopify (`X-Shopify-Hmac-Sha256`).
    Shopify,
}

impl Scheme {
    /// The scheme's name, as in URLs and logs.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::StandardWebhooks => "standard",
            Scheme::Stripe => "stripe",
            Scheme::GitHub => "github",
            Scheme::Shopify => "shopify",
        }
    }
}

/// Checks requests against one scheme and one or more secrets.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use dedupe_webhook::{Scheme, Verifier};
///
/// let verifier = Verifier::new(Scheme::GitHub, ["It's a Secret to Everybody"])?;
/// let mut headers = http::HeaderMap::new();
/// headers.insert(
///     "x-hub-signature-256",
///     "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17".parse()?,
/// );
/// verifier.verify(&headers, b"Hello, World!", SystemTime::now())?;
/// assert!(verifier.verify(&headers, b"Hello, World?", SystemTime::now()).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Verifier {
    scheme: Scheme,
    keys: Vec<Vec<u8>>,
    tolerance: Duration,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("scheme", &self.scheme)
            .field("secrets", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Verifier {
    /// Default distance allowed between a signed timestamp and now.
    pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

    /// A verifier accepting signatures made with any of `secrets` (more than one
    /// while a secret is rotated). Standard Webhooks secrets are `whsec_` and the
    /// base64 of the key; the other schemes use the secret string as the key.
    pub fn new<S: AsRef<str>>(
        scheme: Scheme,
        secrets: impl IntoIterator<Item = S>,
    ) -> Result<Self, SecretError> {
        let bad = |reason| SecretError {
            scheme: scheme.name(),
            reason,
        };
        let mut keys = Vec::new();
        for secret in secrets {
            let secret = secret.as_ref();
            if secret.is_empty() {
                return Err(bad("empty"));
            }
            // A secret pasted with a newline or a space around it would sign
            // nothing the provider sends: every delivery would be refused 401.
            if secret.trim() != secret {
                return Err(bad(
                    "has whitespace before or after it (a newline from a file or a copy?): \
                     no provider's secret does",
                ));
            }
            keys.push(match scheme {
                Scheme::StandardWebhooks => {
                    let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
                    let key = STANDARD
                        .decode(b64)
                        .map_err(|_| bad("not whsec_<base64>"))?;
                    if key.is_empty() {
                        return Err(bad("empty key"));
                    }
                    key
                }
                _ => secret.as_bytes().to_vec(),
            });
        }
        if keys.is_empty() {
            return Err(bad("no secret given"));
        }
        Ok(Self {
            scheme,
            keys,
            tolerance: Self::DEFAULT_TOLERANCE,
        })
    }

    /// Sets the replay tolerance for the schemes that sign a timestamp.
    pub fn with_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The scheme checked.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Checks the request's signature over `body` at time `now`, and answers
    /// what it covered ([`Verified`]).
    ///
    /// Standard Webhooks requests are read with the `webhook-*` headers or
    /// with Svix's `svix-*` names: each set whose signature header is present
    /// is checked on its own, and the first that verifies is the one whose id
    /// is answered.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<Verified, SignatureError> {
        match self.scheme {
            Scheme::StandardWebhooks => {
                let mut first_error = None;
                for names in STANDARD_HEADERS {
                    if !headers.contains_key(names[2]) {
                        continue;
                    }
                    match self.verify_standard(names, headers, body, now) {
                        Ok(id) => return Ok(Verified { id: Some(id) }),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                Err(first_error.unwrap_or(SignatureError::Missing("webhook-signature")))
            }
            Scheme::Stripe => self
                .verify_stripe(headers, body, now)
                .map(|()| Verified::default()),
            Scheme::GitHub => {
                let value = header(headers, "x-hub-signature-256")?;
                let hex_sig = value
                    .strip_prefix("sha256=")
                    .ok_or(SignatureError::Malformed {
                        header: "x-hub-signature-256",
                        reason: "expected sha256=<hex>",
                    })?;
                let sig = hex::decode(hex_sig).map_err(|_| SignatureError::Malformed {
                    header: "x-hub-signature-256",
                    reason: "not hex",
                })?;
                self.check(&[&sig], &[body]).map(|()| Verified::default())
            }
            Scheme::Shopify => {
                let value = header(headers, "x-shopify-hmac-sha256")?;
                let sig = STANDARD
                    .decode(value.trim())
                    .map_err(|_| SignatureError::Malformed {
                        header: "x-shopify-hmac-sha256",
                        reason: "not base64",
                    })?;
                self.check(&[&sig], &[body]).map(|()| Verified::default())
            }
        }
    }

    /// Checks one set of Standard Webhooks headers; answers the signed id.
    fn verify_standard(
        &self,
        [id_name, ts_name, sig_name]: [&'static str; 3],
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<String, SignatureError> {
        let id = header(headers, id_name)?;
        let ts_text = header(headers, ts_name)?;
        let ts = parse_timestamp(ts_text, ts_name)?;
        self.check_fresh(ts, now)?;
        let value = header(headers, sig_name)?;
        let mut sigs = Vec::new();
        for entry in value.split(' ').filter(|e| !e.is_empty()) {
            let Some((version, b64)) = entry.split_once(',') else {
                return Err(SignatureError::Malformed {
                    header: sig_name,
                    reason: "expected v1,<base64> entries",
                });
            };
            if version != "v1" {
                continue; // other versions (v1a: asymmetric) are not ours to check
            }
            // An entry that does not decode cannot match; the others still may.
            if let Ok(sig) = STANDARD.decode(b64) {
                sigs.push(sig);
            }
        }
        let sigs: Vec<&[u8]> = sigs.iter().map(Vec::as_slice).collect();
        self.check(
            &sigs,
            &[id.as_bytes(), b".", ts_text.as_bytes(), b".", body],
        )?;
        Ok(id.to_string())
    }

    fn verify_stripe(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), SignatureError> {
        const NAME: &str = "stripe-signature";
        let value = header(headers, NAME)?;
        let mut ts_text = None;
        let mut sigs = Vec::new();
        for part in value.split(',') {
            let Some((k, v)) = part.trim().split_once('=') else {
                return Err(SignatureError::Malformed {
                    header: NAME,
                    reason: "expected t=<ts>,v1=<hex>",
                });
            };
            match k {
                "t" => ts_text = Some(v),
                // A v1 that does not decode cannot match; the others still may.
                "v1" => sigs.extend(hex::decode(v).ok()),
                _ => {} // v0 (test mode, SHA-1) and future schemes are ignored
            }
        }
        let ts_text = ts_text.ok_or(SignatureError::Malformed {
            header: NAME,
            reason: "no t= timestamp",
        })?;
        let ts = parse_timestamp(ts_text, NAME)?;
        self.check_fresh(ts, now)?;
        let sigs: Vec<&[u8]> = sigs.iter().map(Vec::as_slice).collect();
        self.check(&sigs, &[ts_text.as_bytes(), b".", body])
    }

    fn check_fresh(&self, ts: u64, now: SystemTime) -> Result<(), SignatureError> {
        let now = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let skew = now.abs_diff(ts);
        if skew > self.tolerance.as_secs() {
            return Err(SignatureError::Stale {
                skew_secs: skew,
                tolerance_secs: self.tolerance.as_secs(),
            });
        }
        Ok(())
    }

    /// Whether any of `sigs` is the HMAC of the concatenated `parts` under any key,
    /// each comparison in constant time.
    fn check(&self, sigs: &[&[u8]], parts: &[&[u8]]) -> Result<(), SignatureError> {
        for key in &self.keys {
            let mut mac = HmacSha256::new_from_slice(key).map_err(|_| SignatureError::NoMatch)?;
            for part in parts {
                mac.update(part);
            }
            for sig in sigs {
                if mac.clone().verify_slice(sig).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(SignatureError::NoMatch)
    }

    /// Signs `body` as the scheme's sender would, with the first secret, at `at`
    /// (seconds since the epoch; ignored by GitHub and Shopify). Answers the
    /// headers to send: for tests and for tools that replay events.
    pub fn sign(&self, id: &str, at: u64, body: &[u8]) -> Vec<(&'static str, String)> {
        let mac = |parts: &[&[u8]]| {
            // A key of any length is accepted by HMAC.
            let mut mac = HmacSha256::new_from_slice(&self.keys[0]).expect("hmac takes any key");
            for part in parts {
                mac.update(part);
            }
            mac.finalize().into_bytes().to_vec()
        };
        let ts = at.to_string();
        match self.scheme {
            Scheme::StandardWebhooks => {
                let sig = mac(&[id.as_bytes(), b".", ts.as_bytes(), b".", body]);
                vec![
                    ("webhook-id", id.to_string()),
                    ("webhook-timestamp", ts),
                    ("webhook-signature", format!("v1,{}", STANDARD.encode(sig))),
                ]
            }
            Scheme::Stripe => {
                let sig = mac(&[ts.as_bytes(), b".", body]);
                vec![(
                    "stripe-signature",
                    format!("t={ts},v1={}", hex::encode(sig)),
                )]
            }
            Scheme::GitHub => vec![(
                "x-hub-signature-256",
                format!("sha256={}", hex::encode(mac(&[body]))),
            )],
            Scheme::Shopify => vec![("x-shopify-hmac-sha256", STANDARD.encode(mac(&[body])))],
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, SignatureError> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().ok_or(SignatureError::Missing(name))?;
    if values.next().is_some() {
        return Err(SignatureError::Malformed {
            header: name,
            reason: "sent more than once",
        });
    }
    value.to_str().map_err(|_| SignatureError::Malformed {
        header: name,
        reason: "not visible ASCII",
    })
}

fn parse_timestamp(text: &str, header: &'static str) -> Result<u64, SignatureError> {
    if text.is_empty() || text.len() > 12 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SignatureError::Malformed {
            header,
            reason: "timestamp is not whole seconds",
        });
    }
    text.parse().map_err(|_| SignatureError::Malformed {
        header,
        reason: "timestamp is not whole seconds",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().expect("header value"));
        }
        h
    }

    fn now_secs() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs()
    }

    #[test]
    fn github_documented_example() {
        // The example of GitHub's documentation on validating deliveries.
        let v = Verifier::new(Scheme::GitHub, ["It's a Secret to Everybody"]).expect("secret");
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17".into(),
        )]);
        assert!(v.verify(&h, b"Hello, World!", SystemTime::now()).is_ok());
        assert_eq!(
            v.verify(&h, b"Hello, World", SystemTime::now()),
            Err(SignatureError::NoMatch)
        );
    }

    #[test]
    fn svix_header_names_are_read_and_the_signed_set_names_the_id() {
        let v = Verifier::new(Scheme::StandardWebhooks, ["whsec_c2VjcmV0LWtleS1ieXRlcw=="])
            .expect("secret");
        let body = br#"{"type":"invoice.paid"}"#;
        let signed = v.sign("msg_svix", now_secs(), body);
        let svix: Vec<(&'static str, String)> = signed
            .iter()
            .map(|(k, val)| {
                let name = match *k {
                    "webhook-id" => "svix-id",
                    "webhook-timestamp" => "svix-timestamp",
                    _ => "svix-signature",
                };
                (name, val.clone())
            })
            .collect();
        let found = v
            .verify(&headers(&svix), body, SystemTime::now())
            .expect("svix");
        assert_eq!(found.id.as_deref(), Some("msg_svix"));
        // An unsigned webhook-id beside the signed svix set does not name the
        // message, and a webhook-signature that fails does not hide the svix one.
        let mut mixed = svix.clone();
        mixed.push(("webhook-id", "msg_forged".into()));
        mixed.push(("webhook-timestamp", now_secs().to_string()));
        mixed.push(("webhook-signature", "v1,AAAA".into()));
        let found = v
            .verify(&headers(&mixed), body, SystemTime::now())
            .expect("mixed");
        assert_eq!(found.id.as_deref(), Some("msg_svix"));
        // Ids are not mixed across sets: svix-signature with a webhook-id only.
        let crossed = vec![
            ("webhook-id", "msg_svix".to_string()),
            svix[1].clone(),
            svix[2].clone(),
        ];
        assert_eq!(
            v.verify(&headers(&crossed), body, SystemTime::now()),
            Err(SignatureError::Missing("svix-id"))
        );
        assert_eq!(
            v.verify(&HeaderMap::new(), body, SystemTime::now()),
            Err(SignatureError::Missing("webhook-signature"))
        );
    }

    #[test]
    fn standard_webhooks_known_vector() {
        // The test vector of the Standard Webhooks reference libraries.
        let v = Verifier::new(
            Scheme::StandardWebhooks,
            ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
        )
        .expect("secret")
        .with_tolerance(Duration::from_secs(u64::MAX / 4));
        let h = headers(&[
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek".into()),
            ("webhook-timestamp", "1614265330".into()),
            (
                "webhook-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=".into(),
            ),
        ]);
        assert!(v
            .verify(&h, br#"{"test": 2432232314}"#, SystemTime::now())
            .is_ok());
    }

    #[test]
    fn every_scheme_round_trips_and_refuses_a_changed_body() {
        for scheme in [
            Scheme::StandardWebhooks,
            Scheme::Stripe,
            Scheme::GitHub,
            Scheme::Shopify,
        ] {
            let secret = match scheme {
                Scheme::StandardWebhooks => "whsec_c2VjcmV0LWtleS1ieXRlcw==",
                _ => "whsec_plain_string_secret",
            };
            let v = Verifier::new(scheme, [secret]).expect("secret");
            let h = headers(&v.sign("evt_1", now_secs(), b"{\"id\":\"evt_1\"}"));
            assert!(
                v.verify(&h, b"{\"id\":\"evt_1\"}", SystemTime::now())
                    .is_ok(),
                "{scheme:?}"
            );
            assert_eq!(
                v.verify(&h, b"{\"id\":\"evt_2\"}", SystemTime::now()),
                Err(SignatureError::NoMatch),
                "{scheme:?}"
            );
        }
    }

    #[test]
    fn rotation_accepts_either_secret_and_several_signatures() {
        let old = Verifier::new(Scheme::Stripe, ["whsec_old"]).expect("secret");
        let new = Verifier::new(Scheme::Stripe, ["whsec_new"]).expect("secret");
        let both = Verifier::new(Scheme::Stripe, ["whsec_new", "whsec_old"]).expect("secrets");
        let at = now_secs();
        let body = b"{}";
        assert!(both
            .verify(&headers(&old.sign("", at, body)), body, SystemTime::now())
            .is_ok());
        // One header carrying two v1 signatures (Stripe during its own rotation).
        let a = &old.sign("", at, body)[0].1;
        let b = &new.sign("", at, body)[0].1;
        let v1b = b.split(',').nth(1).expect("v1");
        let h = headers(&[("stripe-signature", format!("{a},{v1b}"))]);
        assert!(new.verify(&h, body, SystemTime::now()).is_ok());
        assert!(old.verify(&h, body, SystemTime::now()).is_ok());
        let other = Verifier::new(Scheme::Stripe, ["whsec_other"]).expect("secret");
        assert_eq!(
            other.verify(&h, body, SystemTime::now()),
            Err(SignatureError::NoMatch)
        );
    }

    /// A secret with a newline or space around it is refused when the
    /// verifier is built, saying so, instead of refusing every delivery.
    #[test]
    fn a_secret_with_surrounding_whitespace_is_refused_at_start_up() {
        for secret in ["whsec_abc\n", " whsec_abc", "whsec_abc "] {
            let e = Verifier::new(Scheme::Stripe, [secret]).expect_err(secret);
            assert!(e.to_string().contains("whitespace"), "{e}");
        }
        assert!(Verifier::new(Scheme::Stripe, ["whsec_abc"]).is_ok());
    }

    #[test]
    fn an_undecodable_entry_does_not_hide_a_good_one() {
        let v = Verifier::new(Scheme::Stripe, ["whsec_x"]).expect("secret");
        let good = &v.sign("", now_secs(), b"{}")[0].1;
        let h = headers(&[("stripe-signature", format!("{good},v1=zz-not-hex"))]);
        assert!(v.verify(&h, b"{}", SystemTime::now()).is_ok());
        let sw = Verifier::new(Scheme::StandardWebhooks, ["whsec_c2VjcmV0"]).expect("secret");
        let signed = sw.sign("msg", now_secs(), b"{}");
        let mut pairs = signed.clone();
        pairs[2].1 = format!("v1,!!notbase64!! {}", signed[2].1);
        assert!(sw
            .verify(&headers(&pairs), b"{}", SystemTime::now())
            .is_ok());
    }

    #[test]
    fn stale_and_future_timestamps_are_refused() {
        for scheme in [Scheme::StandardWebhooks, Scheme::Stripe] {
            let v = Verifier::new(scheme, ["whsec_c2VjcmV0"]).expect("secret");
            for at in [now_secs() - 301, now_secs() + 301] {
                let h = headers(&v.sign("evt", at, b"{}"));
                assert!(
                    matches!(
                        v.verify(&h, b"{}", SystemTime::now()),
                        Err(SignatureError::Stale { .. })
                    ),
                    "{scheme:?} at {at}"
                );
            }
            let h = headers(&v.sign("evt", now_secs() - 299, b"{}"));
            assert!(v.verify(&h, b"{}", SystemTime::now()).is_ok());
        }
    }

    #[test]
    fn malformed_headers_are_typed_errors() {
        let v = Verifier::new(Scheme::Stripe, ["whsec_x"]).expect("secret");
        for value in ["", "t=", "t=abc,v1=00", "v1=zz,t=1", "garbage", "t=1"] {
            let h = headers(&[("stripe-signature", value.to_string())]);
            let e = v.verify(&h, b"{}", SystemTime::now()).expect_err(value);
            assert!(
                matches!(
                    e,
                    SignatureError::Malformed { .. }
                        | SignatureError::Stale { .. }
                        | SignatureError::NoMatch
                ),
                "{value}: {e:?}"
            );
        }
        assert_eq!(
            v.verify(&HeaderMap::new(), b"{}", SystemTime::now()),
            Err(SignatureError::Missing("stripe-signature"))
        );
        assert!(Verifier::new(Scheme::StandardWebhooks, ["whsec_!!"]).is_err());
        assert!(Verifier::new(Scheme::GitHub, [""]).is_err());
        assert!(Verifier::new::<&str>(Scheme::GitHub, []).is_err());
    }
}
