//! The `Idempotency-Key` request header: parsed as the IETF draft's
//! structured-field string (`"8e03978e-40d5"`), or as the bare token most
//! clients send (`8e03978e-40d5`, as Stripe's libraries do).

use http::HeaderMap;

/// The header's name.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

/// The longest key accepted, in bytes (Stripe's limit; the draft sets none).
pub const MAX_KEY_BYTES: usize = 255;

/// A client's idempotency key, as sent: 1 to [`MAX_KEY_BYTES`] printable
/// ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses one header value: a structured-field string (quoted, with `\"`
    /// and `\\` escapes) or a bare token of visible ASCII without a quote,
    /// a backslash, a `;` (parameters are not taken) or a `,` (two values).
    ///
    /// ```
    /// use dedupe_http::{IdempotencyKey, KeyError};
    /// assert_eq!(IdempotencyKey::parse(b"\"a-1\"")?.as_str(), "a-1");
    /// assert_eq!(IdempotencyKey::parse(b"a-1")?.as_str(), "a-1");
    /// assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
    /// # Ok::<(), KeyError>(())
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let key = match value.first() {
            None => return Err(KeyError::Empty),
            Some(b'"') => sf_string(value)?,
            Some(_) => {
                // Visible ASCII, but none of what gives a structured field
                // its shape: a quote, an escape, parameters (`;`), or a
                // comma (two field lines joined into one, RFC 9110 section
                // 5.3, or a list): never one key.
                if let Some(at) = value.iter().position(|b| {
                    !(0x21..=0x7e).contains(b) || matches!(b, b'"' | b'\\' | b';' | b',')
                }) {
                    return Err(KeyError::BadCharacter {
                        at,
                        byte: value[at],
                    });
                }
                // Checked just above: visible ASCII only.
                String::from_utf8_lossy(value).into_owned()
            }
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong { len: key.len() });
        }
        Ok(Self(key))
    }

    /// The key from a request's headers: `None` when there is no
    /// `Idempotency-Key`; an error when there are several, or it is malformed.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key as the client sent it (unquoted, unescaped).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why an `Idempotency-Key` header was refused (answered 400, nothing
/// written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header is there with nothing in it (or an empty quoted string).
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// Longer than [`MAX_KEY_BYTES`].
    #[error("the Idempotency-Key is {len} bytes long; at most {MAX_KEY_BYTES} are accepted")]
    TooLong {
        /// Its length, unquoted.
        len: usize,
    },
    /// A byte outside printable ASCII, or (in a bare key) a space, a
    /// quote, a backslash, a `;` or a `,`; the message says which and why.
    #[error("the Idempotency-Key has {} at {at}: {}", shown(*byte), why(*byte))]
    BadCharacter {
        /// Where, in the header's value.
        at: usize,
        /// The byte.
        byte: u8,
    },
    /// A quoted key whose closing quote is missing, with a bad escape, or
    /// with something after the closing quote.
    #[error("the Idempotency-Key is not a valid structured-field string: {0}")]
    Malformed(&'static str),
    /// More than one `Idempotency-Key` header.
    #[error("the request has more than one Idempotency-Key header")]
    Repeated,
    /// The route requires a key and the request has none.
    #[error("this request requires an Idempotency-Key header")]
    Missing,
}

/// A refused byte as a reader would name it.
fn shown(byte: u8) -> String {
    match byte {
        0x20..=0x7e => format!("'{}'", char::from(byte)),
        _ => format!("byte 0x{byte:02x}"),
    }
}

/// Why a byte is refused, and what to send instead.
fn why(byte: u8) -> &'static str {
    match byte {
        b',' => {
            "a comma makes two values (two Idempotency-Key lines are joined with one); \
             a key holding one is sent quoted, as \"a,b\""
        }
        b';' => "a bare key takes no parameters; a key holding ';' is sent quoted, as \"a;b\"",
        b' ' => "a bare key has no spaces; a key holding one is sent quoted, as \"a b\"",
        b'"' | b'\\' => "a key holding a quote or a backslash is sent quoted, escaped with '\\'",
        _ => "only printable ASCII is accepted",
    }
}

/// RFC 8941's sf-string: `"` then printable ASCII with `\"` and `\\`
/// escapes, then `"` and nothing else (parameters are not accepted).
fn sf_string(value: &[u8]) -> Result<String, KeyError> {
    let mut out = String::new();
    let mut at = 1;
    loop {
        let Some(&byte) = value.get(at) else {
            return Err(KeyError::Malformed("no closing quote"));
        };
        match byte {
            b'"' => break,
            b'\\' => match value.get(at + 1) {
                Some(&escaped @ (b'"' | b'\\')) => {
                    out.push(char::from(escaped));
                    at += 1;
                }
                _ => {
                    return Err(KeyError::Malformed(
                        "a backslash escapes only '\"' and '\\'",
                    ))
                }
            },
            0x20..=0x7e => out.push(char::from(byte)),
            _ => return Err(KeyError::BadCharacter { at, byte }),
        }
        at += 1;
    }
    if at + 1 != value.len() {
        return Err(KeyError::Malformed(
            "something follows the closing quote (parameters are not accepted)",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_bare_and_refused() {
        let ok = |v: &[u8]| IdempotencyKey::parse(v).map(|k| k.0);
        assert_eq!(ok(b"\"a b\""), Ok("a b".into()));
        assert_eq!(ok(br#""q\"\\""#), Ok(r#"q"\"#.into()));
        assert_eq!(ok(b"abc-123_XYZ"), Ok("abc-123_XYZ".into()));
        assert_eq!(ok(b"\"\""), Err(KeyError::Empty));
        assert_eq!(
            ok(b"a b"),
            Err(KeyError::BadCharacter { at: 1, byte: b' ' })
        );
        assert!(matches!(ok(b"\"abc"), Err(KeyError::Malformed(_))));
        assert!(matches!(ok(b"\"abc\";p=1"), Err(KeyError::Malformed(_))));
        assert!(matches!(ok(br#""a\n""#), Err(KeyError::Malformed(_))));
        assert_eq!(
            ok(b"\"caf\xc3\xa9\""),
            Err(KeyError::BadCharacter { at: 4, byte: 0xc3 })
        );
        assert_eq!(ok(&[b'k'; 255]).map(|k| k.len()), Ok(255));
        assert_eq!(ok(&[b'k'; 256]), Err(KeyError::TooLong { len: 256 }));
    }

    /// The refusal names the character and says what to send instead,
    /// never "only printable ASCII" for a comma.
    #[test]
    fn a_refused_character_is_named_with_its_reason() {
        let said = |v: &[u8]| IdempotencyKey::parse(v).expect_err("refused").to_string();
        let comma = said(b"a,b");
        assert!(
            comma.contains("',' at 1") && comma.contains("quoted"),
            "{comma}"
        );
        assert!(!comma.contains("printable"), "{comma}");
        assert!(said(b"a;b").contains("parameters"));
        assert!(said(b"a b").contains("no spaces"));
        let accent = said(b"\"caf\xc3\xa9\"");
        assert!(
            accent.contains("byte 0xc3 at 4") && accent.contains("printable ASCII"),
            "{accent}"
        );
    }

    #[test]
    fn two_headers_are_refused() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, "a".parse().expect("value"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers).map(|k| k.map(|k| k.0)),
            Ok(Some("a".into()))
        );
        headers.append(IDEMPOTENCY_KEY, "b".parse().expect("value"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(KeyError::Repeated)
        );
    }
}
