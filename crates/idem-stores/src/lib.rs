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
//! ```no_run
//! # async fn demo() -> Result<(), idem_stores::Error> {
//! use idem_stores::{AnyStore, StoreUrl};
//! let url = StoreUrl::parse("sqlite:./idem-data/idem.db")?;
//! assert!(url.is_exclusive());
//! let store = AnyStore::open(&url, "idem", idem_store::Limits::default()).await?;
//! store.close().await;
//! # Ok(()) }
//! ```

mod any;
mod error;
mod url;

pub use any::AnyStore;
pub use error::Error;
pub use url::StoreUrl;
