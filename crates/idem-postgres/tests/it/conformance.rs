//! The conformance suite on PostgreSQL, each check in a schema of its own that is dropped afterwards.
//! Skips (with a printed reason) when `IDEM_TEST_POSTGRES_URL` is unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_postgres::PostgresStore;
use idem_store::Limits;

/// Drops the test's schema when the test ends, pass or fail.
struct DropSchema {
    url: String,
    schema: String,
}

impl Drop for DropSchema {
    fn drop(&mut self) {
        let (url, schema) = (self.url.clone(), self.schema.clone());
        // Drop runs inside the test's runtime; a fresh thread with its own runtime may block freely.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(conn);
                client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await.unwrap();
            });
        })
        .join();
    }
}

async fn store() -> Option<(PostgresStore, DropSchema)> {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_POSTGRES_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset (e.g. postgres://postgres@127.0.0.1:5432/test)");
        return None;
    };
    let schema = format!("idem_test_{:016x}", rand::random::<u64>());
    let store = PostgresStore::connect(&url, &schema, Limits::default()).await.expect("connect");
    Some((store, DropSchema { url, schema }))
}

idem_store::conformance_tests!(store);
