//! The embedded default store: one SQLite file in WAL mode with `synchronous=FULL`.
//!
//! A write is acknowledged only after the transaction holding it is durable (the WAL is fsynced). One writer
//! thread owns the only write connection; it takes every write that queued up while the previous commit was
//! being fsynced and applies them all in one transaction (group commit), so many concurrent writers share one
//! fsync instead of paying one each. Reads run on a few read-only connections and never wait for a commit.
//! Expired values read as absent at once; the writer thread sweeps them in the background.
//!
//! [`SharedSqlite`] lets several processes share one file by taking turns with the store (`idem run`'s ledger).
//!
//! ```
//! use idem_sqlite::SqliteStore;
//! use idem_store::{Limits, Precondition, Store, Ttl};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("idem.db");
//! let store = SqliteStore::open(&path, Limits::default())?;
//! let written = store.put("greeting", "hello".into(), Precondition::Absent, Ttl::Keep).await?;
//! store.close().await;
//! drop(store); // releases the file's lock: one process (one store) at a time
//!
//! // Acknowledged means on disk: another open of the file reads it back.
//! let store = SqliteStore::open(&path, Limits::default())?;
//! let read = store.get("greeting").await?.expect("written before the close");
//! assert_eq!((read.value().as_ref(), read.generation()), (&b"hello"[..], written.generation()));
//! store.close().await;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

mod error;
mod lockfile;
mod schema;
mod shared;
mod store;
mod writer;

pub use error::Error;
pub use shared::SharedSqlite;
pub use store::SqliteStore;
