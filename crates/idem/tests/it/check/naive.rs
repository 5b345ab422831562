//! Naive Idempotency-Key handling, as teams write it by hand: a `HashMap` of records in front of the example
//! upstream. Correct unless told to have one flaw, so that `idem check` can be shown to flag exactly that flaw.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use crate::common::upstream;

/// The one thing done wrong (all `false`: nothing).
#[derive(Clone, Copy, Debug, Default)]
pub struct Flaws {
    /// The fingerprint has the method and path but not the body: another payload under a key is replayed.
    pub body_not_fingerprinted: bool,
    /// No fingerprint at all: any request under a key is replayed.
    pub no_fingerprint: bool,
    /// Records are keyed by the key alone, not by (credential, key).
    pub unscoped: bool,
    /// `Set-Cookie` is stored and replayed with the answer.
    pub replays_set_cookie: bool,
    /// A 503 is stored like any answer instead of releasing the key.
    pub stores_503: bool,
}

enum Record {
    InFlight(Vec<u8>),
    Done(Vec<u8>, Stored),
}

struct Stored {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

struct Naive {
    flaws: Flaws,
    records: Mutex<HashMap<(String, String), Record>>,
}

/// Starts the example upstream (every answer setting a fresh session cookie) behind the naive layer with
/// `flaws`, on a free port; returns its URL.
pub async fn start(flaws: Flaws) -> String {
    let naive = Arc::new(Naive { flaws, records: Mutex::default() });
    let app = upstream::router(Arc::default())
        .layer(middleware::from_fn(set_cookie))
        .layer(middleware::from_fn_with_state(naive, idempotency));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Every answer sets a cookie of its own, as a session-issuing API does.
async fn set_cookie(request: Request, next: Next) -> Response {
    static SESSIONS: AtomicU64 = AtomicU64::new(0);
    let mut response = next.run(request).await;
    let cookie = format!("session={}", SESSIONS.fetch_add(1, Ordering::SeqCst) + 1);
    response.headers_mut().append("set-cookie", HeaderValue::from_str(&cookie).unwrap());
    response
}

/// The key of one field line: an sf-string or a bare token of 1..=255 printable ASCII characters.
fn parse_key(value: &[u8]) -> Option<String> {
    let value = value.trim_ascii();
    let inner = match value.strip_prefix(b"\"") {
        Some(rest) => rest.strip_suffix(b"\"").filter(|k| !k.contains(&b'"') && !k.contains(&b'\\'))?,
        None => value,
    };
    let printable = inner.iter().all(|b| (0x20..=0x7E).contains(b));
    (printable && (1..=255).contains(&inner.len())).then(|| String::from_utf8_lossy(inner).into_owned())
}

async fn idempotency(State(naive): State<Arc<Naive>>, request: Request, next: Next) -> Response {
    if !matches!(*request.method(), Method::POST | Method::PATCH) {
        return next.run(request).await;
    }
    let lines: Vec<&HeaderValue> = request.headers().get_all("idempotency-key").iter().collect();
    let key = match lines.as_slice() {
        [] => return next.run(request).await,
        [one] => match parse_key(one.as_bytes()) {
            Some(key) => key,
            None => return StatusCode::BAD_REQUEST.into_response(),
        },
        _ => return StatusCode::BAD_REQUEST.into_response(),
    };
    let flaws = naive.flaws;
    let credential = request.headers().get("authorization").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let id = (if flaws.unscoped { String::new() } else { credential.unwrap_or_default() }, key);
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    let mut fingerprint = Vec::new();
    if !flaws.no_fingerprint {
        fingerprint.extend_from_slice(format!("{} {}\n", parts.method, parts.uri).as_bytes());
        if !flaws.body_not_fingerprinted {
            fingerprint.extend_from_slice(&body);
        }
    }
    {
        let mut records = naive.records.lock().unwrap();
        match records.get(&id) {
            Some(Record::InFlight(f) | Record::Done(f, _)) if *f != fingerprint => {
                return StatusCode::UNPROCESSABLE_ENTITY.into_response();
            }
            Some(Record::InFlight(_)) => return (StatusCode::CONFLICT, [("retry-after", "1")]).into_response(),
            Some(Record::Done(_, stored)) => {
                let mut replay = Response::new(Body::from(stored.body.clone()));
                *replay.status_mut() = stored.status;
                for (name, value) in &stored.headers {
                    replay.headers_mut().append(name.clone(), value.clone());
                }
                replay.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
                return replay;
            }
            None => {
                records.insert(id.clone(), Record::InFlight(fingerprint.clone()));
            }
        }
    }
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20).await.unwrap();
    let mut records = naive.records.lock().unwrap();
    if parts.status == StatusCode::TOO_MANY_REQUESTS || (parts.status == 503 && !flaws.stores_503) {
        records.remove(&id);
    } else {
        let kept = |name: &HeaderName| {
            matches!(name.as_str(), "content-type" | "location") || (flaws.replays_set_cookie && name == "set-cookie")
        };
        let headers = parts.headers.iter().filter(|(n, _)| kept(n)).map(|(n, v)| (n.clone(), v.clone())).collect();
        records.insert(id, Record::Done(fingerprint, Stored { status: parts.status, headers, body: body.clone() }));
    }
    Response::from_parts(parts, Body::from(body))
}

/// An API that ignores `Idempotency-Key` and whose answers never differ: every request executes (counted) and
/// gets `201 {}`; under `/error` a `503 {}`, under `/slow` the `201 {}` after a second, under `/big` 3 MiB of
/// `x`, under `/endless` a chunked body that never ends. Returns its URL and the executions counter.
pub async fn start_constant() -> (String, Arc<AtomicU64>) {
    let executed = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&executed);
    let app = axum::Router::new().fallback(move |request: Request| {
        let counter = Arc::clone(&counter);
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            let path = request.uri().path().to_owned();
            match path.as_str() {
                "/error" => (StatusCode::SERVICE_UNAVAILABLE, "{}").into_response(),
                "/big" => (StatusCode::CREATED, vec![b'x'; 3 << 20]).into_response(),
                // A chunked body that never ends: 64 KiB chunks for as long as the client reads.
                "/endless" => {
                    let chunks =
                        futures_util::stream::repeat_with(|| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1 << 16])));
                    (StatusCode::CREATED, Body::from_stream(chunks)).into_response()
                }
                _ => {
                    if path == "/slow" {
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                    (StatusCode::CREATED, [("content-type", "application/json")], "{}").into_response()
                }
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, executed)
}
