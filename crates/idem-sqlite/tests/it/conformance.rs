//! The conformance suite on the embedded SQLite store, each check on a fresh file.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_sqlite::SqliteStore;
use idem_store::Limits;

idem_store::conformance_tests!(async || {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("idem.db"), Limits::default()).expect("open");
    Some((store, dir))
});
