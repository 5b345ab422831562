//! `idem-postgres`'s integration tests, in one test binary (one binary per crate links the dependencies once).
//! They skip with a printed reason when `IDEM_TEST_POSTGRES_URL` is unset (conformance, migrations) or the
//! PostgreSQL server programs are missing (tls), unless `IDEM_TEST_REQUIRE_BACKENDS` is set.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod conformance;
mod generations;
mod ha;
mod migrations;
mod shutdown;
mod switchover;
mod tls;

/// `IDEM_TEST_POSTGRES_URL`, or `None` (printed) when unset; unset under `IDEM_TEST_REQUIRE_BACKENDS` fails.
fn url() -> Option<String> {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_POSTGRES_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset");
        return None;
    };
    Some(url)
}

/// A plain session of the test's own, beside the store's pool.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}
