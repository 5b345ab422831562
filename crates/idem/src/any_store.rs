//! The one place that names concrete backends: a store chosen by URL scheme.

use bytes::Bytes;
use idem_sqlite::SqliteStore;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written,
};

use crate::error::Error;

/// A store chosen at run time by URL: `sqlite:PATH` or `memory:`.
#[derive(Clone, Debug)]
pub enum AnyStore {
    /// `memory:`: nothing survives the process.
    Memory(MemoryStore),
    /// `sqlite:PATH`: the embedded default.
    Sqlite(SqliteStore),
}

/// Hides a password in a URL (`scheme://user:secret@host` → `scheme://user:***@host`) for messages.
pub fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((userinfo, host)) = rest.split_once('@')
        && let Some((user, _)) = userinfo.split_once(':')
    {
        return format!("{scheme}://{user}:***@{host}");
    }
    url.to_owned()
}

impl AnyStore {
    /// Opens the store a URL names.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown or unsupported scheme; [`Error::OpenStore`] when the backend refuses.
    pub fn open(url: &str, limits: Limits) -> Result<Self, Error> {
        if url == "memory:" || url == "memory://" {
            return Ok(AnyStore::Memory(MemoryStore::with_limits(limits)));
        }
        if let Some(path) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
            if path.is_empty() {
                return Err(Error::Config(format!("store URL {url:?} names no file; use sqlite:./idem-data/idem.db")));
            }
            return SqliteStore::open(path, limits)
                .map(AnyStore::Sqlite)
                .map_err(|e| Error::OpenStore { url: redact(url), source: Box::new(e) });
        }
        let shown = redact(url);
        if url.starts_with("postgres://") || url.starts_with("postgresql://") || url.starts_with("redis://") {
            return Err(Error::Config(format!("store URL {shown}: this build has no PostgreSQL or Redis backend yet")));
        }
        Err(Error::Config(format!("store URL {shown:?} has an unknown scheme; use sqlite:PATH or memory:")))
    }

    /// Finishes queued writes and releases the store (flushes and checkpoints SQLite).
    pub async fn close(&self) {
        match self {
            AnyStore::Memory(_) => {}
            AnyStore::Sqlite(s) => s.close().await,
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e,
            AnyStore::Sqlite($s) => $e,
        }
    };
}

impl Store for AnyStore {
    fn limits(&self) -> &Limits {
        each!(self, s => s.limits())
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        each!(self, s => s.get(key).await)
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        each!(self, s => s.put(key, value, precondition, ttl).await)
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        each!(self, s => s.delete(key, precondition).await)
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        each!(self, s => s.list(prefix, cursor, limit).await)
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        each!(self, s => s.set_change(key, change).await)
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        each!(self, s => s.counter_add(key, delta, dedupe_id).await)
    }
}
