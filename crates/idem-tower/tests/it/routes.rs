//! Routes of the layer (`IdempotencyLayer::route`), in process: a signature check runs before the key is read
//! or the store touched; records are scoped by route and path; a release route executes again after a
//! non-2xx answer. The store counts its operations (`idem_store::testing::FaultyStore` with no fault).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use idem_store::testing::FaultyStore;
use idem_store::{MemoryStore, Store};
use idem_tower::{
    Body, IdempotencyLayer, KeySource, MissingKey, OnFailure, Refusal, RefusalReason, RoutePolicy, Verify,
};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};

type Inner = BoxCloneService<Request<Body>, Response<Body>, std::io::Error>;
type Counted = FaultyStore<MemoryStore>;

/// Accepts a request whose `x-signature` header is `good`, refuses any other.
struct HeaderCheck;

impl Verify for HeaderCheck {
    fn scheme(&self) -> &str {
        "test"
    }

    fn verify(&self, parts: &Parts, _body: &Bytes, _now: SystemTime) -> Result<(), Refusal> {
        match parts.headers.get("x-signature").map(|v| v.as_bytes()) {
            Some(b"good") => Ok(()),
            Some(_) => Err(Refusal { reason: RefusalReason::Mismatch, detail: "not good".into() }),
            None => Err(Refusal { reason: RefusalReason::Missing, detail: "no x-signature".into() }),
        }
    }
}

/// The inner service: counts executions; `/fail...` answers 500 on its first execution, `/status/N` answers
/// N, `/own-hint` 500 with its own `Stripe-Should-Retry: true`, `/slow` waits for `gate`; the rest 201.
fn gated(executions: Arc<AtomicUsize>, gate: Arc<tokio::sync::Semaphore>) -> Inner {
    BoxCloneService::new(service_fn(move |request: Request<Body>| {
        let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
        let gate = Arc::clone(&gate);
        async move {
            let path = request.uri().path().to_owned();
            let mut response = Response::builder();
            let status = match path.as_str() {
                p if p.starts_with("/fail") && n == 1 => StatusCode::INTERNAL_SERVER_ERROR,
                p if p.starts_with("/status/") => StatusCode::from_u16(p[8..].parse().unwrap()).unwrap(),
                "/own-hint" => {
                    response = response.header("stripe-should-retry", "true");
                    StatusCode::INTERNAL_SERVER_ERROR
                }
                "/big" => return Ok(Response::new(Body::from(vec![b'x'; 5000]))),
                "/slow" => {
                    gate.acquire().await.unwrap().forget();
                    StatusCode::CREATED
                }
                _ => StatusCode::CREATED,
            };
            Ok(response.status(status).body(Body::from(format!("execution {n}\n"))).unwrap())
        }
    }))
}

fn inner(executions: Arc<AtomicUsize>) -> Inner {
    gated(executions, Arc::new(tokio::sync::Semaphore::new(0)))
}

fn key() -> Vec<KeySource> {
    vec!["header:x-delivery".parse().unwrap()]
}

fn delivery(path: &str, id: Option<&str>, signature: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(id) = id {
        request = request.header("x-delivery", id);
    }
    if let Some(signature) = signature {
        request = request.header("x-signature", signature);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

async fn keys(store: &Counted, prefix: &str) -> Vec<String> {
    store.inner().list(prefix, None, 1000).await.unwrap().items.into_iter().map(|i| i.key).collect()
}

#[tokio::test]
async fn a_refused_signature_reads_no_key_and_touches_neither_store_nor_service() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new(), |_| None));
    let executions = Arc::new(AtomicUsize::new(0));
    let route = RoutePolicy::new("signed", "/hooks", key()).unwrap().verifier(Arc::new(HeaderCheck));
    let app = IdempotencyLayer::from_shared(Arc::clone(&store))
        .max_request_body(64)
        .route(route)
        .layer(inner(Arc::clone(&executions)));
    for (signature, id) in [(None, Some("d1")), (Some("bad"), Some("d1")), (Some("bad"), None)] {
        let answer = app.clone().oneshot(delivery("/hooks/x", id, signature, "{}")).await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{signature:?} {id:?}");
        assert_eq!(answer.headers()["www-authenticate"], "Webhook-Signature scheme=\"test\"");
    }
    // The body limit applies before the check.
    let big = app.clone().oneshot(delivery("/hooks/x", Some("d1"), Some("good"), &"x".repeat(65))).await.unwrap();
    assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(store.operations(), 0, "no store operation for a refused request");
    assert_eq!(executions.load(Ordering::SeqCst), 0);
    let good = app.clone().oneshot(delivery("/hooks/x", Some("d1"), Some("good"), "{}")).await.unwrap();
    assert_eq!(good.status(), StatusCode::CREATED);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // Signed but without the key source: refused, or passed through when the route says so.
    let keyless = app.clone().oneshot(delivery("/hooks/x", None, Some("good"), "{}")).await.unwrap();
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_lowercase_method_is_covered_like_its_uppercase_form() {
    // Method names are case-sensitive, but frameworks such as Werkzeug upper-case them: an unsigned `post`
    // passed through would reach the POST handler (break-it review).
    let store = Arc::new(FaultyStore::new(MemoryStore::new(), |_| None));
    let executions = Arc::new(AtomicUsize::new(0));
    let route = RoutePolicy::new("signed", "/hooks", key()).unwrap().verifier(Arc::new(HeaderCheck));
    let app = IdempotencyLayer::from_shared(Arc::clone(&store)).route(route).layer(inner(Arc::clone(&executions)));
    let lower = |signature: Option<&str>| {
        let mut request = delivery("/hooks", Some("d1"), signature, "{}");
        *request.method_mut() = http::Method::from_bytes(b"post").unwrap();
        request
    };
    assert_eq!(app.clone().oneshot(lower(None)).await.unwrap().status(), StatusCode::UNAUTHORIZED);
    assert_eq!(executions.load(Ordering::SeqCst), 0);
    assert_eq!(app.clone().oneshot(lower(Some("good"))).await.unwrap().status(), StatusCode::CREATED);
    let upper = app.clone().oneshot(delivery("/hooks", Some("d1"), Some("good"), "{}")).await.unwrap();
    assert_eq!(upper.status(), StatusCode::CREATED);
    assert_eq!(executions.load(Ordering::SeqCst), 1, "one delivery, whatever the method's case");
}

#[tokio::test]
async fn a_signed_route_checks_every_method_and_scopes_without_credential_headers() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new(), |_| None));
    let executions = Arc::new(AtomicUsize::new(0));
    let route = RoutePolicy::new("signed", "/hooks", key()).unwrap().verifier(Arc::new(HeaderCheck));
    let app = IdempotencyLayer::from_shared(Arc::clone(&store)).route(route).layer(inner(Arc::clone(&executions)));
    // An unsigned PUT or DELETE is refused like an unsigned POST (review finding: it reached the handler).
    for method in [http::Method::PUT, http::Method::DELETE, http::Method::GET] {
        let mut request = delivery("/hooks", Some("d1"), None, "{}");
        *request.method_mut() = method.clone();
        assert_eq!(app.clone().oneshot(request).await.unwrap().status(), StatusCode::UNAUTHORIZED, "{method}");
    }
    assert_eq!(executions.load(Ordering::SeqCst), 0);
    // A signed PUT passes, unkeyed: only deliveries (the covered methods) are recorded.
    let mut put = delivery("/hooks", Some("d1"), Some("good"), "{}");
    *put.method_mut() = http::Method::PUT;
    assert_eq!(app.clone().oneshot(put).await.unwrap().status(), StatusCode::CREATED);
    assert!(keys(&store, "idempotency/").await.is_empty());
    // No scheme signs credential headers: a delivery resent with made-up ones is the same delivery (break-it
    // review: one delivery sent 6 times with new `X-Api-Key`s executed 5 times).
    for credential in [None, Some(("x-api-key", "made-up-1")), Some(("authorization", "Bearer made-up-2"))] {
        let mut request = delivery("/hooks", Some("d2"), Some("good"), "{}");
        if let Some((name, value)) = credential {
            request.headers_mut().insert(name, http::HeaderValue::from_static(value));
        }
        assert_eq!(app.clone().oneshot(request).await.unwrap().status(), StatusCode::CREATED);
    }
    assert_eq!(executions.load(Ordering::SeqCst), 2, "the PUT and one execution of d2");
    assert_eq!(keys(&store, "idempotency/route/signed/").await.len(), 1);
}

#[tokio::test]
async fn one_id_on_three_routes_and_two_paths_of_one_is_four_deliveries() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new(), |_| None));
    let executions = Arc::new(AtomicUsize::new(0));
    let app = IdempotencyLayer::from_shared(Arc::clone(&store))
        .route(RoutePolicy::new("a", "/a", key()).unwrap())
        .route(RoutePolicy::new("a-deeper", "/a/deeper", key()).unwrap().missing_key(MissingKey::Pass))
        .route(RoutePolicy::new("b", "/b", key()).unwrap())
        .layer(inner(Arc::clone(&executions)));
    for _ in 0..2 {
        for path in ["/a", "/a/other", "/b", "/a/deeper/x"] {
            let answer = app.clone().oneshot(delivery(path, Some("evt_1"), None, "{}")).await.unwrap();
            assert_eq!(answer.status(), StatusCode::CREATED, "{path}");
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 4, "each path once");
    assert_eq!(keys(&store, "idempotency/route/a/").await.len(), 2, "two paths below /a");
    assert_eq!(keys(&store, "idempotency/route/a-deeper/").await.len(), 1, "the longer route wins");
    assert_eq!(keys(&store, "idempotency/route/b/").await.len(), 1);
    // A pass route forwards a keyless request unprotected; a path no route covers keeps Idempotency-Key.
    let keyless = app.clone().oneshot(delivery("/a/deeper/x", None, None, "{}")).await.unwrap();
    assert_eq!(keyless.status(), StatusCode::CREATED);
    let plain = Request::post("/orders").header("idempotency-key", "evt_1").body(Body::from("{}")).unwrap();
    assert_eq!(app.clone().oneshot(plain).await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(keys(&store, "idempotency/anonymous/").await, ["idempotency/anonymous/evt_1"]);
    assert_eq!(executions.load(Ordering::SeqCst), 6);
    // The same delivery under other spellings of its path is replayed, not executed again (break-it review: a
    // genuine delivery resent to `/a/Other`, `/a/x/../other` or `/a/%6fther` executed once per spelling).
    for path in ["/a/Other", "/a/x/../other", "/a/%6fther", "/a//other", "/a/other/"] {
        let answer = app.clone().oneshot(delivery(path, Some("evt_1"), None, "{}")).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED, "{path}");
        assert!(answer.headers().contains_key("idempotent-replayed"), "{path}: not a replay");
    }
    assert_eq!(executions.load(Ordering::SeqCst), 6, "no spelling executed again");
}

#[tokio::test]
async fn a_release_route_stores_only_2xx() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new(), |_| None));
    let executions = Arc::new(AtomicUsize::new(0));
    let app = IdempotencyLayer::from_shared(Arc::clone(&store))
        .route(RoutePolicy::new("release", "/fail", key()).unwrap().on_failure(OnFailure::Release))
        .layer(inner(Arc::clone(&executions)));
    let send = || app.clone().oneshot(delivery("/fail", Some("d1"), None, "{}"));
    assert_eq!(send().await.unwrap().status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(keys(&store, "idempotency/").await.is_empty(), "the failure is not stored");
    assert_eq!(send().await.unwrap().status(), StatusCode::CREATED);
    let replay = send().await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

/// A delivery id sent again with another body is refused as what it is: no Idempotency-Key header was sent, so
/// the 422 names the delivery id (`webhook-delivery-reused`), in the same RFC 9457 shape, and nothing executes.
#[tokio::test]
async fn a_changed_delivery_under_the_same_id_is_a_422_that_names_the_delivery_id() {
    let executions = Arc::new(AtomicUsize::new(0));
    let app = IdempotencyLayer::new(MemoryStore::new())
        .route(RoutePolicy::new("hooks", "/hooks", key()).unwrap())
        .layer(inner(Arc::clone(&executions)));
    let first = app.clone().oneshot(delivery("/hooks", Some("evt_1"), None, r#"{"amount":5}"#)).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let changed = app.clone().oneshot(delivery("/hooks", Some("evt_1"), None, r#"{"amount":6}"#)).await.unwrap();
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.headers()["content-type"], "application/problem+json");
    let body = changed.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["status"], 422);
    assert_eq!(json["type"], "urn:idem:problem:webhook-delivery-reused");
    assert_eq!(json["title"], "Webhook delivery id reused with a different body");
    assert!(!json["detail"].as_str().unwrap().contains("Idempotency-Key"), "{json}");
    assert_eq!(executions.load(Ordering::SeqCst), 1, "the changed delivery is not executed");
}

/// The retry hints (`Stripe-Should-Retry`, `x-should-retry`) of `answer`, which must agree.
fn hint_of(answer: &Response<Body>) -> Option<String> {
    let stripe = answer.headers().get("stripe-should-retry").map(|v| v.to_str().unwrap().to_owned());
    let stainless = answer.headers().get("x-should-retry").map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(stripe, stainless, "both SDKs get the same hint");
    stripe
}

#[tokio::test]
async fn retry_hints_say_whether_a_retry_could_get_another_answer() {
    let executions = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let app = IdempotencyLayer::new(MemoryStore::new())
        .route(RoutePolicy::new("hooks", "/fail", key()).unwrap().on_failure(OnFailure::Release))
        .route(RoutePolicy::new("signed", "/hooks", key()).unwrap().verifier(Arc::new(HeaderCheck)))
        .layer(gated(Arc::clone(&executions), Arc::clone(&gate)));
    let keyed = |path: &str, key: &str, body: &str| {
        let request = Request::post(path).header("idempotency-key", key).header("content-type", "application/json");
        app.clone().oneshot(request.body(Body::from(body.to_owned())).unwrap())
    };
    let hint = |answer: Response<Body>| (answer.status().as_u16(), hint_of(&answer));
    let no = Some("false".to_owned());
    let yes = Some("true".to_owned());
    let route = |id: &str| app.clone().oneshot(delivery("/fail", Some(id), None, "{}"));
    // Released on a release route (the first execution of `/fail` answers 500).
    assert_eq!(hint(route("d1").await.unwrap()), (500, yes.clone()));
    // A 2xx, first or replayed, carries none.
    assert_eq!(hint(route("d1").await.unwrap()), (201, None));
    assert_eq!(hint(route("d1").await.unwrap()), (201, None));
    // A stored error: its first answer and its replays would be the same on every retry.
    assert_eq!(hint(keyed("/status/500", "k1", "{}").await.unwrap()), (500, no.clone()));
    assert_eq!(hint(keyed("/status/500", "k1", "{}").await.unwrap()), (500, no.clone()));
    // Released: 429 and 503 everywhere.
    assert_eq!(hint(keyed("/status/429", "k2", "{}").await.unwrap()), (429, yes.clone()));
    assert_eq!(hint(keyed("/status/503", "k3", "{}").await.unwrap()), (503, yes.clone()));
    // The layer's own refusals: 422, 400, 401 never change on a retry; 409 in flight does.
    assert_eq!(hint(keyed("/status/500", "k1", r#"{"other":1}"#).await.unwrap()), (422, no.clone()));
    let malformed = Request::post("/orders").header("idempotency-key", "two words").body(Body::empty()).unwrap();
    assert_eq!(hint(app.clone().oneshot(malformed).await.unwrap()), (400, no.clone()));
    let unsigned = app.clone().oneshot(delivery("/hooks", Some("d2"), None, "{}")).await.unwrap();
    assert_eq!(hint(unsigned), (401, no.clone()));
    let first = tokio::spawn(keyed("/slow", "k4", "{}"));
    while executions.load(Ordering::SeqCst) < 6 {
        tokio::task::yield_now().await;
    }
    assert_eq!(hint(keyed("/slow", "k4", "{}").await.unwrap()), (409, yes.clone()));
    gate.add_permits(1);
    assert_eq!(hint(first.await.unwrap().unwrap()), (201, None));
    // The upstream's own hint is kept, and no other added.
    let own = keyed("/own-hint", "k5", "{}").await.unwrap();
    assert_eq!(own.headers()["stripe-should-retry"], "true");
    assert!(own.headers().get("x-should-retry").is_none());
    assert_eq!(executions.load(Ordering::SeqCst), 7);
}

#[tokio::test]
async fn a_2xx_too_large_to_store_is_replayed_as_its_status_on_a_release_route() {
    let executions = Arc::new(AtomicUsize::new(0));
    let app = IdempotencyLayer::new(MemoryStore::new())
        .max_stored_body(1000)
        .route(RoutePolicy::new("big", "/big", key()).unwrap().on_failure(OnFailure::Release))
        .layer(inner(Arc::clone(&executions)));
    let send = || app.clone().oneshot(delivery("/big", Some("d1"), None, "{}"));
    let first = send().await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes().len(), 5000, "the first caller gets it whole");
    let again = send().await.unwrap();
    assert_eq!(again.status(), StatusCode::OK, "not 409, which a sender would deliver again for days");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(again.into_body().collect().await.unwrap().to_bytes().is_empty());
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// An unknown outcome an operator resolved (`idem admin resolve`: the record rewritten by
/// `Record::resolved`) answers a retry 409 `outcome-resolved` with the note and retry hints `false`; on a
/// release route (a webhook sender, which reads only the status and would deliver a 409 again for days) 200.
/// Neither executes again.
#[tokio::test]
async fn a_resolved_unknown_outcome_is_409_or_200_on_a_release_route_and_never_executed() {
    let executions = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&executions);
    // Every execution's answer is marked as an unknown outcome (as the proxy marks a timeout after sending).
    let unknown: Inner = BoxCloneService::new(service_fn(move |_request: Request<Body>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut response = Response::builder().status(StatusCode::BAD_GATEWAY).body(Body::empty()).unwrap();
            response.extensions_mut().insert(idem_tower::UpstreamFailure::OutcomeUnknown { reason: "reset".into() });
            Ok(response)
        }
    }));
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .replay_cache(1 << 20)
        .route(RoutePolicy::new("hook", "/hook", key()).unwrap().on_failure(OnFailure::Release));
    let app = layer.clone().layer(unknown);
    // Keyed by Idempotency-Key outside the route, by x-delivery on it.
    let request = |path: &str| {
        let mut request = delivery(path, Some("d1"), None, "{}");
        request.headers_mut().insert("idempotency-key", http::HeaderValue::from_static("d1"));
        request
    };
    for path in ["/charge", "/hook"] {
        let send = || app.clone().oneshot(request(path));
        assert_eq!(send().await.unwrap().status(), StatusCode::BAD_GATEWAY, "{path}: the first caller");
        assert_eq!(send().await.unwrap().status(), StatusCode::BAD_GATEWAY, "{path}: unknown, not executed");
    }
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    for item in store.list("", None, 100).await.unwrap().items {
        let value = store.get(&item.key).await.unwrap().unwrap();
        let record = idem_core::record::Record::decode(value.value()).unwrap();
        let resolved = record.resolved("ops", "ch_1 exists <b>", 1).expect("an unknown outcome");
        store.put(&item.key, resolved.encode(), idem_store::Precondition::Any, idem_store::Ttl::Keep).await.unwrap();
        layer.invalidate(&item.key);
    }
    let charge = app.clone().oneshot(request("/charge")).await.unwrap();
    assert_eq!(charge.status(), StatusCode::CONFLICT);
    assert_eq!(hint_of(&charge).as_deref(), Some("false"));
    let body = String::from_utf8(charge.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(body.contains("urn:idem:problem:outcome-resolved") && body.contains("ch_1 exists <b>"), "{body}");
    let hook = app.clone().oneshot(request("/hook")).await.unwrap();
    assert_eq!(hook.status(), StatusCode::OK, "a webhook sender is acknowledged");
    assert_eq!(executions.load(Ordering::SeqCst), 2, "0 executions after the resolution");
}
