//! The storage contract of idem: a versioned key-value store with compare-and-swap.
//!
//! Every value carries a [`Generation`], a `u64` the store assigns at each successful write, strictly increasing
//! across the whole store and never reused (like etcd's revision). Writes take a [`Precondition`]; a failed one is
//! [`Error::PreconditionFailed`] carrying the current generation. [`StoreExt::update`] turns the primitives into a
//! read-modify-write loop that never loses an update.
//!
//! ```
//! use idem_store::{Decision, MemoryStore, Precondition, RetryPolicy, Store, StoreExt, Ttl};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let first = store.put("greeting", "hello".into(), Precondition::Absent, Ttl::Keep).await?;
//! // A second create under the same key fails and says what is there now.
//! let err = store.put("greeting", "again".into(), Precondition::Absent, Ttl::Keep).await.unwrap_err();
//! assert_eq!(err.current_generation(), Some(Some(first.generation())));
//!
//! // Read-modify-write with retries: re-reads before every attempt.
//! store
//!     .update("greeting", |cur| {
//!         let mut v = cur.map(|c| c.value().to_vec()).unwrap_or_default();
//!         v.extend_from_slice(b", world");
//!         Decision::<()>::Put(v.into())
//!     }, &RetryPolicy::default())
//!     .await?;
//! assert_eq!(store.get("greeting").await?.unwrap().value().as_ref(), b"hello, world");
//! # Ok::<(), idem_store::Error>(())
//! # }).unwrap();
//! ```
//!
//! The backends (SQLite, PostgreSQL, Redis) live in crates of their own. Writing another one: implement
//! [`Store`], use the helpers in [`backend`], and run the `conformance` suite (cargo feature `conformance`).

pub mod backend;
mod error;
mod lease;
mod limits;
mod memory;
pub mod stop;
mod store;
mod types;
mod update;
mod write;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{Error, KeyProblem, error_chain};
pub use lease::{LeaseKeeper, Lost, Renewable};
pub use limits::{Limits, MAX_KEY_BYTES, MAX_TTL, MIN_TTL};
#[cfg(feature = "testing")]
pub use memory::ManualClock;
pub use memory::MemoryStore;
pub use stop::Stop;
pub use store::{Store, StoreExt};
pub use types::{
    CounterOutcome, Generation, ListItem, Page, Precondition, SetChange, SetOutcome, Ttl, Versioned, Written,
    millis_to_system_time, system_time_to_millis,
};
pub use update::{Decision, Jitter, RetryPolicy, Updated};
pub use write::{Write, WriteOp};
