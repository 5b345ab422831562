//! The JSON endpoints under `/v1/admin/`: the same reads and actions as the pages, for scripts.
//!
//! Reads are `GET`; actions are `POST` with a JSON body (`Content-Type: application/json`). With an admin
//! token configured every request needs `Authorization: Bearer <token>` (RFC 6750 §2.1); an action needs it,
//! or a listener that requires client certificates. Errors are RFC 9457 problem details.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderMap, StatusCode, header};
use idem_store::Store;
use serde::Deserialize;

use crate::ui::RecordQuery;
use crate::{Admin, Error, records, runs};

type St<S> = State<Arc<Admin<S>>>;

/// An RFC 9457 problem.
fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    (status, [(header::CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}

fn failed(e: &Error) -> Response {
    problem(e.status(), &e.to_string())
}

fn answer<T: serde::Serialize>(r: Result<T, Error>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => failed(&e),
    }
}

pub(crate) fn routes<S: Store>(admin: Arc<Admin<S>>) -> Router {
    Router::new()
        .route("/v1/admin/records", get(list_records::<S>))
        .route("/v1/admin/record", get(record::<S>))
        .route("/v1/admin/records/release", post(release::<S>))
        .route("/v1/admin/records/resolve", post(resolve::<S>))
        .route("/v1/admin/items", get(items::<S>))
        .route("/v1/admin/item", get(item::<S>))
        .route("/v1/admin/items/forget", post(forget::<S>))
        .route("/v1/admin/cron", get(cron::<S>))
        .route("/v1/admin/cron/pause", post(cron_pause::<S>))
        .route("/v1/admin/cron/resume", post(cron_resume::<S>))
        .route("/v1/admin/cron/trigger", post(cron_trigger::<S>))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&admin), require_reader::<S>))
        .with_state(admin)
}

/// With a token configured, every request must present it.
async fn require_reader<S: Store>(
    State(admin): St<S>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if admin.guard.has_token() && admin.guard.api_actor(req.headers()).is_none() {
        return problem(StatusCode::UNAUTHORIZED, "Authorization: Bearer <admin token> required");
    }
    next.run(req).await
}

/// The actor of a POST, and its parsed body.
fn action<T: serde::de::DeserializeOwned, S: Store>(
    admin: &Admin<S>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(String, T), Box<Response>> {
    let actor = admin.guard.api_actor(headers).ok_or_else(|| {
        Box::new(problem(
            StatusCode::FORBIDDEN,
            "actions need the admin token (--admin-token-file) or a client certificate (--tls-client-ca)",
        ))
    })?;
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(Box::new(problem(StatusCode::UNSUPPORTED_MEDIA_TYPE, "send the action as application/json")));
    }
    if headers.contains_key(header::ORIGIN) && !crate::guard::same_origin(headers) {
        return Err(Box::new(problem(StatusCode::FORBIDDEN, "the request's Origin is not this listener")));
    }
    let parsed =
        serde_json::from_slice(body).map_err(|e| Box::new(problem(StatusCode::BAD_REQUEST, &e.to_string())))?;
    Ok((actor, parsed))
}

async fn list_records<S: Store>(State(admin): St<S>, Query(q): Query<RecordQuery>) -> Response {
    answer(
        async {
            let filter = q.filter()?;
            let now_ms = idem_store::system_time_to_millis(admin.store.now().await?);
            let cursor = (!q.cursor.is_empty()).then_some(q.cursor.as_str());
            records::list(&admin.store, &admin.prefix, &filter, cursor, crate::PAGE, now_ms).await
        }
        .await,
    )
}

#[derive(Deserialize)]
struct KeyQuery {
    k: String,
    #[serde(default)]
    body: Option<String>,
}

async fn record<S: Store>(State(admin): St<S>, Query(q): Query<KeyQuery>) -> Response {
    answer(records::detail(&admin.store, &admin.prefix, &q.k, q.body.is_some()).await)
}

#[derive(Deserialize)]
struct Release {
    key: String,
    generation: Option<u64>,
}

async fn release<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<Release, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match records::release(&admin.store, &admin.prefix, &r.key, r.generation, &actor).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(&e),
    }
}

#[derive(Deserialize)]
struct Resolve {
    key: String,
    generation: Option<u64>,
    #[serde(default)]
    note: String,
}

async fn resolve<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<Resolve, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match records::resolve(&admin.store, &admin.prefix, &r.key, r.generation, &r.note, &actor).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(&e),
    }
}

#[derive(Deserialize)]
struct ItemsQuery {
    job: String,
    #[serde(default)]
    state: String,
    #[serde(default)]
    cursor: String,
}

async fn items<S: Store>(State(admin): St<S>, Query(q): Query<ItemsQuery>) -> Response {
    answer(
        async {
            let state = (!q.state.is_empty()).then(|| runs::ItemState::parse(&q.state)).transpose()?;
            let cursor = (!q.cursor.is_empty()).then_some(q.cursor.as_str());
            runs::items(&admin.store, &q.job, state, cursor, crate::PAGE).await
        }
        .await,
    )
}

#[derive(Deserialize)]
struct ItemRef {
    job: String,
    id: String,
}

async fn item<S: Store>(State(admin): St<S>, Query(q): Query<ItemRef>) -> Response {
    answer(runs::item(&admin.store, &q.job, &q.id).await)
}

async fn forget<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<ItemRef, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    match runs::forget(&admin.store, &r.job, &r.id, &actor).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(&e),
    }
}

#[derive(Deserialize)]
struct CronQuery {
    name: String,
}

async fn cron<S: Store>(State(admin): St<S>, Query(q): Query<CronQuery>) -> Response {
    answer(
        async {
            let now_ms = idem_store::system_time_to_millis(admin.store.now().await?);
            crate::cron::history(&admin.store, &q.name, now_ms).await
        }
        .await,
    )
}

#[derive(Deserialize)]
struct CronPause {
    name: String,
    #[serde(default)]
    until: Option<String>,
    #[serde(default)]
    note: Option<String>,
}

/// `POST /v1/admin/cron/pause` `{"name", "until"?, "note"?}`: the pause as `status` shows it.
async fn cron_pause<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<CronPause, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    answer(crate::cron::pause(&admin.store, &r.name, r.until.as_deref(), r.note.as_deref(), &actor).await)
}

/// `POST /v1/admin/cron/resume` `{"name"}`: `{"resumed": false}` when it was not paused.
async fn cron_resume<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<CronQuery, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    answer(
        crate::cron::resume(&admin.store, &r.name, &actor)
            .await
            .map(|resumed| serde_json::json!({ "resumed": resumed })),
    )
}

#[derive(Deserialize)]
struct CronTrigger {
    name: String,
    #[serde(default)]
    id: Option<String>,
}

/// `POST /v1/admin/cron/trigger` `{"name", "id"?}`: the trigger's id, whether it is new, its state.
async fn cron_trigger<S: Store>(State(admin): St<S>, headers: HeaderMap, body: Bytes) -> Response {
    let (actor, r) = match action::<CronTrigger, S>(&admin, &headers, &body) {
        Ok(a) => a,
        Err(refusal) => return *refusal,
    };
    answer(crate::cron::trigger(&admin.store, &r.name, r.id.as_deref(), &actor).await)
}
