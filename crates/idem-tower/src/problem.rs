//! The layer's own answers: replays of stored responses, and RFC 9457 problem details for its refusals (in
//! flight, outcome unknown, store unavailable, ...). Types are [`ProblemType`]s, the ones the KV API uses, so
//! clients branch on one namespace. Details never contain another request's data ([step 7](crate#steps)).

use crate::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use idem_core::ProblemType;
use idem_core::record::StoredResponse;
use idem_store::Error as StoreError;
use tracing::warn;

static REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The retry hints of SDKs: Stripe's (`Stripe-Should-Retry`) and the Stainless-generated ones'
/// (`x-should-retry`). Each SDK follows its header over its own status rules, so an answer a retry could only
/// repeat says `false` and stops the SDK's retries at once.
static RETRY_HINTS: [HeaderName; 2] =
    [HeaderName::from_static("stripe-should-retry"), HeaderName::from_static("x-should-retry")];

/// Marks `response` as worth retrying (`true`: a retry may execute or get the first answer) or not (`false`: a
/// retry would get this answer again). An answer carrying either hint already (the upstream's own) is left as
/// it is, so the two never disagree.
pub(crate) fn hint<B>(response: &mut Response<B>, retry: bool) {
    if RETRY_HINTS.iter().any(|name| response.headers().contains_key(name)) {
        return;
    }
    let value = HeaderValue::from_static(if retry { "true" } else { "false" });
    for name in &RETRY_HINTS {
        response.headers_mut().insert(name.clone(), value.clone());
    }
}

/// An RFC 9457 problem details answer (`application/problem+json`): the one builder of idem's problem bodies,
/// for the layer's refusals and for `idem-server`'s KV API, proxy and listeners.
///
/// The body holds `type` (the [`ProblemType`]'s URI, §3.1.1), `title` (its fixed title, §3.1.3), `status`
/// (§3.1.2) and `detail` (§3.1.4), in that order, then any extension members (§3.2) in the order added.
///
/// ```
/// use http::StatusCode;
/// use idem_core::ProblemType;
/// use idem_tower::Problem;
///
/// let problem = Problem::new(StatusCode::CONFLICT, ProblemType::WrongType, "the value is not a counter")
///     .member("current_generation", 7);
/// assert_eq!(
///     problem.body(),
///     r#"{"type":"urn:idem:problem:wrong-type","title":"Wrong type","status":409,"detail":"the value is not a counter","current_generation":7}"#
/// );
/// let response: http::Response<String> = problem.into_response();
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Clone, Debug)]
pub struct Problem {
    status: StatusCode,
    kind: ProblemType,
    detail: String,
    members: Vec<(&'static str, serde_json::Value)>,
    headers: HeaderMap,
}

impl Problem {
    /// A problem of kind `kind` (its type URI and title) answered with `status`, with a detail for this
    /// occurrence. The detail must never hold another caller's data.
    pub fn new(status: StatusCode, kind: ProblemType, detail: impl Into<String>) -> Self {
        Self { status, kind, detail: detail.into(), members: Vec::new(), headers: HeaderMap::new() }
    }

    /// Adds an extension member (RFC 9457 §3.2), e.g. `current_generation` or `limit_bytes`.
    pub fn member(mut self, name: &'static str, value: impl Into<serde_json::Value>) -> Self {
        self.members.push((name, value.into()));
        self
    }

    /// Adds a header field to the answer (`Retry-After`, `ETag`, `WWW-Authenticate`, …).
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The kind of problem.
    pub fn kind(&self) -> ProblemType {
        self.kind
    }

    /// The detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        use serde_json::Value;
        let mut body = format!(
            "{{\"type\":{},\"title\":{},\"status\":{},\"detail\":{}",
            Value::from(self.kind.uri()),
            Value::from(self.kind.title()),
            self.status.as_u16(),
            Value::from(self.detail.as_str())
        );
        for (name, value) in &self.members {
            body.push_str(&format!(",{}:{value}", Value::from(*name)));
        }
        body.push('}');
        body
    }

    /// The answer: the status, `Content-Type: application/problem+json`, the headers added and the body.
    pub fn into_response<B: From<String>>(self) -> Response<B> {
        let mut response = Response::new(B::from(self.body()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        response
    }
}

/// A problem answer of the layer, with its retry hint: `true` for a request in flight and an unavailable store
/// (a retry later executes or replays), `false` for every other refusal (the same request gets it again).
pub(crate) fn problem(status: StatusCode, kind: ProblemType, detail: &str) -> Response<Body> {
    let mut response = Problem::new(status, kind, detail).into_response();
    hint(&mut response, matches!(kind, ProblemType::RequestInFlight | ProblemType::StoreUnavailable));
    response
}

pub(crate) fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            response.headers_mut().append(name, value);
        }
    }
    response.headers_mut().insert(REPLAYED.clone(), HeaderValue::from_static("true"));
    // A replayed error would be replayed again; a replayed 2xx needs no hint.
    if !response.status().is_success() {
        hint(&mut response, false);
    }
    response
}

pub(crate) fn in_flight() -> Response<Body> {
    crate::counters::count(crate::counters::Count::Conflicts);
    let mut response = problem(
        StatusCode::CONFLICT,
        ProblemType::RequestInFlight,
        "a request with this key is still being processed; retry after the time Retry-After gives",
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// What becomes of a key whose outcome is unknown, for the answer's detail: kept (the default) or released
/// (`UnknownOutcome::Release`, for upstreams that dedupe on the forwarded key themselves).
fn after_unknown(released: bool) -> &'static str {
    if released {
        "the key was released, so a retry under it executes again (the upstream is trusted to dedupe on the \
         forwarded Idempotency-Key)"
    } else {
        "it will not be executed again under this key"
    }
}

/// The first caller's answer when its own request's outcome became unknown here (timeout); `released` as
/// for the key's policy.
pub(crate) fn outcome_unknown_now(status: StatusCode, limit: &str, released: bool) -> Response<Body> {
    rehint(
        problem(
            status,
            ProblemType::OutcomeUnknown,
            &format!(
                "no complete answer within {limit}; the request may or may not have taken effect, and {}",
                after_unknown(released)
            ),
        ),
        released,
    )
}

/// `response` with its retry hint replaced: a released unknown outcome executes again on a retry.
pub(crate) fn rehint(mut response: Response<Body>, retry: bool) -> Response<Body> {
    for name in &RETRY_HINTS {
        response.headers_mut().remove(name);
    }
    hint(&mut response, retry);
    response
}

/// The first caller's answer when the response body broke off; `released` as for the key's policy.
pub(crate) fn outcome_unknown_broken(released: bool) -> Response<Body> {
    if !released {
        return outcome_unknown();
    }
    rehint(
        problem(
            StatusCode::BAD_GATEWAY,
            ProblemType::OutcomeUnknown,
            &format!(
                "the request under this key was sent upstream but no complete answer came back, so it may or may not \
             have taken effect; {}",
                after_unknown(true)
            ),
        ),
        true,
    )
}

/// The answer for a key whose stored outcome is unknown.
pub(crate) fn outcome_unknown() -> Response<Body> {
    problem(
        StatusCode::BAD_GATEWAY,
        ProblemType::OutcomeUnknown,
        "the request under this key was sent upstream but no complete answer came back, so it may or may not \
         have taken effect; it will not be executed again under this key. Check the effect, then use a new key, \
         or ask an operator to release the record (it did not take effect: a retry executes) or resolve it (it \
         did: retries are told so)",
    )
}

/// The answer for a key whose unknown outcome an operator resolved as taken effect: 409 `outcome-resolved`
/// with their note, and the SDKs' retry hints `false` (a retry would get this again).
pub(crate) fn outcome_resolved(note: &str) -> Response<Body> {
    let detail = if note.is_empty() {
        "the request under this key had an unknown outcome, and an operator found that it took effect; it will not \
         be executed again under this key"
            .to_owned()
    } else {
        format!(
            "the request under this key had an unknown outcome, and an operator found that it took effect ({note}); \
             it will not be executed again under this key"
        )
    };
    rehint(problem(StatusCode::CONFLICT, ProblemType::OutcomeResolved, &detail), false)
}

pub(crate) fn store_unavailable(e: &StoreError) -> Response<Body> {
    warn!(error = %e, "idempotency store unavailable");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        ProblemType::StoreUnavailable,
        "the idempotency store cannot be reached; nothing was executed, retry later",
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
