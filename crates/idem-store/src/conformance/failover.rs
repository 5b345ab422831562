//! Writes through a failover: what a highly available backend must keep when its primary dies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{Error, Precondition, Store, Ttl};

/// What [`writes_through_failover`] counted.
#[derive(Debug, Default)]
pub struct FailoverTally {
    /// Writes acknowledged (before, during and after the switch).
    pub acknowledged: usize,
    /// Of those, present with their value afterwards.
    pub present: usize,
    /// Acknowledged writes missing afterwards (their keys).
    pub lost: Vec<String>,
    /// Writes that failed with [`Error::Unavailable`] (the 503 of the switch).
    pub unavailable: usize,
    /// Acknowledged after `failover` returned.
    pub after: usize,
}

/// Runs `writers` tasks that each create fresh keys (`Precondition::Absent`) in a loop; after 300
/// acknowledged writes calls `failover` (kill the primary, promote a standby: it may block, it runs on a
/// blocking thread), then keeps writing until 300 more were acknowledged, and reads every acknowledged key back.
///
/// A write that fails gets a new key for the next attempt: it may or may not have been applied, and only
/// acknowledged writes are promised.
///
/// # Panics
/// When a write fails other than with [`Error::Unavailable`] or writes stall for a minute.
pub async fn writes_through_failover<S: Store + Clone>(
    store: &S,
    writers: usize,
    failover: impl FnOnce() + Send + 'static,
) -> FailoverTally {
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let unavailable: Arc<Mutex<usize>> = Arc::default();
    let prefix = super::prefix("failover");
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (store, stop, acked, unavailable) =
                (store.clone(), Arc::clone(&stop), Arc::clone(&acked), Arc::clone(&unavailable));
            let prefix = prefix.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("{prefix}w{w}-{n}");
                    n += 1;
                    match store.put(&key, key.clone().into(), Precondition::Absent, Ttl::Keep).await {
                        Ok(_) => acked.lock().unwrap().push(key),
                        Err(Error::Unavailable { .. }) => {
                            *unavailable.lock().unwrap() += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(e) => panic!("a write during the failover failed other than as unavailable: {e:?}"),
                    }
                }
            })
        })
        .collect();
    let count = || acked.lock().unwrap().len();
    let wait_for = |n: usize| {
        let count = &count;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while count() < n {
                assert!(tokio::time::Instant::now() < deadline, "writes stalled at {} acknowledged", count());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(300).await;
    tokio::task::spawn_blocking(failover).await.unwrap();
    let before = count();
    wait_for(before + 300).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let mut tally = FailoverTally {
        acknowledged: acked.len(),
        unavailable: *unavailable.lock().unwrap(),
        after: acked.len() - before,
        ..FailoverTally::default()
    };
    for key in acked {
        match store.get(&key).await.expect("read after the failover") {
            Some(v) if v.value().as_ref() == key.as_bytes() => tally.present += 1,
            _ => tally.lost.push(key),
        }
    }
    tally
}
