//! The KV HTTP contract (docs/DESIGN.md), driven through the router without a socket.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use idem_server::{ServerConfig, app};
use idem_store::{Limits, MemoryStore, Store};
use tower::ServiceExt;

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {:?}", self.body))
    }
    fn etag(&self) -> Option<&str> {
        self.headers.get(header::ETAG).map(|v| v.to_str().unwrap())
    }
    fn problem_type(&self) -> String {
        assert_eq!(self.headers[header::CONTENT_TYPE], "application/problem+json", "{:?}", self.body);
        let j = self.json();
        assert_eq!(j["status"], self.status.as_u16());
        j["type"].as_str().unwrap().trim_start_matches("urn:idem:problem:").to_owned()
    }
}

async fn call(app: &Router, method: Method, uri: &str, headers: &[(&str, &str)], body: impl Into<Body>) -> Resp {
    let mut req = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app.clone().oneshot(req.body(body.into()).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    Resp { status: parts.status, headers: parts.headers, body: body.collect().await.unwrap().to_bytes() }
}

fn setup() -> (MemoryStore, Router) {
    let store = MemoryStore::with_limits(Limits::default().with_max_value_bytes(1024));
    (store.clone(), app(store, ServerConfig::default()))
}

/// Every key with its value and generation: what "nothing changed" is checked against.
async fn snapshot(store: &MemoryStore) -> Vec<(String, Bytes, u64)> {
    let mut out = Vec::new();
    for item in store.list("", None, 1000).await.unwrap().items {
        let v = store.get(&item.key).await.unwrap().unwrap();
        out.push((item.key, v.value().clone(), v.generation().get()));
    }
    out
}

#[tokio::test]
async fn put_get_delete_with_preconditions() {
    let (_, app) = setup();
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[], "v1").await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.headers[header::LOCATION], "/v1/kv/orders%2F1");
    let g1 = r.etag().unwrap().to_owned();
    assert_eq!(r.json()["generation"].to_string(), g1.trim_matches('"'));

    let r = call(&app, Method::GET, "/v1/kv/orders%2F1", &[], Body::empty()).await;
    assert_eq!((r.status, r.body.as_ref(), r.etag()), (StatusCode::OK, &b"v1"[..], Some(g1.as_str())));

    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[], "v2").await;
    assert_eq!(r.status, StatusCode::OK);
    let g2 = r.etag().unwrap().to_owned();
    assert_ne!(g1, g2);

    // A stale If-Match: 412 carrying the current ETag.
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", &g1)], "lost").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(r.problem_type(), "precondition-failed");
    assert_eq!(r.etag(), Some(g2.as_str()));
    assert_eq!(r.json()["current_generation"].to_string(), g2.trim_matches('"'));
    // If-None-Match: * on a present key.
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-none-match", "*")], "dup").await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g2.as_str())));
    // The right If-Match wins; If-Match: * on a present key too.
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", &g2)], "v3").await;
    assert_eq!(r.status, StatusCode::OK);
    let g3 = r.etag().unwrap().to_owned();
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", "*")], "v4").await;
    assert_eq!(r.status, StatusCode::OK);
    let g4 = r.etag().unwrap().to_owned();
    // A weak tag never matches under If-Match (strong comparison, RFC 9110 §13.1.1).
    let weak = format!("W/{g4}");
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", &weak)], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);

    let r = call(&app, Method::DELETE, "/v1/kv/orders%2F1", &[("if-match", &g3)], Body::empty()).await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g4.as_str())));
    let r = call(&app, Method::DELETE, "/v1/kv/orders%2F1", &[("if-match", &g4)], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&app, Method::GET, "/v1/kv/orders%2F1", &[], Body::empty()).await;
    assert_eq!((r.status, r.problem_type().as_str()), (StatusCode::NOT_FOUND, "not-found"));
    // Deleting what is gone is a no-op; but If-Match: * on an absent key fails, with no ETag.
    let r = call(&app, Method::DELETE, "/v1/kv/orders%2F1", &[], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", "*")], "x").await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, None));
    // Re-created: a new, higher generation; the old one does not match (ABA).
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-none-match", "*")], "again").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = call(&app, Method::PUT, "/v1/kv/orders%2F1", &[("if-match", &g4)], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
}

#[tokio::test]
async fn any_utf8_key_round_trips() {
    let (_, app) = setup();
    let keys = ["a/b/c", "ключ 🔑", "100%", "?#&=+", " spaced ", "%2F literally", ".", "..", &"k".repeat(1024)];
    for (i, key) in keys.iter().enumerate() {
        let enc: String = url_encode(key);
        let r = call(&app, Method::PUT, &format!("/v1/kv/{enc}"), &[], format!("{i}")).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}");
        let r = call(&app, Method::GET, &format!("/v1/kv/{enc}"), &[], Body::empty()).await;
        assert_eq!(r.body, format!("{i}"), "{key}");
    }
    // Unencoded slashes are part of the key too.
    let r = call(&app, Method::GET, "/v1/kv/a/b/c", &[], Body::empty()).await;
    assert_eq!(r.body, "0");
    let r = call(&app, Method::GET, "/v1/kv?limit=1000", &[], Body::empty()).await;
    let listed: Vec<String> =
        r.json()["items"].as_array().unwrap().iter().map(|i| i["key"].as_str().unwrap().to_owned()).collect();
    let mut want: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    want.sort();
    assert_eq!(listed, want);
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// method, URI, headers, body, expected status, expected problem type.
type Case<'a> = (Method, &'a str, Vec<(&'a str, &'a str)>, String, StatusCode, &'a str);

#[tokio::test]
async fn bad_requests_get_precise_problems_and_change_nothing() {
    let (store, app) = setup();
    call(&app, Method::PUT, "/v1/kv/keep", &[], "original").await;
    call(&app, Method::POST, "/v1/kv/n/counter", &[], r#"{"delta":5}"#).await;
    let before = snapshot(&store).await;
    let long = format!("/v1/kv/{}", "k".repeat(1025));
    let big = "x".repeat(1025);
    let cases: Vec<Case> = vec![
        (Method::PUT, "/v1/kv/", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-key"),
        (Method::GET, "/v1/kv/", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-key"),
        (Method::PUT, &long, vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-key"),
        (Method::PUT, "/v1/kv/nul%00", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-key"),
        (Method::PUT, "/v1/kv/keep%zz", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-percent-encoding"),
        (Method::PUT, "/v1/kv/keep%", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-percent-encoding"),
        (Method::GET, "/v1/kv/%ff%fe", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-key"),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "12")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "\"12")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "\"1\", \"2")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "\"1\" \"2\"")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "*"), ("if-match", "\"2\"")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::PUT,
            "/v1/kv/keep",
            vec![("if-match", "*"), ("if-none-match", "1")],
            "v".into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::GET,
            "/v1/kv/keep",
            vec![("if-none-match", "\"1\", 2")],
            String::new(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::DELETE,
            "/v1/kv/keep",
            vec![("if-match", "W/")],
            String::new(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (Method::PUT, "/v1/kv/keep?ttl=0s", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-ttl"),
        (Method::PUT, "/v1/kv/keep?ttl=500ms", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-ttl"),
        (Method::PUT, "/v1/kv/keep?ttl=366days", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-ttl"),
        (Method::PUT, "/v1/kv/keep?ttl=soon", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-ttl"),
        (Method::PUT, "/v1/kv/keep?tll=30s", vec![], "v".into(), StatusCode::BAD_REQUEST, "invalid-query"),
        (Method::PUT, "/v1/kv/keep", vec![], big, StatusCode::PAYLOAD_TOO_LARGE, "value-too-large"),
        (Method::GET, "/v1/kv?limit=0", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-query"),
        (Method::GET, "/v1/kv?limit=1001", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-query"),
        (Method::GET, "/v1/kv?limit=ten", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-query"),
        (Method::GET, "/v2/kv/keep", vec![], String::new(), StatusCode::NOT_FOUND, "unknown-route"),
        (Method::PATCH, "/v1/kv/keep", vec![], "v".into(), StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed"),
        (Method::POST, "/v1/kv/keep", vec![], "{}".into(), StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed"),
        (
            Method::POST,
            "/v1/kv/keep/frobnicate",
            vec![],
            "{}".into(),
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
        ),
        (Method::GET, "/v1/kv?cursor=%%%", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-percent-encoding"),
        (Method::GET, "/v1/kv?prefix=a%2", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-percent-encoding"),
        (Method::GET, "/v1/kv?prefix=%FF", vec![], String::new(), StatusCode::BAD_REQUEST, "invalid-query"),
        (Method::POST, "/v1/kv/n/counter", vec![], "{\"delta\":".into(), StatusCode::BAD_REQUEST, "invalid-body"),
        (
            Method::POST,
            "/v1/kv/n/counter",
            vec![],
            r#"{"delta":"1"}"#.into(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-body",
        ),
        (
            Method::POST,
            "/v1/kv/n/counter",
            vec![],
            r#"{"delta":1,"dedupe_id":""}"#.into(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-argument",
        ),
        (
            Method::POST,
            "/v1/kv/n/counter",
            vec![],
            format!("{{\"delta\":{}}}", i64::MAX),
            StatusCode::CONFLICT,
            "counter-overflow",
        ),
        (Method::POST, "/v1/kv/keep/counter", vec![], r#"{"delta":1}"#.into(), StatusCode::CONFLICT, "wrong-type"),
        (Method::POST, "/v1/kv/keep/set", vec![], r#"{"add":["a"]}"#.into(), StatusCode::CONFLICT, "wrong-type"),
        (
            Method::POST,
            "/v1/kv/s/set",
            vec![],
            r#"{"add":[""]}"#.into(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-argument",
        ),
        (
            Method::POST,
            "/v1/kv/s/set",
            vec![("if-match", "\"1\"")],
            r#"{"add":["x"]}"#.into(),
            StatusCode::BAD_REQUEST,
            "invalid-precondition",
        ),
        (
            Method::POST,
            "/v1/kv/n/counter?ttl=30s",
            vec![],
            r#"{"delta":1}"#.into(),
            StatusCode::BAD_REQUEST,
            "invalid-query",
        ),
        (Method::PUT, "/v1/kv", vec![], "v".into(), StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed"),
        (Method::POST, "/healthz", vec![], String::new(), StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed"),
    ];
    for (method, uri, headers, body, status, kind) in cases {
        let r = call(&app, method.clone(), uri, &headers, body).await;
        assert_eq!(r.status, status, "{method} {uri} {headers:?}: {:?}", r.body);
        assert_eq!(r.problem_type(), kind, "{method} {uri} {headers:?}");
        assert!(!r.json()["detail"].as_str().unwrap().is_empty());
    }
    assert_eq!(snapshot(&store).await, before, "a refused request changed stored data");
}

/// Each 405 names what its target takes (RFC 9110 §15.5.6): POST only on `{key}/set` and `{key}/counter`.
#[tokio::test]
async fn allow_names_the_methods_the_target_takes() {
    let (_, app) = setup();
    for (method, uri, allow) in [
        (Method::PATCH, "/v1/kv/keep", "GET, PUT, DELETE"),
        (Method::POST, "/v1/kv/keep", "GET, PUT, DELETE"),
        (Method::POST, "/v1/kv/a%2Fset", "GET, PUT, DELETE"),
        (Method::PATCH, "/v1/kv/n/counter", "GET, PUT, DELETE, POST"),
        (Method::PATCH, "/v1/kv/s/set", "GET, PUT, DELETE, POST"),
        (Method::PUT, "/v1/kv", "GET"),
    ] {
        let r = call(&app, method.clone(), uri, &[], "{}").await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
        assert_eq!(r.headers.get("allow").map(|v| v.to_str().unwrap()), Some(allow), "{method} {uri}");
    }
}

/// A body that counts how many bytes the server pulled from it and, after `len` bytes, never ends.
fn counting_body(len: usize, chunk: usize, pulled: Arc<AtomicUsize>) -> Body {
    let stream = futures_util::stream::unfold(0usize, move |sent| {
        let pulled = pulled.clone();
        async move {
            if sent >= len {
                std::future::pending::<()>().await;
            }
            pulled.fetch_add(chunk, Ordering::SeqCst);
            Some((Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; chunk])), sent + chunk))
        }
    });
    Body::from_stream(stream)
}

#[tokio::test]
async fn over_limit_bodies_get_413_without_reading_past_the_drain_bound() {
    let (store, app) = setup();
    // What an unread body is drained up to: the largest body the API accepts (the 1 MiB set/counter body,
    // over this store's 1 KiB value limit) plus the slack (see `unread_body.rs` for why it is drained).
    let bound = (1 << 20) + idem_tower::DRAIN_SLACK_BYTES as usize;
    // Declared past the bound: answered before reading any of it (the body would hang forever if read).
    let pulled = Arc::new(AtomicUsize::new(0));
    let req = Request::put("/v1/kv/big")
        .header(header::CONTENT_LENGTH, (bound + 1).to_string())
        .body(counting_body(bound + 1, 4096, pulled.clone()))
        .unwrap();
    let resp =
        tokio::time::timeout(std::time::Duration::from_secs(5), app.clone().oneshot(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(pulled.load(Ordering::SeqCst), 0, "read a body it had already refused");
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["limit_bytes"], 1024);
    // Chunked, no length: the handler stops one chunk past the limit, the drain one chunk past its bound.
    let pulled = Arc::new(AtomicUsize::new(0));
    let req = Request::put("/v1/kv/big").body(counting_body(usize::MAX, 256, pulled.clone())).unwrap();
    let resp =
        tokio::time::timeout(std::time::Duration::from_secs(5), app.clone().oneshot(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(resp.headers()[header::CONNECTION], "close");
    let n = pulled.load(Ordering::SeqCst);
    assert!(n > bound && n <= bound + 256, "pulled {n} bytes; the bound is {bound}");
    assert!(store.get("big").await.unwrap().is_none());
    // Exactly the limit is fine.
    let r = call(&app, Method::PUT, "/v1/kv/big", &[], "x".repeat(1024)).await;
    assert_eq!(r.status, StatusCode::CREATED);
}

#[tokio::test]
async fn ttl_query_sets_keeps_and_clears_expiry() {
    let (_, app) = setup();
    let r = call(&app, Method::PUT, "/v1/kv/t?ttl=1h", &[], "a").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let exp = call(&app, Method::GET, "/v1/kv/t", &[], Body::empty()).await.headers["idem-expires-at"].clone();
    call(&app, Method::PUT, "/v1/kv/t", &[], "b").await;
    let r = call(&app, Method::GET, "/v1/kv/t", &[], Body::empty()).await;
    assert_eq!(r.headers["idem-expires-at"], exp, "an omitted ttl must keep the expiry");
    call(&app, Method::PUT, "/v1/kv/t?ttl=keep", &[], "c").await;
    assert_eq!(call(&app, Method::GET, "/v1/kv/t", &[], Body::empty()).await.headers["idem-expires-at"], exp);
    let listed = call(&app, Method::GET, "/v1/kv?prefix=t", &[], Body::empty()).await.json();
    assert!(listed["items"][0]["expires_at"].is_string());
    call(&app, Method::PUT, "/v1/kv/t?ttl=none", &[], "d").await;
    assert!(call(&app, Method::GET, "/v1/kv/t", &[], Body::empty()).await.headers.get("idem-expires-at").is_none());
    call(&app, Method::PUT, "/v1/kv/t?ttl=90", &[], "e").await;
    assert!(call(&app, Method::GET, "/v1/kv/t", &[], Body::empty()).await.headers.get("idem-expires-at").is_some());
}

#[tokio::test]
async fn conditional_get_answers_304() {
    let (_, app) = setup();
    let g = call(&app, Method::PUT, "/v1/kv/c", &[], "a").await.etag().unwrap().to_owned();
    let r = call(&app, Method::GET, "/v1/kv/c", &[("if-none-match", &g)], Body::empty()).await;
    assert_eq!((r.status, r.body.len()), (StatusCode::NOT_MODIFIED, 0));
    let r = call(&app, Method::GET, "/v1/kv/c", &[("if-none-match", "\"999999\"")], Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
}

/// A field value listing `tags`, comma-separated.
fn listed(tags: &[&str]) -> String {
    tags.join(", ")
}

/// RFC 9110 §13.1.1, §13.1.2, §13.2.2: entity-tag lists, weak and strong comparison, both fields at once.
#[tokio::test]
async fn entity_tag_lists_are_evaluated_in_rfc_order() {
    let (store, app) = setup();
    let g = call(&app, Method::PUT, "/v1/kv/k", &[], "v1").await.etag().unwrap().to_owned();
    let stale = g.clone();
    let g = call(&app, Method::PUT, "/v1/kv/k", &[], "v2").await.etag().unwrap().to_owned();
    let foreign = "\"999999\"";
    let weak = format!("W/{g}");
    let get = |headers: Vec<(&'static str, String)>| {
        let app = app.clone();
        async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let get = call(&app, Method::GET, "/v1/kv/k", &h, Body::empty()).await;
            let head = call(&app, Method::HEAD, "/v1/kv/k", &h, Body::empty()).await;
            assert_eq!(get.status, head.status, "GET and HEAD differ for {h:?}");
            get
        }
    };

    // If-None-Match naming the current generation among others: 304 on GET and HEAD, with the ETag.
    for inm in [listed(&[foreign, &g]), listed(&[&g, foreign]), weak.clone(), listed(&["\"a,b\"", &weak])] {
        let r = get(vec![("if-none-match", inm.clone())]).await;
        assert_eq!((r.status, r.etag(), r.body.len()), (StatusCode::NOT_MODIFIED, Some(g.as_str()), 0), "{inm}");
    }
    // ... and 412 on PUT and DELETE, changing nothing.
    let before = snapshot(&store).await;
    for inm in [listed(&[foreign, &g]), weak.clone()] {
        let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-none-match", &inm)], "x").await;
        assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g.as_str())), "{inm}");
        assert_eq!(r.problem_type(), "precondition-failed");
        let r = call(&app, Method::DELETE, "/v1/kv/k", &[("if-none-match", &inm)], Body::empty()).await;
        assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g.as_str())), "{inm}");
    }
    // If-Match uses strong comparison: a weak tag never matches, on reads or writes.
    let r = get(vec![("if-match", weak.clone())]).await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g.as_str())));
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-match", &listed(&[&weak, foreign]))], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    // A comma inside quotes is one opaque tag: it matches nothing, and is no 400.
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-match", "\"a,b\"")], "x").await;
    assert_eq!((r.status, r.problem_type().as_str()), (StatusCode::PRECONDITION_FAILED, "precondition-failed"));
    // Both fields: If-Match is judged first, so a failing If-Match is 412 even where If-None-Match would be 304.
    let r = get(vec![("if-match", foreign.to_owned()), ("if-none-match", g.clone())]).await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    let r = get(vec![("if-match", listed(&[foreign, &g])), ("if-none-match", g.clone())]).await;
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    let r = get(vec![("if-match", g.clone()), ("if-none-match", foreign.to_owned())]).await;
    assert_eq!((r.status, r.body.as_ref()), (StatusCode::OK, &b"v2"[..]));
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-match", "*"), ("if-none-match", "*")], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-match", &g), ("if-none-match", &weak)], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-match", &stale), ("if-none-match", foreign)], "x").await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g.as_str())));
    assert_eq!(snapshot(&store).await, before, "a failed precondition changed stored data");

    // If-Match lists: the write happens when the current generation is any listed one; optional whitespace
    // around commas, empty elements and several field lines are all one list (RFC 9110 §5.6.1, §5.3).
    let mut g = g;
    for variant in 0..6 {
        let headers: Vec<(&str, String)> = match variant {
            0 => vec![("if-match", listed(&[foreign, &g]))],
            1 => vec![("if-match", format!("{foreign},{g}"))],
            2 => vec![("if-match", format!(" {foreign} ,\t{g} "))],
            3 => vec![("if-match", format!(",{g},,{stale},"))],
            4 => vec![("if-match", foreign.to_owned()), ("if-match", g.clone())],
            _ => vec![("if-match", listed(&[&stale, &g])), ("if-none-match", listed(&[foreign, "\"a,b\""]))],
        };
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = call(&app, Method::PUT, "/v1/kv/k", &h, format!("w{variant}")).await;
        assert_eq!(r.status, StatusCode::OK, "{h:?}: {:?}", r.body);
        let next = r.etag().unwrap().to_owned();
        assert_ne!(next, g);
        // The generation it replaced is now stale: the same request is refused.
        let r = call(&app, Method::PUT, "/v1/kv/k", &h, "again").await;
        assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(next.as_str())), "{h:?}");
        g = next;
    }
    assert_eq!(call(&app, Method::GET, "/v1/kv/k", &[], Body::empty()).await.body, "w5");
    // If-None-Match naming other generations lets the write through; on an absent key too (it creates).
    let r = call(&app, Method::PUT, "/v1/kv/k", &[("if-none-match", &listed(&[foreign, &stale]))], "n").await;
    assert_eq!(r.status, StatusCode::OK);
    let g = r.etag().unwrap().to_owned();
    let r = call(&app, Method::PUT, "/v1/kv/fresh", &[("if-none-match", &listed(&[foreign, &g]))], "f").await;
    assert_eq!(r.status, StatusCode::CREATED);
    // If-Match naming only other generations fails on an absent key, and creates nothing.
    let r = call(&app, Method::PUT, "/v1/kv/none", &[("if-match", &listed(&[foreign, &g]))], "x").await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, None));
    let r = call(&app, Method::PUT, "/v1/kv/none", &[("if-match", "*"), ("if-none-match", "*")], "x").await;
    assert_eq!(r.status, StatusCode::PRECONDITION_FAILED);
    assert!(store.get("none").await.unwrap().is_none());
    // DELETE with lists.
    let r = call(&app, Method::DELETE, "/v1/kv/k", &[("if-match", &listed(&[foreign, &stale]))], Body::empty()).await;
    assert_eq!((r.status, r.etag()), (StatusCode::PRECONDITION_FAILED, Some(g.as_str())));
    let r = call(&app, Method::DELETE, "/v1/kv/k", &[("if-match", &listed(&[foreign, &g]))], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&app, Method::DELETE, "/v1/kv/fresh", &[("if-none-match", foreign)], Body::empty()).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(snapshot(&store).await.is_empty());
}

/// A PUT under an `If-Match` list is a compare-and-swap: concurrent read-increment-write loops whose
/// precondition is a list holding the generation they read never lose an increment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn if_match_lists_never_lose_an_update() {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_sqlite::SqliteStore::open(dir.path().join("l.db"), Limits::default()).unwrap();
    let app = app(store, ServerConfig::default());
    call(&app, Method::PUT, "/v1/kv/n", &[], "0").await;
    const WRITERS: usize = 8;
    const INCREMENTS: usize = 25;
    let refused = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..WRITERS {
        let (app, refused) = (app.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            while done < INCREMENTS {
                let r = call(&app, Method::GET, "/v1/kv/n", &[], Body::empty()).await;
                let n: u64 = std::str::from_utf8(&r.body).unwrap().parse().unwrap();
                let tags = listed(&["\"999999\"", r.etag().unwrap(), "W/\"1\""]);
                let w = call(&app, Method::PUT, "/v1/kv/n", &[("if-match", &tags)], (n + 1).to_string()).await;
                match w.status {
                    StatusCode::OK => done += 1,
                    StatusCode::PRECONDITION_FAILED => {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    other => panic!("unexpected {other}: {:?}", w.body),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let r = call(&app, Method::GET, "/v1/kv/n", &[], Body::empty()).await;
    assert_eq!(r.body, (WRITERS * INCREMENTS).to_string());
    // The contention was real: some writes lost a race and were refused.
    assert!(refused.load(Ordering::SeqCst) > 0, "no write ever raced; the test proves nothing");
}

#[tokio::test]
async fn list_pages_with_cursor() {
    let (_, app) = setup();
    for i in 0..25 {
        call(&app, Method::PUT, &format!("/v1/kv/p%2F{i:02}"), &[], "v").await;
    }
    call(&app, Method::PUT, "/v1/kv/q", &[], "v").await;
    let mut cursor: Option<String> = None;
    let mut keys = Vec::new();
    loop {
        let uri = match &cursor {
            Some(c) => format!("/v1/kv?prefix=p%2F&limit=10&cursor={}", url_encode(c)),
            None => "/v1/kv?prefix=p%2F&limit=10".to_owned(),
        };
        let page = call(&app, Method::GET, &uri, &[], Body::empty()).await.json();
        keys.extend(page["items"].as_array().unwrap().iter().map(|i| i["key"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let want: Vec<String> = (0..25).map(|i| format!("p/{i:02}")).collect();
    assert_eq!(keys, want);
}

#[tokio::test]
async fn set_and_counter_operations() {
    let (_, app) = setup();
    let r = call(&app, Method::POST, "/v1/kv/s/set", &[], r#"{"add":["b","a","b"]}"#).await;
    assert_eq!(
        (r.status, r.json()["members"].as_u64(), r.json()["added"].as_u64()),
        (StatusCode::OK, Some(2), Some(2))
    );
    assert_eq!(call(&app, Method::GET, "/v1/kv/s", &[], Body::empty()).await.body, r#"["a","b"]"#);
    let r = call(&app, Method::POST, "/v1/kv/s/set", &[], r#"{"remove":["a","z"]}"#).await;
    assert_eq!(r.json()["removed"], 1);
    let r = call(&app, Method::POST, "/v1/kv/n/counter", &[], r#"{"delta":3,"dedupe_id":"op-1"}"#).await;
    assert_eq!((r.json()["value"].as_i64(), r.json()["applied"].as_bool()), (Some(3), Some(true)));
    let r = call(&app, Method::POST, "/v1/kv/n/counter", &[], r#"{"delta":3,"dedupe_id":"op-1"}"#).await;
    assert_eq!((r.json()["value"].as_i64(), r.json()["applied"].as_bool()), (Some(3), Some(false)));
    assert_eq!(r.headers["idempotent-replayed"], "true");
    let r = call(&app, Method::POST, "/v1/kv/n/counter", &[], r#"{"delta":-10}"#).await;
    assert_eq!(r.json()["value"], -7);
}

/// Idem issue 12, case 4, as reported: `{"delta":5,"dedupe_id":"pay-1"}` then `{"delta":7,"dedupe_id":"pay-1"}`
/// on `balance`. The same payload again replays; the other payload is 422 naming the key and the id, and the
/// balance and its generation stay as the first add left them.
#[tokio::test]
async fn counter_dedupe_id_reused_with_another_delta_is_422() {
    let (store, app) = setup();
    let uri = "/v1/kv/balance/counter";
    let r = call(&app, Method::POST, uri, &[], r#"{"delta":5,"dedupe_id":"pay-1"}"#).await;
    assert_eq!(
        (r.status, r.json()["value"].as_i64(), r.json()["applied"].as_bool()),
        (StatusCode::OK, Some(5), Some(true))
    );
    assert!(r.headers.get("idempotent-replayed").is_none());
    let first_etag = r.etag().unwrap().to_owned();
    let before = snapshot(&store).await;

    let r = call(&app, Method::POST, uri, &[], r#"{"delta":7,"dedupe_id":"pay-1"}"#).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.problem_type(), "dedupe-id-reused");
    let detail = r.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("\"pay-1\"") && detail.contains("\"balance\""), "{detail}");
    assert!(r.headers.get("idempotent-replayed").is_none() && r.etag().is_none());
    assert_eq!(snapshot(&store).await, before, "a refused add changed something");

    // The original payload, with its fields in another order, still replays the first result.
    let r = call(&app, Method::POST, uri, &[], r#"{"dedupe_id":"pay-1","delta":5}"#).await;
    assert_eq!(
        (r.status, r.json()["value"].as_i64(), r.json()["applied"].as_bool()),
        (StatusCode::OK, Some(5), Some(false))
    );
    assert_eq!((r.headers["idempotent-replayed"].to_str().unwrap(), r.etag()), ("true", Some(first_etag.as_str())));
    assert_eq!(snapshot(&store).await, before);
}

/// A dedupe id or set member holding a NUL is refused with a detail that names the NUL rule: the id below is 3
/// bytes, so "must be 1..=255 bytes" alone would send its caller looking for a length problem it does not have.
#[tokio::test]
async fn nul_in_a_dedupe_id_or_member_is_named_in_the_problem() {
    let (store, app) = setup();
    for (uri, body) in [
        ("/v1/kv/n/counter", r#"{"delta":1,"dedupe_id":"a\u0000b"}"#),
        ("/v1/kv/s/set", r#"{"add":["a"],"dedupe_id":"a\u0000b"}"#),
        ("/v1/kv/s/set", r#"{"add":["a\u0000b"]}"#),
    ] {
        let r = call(&app, Method::POST, uri, &[], body).await;
        assert_eq!((r.status, r.problem_type()), (StatusCode::UNPROCESSABLE_ENTITY, "invalid-argument".to_owned()));
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("without NUL"), "{body}: {detail}");
    }
    assert_eq!(snapshot(&store).await, vec![], "a refused request wrote");
}

/// Set changes take a `dedupe_id` too: a retry listing the same members in another order replays with
/// `Idempotent-Replayed: true` and `applied: false`; another change under the id is 422 and writes nothing.
#[tokio::test]
async fn set_dedupe_id_replays_and_refuses_another_change() {
    let (store, app) = setup();
    let uri = "/v1/kv/tags/set";
    let r = call(&app, Method::POST, uri, &[], r#"{"add":["b","a"],"dedupe_id":"tag-1"}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    let first = r.json();
    assert_eq!((first["added"].as_u64(), first["applied"].as_bool()), (Some(2), Some(true)));
    assert!(r.headers.get("idempotent-replayed").is_none());
    let first_etag = r.etag().unwrap().to_owned();
    let before = snapshot(&store).await;

    let r = call(&app, Method::POST, uri, &[], r#"{"dedupe_id":"tag-1","add":["a","b","a"],"remove":[]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["idempotent-replayed"], "true");
    assert_eq!(r.etag(), Some(first_etag.as_str()));
    let mut want = first.clone();
    want["applied"] = false.into();
    assert_eq!(r.json(), want);

    for body in [r#"{"add":["c"],"dedupe_id":"tag-1"}"#, r#"{"add":["a","b"],"remove":["a"],"dedupe_id":"tag-1"}"#] {
        let r = call(&app, Method::POST, uri, &[], body).await;
        assert_eq!((r.status, r.problem_type()), (StatusCode::UNPROCESSABLE_ENTITY, "dedupe-id-reused".to_owned()));
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("\"tag-1\"") && detail.contains("\"tags\""), "{detail}");
    }
    assert_eq!(snapshot(&store).await, before, "a refused change wrote");
    let r = call(&app, Method::POST, uri, &[], r#"{"add":["c"],"dedupe_id":""}"#).await;
    assert_eq!((r.status, r.problem_type()), (StatusCode::UNPROCESSABLE_ENTITY, "invalid-argument".to_owned()));
    // Without an id, nothing is remembered: the same change is applied each time (here adding nothing new).
    let r = call(&app, Method::POST, uri, &[], r#"{"add":["a"]}"#).await;
    assert_eq!((r.json()["applied"].as_bool(), r.json()["added"].as_u64()), (Some(true), Some(0)));
    assert!(r.headers.get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn bearer_token_guards_every_kv_request() {
    let store = MemoryStore::new();
    let app = app(store, ServerConfig::new().with_auth_token("s3cret"));
    for (headers, want) in [
        (vec![], StatusCode::UNAUTHORIZED),
        (vec![("authorization", "Bearer wrong")], StatusCode::UNAUTHORIZED),
        (vec![("authorization", "Basic czNjcmV0")], StatusCode::UNAUTHORIZED),
        (vec![("authorization", "Bearer s3cret")], StatusCode::CREATED),
    ] {
        let r = call(&app, Method::PUT, "/v1/kv/k", &headers, "v").await;
        assert_eq!(r.status, want, "{headers:?}");
        if want == StatusCode::UNAUTHORIZED {
            assert_eq!(r.problem_type(), "unauthorized");
            assert!(r.headers[header::WWW_AUTHENTICATE].to_str().unwrap().starts_with("Bearer"));
        }
    }
    for uri in ["/v1/kv/k", "/v1/kv?prefix=", "/v1/kv/"] {
        assert_eq!(call(&app, Method::GET, uri, &[], Body::empty()).await.status, StatusCode::UNAUTHORIZED, "{uri}");
    }
    assert_eq!(call(&app, Method::GET, "/healthz", &[], Body::empty()).await.status, StatusCode::OK);
    assert_eq!(call(&app, Method::GET, "/readyz", &[], Body::empty()).await.status, StatusCode::OK);
}

#[tokio::test]
async fn metrics_count_requests_and_precondition_failures() {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_sqlite::SqliteStore::open(dir.path().join("m.db"), Limits::default()).unwrap();
    let app = app(store, ServerConfig::default());
    call(&app, Method::PUT, "/v1/kv/m", &[("if-none-match", "*")], "v").await;
    call(&app, Method::PUT, "/v1/kv/m", &[("if-none-match", "*")], "v").await;
    // Arbitrary method tokens must not become label values (one time series each, forever).
    for i in 0..5 {
        let m = Method::from_bytes(format!("FROB{i}").as_bytes()).unwrap();
        call(&app, m, "/nope", &[], Body::empty()).await;
    }
    let text = String::from_utf8(call(&app, Method::GET, "/metrics", &[], Body::empty()).await.body.to_vec()).unwrap();
    for needle in [
        "idem_http_requests_total{route=\"/v1/kv/{*key}\",method=\"PUT\",status=\"412\"}",
        "idem_precondition_failures_total{op=\"put\"}",
        "idem_store_op_seconds_bucket{op=\"put\"",
        "idem_sqlite_batch_size_bucket",
        "method=\"other\"",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    assert!(!text.contains("FROB"), "a client-chosen method became a label value");
}
