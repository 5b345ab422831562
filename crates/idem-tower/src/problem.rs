//! The layer's own answers: replays of stored responses, and RFC 9457 problem details for its refusals (in
//! flight, outcome unknown, store unavailable, ...). Types are [`ProblemType`]s, the ones the KV API uses, so
//! clients branch on one namespace. Details never contain another request's data ([step 7](crate#steps)).

use crate::body::Body;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
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

/// A problem answer of the layer, with its retry hint: `true` for a request in flight and an unavailable store
/// (a retry later executes or replays), `false` for every other refusal (the same request gets it again).
pub(crate) fn problem(status: StatusCode, kind: ProblemType, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": kind.uri(),
        "title": kind.title(),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
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
         have taken effect; it will not be executed again under this key. Check the effect, then use a new key \
         or ask an operator to delete the record",
    )
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
