//! RFC 9110 §13.1 conditional request headers and strong ETags carrying generations.
//!
//! `If-Match` and `If-None-Match` are parsed here by a small parser of their own. The `headers` crate (0.4)
//! implements both fields, but its `IfMatch`/`IfNoneMatch` neither reject a malformed member (an unquoted or
//! unterminated tag is skipped as if absent, so `If-Match: "12` would silently never match instead of being a
//! 400) nor let a caller iterate the listed tags (only `precondition_passes(&ETag)`), which the server needs to
//! turn a single-tag field into one compare-and-swap without reading first.

use idem_core::ProblemType;
use std::collections::BTreeSet;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use idem_store::{Generation, Precondition};

use crate::Problem;

/// `"42"`: the strong ETag for a generation (RFC 9110 §8.8.3).
pub(crate) fn etag(g: Generation) -> HeaderValue {
    // Digits and quotes are always a valid header value.
    HeaderValue::from_str(&format!("\"{g}\"")).unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
}

/// What one conditional field names, reduced to our generations.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Names {
    /// `*`: any current representation.
    Any,
    /// The generations whose ETag the listed tags match under the field's comparison function. Tags that are
    /// no ETag of ours (`"a,b"`, `"007"`, and weak tags under strong comparison) match nothing, so they are
    /// left out; an empty set matches nothing.
    Generations(BTreeSet<Generation>),
}

impl Names {
    fn matches(&self, current: Option<Generation>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Names::Any, Some(_)) => true,
            (Names::Generations(set), Some(g)) => set.contains(&g),
        }
    }
}

/// How a request's preconditions came out against the current generation (RFC 9110 §13.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Evaluation {
    /// Perform the method.
    Proceed,
    /// Step 1: `If-Match` is present and does not match: 412.
    IfMatchFailed,
    /// Step 3: `If-None-Match` matches: 304 for GET/HEAD, 412 otherwise.
    IfNoneMatchMatched,
}

/// The `If-Match` and `If-None-Match` fields of a request, parsed and validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Conditions {
    if_match: Option<Names>,
    if_none_match: Option<Names>,
}

impl Conditions {
    /// Parses both fields; several field lines of one field combine into one list (RFC 9110 §5.3).
    ///
    /// # Errors
    /// 400 `invalid-precondition` for a value that is not `*` or a list of entity-tags.
    pub(crate) fn parse(headers: &HeaderMap) -> Result<Self, Problem> {
        Ok(Self {
            // §13.1.1: If-Match uses the strong comparison function, so a weak tag never matches.
            if_match: parse_field(headers, &header::IF_MATCH, Comparison::Strong)?,
            // §13.1.2: If-None-Match uses the weak comparison function, so W/"7" matches generation 7.
            if_none_match: parse_field(headers, &header::IF_NONE_MATCH, Comparison::Weak)?,
        })
    }

    /// Evaluates the fields against the current generation (`None` = absent) in the order of RFC 9110 §13.2.2:
    /// `If-Match` first, then `If-None-Match`. (`If-Unmodified-Since` and `If-Modified-Since` are not
    /// supported: a generation is no date.)
    pub(crate) fn evaluate(&self, current: Option<Generation>) -> Evaluation {
        if let Some(names) = &self.if_match
            && !names.matches(current)
        {
            return Evaluation::IfMatchFailed;
        }
        if let Some(names) = &self.if_none_match
            && names.matches(current)
        {
            return Evaluation::IfNoneMatchMatched;
        }
        Evaluation::Proceed
    }

    /// The one store precondition that holds for exactly the current generations these fields pass, when there
    /// is one; then the write is a single compare-and-swap. `None` when the fields name several generations
    /// (`If-Match: "7", "1"`), exclude some (`If-None-Match: "7"`), or can never pass: such a write needs the
    /// current generation first (see `kv::conditional`).
    pub(crate) fn as_precondition(&self) -> Option<Precondition> {
        let excludes_nothing = |names: &Option<Names>| match names {
            None => true,
            Some(Names::Generations(set)) => set.is_empty(),
            Some(Names::Any) => false,
        };
        match &self.if_match {
            None if excludes_nothing(&self.if_none_match) => Some(Precondition::Any),
            None if self.if_none_match == Some(Names::Any) => Some(Precondition::Absent),
            Some(Names::Any) if excludes_nothing(&self.if_none_match) => Some(Precondition::Present),
            Some(Names::Generations(set)) if set.len() == 1 => {
                let g = set.first().copied()?;
                let excluded = self.if_none_match.as_ref().is_some_and(|n| n.matches(Some(g)));
                (!excluded).then_some(Precondition::Generation(g))
            }
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Comparison {
    /// RFC 9110 §8.8.3.2: both tags strong and their opaque-tags equal.
    Strong,
    /// Opaque-tags equal, weakness ignored.
    Weak,
}

fn invalid(name: &HeaderName, detail: impl std::fmt::Display) -> Problem {
    Problem::bad_request(ProblemType::InvalidPrecondition, format!("{name}: {detail}"))
}

/// Parses `*` or `#entity-tag` (RFC 9110 §13.1.1, §13.1.2, list syntax §5.6.1) over all field lines of `name`.
fn parse_field(headers: &HeaderMap, name: &HeaderName, comparison: Comparison) -> Result<Option<Names>, Problem> {
    let mut lines = headers.get_all(name).iter().peekable();
    if lines.peek().is_none() {
        return Ok(None);
    }
    let mut stars = 0usize;
    let mut tags = 0usize;
    let mut generations = BTreeSet::new();
    for line in lines {
        for element in ListElements::new(line.as_bytes()) {
            match element.map_err(|e| invalid(name, e))? {
                Element::Any => stars += 1,
                Element::Tag { weak, opaque } => {
                    tags += 1;
                    if weak && comparison == Comparison::Strong {
                        continue;
                    }
                    // Equal opaque-tags, compared as octets: "007" and "+7" are not the ETag "7".
                    if let Some(g) = std::str::from_utf8(opaque)
                        .ok()
                        .and_then(|s| s.parse::<Generation>().ok().filter(|g| g.to_string() == s))
                    {
                        generations.insert(g);
                    }
                }
            }
        }
    }
    match (stars, tags) {
        (1, 0) => Ok(Some(Names::Any)),
        (1.., _) => Err(invalid(name, "* stands alone; it cannot be listed with entity-tags or another *")),
        (0, 0) => Err(invalid(name, "names no entity-tag; expected * or a list like \"42\", \"43\"")),
        (0, _) => Ok(Some(Names::Generations(generations))),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Element<'a> {
    Any,
    Tag { weak: bool, opaque: &'a [u8] },
}

/// The elements of one field line: `[ element ] *( OWS "," OWS [ element ] )`, where empty elements are
/// skipped as RFC 9110 §5.6.1.2 requires of a recipient. Commas inside a quoted opaque-tag belong to the tag.
struct ListElements<'a> {
    rest: &'a [u8],
    failed: bool,
}

impl<'a> ListElements<'a> {
    fn new(line: &'a [u8]) -> Self {
        Self { rest: line, failed: false }
    }

    fn skip_ows(&mut self) {
        while let [b' ' | b'\t', tail @ ..] = self.rest {
            self.rest = tail;
        }
    }

    fn element(&mut self) -> Result<Element<'a>, String> {
        if let [b'*', tail @ ..] = self.rest {
            self.rest = tail;
            return Ok(Element::Any);
        }
        let (weak, quoted) = match self.rest {
            [b'W', b'/', tail @ ..] => (true, tail),
            other => (false, other),
        };
        let [b'"', inner @ ..] = quoted else {
            return Err(format!("expected * or a quoted entity-tag like \"42\" or W/\"42\", got {}", shown(self.rest)));
        };
        // etagc = %x21 / %x23-7E / obs-text (§8.8.3); header values hold no other controls than HTAB.
        let Some(end) = inner.iter().position(|&b| b == b'"') else {
            return Err(format!("unterminated quoted entity-tag {}", shown(self.rest)));
        };
        let opaque = &inner[..end];
        if let Some(&b) = opaque.iter().find(|&&b| !(b == 0x21 || (0x23..=0x7e).contains(&b) || b >= 0x80)) {
            return Err(format!(
                "entity-tag {} holds the character {:?}, not allowed there",
                shown(self.rest),
                b as char
            ));
        }
        self.rest = &inner[end + 1..];
        Ok(Element::Tag { weak, opaque })
    }
}

impl<'a> Iterator for ListElements<'a> {
    type Item = Result<Element<'a>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        loop {
            self.skip_ows();
            match self.rest {
                [] => return None,
                [b',', tail @ ..] => self.rest = tail,
                _ => break,
            }
        }
        let result = self.element().and_then(|e| {
            self.skip_ows();
            match self.rest {
                [] => Ok(e),
                [b',', tail @ ..] => {
                    self.rest = tail;
                    Ok(e)
                }
                _ => Err(format!("expected a comma after an element, got {}", shown(self.rest))),
            }
        });
        self.failed = result.is_err();
        Some(result)
    }
}

/// Up to 64 characters of raw field text, for a problem's detail.
fn shown(bytes: &[u8]) -> String {
    let s: String = String::from_utf8_lossy(bytes).chars().take(64).collect();
    format!("{s:?}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn conditions(lines: &[(&HeaderName, &str)]) -> Result<Conditions, Problem> {
        let mut headers = HeaderMap::new();
        for (name, value) in lines {
            headers.append(*name, HeaderValue::from_str(value).unwrap());
        }
        Conditions::parse(&headers)
    }

    fn gens(ns: &[u64]) -> Option<Names> {
        Some(Names::Generations(ns.iter().copied().map(Generation::new).collect()))
    }

    #[test]
    fn lists_parse_with_optional_whitespace_and_empty_elements() {
        let m = &header::IF_MATCH;
        for value in [
            "\"7\",\"1\"",
            "\"7\", \"1\"",
            " \"7\" ,\t\"1\" ",
            "\"7\",,\"1\",",
            ", \"7\" , , \"1\"",
            "\"1\", \"7\", \"1\"",
        ] {
            assert_eq!(conditions(&[(m, value)]).unwrap().if_match, gens(&[1, 7]), "{value:?}");
        }
        // Several field lines are one list (RFC 9110 §5.3).
        assert_eq!(conditions(&[(m, "\"7\""), (m, "\"1\"")]).unwrap().if_match, gens(&[1, 7]));
        assert_eq!(conditions(&[(m, "*")]).unwrap().if_match, Some(Names::Any));
        assert_eq!(conditions(&[(m, " * ")]).unwrap().if_match, Some(Names::Any));
    }

    #[test]
    fn opaque_tags_compare_as_octets() {
        let m = &header::IF_MATCH;
        // A comma inside the quotes is part of one opaque tag, which is no generation of ours.
        assert_eq!(conditions(&[(m, "\"a,b\"")]).unwrap().if_match, gens(&[]));
        assert_eq!(conditions(&[(m, "\"a,b\", \"3\"")]).unwrap().if_match, gens(&[3]));
        assert_eq!(conditions(&[(m, "\"007\", \"+7\", \"7.0\", \"\"")]).unwrap().if_match, gens(&[]));
        assert_eq!(conditions(&[(m, "\"18446744073709551616\"")]).unwrap().if_match, gens(&[]));
    }

    #[test]
    fn weak_tags_never_match_if_match_but_do_match_if_none_match() {
        let c =
            conditions(&[(&header::IF_MATCH, "W/\"1\", \"2\""), (&header::IF_NONE_MATCH, "W/\"3\", \"4\"")]).unwrap();
        assert_eq!(c.if_match, gens(&[2]));
        assert_eq!(c.if_none_match, gens(&[3, 4]));
    }

    #[test]
    fn malformed_fields_are_refused_precisely() {
        for (value, says) in [
            ("12", "expected * or a quoted entity-tag"),
            ("\"12", "unterminated quoted entity-tag"),
            ("\"1\", \"2", "unterminated quoted entity-tag"),
            ("\"1\" \"2\"", "expected a comma"),
            ("\"1\"x", "expected a comma"),
            ("W/", "expected * or a quoted entity-tag"),
            ("w/\"1\"", "expected * or a quoted entity-tag"),
            ("\"1\", *", "* stands alone"),
            ("*, *", "* stands alone"),
            ("", "names no entity-tag"),
            (" , ,", "names no entity-tag"),
            ("\"a b\"", "not allowed there"),
        ] {
            for name in [&header::IF_MATCH, &header::IF_NONE_MATCH] {
                let p = conditions(&[(name, value)]).unwrap_err();
                assert_eq!(p.status(), http::StatusCode::BAD_REQUEST, "{value:?}");
                let detail = p.detail().to_owned();
                assert!(detail.starts_with(name.as_str()) && detail.contains(says), "{value:?}: {detail}");
            }
        }
        // `*` on one line and a tag on another is the list `*, "1"`.
        assert!(conditions(&[(&header::IF_MATCH, "*"), (&header::IF_MATCH, "\"1\"")]).is_err());
    }

    #[test]
    fn evaluation_follows_rfc_9110_13_2_2() {
        let (im, inm) = (&header::IF_MATCH, &header::IF_NONE_MATCH);
        let g = |n| Some(Generation::new(n));
        let c = conditions(&[(im, "\"7\", \"1\"")]).unwrap();
        assert_eq!(c.evaluate(g(1)), Evaluation::Proceed);
        assert_eq!(c.evaluate(g(7)), Evaluation::Proceed);
        assert_eq!(c.evaluate(g(2)), Evaluation::IfMatchFailed);
        assert_eq!(c.evaluate(None), Evaluation::IfMatchFailed);
        let c = conditions(&[(inm, "\"7\", W/\"1\"")]).unwrap();
        assert_eq!(c.evaluate(g(1)), Evaluation::IfNoneMatchMatched);
        assert_eq!(c.evaluate(g(2)), Evaluation::Proceed);
        assert_eq!(c.evaluate(None), Evaluation::Proceed);
        // Both: If-Match is judged first.
        let c = conditions(&[(im, "\"1\", \"2\""), (inm, "\"2\", \"3\"")]).unwrap();
        assert_eq!(c.evaluate(g(1)), Evaluation::Proceed);
        assert_eq!(c.evaluate(g(2)), Evaluation::IfNoneMatchMatched);
        assert_eq!(c.evaluate(g(3)), Evaluation::IfMatchFailed);
        let c = conditions(&[(im, "*"), (inm, "*")]).unwrap();
        assert_eq!(c.evaluate(g(1)), Evaluation::IfNoneMatchMatched);
        assert_eq!(c.evaluate(None), Evaluation::IfMatchFailed);
    }

    #[test]
    fn single_compare_and_swaps_need_no_read() {
        let (im, inm) = (&header::IF_MATCH, &header::IF_NONE_MATCH);
        let p = |lines: &[(&HeaderName, &str)]| conditions(lines).unwrap().as_precondition();
        let g = |n| Precondition::Generation(Generation::new(n));
        assert_eq!(p(&[]), Some(Precondition::Any));
        assert_eq!(p(&[(inm, "*")]), Some(Precondition::Absent));
        assert_eq!(p(&[(inm, "\"a,b\"")]), Some(Precondition::Any));
        assert_eq!(p(&[(im, "*")]), Some(Precondition::Present));
        assert_eq!(p(&[(im, "*"), (inm, "W/\"x\"")]), Some(Precondition::Present));
        assert_eq!(p(&[(im, "\"5\"")]), Some(g(5)));
        assert_eq!(p(&[(im, "\"5\", W/\"6\", \"a\"")]), Some(g(5)));
        assert_eq!(p(&[(im, "\"5\""), (inm, "\"6\"")]), Some(g(5)));
        // These need the current generation first.
        assert_eq!(p(&[(im, "\"5\", \"6\"")]), None);
        assert_eq!(p(&[(im, "\"5\""), (inm, "W/\"5\"")]), None);
        assert_eq!(p(&[(im, "\"5\""), (inm, "*")]), None);
        assert_eq!(p(&[(im, "W/\"5\"")]), None);
        assert_eq!(p(&[(inm, "\"5\"")]), None);
        assert_eq!(p(&[(im, "*"), (inm, "\"5\"")]), None);
        assert_eq!(p(&[(im, "*"), (inm, "*")]), None);
    }
}
