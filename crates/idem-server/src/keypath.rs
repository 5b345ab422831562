//! Keys travel percent-encoded in the path (RFC 3986 §2.1); any UTF-8 key round-trips, `/` included.

use crate::Problem;
use idem_core::ProblemType;

/// Decodes a raw path segment into a key, refusing malformed escapes (`%zz`, a lone `%`) and non-UTF-8
/// results instead of passing them through as literal text.
pub(crate) fn decode_key(raw: &str) -> Result<String, Problem> {
    check_escapes(raw)?;
    let decoded = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| Problem::bad_request(ProblemType::InvalidKey, "the percent-decoded key is not valid UTF-8"))?;
    Ok(decoded.into_owned())
}

/// Refuses a malformed escape (`%zz`, a lone `%`) in a path or query (RFC 3986 §2.1), which lenient decoders
/// would pass through as literal text.
pub(crate) fn check_escapes(raw: &str) -> Result<(), Problem> {
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let ok = bytes.get(i + 1..i + 3).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit));
            if !ok {
                let shown: String = raw[i..].chars().take(3).collect();
                return Err(Problem::bad_request(
                    ProblemType::InvalidPercentEncoding,
                    format!("\"%\" at byte {i} must start an escape of two hex digits, found {shown:?}"),
                ));
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    Ok(())
}

/// Percent-encodes a key for the KV API's path (`/v1/kv/{encoded}`): everything but letters, digits, `-`, `_`
/// and `~` is escaped, `/` included. `.` is escaped too, although RFC 3986 §2.3 lets it stand: a key `.` or
/// `..` would otherwise be a dot-segment that clients remove (RFC 3986 §5.2.4) before sending.
pub fn encode_key(key: &str) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');
    percent_encoding::utf8_percent_encode(key, SET).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_any_utf8_key() {
        for key in ["a", "a/b/c", "ключ 🔑", "100%", "?#[]", " spaced ", "a%2Fb", ".", "..", "../x"] {
            let enc = encode_key(key);
            assert!(!enc.split('/').any(|seg| seg == "." || seg == ".."), "{enc} has a dot-segment");
            assert_eq!(decode_key(&enc).unwrap(), key);
        }
    }

    #[test]
    fn refuses_malformed_escapes() {
        for raw in ["%", "%2", "%zz", "ab%g0", "x%"] {
            let p = decode_key(raw).unwrap_err();
            assert_eq!(p.status(), http::StatusCode::BAD_REQUEST, "{raw}");
        }
        assert!(decode_key("%ff%fe").is_err(), "non-UTF-8 must be refused");
    }
}
