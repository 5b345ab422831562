use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime, Transaction};
use idem_store::backend::{apply_counter, apply_set};
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written, system_time_to_millis,
};
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::error::SqlState;

use crate::Error;
use crate::schema::{migrate, validate};
use crate::sql::Sql;

/// Connections per store; each conditional write holds one for a few round trips.
const POOL_SIZE: usize = 16;
/// How long a connection attempt to one host may take unless the URL's `connect_timeout` (seconds) says.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
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
    /// Reads the replication setting again and warns when a commit stops waiting for every standby.
    replication: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.sweeper.abort();
        self.replication.abort();
    }
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").finish_non_exhaustive()
    }
}

/// Connection trouble is `Unavailable` (503, retry later); anything else the database said is `Backend`.
///
/// Unavailable: no SQLSTATE at all (the connection was refused, reset or closed), class 08 (connection
/// exception), 57P01-57P03 (the server shutting down or not yet accepting connections), 53300 (too many
/// connections), and 25006 (a read-only transaction: the server is a standby, as a failover leaves the old
/// primary or a libpq multi-host URL may find one for a moment).
fn pg_err(e: tokio_postgres::Error) -> StoreError {
    let transient = e.code().is_none_or(transient_code);
    if transient { StoreError::unavailable(e) } else { StoreError::backend(e) }
}

/// The SQLSTATEs a later try may not meet: the server shutting down, crashed or not yet accepting connections
/// (57P01-57P03), too many connections (53300), a read-only transaction (25006: a standby), a connection
/// exception (class 08).
pub(crate) fn transient_code(c: &SqlState) -> bool {
    *c == SqlState::ADMIN_SHUTDOWN
        || *c == SqlState::CRASH_SHUTDOWN
        || *c == SqlState::CANNOT_CONNECT_NOW
        || *c == SqlState::TOO_MANY_CONNECTIONS
        || *c == SqlState::READ_ONLY_SQL_TRANSACTION
        || c.code().starts_with("08")
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

fn to_usize(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl PostgresStore {
    /// Connects to `url`, creating and migrating `schema` (a plain lowercase identifier; `"idem"` by default in
    /// the binary), and starts the background sweeper.
    ///
    /// `url` is a libpq URL (`postgres://user:password@host:port/db?param=value&…`), with one host or several
    /// (`postgres://u@h1:5432,h2:5432/db`, libpq's multi-host form,
    /// <https://www.postgresql.org/docs/15/libpq-connect.html#LIBPQ-MULTIPLE-HOSTS>): each new connection tries the
    /// hosts in order and keeps the first whose session is read-write (`target_session_attrs=read-write`, which
    /// idem always asks for; any other value is refused), so after a failover the pool's next connection finds
    /// the promoted primary. `connect_timeout=SECONDS` bounds each host's attempt (5 s when absent). While no
    /// host takes writes, operations fail with [`idem_store::Error::Unavailable`], as do writes that reach a
    /// server turned read-only (SQLSTATE 25006). TLS is libpq's
    /// (<https://www.postgresql.org/docs/15/libpq-ssl.html>, table 34.1): `sslmode=disable`, `prefer` (the
    /// default: TLS when the server offers it, unverified), `require` (TLS, unverified unless `sslrootcert` is
    /// given, then as `verify-ca`), `verify-ca` (the chain must lead to a trusted root), `verify-full` (and
    /// the certificate must name the host); `sslrootcert=PATH` is a PEM file of trusted roots, the platform's
    /// store when absent (or `system`).
    ///
    /// `synchronous_standbys=all` refuses a primary whose commits do not wait for every standby (the hosts
    /// after the first, and any the primary has connected): `synchronous_commit` `on` or `remote_apply` and
    /// `synchronous_standby_names` asking for that many (`ANY n (…)`), so that no failover or switchover can
    /// promote a standby without an acknowledged commit. Without it such a primary is warned about at
    /// start-up and when its setting changes, with the `idem_store_replicas_unwaited` gauge.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`], [`Error::InvalidSslMode`], [`Error::TargetSessionAttrs`], [`Error::ClientCertificate`],
    /// [`Error::TlsFiles`], [`Error::Tls`], [`Error::InvalidSchema`], [`Error::Server`] when the server refuses the
    /// connection or cannot be reached (or no host is read-write), [`Error::ConnectTimeout`] when no host
    /// answers within the connect timeout, [`Error::Connect`] for other pool failures,
    /// [`Error::Handshake`] when the TLS handshake fails, [`Error::Migrate`], [`Error::SchemaTooNew`],
    /// [`Error::NotSynchronous`] under `synchronous_standbys=all`.
    pub async fn connect(url: &str, schema: &str, limits: Limits) -> Result<Self, Error> {
        match Self::connect_with(url, schema, limits, true).await? {
            Some(store) => Ok(store),
            // Unreachable: with `create` the schema is made when absent.
            None => Err(Error::NoSchema(schema.to_owned())),
        }
    }

    /// As [`PostgresStore::connect`], but `None` (nothing created) when `schema` does not exist: for readers
    /// such as `idem once status` that must not leave an empty schema behind for a mistyped namespace. An
    /// existing schema is migrated as by `connect`.
    ///
    /// # Errors
    /// Those of [`PostgresStore::connect`].
    pub async fn connect_existing(url: &str, schema: &str, limits: Limits) -> Result<Option<Self>, Error> {
        Self::connect_with(url, schema, limits, false).await
    }

    async fn connect_with(url: &str, schema: &str, limits: Limits, create: bool) -> Result<Option<Self>, Error> {
        validate(schema)?;
        let tls = crate::tls::parse(url)?;
        let mut config: tokio_postgres::Config = tls.url.parse().map_err(Error::InvalidUrl)?;
        config.ssl_mode(tls.tokio_mode());
        // idem only writes: with several hosts, a session on a standby would refuse every write, so each new
        // connection checks `transaction_read_only` and moves on to the next host (libpq's `read-write`).
        config.target_session_attrs(TargetSessionAttrs::ReadWrite);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        // The timeout is per host (as libpq's): a new connection may try each host in turn.
        let per_host = config.get_connect_timeout().copied().unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        let hosts = u32::try_from(config.get_hosts().len().max(1)).unwrap_or(u32::MAX);
        let connector = tls.connector()?;
        let manager_config = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match crate::connect::per_host_urls(&tls.url) {
            // Several hosts: each tried with its own whole-attempt timeout (`connect.rs`).
            Some(urls) => {
                let hosts = urls
                    .iter()
                    .map(|url| {
                        let mut one: tokio_postgres::Config = url.parse().map_err(Error::InvalidUrl)?;
                        one.ssl_mode(tls.tokio_mode());
                        one.target_session_attrs(TargetSessionAttrs::ReadWrite);
                        one.connect_timeout(per_host);
                        Ok(one)
                    })
                    .collect::<Result<Vec<_>, Error>>()?;
                let per_host_connect = crate::connect::PerHost { hosts, tls: connector, per_host };
                Manager::from_connect(config, per_host_connect, manager_config)
            }
            None => Manager::from_config(config, connector, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(per_host.saturating_mul(hosts)))
            .build()
            .map_err(Error::Pool)?;
        let mut client = pool.get().await.map_err(|e| match idem_tls::rustls_error_in(&e) {
            Some(tls) => Error::Handshake(idem_tls::describe(
                tls,
                idem_tls::Hints {
                    peer: "PostgreSQL server",
                    trust: "sslrootcert=FILE",
                    client_cert: "idem does not send client certificates to PostgreSQL",
                    plaintext: "it has ssl=off: use sslmode=disable there, or turn ssl on",
                },
            )),
            None => match e {
                // deadpool's own words ("Timeout occurred while creating a new object") name its internals.
                deadpool_postgres::PoolError::Timeout(_) => Error::ConnectTimeout(per_host),
                deadpool_postgres::PoolError::Backend(e) => Error::Server(e),
                other => Error::Connect(other),
            },
        })?;
        if !create {
            let found = client
                .query_opt("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1", &[&schema])
                .await
                .map_err(|source| Error::Migrate { schema: schema.to_owned(), source })?;
            if found.is_none() {
                return Ok(None);
            }
        }
        // The hosts besides the primary are the standbys idem would fail over to.
        let listed = hosts.saturating_sub(1);
        let coverage = crate::replication::coverage(&client, listed).await.map_err(Error::Server)?;
        if tls.synchronous_all && coverage.unwaited() > 0 {
            return Err(Error::NotSynchronous {
                standbys: coverage.standbys,
                waited: coverage.waited,
                setting: coverage.setting,
            });
        }
        crate::replication::judge(&coverage);
        migrate(&mut client, schema).await?;
        drop(client);
        let replication = crate::replication::watch(pool.clone(), listed, coverage);
        let sql = Sql::new(schema);
        let sweeper = {
            let sweeps = [sql.sweep_kv.clone(), sql.sweep_dedupe.clone(), sql.sweep_set_dedupe.clone()];
            let pool = pool.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(SWEEP_EVERY).await;
                    // Batches of 1000 until a batch comes back short (at most 100 per tick), so reclaiming
                    // keeps pace with expiring writes.
                    for _ in 0..100 {
                        let mut full = false;
                        for sql in &sweeps {
                            let deleted = match pool.get().await {
                                Ok(c) => c.execute(sql.as_str(), &[]).await.map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            };
                            match deleted {
                                Ok(n) => full |= n >= 1000,
                                Err(e) => tracing::warn!(error = %e, "sweeping expired rows failed; will retry"),
                            }
                        }
                        if !full {
                            break;
                        }
                    }
                }
            })
        };
        Ok(Some(Self { inner: Arc::new(Inner { pool, limits, sql, sweeper, replication }) }))
    }
}

fn ttl_args(ttl: Ttl) -> (i32, Option<f64>) {
    match ttl {
        Ttl::Keep => (0, None),
        Ttl::Clear => (1, None),
        Ttl::After(d) => (2, Some(ms(d))),
    }
}

/// Runs one statement that returns the written generation, or no row when its condition did not hold.
async fn returning<C: deadpool_postgres::GenericClient>(
    c: &C,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<Generation>, StoreError> {
    let stmt = c.prepare_cached(sql).await.map_err(pg_err)?;
    Ok(c.query_opt(&stmt, params).await.map_err(pg_err)?.map(|r| gen_of(r.get(0))))
}

/// The failed precondition, carrying the generation current now.
/// After a conditional write returned no row: the refusal, naming a current generation that fails
/// `precondition`, or `None` when the key changed between the refused statement and this read so that the
/// precondition now holds (a create-only put refused, then the key deleted): the caller tries the write again,
/// since a refusal naming "absent" for a create-only put would contradict itself.
async fn refusal<C: deadpool_postgres::GenericClient>(
    c: &C,
    sql: &Sql,
    key: &str,
    precondition: Precondition,
) -> Result<Option<StoreError>, StoreError> {
    let current = returning(c, &sql.read_generation, &[&key]).await?;
    Ok(precondition.check(current).err())
}

/// A live row read under its row lock (`SELECT ... FOR UPDATE`).
struct Live {
    value: Vec<u8>,
    generation: Generation,
}

async fn lock_row(tx: &Transaction<'_>, sql: &Sql, key: &str) -> Result<Option<Live>, StoreError> {
    let stmt = tx.prepare_cached(&sql.lock_row).await.map_err(pg_err)?;
    let row = tx.query_opt(&stmt, &[&key]).await.map_err(pg_err)?;
    Ok(row.map(|r| Live { value: r.get(0), generation: gen_of(r.get(1)) }))
}

/// Writes a read-modify-write result inside a transaction that holds the row lock (`current` is `Some`) or
/// found no live row (`None`). Returns `None` when a concurrent writer created the key meanwhile: the caller
/// runs its transaction again.
async fn write_locked(
    tx: &Transaction<'_>,
    sql: &Sql,
    key: &str,
    value: &[u8],
    current: Option<&Live>,
) -> Result<Option<Generation>, StoreError> {
    let none: Option<i64> = None;
    let keep = (0i32, None::<f64>);
    match current {
        Some(_) => returning(tx, &sql.update_if_present, &[&key, &value, &none, &keep.0, &keep.1]).await,
        None => create(tx, sql, key, &[&key, &value, &none, &keep.0, &keep.1]).await,
    }
}

/// Creates `key` (absent, or there but expired) with `insert_if_absent` and its `params`, inside the caller's
/// transaction, and numbers the new row once the transaction holds its lock. `None` when the key is live.
///
/// Why not the INSERT's own `nextval`: PostgreSQL evaluates it before the statement waits on a conflicting row.
/// When that row gets a newer version and is then deleted while the INSERT waits, the INSERT lands with a
/// number older than the version it followed, and a reader sees the key's generation go back (found by
/// `idem-verify`; test `generations::a_create_racing_a_write_and_a_delete_gets_a_higher_generation`).
/// A number taken under the new row's lock is above every version committed before it.
async fn create<C: deadpool_postgres::GenericClient>(
    tx: &C,
    sql: &Sql,
    key: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<Generation>, StoreError> {
    if returning(tx, &sql.insert_if_absent, params).await?.is_none() {
        return Ok(None);
    }
    returning(tx, &sql.renumber, &[&key]).await
}

/// [`create`] in a transaction of its own, committed when it created the key.
async fn create_alone(
    c: &mut deadpool_postgres::Object,
    sql: &Sql,
    key: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<Generation>, StoreError> {
    let tx = c.transaction().await.map_err(pg_err)?;
    let created = create(&tx, sql, key, params).await?;
    if created.is_some() {
        tx.commit().await.map_err(pg_err)?;
    } else {
        tx.rollback().await.map_err(pg_err)?;
    }
    Ok(created)
}

/// How often a read-modify-write transaction is retried when a concurrent create beat it to an absent key.
const CREATE_RACES: usize = 16;

impl Store for PostgresStore {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The server's `now()`, the clock every statement judges expiry by (in an autocommit `SELECT` it is the
    /// statement's start), in microseconds since the Unix epoch.
    async fn now(&self) -> Result<SystemTime, StoreError> {
        let client = self.inner.pool.get().await.map_err(pool_err)?;
        let stmt = client.prepare_cached("SELECT (extract(epoch FROM now()) * 1000000)::int8").await.map_err(pg_err)?;
        let micros: i64 = client.query_one(&stmt, &[]).await.map_err(pg_err)?.get(0);
        let micros = u64::try_from(micros).map_err(|_| StoreError::backend("the server's clock is before 1970"))?;
        Ok(SystemTime::UNIX_EPOCH + Duration::from_micros(micros))
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
        let mut c = self.inner.pool.get().await.map_err(pool_err)?;
        let sql = &self.inner.sql;
        let (mode, after) = ttl_args(ttl);
        let v: &[u8] = &value;
        let none: Option<i64> = None;
        if precondition == Precondition::Any {
            // Replace if live, else create; a race between the two (a concurrent create or delete) just means
            // trying again.
            for _ in 0..CREATE_RACES {
                if let Some(g) = returning(&c, &sql.update_if_present, &[&key, &v, &none, &mode, &after]).await? {
                    return Ok(Written::new(g, false));
                }
                if let Some(g) = create_alone(&mut c, sql, key, &[&key, &v, &none, &mode, &after]).await? {
                    return Ok(Written::new(g, true));
                }
            }
            return Err(StoreError::backend("unconditional put kept racing with creates and deletes"));
        }
        for _ in 0..CREATE_RACES {
            let written = match precondition {
                Precondition::Generation(g) => {
                    let g = i64::try_from(g.get()).unwrap_or(i64::MAX);
                    returning(&c, &sql.update_if_generation, &[&key, &v, &g, &mode, &after]).await?.map(|g| (g, false))
                }
                Precondition::Present | Precondition::Any => {
                    returning(&c, &sql.update_if_present, &[&key, &v, &none, &mode, &after]).await?.map(|g| (g, false))
                }
                Precondition::Absent => {
                    create_alone(&mut c, sql, key, &[&key, &v, &none, &mode, &after]).await?.map(|g| (g, true))
                }
            };
            match written {
                Some((g, created)) => return Ok(Written::new(g, created)),
                None => {
                    if let Some(refusal) = refusal(&c, sql, key, precondition).await? {
                        return Err(refusal);
                    }
                }
            }
        }
        Err(StoreError::backend("conditional put kept racing with creates and deletes"))
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        self.inner.limits.check_key(key)?;
        let c = self.inner.pool.get().await.map_err(pool_err)?;
        let sql = &self.inner.sql;
        let none: Option<i64> = None;
        for _ in 0..CREATE_RACES {
            let deleted = match precondition {
                Precondition::Generation(g) => {
                    let g = i64::try_from(g.get()).unwrap_or(i64::MAX);
                    returning(&c, &sql.delete_if_generation, &[&key, &g]).await?
                }
                Precondition::Present => returning(&c, &sql.delete_if_present, &[&key, &none]).await?,
                Precondition::Absent => {
                    // Nothing to delete when absent; when present, the precondition fails.
                    return match returning(&c, &sql.read_generation, &[&key]).await? {
                        None => Ok(None),
                        current => Err(StoreError::PreconditionFailed { current }),
                    };
                }
                Precondition::Any => {
                    let stmt = c.prepare_cached(&sql.delete_any).await.map_err(pg_err)?;
                    let row = c.query_opt(&stmt, &[&key]).await.map_err(pg_err)?;
                    // An expired row is removed too, but it was absent: report nothing deleted.
                    return Ok(row.filter(|r| r.get::<_, bool>(1)).map(|r| gen_of(r.get(0))));
                }
            };
            match deleted {
                Some(g) => return Ok(Some(g)),
                None => {
                    if let Some(refusal) = refusal(&c, sql, key, precondition).await? {
                        return Err(refusal);
                    }
                }
            }
        }
        Err(StoreError::backend("conditional delete kept racing with creates and deletes"))
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
        let items: Vec<ListItem> = rows
            .iter()
            .map(|r| ListItem {
                key: r.get(0),
                generation: gen_of(r.get(1)),
                expires_at_ms: r.get::<_, Option<SystemTime>>(2).map(system_time_to_millis),
            })
            .take_while(|i| i.key.starts_with(prefix))
            .collect();
        Ok(Page::from_fetched(items, limit))
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_set_change(key, &change)?;
        let sql = &self.inner.sql;
        let dedupe = change.dedupe_id.as_deref().map(|id| (id, change.fingerprint()));
        let mut c = self.inner.pool.get().await.map_err(pool_err)?;
        for _ in 0..CREATE_RACES {
            let tx = c.transaction().await.map_err(pg_err)?;
            let current = lock_row(&tx, sql, key).await?;
            if let Some((id, fingerprint)) = &dedupe
                && let Some(row) = tx.query_opt(&sql.set_dedupe_get, &[&key, id]).await.map_err(pg_err)?
            {
                if row.get::<_, String>(0) != *fingerprint {
                    return Err(StoreError::DedupeIdReused { key: key.to_owned(), dedupe_id: (*id).to_owned() });
                }
                return Ok(SetOutcome {
                    generation: row.get::<_, Option<i64>>(1).map(gen_of),
                    members: to_usize(row.get(2)),
                    added: to_usize(row.get(3)),
                    removed: to_usize(row.get(4)),
                    applied: false,
                });
            }
            let applied = apply_set(current.as_ref().map(|c| c.value.as_slice()), &change)?;
            let mut generation = current.as_ref().map(|c| c.generation);
            if applied.changed {
                match &applied.value {
                    Some(v) => {
                        limits.check_value(v)?;
                        match write_locked(&tx, sql, key, v, current.as_ref()).await? {
                            Some(g) => generation = Some(g),
                            None => continue,
                        }
                    }
                    None => {
                        tx.execute(&sql.delete_any, &[&key]).await.map_err(pg_err)?;
                        generation = None;
                    }
                }
            }
            let outcome = SetOutcome {
                generation,
                members: applied.members,
                added: applied.added,
                removed: applied.removed,
                applied: true,
            };
            if let Some((id, fingerprint)) = &dedupe {
                // A change that alters nothing takes no row lock, so two changes under one id can both get
                // here; the id's primary key decides, and the loser rolls back and looks again.
                let g = generation.map(|g| i64::try_from(g.get()).unwrap_or(i64::MAX));
                let counts = [outcome.members, outcome.added, outcome.removed].map(|n| i64::try_from(n).unwrap_or(0));
                let retention = ms(limits.dedupe_retention());
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 8] =
                    [&key, id, fingerprint, &g, &counts[0], &counts[1], &counts[2], &retention];
                if tx.query_opt(&sql.set_dedupe_put, &params).await.map_err(pg_err)?.is_none() {
                    continue;
                }
            }
            tx.commit().await.map_err(pg_err)?;
            return Ok(outcome);
        }
        Err(StoreError::backend("set change kept racing with concurrent creates"))
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_counter(key, dedupe_id)?;
        let sql = &self.inner.sql;
        let mut c = self.inner.pool.get().await.map_err(pool_err)?;
        for _ in 0..CREATE_RACES {
            let tx = c.transaction().await.map_err(pg_err)?;
            // The row lock comes first, so two adds with the same dedupe id serialise here and the second
            // sees the first's dedupe record.
            let current = lock_row(&tx, sql, key).await?;
            if let Some(id) = dedupe_id
                && let Some(row) = tx.query_opt(&sql.dedupe_get, &[&key, &id]).await.map_err(pg_err)?
            {
                // A NULL delta is a record written before migration 2, which kept no payload: it matches any
                // delta, as those versions answered.
                if row.get::<_, Option<i64>>(2).is_some_and(|seen| seen != delta) {
                    return Err(StoreError::DedupeIdReused { key: key.to_owned(), dedupe_id: id.to_owned() });
                }
                return Ok(CounterOutcome { value: row.get(0), generation: gen_of(row.get(1)), applied: false });
            }
            let applied = apply_counter(current.as_ref().map(|c| c.value.as_slice()), delta)?;
            let Some(g) = write_locked(&tx, sql, key, &applied.encode(), current.as_ref()).await? else { continue };
            if let Some(id) = dedupe_id {
                let g_i64 = i64::try_from(g.get()).unwrap_or(i64::MAX);
                let retention = ms(limits.dedupe_retention());
                tx.execute(&sql.dedupe_put, &[&key, &id, &applied.value, &g_i64, &retention, &delta])
                    .await
                    .map_err(pg_err)?;
            }
            tx.commit().await.map_err(pg_err)?;
            return Ok(CounterOutcome { value: applied.value, generation: g, applied: true });
        }
        Err(StoreError::backend("counter add kept racing with concurrent creates"))
    }
}
