//! Migrations: several servers starting at once on a fresh schema all connect and migrate exactly once; a
//! schema written by an older release is migrated and its data keeps working; a newer one is refused. Skips
//! when `IDEM_TEST_POSTGRES_URL` is unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_postgres::PostgresStore;
use idem_store::{Error, Limits, Precondition, SetChange, Store, Ttl};

use crate::{connect, url};

/// How many migrations this build knows.
const MIGRATIONS: i64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_starts_migrate_once() {
    let Some(url) = url() else { return };
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
    let client = connect(&url).await;
    let applied: i64 =
        client.query_one(&format!("SELECT count(*) FROM {schema}.schema_migrations"), &[]).await.unwrap().get(0);
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    assert_eq!(applied, MIGRATIONS, "{MIGRATIONS} migrations were recorded {applied} times");
}

/// Migration 1 exactly as released, to build the schema an upgrade meets.
const MIGRATION_1: &str = r#"
CREATE SEQUENCE {s}.generation AS bigint;
CREATE TABLE {s}.kv (
    key text COLLATE "C" PRIMARY KEY, value bytea NOT NULL, generation bigint NOT NULL, expires_at timestamptz
);
CREATE INDEX kv_expires_at ON {s}.kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE {s}.counter_dedupe (
    key text COLLATE "C" NOT NULL, dedupe_id text COLLATE "C" NOT NULL, value bigint NOT NULL,
    generation bigint NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (key, dedupe_id)
);
CREATE INDEX counter_dedupe_expires_at ON {s}.counter_dedupe (expires_at);
"#;

/// A schema at migration 1 holding a counter at 5 under dedupe id `pay-1` (generation 7) is migrated on
/// connect, and its old dedupe record keeps working: it kept no delta, so it replays for any delta, as
/// before. New records remember their payload and refuse another; generations go on from the sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_1_schema_migrates_and_keeps_its_dedupe_records() {
    let Some(url) = url() else { return };
    let schema = format!("idem_test_{:016x}", rand::random::<u64>());
    let client = connect(&url).await;
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {schema}.schema_migrations (version integer PRIMARY KEY, \
             applied_at timestamptz NOT NULL DEFAULT now()); INSERT INTO {schema}.schema_migrations VALUES (1); \
             {} \
             SELECT setval('{schema}.generation', 7); \
             INSERT INTO {schema}.kv (key, value, generation) VALUES ('balance', '5', 7); \
             INSERT INTO {schema}.counter_dedupe VALUES ('balance', 'pay-1', 5, 7, now() + interval '1 hour');",
            MIGRATION_1.replace("{s}", &schema)
        ))
        .await
        .unwrap();
    let (u, sc) = (url.clone(), schema.clone());
    let result = async move {
        let (url, schema, client) = (&u, &sc, connect(&u).await);
        let store = PostgresStore::connect(url, schema, Limits::default()).await.expect("connect");
        for delta in [5, 7] {
            let out = store.counter_add("balance", delta, Some("pay-1")).await.unwrap();
            assert_eq!((out.value, out.generation.get(), out.applied), (5, 7, false), "delta {delta}");
        }
        let fresh = store.counter_add("balance", 2, Some("pay-2")).await.unwrap();
        assert!(fresh.applied && fresh.value == 7 && fresh.generation.get() > 7);
        assert!(matches!(
            store.counter_add("balance", 3, Some("pay-2")).await,
            Err(Error::DedupeIdReused { ref key, ref dedupe_id }) if key == "balance" && dedupe_id == "pay-2"
        ));
        let set = SetChange { add: vec!["a".into()], dedupe_id: Some("s-1".into()), ..SetChange::default() };
        assert!(store.set_change("tags", set.clone()).await.unwrap().applied);
        assert!(!store.set_change("tags", set).await.unwrap().applied);
        let versions: Vec<i32> = client
            .query(&format!("SELECT version FROM {schema}.schema_migrations ORDER BY version"), &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(versions, vec![1, 2]);
    };
    // Drop the schema whether the checks pass or not.
    let outcome = tokio::spawn(result).await;
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A schema migrated by a newer idem (a migration this build does not know) is refused.
#[tokio::test]
async fn a_newer_schema_is_refused() {
    let Some(url) = url() else { return };
    let schema = format!("idem_test_{:016x}", rand::random::<u64>());
    PostgresStore::connect(&url, &schema, Limits::default()).await.expect("connect");
    let client = connect(&url).await;
    client.batch_execute(&format!("INSERT INTO {schema}.schema_migrations (version) VALUES (3)")).await.unwrap();
    let err = PostgresStore::connect(&url, &schema, Limits::default()).await.unwrap_err();
    client.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    assert!(matches!(err, idem_postgres::Error::SchemaTooNew { found: 3, known: 2, .. }), "{err}");
}
