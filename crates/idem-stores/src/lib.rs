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

use std::path::PathBuf;

use bytes::Bytes;
use idem_postgres::PostgresStore;
use idem_redis::RedisStore;
use idem_sqlite::SqliteStore;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written,
};

/// Why a store URL cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The scheme is none of `sqlite:`, `memory:`, `postgres://`, `redis://`, `rediss://`.
    #[error("store URL {0:?} has an unknown scheme; use sqlite:PATH, memory:, postgres://…, redis://… or rediss://…")]
    UnknownScheme(String),
    /// `sqlite:` with no path after it.
    #[error("store URL {0:?} names no file; use sqlite:./idem-data/idem.db")]
    NoPath(String),
    /// The backend refused to open (the source says why: unreachable, TLS refused, schema too new, …).
    #[error("cannot open store {url}")]
    Open {
        /// The URL, passwords hidden.
        url: String,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// A parsed store URL; [`StoreUrl::redacted`] is the form to print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory:`.
    Memory,
    /// `sqlite:PATH`: the file.
    Sqlite(PathBuf),
    /// `postgres://…`, as given (the backend reads its parameters).
    Postgres(String),
    /// `redis://…` or `rediss://…`, as given.
    Redis(String),
}

impl StoreUrl {
    /// Parses `url` by its scheme; the rest is the backend's to judge when it opens.
    ///
    /// # Errors
    /// [`Error::UnknownScheme`], [`Error::NoPath`] (names the URL with passwords hidden).
    pub fn parse(url: &str) -> Result<Self, Error> {
        if url == "memory:" || url == "memory://" {
            return Ok(StoreUrl::Memory);
        }
        if let Some(path) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
            if path.is_empty() {
                return Err(Error::NoPath(url.to_owned()));
            }
            return Ok(StoreUrl::Sqlite(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(StoreUrl::Postgres(url.to_owned()));
        }
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            return Ok(StoreUrl::Redis(url.to_owned()));
        }
        Err(Error::UnknownScheme(redact(url)))
    }

    /// Whether the store is this process's alone (`sqlite:`, whose lock file keeps other processes out, and
    /// `memory:`), so nothing else changes its records.
    pub fn is_exclusive(&self) -> bool {
        matches!(self, StoreUrl::Memory | StoreUrl::Sqlite(_))
    }

    /// The URL with passwords hidden, for messages.
    pub fn redacted(&self) -> String {
        match self {
            StoreUrl::Memory => "memory:".to_owned(),
            StoreUrl::Sqlite(path) => format!("sqlite:{}", path.display()),
            StoreUrl::Postgres(url) | StoreUrl::Redis(url) => redact(url),
        }
    }
}

/// A store chosen at run time by URL (see the crate documentation).
#[derive(Clone, Debug)]
pub enum AnyStore {
    /// `memory:`: nothing survives the process.
    Memory(MemoryStore),
    /// `sqlite:PATH`: the embedded default.
    Sqlite(SqliteStore),
    /// `postgres://…`: tables in the schema named by the namespace.
    Postgres(PostgresStore),
    /// `redis://…` or `rediss://…`: keys under `<namespace>:`.
    Redis(RedisStore),
}

/// Hides passwords in a URL for messages: the userinfo's (`scheme://user:secret@host` → `user:***@host`, the
/// last `@` ending it, as passwords may contain `@`) and any `password=` query parameter.
pub fn redact(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, tail) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if let Some((userinfo, host)) = authority.rsplit_once('@')
            && let Some((user, _)) = userinfo.split_once(':')
        {
            out = format!("{scheme}://{user}:***@{host}{tail}");
        }
    }
    if let Some((base, query)) = out.clone().split_once('?') {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        out = format!("{base}?{}", params.join("&"));
    }
    out
}

impl AnyStore {
    /// Opens the store `url` names. `namespace` (a lowercase identifier) names the PostgreSQL schema and the
    /// Redis key prefix, so several deployments can share one database.
    ///
    /// # Errors
    /// [`Error::Open`] when the backend refuses (its error is the source).
    pub async fn open(url: &StoreUrl, namespace: &str, limits: Limits) -> Result<Self, Error> {
        let failed = |source: Box<dyn std::error::Error + Send + Sync>| Error::Open { url: url.redacted(), source };
        match url {
            StoreUrl::Memory => Ok(AnyStore::Memory(MemoryStore::with_limits(limits))),
            StoreUrl::Sqlite(path) => {
                SqliteStore::open(path, limits).map(AnyStore::Sqlite).map_err(|e| failed(Box::new(e)))
            }
            StoreUrl::Postgres(u) => PostgresStore::connect(u, namespace, limits)
                .await
                .map(AnyStore::Postgres)
                .map_err(|e| failed(Box::new(e))),
            StoreUrl::Redis(u) => RedisStore::connect(u, &format!("{namespace}:"), limits)
                .await
                .map(AnyStore::Redis)
                .map_err(|e| failed(Box::new(e))),
        }
    }

    /// Finishes queued writes and releases the store (flushes and checkpoints SQLite).
    pub async fn close(&self) {
        match self {
            AnyStore::Sqlite(s) => s.close().await,
            // Memory has nothing to flush; PostgreSQL and Redis acknowledged every write already.
            AnyStore::Memory(_) | AnyStore::Postgres(_) | AnyStore::Redis(_) => {}
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e,
            AnyStore::Sqlite($s) => $e,
            AnyStore::Postgres($s) => $e,
            AnyStore::Redis($s) => $e,
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

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, StoreError> {
        each!(self, s => s.get_many(keys).await)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn urls_parse_by_scheme_and_print_without_passwords() {
        assert_eq!(StoreUrl::parse("memory:").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("sqlite:a/b.db").unwrap(), StoreUrl::Sqlite("a/b.db".into()));
        assert_eq!(StoreUrl::parse("sqlite:///tmp/x.db").unwrap(), StoreUrl::Sqlite("/tmp/x.db".into()));
        assert!(StoreUrl::parse("sqlite:x").unwrap().is_exclusive());
        let pg = StoreUrl::parse("postgres://u:secret@h/db?password=also").unwrap();
        assert!(!pg.is_exclusive());
        assert_eq!(pg.redacted(), "postgres://u:***@h/db?password=***");
        assert!(matches!(StoreUrl::parse("sqlite:"), Err(Error::NoPath(_))));
        let e = StoreUrl::parse("mysql://u:secret@h/db").unwrap_err().to_string();
        assert!(e.starts_with("store URL \"mysql://u:***@h/db\" has an unknown scheme"), "{e}");
    }
}
