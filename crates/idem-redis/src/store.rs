use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written, millis_to_system_time,
};
use redis::aio::ConnectionManager;
use redis::{Cmd, Script, Value};

use crate::conn::{Conn, SentinelConn};
use crate::error::{Error, first_connect_error, redis_err};
use crate::topology::Wait;
use crate::topology::{Source, Topology};
use crate::url::Target;

mod send;

/// How often the key index is walked to drop members whose value expired.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

struct Scripts {
    put: Script,
    delete: Script,
    get: Script,
    list: Script,
    set: Script,
    counter: Script,
    sweep: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            put: Script::new(concat!(include_str!("lua/precondition.lua"), include_str!("lua/put.lua"))),
            delete: Script::new(concat!(include_str!("lua/precondition.lua"), include_str!("lua/delete.lua"))),
            get: Script::new(include_str!("lua/get.lua")),
            list: Script::new(include_str!("lua/list.lua")),
            set: Script::new(include_str!("lua/set.lua")),
            counter: Script::new(include_str!("lua/counter.lua")),
            sweep: Script::new(include_str!("lua/sweep.lua")),
        }
    }
}

/// The Redis store. Cheap to clone: clones share one auto-reconnecting multiplexed connection (per Cluster
/// node on a Cluster).
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Reads, and the sweeper's removals (they may run twice).
    conn: Conn,
    /// Writes: on a Cluster a client that never sends a command twice; elsewhere the same as `conn`.
    writes: std::sync::Mutex<Conn>,
    /// On a Cluster, the client `writes` comes from: a connection that does not resend does not repair its
    /// slot map either, so after a failover `write` replaces it with a fresh one.
    cluster_writes: Option<redis::cluster::ClusterClient>,
    limits: Limits,
    /// What every Redis key of the store starts with: the prefix, in braces on a Cluster so that it is the
    /// hash tag of every key and each script's keys share one slot.
    prefix: String,
    /// The store's generation counter and key index (`{prefix}generation`, `{prefix}index`), made once: a
    /// `format!` per write cost about 1,000 instructions each, 4% of a proxy's first execution.
    generation_key: String,
    index_key: String,
    wait: Option<Wait>,
    /// The master's replicas as the failover manager knows them (`wait_replicas=all` waits for each).
    topology: Topology,
    scripts: Scripts,
    sweeper: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.sweeper.abort();
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("prefix", &self.inner.prefix).finish_non_exhaustive()
    }
}

fn unexpected(what: &str) -> StoreError {
    StoreError::backend(format!("unexpected reply from a Redis script: {what}"))
}

fn int(v: &Value) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        other => Err(unexpected(&format!("{other:?} where an integer was expected"))),
    }
}

fn bulk(v: Value) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        other => Err(unexpected(&format!("{other:?} where a string was expected"))),
    }
}

fn array(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(unexpected(&format!("{other:?} where an array was expected"))),
    }
}

fn generation(n: i64) -> Option<Generation> {
    u64::try_from(n).ok().map(Generation::new)
}

fn expiry_ms(n: i64) -> Option<u64> {
    u64::try_from(n).ok()
}

fn precondition_args(p: Precondition) -> (&'static str, u64) {
    match p {
        Precondition::Any => ("any", 0),
        Precondition::Absent => ("absent", 0),
        Precondition::Present => ("present", 0),
        Precondition::Generation(g) => ("gen", g.get()),
    }
}

/// `EVALSHA` of `script` with `keys`; the caller adds the arguments.
/// Drops the key index's entries for expired keys in the background, up to 100 batches of 1000 every
/// [`SWEEP_EVERY`]; aborted when the store is dropped.
fn spawn_sweeper(mut conn: Conn, prefix: String, script: Script) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut start = "-".to_owned();
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            // Walk up to 100 batches per tick, so dropping dead index entries keeps pace with expiry.
            for _ in 0..100 {
                let r: Result<String, _> = script
                    .key(format!("{prefix}index"))
                    .arg(format!("{prefix}k:"))
                    .arg(&start)
                    .arg(1000)
                    .invoke_async(&mut conn)
                    .await;
                match r {
                    Ok(next) if next.is_empty() => {
                        start = "-".to_owned();
                        break;
                    }
                    Ok(next) => start = next,
                    // A failover closes the connection under the sweep: that is the store away for
                    // a moment, not a fault of the sweep.
                    Err(e) if redis_err(e.clone()).is_unavailable() => {
                        tracing::info!(error = %e, "sweeping the key index waits for the store; will retry");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "sweeping the key index failed; will retry");
                        break;
                    }
                }
            }
        }
    })
}

fn evalsha(script: &Script, keys: &[&str]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys.len()).arg(keys);
    cmd
}

impl RedisStore {
    /// Connects to `url`; every Redis key this store uses starts with `prefix` (e.g. `"idem:"`), so several
    /// stores can share one Redis database.
    ///
    /// `url` is one of:
    /// - `redis://[[user]:password@]host:port[/db]` (`rediss://` for TLS): one server;
    /// - `redis+sentinel://[[user]:password@]host:port,host:port/MASTER[/db]` (`rediss+sentinel://` for TLS to
    ///   the Sentinels and the master): the master the Sentinels (default port 26379) name for `MASTER`, asked
    ///   for again after a connection error or a `READONLY` answer, so the store follows a failover by itself;
    ///   `sentinel_username` and `sentinel_password` authenticate to the Sentinels, the userinfo to the master;
    /// - `redis+cluster://[[user]:password@]host:port,host:port` (`rediss+cluster://`): a Redis or Valkey
    ///   Cluster, through the redis crate's cluster client, which follows `MOVED`/`ASK` and slot migrations.
    ///   The prefix in braces is the hash tag of every key of the store (`{idem:}k:…`), so every key a script
    ///   touches, and the store's generation counter and key index, share one hash slot: one store lives on
    ///   one master (and its replicas), and a Cluster spreads several stores (namespaces) over its masters.
    ///
    /// `wait_replicas=N` (default 0: off) makes every write (a put, a delete, a set change, a counter add) wait
    /// until `N` replicas acknowledged it (`WAIT N T`, `T` = `wait_timeout_ms`, default 1000): with fewer
    /// acknowledgements by then the write fails with [`idem_store::Error::Unavailable`] (it was applied on the
    /// master and may or may not survive a failover), never a silent success. Without it, Redis replicates
    /// asynchronously and a write acknowledged by a master that dies before a replica copied it is lost when
    /// that replica takes over.
    ///
    /// TLS (`rediss…`) verifies the server's certificate chain and host name against the platform's trust
    /// store, or against the PEM file of a `cacert=PATH` query parameter (redis-cli's `--cacert`), which idem
    /// takes out of the URL before the redis crate sees it. There is no way to switch verification off.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`]; [`Error::UnknownParameter`], [`Error::InvalidParameter`], [`Error::InvalidHost`],
    /// [`Error::NoMasterName`], [`Error::InvalidPrefix`]; [`Error::CaCert`], [`Error::CaCertWithoutTls`];
    /// [`Error::Connect`] when the server (no Sentinel, no Cluster node) cannot be reached; [`Error::Handshake`]
    /// when the TLS handshake fails or a `rediss://` server gives no TLS answer within 5 s.
    pub async fn connect(url: &str, prefix: &str, limits: Limits) -> Result<Self, Error> {
        let parsed = crate::url::parse(url)?;
        let tls = parsed.tls;
        let timeout = Some(Duration::from_secs(5));
        let (conn, writes, prefix, source) = match parsed.target {
            Target::Single(client) => {
                // One plain connection first, so an unreachable server fails start-up at once; the manager
                // below would keep retrying, which is what we want later, not now.
                crate::error::probe(&client, tls, timeout).await?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(Some(Duration::from_secs(10)))
                    // While Redis is down a request should get its 503 in about a second, not wait through the
                    // default six reconnect attempts (~9 s); the next request after Redis returns reconnects anyway.
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500));
                let conn = ConnectionManager::new_with_config(client, config).await.map_err(Error::Connect)?;
                (Conn::Single(conn), None, prefix.to_owned(), Source::Single)
            }
            Target::Sentinel(builder, db, sentinels) => {
                let client = builder.build().map_err(Error::InvalidUrl)?;
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(Some(Duration::from_secs(10)));
                let mut sentinels = sentinels;
                let conn = match SentinelConn::connect(client, config, db).await {
                    Ok(conn) => conn,
                    // Mid-failover the Sentinels name no master for a moment (the old one is down, the new one
                    // not yet promoted): an outage. A name no Sentinel knows is a mistake in the URL.
                    Err(e) if e.kind() == redis::ErrorKind::MasterNameNotFoundBySentinel => {
                        return Err(match sentinels.knows_master().await {
                            Some(false) => Error::NoSuchMaster(sentinels.master().to_owned()),
                            // The redis crate says "not found" for a master it could not reach too: name the
                            // address, so an operator looks at that server, not at the URL's spelling.
                            Some(true) => Error::MasterAway {
                                name: sentinels.master().to_owned(),
                                addr: sentinels.master_addr().await,
                                source: e,
                            },
                            None => Error::Connect(e),
                        });
                    }
                    Err(e) => return Err(first_connect_error(e, tls, &sentinels.addrs(), false).await),
                };
                (Conn::Sentinel(conn), None, prefix.to_owned(), Source::Sentinel(sentinels))
            }
            Target::Cluster(spec) => {
                if prefix.contains(['{', '}']) {
                    return Err(Error::InvalidPrefix(prefix.to_owned()));
                }
                let client = |retries: Option<u32>| {
                    let mut b = spec
                        .builder()
                        .connection_timeout(Duration::from_secs(5))
                        .response_timeout(Duration::from_secs(10));
                    if let Some(n) = retries {
                        b = b.retries(n);
                    }
                    b.build().map_err(Error::InvalidUrl)
                };
                let reads = match client(None)?.get_async_connection().await {
                    Ok(reads) => reads,
                    Err(e) => return Err(first_connect_error(e, tls, &spec.addrs(), true).await),
                };
                // The cluster client sends a command again after its connection dropped, when it may have run:
                // right for reads, wrong for a write (a counter add applied twice, a put refused by its own
                // first copy). Writes go through a client that never resends; `write` retries refusals
                // that ran nothing (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) itself.
                let once = client(Some(0))?;
                let writes = match once.get_async_connection().await {
                    Ok(writes) => writes,
                    Err(e) => return Err(first_connect_error(e, tls, &spec.addrs(), true).await),
                };
                let prefix = format!("{{{prefix}}}");
                let slot: u16 = redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(format!("{prefix}generation"))
                    .query_async(&mut Conn::Cluster(reads.clone()))
                    .await
                    .map_err(Error::Connect)?;
                (Conn::Cluster(reads), Some((Conn::Cluster(writes), once)), prefix, Source::Cluster { slot })
            }
        };
        let topology = Topology::start(source, conn.clone(), parsed.wait).await.map_err(Error::Connect)?;
        let scripts = Scripts::new();
        let sweeper = spawn_sweeper(conn.clone(), prefix.clone(), scripts.sweep.clone());
        let (writes, cluster_writes) = match writes {
            Some((writes, client)) => (writes, Some(client)),
            None => (conn.clone(), None),
        };
        let writes = std::sync::Mutex::new(writes);
        let (generation_key, index_key) =
            ([prefix.as_str(), "generation"].concat(), [prefix.as_str(), "index"].concat());
        let inner = Inner {
            conn,
            writes,
            cluster_writes,
            limits,
            prefix,
            generation_key,
            index_key,
            wait: parsed.wait,
            topology,
            scripts,
            sweeper,
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    fn value_key(&self, key: &str) -> String {
        [self.inner.prefix.as_str(), "k:", key].concat()
    }

    fn generation_key(&self) -> &str {
        &self.inner.generation_key
    }

    fn index_key(&self) -> &str {
        &self.inner.index_key
    }

    fn dedupe_key(&self, key: &str, id: &str) -> String {
        // The key's length first, so no key/id pair can spell another pair's record name.
        format!("{}d:{}:{key}:{id}", self.inner.prefix, key.len())
    }

    fn set_dedupe_key(&self, key: &str, id: &str) -> String {
        format!("{}sd:{}:{key}:{id}", self.inner.prefix, key.len())
    }

    fn conn(&self) -> Conn {
        self.inner.conn.clone()
    }

    fn writes(&self) -> Conn {
        self.inner.writes.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Store for RedisStore {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The server's `TIME` (seconds and microseconds), the clock its scripts compute expiry instants from.
    async fn now(&self) -> Result<std::time::SystemTime, StoreError> {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut self.conn()).await.map_err(redis_err)?;
        Ok(std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros))
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.inner.limits.check_key(key)?;
        let script = &self.inner.scripts.get;
        let r = self.read(script, &evalsha(script, &[&self.value_key(key)])).await?;
        let mut r = array(r)?.into_iter();
        let (Some(v), Some(g), Some(e)) = (r.next(), r.next(), r.next()) else { return Ok(None) };
        let g = generation(int(&g)?).ok_or_else(|| unexpected("negative generation"))?;
        Ok(Some(Versioned::new(Bytes::from(bulk(v)?), g, expiry_ms(int(&e)?).map(millis_to_system_time))))
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        self.inner.limits.check_put(key, &value, &ttl)?;
        let (kind, expected) = precondition_args(precondition);
        let (ttl_kind, ttl_ms) = match ttl {
            Ttl::Keep => ("keep", 0),
            Ttl::Clear => ("clear", 0),
            Ttl::After(d) => ("after", u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        let script = &self.inner.scripts.put;
        let mut cmd = evalsha(script, &[&self.value_key(key), self.generation_key(), self.index_key()]);
        cmd.arg(value.as_ref()).arg(kind).arg(expected).arg(ttl_kind).arg(ttl_ms).arg(key);
        let r = self.write(script, &cmd).await?;
        let r = array(r)?;
        match r.as_slice() {
            [ok, cur] if int(ok)? == 0 => Err(StoreError::PreconditionFailed { current: generation(int(cur)?) }),
            [_, g, created] => Ok(Written::new(
                generation(int(g)?).ok_or_else(|| unexpected("negative generation"))?,
                int(created)? == 1,
            )),
            _ => Err(unexpected("put")),
        }
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        self.inner.limits.check_key(key)?;
        let (kind, expected) = precondition_args(precondition);
        let script = &self.inner.scripts.delete;
        let mut cmd = evalsha(script, &[&self.value_key(key), self.index_key()]);
        cmd.arg(kind).arg(expected).arg(key);
        let r = self.write(script, &cmd).await?;
        match array(r)?.as_slice() {
            [ok, cur] if int(ok)? == 0 => Err(StoreError::PreconditionFailed { current: generation(int(cur)?) }),
            [_, deleted] => Ok(generation(int(deleted)?)),
            _ => Err(unexpected("delete")),
        }
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        if !(1..=1000).contains(&limit) {
            return Err(StoreError::InvalidArgument { what: "limit" });
        }
        let start = match cursor.filter(|c| *c >= prefix) {
            Some(c) => format!("({c}"),
            None => format!("[{prefix}"),
        };
        let script = &self.inner.scripts.list;
        let mut cmd = evalsha(script, &[self.index_key()]);
        cmd.arg(format!("{}k:", self.inner.prefix)).arg(start).arg(limit + 1).arg(prefix);
        let r = self.read(script, &cmd).await?;
        let flat = array(r)?;
        let mut items = Vec::with_capacity(flat.len() / 3);
        let mut it = flat.into_iter();
        while let (Some(k), Some(g), Some(e)) = (it.next(), it.next(), it.next()) {
            let key = String::from_utf8(bulk(k)?).map_err(|_| unexpected("non-UTF-8 key in the index"))?;
            let generation = generation(int(&g)?).ok_or_else(|| unexpected("negative generation"))?;
            items.push(ListItem { key, generation, expires_at_ms: expiry_ms(int(&e)?) });
        }
        Ok(Page::from_fetched(items, limit))
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_set_change(key, &change)?;
        let id = change.dedupe_id.as_deref().unwrap_or("");
        let fingerprint = change.dedupe_id.as_ref().map(|_| change.fingerprint()).unwrap_or_default();
        let retention_ms = u64::try_from(limits.dedupe_retention().as_millis()).unwrap_or(u64::MAX);
        let script = &self.inner.scripts.set;
        let mut cmd = evalsha(
            script,
            &[&self.value_key(key), self.generation_key(), self.index_key(), &self.set_dedupe_key(key, id)],
        );
        cmd.arg(limits.max_value_bytes()).arg(key).arg(id).arg(fingerprint).arg(retention_ms).arg(change.add.len());
        for m in change.add.iter().chain(&change.remove) {
            cmd.arg(m);
        }
        let r = self.write(script, &cmd).await?;
        match array(r)?.as_slice() {
            [code] if int(code)? == -1 => Err(StoreError::WrongType { expected: "set" }),
            [code] if int(code)? == -2 => {
                Err(StoreError::ValueTooLarge { size: limits.max_value_bytes() + 1, max: limits.max_value_bytes() })
            }
            [code] if int(code)? == -3 => {
                Err(StoreError::DedupeIdReused { key: key.to_owned(), dedupe_id: id.to_owned() })
            }
            [g, members, added, removed, applied] => Ok(SetOutcome {
                generation: generation(int(g)?),
                members: usize::try_from(int(members)?).unwrap_or(0),
                added: usize::try_from(int(added)?).unwrap_or(0),
                removed: usize::try_from(int(removed)?).unwrap_or(0),
                applied: int(applied)? == 1,
            }),
            _ => Err(unexpected("set")),
        }
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        let limits = self.inner.limits;
        limits.check_counter(key, dedupe_id)?;
        let retention_ms = u64::try_from(limits.dedupe_retention().as_millis()).unwrap_or(u64::MAX);
        let script = &self.inner.scripts.counter;
        let mut cmd = evalsha(
            script,
            &[
                &self.value_key(key),
                self.generation_key(),
                self.index_key(),
                &self.dedupe_key(key, dedupe_id.unwrap_or("")),
            ],
        );
        cmd.arg(delta).arg(dedupe_id.unwrap_or("")).arg(retention_ms).arg(key);
        let r = self.write(script, &cmd).await?;
        let r = array(r)?;
        if let [code] = r.as_slice() {
            return Err(match int(code)? {
                -2 => StoreError::CounterOverflow,
                -3 => StoreError::DedupeIdReused {
                    key: key.to_owned(),
                    dedupe_id: dedupe_id.unwrap_or_default().to_owned(),
                },
                _ => StoreError::WrongType { expected: "counter" },
            });
        }
        let mut it = r.into_iter();
        let (Some(applied), Some(value), Some(g)) = (it.next(), it.next(), it.next()) else {
            return Err(unexpected("counter"));
        };
        let value = String::from_utf8(bulk(value)?)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| unexpected("non-integer counter"))?;
        Ok(CounterOutcome {
            value,
            generation: generation(int(&g)?).ok_or_else(|| unexpected("negative generation"))?,
            applied: int(&applied)? == 1,
        })
    }
}
