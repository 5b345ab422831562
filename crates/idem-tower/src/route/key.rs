//! Where a route's key comes from ([`KeySource`]) and what its fingerprint leaves out ([`Ignore`]): parsed
//! from the route's settings, applied to a delivery's head and body.

use std::str::FromStr;

use bytes::Bytes;
use http::HeaderName;
use http::request::Parts;
use percent_encoding::percent_decode_str;
use serde_json::Value;

use super::RouteError;

/// One part of a key source.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    /// The single field line of this header, trimmed.
    Header(HeaderName),
    /// A string, or a number's JSON text, at this RFC 6901 pointer of a JSON body.
    Json(String),
    /// The first value of this query parameter, percent-decoded.
    Query(String),
}

impl Part {
    fn parse(entry: &str, what: &'static str) -> Result<Self, RouteError> {
        let invalid = |reason| RouteError::InvalidSource { what, entry: entry.to_owned(), reason };
        let (kind, rest) = entry.split_once(':').ok_or_else(|| invalid("expected header:, json: or query:"))?;
        match kind {
            "header" => HeaderName::try_from(rest).map(Part::Header).map_err(|_| invalid("not a header name")),
            "json" if rest.starts_with('/') => Ok(Part::Json(rest.to_owned())),
            "json" => Err(invalid("a JSON pointer starts with / (RFC 6901)")),
            "query" if !rest.is_empty() => Ok(Part::Query(rest.to_owned())),
            "query" => Err(invalid("an empty query parameter name")),
            _ => Err(invalid("expected header:, json: or query:")),
        }
    }
}

/// Where a route's key comes from: `header:NAME`, `json:/rfc6901/pointer` or `query:NAME`, or several of them
/// joined with `+` (present only when every part is). Every value has `%` escaped as `%25` and `+` as `%2B`,
/// and the parts are joined with `+`, so no join equals another join or a single value.
///
/// A header given on two field lines, a JSON value that is an object, an array, null, a boolean, a fraction
/// or an integer beyond 64 bits, and a body that is not JSON all count as absent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySource(Vec<Part>);

impl FromStr for KeySource {
    type Err = RouteError;

    fn from_str(s: &str) -> Result<Self, RouteError> {
        let parts = s
            .split('+')
            .map(|p| {
                if p.is_empty() {
                    Err(RouteError::InvalidSource {
                        what: "key source",
                        entry: s.to_owned(),
                        reason: "an empty + part",
                    })
                } else {
                    Part::parse(p, "key source")
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self(parts))
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Part::Header(name) => write!(f, "header:{name}"),
            Part::Json(pointer) => write!(f, "json:{pointer}"),
            Part::Query(name) => write!(f, "query:{name}"),
        }
    }
}

/// As written in a configuration: `header:NAME`, `json:/pointer`, `query:NAME`, parts joined with `+`.
impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, part) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("+")?;
            }
            write!(f, "{part}")?;
        }
        Ok(())
    }
}

/// A request's body parsed as JSON at most once, shared by the key sources and the ignores.
#[derive(Default)]
pub(crate) struct JsonBody(Option<Option<Value>>);

impl JsonBody {
    pub(crate) fn get(&mut self, body: &[u8]) -> Option<&Value> {
        self.0.get_or_insert_with(|| serde_json::from_slice(body).ok()).as_ref()
    }
}

impl KeySource {
    /// The key this source gives for a request, if every part is present.
    pub(crate) fn extract(&self, parts: &Parts, body: &[u8], json: &mut JsonBody) -> Option<String> {
        let mut joined = String::new();
        for (i, part) in self.0.iter().enumerate() {
            let value = match part {
                Part::Header(name) => {
                    let mut lines = parts.headers.get_all(name).iter();
                    let first = lines.next()?;
                    if lines.next().is_some() {
                        return None;
                    }
                    first.to_str().ok()?.trim().to_owned()
                }
                Part::Json(pointer) => match json.get(body)?.pointer(pointer)? {
                    Value::String(s) => s.clone(),
                    // An integer serde_json holds exactly; a larger one (or a fraction) is parsed into an f64 that
                    // several ids share (break-it review: ids 18446744073709551617 and …618 were one delivery).
                    Value::Number(n) if n.is_u64() || n.is_i64() => n.to_string(),
                    _ => return None,
                },
                Part::Query(name) => query_value(parts.uri.query()?, name)?,
            };
            if value.is_empty() {
                return None;
            }
            if i > 0 {
                joined.push('+');
            }
            // Escaped in a single-part source too: a joined `u`+`v` and a single `u+v` from another source
            // of the list would otherwise be one key (break-it review).
            joined.push_str(&value.replace('%', "%25").replace('+', "%2B"));
        }
        Some(joined)
    }
}

/// The first value of `name` in a raw query, percent-decoded (`+` as a space, as forms encode it).
fn query_value(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

fn decode(s: &str) -> String {
    percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned()
}

/// A part of the request left out of the fingerprint: `json:/pointer` (an object member is removed, an array
/// element becomes null so that indices stay stable; applies only to a JSON body the canonical form represents
/// exactly), `query:NAME` (every value of it), or `header:NAME` (accepted for documentation: headers are never
/// compared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ignore(Part);

impl FromStr for Ignore {
    type Err = RouteError;

    fn from_str(s: &str) -> Result<Self, RouteError> {
        Part::parse(s, "ignore entry").map(Self)
    }
}

/// The request's body and query as the fingerprint compares them on a route with ignores.
pub(crate) fn without_ignored(
    ignore: &[Ignore],
    query: Option<&str>,
    body: &Bytes,
    json: &mut JsonBody,
) -> (Option<String>, Bytes) {
    let names: Vec<&str> =
        ignore.iter().filter_map(|i| if let Part::Query(n) = &i.0 { Some(n.as_str()) } else { None }).collect();
    let query = query.map(|q| {
        if names.is_empty() {
            return q.to_owned();
        }
        q.split('&')
            .filter(|pair| !names.contains(&decode(pair.split_once('=').map_or(*pair, |(k, _)| k)).as_str()))
            .collect::<Vec<_>>()
            .join("&")
    });
    let pointers: Vec<&str> =
        ignore.iter().filter_map(|i| if let Part::Json(p) = &i.0 { Some(p.as_str()) } else { None }).collect();
    // Only a body the canonical form represents exactly: else it is compared byte for byte, ignores and all
    // (removing a member from a body with duplicate names would compare something the sender never sent).
    if pointers.is_empty() || matches!(idem_core::canonical_payload(body), std::borrow::Cow::Borrowed(_)) {
        return (query, body.clone());
    }
    let Some(mut value) = json.get(body).cloned() else { return (query, body.clone()) };
    for pointer in pointers {
        remove_pointer(&mut value, pointer);
    }
    match serde_json::to_vec(&value) {
        Ok(bytes) => (query, Bytes::from(bytes)),
        Err(_) => (query, body.clone()),
    }
}

fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else { return };
    let last = last.replace("~1", "/").replace("~0", "~");
    let parent = if parent.is_empty() { Some(value) } else { value.pointer_mut(parent) };
    match parent {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Some(item) = last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}
