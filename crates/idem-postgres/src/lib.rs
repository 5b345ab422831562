//! idem's store on PostgreSQL, for several machines sharing one state.
//!
//! Generations come from one sequence, so they are unique and never reused. Every conditional put or delete is
//! ONE statement whose `WHERE` carries the precondition (`UPDATE … WHERE generation = $g`, `INSERT … ON
//! CONFLICT DO UPDATE … WHERE expired`); PostgreSQL re-checks such a condition on the newest row version once
//! it holds the row lock, so a lost race matches no row and is reported as a failed precondition with the
//! current generation, never as a lost update or a database error. Set and counter operations are one short
//! transaction that locks the row (`SELECT … FOR UPDATE`). Expiry is judged by the database's clock
//! (`now()`). The schema is created and migrated by [`PostgresStore::connect`] under an advisory lock, so
//! servers starting together migrate once.
//!
//! TLS follows libpq's `sslmode` (`disable`, `prefer` — the default —, `require`, `verify-ca`,
//! `verify-full`) and `sslrootcert=PATH` URL parameters, over rustls; see [`PostgresStore::connect`].
//!
//! ```no_run
//! use idem_postgres::PostgresStore;
//! use idem_store::{Limits, Precondition, Store, Ttl};
//!
//! # async fn demo() -> Result<(), idem_postgres::Error> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/test", "idem", Limits::default()).await?;
//! store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await?;
//! # Ok(()) }
//! ```

mod connect;
mod error;
mod replication;
mod schema;
mod sql;
mod store;
mod tls;

pub use error::Error;
pub use store::PostgresStore;
