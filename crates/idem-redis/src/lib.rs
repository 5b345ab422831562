//! idem's store on Redis, for several machines sharing one state.
//!
//! Every conditional operation is one Lua script, so it runs atomically on the server; scripts are sent once
//! and then called by SHA (`EVALSHA`). Generations come from one counter key (`INCR`). Expiry is Redis's own
//! (`PEXPIREAT`, judged by the Redis server's clock): `HSET` keeps a key's expiry (`Ttl::Keep`), `PERSIST`
//! clears it (`Ttl::Clear`). A sorted set indexes the keys for ordered prefix listing; members whose value
//! expired are dropped lazily by listings and by a background sweep.
//!
//! Durability is whatever the Redis server's persistence gives: with `appendonly yes` and
//! `appendfsync always` an acknowledged write survives a crash; with the default `everysec` up to one
//! second of acknowledged writes can be lost; without persistence, everything is lost on restart.
//!
//! ```no_run
//! use idem_redis::RedisStore;
//! use idem_store::{Limits, Precondition, Store, Ttl};
//!
//! # async fn demo() -> Result<(), idem_redis::Error> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379", "idem:", Limits::default()).await?;
//! store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await?;
//! # Ok(()) }
//! ```

mod conn;
mod error;
mod store;
mod topology;
mod url;

pub use error::Error;
pub use store::RedisStore;
