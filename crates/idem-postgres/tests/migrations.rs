//! Several servers starting at once on a fresh schema: every one of them connects, and the schema is migrated
//! exactly once. Skips when `IDEM_TEST_POSTGRES_URL` is unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_postgres::PostgresStore;
use idem_store::{Limits, Precondition, Store, Ttl};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_starts_migrate_once() {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_POSTGRES_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_POSTGRES_URL is unset");
        return;
    };
    let schema = format!("idem_test_{:016x}", rand::random::<u64>());
    let starts: Vec<_> = (0..8)
        .map(|_| {
            let (url, schema) = (url.clone(), schema.clone());
            tokio::spawn(async move { PostgresStore::connect(&url, &schema, Limits::default()).await })
        })
        .collect();
    let mut stores = Vec::new();
    for s in starts {
        stores.push(s.await.unwrap().expect("a concurrent start failed"));
    }
    // All eight share one state.
    let g = stores[0].put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation();
    for s in &stores {
        assert_eq!(s.get("k").await.unwrap().unwrap().generation(), g);
    }
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let applied: i64 =
        client.query_one(&format!("SELECT count(*) FROM {schema}.schema_migrations"), &[]).await.unwrap().get(0);
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    assert_eq!(applied, 1, "the one migration was recorded {applied} times");
}
