//! Behaviour specific to the embedded backend: the sweeper, reopening, closing.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::time::Duration;

use idem_sqlite::SqliteStore;
use idem_store::{Error, Limits, Precondition, Store, Ttl};

fn rows(path: &std::path::Path, sql: &str) -> i64 {
    let c = rusqlite::Connection::open(path).unwrap();
    c.query_row(sql, [], |r| r.get(0)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_removes_expired_rows_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let store = SqliteStore::open(&path, Limits::default().with_dedupe_retention(Duration::from_secs(1))).unwrap();
    for i in 0..50 {
        store
            .put(&format!("short/{i}"), "v".into(), Precondition::Any, Ttl::After(Duration::from_secs(1)))
            .await
            .unwrap();
    }
    store.put("long", "v".into(), Precondition::Any, Ttl::Keep).await.unwrap();
    store.counter_add("c", 1, Some("id-1")).await.unwrap();
    assert_eq!(rows(&path, "SELECT count(*) FROM kv"), 52);
    assert_eq!(rows(&path, "SELECT count(*) FROM counter_dedupe"), 1);
    // No reads or writes from here on: only the background sweep can remove rows.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while rows(&path, "SELECT count(*) FROM kv") != 2 || rows(&path, "SELECT count(*) FROM counter_dedupe") != 0 {
        assert!(std::time::Instant::now() < deadline, "expired rows were never swept");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(store.get("long").await.unwrap().is_some());
}

#[tokio::test]
async fn reopening_keeps_values_and_continues_generations() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.db");
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    let mut last = 0;
    for i in 0..20 {
        last = store
            .put(&format!("k{i}"), format!("{i}").into(), Precondition::Any, Ttl::Keep)
            .await
            .unwrap()
            .generation()
            .get();
    }
    // Deleting the newest key must not let its generation be handed out again after a restart.
    store.delete("k19", Precondition::Any).await.unwrap();
    store.close().await;
    assert!(matches!(store.get("k0").await, Err(Error::Closed)));
    assert!(matches!(store.put("x", "v".into(), Precondition::Any, Ttl::Keep).await, Err(Error::Closed)));
    drop(store);
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    assert_eq!(store.get("k7").await.unwrap().unwrap().value().as_ref(), b"7");
    let g = store.put("new", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation().get();
    assert!(g > last, "generation {g} reused after reopen (last was {last})");
}

#[tokio::test]
async fn refuses_a_file_that_is_not_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.db");
    std::fs::write(&path, vec![0x55u8; 8192]).unwrap();
    let err = SqliteStore::open(&path, Limits::default()).unwrap_err();
    assert!(err.to_string().contains("junk.db"), "{err}");
}

#[tokio::test]
async fn a_second_open_of_the_same_file_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.db");
    let first = SqliteStore::open(&path, Limits::default()).unwrap();
    let err = SqliteStore::open(&path, Limits::default()).unwrap_err();
    assert!(matches!(err, idem_sqlite::Error::InUse { .. }), "{err}");
    first.close().await;
    drop(first);
    let again = SqliteStore::open(&path, Limits::default()).unwrap();
    again.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap();
    // The same file under another name: a symlink to it, and a path through a symlinked directory.
    let alias = dir.path().join("alias.db");
    std::os::unix::fs::symlink(&path, &alias).unwrap();
    let err = SqliteStore::open(&alias, Limits::default()).unwrap_err();
    assert!(matches!(err, idem_sqlite::Error::InUse { .. }), "{err}");
    let linked_dir = tempfile::tempdir().unwrap();
    let through = linked_dir.path().join("d");
    std::os::unix::fs::symlink(dir.path(), &through).unwrap();
    let err = SqliteStore::open(through.join("one.db"), Limits::default()).unwrap_err();
    assert!(matches!(err, idem_sqlite::Error::InUse { .. }), "{err}");
}
