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
