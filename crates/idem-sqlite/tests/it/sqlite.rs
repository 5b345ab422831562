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
    let tags = idem_store::SetChange { add: vec!["a".into()], dedupe_id: Some("id-1".into()), ..Default::default() };
    store.set_change("tags", tags).await.unwrap();
    assert_eq!(rows(&path, "SELECT count(*) FROM kv"), 53);
    assert_eq!(rows(&path, "SELECT count(*) FROM counter_dedupe"), 1);
    assert_eq!(rows(&path, "SELECT count(*) FROM set_dedupe"), 1);
    // No reads or writes from here on: only the background sweep can remove rows.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let dedupe_rows =
        || rows(&path, "SELECT count(*) FROM counter_dedupe") + rows(&path, "SELECT count(*) FROM set_dedupe");
    while rows(&path, "SELECT count(*) FROM kv") != 3 || dedupe_rows() != 0 {
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

/// The version 1 schema exactly as released, to build the databases an upgrade meets.
const SCHEMA_V1: &str = "
CREATE TABLE kv (key TEXT NOT NULL PRIMARY KEY, value BLOB NOT NULL, generation INTEGER NOT NULL, expires_at INTEGER);
CREATE INDEX kv_expires_at ON kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE counter_dedupe (
    key TEXT NOT NULL, dedupe_id TEXT NOT NULL, value INTEGER NOT NULL, generation INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, PRIMARY KEY (key, dedupe_id)
) WITHOUT ROWID;
CREATE INDEX counter_dedupe_expires_at ON counter_dedupe (expires_at);
CREATE TABLE meta (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO meta (name, value) VALUES ('generation', 0), ('schema_version', 1);
";

/// A database written by schema version 1 (a counter at 5 under dedupe id `pay-1`, generation 7) opens,
/// migrates to version 2, and its old dedupe record keeps working: with no delta kept, it replays for any
/// delta, as version 1 did. New records remember their delta and refuse another one; generations go on.
#[tokio::test]
async fn a_version_1_database_migrates_and_keeps_its_dedupe_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(SCHEMA_V1).unwrap();
        let until = i64::try_from(idem_store::system_time_to_millis(std::time::SystemTime::now())).unwrap() + 3_600_000;
        c.execute("INSERT INTO kv (key, value, generation) VALUES ('balance', X'35', 7)", []).unwrap();
        c.execute(
            "INSERT INTO counter_dedupe (key, dedupe_id, value, generation, expires_at) VALUES ('balance', 'pay-1', 5, 7, ?1)",
            [until],
        )
        .unwrap();
        c.execute("UPDATE meta SET value = 7 WHERE name = 'generation'", []).unwrap();
    }
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    assert_eq!(rows(&path, "SELECT value FROM meta WHERE name = 'schema_version'"), 2);
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
    let set = idem_store::SetChange { add: vec!["a".into()], dedupe_id: Some("s-1".into()), ..Default::default() };
    let first = store.set_change("tags", set.clone()).await.unwrap();
    assert!(first.applied);
    assert!(!store.set_change("tags", set).await.unwrap().applied);
    store.close().await;
    drop(store);
    // Reopening finds version 2 and migrates nothing twice.
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    assert_eq!(rows(&path, "SELECT value FROM meta WHERE name = 'schema_version'"), 2);
    assert!(!store.counter_add("balance", 2, Some("pay-2")).await.unwrap().applied);
}

/// The starting generation is the highest one on disk in any table, `set_dedupe` included: a record there
/// above `meta` (as a torn copy could leave) is never handed out again.
#[tokio::test]
async fn generations_start_above_the_set_dedupe_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.db");
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    let set = idem_store::SetChange { add: vec!["a".into()], dedupe_id: Some("s-1".into()), ..Default::default() };
    store.set_change("tags", set).await.unwrap();
    store.close().await;
    drop(store);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute("UPDATE set_dedupe SET generation = 1000", []).unwrap();
    }
    let store = SqliteStore::open(&path, Limits::default()).unwrap();
    let g = store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation().get();
    assert!(g > 1000, "generation {g} does not start above the set_dedupe record's 1000");
}

/// A database from a newer idem (schema version 3) is refused, not half-understood.
#[tokio::test]
async fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    SqliteStore::open(&path, Limits::default()).unwrap().close().await;
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute("UPDATE meta SET value = 3 WHERE name = 'schema_version'", []).unwrap();
    }
    let err = SqliteStore::open(&path, Limits::default()).unwrap_err();
    assert!(matches!(err, idem_sqlite::Error::SchemaTooNew { found: 3, known: 2, .. }), "{err}");
}

/// A full disk is a store that is unavailable for now (503 `store-unavailable` with `Retry-After` over HTTP),
/// not a failure a retry cannot fix: once space returns the same write succeeds, and nothing acknowledged
/// before is lost. Found by `idem-verify`'s disk-full fault, which got 500 `store-failed`. Needs a tmpfs it can
/// mount (root); skipped with a printed reason otherwise.
#[tokio::test]
async fn a_full_disk_is_unavailable_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(dir.path())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipped: cannot mount a tmpfs (needs root)");
        return;
    }
    struct Unmount<'a>(&'a std::path::Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _unmount = Unmount(dir.path());
    let store = SqliteStore::open(dir.path().join("full.db"), Limits::default()).unwrap();
    let kept = store.put("kept", "acknowledged".into(), Precondition::Any, Ttl::Keep).await.unwrap().generation();
    // Fill the disk with a file, then grow the database until a write is refused.
    let filler = dir.path().join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 4 << 20]);
    let mut refusal = None;
    for i in 0..64 {
        if let Err(e) = store.put(&format!("big/{i}"), vec![b'x'; 256 << 10].into(), Precondition::Any, Ttl::Keep).await
        {
            refusal = Some(e);
            break;
        }
    }
    let refusal = refusal.expect("no write failed on a full disk");
    assert!(matches!(refusal, Error::Unavailable { .. }), "a full disk must be unavailable, got {refusal:?}");
    std::fs::remove_file(&filler).unwrap();
    store.put("after", "space returned".into(), Precondition::Any, Ttl::Keep).await.unwrap();
    let read = store.get("kept").await.unwrap().unwrap();
    assert_eq!((read.value().as_ref(), read.generation()), (&b"acknowledged"[..], kept));
}
