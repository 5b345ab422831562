//! The one place that names concrete backends: a store chosen by URL scheme.

use bytes::Bytes;
use idem_postgres::PostgresStore;
use idem_redis::RedisStore;
use idem_sqlite::SqliteStore;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written,
};

use crate::error::Error;

/// A store chosen at run time by URL: `sqlite:PATH`, `memory:`, `postgres://…` (TLS by libpq's `sslmode`
/// and `sslrootcert`) or `redis://…` / `rediss://…` (TLS, with `cacert=PATH` for a private CA).
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
    /// Whether the store a URL names is this process's alone (`sqlite:`, whose lock file keeps other
    /// processes out, and `memory:`), so nothing else changes its records.
    pub fn is_exclusive_url(url: &str) -> bool {
        url.starts_with("sqlite:") || url.starts_with("memory:")
    }

    /// Opens the store a URL names. `namespace` (a lowercase identifier) names the PostgreSQL schema and the
    /// Redis key prefix, so several deployments can share one database.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown or unsupported scheme; [`Error::OpenStore`] when the backend refuses.
    pub async fn open(url: &str, namespace: &str, limits: Limits) -> Result<Self, Error> {
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
        let open_err = |e: Box<dyn std::error::Error + Send + Sync>| Error::OpenStore { url: redact(url), source: e };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return PostgresStore::connect(url, namespace, limits)
                .await
                .map(AnyStore::Postgres)
                .map_err(|e| open_err(Box::new(e)));
        }
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            return RedisStore::connect(url, &format!("{namespace}:"), limits)
                .await
                .map(AnyStore::Redis)
                .map_err(|e| open_err(Box::new(e)));
        }
        Err(Error::Config(format!(
            "store URL {:?} has an unknown scheme; use sqlite:PATH, memory:, postgres://…, redis://… or rediss://…",
            redact(url)
        )))
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
