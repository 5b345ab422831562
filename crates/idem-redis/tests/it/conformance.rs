//! The conformance suite on Redis, each check under a key prefix of its own that is deleted afterwards.
//! Skips (with a printed reason) when `IDEM_TEST_REDIS_URL` is unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_redis::RedisStore;
use idem_store::Limits;

/// Deletes every Redis key under the test's prefix when the test ends, pass or fail.
struct DropPrefix {
    url: String,
    prefix: String,
}

impl Drop for DropPrefix {
    fn drop(&mut self) {
        let (url, prefix) = (self.url.clone(), self.prefix.clone());
        let _ = std::thread::spawn(move || {
            let client = redis::Client::open(url).unwrap();
            let mut conn = client.get_connection().unwrap();
            let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}*")).query(&mut conn).unwrap();
            for chunk in keys.chunks(500) {
                let _: () = redis::cmd("DEL").arg(chunk).query(&mut conn).unwrap();
            }
        })
        .join();
    }
}

async fn store() -> Option<(RedisStore, DropPrefix)> {
    let Ok(url) = std::env::var("IDEM_TEST_REDIS_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_REDIS_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_REDIS_URL is unset (e.g. redis://127.0.0.1:6379)");
        return None;
    };
    let prefix = format!("idem-test:{:016x}:", rand::random::<u64>());
    let store = RedisStore::connect(&url, &prefix, Limits::default()).await.expect("connect");
    Some((store, DropPrefix { url, prefix }))
}

idem_store::conformance_tests!(store);

/// Dedupe records written before records kept their payload (a hash with only `v` and `g`) keep working: they
/// replay for any delta, as the code that wrote them answered; records written now refuse another delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_dedupe_records_replay_for_any_delta() {
    use idem_store::{Error, Store};
    let Some((store, guard)) = store().await else { return };
    let client = redis::Client::open(guard.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let p = &guard.prefix;
    // The layout as the old code wrote it: value hash, generation counter, index, dedupe record.
    let _: () = redis::pipe()
        .hset_multiple(format!("{p}k:balance"), &[("v", "5"), ("g", "7")])
        .set(format!("{p}generation"), 7)
        .zadd(format!("{p}index"), "balance", 0)
        .hset_multiple(format!("{p}d:7:balance:pay-1"), &[("v", "5"), ("g", "7")])
        .pexpire(format!("{p}d:7:balance:pay-1"), 3_600_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    for delta in [5, 7] {
        let out = store.counter_add("balance", delta, Some("pay-1")).await.unwrap();
        assert_eq!((out.value, out.generation.get(), out.applied), (5, 7, false), "delta {delta}");
    }
    let fresh = store.counter_add("balance", 2, Some("pay-2")).await.unwrap();
    assert_eq!((fresh.value, fresh.generation.get(), fresh.applied), (7, 8, true));
    assert!(matches!(
        store.counter_add("balance", 3, Some("pay-2")).await,
        Err(Error::DedupeIdReused { ref key, ref dedupe_id }) if key == "balance" && dedupe_id == "pay-2"
    ));
    assert_eq!(store.get("balance").await.unwrap().unwrap().value().as_ref(), b"7");
}
