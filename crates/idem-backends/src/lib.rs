//! Every idem backend behind one store URL, as object_store's `parse_url` does for object stores: the server,
//! `idem run`'s ledger and `idem bench` open their store from the same string, parsed in one place.
//!
//! | URL | store |
//! | --- | --- |
//! | `sqlite:PATH` (or `sqlite://PATH`) | the embedded default ([`idem_sqlite::SqliteStore`]) |
//! | `memory:` | nothing survives the process ([`idem_store::MemoryStore`]) |
//! | `postgres://…` / `postgresql://…` | [`idem_postgres::PostgresStore`]; TLS by libpq's `sslmode`, `sslrootcert` |
//! | `redis://…` / `rediss://…` | [`idem_redis::RedisStore`]; TLS with `rediss://`, `cacert=PATH` |
//!
//! ```
//! use idem_store::{Limits, Precondition, Store, Ttl};
//! use idem_backends::{AnyStore, StoreUrl};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! # let dir = tempfile::tempdir()?;
//! # let db = dir.path().join("idem.db");
//! let url = StoreUrl::parse(&format!("sqlite:{}", db.display()))?;
//! assert!(url.is_exclusive()); // one process at a time on a SQLite file
//! let store = AnyStore::open(&url, "idem", Limits::default()).await?;
//! store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await?;
//! assert_eq!(store.get("k").await?.expect("just written").value().as_ref(), b"v");
//! store.close().await;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

mod any;
mod error;
mod url;

pub use any::AnyStore;
pub use error::Error;
pub use url::StoreUrl;
