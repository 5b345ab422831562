//! Lease takeover and fencing with the layer on an axum service over a real SQLite store: a holder that
//! cannot renew loses its lease to a retry, and its late completion is refused by the fence.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::record::Record;
use idem_sqlite::SqliteStore;
use idem_store::testing::{Fault, FaultyStore};
use idem_store::{Limits, Precondition, Store};
use idem_tower::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::upstream;

/// A real store whose lease renewals by the first holder (fenced puts of the in-progress record it claimed) are
/// never answered while `stall` is set, the way they would not be behind a network partition or a paused store.
/// A takeover (a fenced put of another claim's record) goes through.
fn stall_renewals(inner: SqliteStore, stall: Arc<AtomicBool>) -> FaultyStore<SqliteStore> {
    let mut first: Option<bytes::Bytes> = None;
    FaultyStore::new(inner, move |op| {
        let value = op.value.filter(|v| matches!(Record::decode(v), Ok(Record::InProgress { .. })))?;
        if op.precondition == Some(Precondition::Absent) && first.is_none() {
            first = Some(value.clone());
        }
        let renewal = matches!(op.precondition, Some(Precondition::Generation(_))) && first.as_ref() == Some(value);
        (renewal && stall.load(Ordering::SeqCst)).then_some(Fault::Hang)
    })
}

/// A real store whose completion writes (puts of a finished record) fail while `failing` is set, the way they
/// would while the store is unreachable.
fn fail_completions(inner: SqliteStore, failing: Arc<AtomicBool>) -> FaultyStore<SqliteStore> {
    FaultyStore::new(inner, move |op| {
        let completion = op.value.is_some_and(|v| matches!(Record::decode(v), Ok(Record::Finished { .. })));
        (completion && failing.load(Ordering::SeqCst)).then_some(Fault::Fail)
    })
}

fn request(path: &str) -> Request<Body> {
    Request::post(path).header("idempotency-key", "fenced").body(Body::empty()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_is_taken_over_and_the_late_completion_is_fenced_off() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    let stall = Arc::new(AtomicBool::new(true));
    let store = stall_renewals(sqlite, Arc::clone(&stall));
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
    // Once a retry has seen the record unchanged for a whole lease, the next one takes the key over and
    // executes (B).
    let started = Instant::now();
    let second = 'retries: loop {
        assert!(started.elapsed() < Duration::from_secs(10), "the dead holder was never taken over");
        let attempt = tokio::spawn(app.clone().oneshot(request("/slow/3000")));
        // Each retry either is told to wait (409) or takes the key over and starts executing; which one is
        // seen by watching both, not after a fixed pause (on a loaded machine a takeover could start after it,
        // and finish 201 where the test expected the 409 of a retry told to wait).
        while !attempt.is_finished() {
            if counts.executions() == 2 {
                // Only A was cut off; B renews normally (A's hung renewal now fails its fence).
                stall.store(false, Ordering::SeqCst);
                break 'retries attempt;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(counts.executions(), 1, "a retry executed without being seen to start");
        assert_eq!(attempt.await.unwrap().unwrap().status(), StatusCode::CONFLICT);
        tokio::time::sleep(Duration::from_millis(100)).await;
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
    let store = fail_completions(sqlite, Arc::clone(&failing));
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

/// A renewal that landed but whose answer was lost moves the record's generation past what the holder knows;
/// the next renewal is refused. The holder must recognise its own record and adopt the generation, not give
/// the lease up as taken over: given up, the record would lapse mid-execution and a retry execute again.
#[tokio::test(flavor = "multi_thread")]
async fn a_renewal_whose_answer_was_lost_keeps_the_lease_and_retries_still_wait() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).unwrap();
    let lost = Arc::new(AtomicBool::new(false));
    let lost_once = Arc::clone(&lost);
    let store = FaultyStore::new(sqlite, move |op| {
        let renewal = matches!(op.precondition, Some(Precondition::Generation(_)))
            && op.value.is_some_and(|v| matches!(Record::decode(v), Ok(Record::InProgress { .. })));
        (renewal && !lost_once.swap(true, Ordering::SeqCst)).then_some(Fault::LoseAnswer)
    });
    let counts = Arc::new(upstream::Counts::default());
    let app = IdempotencyLayer::new(store).lease(Duration::from_secs(1)).layer(upstream::router(Arc::clone(&counts)));
    let first = tokio::spawn(app.clone().oneshot(request("/slow/3000")));
    while counts.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past the point where the lease would have lapsed had it been given up (a lease after the lost renewal).
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let busy = app.clone().oneshot(request("/slow/3000")).await.unwrap();
        assert_eq!(busy.status(), StatusCode::CONFLICT, "the key is still held by the first request");
    }
    assert!(lost.load(Ordering::SeqCst), "a renewal's answer was lost");
    assert_eq!(first.await.unwrap().unwrap().headers()["location"], "/orders/1");
    let replay = app.clone().oneshot(request("/slow/3000")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(counts.executions(), 1);
}
