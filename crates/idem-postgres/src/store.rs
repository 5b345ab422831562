use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime, Transaction};
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written, apply_counter, apply_set, system_time_to_millis,
};
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;

use crate::Error;
use crate::schema::{migrate, validate};

/// Connections per store; each conditional write holds one for a few round trips.
const POOL_SIZE: usize = 16;
/// How often expired rows are deleted. Expired rows are invisible at once; this only reclaims space.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The PostgreSQL store. Cheap to clone: clones share the pool.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    limits: Limits,
    sql: Sql,
    sweeper: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").finish_non_exhaustive()
    }
}

/// Statements with the schema name filled in once.
struct Sql {
    get: String,
    lock: String,
    read_meta: String,
    upsert: String,
    delete: String,
    list: String,
    dedupe_get: String,
    dedupe_put: String,
    sweep: String,
}

impl Sql {
    fn new(s: &str) -> Self {
        const LIVE: &str = "(k.expires_at IS NULL OR k.expires_at > now())";
        Self {
            // Per key and per transaction: it serialises writers of one key, present or absent, and is
            // released by COMMIT or ROLLBACK. It must be its own statement: under READ COMMITTED a statement
            // reads from a snapshot taken when it starts, so a read in the statement that waited for the lock
            // would see the value from before the previous holder's commit (a lost update).
            lock: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_owned(),
            get: format!("SELECT k.value, k.generation, k.expires_at FROM {s}.kv k WHERE k.key = $1 AND {LIVE}"),
            read_meta: format!("SELECT k.generation, k.expires_at FROM {s}.kv k WHERE k.key = $1 AND {LIVE}"),
            upsert: format!(
                "INSERT INTO {s}.kv (key, value, generation, expires_at) VALUES ($1, $2, nextval('{s}.generation'), \
                 CASE WHEN $4::float8 IS NULL THEN $3::timestamptz ELSE now() + $4::float8 * interval '1 millisecond' END) \
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value, generation = excluded.generation, \
                 expires_at = excluded.expires_at RETURNING generation"
            ),
            delete: format!("DELETE FROM {s}.kv WHERE key = $1"),
            // A plain lower bound (max of prefix and cursor, chosen by the caller) lets the planner seek the
            // primary key index instead of scanning from the prefix on every page.
            list: format!(
                "SELECT k.key, k.generation, k.expires_at FROM {s}.kv k WHERE k.key >= $1 AND k.key <> $2 \
                 AND {LIVE} ORDER BY k.key LIMIT $3"
            ),
            dedupe_get: format!(
                "SELECT value, generation FROM {s}.counter_dedupe WHERE key = $1 AND dedupe_id = $2 AND expires_at > now()"
            ),
            dedupe_put: format!(
                "INSERT INTO {s}.counter_dedupe (key, dedupe_id, value, generation, expires_at) \
                 VALUES ($1, $2, $3, $4, now() + $5::float8 * interval '1 millisecond') ON CONFLICT (key, dedupe_id) \
                 DO UPDATE SET value = excluded.value, generation = excluded.generation, expires_at = excluded.expires_at"
            ),
            sweep: format!(
                "DELETE FROM {s}.kv WHERE ctid IN (SELECT ctid FROM {s}.kv WHERE expires_at <= now() LIMIT 1000); \
                 DELETE FROM {s}.counter_dedupe WHERE ctid IN \
                 (SELECT ctid FROM {s}.counter_dedupe WHERE expires_at <= now() LIMIT 1000);"
            ),
        }
    }
}

/// Connection trouble is `Unavailable` (503, retry later); anything else the database said is `Backend`.
fn pg_err(e: tokio_postgres::Error) -> StoreError {
    let transient = match e.code() {
        None => true,
        Some(c) => {
            *c == SqlState::ADMIN_SHUTDOWN
                || *c == SqlState::CRASH_SHUTDOWN
                || *c == SqlState::CANNOT_CONNECT_NOW
                || *c == SqlState::TOO_MANY_CONNECTIONS
                || c.code().starts_with("08")
        }
    };
    if transient { StoreError::unavailable(e) } else { StoreError::backend(e) }
}

fn pool_err(e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => pg_err(e),
        other => StoreError::unavailable(other),
    }
}

fn gen_of(n: i64) -> Generation {
    Generation::new(u64::try_from(n).unwrap_or(0))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The live row read under the key's lock.
struct Live {
    generation: Generation,
    expires_at: Option<SystemTime>,
    value: Option<Vec<u8>>,
}

impl PostgresStore {
    /// Connects to `url`, creating and migrating `schema` (a plain lowercase identifier; `"idem"` by default in
    /// the binary), and starts the background sweeper.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`], [`Error::InvalidSchema`], [`Error::Connect`] when the server cannot be reached
    /// (within 5 s), [`Error::Migrate`], [`Error::SchemaTooNew`].
    pub async fn connect(url: &str, schema: &str, limits: Limits) -> Result<Self, Error> {
        validate(schema)?;
        let mut config: tokio_postgres::Config = url.parse().map_err(Error::InvalidUrl)?;
        config.connect_timeout(Duration::from_secs(5));
        let manager = Manager::from_config(config, NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(Error::Pool)?;
        let mut client = pool.get().await.map_err(Error::Connect)?;
        migrate(&mut client, schema).await?;
        drop(client);
        let sql = Sql::new(schema);
        let sweeper = {
            let (pool, sweep) = (pool.clone(), sql.sweep.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(SWEEP_EVERY).await;
                    let result = match pool.get().await {
                        Ok(c) => c.batch_execute(&sweep).await.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "sweeping expired rows failed; will retry");
                    }
                }
            })
        };
        Ok(Self { inner: Arc::new(Inner { pool, limits, sql, sweeper }) })
    }
}

/// Runs `$body` (a future using `$tx` and `$sql`) in one transaction; commits only when it succeeded.
/// Returning early with `?` drops the transaction, which rolls it back.
macro_rules! in_tx {
    ($self:ident, |$tx:ident, $sql:ident| $body:expr) => {{
        let mut client = $self.inner.pool.get().await.map_err(pool_err)?;
        let $tx = client.transaction().await.map_err(pg_err)?;
        let $sql = &$self.inner.sql;
        let out = $body.await?;
        $tx.commit().await.map_err(pg_err)?;
        Ok(out)
    }};
}

/// Refuses a write whose precondition already fails, without waiting for the key's lock.
///
/// Sound for every precondition: the failure is a true answer as of this read. For `Generation(g)` it is
/// final, since generations are never reused. Under contention this keeps stale compare-and-swaps out of
/// the lock queue, where each would otherwise wait behind every other writer only to fail.
async fn precheck(tx: &Transaction<'_>, sql: &Sql, key: &str, precondition: Precondition) -> Result<(), StoreError> {
    if precondition == Precondition::Any {
        return Ok(());
    }
    let row = tx.query_opt(&sql.read_meta, &[&key]).await.map_err(pg_err)?;
    precondition.check(row.map(|r| gen_of(r.get(0))))
}

/// Takes the key's lock, then reads its live row (generation and expiry) in a fresh snapshot.
async fn lock_meta(tx: &Transaction<'_>, sql: &Sql, key: &str) -> Result<Option<Live>, StoreError> {
    tx.execute(&sql.lock, &[&key]).await.map_err(pg_err)?;
    let row = tx.query_opt(&sql.read_meta, &[&key]).await.map_err(pg_err)?;
    Ok(row.map(|r| Live { generation: gen_of(r.get(0)), expires_at: r.get(1), value: None }))
}

/// Takes the key's lock, then reads its live row with the value.
async fn lock_row(tx: &Transaction<'_>, sql: &Sql, key: &str) -> Result<Option<Live>, StoreError> {
    tx.execute(&sql.lock, &[&key]).await.map_err(pg_err)?;
    let row = tx.query_opt(&sql.get, &[&key]).await.map_err(pg_err)?;
    Ok(row.map(|r| Live { generation: gen_of(r.get(1)), expires_at: r.get(2), value: r.get(0) }))
}

async fn upsert(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    value: &[u8],
    keep: Option<SystemTime>,
    after: Option<Duration>,
) -> Result<Generation, StoreError> {
    let after_ms = after.map(ms);
    let row = tx.query_one(&sql.upsert, &[&key, &value, &keep, &after_ms]).await.map_err(pg_err)?;
    Ok(gen_of(row.get(0)))
}

async fn put_tx(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    value: &[u8],
    precondition: Precondition,
    ttl: Ttl,
) -> Result<Written, StoreError> {
    precheck(tx, sql, key, precondition).await?;
    let current = lock_meta(tx, sql, key).await?;
    precondition.check(current.as_ref().map(|c| c.generation))?;
    let (keep, after) = match ttl {
        Ttl::Keep => (current.as_ref().and_then(|c| c.expires_at), None),
        Ttl::Clear => (None, None),
        Ttl::After(d) => (None, Some(d)),
    };
    let g = upsert(tx, sql, key, value, keep, after).await?;
    Ok(Written::new(g, current.is_none()))
}

async fn delete_tx(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    precondition: Precondition,
) -> Result<Option<Generation>, StoreError> {
    precheck(tx, sql, key, precondition).await?;
    let current = lock_meta(tx, sql, key).await?.map(|c| c.generation);
    precondition.check(current)?;
    if current.is_some() {
        tx.execute(&sql.delete, &[&key]).await.map_err(pg_err)?;
    }
    Ok(current)
}

async fn set_tx(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    change: &SetChange,
    limits: &Limits,
) -> Result<SetOutcome, StoreError> {
    let current = lock_row(tx, sql, key).await?;
    let applied = apply_set(current.as_ref().and_then(|c| c.value.as_deref()), change)?;
    let mut generation = current.as_ref().map(|c| c.generation);
    if applied.changed {
        match &applied.value {
            Some(v) => {
                limits.check_value(v)?;
                let keep = current.as_ref().and_then(|c| c.expires_at);
                generation = Some(upsert(tx, sql, key, v, keep, None).await?);
            }
            None => {
                tx.execute(&sql.delete, &[&key]).await.map_err(pg_err)?;
                generation = None;
            }
        }
    }
    Ok(SetOutcome { generation, members: applied.members, added: applied.added, removed: applied.removed })
}

async fn counter_tx(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    delta: i64,
    dedupe_id: Option<&str>,
    retention: Duration,
) -> Result<CounterOutcome, StoreError> {
    // The key's lock is taken first, so two adds with the same dedupe id serialise here.
    let current = lock_row(tx, sql, key).await?;
    if let Some(id) = dedupe_id
        && let Some(row) = tx.query_opt(&sql.dedupe_get, &[&key, &id]).await.map_err(pg_err)?
    {
        return Ok(CounterOutcome { value: row.get(0), generation: gen_of(row.get(1)), applied: false });
    }
    let applied = apply_counter(current.as_ref().and_then(|c| c.value.as_deref()), delta)?;
    let keep = current.as_ref().and_then(|c| c.expires_at);
    let g = upsert(tx, sql, key, &applied.encode(), keep, None).await?;
    if let Some(id) = dedupe_id {
        let g_i64 = i64::try_from(g.get()).unwrap_or(i64::MAX);
        tx.execute(&sql.dedupe_put, &[&key, &id, &applied.value, &g_i64, &ms(retention)]).await.map_err(pg_err)?;
    }
    Ok(CounterOutcome { value: applied.value, generation: g, applied: true })
}

impl Store for PostgresStore {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.inner.limits.check_key(key)?;
        let client = self.inner.pool.get().await.map_err(pool_err)?;
        let stmt = client.prepare_cached(&self.inner.sql.get).await.map_err(pg_err)?;
        let row = client.query_opt(&stmt, &[&key]).await.map_err(pg_err)?;
        Ok(row.map(|r| Versioned::new(Bytes::from(r.get::<_, Vec<u8>>(0)), gen_of(r.get(1)), r.get(2))))
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        self.inner.limits.check_put(key, &value, &ttl)?;
        in_tx!(self, |tx, sql| put_tx(&tx, sql, key, &value, precondition, ttl))
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        self.inner.limits.check_key(key)?;
        in_tx!(self, |tx, sql| delete_tx(&tx, sql, key, precondition))
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        if !(1..=1000).contains(&limit) {
            return Err(StoreError::InvalidArgument { what: "limit" });
        }
        let after = cursor.filter(|c| *c >= prefix);
        let client = self.inner.pool.get().await.map_err(pool_err)?;
        let stmt = client.prepare_cached(&self.inner.sql.list).await.map_err(pg_err)?;
        let fetch = i64::try_from(limit + 1).unwrap_or(1001);
        // From the cursor (exclusive) when there is one, else from the prefix (inclusive).
        let (from, skip) = match after {
            Some(a) => (a, a),
            None => (prefix, ""),
        };
        let rows = client.query(&stmt, &[&from, &skip, &fetch]).await.map_err(pg_err)?;
        let mut items: Vec<ListItem> = rows
            .iter()
            .map(|r| ListItem {
                key: r.get(0),
                generation: gen_of(r.get(1)),
                expires_at_ms: r.get::<_, Option<SystemTime>>(2).map(system_time_to_millis),
            })
            .take_while(|i| i.key.starts_with(prefix))
            .collect();
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|i| i.key.clone())
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_key(key)?;
        for m in change.add.iter().chain(&change.remove) {
            limits.check_token("set member", m)?;
        }
        in_tx!(self, |tx, sql| set_tx(&tx, sql, key, &change, &limits))
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_key(key)?;
        if let Some(id) = dedupe_id {
            limits.check_token("dedupe id", id)?;
        }
        in_tx!(self, |tx, sql| counter_tx(&tx, sql, key, delta, dedupe_id, limits.dedupe_retention()))
    }
}
