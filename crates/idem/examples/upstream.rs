//! A tiny HTTP API that counts how many times it executes writes: the upstream to put behind
//! `idem serve --upstream` when trying idempotency out.
//!
//! ```text
//! cargo run --release --example upstream -- --listen 127.0.0.1:9000
//! curl -s -X POST localhost:9000/orders -d '{"sku":"a"}'      # 201, Location: /orders/1, executes
//! curl -s localhost:9000/executions                           # {"executions":1,"distinct_keys":0,...}
//! ```
//!
//! With `--sqlite PATH`, every order is also written durably (one conditional put acknowledged after fsync, in
//! idem's embedded store): an upstream that, like any real write API, persists what it is asked to do.
//!
//! Routes: `POST|PATCH /orders` (201 + Location), `GET|DELETE /orders/{n}`, `POST /status/{code}[/…]` (answers that status),
//! `POST /slow/{ms}` (sleeps, then 201), `POST /big/{bytes}` (a body of that many bytes), `POST /headers`
//! (representation, caching and cookie headers),
//! `POST /fail-first/{n}` (500 for the first n executions of a delivery, then 201),
//! `GET /executions` (the counts, with how often each delivery executed).
//! Every POST/PATCH counts as one execution when it starts, under its delivery: the forwarded
//! `Idempotency-Key`, else a webhook's `webhook-id` / `svix-id` / `X-Shopify-Event-Id` / `X-Shopify-Webhook-Id`, else
//! `X-GitHub-Hook-ID` + `X-GitHub-Delivery`, else the JSON body's `id` (Stripe) or `event_id` (Slack).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

/// Executions seen so far (and, optionally, where orders are persisted).
#[derive(Default)]
pub struct Counts {
    inner: Mutex<Inner>,
    orders: Option<idem_sqlite::SqliteStore>,
}

#[derive(Default)]
struct Inner {
    executions: u64,
    by_key: BTreeMap<String, u64>,
    deleted: std::collections::BTreeSet<u64>,
}

impl Counts {
    /// Total executions.
    pub fn executions(&self) -> u64 {
        self.inner.lock().map(|i| i.executions).unwrap_or(0)
    }

    /// How many times requests carrying `key` executed.
    pub fn executions_of(&self, key: &str) -> u64 {
        self.inner.lock().map(|i| i.by_key.get(key).copied().unwrap_or(0)).unwrap_or(0)
    }

    fn count(&self, headers: &HeaderMap) -> u64 {
        self.count_delivery(headers, "").0
    }

    /// Counts one execution; returns the total and how often this delivery has executed, this one included.
    fn count_delivery(&self, headers: &HeaderMap, body: &str) -> (u64, u64) {
        let Ok(mut inner) = self.inner.lock() else { return (0, 0) };
        inner.executions += 1;
        let mut of_delivery = 0;
        if let Some(key) = delivery(headers, body) {
            let n = inner.by_key.entry(key).or_default();
            *n += 1;
            of_delivery = *n;
        }
        (inner.executions, of_delivery)
    }
}

/// The delivery a request belongs to, as its sender names it.
fn delivery(headers: &HeaderMap, body: &str) -> Option<String> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let named = text("idempotency-key")
        .or_else(|| text("webhook-id"))
        .or_else(|| text("svix-id"))
        .or_else(|| text("x-shopify-event-id"))
        .or_else(|| text("x-shopify-webhook-id"));
    named.or_else(|| match (text("x-github-hook-id"), text("x-github-delivery")) {
        (Some(hook), Some(guid)) => Some(format!("{hook}+{guid}")),
        _ => {
            let json = serde_json::from_str::<serde_json::Value>(body).ok()?;
            json.get("id").or_else(|| json.get("event_id"))?.as_str().map(str::to_owned)
        }
    })
}

/// The routes above, counting into `counts`.
pub fn router(counts: Arc<Counts>) -> Router {
    Router::new()
        .route("/orders", post(create).patch(create))
        .route("/orders/{n}", get(read_order).delete(delete_order))
        .route("/status/{code}", post(status))
        .route("/status/{code}/{*rest}", post(status_rest))
        .route("/slow/{ms}", post(slow))
        .route("/fail-first/{n}", post(fail_first))
        .route("/big/{bytes}", post(big))
        .route("/headers", post(with_headers))
        .route("/executions", get(executions))
        .with_state(counts)
}

async fn create(State(counts): State<Arc<Counts>>, headers: HeaderMap, body: String) -> Response {
    let (n, _) = counts.count_delivery(&headers, &body);
    if let Some(orders) = &counts.orders {
        use idem_store::{Precondition, Store, Ttl};
        let written = orders.put(&format!("orders/{n}"), body.clone().into(), Precondition::Absent, Ttl::Keep).await;
        if let Err(e) = written {
            return (StatusCode::INTERNAL_SERVER_ERROR, format!("could not store order {n}: {e}\n")).into_response();
        }
    }
    let location = format!("/orders/{n}");
    let body = serde_json::json!({ "order": n, "received_bytes": body.len() });
    (StatusCode::CREATED, [(header::LOCATION, location)], axum::Json(body)).into_response()
}

async fn read_order(State(counts): State<Arc<Counts>>, Path(n): Path<u64>) -> Response {
    let Ok(inner) = counts.inner.lock() else { return StatusCode::INTERNAL_SERVER_ERROR.into_response() };
    if n == 0 || n > inner.executions || inner.deleted.contains(&n) {
        return StatusCode::NOT_FOUND.into_response();
    }
    format!("order {n}\n").into_response()
}

async fn delete_order(State(counts): State<Arc<Counts>>, Path(n): Path<u64>) -> Response {
    let Ok(mut inner) = counts.inner.lock() else { return StatusCode::INTERNAL_SERVER_ERROR.into_response() };
    inner.deleted.insert(n);
    StatusCode::NO_CONTENT.into_response()
}

async fn status(
    State(counts): State<Arc<Counts>>,
    Path(code): Path<u16>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let (n, _) = counts.count_delivery(&headers, &body);
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    (status, format!("execution {n} answered {code}\n")).into_response()
}

/// `POST /status/{code}/...`: as `/status/{code}`, for clients that append their own path (an SDK's base URL).
async fn status_rest(
    State(counts): State<Arc<Counts>>,
    Path((code, _rest)): Path<(u16, String)>,
    headers: HeaderMap,
    body: String,
) -> Response {
    status(State(counts), Path(code), headers, body).await
}

async fn fail_first(
    State(counts): State<Arc<Counts>>,
    Path(n): Path<u64>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let (total, of_delivery) = counts.count_delivery(&headers, &body);
    if of_delivery <= n {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("execution {total} failed ({of_delivery} of {n})\n"))
            .into_response();
    }
    (StatusCode::CREATED, format!("execution {total} succeeded after {n} failures\n")).into_response()
}

async fn slow(State(counts): State<Arc<Counts>>, Path(ms): Path<u64>, headers: HeaderMap, body: String) -> Response {
    let (n, _) = counts.count_delivery(&headers, &body);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (StatusCode::CREATED, [(header::LOCATION, format!("/orders/{n}"))], format!("slow execution {n}\n")).into_response()
}

async fn big(State(counts): State<Arc<Counts>>, Path(bytes): Path<usize>, headers: HeaderMap) -> Response {
    counts.count(&headers);
    (StatusCode::OK, vec![b'x'; bytes.min(64 << 20)]).into_response()
}

async fn with_headers(State(counts): State<Arc<Counts>>, headers: HeaderMap) -> Response {
    let n = counts.count(&headers);
    let pairs = [
        ("content-encoding", "identity"),
        ("vary", "accept-encoding"),
        ("cache-control", "no-store"),
        ("set-cookie", "session=secret"),
        ("x-custom", "not replayed"),
    ];
    let mut response = format!("headers {n}\n").into_response();
    for (name, value) in pairs {
        if let (Ok(name), Ok(value)) = (header::HeaderName::try_from(name), header::HeaderValue::try_from(value)) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

async fn executions(State(counts): State<Arc<Counts>>) -> Response {
    let Ok(inner) = counts.inner.lock() else { return StatusCode::INTERNAL_SERVER_ERROR.into_response() };
    let max_per_key = inner.by_key.values().copied().max().unwrap_or(0);
    let counts = serde_json::json!({
        "executions": inner.executions,
        "distinct_keys": inner.by_key.len(),
        "max_executions_per_key": max_per_key,
    });
    ([(header::CONTENT_TYPE, "application/json")], format!("{counts}\n")).into_response()
}

#[allow(dead_code)] // the tests include this file for `router` only
#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:9000".to_owned();
    let mut counts = Counts::default();
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--listen", Some(addr)) => listen = addr,
            ("--sqlite", Some(path)) => {
                let store = idem_sqlite::SqliteStore::open(&path, idem_store::Limits::default())
                    .map_err(|e| std::io::Error::other(format!("cannot open {path}: {e}")))?;
                counts.orders = Some(store);
            }
            _ => {
                eprintln!(
                    "usage: upstream [--listen ADDR (default 127.0.0.1:9000)] [--sqlite PATH (persist orders)]\n\
                     routes: POST|PATCH /orders (201 + Location), GET|DELETE /orders/N,\n\
                     \x20       POST /status/CODE (answers CODE),\n\
                     \x20       POST /slow/MS (sleeps, then 201), POST /big/BYTES (a body that long),
                     \x20       POST /fail-first/N (500 for a delivery's first N executions, then 201),\n\
                     \x20       POST /headers (representation, caching and cookie headers),\n\
                     \x20       GET /executions (counts, per forwarded Idempotency-Key)"
                );
                std::process::exit(2);
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("upstream listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(Arc::new(counts))).await
}
