//! The `Idempotency-Key` request header: parsing (draft-ietf-httpapi-idempotency-key-header §2) and
//! deterministic derivation for clients that must rebuild the same key after a crash.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::Error;

/// Longest key accepted, in bytes (characters: keys are ASCII). Stripe's limit; the draft leaves it open.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1..=[`MAX_KEY_LEN`] printable ASCII characters (`0x20..=0x7E`).
///
/// Parsed from the header with [`IdempotencyKey::from_field_lines`], built with [`IdempotencyKey::new`], or
/// derived from a logical write with [`derive_key`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `key` as it stands (no header syntax: quotes are part of the key).
    ///
    /// # Errors
    /// [`Error::KeyEmpty`], [`Error::KeyTooLong`] beyond 255 bytes, [`Error::KeyInvalidCharacter`] for anything
    /// outside printable ASCII (control characters, CR, LF, DEL, non-ASCII).
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        check_printable(key.as_bytes())?;
        Ok(Self(key))
    }

    /// Parses the `Idempotency-Key` header from all of its field lines.
    ///
    /// Returns `Ok(None)` when the request has no such field. One line holds either an sf-string
    /// (`"8e03978e-40d5"`, RFC 9651 §3.3.3, as the draft specifies; parameters are ignored) or a bare value
    /// (`8e03978e-40d5`, as Stripe clients send it: visible ASCII without spaces or quotes).
    ///
    /// # Errors
    /// [`Error::KeyRepeated`] for two or more field lines (draft §2.1: the key must be unambiguous),
    /// [`Error::KeyMalformed`] for a quoted value that is not a valid sf-string or a bare value with spaces,
    /// quotes or commas, plus the errors of [`IdempotencyKey::new`].
    pub fn from_field_lines<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Result<Option<Self>, Error> {
        let mut lines = lines.into_iter();
        let Some(first) = lines.next() else {
            return Ok(None);
        };
        if lines.next().is_some() {
            return Err(Error::KeyRepeated);
        }
        Self::parse_field_value(first).map(Some)
    }

    /// Parses one field value; see [`IdempotencyKey::from_field_lines`].
    ///
    /// # Errors
    /// As [`IdempotencyKey::from_field_lines`], except [`Error::KeyRepeated`].
    pub fn parse_field_value(value: &[u8]) -> Result<Self, Error> {
        let trimmed = value.trim_ascii();
        if trimmed.first() == Some(&b'"') {
            // The sf-string parser enforces the quoting rules (only \" and \\ escapes, printable ASCII).
            let item: sfv::Item =
                sfv::Parser::new(trimmed).parse_item().map_err(|e| Error::KeyMalformed { reason: e.to_string() })?;
            let Some(s) = item.bare_item.as_string() else {
                return Err(Error::KeyMalformed { reason: "not an sf-string".into() });
            };
            return Self::new(s.as_str());
        }
        check_printable(trimmed)?;
        // A comma or space means an intermediary folded two field lines into one, or a client sent a list.
        if let Some(at) = trimmed.iter().position(|b| matches!(b, b' ' | b'"' | b',' | b'\\')) {
            return Err(Error::KeyMalformed {
                reason: format!(
                    "a bare key may not contain {:?} (at byte {at}); quote it as an sf-string",
                    trimmed[at] as char
                ),
            });
        }
        // Checked above: printable ASCII is UTF-8.
        Ok(Self(String::from_utf8_lossy(trimmed).into_owned()))
    }

    /// The key's characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an sf-string field value (RFC 9651 §4.1.6), the form to send in the header.
    pub fn to_field_value(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check_printable(bytes: &[u8]) -> Result<(), Error> {
    if bytes.is_empty() {
        return Err(Error::KeyEmpty);
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(Error::KeyTooLong { len: bytes.len(), max: MAX_KEY_LEN });
    }
    if let Some(position) = bytes.iter().position(|b| !(0x20..=0x7E).contains(b)) {
        return Err(Error::KeyInvalidCharacter { position, byte: bytes[position] });
    }
    Ok(())
}

/// The bytes a payload is hashed as: its RFC 8785 canonical form when it parses as JSON that the canonical
/// form represents exactly (so key order and whitespace do not matter, array order does), else the bytes
/// themselves. Not exact, so hashed raw: duplicate member names (a parser keeps one of them) and numbers of
/// magnitude 2^53 or more, integer or not (RFC 8785 §3.2.2.3 writes numbers as IEEE 754 doubles, which would
/// merge 9007199254740993 with 9007199254740992, and 18446744073709551617 with …618).
pub fn canonical_payload(payload: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let mut de = serde_json::Deserializer::from_slice(payload);
    if serde::de::Deserializer::deserialize_any(&mut de, Exact).is_err() || de.end().is_err() {
        return std::borrow::Cow::Borrowed(payload);
    }
    match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(value) => match serde_json_canonicalizer::to_vec(&value) {
            Ok(canonical) => std::borrow::Cow::Owned(canonical),
            Err(_) => std::borrow::Cow::Borrowed(payload),
        },
        Err(_) => std::borrow::Cow::Borrowed(payload),
    }
}

/// Walks a JSON document, failing on what the canonical form would not represent exactly.
struct Exact;

const EXACT_INT: u64 = 1 << 53;

impl<'de> serde::de::DeserializeSeed<'de> for Exact {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Exact {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JSON the canonical form represents exactly")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        if v > EXACT_INT { Err(E::custom("integer beyond 2^53")) } else { Ok(()) }
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        if v.unsigned_abs() > EXACT_INT { Err(E::custom("integer beyond 2^53")) } else { Ok(()) }
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        // serde_json gives an integer beyond 64 bits as an f64: 18446744073709551617 and …618 would be one
        // number (break-it review: a changed amount was replayed instead of refused).
        if v.abs() >= EXACT_INT as f64 { Err(E::custom("number beyond 2^53")) } else { Ok(()) }
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Exact)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key) {
                return Err(serde::de::Error::custom("duplicate member name"));
            }
            map.next_value_seed(Exact)?;
        }
        Ok(())
    }
}

/// Derives the idempotency key of one logical write: `PREFIX:ID:HASH`, where `HASH` is the first 16 hex digits
/// (64 bits) of the SHA-256 of the [canonical payload](canonical_payload).
///
/// The same prefix, id and payload give the same key in any process, so a client that crashed after sending
/// rebuilds the key it used; a changed payload gives another key (and the server then sees a new write).
///
/// # Errors
/// [`Error::DerivePrefix`] when the prefix is empty or contains `:` (it would make `a:b` + `c` and
/// `a` + `b:c` collide); [`Error::KeyTooLong`] / [`Error::KeyInvalidCharacter`] when prefix or id are too
/// long (together over 237 bytes) or not printable ASCII.
pub fn derive_key(prefix: &str, id: &str, payload: &[u8]) -> Result<IdempotencyKey, Error> {
    if prefix.is_empty() || prefix.contains(':') {
        return Err(Error::DerivePrefix { prefix: prefix.to_owned() });
    }
    let digest = Sha256::digest(canonical_payload(payload));
    let mut key = format!("{prefix}:{id}:");
    for byte in &digest[..8] {
        key.push_str(&format!("{byte:02x}"));
    }
    IdempotencyKey::new(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(lines: &[&str]) -> Result<Option<IdempotencyKey>, Error> {
        IdempotencyKey::from_field_lines(lines.iter().map(|l| l.as_bytes()))
    }

    #[test]
    fn sf_string_and_bare_forms() {
        assert_eq!(parse(&[r#""abc-1""#]).unwrap().unwrap().as_str(), "abc-1");
        assert_eq!(parse(&[r#""a \"q\" \\ b""#]).unwrap().unwrap().as_str(), r#"a "q" \ b"#);
        assert_eq!(
            parse(&["8e03978e-40d5-43e8-bc93-6894a57f9324"]).unwrap().unwrap().as_str(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse(&[r#""k";p=1"#]).unwrap().unwrap().as_str(), "k");
        assert_eq!(parse(&[]).unwrap(), None);
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert_eq!(parse(&[""]), Err(Error::KeyEmpty));
        assert_eq!(parse(&[r#""""#]), Err(Error::KeyEmpty));
        assert!(matches!(parse(&[&"x".repeat(256)]), Err(Error::KeyTooLong { len: 256, .. })));
        assert!(parse(&[&"x".repeat(255)]).is_ok());
        assert!(matches!(parse(&["a\tb"]), Err(Error::KeyInvalidCharacter { position: 1, byte: 9 })));
        assert!(matches!(parse(&["a\r\nb"]), Err(Error::KeyInvalidCharacter { .. })));
        assert!(matches!(parse(&["é"]), Err(Error::KeyInvalidCharacter { .. })));
        assert!(matches!(parse(&[r#""unterminated"#]), Err(Error::KeyMalformed { .. })));
        assert!(matches!(parse(&["a, b"]), Err(Error::KeyMalformed { .. })));
        assert_eq!(parse(&["a", "a"]), Err(Error::KeyRepeated));
    }

    #[test]
    fn field_value_round_trips() {
        let key = IdempotencyKey::new(r#"a "q" \ b"#).unwrap();
        let back = IdempotencyKey::parse_field_value(key.to_field_value().as_bytes()).unwrap();
        assert_eq!(back, key);
    }

    #[test]
    fn derived_keys_ignore_json_formatting_but_not_content() {
        let a = derive_key("orders", "123", br#"{"b": [1, 2], "a": 1}"#).unwrap();
        let b = derive_key("orders", "123", br#"{"a":1,"b":[1,2]}"#).unwrap();
        let c = derive_key("orders", "123", br#"{"a":1,"b":[2,1]}"#).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.as_str().starts_with("orders:123:"));
        assert_eq!(a.as_str().len(), "orders:123:".len() + 16);
        assert!(matches!(derive_key("a:b", "1", b""), Err(Error::DerivePrefix { .. })));
        // Not exactly representable in the canonical form: compared byte for byte instead.
        let big = |v: &str| derive_key("p", "1", format!(r#"{{"amount": {v}}}"#).as_bytes()).unwrap();
        assert_ne!(big("9007199254740993"), big("9007199254740992"));
        // Beyond 64 bits serde_json parses an f64, which both share (break-it review).
        assert_ne!(big("18446744073709551617"), big("18446744073709551618"));
        assert_ne!(big("1e300"), big("1.0e300"));
        assert_eq!(big("1.5"), derive_key("p", "1", br#"{"amount":1.5}"#).unwrap());
        assert_eq!(big("9007199254740992"), derive_key("p", "1", br#"{"amount":9007199254740992}"#).unwrap());
        assert_ne!(derive_key("p", "1", br#"{"a":1,"a":2}"#).unwrap(), derive_key("p", "1", br#"{"a":2}"#).unwrap());
        assert!(matches!(derive_key("p", &"x".repeat(250), b""), Err(Error::KeyTooLong { .. })));
    }
}
