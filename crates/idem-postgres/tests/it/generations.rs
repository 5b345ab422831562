//! Per-key generations rise in the order versions become visible, across a delete and a re-create that raced
//! with them. Found by `idem-verify` (KV workload, seed 2026): a create-only put took its generation before it
//! waited on the row of a concurrent writer; that writer committed a higher one, a delete removed it, and the
//! create then landed with the lower, older number. The interleaving is forced here with two raw sessions.
//! Skips when `IDEM_TEST_POSTGRES_URL` is unset.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::time::Duration;

use idem_postgres::PostgresStore;
use idem_store::{Error, Generation, Limits, Precondition, Store, Ttl};

use crate::{connect, url};

/// Waits until `n` sessions wait for a lock held by another (pg_locks rows not granted).
async fn until_waiting(watch: &tokio_postgres::Client, n: i64) {
    for _ in 0..500 {
        let waiting: i64 =
            watch.query_one("SELECT count(*) FROM pg_locks WHERE NOT granted", &[]).await.unwrap().get(0);
        if waiting >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} sessions never waited on a lock");
}

/// Session A locks the row and later writes a new version (as a counter add does); session B's delete and
/// the store's create-only put queue behind it, in that order. A commits generation G; B deletes it and, before
/// B commits, a reader sees G; then the create lands. Its generation must be above G: a reader that saw G and
/// then the created version saw the key's generation go back.
///
/// The create usually rechecks the key after B's delete; now and then it gets to A's version first and is
/// refused (a correct answer, but not this race), so the interleaving is tried up to ten times and must
/// happen at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_racing_a_write_and_a_delete_gets_a_higher_generation() {
    let Some(url) = url() else { return };
    let schema = format!("idem_test_{:016x}", rand::random::<u64>());
    let store = PostgresStore::connect(&url, &schema, Limits::default()).await.unwrap();
    let watch = connect(&url).await;
    let mut raced = 0;
    for attempt in 0..10 {
        if let Some((seen, created)) = race(&url, &schema, &store, &watch, &format!("k{attempt}")).await {
            raced += 1;
            assert!(
                created > seen,
                "a reader saw generation {} and then the re-created key at generation {}: generations went back",
                seen.get(),
                created.get()
            );
        }
    }
    watch.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.unwrap();
    assert!(raced > 0, "the create never landed after the delete in ten tries");
}

/// One try on `key`: the generation a reader saw before B committed its delete and the created one, or `None`
/// when the create was refused (it saw A's version before B deleted it).
async fn race(
    url: &str,
    schema: &str,
    store: &PostgresStore,
    watch: &tokio_postgres::Client,
    key: &str,
) -> Option<(Generation, Generation)> {
    let first = store.put(key, "v0".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation();
    let (a, b) = (connect(url).await, connect(url).await);
    a.batch_execute(&format!("BEGIN; SELECT 1 FROM {schema}.kv WHERE key = '{key}' FOR UPDATE")).await.unwrap();
    b.batch_execute("BEGIN").await.unwrap();
    let delete = {
        let sql = format!("DELETE FROM {schema}.kv WHERE key = '{key}' RETURNING generation");
        tokio::spawn(async move {
            let g: i64 = b.query_one(&sql, &[]).await.unwrap().get(0);
            (b, g)
        })
    };
    until_waiting(watch, 1).await;
    let create = {
        let (store, key) = (store.clone(), key.to_owned());
        tokio::spawn(async move { store.put(&key, "created".into(), Precondition::Absent, Ttl::Keep).await })
    };
    until_waiting(watch, 2).await;
    let written: i64 = a
        .query_one(
            &format!(
                "UPDATE {schema}.kv SET generation = nextval('{schema}.generation') WHERE key = '{key}' \
                 RETURNING generation"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    a.batch_execute("COMMIT").await.unwrap();
    let (b, deleted) = delete.await.unwrap();
    assert_eq!(deleted, written, "the delete removes A's version");
    let seen = store.get(key).await.unwrap().expect("B has not committed its delete yet").generation();
    assert_eq!(seen.get(), u64::try_from(written).unwrap());
    assert!(seen > first);
    b.batch_execute("COMMIT").await.unwrap();
    match create.await.unwrap() {
        Ok(written) => {
            let now = store.get(key).await.unwrap().unwrap().generation();
            assert_eq!(now, written.generation());
            Some((seen, written.generation()))
        }
        Err(Error::PreconditionFailed { .. }) => None,
        Err(e) => panic!("the create failed: {e}"),
    }
}
