//! [`AnyStore`]: the backend a [`StoreUrl`] names, opened, behind the one `Store` trait.

use std::time::Duration;

use bytes::Bytes;
use idem_postgres::PostgresStore;
use idem_redis::RedisStore;
use idem_sqlite::SqliteStore;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, MemoryStore, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written,
};

use crate::{Error, StoreUrl};

/// A store being opened in the background ([`AnyStore::open_or_keep_trying`]).
#[derive(Debug)]
pub struct Opening {
    limits: Limits,
    store: std::sync::OnceLock<AnyStore>,
    /// Why the last try failed, for the 503's detail.
    why: std::sync::Mutex<String>,
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
    /// `redis://…`, `rediss://…`, Sentinel or Cluster URLs: keys under `<namespace>:` (`{<namespace>:}` on a
    /// Cluster).
    Redis(RedisStore),
    /// A PostgreSQL or Redis store that was unavailable when opened (a Sentinel naming no master mid-failover,
    /// a primary restarting): every operation is [`StoreError::Unavailable`] until a background task has
    /// opened it ([`AnyStore::open_or_keep_trying`]), then the opened store's.
    Opening(std::sync::Arc<Opening>),
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

    /// As [`AnyStore::open`], but a store unavailable for now ([`Error::is_unavailable`]) is returned as
    /// [`AnyStore::Opening`], which answers every operation [`StoreError::Unavailable`] (a server's 503 with
    /// `Retry-After`) while a background task tries to open it again, every 100 ms to 2 s (the policy's
    /// full-jitter backoff), until it opens; the task logs the first failure and the opening.
    ///
    /// # Errors
    /// As [`AnyStore::open`], for what a retry cannot fix (a bad URL, a refused login, a setting refused).
    pub async fn open_or_keep_trying(url: &StoreUrl, namespace: &str, limits: Limits) -> Result<Self, Error> {
        let first = match Self::open(url, namespace, limits).await {
            Err(e) if e.is_unavailable() => e,
            other => return other,
        };
        let why = idem_store::error_chain(&first);
        tracing::warn!(error = %why, "the store is unavailable; answering 503 until it opens, trying again meanwhile");
        let opening =
            std::sync::Arc::new(Opening { limits, store: std::sync::OnceLock::new(), why: std::sync::Mutex::new(why) });
        let (task, url, namespace) = (opening.clone(), url.clone(), namespace.to_owned());
        tokio::spawn(async move {
            let policy = idem_store::RetryPolicy::new()
                .with_base_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(2));
            for attempt in 2u32.. {
                tokio::time::sleep(policy.backoff(attempt).max(Duration::from_millis(100))).await;
                match Self::open(&url, &namespace, limits).await {
                    Ok(store) => {
                        tracing::info!("the store opened");
                        let _ = task.store.set(store);
                        return;
                    }
                    Err(e) => *task.why.lock().unwrap_or_else(|e| e.into_inner()) = idem_store::error_chain(&e),
                }
            }
        });
        Ok(AnyStore::Opening(opening))
    }

    /// The opened store: `self`, or the store an [`AnyStore::Opening`] has opened by now.
    fn ready(&self) -> Result<&AnyStore, StoreError> {
        match self {
            AnyStore::Opening(o) => o.store.get().ok_or_else(|| {
                let why = o.why.lock().unwrap_or_else(|e| e.into_inner()).clone();
                StoreError::unavailable(format!("the store has not opened yet: {why}"))
            }),
            other => Ok(other),
        }
    }

    /// As [`AnyStore::open`], but `None` when a PostgreSQL `namespace` (schema) does not exist, creating
    /// nothing: for readers that must not leave an empty schema behind (other backends create nothing a
    /// reader would notice: Redis keys appear with writes, SQLite is the caller's to check).
    ///
    /// # Errors
    /// As [`AnyStore::open`].
    pub async fn open_existing(url: &StoreUrl, namespace: &str, limits: Limits) -> Result<Option<Self>, Error> {
        match url {
            StoreUrl::Postgres(u) => PostgresStore::connect_existing(u, namespace, limits)
                .await
                .map(|s| s.map(AnyStore::Postgres))
                .map_err(|e| Error::Open { url: url.redacted(), source: Box::new(e) }),
            other => Self::open(other, namespace, limits).await.map(Some),
        }
    }

    /// Finishes queued writes and releases the store (flushes and checkpoints SQLite).
    pub async fn close(&self) {
        match self {
            AnyStore::Sqlite(s) => s.close().await,
            // Memory has nothing to flush; PostgreSQL and Redis acknowledged every write already.
            AnyStore::Memory(_) | AnyStore::Postgres(_) | AnyStore::Redis(_) => {}
            AnyStore::Opening(o) => {
                if let Some(s) = o.store.get() {
                    Box::pin(s.close()).await;
                }
            }
        }
    }
}

/// `$e` on the opened store (an [`AnyStore::Opening`] not yet open is `Unavailable`).
macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.ready()? {
            AnyStore::Memory($s) => $e,
            AnyStore::Sqlite($s) => $e,
            AnyStore::Postgres($s) => $e,
            AnyStore::Redis($s) => $e,
            // `ready` never gives an `Opening`: the background task sets only what `open` returned.
            AnyStore::Opening(_) => Err(StoreError::unavailable("the store has not opened yet")),
        }
    };
}

impl Store for AnyStore {
    fn limits(&self) -> &Limits {
        match self {
            AnyStore::Memory(s) => s.limits(),
            AnyStore::Sqlite(s) => s.limits(),
            AnyStore::Postgres(s) => s.limits(),
            AnyStore::Redis(s) => s.limits(),
            AnyStore::Opening(o) => &o.limits,
        }
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        each!(self, s => s.get(key).await)
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, StoreError> {
        each!(self, s => s.get_many(keys).await)
    }

    async fn now(&self) -> Result<std::time::SystemTime, StoreError> {
        each!(self, s => s.now().await)
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
