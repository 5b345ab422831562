//! What `idem check` sends: the target request the user named, the requests each probe plans from it, and how
//! a planned request is shown (`--dry-run`, the JSON report) and turned into a real one.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{Method, Url};

use crate::error::Error;

/// Header fields `idem check` sets itself: a second copy from `-H` would contradict it.
const RESERVED: [&str; 5] = ["idempotency-key", "content-type", "content-length", "transfer-encoding", "host"];

/// The request under test and everything the probes may use, checked once before anything is planned.
#[derive(Debug)]
pub struct Target {
    /// The method of the write (`--method`, POST by default).
    pub method: Method,
    /// The URL the user named.
    pub url: Url,
    /// The body as given (`--json`, `--data`; `{}` when neither).
    pub body: Bytes,
    /// Another body, for the payload-mismatch probe: the same JSON object with one member more, or the bytes
    /// with a line more.
    pub variant: Bytes,
    /// `Content-Type` of both bodies.
    pub content_type: HeaderValue,
    /// `-H` fields, sent on every request.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The first caller's credential field (`--credential`), sent on every request but the second caller's.
    pub credential: Option<(HeaderName, HeaderValue)>,
    /// The second caller's credential field (`--second-credential`), sent instead of the first.
    pub second_credential: Option<(HeaderName, HeaderValue)>,
    /// A URL of the same API that answers the request slowly (`--slow-url`), for the in-flight probe.
    pub slow_url: Option<Url>,
    /// A URL of the same API that answers the request with a 5xx or 429 (`--error-url`).
    pub error_url: Option<Url>,
    /// Another URL of the same API that takes the request (`--other-url`), for the same key on another path.
    pub other_url: Option<Url>,
    /// Requests the concurrency probe sends at once.
    pub concurrency: usize,
    /// Whether a request without a key must be refused with 400 (`--key-required`).
    pub key_required: bool,
    /// The retention the API states (`--retention-probe`): the expiry probe waits this long.
    pub retention: Option<Duration>,
    /// The prefix of every key this run sends, `idem-check-` and 8 random hex digits.
    pub run: String,
}

/// What a control request is for ([`Target::control`]).
const CONTROL_NOTE: &str =
    "another key, same body: a second execution, sent only when the answers cannot otherwise be told apart";

/// Who sends a request: the first caller (`--credential`, or none) or the second (`--second-credential`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Caller {
    /// Sends `--credential`, if any.
    First,
    /// Sends `--second-credential` instead.
    Second,
}

/// One request a probe will send, fixed before anything is sent so that `--dry-run` shows exactly what a run
/// sends.
#[derive(Clone, Debug)]
pub struct Planned {
    /// What this request is for, in the probe's words.
    pub note: &'static str,
    /// The method.
    pub method: Method,
    /// The URL (one the user named).
    pub url: Url,
    /// The `Idempotency-Key` field lines, in order (none, one, or two for the repeated-field probe).
    pub keys: Vec<HeaderValue>,
    /// Whose credential goes with it.
    pub caller: Caller,
    /// Whether it carries the other body ([`Target::variant`]).
    pub variant: bool,
}

impl Planned {
    /// The request's `Idempotency-Key` field lines as text (a tab shown as `\t`).
    pub fn key_texts(&self) -> Vec<String> {
        self.keys.iter().map(|v| String::from_utf8_lossy(v.as_bytes()).replace('\t', "\\t")).collect()
    }
}

impl Target {
    /// The key of a probe's request: the run prefix, then `suffix`.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.run)
    }

    /// `key` as the field value the draft specifies (§2.1: an RFC 9651 sf-string).
    pub fn field(key: &str) -> HeaderValue {
        // The keys are built from the run prefix and fixed suffixes: printable ASCII without `"` or `\`.
        HeaderValue::from_str(&format!("\"{key}\"")).unwrap_or(HeaderValue::from_static("\"idem-check\""))
    }

    /// The target request as the first caller sends it, with the one key `suffix` names.
    pub fn keyed(&self, note: &'static str, suffix: &str) -> Planned {
        Planned { keys: vec![Self::field(&self.key(suffix))], ..self.unkeyed(note) }
    }

    /// The control request of `probe`: another key, the same body (a second execution), sent only when the
    /// probe's answers are equal and unmarked, to learn whether two executions' answers can be told apart.
    pub fn control(&self, probe: &str) -> Planned {
        self.keyed(CONTROL_NOTE, &format!("{probe}-control"))
    }

    /// The target request without any key.
    pub fn unkeyed(&self, note: &'static str) -> Planned {
        Planned {
            note,
            method: self.method.clone(),
            url: self.url.clone(),
            keys: Vec::new(),
            caller: Caller::First,
            variant: false,
        }
    }

    /// The method another-method probes use: PATCH for a POST, else POST (both covered by the draft's
    /// non-idempotent methods).
    pub fn other_method(&self) -> Method {
        if self.method == Method::POST { Method::PATCH } else { Method::POST }
    }

    /// The real request for `planned`.
    pub fn build(&self, http: &reqwest::Client, planned: &Planned) -> reqwest::RequestBuilder {
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        let credential = match planned.caller {
            Caller::First => &self.credential,
            Caller::Second => &self.second_credential,
        };
        if let Some((name, value)) = credential {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(reqwest::header::CONTENT_TYPE, self.content_type.clone());
        for key in &planned.keys {
            headers.append(HeaderName::from_static("idempotency-key"), key.clone());
        }
        let body = if planned.variant { self.variant.clone() } else { self.body.clone() };
        http.request(planned.method.clone(), planned.url.clone()).headers(headers).body(body)
    }

    /// One line saying what `planned` sends; credential values are hidden.
    pub fn describe(&self, planned: &Planned) -> String {
        let mut line = format!("{} {}", planned.method, shown(&planned.url));
        if planned.keys.is_empty() {
            line.push_str("  (no Idempotency-Key)");
        }
        for key in planned.key_texts() {
            let _ = write!(line, "  Idempotency-Key: {key}");
        }
        let credential = match planned.caller {
            Caller::First => &self.credential,
            Caller::Second => &self.second_credential,
        };
        if let Some((name, _)) = credential {
            let _ = write!(
                line,
                "  {name}: *** ({} credential)",
                if planned.caller == Caller::First { "first" } else { "second" }
            );
        }
        let body = if planned.variant { &self.variant } else { &self.body };
        let _ = write!(line, "  body {}", excerpt(body, 40));
        let _ = write!(line, "  ({})", planned.note);
        line
    }
}

/// The body made different for the payload-mismatch probe: a JSON object gains the member `idem_check`, any
/// other body a line naming the run. Either way the same key now comes with another payload (draft §2.2).
pub fn variant_of(body: &[u8], json: bool, run: &str) -> Bytes {
    if json && let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice::<serde_json::Value>(body) {
        object.insert("idem_check".into(), serde_json::Value::String(format!("{run}-other-payload")));
        if let Ok(bytes) = serde_json::to_vec(&object) {
            return bytes.into();
        }
    }
    let mut other = body.to_vec();
    other.extend_from_slice(format!("\n{run}-other-payload\n").as_bytes());
    other.into()
}

/// `bytes` as short printable text: at most `max` characters of it, `…` when cut, or its length when it is
/// not text.
pub fn excerpt(bytes: &[u8], max: usize) -> String {
    let Ok(text) = std::str::from_utf8(bytes) else { return format!("({} bytes)", bytes.len()) };
    let text = text.trim_end();
    if text.is_empty() {
        return "(empty)".into();
    }
    // Control characters escaped (a body must not move the table's lines), quotes kept readable.
    let mut shown: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() })
        .collect();
    if text.chars().count() > max {
        shown.push('…');
    }
    shown
}

/// `url` as printed (plan, `--dry-run`, report, messages): a password in its userinfo hidden (`user:***@host`),
/// as everywhere else idem prints a URL.
pub fn shown(url: &Url) -> String {
    idem_core::redact_url(url.as_str())
}

/// A `Name: value` flag as a header field.
///
/// # Errors
/// [`Error::Config`] naming `flag` for text without a colon, a bad name or value, or a field `idem check` sets
/// itself.
pub fn header_flag(flag: &str, text: &str) -> Result<(HeaderName, HeaderValue), Error> {
    let (name, value) =
        text.split_once(':').ok_or_else(|| Error::Config(format!("{flag} {text:?} is not \"Name: value\"")))?;
    let name =
        HeaderName::try_from(name.trim()).map_err(|_| Error::Config(format!("bad header name in {flag} {text:?}")))?;
    if RESERVED.contains(&name.as_str()) {
        return Err(Error::Config(format!(
            "{flag} {name} is set by idem check itself (use --json, --data with --content-type; the probes choose the keys)"
        )));
    }
    let value = HeaderValue::from_str(value.trim())
        .map_err(|_| Error::Config(format!("bad header value in {flag} {text:?}")))?;
    Ok((name, value))
}
