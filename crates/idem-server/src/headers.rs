//! RFC 9110 §13.1 conditional request headers and strong ETags carrying generations.

use http::{HeaderMap, HeaderValue, header};
use idem_store::{Generation, Precondition};

use crate::Problem;

/// `"42"`: the strong ETag for a generation (RFC 9110 §8.8.3).
pub(crate) fn etag(g: Generation) -> HeaderValue {
    // Digits and quotes are always a valid header value.
    HeaderValue::from_str(&format!("\"{g}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
}

/// Parses one entity-tag: `"<generation>"`; `Ok(None)` for a weak tag, which strong comparison never matches
/// (RFC 9110 §8.8.3.2), and for an opaque tag that is no generation of ours.
fn parse_tag(s: &str) -> Result<Option<Generation>, Problem> {
    let s = s.trim();
    let (weak, rest) = match s.strip_prefix("W/") {
        Some(r) => (true, r),
        None => (false, s),
    };
    let inner = rest
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .filter(|i| !i.contains('"') && i.bytes().all(|b| b == 0x21 || (0x23..=0x7e).contains(&b) || b >= 0x80))
        .ok_or_else(|| malformed(s))?;
    if weak {
        return Ok(None);
    }
    Ok(inner.parse::<Generation>().ok())
}

fn malformed(s: &str) -> Problem {
    let shown: String = s.chars().take(64).collect();
    Problem::bad_request(
        "invalid-precondition",
        "Invalid precondition header",
        format!("expected * or a quoted entity-tag like \"42\", got {shown:?}"),
    )
}

fn single<'a>(headers: &'a HeaderMap, name: &header::HeaderName) -> Result<Option<&'a str>, Problem> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(Problem::bad_request(
            "invalid-precondition",
            "Invalid precondition header",
            format!("{name} appears more than once; send one field line"),
        ));
    }
    let s = first.to_str().map_err(|_| malformed("<non-ASCII header>"))?;
    if s.contains(',') {
        return Err(Problem::bad_request(
            "invalid-precondition",
            "Invalid precondition header",
            format!("{name} lists several entity-tags; idem compares one generation per request"),
        ));
    }
    Ok(Some(s.trim()))
}

/// The write precondition from `If-Match` / `If-None-Match`: none, `If-None-Match: *`, `If-Match: *`,
/// `If-Match: "g"`.
///
/// A weak or foreign tag in `If-Match` can never match, so it becomes a generation no value has (0) and the
/// write gets 412, as RFC 9110 §13.1.1 requires.
pub(crate) fn write_precondition(headers: &HeaderMap) -> Result<Precondition, Problem> {
    let if_match = single(headers, &header::IF_MATCH)?;
    let if_none_match = single(headers, &header::IF_NONE_MATCH)?;
    match (if_match, if_none_match) {
        (Some(_), Some(_)) => Err(Problem::bad_request(
            "invalid-precondition",
            "Invalid precondition header",
            "send If-Match or If-None-Match, not both",
        )),
        (None, None) => Ok(Precondition::Any),
        (Some("*"), None) => Ok(Precondition::Present),
        (Some(tag), None) => Ok(Precondition::Generation(parse_tag(tag)?.unwrap_or(Generation::new(0)))),
        (None, Some("*")) => Ok(Precondition::Absent),
        (None, Some(tag)) => {
            parse_tag(tag)?;
            Err(Problem::bad_request(
                "invalid-precondition",
                "Invalid precondition header",
                "on writes If-None-Match takes only *; use If-Match: \"<generation>\" for compare-and-swap",
            ))
        }
    }
}

/// For GET: the generation named by `If-None-Match`, to answer 304 when it is current (RFC 9110 §13.1.2).
/// `*` matches any live value.
pub(crate) fn read_precondition(headers: &HeaderMap) -> Result<Option<Precondition>, Problem> {
    match single(headers, &header::IF_NONE_MATCH)? {
        None => Ok(None),
        Some("*") => Ok(Some(Precondition::Present)),
        // Weak comparison applies to If-None-Match, so W/"g" matches generation g.
        Some(tag) => {
            let strong = tag.trim().strip_prefix("W/").unwrap_or(tag);
            Ok(Some(Precondition::Generation(parse_tag(strong)?.unwrap_or(Generation::new(0)))))
        }
    }
}
