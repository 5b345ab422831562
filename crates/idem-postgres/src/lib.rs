//! idem's store on PostgreSQL, for several machines sharing one state.
//!
//! Generations come from one sequence, so they are unique and never reused; per key they strictly increase
//! because each conditional write holds the key's lock while it takes the next value. Every conditional
//! operation is one short transaction that first takes a transaction-scoped advisory lock on the key (so even
//! an absent key has something to lock), reads the live row, checks the precondition and writes: a lost race
//! is a failed precondition carrying the current generation, never a database error. Expiry is judged by the
//! database's clock (`now()`). The schema is created and migrated by [`PostgresStore::connect`] under an
//! advisory lock, so servers starting together migrate once.
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

mod error;
mod schema;
mod store;

pub use error::Error;
pub use store::PostgresStore;
