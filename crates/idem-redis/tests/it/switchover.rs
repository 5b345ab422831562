//! What operators do to a replicated Redis besides a crash, with two replicas under three Sentinels:
//! `wait_replicas=all` loses no acknowledged write through a `SENTINEL FAILOVER` with the old master alive (with
//! `wait_replicas=1` that switchover lost 135 to 377 acknowledged writes in 5 of 5 tries: the second replica,
//! not yet switched, answered `WAIT 1` for writes the old master took after the promotion), waits for every
//! replica the Sentinels list, a frozen one included, and opening the store while
//! the Sentinels name no master is an outage, not a bad URL. Skips when `redis-server` is missing, unless
//! `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_redis::RedisStore;
use idem_store::conformance::writes_through_failover;
use idem_store::{Error as StoreError, Limits, Precondition, Store, Ttl, error_chain};
use idem_testkit::RedisSentinel;

fn prefix() -> String {
    format!("idem-test:{:016x}:", rand::random::<u64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_switchover_with_two_replicas_and_wait_all_loses_no_acknowledged_write() {
    let Some(set) = RedisSentinel::start_with_replicas(2) else { return };
    let store = RedisStore::connect(&set.url("wait_replicas=all&wait_timeout_ms=500"), &prefix(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    let old = set.master_port();
    let set = Arc::new(Mutex::new(set));
    let shared = Arc::clone(&set);
    let tally = writes_through_failover(&store, 8, move || {
        shared.lock().unwrap().switchover();
    })
    .await;
    assert_ne!(set.lock().unwrap().master_port(), old, "no switchover happened");
    crate::assert_none_lost(&tally);
}

/// A frozen replica (SIGSTOP: a hung machine) is waited for, and writes are refused, for as long as it is
/// frozen, also once the Sentinels judge it down: a Sentinel promotes it after a crash of the master if its
/// `replica-priority` ranks it first, whatever it missed (leaving judged-down replicas out of the count lost
/// 19,862 of 45,502 acknowledged writes so in a break-it round). Thawed and in sync, writes are acknowledged
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_all_waits_for_a_frozen_replica_also_once_the_sentinels_judge_it_down() {
    let Some(set) = RedisSentinel::start_with_replicas(2) else { return };
    let store = RedisStore::connect(&set.url("wait_replicas=all&wait_timeout_ms=200"), &prefix(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    store.put("before", "v".into(), Precondition::Absent, Ttl::Keep).await.expect("both replicas acknowledge");
    let frozen = set.replica_ports[1];
    set.freeze(frozen);
    // The Sentinels judge it down after 1 s (the test kit's down-after-milliseconds); 4 s spans that and three
    // recounts of the replicas.
    let since = Instant::now();
    let mut n = 0;
    while since.elapsed() < Duration::from_secs(4) {
        n += 1;
        let r = store.put(&format!("frozen-{n}"), "v".into(), Precondition::Absent, Ttl::Keep).await;
        let Err(err) = r else {
            set.thaw(frozen);
            panic!("a write was acknowledged {:?} into the freeze, without the frozen replica", since.elapsed());
        };
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err:?}");
        let chain = error_chain(&err);
        assert!(chain.contains("1 of 2 replicas acknowledged the write within 200 ms"), "{chain}");
    }
    set.thaw(frozen);
    set.wait_in_sync(frozen);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        n += 1;
        match store.put(&format!("after-{n}"), "v".into(), Precondition::Absent, Ttl::Keep).await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => assert!(matches!(e, StoreError::Unavailable { .. }), "{e:?}"),
            Err(e) => panic!("writes still refused with the replica back: {}", error_chain(&e)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_master_named_is_unavailable_and_an_unknown_name_is_a_mistake() {
    let Some(mut set) = RedisSentinel::start_with_replicas(1) else { return };
    let url = set.url("");
    let wrong = url.replace("/idem", "/no-such-master");
    let err = RedisStore::connect(&wrong, &prefix(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, idem_redis::Error::NoSuchMaster(ref n) if n == "no-such-master"), "{}", error_chain(&err));
    assert!(!err.is_unavailable());
    // The master and its only replica down: the Sentinels flag the master down and have nobody to promote.
    let replica = set.replica_ports[0];
    set.kill(replica);
    set.kill_primary();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
        assert!(err.is_unavailable(), "{}", error_chain(&err));
        if error_chain(&err).to_lowercase().contains("master with given name not found") {
            break;
        }
        assert!(Instant::now() < deadline, "the Sentinels never stopped naming the dead master: {}", error_chain(&err));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `CLUSTER FAILOVER FORCE` to a replica of the store's master, with two replicas per master and the old
/// master alive: it promotes itself without the master's handshake, and the old master goes on taking writes
/// until it learns of the new epoch (`wait_replicas=1` lost 36 acknowledged writes so). Under
/// `wait_replicas=all` none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_force_with_two_replicas_and_wait_all_loses_no_acknowledged_write() {
    let Some(cluster) = idem_testkit::RedisCluster::start_with_replicas(2) else { return };
    let prefix = prefix();
    let store = RedisStore::connect(&cluster.url("wait_replicas=all&wait_timeout_ms=500"), &prefix, Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    let tag = format!("{{{prefix}}}");
    let old = cluster.master_of(&tag);
    let replica = cluster.replicas_of(old)[0];
    let cluster = Arc::new(Mutex::new(cluster));
    let shared = Arc::clone(&cluster);
    let tally = writes_through_failover(&store, 8, move || {
        shared.lock().unwrap().failover(replica, idem_testkit::ClusterFailover::Force);
    })
    .await;
    assert_eq!(cluster.lock().unwrap().master_of(&tag), replica, "no failover happened");
    crate::assert_none_lost(&tally);
}

/// A master whose own floor of replicas (`min-replicas-to-write`) is not met refuses writes with `NOREPLICAS`:
/// that is the store away for now (503, `idem once` exit 75, `idem run` waits), not a store failure (it was a
/// 500 `store-failed`, and exit 2 from `idem once`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_short_of_its_min_replicas_to_write_is_unavailable() {
    let Some(set) = RedisSentinel::start_with_replicas(1) else { return };
    let store = RedisStore::connect(&set.url(""), &prefix(), Limits::default()).await.unwrap();
    let master = redis::Client::open(format!("redis://127.0.0.1:{}", set.master_port())).unwrap();
    let mut admin = master.get_multiplexed_async_connection().await.unwrap();
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("min-replicas-to-write").arg(2).query_async(&mut admin).await.unwrap();
    let err = store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable { .. }), "{}", error_chain(&err));
    assert!(error_chain(&err).contains("NOREPLICAS"), "{}", error_chain(&err));
}

/// Under `wait_replicas=all` a read is confirmed as a write is: with the one replica frozen, a read gets 503
/// rather than a value the replica may lack (a write refused for want of replicas stays on the master, and a
/// switchover then discards it: a reader shown it saw a value that vanished, found by the checker's
/// `switchover` and `partition` faults). Without `wait_replicas`, reads are not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_wait_all_a_read_the_replicas_cannot_confirm_is_unavailable() {
    let Some(set) = RedisSentinel::start_with_replicas(1) else { return };
    let prefix = prefix();
    let all = RedisStore::connect(&set.url("wait_replicas=all&wait_timeout_ms=200"), &prefix, Limits::default())
        .await
        .unwrap();
    let plain = RedisStore::connect(&set.url(""), &prefix, Limits::default()).await.unwrap();
    all.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap();
    assert_eq!(all.get("k").await.unwrap().map(|v| v.value().clone()), Some("v".into()));
    let replica = set.replica_ports[0];
    set.freeze(replica);
    let read = all.get("k").await;
    let listed = all.list("", None, 10).await;
    let unwaited = plain.get("k").await;
    set.thaw(replica);
    let err = read.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err:?}");
    assert!(error_chain(&err).contains("0 of 1 replicas acknowledged"), "{}", error_chain(&err));
    assert!(matches!(listed, Err(StoreError::Unavailable { .. })), "{listed:?}");
    assert!(unwaited.unwrap().is_some(), "a store without wait_replicas reads as before");
    set.wait_in_sync(replica);
    assert!(all.get("k").await.unwrap().is_some());
}
