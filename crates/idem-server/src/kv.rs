//! The KV API: `GET`/`PUT`/`DELETE /v1/kv/{key}` with generations as ETags, list by prefix, and the atomic
//! set and counter operations, over any [`Store`](idem_store::Store).

use idem_core::ProblemType;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_store::{
    Error as StoreError, ListItem, Precondition, RetryPolicy, SetChange, Store, Ttl, millis_to_system_time,
};
use serde::{Deserialize, Serialize};

use crate::Problem;
use crate::headers::{Conditions, Evaluation, etag};
use crate::keypath::{check_escapes, decode_key, encode_key};

const PREFIX: &str = "/v1/kv/";
/// Largest JSON body for set and counter operations, in bytes.
pub(crate) const MAX_OP_BODY: usize = 1024 * 1024;

type Shared<S> = State<Arc<S>>;

pub(crate) fn routes<S: Store>(store: Arc<S>) -> Router {
    // POST is allowed only where it means something: `{key}/set` and `{key}/counter`.
    let not_allowed = |uri: Uri| async move {
        match op_of(raw_key(&uri)) {
            Some(_) => method_not_allowed("GET, PUT, DELETE, POST"),
            None => method_not_allowed("GET, PUT, DELETE"),
        }
    };
    Router::new()
        .route("/v1/kv", get(list::<S>).fallback(|| async { method_not_allowed("GET") }))
        .route(
            "/v1/kv/",
            any(|| async {
                Problem::bad_request(ProblemType::InvalidKey, "key is empty; use /v1/kv/{percent-encoded key}")
            }),
        )
        .route(
            "/v1/kv/{*key}",
            get(get_key::<S>).put(put_key::<S>).delete(delete_key::<S>).post(post_op::<S>).fallback(not_allowed),
        )
        .with_state(store)
}

/// 405 with the `Allow` header RFC 9110 §15.5.6 requires.
pub(crate) fn method_not_allowed(allow: &'static str) -> Response {
    let mut r = Problem::method_not_allowed().into_response();
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// A POST path's key (still percent-encoded) and operation, `set` or `counter`; `None` for any other path.
fn op_of(raw: &str) -> Option<(&str, &str)> {
    raw.rsplit_once('/').filter(|(_, op)| matches!(*op, "set" | "counter"))
}

/// The raw (still percent-encoded) remainder of the path after `/v1/kv/`.
fn raw_key(uri: &Uri) -> &str {
    uri.path().strip_prefix(PREFIX).unwrap_or_default()
}

/// Awaits a store operation, recording its latency.
async fn timed_raw<T>(op: &'static str, fut: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    let started = Instant::now();
    let r = fut.await;
    metrics::histogram!("idem_store_op_seconds", "op" => op).record(started.elapsed().as_secs_f64());
    r
}

/// Awaits a store operation, recording its latency and failed preconditions.
async fn timed<T>(op: &'static str, fut: impl Future<Output = Result<T, StoreError>>) -> Result<T, Problem> {
    timed_raw(op, fut).await.map_err(|e| refused(op, e))
}

/// The problem for a store error, counting failed preconditions.
fn refused(op: &'static str, e: StoreError) -> Problem {
    if e.is_precondition_failed() {
        metrics::counter!("idem_precondition_failures_total", "op" => op).increment(1);
    }
    Problem::from(e)
}

/// How often a write under a list precondition re-evaluates it after losing a race (see [`conditional`]).
const CONDITIONAL_ATTEMPTS: u32 = 8;

/// Performs `write` only if `conditions` pass (RFC 9110 §13.2.2), atomically with the write.
///
/// When the fields amount to one store precondition (none, `*`, a single `If-Match` tag), that is the write's
/// precondition and the store's compare-and-swap decides alone. A list (`If-Match: "7", "1"`, or an
/// `If-None-Match` naming generations) has no such precondition: the store can compare with one generation, not
/// a set. It is reduced soundly instead: read the current generation g, evaluate the fields on g, and if they
/// pass, write conditioned on exactly g (or on absence). The write then succeeds only while the current
/// generation is still the one judged, so a concurrent write can never slip in between the judgement and the
/// write, on any backend. If it did move, the refusal carries the new current generation (atomically with the
/// refused check), and the fields are judged again on that one, up to [`CONDITIONAL_ATTEMPTS`] times with the
/// jittered backoff of [`RetryPolicy`]; every lost round means some other write succeeded, so the loop only
/// spins while the key is being written. An `If-Match` list stops after one lost round in practice, since a
/// new generation is larger than any the client could have seen.
async fn conditional<T, F, Fut>(
    store: &impl Store,
    key: &str,
    conditions: &Conditions,
    op: &'static str,
    mut write: F,
) -> Result<T, Problem>
where
    F: FnMut(Precondition) -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    if let Some(precondition) = conditions.as_precondition() {
        // The planted bug "kv-precondition": the compare-and-swap skipped.
        let precondition = if idem_core::planted("kv-precondition") { Precondition::Any } else { precondition };
        return timed(op, write(precondition)).await;
    }
    let mut current = timed("get", store.get(key)).await?.map(|v| v.generation());
    let policy = RetryPolicy::default();
    for attempt in 1..=CONDITIONAL_ATTEMPTS {
        if conditions.evaluate(current) != Evaluation::Proceed {
            return Err(refused(op, StoreError::PreconditionFailed { current }));
        }
        if attempt > 1 {
            tokio::time::sleep(policy.backoff(attempt)).await;
        }
        let exactly = current.map_or(Precondition::Absent, Precondition::Generation);
        match timed_raw(op, write(exactly)).await {
            Err(StoreError::PreconditionFailed { current: now }) => current = now,
            other => return other.map_err(|e| refused(op, e)),
        }
    }
    Err(refused(op, StoreError::UpdateExhausted { attempts: CONDITIONAL_ATTEMPTS }))
}

fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(millis_to_system_time(ms)).to_string()
}

async fn get_key<S: Store>(State(store): Shared<S>, uri: Uri, headers: HeaderMap) -> Result<Response, Problem> {
    let key = decode_key(raw_key(&uri))?;
    let conditions = Conditions::parse(&headers)?;
    // A 404 ignores the preconditions (RFC 9110 §13.2.1: only a 2xx or 412 answer is conditional).
    let value = timed("get", store.get(&key)).await?.ok_or_else(Problem::not_found_key)?;
    let tag = etag(value.generation());
    match conditions.evaluate(Some(value.generation())) {
        Evaluation::Proceed => {}
        // RFC 9110 §13.1.2: 304 for GET and HEAD (axum answers HEAD with this handler).
        Evaluation::IfNoneMatchMatched => {
            return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, tag)]).into_response());
        }
        Evaluation::IfMatchFailed => {
            return Err(refused("get", StoreError::PreconditionFailed { current: Some(value.generation()) }));
        }
    }
    let mut resp = (
        StatusCode::OK,
        [(header::ETAG, tag), (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"))],
        Body::from(value.value().clone()),
    )
        .into_response();
    if let Some(at) = value.expires_at() {
        resp.headers_mut().insert("idem-expires-at", header_value(&humantime::format_rfc3339_millis(at).to_string()));
    }
    Ok(resp)
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct PutQuery {
    ttl: Option<String>,
}

fn parse_query<T: serde::de::DeserializeOwned + Default>(raw: Option<String>) -> Result<T, Problem> {
    match raw {
        None => Ok(T::default()),
        Some(q) => {
            // The form decoder passes a malformed escape through as text and replaces bytes that are not UTF-8;
            // a cursor or prefix read that way would list from somewhere the caller did not name.
            check_escapes(&q)?;
            let utf8 = |part: &str| percent_encoding::percent_decode_str(part).decode_utf8().is_ok();
            if !q.split(['&', '=']).all(utf8) {
                return Err(Problem::bad_request(ProblemType::InvalidQuery, "a query parameter is not valid UTF-8"));
            }
            serde_urlencoded::from_str(&q).map_err(|e| Problem::bad_request(ProblemType::InvalidQuery, e.to_string()))
        }
    }
}

/// `keep` | `none` | a duration (`30s`, `1h 30m`, `2days`, or bare seconds); omitted = `keep`.
fn parse_ttl(s: Option<&str>) -> Result<Ttl, Problem> {
    let bad = |detail: String| Problem::bad_request(ProblemType::InvalidTtl, detail);
    match s.map(str::trim) {
        None | Some("keep") => Ok(Ttl::Keep),
        Some("none") => Ok(Ttl::Clear),
        Some(d) => {
            let dur = match d.parse::<u64>() {
                Ok(secs) => Duration::from_secs(secs),
                Err(_) => humantime::parse_duration(d)
                    .map_err(|e| bad(format!("ttl {d:?} is not keep, none or a duration like 30s: {e}")))?,
            };
            Ok(Ttl::After(dur))
        }
    }
}

/// Reads at most `max` bytes of body; a declared or actual length past that is 413 without reading further.
async fn read_limited(headers: &HeaderMap, body: Body, max: usize) -> Result<Bytes, Problem> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > max as u64
    {
        return Err(Problem::too_large(Some(n), max));
    }
    match Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(Problem::too_large(None, max)),
        Err(e) => Err(Problem::bad_request(ProblemType::InvalidBody, format!("reading the body failed: {e}"))),
    }
}

#[derive(Serialize)]
struct Generated {
    generation: idem_store::Generation,
}

async fn put_key<S: Store>(
    State(store): Shared<S>,
    uri: Uri,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    body: Body,
) -> Result<Response, Problem> {
    let raw = raw_key(&uri);
    let key = decode_key(raw)?;
    store.limits().check_key(&key)?;
    let conditions = Conditions::parse(&headers)?;
    let q: PutQuery = parse_query(query)?;
    let ttl = parse_ttl(q.ttl.as_deref())?;
    store.limits().check_ttl(&ttl)?;
    let value = read_limited(&headers, body, store.limits().max_value_bytes()).await?;
    let written = conditional(&*store, &key, &conditions, "put", |p| store.put(&key, value.clone(), p, ttl)).await?;
    let status = if written.created() { StatusCode::CREATED } else { StatusCode::OK };
    let mut resp = (
        status,
        [(header::ETAG, etag(written.generation()))],
        axum::Json(Generated { generation: written.generation() }),
    )
        .into_response();
    if written.created() {
        resp.headers_mut().insert(header::LOCATION, header_value(&format!("{PREFIX}{}", encode_key(&key))));
    }
    Ok(resp)
}

async fn delete_key<S: Store>(State(store): Shared<S>, uri: Uri, headers: HeaderMap) -> Result<Response, Problem> {
    let key = decode_key(raw_key(&uri))?;
    let conditions = Conditions::parse(&headers)?;
    conditional(&*store, &key, &conditions, "delete", |p| store.delete(&key, p)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CounterBody {
    delta: i64,
    dedupe_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetBody {
    #[serde(default)]
    add: Vec<String>,
    #[serde(default)]
    remove: Vec<String>,
    dedupe_id: Option<String>,
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, ProblemType::InvalidBody, e.to_string())
        }
        _ => Problem::bad_request(ProblemType::InvalidBody, format!("body is not valid JSON: {e}")),
    })
}

async fn post_op<S: Store>(
    State(store): Shared<S>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let Some((raw, op)) = op_of(raw_key(&uri)) else {
        // A key, which takes no POST (RFC 9110 §15.5.6); the `Allow` says what it takes.
        return Ok(method_not_allowed("GET, PUT, DELETE"));
    };
    // Set and counter operations are atomic in the store and take no precondition or TTL; refusing them beats
    // silently ignoring a compare-and-swap the caller thinks it made.
    if headers.contains_key(header::IF_MATCH) || headers.contains_key(header::IF_NONE_MATCH) {
        return Err(Problem::bad_request(
            ProblemType::InvalidPrecondition,
            "set and counter operations are atomic and take no If-Match/If-None-Match; use PUT for compare-and-swap",
        ));
    }
    if let Some(q) = uri.query() {
        let shown: String = q.chars().take(64).collect();
        return Err(Problem::bad_request(
            ProblemType::InvalidQuery,
            format!("set and counter operations take no query parameters, got {shown:?}"),
        ));
    }
    let key = decode_key(raw)?;
    store.limits().check_key(&key)?;
    let bytes = read_limited(&headers, body, MAX_OP_BODY).await?;
    if op == "set" {
        let b: SetBody = parse_json(&bytes)?;
        let change = SetChange { add: b.add, remove: b.remove, dedupe_id: b.dedupe_id };
        let out = timed("set", store.set_change(&key, change)).await?;
        let mut resp = axum::Json(out).into_response();
        if let Some(g) = out.generation {
            resp.headers_mut().insert(header::ETAG, etag(g));
        }
        if !out.applied {
            resp.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        return Ok(resp);
    }
    let b: CounterBody = parse_json(&bytes)?;
    let out = timed("counter", store.counter_add(&key, b.delta, b.dedupe_id.as_deref())).await?;
    let mut resp = axum::Json(out).into_response();
    resp.headers_mut().insert(header::ETAG, etag(out.generation));
    if !out.applied {
        resp.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(resp)
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    prefix: String,
    cursor: Option<String>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct ListedItem {
    key: String,
    generation: idem_store::Generation,
    expires_at: Option<String>,
}

#[derive(Serialize)]
struct ListPage {
    items: Vec<ListedItem>,
    next_cursor: Option<String>,
}

async fn list<S: Store>(State(store): Shared<S>, RawQuery(query): RawQuery) -> Result<Response, Problem> {
    let q: ListQuery = parse_query(query)?;
    if q.prefix.contains('\0') || q.cursor.as_deref().is_some_and(|c| c.contains('\0')) {
        return Err(Problem::bad_request(ProblemType::InvalidQuery, "prefix and cursor cannot contain NUL"));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(Problem::bad_request(ProblemType::InvalidQuery, format!("limit {limit} is outside 1..=1000")));
    }
    let page = timed("list", store.list(&q.prefix, q.cursor.as_deref(), limit)).await?;
    let items = page
        .items
        .into_iter()
        .map(|ListItem { key, generation, expires_at_ms }| ListedItem {
            key,
            generation,
            expires_at: expires_at_ms.map(rfc3339),
        })
        .collect();
    Ok(axum::Json(ListPage { items, next_cursor: page.next_cursor }).into_response())
}
