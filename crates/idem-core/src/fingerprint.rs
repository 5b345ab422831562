//! Request fingerprints and key scopes.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::Error;
use crate::key::canonical_payload;

/// What a fingerprint covers: the parts of a request that make two requests "the same write".
#[derive(Clone, Copy, Debug)]
pub struct RequestParts<'a> {
    method: &'a str,
    path: &'a str,
    query: Option<&'a str>,
    content_type: Option<&'a str>,
    body: &'a [u8],
}

impl<'a> RequestParts<'a> {
    /// The method (`POST`), the path as sent (`/orders`), the raw query without `?`, the `Content-Type` field
    /// value and the whole body.
    pub fn new(
        method: &'a str,
        path: &'a str,
        query: Option<&'a str>,
        content_type: Option<&'a str>,
        body: &'a [u8],
    ) -> Self {
        Self { method, path, query, content_type, body }
    }
}

/// SHA-256 over method, path, query, content type and body (32 bytes, shown as 64 hex digits).
///
/// Media types compare case-insensitively; JSON media types without their parameters (a `charset` changes
/// nothing in JSON). JSON bodies (`application/json` or any `+json` media type, RFC 6839 §3.1) are hashed in their RFC 8785
/// canonical form, so key order and insignificant whitespace do not change the fingerprint while array order
/// does; a body that claims JSON but does not parse is hashed as it is. Every part is length-prefixed, so no
/// two different requests share an input to the hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints one request.
    pub fn of_request(parts: &RequestParts<'_>) -> Self {
        let mut hasher = Sha256::new();
        let mut field = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        field(parts.method.as_bytes());
        field(parts.path.as_bytes());
        field(parts.query.unwrap_or("").as_bytes());
        let mut media_type = parts.content_type.map(normalise_content_type);
        let is_json = media_type.as_deref().is_some_and(|m| {
            let essence = m.split(';').next().unwrap_or("");
            essence == "application/json" || essence.ends_with("+json")
        });
        if is_json {
            // JSON has no charset parameter (RFC 8259 §11: it is always UTF-8), yet many clients add one:
            // `application/json; charset=utf-8` is the same request as `application/json`.
            media_type = media_type.map(|m| m.split(';').next().unwrap_or("").to_owned());
        }
        field(media_type.as_deref().unwrap_or("").as_bytes());
        if is_json {
            field(&canonical_payload(parts.body));
        } else {
            field(parts.body);
        }
        Self(hasher.finalize().into())
    }

    /// The 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 64 hex digits.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] for anything else.
    pub fn from_hex(s: &str) -> Result<Self, Error> {
        let bad = || Error::RecordCorrupt { reason: format!("fingerprint {s:?} is not 64 hex digits") };
        if s.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| bad())?;
        Ok(Self(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

// Media types are case-insensitive (RFC 9110 §8.3.1) and clients differ in spacing around parameters.
fn normalise_content_type(value: &str) -> String {
    value
        .split(';')
        .map(|part| part.trim().to_ascii_lowercase())
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join(";")
}

/// Lowercase hex, by the `hex` crate (a `format!` per byte was 2% of a first execution's CPU).
pub(crate) fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// Who owns an idempotency key: 32 hex digits of a SHA-256 of the caller's credential (the value of the
/// configured header, `Authorization` by default), or `anonymous` for requests without one.
///
/// Two callers with different credentials never share a record, so neither can read the other's stored
/// response; the credential itself is never stored.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope(String);

impl Scope {
    /// The scope of a request whose credential header holds `credential` (`None`: no such header).
    pub fn from_credential(credential: Option<&[u8]>) -> Self {
        match credential {
            None => Self("anonymous".to_owned()),
            Some(value) => {
                let mut hasher = Sha256::new();
                // Domain separation: the same token hashed elsewhere in a system must not equal a scope.
                hasher.update(b"idem scope\0");
                hasher.update(value);
                Self(hex(&hasher.finalize()[..16]))
            }
        }
    }

    /// The scope's text: `anonymous` or 32 hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parses the text form (as the admin endpoint receives it).
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when it is neither `anonymous` nor 32 lowercase hex digits.
    pub fn parse(s: &str) -> Result<Self, Error> {
        let hex_ok = s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if s == "anonymous" || hex_ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(Error::RecordCorrupt { reason: format!("scope {s:?} is neither 'anonymous' nor 32 hex digits") })
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(method: &str, path: &str, query: Option<&str>, ct: Option<&str>, body: &str) -> Fingerprint {
        Fingerprint::of_request(&RequestParts::new(method, path, query, ct, body.as_bytes()))
    }

    #[test]
    fn json_canonicalisation_ignores_order_and_whitespace_only() {
        let ct = Some("application/json");
        let a = fp("POST", "/o", None, ct, r#"{"a":1,"b":[1,2],"c":{"y":1,"x":2}}"#);
        assert_eq!(a, fp("POST", "/o", None, ct, "{ \"c\": {\"x\": 2, \"y\": 1},\n \"b\": [1, 2], \"a\": 1 }"));
        assert_eq!(
            fp("POST", "/o", None, Some("Application/JSON ; charset=UTF-8"), "{}"),
            fp("POST", "/o", None, Some("application/json"), "{ }")
        );
        assert_ne!(
            fp("POST", "/o", None, Some("text/plain; charset=latin1"), "x"),
            fp("POST", "/o", None, Some("text/plain"), "x")
        );
        assert_ne!(a, fp("POST", "/o", None, ct, r#"{"a":1,"b":[2,1],"c":{"y":1,"x":2}}"#));
        assert_ne!(a, fp("PATCH", "/o", None, ct, r#"{"a":1,"b":[1,2],"c":{"y":1,"x":2}}"#));
        assert_ne!(a, fp("POST", "/p", None, ct, r#"{"a":1,"b":[1,2],"c":{"y":1,"x":2}}"#));
        assert_ne!(a, fp("POST", "/o", Some("x=1"), ct, r#"{"a":1,"b":[1,2],"c":{"y":1,"x":2}}"#));
        let problem = Some("application/problem+json");
        assert_eq!(
            fp("POST", "/o", None, problem, r#"{"a":1, "b":2}"#),
            fp("POST", "/o", None, problem, r#"{"b":2,"a":1}"#)
        );
    }

    #[test]
    fn non_json_bodies_are_hashed_byte_exact() {
        let ct = Some("text/plain");
        assert_ne!(fp("POST", "/o", None, ct, r#"{"a":1,"b":2}"#), fp("POST", "/o", None, ct, r#"{"b":2,"a":1}"#));
        assert_ne!(fp("POST", "/o", None, ct, "x"), fp("POST", "/o", None, Some("text/csv"), "x"));
        // Length prefixes: moving bytes between fields changes the fingerprint.
        assert_ne!(fp("POST", "/ab", None, None, ""), fp("POST", "/a", Some("b"), None, ""));
    }

    #[test]
    fn fingerprint_hex_round_trips() {
        let a = fp("POST", "/o", None, None, "x");
        assert_eq!(Fingerprint::from_hex(&a.to_hex()).unwrap(), a);
        assert!(Fingerprint::from_hex("zz").is_err());
    }

    #[test]
    fn scopes_separate_credentials() {
        let alice = Scope::from_credential(Some(b"Bearer alice"));
        assert_eq!(alice, Scope::from_credential(Some(b"Bearer alice")));
        assert_ne!(alice, Scope::from_credential(Some(b"Bearer bob")));
        assert_eq!(Scope::from_credential(None).as_str(), "anonymous");
        assert_eq!(alice.as_str().len(), 32);
        assert_eq!(Scope::parse(alice.as_str()).unwrap(), alice);
        assert!(Scope::parse("../x").is_err());
    }
}
