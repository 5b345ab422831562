//! `StoreExt::update`: the retry loop's edges, with interference forced rather than hoped for.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use bytes::Bytes;
use idem_store::{Decision, Error, Jitter, MemoryStore, Precondition, RetryPolicy, Store, StoreExt, Ttl, Updated};

fn interfere(store: &MemoryStore, key: &str) {
    // A competing writer lands between this attempt's read and its conditional write.
    let handle = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        handle.block_on(store.put(key, Bytes::from_static(b"other"), Precondition::Any, Ttl::Keep))
    })
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhaustion_is_typed_and_counts_attempts() {
    let store = MemoryStore::new();
    let mut calls = 0;
    let policy = RetryPolicy::default().with_max_attempts(5);
    let err = store
        .update(
            "k",
            |_| {
                calls += 1;
                interfere(&store, "k");
                Decision::<()>::Put(Bytes::from_static(b"mine"))
            },
            &policy,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UpdateExhausted { attempts: 5 }), "{err:?}");
    assert_eq!(calls, 5, "the closure must run once per attempt, after a fresh read");
    assert_eq!(store.get("k").await.unwrap().unwrap().value().as_ref(), b"other");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rereads_before_every_attempt_and_succeeds_after_losing() {
    let store = MemoryStore::new();
    store.put("k", Bytes::from_static(b"0"), Precondition::Absent, Ttl::Keep).await.unwrap();
    let mut seen = Vec::new();
    let out = store
        .update(
            "k",
            |cur| {
                let v = cur.unwrap().value().clone();
                seen.push(v.clone());
                if seen.len() < 3 {
                    interfere(&store, "k");
                }
                Decision::<()>::Put(Bytes::from(format!("{}+1", String::from_utf8_lossy(&v))))
            },
            &RetryPolicy::default(),
        )
        .await
        .unwrap();
    assert!(matches!(out, Updated::Put { attempts: 3, .. }), "{out:?}");
    assert_eq!(seen, vec![Bytes::from_static(b"0"), Bytes::from_static(b"other"), Bytes::from_static(b"other")]);
    assert_eq!(store.get("k").await.unwrap().unwrap().value().as_ref(), b"other+1");
}

#[tokio::test]
async fn abort_writes_nothing_and_delete_deletes() {
    let store = MemoryStore::new();
    store.put("k", Bytes::from_static(b"v"), Precondition::Absent, Ttl::Keep).await.unwrap();
    let out = store.update("k", |_| Decision::Abort("no"), &RetryPolicy::default()).await.unwrap();
    assert_eq!(out, Updated::Aborted("no"));
    assert_eq!(store.get("k").await.unwrap().unwrap().generation().get(), 1);
    let out = store.update("k", |_| Decision::<()>::Delete, &RetryPolicy::default()).await.unwrap();
    assert_eq!(out, Updated::Deleted { attempts: 1 });
    assert!(store.get("k").await.unwrap().is_none());
    let out = store.update("k", |_| Decision::<()>::Delete, &RetryPolicy::default()).await.unwrap();
    assert_eq!(out, Updated::Deleted { attempts: 1 });
}

/// Equal jitter never goes below half the window, and no jitter is the window itself; `pause_after(n)` is the
/// backoff before attempt n + 1.
#[test]
fn equal_jitter_stays_in_the_upper_half_and_no_jitter_is_the_window() {
    let ms = std::time::Duration::from_millis;
    let equal = RetryPolicy::default().with_base_delay(ms(100)).with_max_delay(ms(2000)).with_jitter(Jitter::Equal);
    for failures in 1..10 {
        let window = ms((100u64 << (failures - 1)).min(2000));
        let samples: Vec<_> = (0..200).map(|_| equal.pause_after(failures)).collect();
        assert!(samples.iter().all(|d| *d >= window / 2 && *d <= window), "failure {failures}: {samples:?}");
        assert!(samples.iter().any(|d| *d < window * 9 / 10), "failure {failures}: not jittered");
    }
    let fixed = RetryPolicy::default().with_base_delay(ms(10)).with_max_delay(ms(200)).with_jitter(Jitter::None);
    let pauses: Vec<u64> = (1..8).map(|n| fixed.pause_after(n).as_millis() as u64).collect();
    assert_eq!(pauses, [10, 20, 40, 80, 160, 200, 200]);
}

#[test]
fn backoff_is_full_jitter_within_the_exponential_window() {
    let p = RetryPolicy::default()
        .with_base_delay(std::time::Duration::from_millis(4))
        .with_max_delay(std::time::Duration::from_millis(20));
    assert_eq!(p.backoff(1), std::time::Duration::ZERO);
    for attempt in 2..12 {
        let window = std::time::Duration::from_millis((4u64 << (attempt - 2)).min(20));
        let samples: Vec<_> = (0..200).map(|_| p.backoff(attempt)).collect();
        assert!(samples.iter().all(|d| *d <= window), "attempt {attempt}: beyond {window:?}");
        assert!(samples.iter().any(|d| *d < window / 4), "attempt {attempt}: no low samples, not full jitter");
    }
}
