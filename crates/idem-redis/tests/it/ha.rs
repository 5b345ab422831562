//! Highly available Redis from idem-testkit, on free ports: a primary with a replica and three Sentinels
//! (`redis+sentinel://`) and a six-node Cluster (`redis+cluster://`). The conformance suite passes on both; a
//! Sentinel failover (the master killed with SIGKILL, its replica promoted) in the middle of concurrent writes
//! with `wait_replicas=1` loses no acknowledged write, and `WAIT` counting fewer replicas than asked for is an
//! error. Skips when `redis-server` is missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex, Weak};

use idem_redis::RedisStore;
use idem_store::conformance::writes_through_failover;
use idem_store::error_chain;
use idem_store::{Error as StoreError, Limits, Precondition, Store, Ttl};
use idem_testkit::{RedisCluster, RedisSentinel};

static SENTINEL: Mutex<Weak<RedisSentinel>> = Mutex::new(Weak::new());
static CLUSTER: Mutex<Weak<RedisCluster>> = Mutex::new(Weak::new());

fn prefix() -> String {
    format!("idem-test:{:016x}:", rand::random::<u64>())
}

async fn sentinel_store() -> Option<(RedisStore, Arc<RedisSentinel>)> {
    let set = idem_testkit::shared(&SENTINEL, RedisSentinel::start)?;
    let store = RedisStore::connect(&set.url(""), &prefix(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect through the Sentinels: {}", error_chain(&e)));
    Some((store, set))
}

async fn cluster_store() -> Option<(RedisStore, Arc<RedisCluster>)> {
    let cluster = idem_testkit::shared(&CLUSTER, RedisCluster::start)?;
    let store = RedisStore::connect(&cluster.url(""), &prefix(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect to the Cluster: {}", error_chain(&e)));
    Some((store, cluster))
}

mod sentinel {
    idem_store::conformance_tests!(super::sentinel_store);
}

mod cluster {
    idem_store::conformance_tests!(super::cluster_store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_counting_fewer_replicas_than_asked_is_an_error() {
    let Some(set) = idem_testkit::shared(&SENTINEL, RedisSentinel::start) else { return };
    // One replica: WAIT 1 is met, WAIT 2 is not within its 100 ms.
    let one = RedisStore::connect(&set.url("wait_replicas=1"), &prefix(), Limits::default()).await.unwrap();
    one.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.expect("one replica acknowledges");
    let two = RedisStore::connect(&set.url("wait_replicas=2&wait_timeout_ms=100"), &prefix(), Limits::default())
        .await
        .unwrap();
    for attempt in [
        two.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.map(|_| ()),
        two.delete("k", Precondition::Any).await.map(|_| ()),
        two.counter_add("c", 1, None).await.map(|_| ()),
    ] {
        let err = attempt.unwrap_err();
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err:?}");
        assert!(
            error_chain(&err).contains("1 of 2 replicas acknowledged the write within 100 ms"),
            "{}",
            error_chain(&err)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_with_wait_loses_no_acknowledged_write() {
    let Some(set) = RedisSentinel::start() else { return };
    let store = RedisStore::connect(&set.url("wait_replicas=all&wait_timeout_ms=500"), &prefix(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    let set = Arc::new(Mutex::new(set));
    let shared = Arc::clone(&set);
    let tally = writes_through_failover(&store, 8, move || {
        let mut set = shared.lock().unwrap();
        set.kill_primary();
        set.wait_failover();
        // WAIT 1 needs a replica: until the old primary is back as one, writes are refused (unavailable).
        set.restart_old_primary();
    })
    .await;
    assert!(tally.unavailable > 0, "no write saw the switch: the failover did not happen under load");
    crate::assert_none_lost(&tally);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_with_wait_loses_no_acknowledged_write() {
    let Some(cluster) = RedisCluster::start() else { return };
    let prefix = prefix();
    let store = RedisStore::connect(&cluster.url("wait_replicas=all&wait_timeout_ms=500"), &prefix, Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    // The store's keys share the hash tag {prefix}: its master is the one to kill.
    let tag = format!("{{{prefix}}}");
    let cluster = Arc::new(Mutex::new(cluster));
    let shared = Arc::clone(&cluster);
    let tally = writes_through_failover(&store, 8, move || {
        let mut cluster = shared.lock().unwrap();
        let master = cluster.master_of(&tag);
        cluster.kill(master);
        cluster.wait_failover(&tag, master);
        cluster.restart(master);
    })
    .await;
    crate::assert_none_lost(&tally);
    assert!(tally.after >= 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_of_one_store_share_a_slot_and_prefixes_with_braces_are_refused() {
    let Some(cluster) = idem_testkit::shared(&CLUSTER, RedisCluster::start) else { return };
    let err = RedisStore::connect(&cluster.url(""), "a{b}:", Limits::default()).await.unwrap_err();
    assert!(matches!(err, idem_redis::Error::InvalidPrefix(_)), "{}", error_chain(&err));
    // Keys whose own slots differ all land under the store's one hash tag, so multi-key scripts run.
    let prefix = prefix();
    let store = RedisStore::connect(&cluster.url(""), &prefix, Limits::default()).await.unwrap();
    for key in ["a", "b", "c", "{x}", "zz"] {
        store.counter_add(key, 1, Some("d")).await.unwrap();
    }
    let page = store.list("", None, 10).await.unwrap();
    assert_eq!(page.items.iter().map(|i| i.key.as_str()).collect::<Vec<_>>(), ["a", "b", "c", "zz", "{x}"]);
}
