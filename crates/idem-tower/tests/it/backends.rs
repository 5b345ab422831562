//! The same forced interleavings on every backend (SQLite; PostgreSQL and Redis from `IDEM_TEST_POSTGRES_URL` /
//! `IDEM_TEST_REDIS_URL`, skipped with a printed reason when unset unless `IDEM_TEST_REQUIRE_BACKENDS` is set):
//! a request that executed but whose completion write the store keeps refusing for several leases. The record
//! must stay in flight all that time: a request with another body under the key is refused (422) and never
//! executes, and a retry with the same body waits (409) instead of taking the key over, since the holder keeps
//! renewing while it retries its completion.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use idem_backends::{AnyStore, StoreUrl};
use idem_core::record::Record;
use idem_store::testing::{Fault, FaultyStore};
use idem_store::{Limits, Precondition, Store};
use idem_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::upstream;

const LEASE: Duration = Duration::from_secs(1);

/// The backend `var` names, or `None` (printed) when unset; unset under `IDEM_TEST_REQUIRE_BACKENDS` fails.
async fn open(var: &str) -> Option<AnyStore> {
    let Ok(url) = std::env::var(var) else {
        assert!(std::env::var_os("IDEM_TEST_REQUIRE_BACKENDS").is_none(), "{var} is unset");
        eprintln!("skipped: {var} is unset");
        return None;
    };
    Some(AnyStore::open(&StoreUrl::parse(&url).unwrap(), "idem_tower_test", Limits::default()).await.unwrap())
}

fn order(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap()
}

fn problem_type<B>(response: &Response<B>) -> String {
    format!("{} {:?}", response.status(), response.headers().get("content-type"))
}

/// Holder A executes under `key`; every completion write (a put of a finished record) fails while `failing`
/// is set, for three leases. Meanwhile the key with another body gets 422 and the same body 409; once the
/// store takes the completion, the retry replays A's answer. One execution in all.
async fn a_completion_the_store_refuses_keeps_the_key<St: Store + Clone>(store: St) {
    let key = format!("k-{:016x}", rand::random::<u64>());
    let failing = Arc::new(AtomicBool::new(true));
    let fail = Arc::clone(&failing);
    let faulty = FaultyStore::new(store.clone(), move |op| {
        let completion = op.value.is_some_and(|v| matches!(Record::decode(v), Ok(Record::Finished { .. })));
        (completion && fail.load(Ordering::SeqCst)).then_some(Fault::Fail)
    });
    let counts = Arc::new(upstream::Counts::default());
    let app = IdempotencyLayer::new(faulty).lease(LEASE).layer(upstream::router(Arc::clone(&counts)));
    // A is answered after the layer's short wait although its outcome is not stored yet.
    let first = app.clone().oneshot(order(&key, r#"{"sku":"a"}"#)).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(first.headers()["location"], "/orders/1");
    // For three leases more: every retry waits, and a reused key is refused, never executed.
    let until = tokio::time::Instant::now() + LEASE * 3;
    while tokio::time::Instant::now() < until {
        let reused = app.clone().oneshot(order(&key, r#"{"sku":"b"}"#)).await.unwrap();
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY, "{}", problem_type(&reused));
        let retry = app.clone().oneshot(order(&key, r#"{"sku":"a"}"#)).await.unwrap();
        assert_eq!(retry.status(), StatusCode::CONFLICT, "the holder is alive: no takeover");
        assert_eq!(counts.executions(), 1, "a request under the key executed again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    failing.store(false, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let replay = loop {
        let retry = app.clone().oneshot(order(&key, r#"{"sku":"a"}"#)).await.unwrap();
        if retry.status() != StatusCode::CONFLICT {
            break retry;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the outcome was never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["location"], "/orders/1");
    let reused = app.clone().oneshot(order(&key, r#"{"sku":"b"}"#)).await.unwrap();
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counts.executions(), 1);
    let _ = store.delete(&format!("idempotency/anonymous/{key}"), Precondition::Any).await;
}

/// Holder A executes under `key` and its process dies with the record in flight (its renewals are never
/// answered again). A request with another body is refused (422) before and after A's lease lapses; the same
/// body waits a whole lease of observation (409), then takes the key over and executes.
async fn a_dead_holder_is_taken_over_only_by_the_same_request<St: Store + Clone>(store: St) {
    let key = format!("k-{:016x}", rand::random::<u64>());
    let dead = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&dead);
    let holder = FaultyStore::new(store.clone(), move |_| d.load(Ordering::SeqCst).then_some(Fault::Hang));
    let counts = Arc::new(upstream::Counts::default());
    let a = IdempotencyLayer::new(holder).lease(LEASE).layer(upstream::router(Arc::clone(&counts)));
    // Another process on the same store.
    let b = IdempotencyLayer::new(store.clone()).lease(LEASE).layer(upstream::router(Arc::clone(&counts)));
    let first = tokio::spawn(
        a.oneshot(Request::post("/slow/5000").header("idempotency-key", &key).body(Body::from("a")).unwrap()),
    );
    while counts.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    dead.store(true, Ordering::SeqCst);
    let slow = |body: &'static str| {
        Request::post("/slow/5000").header("idempotency-key", &key).body(Body::from(body)).unwrap()
    };
    let started = tokio::time::Instant::now();
    let mut conflicts = 0;
    loop {
        let reused = b.clone().oneshot(slow("b")).await.unwrap();
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY, "another body is never taken over");
        assert_eq!(counts.executions(), 1);
        let retry = tokio::spawn(b.clone().oneshot(slow("a")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        if counts.executions() == 2 {
            break;
        }
        assert_eq!(retry.await.unwrap().unwrap().status(), StatusCode::CONFLICT);
        conflicts += 1;
        assert!(started.elapsed() < Duration::from_secs(10), "the dead holder was never taken over");
    }
    // Not before a whole lease of the observer's own watching (plus the holder's last renewal interval).
    assert!(started.elapsed() >= LEASE, "taken over after {:?}", started.elapsed());
    assert!(conflicts >= 5, "{conflicts} retries were told to wait");
    first.abort();
    let reused = b.clone().oneshot(slow("b")).await.unwrap();
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counts.executions(), 2);
    let _ = store.delete(&format!("idempotency/anonymous/{key}"), Precondition::Any).await;
}

fn sqlite() -> (tempfile::TempDir, idem_sqlite::SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_sqlite::SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    (dir, store)
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_a_refused_completion_keeps_the_key_from_another_body() {
    let (_dir, store) = sqlite();
    a_completion_the_store_refuses_keeps_the_key(store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_refused_completion_keeps_the_key_from_another_body() {
    let Some(store) = open("IDEM_TEST_POSTGRES_URL").await else { return };
    a_completion_the_store_refuses_keeps_the_key(store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_refused_completion_keeps_the_key_from_another_body() {
    let Some(store) = open("IDEM_TEST_REDIS_URL").await else { return };
    a_completion_the_store_refuses_keeps_the_key(store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_a_dead_holder_is_taken_over_only_by_the_same_request() {
    let (_dir, store) = sqlite();
    a_dead_holder_is_taken_over_only_by_the_same_request(store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_dead_holder_is_taken_over_only_by_the_same_request() {
    let Some(store) = open("IDEM_TEST_POSTGRES_URL").await else { return };
    a_dead_holder_is_taken_over_only_by_the_same_request(store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_a_dead_holder_is_taken_over_only_by_the_same_request() {
    let Some(store) = open("IDEM_TEST_REDIS_URL").await else { return };
    a_dead_holder_is_taken_over_only_by_the_same_request(store).await;
}
