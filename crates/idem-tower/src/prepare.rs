//! Step 1 of the layer ([crate docs](crate#steps)), before any store access: the key, the scope, the request body (buffered up to
//! its limit) and the fingerprint. A client that hangs up during it leaves nothing behind.

use crate::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::record::RecordKey;
use idem_core::{Fingerprint, IdempotencyKey, ProblemType, RequestParts, Scope};
use tower::BoxError;

use crate::config::{Config, KeyPolicy};
use crate::problem::problem;
use crate::route::{JsonBody, MissingKey, RoutePolicy, record_key_of, without_ignored};
use std::time::SystemTime;
use tracing::info;

static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The whole body of a request the layer forwards, in the request's extensions, so that a service below can
/// send the request again: the reverse proxy does when the upstream provably never read it (a `Bytes` clone
/// shares the buffer; nothing is copied).
#[derive(Clone, Debug)]
pub struct BufferedBody(pub Bytes);

/// A covered request, read and judged as far as possible without the store.
pub(crate) enum Prepared {
    /// No key, and none required.
    PassThrough(Request<Body>),
    /// Refused before any store access (missing, malformed key; body too large or unreadable).
    Answer(Response<Body>),
    /// Carries a valid key: its body read, its fingerprint and record key computed.
    Keyed(Keyed),
}

pub(crate) struct Keyed {
    pub(crate) parts: http::request::Parts,
    pub(crate) body: Bytes,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) record_key: RecordKey,
}

/// Step 1 of the layer: the key, the scope, the body and the fingerprint.
pub(crate) async fn prepare<ReqBody>(config: &Config, request: Request<ReqBody>) -> Prepared
where
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
{
    if let Some(route) = &config.route {
        return prepare_route(config, route, request).await;
    }
    let lines = request.headers().get_all(&IDEMPOTENCY_KEY).iter().map(HeaderValue::as_bytes);
    let key = match IdempotencyKey::from_field_lines(lines) {
        Ok(Some(key)) => key,
        Ok(None) if config.key_policy == KeyPolicy::Optional => {
            return Prepared::PassThrough(request.map(Body::new));
        }
        Ok(None) => {
            return Prepared::Answer(problem(
                StatusCode::BAD_REQUEST,
                ProblemType::IdempotencyKeyMissing,
                &format!("{} requests to this endpoint must carry an Idempotency-Key header", request.method()),
            ));
        }
        Err(e) => {
            return Prepared::Answer(problem(
                StatusCode::BAD_REQUEST,
                ProblemType::IdempotencyKeyInvalid,
                &e.to_string(),
            ));
        }
    };
    let scope = scope_of(request.headers(), &config.credential_headers);
    let (mut parts, body) = request.into_parts();
    let body = match read_request_body(&parts.headers, body, config.max_request_body).await {
        Ok(body) => body,
        Err(refusal) => return Prepared::Answer(refusal),
    };
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    // Upper-cased: a covered method is matched ignoring case (`post` reaches a POST handler in several
    // frameworks), so both spellings are one request.
    let method = parts.method.as_str().to_ascii_uppercase();
    let fingerprint = Fingerprint::of_request(&RequestParts::new(
        &method,
        parts.uri.path(),
        parts.uri.query(),
        content_type,
        // The planted bug "proxy-fingerprint": the body is left out of the fingerprint, so a reused key with
        // another body replays the first answer instead of 422.
        if idem_core::planted("proxy-fingerprint") { b"" } else { &body },
    ));
    let record_key = RecordKey::new(&config.record_prefix, &scope, &key);
    // The body is already here: an `Expect: 100-continue` passed on would make the inner service wait for a
    // go-ahead nobody sends.
    parts.headers.remove(header::EXPECT);
    Prepared::Keyed(Keyed { parts, body, fingerprint, record_key })
}

/// Step 1 on a route: the whole body first, then the signature check, and only then the key, the scope and
/// the fingerprint. A refused signature therefore claims, stores and forwards nothing, and a request without
/// a key cannot pass through unsigned.
async fn prepare_route<ReqBody>(config: &Config, route: &RoutePolicy, request: Request<ReqBody>) -> Prepared
where
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let body = match read_request_body(&parts.headers, body, config.max_request_body).await {
        Ok(body) => body,
        Err(refusal) => return Prepared::Answer(refusal),
    };
    if let Some(verifier) = &route.verifier
        && let Err(refusal) = verifier.verify(&parts, &body, SystemTime::now())
    {
        crate::counters::count(crate::counters::Count::SignatureRefusals);
        if let Some(counters) = &config.route_counters {
            counters.refused(refusal.reason);
        }
        info!(route = route.name(), reason = refusal.reason.as_str(), "webhook signature refused");
        let mut answer = problem(StatusCode::UNAUTHORIZED, ProblemType::WebhookSignatureInvalid, &refusal.detail);
        // RFC 9110 §15.5.2: a 401 carries WWW-Authenticate. The scheme name is the operator's configuration.
        let challenge = format!("Webhook-Signature scheme=\"{}\"", verifier.scheme());
        if let Ok(value) = HeaderValue::try_from(challenge) {
            answer.headers_mut().insert(header::WWW_AUTHENTICATE, value);
        }
        return Prepared::Answer(answer);
    }
    // A signed route checks every method (see `Idempotency::call`) but keys only the covered ones.
    if !crate::service::covers_method(&config.methods, &parts.method) {
        parts.headers.remove(header::EXPECT);
        return Prepared::PassThrough(Request::from_parts(parts, Body::from(body)));
    }
    let mut json = JsonBody::default();
    let Some(value) = route.key.iter().find_map(|source| source.extract(&parts, &body, &mut json)) else {
        return match route.missing_key {
            MissingKey::Pass => {
                if let Some(counters) = &config.route_counters {
                    counters.keyless_passed.increment(1);
                }
                parts.headers.remove(header::EXPECT);
                Prepared::PassThrough(Request::from_parts(parts, Body::from(body)))
            }
            MissingKey::Refuse => {
                if let Some(counters) = &config.route_counters {
                    counters.keyless_refused.increment(1);
                }
                Prepared::Answer(problem(
                    StatusCode::BAD_REQUEST,
                    ProblemType::WebhookKeyMissing,
                    &format!("requests to route {:?} must carry one of its key sources", route.name()),
                ))
            }
        };
    };
    if let Some(counters) = &config.route_counters {
        counters.deliveries.increment(1);
    }
    let key = record_key_of(value);
    // The path is part of the scope: the same delivery id at another path below the route is another delivery.
    // Normalised, as routes are matched: the same path spelled another way (`/Stripe`, `/x/../stripe`, `%73`) is
    // the same delivery, not another execution.
    let path = route.delivery_path(parts.uri.path());
    // A signed route's scope leaves the credential headers out: no scheme signs them, so a captured delivery
    // resent with a made-up `Authorization` or `X-Api-Key` would otherwise be another delivery (break-it review:
    // one Standard Webhooks delivery sent 6 times executed 5 times). The signature authenticates the sender.
    let credential = if route.verifier.is_some() {
        Vec::new()
    } else {
        credential_bytes(&parts.headers, &config.credential_headers)
    };
    let scope = crate::route::route_scope(&path, &credential);
    let (query, compared) = without_ignored(&route.ignore, parts.uri.query(), &body, &mut json);
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    // Upper-cased: a covered method is matched ignoring case (`post` reaches a POST handler in several
    // frameworks), so both spellings are one request.
    let method = parts.method.as_str().to_ascii_uppercase();
    let fingerprint =
        Fingerprint::of_request(&RequestParts::new(&method, &path, query.as_deref(), content_type, &compared));
    let record_key = RecordKey::new(&config.record_prefix, &scope, &key);
    parts.headers.remove(header::EXPECT);
    Prepared::Keyed(Keyed { parts, body, fingerprint, record_key })
}

/// The scope of a request: a hash of every configured credential header it carries (name and value).
fn scope_of(headers: &HeaderMap, credential_headers: &[HeaderName]) -> Scope {
    let credential = credential_bytes(headers, credential_headers);
    if credential.is_empty() { Scope::from_credential(None) } else { Scope::from_credential(Some(&credential)) }
}

/// Every configured credential header a request carries, name and value, NUL-separated.
fn credential_bytes(headers: &HeaderMap, credential_headers: &[HeaderName]) -> Vec<u8> {
    let mut credential = Vec::new();
    for name in credential_headers {
        for value in headers.get_all(name) {
            credential.extend_from_slice(name.as_str().as_bytes());
            credential.push(0);
            credential.extend_from_slice(value.as_bytes());
            credential.push(0);
        }
    }
    credential
}

async fn read_request_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<Bytes, Response<Body>>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::RequestTooLarge,
            &format!("a request with an Idempotency-Key may carry at most {limit} bytes of body"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(problem(
            StatusCode::BAD_REQUEST,
            ProblemType::RequestBodyUnreadable,
            &format!("the request body could not be read: {e}"),
        )),
    }
}
