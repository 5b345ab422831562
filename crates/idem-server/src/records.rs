//! The operator's view of idempotency records: `GET` / `DELETE /v1/idempotency/{scope}/{key}` on the
//! admin listener, and `/v1/idempotency/route/{name}/{scope}/{key}` for the
//! records of a route (webhook deliveries), or `/v1/idempotency/route/{name}/{key}?path=/request/path` with
//! the scope computed from the path for deliveries without credential headers. The key is percent-encoded like
//! KV keys; the scope is `anonymous` or the 32 hex digits the layer derives from a credential (see
//! `idem_core::Scope`), for a route from the request path and the credential (`idem_tower::route_scope`).

use idem_core::ProblemType;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idem_core::record::{Outcome, Record, RecordKey};
use idem_core::{IdempotencyKey, Scope};
use idem_store::{Precondition, Store};
use serde_json::json;

use crate::Problem;
use crate::keypath::decode_key;

const PREFIX: &str = "/v1/idempotency/";

/// The store and the key prefix its records live under: the layer's, handed over in `ServerConfig`, so the
/// look-up names the keys the layer wrote.
struct Records<S> {
    store: Arc<S>,
    prefix: Arc<str>,
}

type Shared<S> = State<Arc<Records<S>>>;

pub(crate) fn routes<S: Store>(store: Arc<S>, prefix: Arc<str>) -> Router {
    Router::new()
        .route(
            "/v1/idempotency/{*rest}",
            get(look_up::<S>).delete(remove::<S>).fallback(|| async { crate::kv::method_not_allowed("GET, DELETE") }),
        )
        .with_state(Arc::new(Records { store, prefix }))
}

fn record_key(prefix: &str, uri: &Uri) -> Result<RecordKey, Problem> {
    let rest = uri.path().strip_prefix(PREFIX).unwrap_or_default();
    let usage = || {
        Problem::bad_request(
            ProblemType::InvalidRecordPath,
            "use /v1/idempotency/{scope}/{percent-encoded key}, /v1/idempotency/route/{name}/{scope}/{key} or \
             /v1/idempotency/route/{name}/{key}?path=/request/path; scope is 'anonymous' or 32 hex digits",
        )
    };
    // A route's records live under `{prefix}route/{name}/` (idem_tower::IdempotencyLayer::route). `route` is
    // not a scope (neither `anonymous` nor hex), so the two forms cannot be confused.
    let (prefix, rest) = match rest.strip_prefix("route/") {
        Some(routed) => {
            let (name, rest) = routed.split_once('/').ok_or_else(usage)?;
            let valid = (1..=32).contains(&name.len())
                && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
            if !valid {
                return Err(usage());
            }
            let prefix = format!("{prefix}route/{name}/");
            // The short form `route/{name}/{key}?path=/p`: the scope computed from the request path, as the
            // layer does on a signed route or for a delivery without credential headers (no sha256sum by hand).
            if let Some(path) = query_path(uri)? {
                if rest.contains('/') {
                    return Err(usage());
                }
                let scope = idem_tower::route_scope(&idem_tower::delivery_path(&path), b"");
                return Ok(RecordKey::new(&prefix, &scope, &record_id(rest)?));
            }
            (std::borrow::Cow::Owned(prefix), rest)
        }
        None => (std::borrow::Cow::Borrowed(prefix), rest),
    };
    let (scope, key) = rest.split_once('/').ok_or_else(usage)?;
    let scope = Scope::parse(scope).map_err(|_| usage())?;
    Ok(RecordKey::new(&prefix, &scope, &record_id(key)?))
}

fn record_id(key: &str) -> Result<IdempotencyKey, Problem> {
    IdempotencyKey::new(decode_key(key)?)
        .map_err(|e| Problem::bad_request(ProblemType::IdempotencyKeyInvalid, e.to_string()))
}

/// The `path` query parameter as written: not percent-decoded here, because the path is normalised (every
/// escape decoded) as the layer normalises a request path; decoding it first would decode `%25` twice (break-it
/// review). It must start with `/`.
fn query_path(uri: &Uri) -> Result<Option<String>, Problem> {
    let Some(query) = uri.query() else { return Ok(None) };
    let Some(path) = query.split('&').find_map(|pair| pair.strip_prefix("path=")) else { return Ok(None) };
    if !path.starts_with('/') {
        return Err(Problem::bad_request(
            ProblemType::InvalidRecordPath,
            "path must be the request path the deliveries were sent to, starting with /",
        ));
    }
    Ok(Some(path.to_owned()))
}

async fn look_up<S: Store>(State(records): Shared<S>, uri: Uri) -> Result<Response, Problem> {
    let key = record_key(&records.prefix, &uri)?;
    let value = records.store.get(key.as_str()).await?.ok_or_else(Problem::not_found_key)?;
    let record = Record::decode(value.value()).map_err(|e| {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::IdempotencyRecordUnreadable, e.to_string())
    })?;
    let expires_at = value.expires_at().map(|t| humantime::format_rfc3339_millis(t).to_string());
    let mut view = match &record {
        Record::InProgress { owner, started_at_ms, .. } => {
            json!({ "state": "in_progress", "owner": owner, "started_at_ms": started_at_ms })
        }
        Record::Finished { outcome, finished_at_ms, .. } => match outcome {
            Outcome::Response(r) => json!({
                "state": "completed", "status": r.status, "headers": r.headers,
                "body_bytes": r.body.len(), "finished_at_ms": finished_at_ms,
            }),
            Outcome::TooLarge { status, size, limit } => json!({
                "state": "too_large", "status": status, "body_bytes_seen": size, "limit_bytes": limit,
                "finished_at_ms": finished_at_ms,
            }),
            Outcome::Unknown { reason } => {
                json!({ "state": "outcome_unknown", "reason": reason, "finished_at_ms": finished_at_ms })
            }
            Outcome::Resolved { reason, by, note, resolved_at_ms } => json!({
                "state": "outcome_resolved", "reason": reason, "resolved_by": by, "note": note,
                "resolved_at_ms": resolved_at_ms, "finished_at_ms": finished_at_ms,
            }),
        },
    };
    view["fingerprint"] = json!(record.fingerprint().to_hex());
    view["generation"] = json!(value.generation().get());
    view["expires_at"] = json!(expires_at);
    Ok(axum::Json(view).into_response())
}

async fn remove<S: Store>(State(records): Shared<S>, uri: Uri) -> Result<Response, Problem> {
    let key = record_key(&records.prefix, &uri)?;
    match records.store.delete(key.as_str(), Precondition::Any).await? {
        Some(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        None => Err(Problem::not_found_key()),
    }
}
