//! Keys: the identity of one logical event, and the values that travel with a claim.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 64;
/// Longest event id accepted, in bytes (UTF-8).
pub const MAX_ID_BYTES: usize = 512;
/// Longest claim id accepted, in bytes.
pub const MAX_CLAIM_ID_BYTES: usize = 128;
/// Longest payload fingerprint accepted, in bytes.
pub const MAX_FINGERPRINT_BYTES: usize = 64;

/// Why a key (or a claim id or fingerprint) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The named part was empty.
    #[error("{part} is empty")]
    Empty {
        /// Which part: `namespace`, `id`, `claim id` or `fingerprint`.
        part: &'static str,
    },
    /// The named part is longer than its limit.
    #[error("{part} is {len} bytes, over the limit of {max} bytes")]
    TooLong {
        /// Which part.
        part: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The named part holds a NUL byte, which no store can keep faithfully.
    #[error("{part} contains a NUL byte at offset {offset}")]
    Nul {
        /// Which part.
        part: &'static str,
        /// Byte offset of the first NUL.
        offset: usize,
    },
    /// The namespace holds a character outside `[A-Za-z0-9_.-]`.
    #[error(
        "namespace contains {found:?}; only ASCII letters, digits, '_', '-' and '.' are allowed"
    )]
    NamespaceChar {
        /// The first character refused.
        found: char,
    },
}

fn check_text(part: &'static str, value: &str, max: usize) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { part });
    }
    if value.len() > max {
        return Err(KeyError::TooLong {
            part,
            len: value.len(),
            max,
        });
    }
    if let Some(offset) = value.bytes().position(|b| b == 0) {
        return Err(KeyError::Nul { part, offset });
    }
    Ok(())
}

/// The identity of one logical event: a namespace (the source, such as `stripe`)
/// plus the provider's stable event id.
///
/// Use the provider's event id, never a per-attempt delivery id or a receipt time:
/// every retry of an event must map to the same key. Where the provider sends no
/// id, [`Key::from_body_sha256`] derives one from the raw body.
///
/// Validation, done by every constructor:
/// - namespace: 1 to [`MAX_NAMESPACE_BYTES`] bytes of `[A-Za-z0-9_.-]`, so that
///   stores which join namespace and id into one string can never collide;
/// - id: 1 to [`MAX_ID_BYTES`] bytes of UTF-8 with no NUL byte. Ids are compared
///   byte for byte: case matters and unicode is kept as given.
///
/// ```
/// use dedupe_core::Key;
/// let key = Key::new("stripe", "evt_1P9x")?;
/// assert_eq!(key.to_string(), "stripe:evt_1P9x");
/// assert!(Key::new("stripe", "").is_err());
/// # Ok::<(), dedupe_core::KeyError>(())
/// ```
///
/// A key is cheap to clone: it holds `namespace:id` once, shared, so the
/// leases and answers that carry it copy no text.
#[derive(Clone)]
pub struct Key {
    /// `namespace:id`: the namespace can hold no `:`, so the first one splits.
    joined: Arc<str>,
    /// The namespace's length in bytes.
    split: usize,
}

impl Key {
    /// Builds a key after validating both parts.
    pub fn new(namespace: impl AsRef<str>, id: impl AsRef<str>) -> Result<Self, KeyError> {
        let (namespace, id) = (namespace.as_ref(), id.as_ref());
        check_text("namespace", namespace, MAX_NAMESPACE_BYTES)?;
        if let Some(found) = namespace
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            return Err(KeyError::NamespaceChar { found });
        }
        check_text("id", id, MAX_ID_BYTES)?;
        let mut joined = String::with_capacity(namespace.len() + 1 + id.len());
        joined.push_str(namespace);
        joined.push(':');
        joined.push_str(id);
        Ok(Self {
            joined: joined.into(),
            split: namespace.len(),
        })
    }

    /// A key whose id is `sha256:<lowercase hex>` of the raw body, for providers that
    /// send no event id. Hash the bytes exactly as received, before any parsing.
    ///
    /// ```
    /// use dedupe_core::Key;
    /// let key = Key::from_body_sha256("acme", b"hello")?;
    /// assert_eq!(
    ///     key.id(),
    ///     "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    /// );
    /// # Ok::<(), dedupe_core::KeyError>(())
    /// ```
    pub fn from_body_sha256(namespace: impl AsRef<str>, body: &[u8]) -> Result<Self, KeyError> {
        Self::new(
            namespace,
            format!("sha256:{}", hex::encode(Sha256::digest(body))),
        )
    }

    /// The provider's event id when there is a non-empty one, else the SHA-256 of the
    /// raw body. This is the extraction rule the webhook path uses.
    ///
    /// ```
    /// use dedupe_core::Key;
    /// assert_eq!(Key::from_event_id_or_body("gh", Some("d-1"), b"{}")?.id(), "d-1");
    /// assert!(Key::from_event_id_or_body("gh", None, b"{}")?.id().starts_with("sha256:"));
    /// # Ok::<(), dedupe_core::KeyError>(())
    /// ```
    pub fn from_event_id_or_body(
        namespace: impl AsRef<str>,
        event_id: Option<&str>,
        body: &[u8],
    ) -> Result<Self, KeyError> {
        match event_id {
            Some(id) if !id.is_empty() => Self::new(namespace, id),
            _ => Self::from_body_sha256(namespace, body),
        }
    }

    /// The namespace (the event's source).
    pub fn namespace(&self) -> &str {
        &self.joined[..self.split]
    }

    /// The event id inside the namespace.
    pub fn id(&self) -> &str {
        &self.joined[self.split + 1..]
    }

    /// `namespace:id`, the form [`Display`](fmt::Display) writes, which stores
    /// that keep a key in one column store.
    ///
    /// ```
    /// use dedupe_core::Key;
    /// assert_eq!(Key::new("gh", "d-1")?.joined(), "gh:d-1");
    /// # Ok::<(), dedupe_core::KeyError>(())
    /// ```
    pub fn joined(&self) -> &str {
        &self.joined
    }
}

// Equality and hashing over `namespace:id` are those of the two parts, as the
// namespace can hold no `:`; order is by namespace, then id.
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.joined == other.joined
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.joined.hash(state);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.namespace(), self.id()).cmp(&(other.namespace(), other.id()))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.joined)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:?}:{:?})", self.namespace(), self.id())
    }
}

/// A caller-chosen id for one logical attempt, so that a retried claim whose first
/// answer was lost on the wire gets the same lease back instead of `InFlight`.
///
/// 1 to [`MAX_CLAIM_ID_BYTES`] bytes, no NUL.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ClaimId(String);

impl ClaimId {
    /// Validates and wraps a claim id.
    pub fn new(id: impl Into<String>) -> Result<Self, KeyError> {
        let id = id.into();
        check_text("claim id", &id, MAX_CLAIM_ID_BYTES)?;
        Ok(Self(id))
    }

    /// The claim id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ClaimId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClaimId({:?})", self.0)
    }
}

/// A digest of an event's payload. When a claim carries one and the stored record
/// carries a different one, the store answers `Mismatch`: the same key arrived with
/// another payload, which is a provider bug or a forged event, never a duplicate.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(Vec<u8>);

impl Fingerprint {
    /// The SHA-256 of the payload.
    pub fn sha256(payload: &[u8]) -> Self {
        Self(Sha256::digest(payload).to_vec())
    }

    /// Wraps digest bytes computed elsewhere (1 to [`MAX_FINGERPRINT_BYTES`] bytes).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(KeyError::Empty {
                part: "fingerprint",
            });
        }
        if bytes.len() > MAX_FINGERPRINT_BYTES {
            return Err(KeyError::TooLong {
                part: "fingerprint",
                len: bytes.len(),
                max: MAX_FINGERPRINT_BYTES,
            });
        }
        Ok(Self(bytes))
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_come_back_as_given_and_order_is_by_namespace_then_id() -> Result<(), KeyError> {
        let key = Key::new("ns", "a:b:c")?;
        assert_eq!((key.namespace(), key.id()), ("ns", "a:b:c"));
        assert_eq!(key.joined(), "ns:a:b:c");
        assert_eq!(key.to_string(), "ns:a:b:c");
        assert_eq!(format!("{key:?}"), r#"Key("ns":"a:b:c")"#);
        // By the joined text "a-b:y" would come first ('-' is below ':').
        assert!(Key::new("a", "x")? < Key::new("a-b", "y")?);
        assert_ne!(Key::new("a", "b:c")?, Key::new("a", "b")?);
        assert_eq!(key.clone(), Key::new(String::from("ns"), "a:b:c")?);
        Ok(())
    }

    #[test]
    fn rejects_bad_parts() {
        assert_eq!(
            Key::new("", "x"),
            Err(KeyError::Empty { part: "namespace" })
        );
        assert_eq!(Key::new("ns", ""), Err(KeyError::Empty { part: "id" }));
        assert_eq!(
            Key::new("ns", "a\0b"),
            Err(KeyError::Nul {
                part: "id",
                offset: 1
            })
        );
        assert_eq!(
            Key::new("n:s", "x"),
            Err(KeyError::NamespaceChar { found: ':' })
        );
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert!(matches!(
            Key::new("ns", long),
            Err(KeyError::TooLong { part: "id", .. })
        ));
        assert!(Key::new("ns", "é".repeat(MAX_ID_BYTES / 2)).is_ok());
        assert!(Key::new("a".repeat(MAX_NAMESPACE_BYTES), "x").is_ok());
        assert!(Key::new("a".repeat(MAX_NAMESPACE_BYTES + 1), "x").is_err());
    }

    #[test]
    fn claim_id_and_fingerprint_limits() {
        assert!(ClaimId::new("").is_err());
        assert!(ClaimId::new("a\0").is_err());
        assert!(ClaimId::new("c".repeat(MAX_CLAIM_ID_BYTES + 1)).is_err());
        assert!(Fingerprint::from_bytes(vec![]).is_err());
        assert!(Fingerprint::from_bytes(vec![1; MAX_FINGERPRINT_BYTES + 1]).is_err());
        assert_eq!(Fingerprint::sha256(b"a").as_bytes().len(), 32);
    }
}

/// A fencing token: no other claim of the same key is ever handed the same one.
///
/// Cheap to clone: the text is shared.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LeaseToken(Arc<str>);

impl LeaseToken {
    /// A fresh random token (128 bits from a UUIDv4, written as 32 hex digits).
    /// Store authors reach it as [`backend::new_token`](crate::backend::new_token).
    pub(crate) fn generate() -> Self {
        Self::from_uuid(uuid::Uuid::new_v4())
    }

    /// The uuid's 32 lowercase hex digits, written without the formatting
    /// machinery (a batch makes one token a key).
    fn from_uuid(uuid: uuid::Uuid) -> Self {
        let mut text = [0u8; uuid::fmt::Simple::LENGTH];
        Self(Arc::from(&*uuid.simple().encode_lower(&mut text)))
    }

    /// `n` fresh tokens from one read of the OS's random source (the same
    /// source `new_v4` reads, 16 bytes a token). Should that read fail, each
    /// token is made on its own, as [`generate`](Self::generate) makes it.
    pub(crate) fn generate_many(n: usize) -> Vec<Self> {
        let mut bytes = vec![0u8; n * 16];
        if getrandom::fill(&mut bytes).is_err() {
            return (0..n).map(|_| Self::generate()).collect();
        }
        bytes
            .chunks_exact(16)
            .map(|chunk| {
                let mut random = [0u8; 16];
                random.copy_from_slice(chunk);
                Self::from_uuid(uuid::Builder::from_random_bytes(random).into_uuid())
            })
            .collect()
    }

    /// Wraps a token read back from storage.
    pub(crate) fn from_stored(token: impl Into<String>) -> Self {
        Self(Arc::from(token.into()))
    }

    /// The token as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", self.0)
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
