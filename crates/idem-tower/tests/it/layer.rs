//! The layer's semantics in process: `IdempotencyLayer` over a `MemoryStore` around a `service_fn` that counts
//! its executions, driven with `oneshot` (tokio's paused clock where a lease or a timeout is involved). Each
//! case asserts the status, the problem type and how many times the inner service ran.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use idem_store::{MemoryStore, Precondition, Store};
use idem_tower::Body;
use idem_tower::{Idempotency, IdempotencyLayer, InFlight, InvalidatingStore, UnknownOutcome, UpstreamFailure};
use tokio::sync::Semaphore;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};

type Inner = BoxCloneService<Request<Body>, Response<Body>, std::io::Error>;
type App = Idempotency<Inner, MemoryStore>;

/// The inner service and what the tests observe and steer of it.
///
/// Paths: `/orders` answers 201 with `Location: /orders/N` and the body `order N: REQUEST BODY` (N counts
/// executions), or 502 marked [`UpstreamFailure::NotSent`] while `down` is set; `/slow` does the same once
/// `gate` gives it a permit; `/hang` never answers; `/big` answers 200 with 5000 bytes; `/error` fails; `/panic` panics.
struct Harness {
    executions: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    down: Arc<AtomicBool>,
}

impl Harness {
    fn new() -> Self {
        Self {
            executions: Arc::new(AtomicUsize::new(0)),
            gate: Arc::new(Semaphore::new(0)),
            down: Arc::new(AtomicBool::new(false)),
        }
    }

    fn app(&self, layer: IdempotencyLayer<MemoryStore>) -> App {
        let (executions, gate, down) = (Arc::clone(&self.executions), Arc::clone(&self.gate), Arc::clone(&self.down));
        let inner = service_fn(move |request: Request<Body>| {
            let (executions, gate, down) = (Arc::clone(&executions), Arc::clone(&gate), Arc::clone(&down));
            async move {
                let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
                let path = request.uri().path().to_owned();
                let body = request.into_body().collect().await.unwrap().to_bytes();
                match path.as_str() {
                    "/slow" => gate.acquire().await.unwrap().forget(),
                    "/hang" => std::future::pending::<()>().await,
                    "/big" => return Ok(Response::new(Body::from(vec![b'x'; 5000]))),
                    "/error" => return Err(std::io::Error::other("the inner service failed")),
                    "/panic" => panic!("the inner service panicked on purpose"),
                    _ => {}
                }
                if down.load(Ordering::SeqCst) {
                    let mut response = Response::new(Body::from("upstream unreachable\n"));
                    *response.status_mut() = StatusCode::BAD_GATEWAY;
                    response.extensions_mut().insert(UpstreamFailure::NotSent);
                    return Ok(response);
                }
                let text = format!("order {n}: {}\n", String::from_utf8_lossy(&body));
                Ok(Response::builder()
                    .status(StatusCode::CREATED)
                    .header("location", format!("/orders/{n}"))
                    .header("content-type", "text/plain")
                    .header("set-cookie", "session=secret")
                    .body(Body::from(text))
                    .unwrap())
            }
        });
        layer.layer(BoxCloneService::new(inner))
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    /// Waits (on the test's clock) until the inner service has been entered `n` times.
    async fn started(&self, n: usize) {
        while self.executions() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new())
}

fn request(path: &str, key: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(app: &App, path: &str, key: &str, body: &str) -> Response<Body> {
    app.clone().oneshot(request(path, key, body)).await.unwrap()
}

async fn text(response: Response<Body>) -> String {
    String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

/// The status, problem type and detail of a problem+json answer.
async fn problem(response: Response<Body>) -> (StatusCode, String, String) {
    let status = response.status();
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value = serde_json::from_str(&text(response).await).unwrap();
    assert_eq!(body["status"], status.as_u16());
    (status, body["type"].as_str().unwrap().to_owned(), body["detail"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_finished_request_is_replayed_with_its_status_headers_and_body() {
    let h = Harness::new();
    let app = h.app(layer());
    let first = send(&app, "/orders", "k", r#"{"item":1}"#).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(first.headers()["location"], "/orders/1");
    assert_eq!(first.headers()["set-cookie"], "session=secret");
    assert_eq!(text(first).await, "order 1: {\"item\":1}\n");

    let retry = send(&app, "/orders", "k", r#"{"item":1}"#).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["location"], "/orders/1");
    assert_eq!(retry.headers()["content-type"], "text/plain");
    assert!(retry.headers().get("set-cookie").is_none(), "cookies are never replayed");
    assert_eq!(text(retry).await, "order 1: {\"item\":1}\n");
    assert_eq!(h.executions(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_duplicate_while_the_first_runs_gets_409_with_retry_after() {
    let h = Harness::new();
    let app = h.app(layer());
    let first = tokio::spawn(app.clone().oneshot(request("/slow", "k", "{}")));
    h.started(1).await;
    // Past a lease renewal (every third of the 10 s lease): the key is still held.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let busy = send(&app, "/slow", "k", "{}").await;
    assert_eq!(busy.headers()["retry-after"], "1");
    let (status, kind, _) = problem(busy).await;
    assert_eq!((status, kind.as_str()), (StatusCode::CONFLICT, "urn:idem:problem:request-in-flight"));
    assert_eq!(h.executions(), 1, "the duplicate did not execute");

    h.gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let after = send(&app, "/slow", "k", "{}").await;
    assert_eq!(after.status(), StatusCode::CREATED);
    assert_eq!(after.headers()["idempotent-replayed"], "true");
    assert_eq!(h.executions(), 1);
}

#[tokio::test]
async fn the_same_key_with_another_request_gets_422_without_echoing_the_first() {
    let h = Harness::new();
    let app = h.app(layer());
    assert_eq!(send(&app, "/orders", "k", r#"{"card":"4242"}"#).await.status(), StatusCode::CREATED);
    for (path, body) in [("/orders", r#"{"card":"5555"}"#), ("/other", r#"{"card":"4242"}"#)] {
        let reused = send(&app, path, "k", body).await;
        assert!(reused.headers().get("idempotent-replayed").is_none());
        assert_eq!(reused.headers()["content-type"], "application/problem+json");
        let json: serde_json::Value = serde_json::from_str(&text(reused).await).unwrap();
        assert_eq!(
            (&json["status"], &json["type"], &json["title"]),
            (&422.into(), &"urn:idem:problem:idempotency-key-reused".into(), &"Idempotency-Key reused".into()),
            "{path} {body}"
        );
        let detail = json["detail"].as_str().unwrap();
        assert!(!detail.contains("4242") && !detail.contains("/orders/1"), "{detail}");
    }
    assert_eq!(h.executions(), 1);
}

#[tokio::test]
async fn a_request_never_sent_releases_the_key_and_the_retry_executes() {
    let h = Harness::new();
    let app = h.app(layer());
    h.down.store(true, Ordering::SeqCst);
    let refused = send(&app, "/orders", "k", "{}").await;
    assert_eq!(refused.status(), StatusCode::BAD_GATEWAY, "the inner service's own answer");
    assert!(refused.headers().get("idempotent-replayed").is_none());
    assert_eq!(text(refused).await, "upstream unreachable\n");

    h.down.store(false, Ordering::SeqCst);
    let retry = send(&app, "/orders", "k", "{}").await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(retry.headers().get("idempotent-replayed").is_none(), "executed, not replayed");
    assert_eq!(retry.headers()["location"], "/orders/2");
    assert_eq!(h.executions(), 2);
    let replay = send(&app, "/orders", "k", "{}").await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["location"], "/orders/2");
    assert_eq!(h.executions(), 2);
}

#[tokio::test]
async fn an_inner_error_is_an_unknown_outcome_never_executed_again() {
    let h = Harness::new();
    let app = h.app(layer());
    let failed = app.clone().oneshot(request("/error", "k", "{}")).await;
    assert_eq!(failed.unwrap_err().to_string(), "the inner service failed", "the caller gets the inner error");
    let (status, kind, _) = problem(send(&app, "/error", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::BAD_GATEWAY, "urn:idem:problem:outcome-unknown"));
    assert_eq!(h.executions(), 1);
}

#[tokio::test]
async fn a_panic_is_an_unknown_outcome_answered_500_and_never_executed_again() {
    let h = Harness::new();
    let app = h.app(layer());
    let (status, kind, detail) = problem(send(&app, "/panic", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::INTERNAL_SERVER_ERROR, "urn:idem:problem:internal"));
    assert!(detail.contains("will not be executed again"), "{detail}");
    assert!(!detail.contains("on purpose"), "the panic message stays in the log: {detail}");
    // Settled, not left in flight: a retry is told the outcome is unknown at once, and never executes.
    let (status, kind, _) = problem(send(&app, "/panic", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::BAD_GATEWAY, "urn:idem:problem:outcome-unknown"));
    assert_eq!(h.executions(), 1);
    // The layer goes on serving.
    assert_eq!(send(&app, "/orders", "k2", "{}").await.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn a_panic_under_release_unknown_releases_the_key() {
    let h = Harness::new();
    let app = h.app(layer().unknown_outcome(UnknownOutcome::Release));
    let (status, _, detail) = problem(send(&app, "/panic", "k", "{}").await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(detail.contains("released"), "{detail}");
    let (status, _, _) = problem(send(&app, "/panic", "k", "{}").await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(h.executions(), 2, "released: the retry executed");
}

#[tokio::test(start_paused = true)]
async fn an_execution_past_its_timeout_is_an_unknown_outcome_never_executed_again() {
    let h = Harness::new();
    let app = h.app(layer().execution_timeout(Duration::from_secs(5)));
    let started = tokio::time::Instant::now();
    let (status, kind, detail) = problem(send(&app, "/hang", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::GATEWAY_TIMEOUT, "urn:idem:problem:outcome-unknown"));
    assert!(detail.contains("no complete answer within 5 s"), "{detail}");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(5) && waited < Duration::from_secs(6), "answered after {waited:?}");

    let (status, kind, _) = problem(send(&app, "/hang", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::BAD_GATEWAY, "urn:idem:problem:outcome-unknown"));
    assert_eq!(h.executions(), 1, "the retry must not execute again");
}

/// Under `UnknownOutcome::Release` the answer must not say the request "will not be executed again": the key
/// was released and the retry does execute again (found by a review of the split layer).
#[tokio::test(start_paused = true)]
async fn a_released_unknown_outcome_says_the_retry_executes_again() {
    let h = Harness::new();
    let app = h.app(layer().execution_timeout(Duration::from_secs(5)).unknown_outcome(UnknownOutcome::Release));
    let (status, kind, detail) = problem(send(&app, "/hang", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::GATEWAY_TIMEOUT, "urn:idem:problem:outcome-unknown"));
    assert!(detail.contains("the key was released, so a retry under it executes again"), "{detail}");
    assert!(!detail.contains("will not be executed again"), "{detail}");
    let (status, kind, _) = problem(send(&app, "/hang", "k", "{}").await).await;
    assert_eq!((status, kind.as_str()), (StatusCode::GATEWAY_TIMEOUT, "urn:idem:problem:outcome-unknown"));
    assert_eq!(h.executions(), 2, "released: the retry executed again");
}

#[tokio::test]
async fn a_request_body_over_the_limit_gets_413_and_never_executes() {
    let h = Harness::new();
    let app = h.app(layer().max_request_body(100));
    let over = "x".repeat(101);
    // Refused on its Content-Length, before reading, and by counting when no length is declared.
    let declared = Request::post("/orders")
        .header("idempotency-key", "k")
        .header("content-length", "101")
        .body(Body::from(over.clone()))
        .unwrap();
    for refused in [app.clone().oneshot(declared).await.unwrap(), send(&app, "/orders", "k", &over).await] {
        let (status, kind, detail) = problem(refused).await;
        assert_eq!((status, kind.as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "urn:idem:problem:request-too-large"));
        assert!(detail.contains("at most 100 bytes"), "{detail}");
    }
    assert_eq!(h.executions(), 0);
    // Nothing was stored under the key: a body at the limit executes.
    assert_eq!(send(&app, "/orders", "k", &"x".repeat(100)).await.status(), StatusCode::CREATED);
    assert_eq!(h.executions(), 1);
}

#[tokio::test]
async fn a_response_over_the_stored_body_limit_reaches_its_caller_and_is_409_on_replay() {
    let h = Harness::new();
    let app = h.app(layer().max_stored_body(1000));
    let first = send(&app, "/big", "k", "{}").await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(text(first).await.len(), 5000, "the first caller gets the whole response");

    let retry = send(&app, "/big", "k", "{}").await;
    assert!(retry.headers().get("retry-after").is_none(), "retrying will not help");
    let (status, kind, detail) = problem(retry).await;
    assert_eq!((status, kind.as_str()), (StatusCode::CONFLICT, "urn:idem:problem:response-not-stored"));
    assert!(detail.contains("(status 200)") && detail.contains("1000-byte"), "{detail}");
    assert_eq!(h.executions(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_hangs_up_mid_execution_does_not_cancel_it_and_the_retry_replays() {
    let h = Harness::new();
    let app = h.app(layer().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = tokio::spawn(app.clone().oneshot(request("/slow", "k", r#"{"n":1}"#)));
    h.started(1).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled(), "the caller hung up before the answer");

    // The execution goes on without its caller; the retry waits for it and replays its response.
    h.gate.add_permits(1);
    let retry = send(&app, "/slow", "k", r#"{"n":1}"#).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(text(retry).await, "order 1: {\"n\":1}\n");
    assert_eq!(h.executions(), 1);
}

/// A record deleted through `InvalidatingStore` (an operator's delete on the admin API) leaves the replay cache
/// too: the retry executes again instead of replaying the deleted record from memory.
#[tokio::test]
async fn a_record_deleted_through_the_invalidating_store_is_not_replayed_from_the_cache() {
    let h = Harness::new();
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone()).replay_cache(1 << 20);
    let admin = InvalidatingStore::new(store.clone(), layer.clone());
    let app = h.app(layer.clone());
    assert_eq!(send(&app, "/orders", "k", "{}").await.status(), StatusCode::CREATED);
    assert_eq!(send(&app, "/orders", "k", "{}").await.headers()["idempotent-replayed"], "true");
    assert_eq!(h.executions(), 1);
    let records = store.list(layer.record_key_prefix(), None, 10).await.unwrap();
    assert_eq!(records.items.len(), 1, "{records:?}");
    admin.delete(&records.items[0].key, Precondition::Any).await.unwrap();
    let again = send(&app, "/orders", "k", "{}").await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert_eq!(h.executions(), 2, "executed again, not replayed from the cache");
}
