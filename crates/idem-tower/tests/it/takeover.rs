//! Lease takeover and fencing with the layer on an axum service over a real SQLite store: a holder that
//! cannot renew loses its lease to a retry, and its late completion is refused by the fence.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::Record;
use idem_sqlite::SqliteStore;
use idem_store::{
    CounterOutcome, Error, Generation, Limits, Page, Precondition, SetChange, SetOutcome, Store, Ttl, Versioned,
    Written,
};
use idem_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::upstream;

/// A real store whose lease renewals (fenced puts of an in-progress record) hang while `stall` is set, the
/// way they would behind a network partition or a paused process.
struct StallRenewals {
    inner: SqliteStore,
    stall: Arc<AtomicBool>,
}

impl Store for StallRenewals {
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        let renewal = matches!(precondition, Precondition::Generation(_))
            && matches!(Record::decode(&value), Ok(Record::InProgress { .. }));
        while renewal && self.stall.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.inner.put(key, value, precondition, ttl).await
    }
    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        self.inner.delete(key, precondition).await
    }
    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        self.inner.list(prefix, cursor, limit).await
    }
    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        self.inner.set_change(key, change).await
    }
    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        self.inner.counter_add(key, delta, dedupe_id).await
    }
}

/// A real store whose completion writes (puts of a finished record) fail while `failing` is set, the way they
/// would while the store is unreachable.
struct FailCompletions {
    inner: SqliteStore,
    failing: Arc<AtomicBool>,
}

impl Store for FailCompletions {
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        if self.failing.load(Ordering::SeqCst) && matches!(Record::decode(&value), Ok(Record::Finished { .. })) {
            return Err(Error::unavailable("store unreachable (test)"));
        }
        self.inner.put(key, value, precondition, ttl).await
    }
    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        self.inner.delete(key, precondition).await
    }
    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        self.inner.list(prefix, cursor, limit).await
    }
    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        self.inner.set_change(key, change).await
    }
    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        self.inner.counter_add(key, delta, dedupe_id).await
    }
}

fn request(path: &str) -> Request<Body> {
    Request::post(path).header("idempotency-key", "fenced").body(Body::empty()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_is_taken_over_and_the_late_completion_is_fenced_off() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    let stall = Arc::new(AtomicBool::new(true));
    let store = StallRenewals { inner: sqlite, stall: Arc::clone(&stall) };
    let counts = Arc::new(upstream::Counts::default());
    let layer = IdempotencyLayer::new(store).lease(Duration::from_secs(1));
    let app = layer.layer(upstream::router(Arc::clone(&counts)));

    // A: runs 3 s under a 1 s lease it cannot renew.
    let first = tokio::spawn(app.clone().oneshot(request("/slow/3000")));
    while counts.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // While the lease stands, a retry is told to wait.
    let busy = app.clone().oneshot(request("/slow/3000")).await.unwrap();
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    // Once the store expired the lease, the next retry takes the key over and executes (B).
    let started = Instant::now();
    let second = loop {
        assert!(started.elapsed() < Duration::from_secs(10), "the lease never lapsed");
        let attempt = tokio::spawn(app.clone().oneshot(request("/slow/3000")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        if counts.executions() == 2 {
            // Only A was cut off; B renews normally (A's hung renewal now fails its fence).
            stall.store(false, Ordering::SeqCst);
            break attempt;
        }
        assert_eq!(attempt.await.unwrap().unwrap().status(), StatusCode::CONFLICT);
    };
    // A finishes first; its completion must not overwrite B's claim.
    let a = first.await.unwrap().unwrap();
    assert_eq!(a.status(), StatusCode::CREATED);
    assert_eq!(a.headers()["location"], "/orders/1", "A's caller still gets A's answer");
    let b = second.await.unwrap().unwrap();
    assert_eq!(b.headers()["location"], "/orders/2");
    // The record is B's: a retry replays /orders/2, and nothing executes a third time.
    let replay = app.clone().oneshot(request("/slow/3000")).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["location"], "/orders/2", "A's late completion was refused by the fence");
    let body = replay.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "slow execution 2\n");
    assert_eq!(counts.executions(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_renewed_lease_outlives_its_length_and_a_retry_waits_instead_of_taking_over() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    let counts = Arc::new(upstream::Counts::default());
    let app = IdempotencyLayer::new(sqlite)
        .lease(Duration::from_secs(1))
        .in_flight(idem_tower::InFlight::Wait(Duration::from_secs(10)))
        .layer(upstream::router(Arc::clone(&counts)));
    let first = tokio::spawn(app.clone().oneshot(request("/slow/2500")));
    while counts.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Well past the 1 s lease: heartbeats kept it, so this retry waits for the first and replays it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waited = app.clone().oneshot(request("/slow/2500")).await.unwrap();
    assert_eq!(waited.status(), StatusCode::CREATED);
    assert_eq!(waited.headers()["idempotent-replayed"], "true");
    assert_eq!(first.await.unwrap().unwrap().headers()["location"], "/orders/1");
    assert_eq!(counts.executions(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outcome_the_store_refused_for_a_while_is_still_recorded_once_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    let observer = sqlite.clone();
    let failing = Arc::new(AtomicBool::new(true));
    let store = FailCompletions { inner: sqlite, failing: Arc::clone(&failing) };
    let counts = Arc::new(upstream::Counts::default());
    let app = IdempotencyLayer::new(store).lease(Duration::from_secs(1)).layer(upstream::router(Arc::clone(&counts)));
    // The caller is answered (after a short wait) although its outcome is not stored yet.
    let first = app.clone().oneshot(request("/orders")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // Well past the 1 s lease and the old 3 s give-up, the store still refusing.
    tokio::time::sleep(Duration::from_millis(4000)).await;
    failing.store(false, Ordering::SeqCst);
    let started = Instant::now();
    let key = "idempotency/anonymous/fenced";
    loop {
        let stored = observer.get(key).await.unwrap().map(|v| Record::decode(v.value()).unwrap());
        if matches!(stored, Some(Record::Finished { .. })) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the outcome never got recorded: {stored:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retry = app.clone().oneshot(request("/orders")).await.unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["location"], "/orders/1");
    assert_eq!(counts.executions(), 1);
}
