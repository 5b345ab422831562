use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome,
    Store, Ttl, Versioned, Written, millis_to_system_time,
};
use percent_encoding::percent_decode_str;
use redis::aio::ConnectionManager;
use redis::{Script, Value};

/// How often the key index is walked to drop members whose value expired.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Errors connecting to Redis. Operations on a connected store return [`idem_store::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL is not a Redis URL.
    #[error("invalid Redis URL")]
    InvalidUrl(#[source] redis::RedisError),
    /// The `cacert` file cannot be read or holds no PEM certificate.
    #[error(transparent)]
    CaCert(idem_tls::Error),
    /// A query parameter neither idem (`cacert`) nor the redis crate (`protocol`) reads from a TCP URL (the
    /// crate ignores `db`, `user` and `pass` there: the database goes in the path, the user and password before
    /// the host). Refused rather than ignored: a setting the user believes in must not be dropped
    /// silently (`ssl_cert_reqs=none`, say, would not switch certificate checks off).
    #[error(
        "unknown Redis URL parameter {0:?}: idem knows cacert=FILE and protocol=resp2|resp3 (the database number \
         goes in the path: redis://HOST:PORT/2)"
    )]
    UnknownParameter(String),
    /// `#insecure`, the redis crate's switch for unverified TLS: idem has no such switch.
    #[error("#insecure would turn certificate checks off, which idem does not do; give cacert=FILE for a private CA")]
    Insecure,
    /// The TLS handshake with the server failed: its certificate was refused (the message says why: unknown
    /// issuer, expired, host name mismatch) or the server does not speak TLS.
    #[error("TLS to the Redis server failed: {0}")]
    Handshake(String),
    /// `cacert` was given on a `redis://` URL, which never uses TLS.
    #[error("cacert needs a rediss:// URL; redis:// does not use TLS")]
    CaCertWithoutTls,
    /// The server could not be reached or did not answer in time (the cause is the source).
    #[error("cannot connect")]
    Connect(#[source] redis::RedisError),
    /// An operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

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

/// The Redis store. Cheap to clone: clones share one auto-reconnecting multiplexed connection.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: ConnectionManager,
    limits: Limits,
    prefix: String,
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

/// Connection trouble is `Unavailable` (503, retry later); anything else Redis said is `Backend`.
fn redis_err(e: redis::RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        StoreError::unavailable(e)
    } else {
        StoreError::backend(e)
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

/// The client for `url`, with the roots of its `cacert` parameter when there is one.
fn client(url: &str) -> Result<redis::Client, Error> {
    // The redis crate builds its rustls config on the process's default provider; name ring (the only one
    // compiled in) so that holds even if another crate ever brings a second provider. Already set is fine.
    idem_tls::install_default_provider();
    // A fragment (`#insecure`, which the redis crate refuses without its insecure feature) comes last in a URL;
    // it is kept for the crate to judge.
    if url.split_once('#').is_some_and(|(_, f)| f == "insecure") {
        return Err(Error::Insecure);
    }
    let (without_fragment, fragment) = match url.split_once('#') {
        Some((u, f)) => (u, format!("#{f}")),
        None => (url, String::new()),
    };
    let (base, query) = without_fragment.split_once('?').unwrap_or((without_fragment, ""));
    let mut cacert = None;
    let mut rest = Vec::new();
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = param.split_once('=').unwrap_or((param, ""));
        // Judged decoded, as reported: `c%61cert` is `cacert`.
        let name = percent_decode_str(name).decode_utf8_lossy();
        match name.as_ref() {
            "cacert" => cacert = Some(percent_decode_str(value).decode_utf8_lossy().into_owned()),
            // The only one the redis crate reads from a TCP URL's query; `db`, `user` and `pass` it reads for
            // `redis+unix:` only, which idem does not take, and ignores here.
            "protocol" => rest.push(param),
            _ => return Err(Error::UnknownParameter(name.into_owned())),
        }
    }
    let Some(cacert) = cacert else {
        return redis::Client::open(url).map_err(Error::InvalidUrl);
    };
    let url =
        if rest.is_empty() { format!("{base}{fragment}") } else { format!("{base}?{}{fragment}", rest.join("&")) };
    if !(url.starts_with("rediss://") || url.starts_with("valkeys://")) {
        return Err(Error::CaCertWithoutTls);
    }
    let path = std::path::PathBuf::from(cacert);
    // Checked here (a clear error now, not a failed handshake later); the redis crate wants the PEM bytes.
    idem_tls::read_roots("cacert", &path).map_err(Error::CaCert)?;
    let pem = std::fs::read(&path)
        .map_err(|source| Error::CaCert(idem_tls::Error::Read { flag: "cacert".into(), path: path.clone(), source }))?;
    redis::Client::build_with_tls(url.as_str(), redis::TlsCertificates { client_tls: None, root_cert: Some(pem) })
        .map_err(Error::InvalidUrl)
}

/// The kind of the I/O error behind `e`, if that is what it is (the redis crate keeps it in an `Arc`).
fn io_error_kind(e: &redis::RedisError) -> Option<std::io::ErrorKind> {
    let source = std::error::Error::source(e)?;
    let inner = match source.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
        Some(shared) => &**shared as &(dyn std::error::Error + 'static),
        None => source,
    };
    inner.downcast_ref::<std::io::Error>().map(std::io::Error::kind)
}

/// A failed first connection in words: a refused certificate said as [`idem_tls::describe`] says it, and a
/// TLS connection that timed out named as what it usually is (a plain Redis port: it reads the TLS hello as a
/// command and waits for the rest of the line, so the handshake never ends).
fn connect_error(e: redis::RedisError, tls: bool) -> Error {
    if let Some(refused) = idem_tls::rustls_error_in(&e) {
        let hints = idem_tls::Hints {
            peer: "Redis server",
            trust: "cacert=FILE in the URL",
            client_cert: "idem does not send client certificates to Redis",
            plaintext: "is this a plain Redis port? then use redis://",
        };
        return Error::Handshake(idem_tls::describe(refused, hints));
    }
    if !tls && io_error_kind(&e) == Some(std::io::ErrorKind::ConnectionReset) {
        return Error::Handshake(
            "the server reset the connection: is this a TLS port? then use rediss:// (with cacert=FILE for a \
             private CA)"
                .into(),
        );
    }
    if tls && e.is_timeout() {
        return Error::Handshake(
            "no TLS answer within 5s: is this a plain Redis port? (it never answers a TLS handshake; use redis:// \
             or the server's tls-port)"
                .into(),
        );
    }
    Error::Connect(e)
}

impl RedisStore {
    /// Connects to `url` (`redis://[[user]:password@]host:port[/db]`, or `rediss://…` for TLS); every Redis key
    /// this store uses starts with `prefix` (e.g. `"idem:"`), so several stores can share one Redis database.
    ///
    /// `rediss://` verifies the server's certificate chain and host name against the platform's trust store,
    /// or against the PEM file of a `cacert=PATH` query parameter (redis-cli's `--cacert`), which idem takes
    /// out of the URL before the redis crate sees it. There is no way to switch verification off.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`]; [`Error::UnknownParameter`]; [`Error::CaCert`], [`Error::CaCertWithoutTls`];
    /// [`Error::Connect`] when the server cannot be reached; [`Error::Handshake`] when the TLS handshake fails
    /// or a `rediss://` server gives no TLS answer within 5 s.
    pub async fn connect(url: &str, prefix: &str, limits: Limits) -> Result<Self, Error> {
        let client = client(url)?;
        // One plain connection first, so an unreachable server fails start-up at once; the manager below
        // would keep retrying, which is what we want later, not now.
        let probe = redis::AsyncConnectionConfig::new().set_connection_timeout(Some(Duration::from_secs(5)));
        let tls = url.starts_with("rediss://") || url.starts_with("valkeys://");
        client.get_multiplexed_async_connection_with_config(&probe).await.map_err(|e| connect_error(e, tls))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(10)))
            // While Redis is down a request should get its 503 in about a second, not wait through the default
            // six reconnect attempts (~9 s); the next request after Redis returns reconnects anyway.
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config).await.map_err(Error::Connect)?;
        let scripts = Scripts::new();
        let sweeper = {
            let (mut conn, prefix, script) = (conn.clone(), prefix.to_owned(), scripts.sweep.clone());
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
                            Err(e) => {
                                tracing::warn!(error = %e, "sweeping the key index failed; will retry");
                                break;
                            }
                        }
                    }
                }
            })
        };
        Ok(Self { inner: Arc::new(Inner { conn, limits, prefix: prefix.to_owned(), scripts, sweeper }) })
    }

    fn value_key(&self, key: &str) -> String {
        format!("{}k:{key}", self.inner.prefix)
    }

    fn generation_key(&self) -> String {
        format!("{}generation", self.inner.prefix)
    }

    fn index_key(&self) -> String {
        format!("{}index", self.inner.prefix)
    }

    fn dedupe_key(&self, key: &str, id: &str) -> String {
        // The key's length first, so no key/id pair can spell another pair's record name.
        format!("{}d:{}:{key}:{id}", self.inner.prefix, key.len())
    }

    fn set_dedupe_key(&self, key: &str, id: &str) -> String {
        format!("{}sd:{}:{key}:{id}", self.inner.prefix, key.len())
    }

    fn conn(&self) -> ConnectionManager {
        self.inner.conn.clone()
    }
}

impl Store for RedisStore {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.inner.limits.check_key(key)?;
        let r: Value =
            self.inner.scripts.get.key(self.value_key(key)).invoke_async(&mut self.conn()).await.map_err(redis_err)?;
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
        let r: Value = self
            .inner
            .scripts
            .put
            .key(self.value_key(key))
            .key(self.generation_key())
            .key(self.index_key())
            .arg(value.as_ref())
            .arg(kind)
            .arg(expected)
            .arg(ttl_kind)
            .arg(ttl_ms)
            .arg(key)
            .invoke_async(&mut self.conn())
            .await
            .map_err(redis_err)?;
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
        let r: Value = self
            .inner
            .scripts
            .delete
            .key(self.value_key(key))
            .key(self.index_key())
            .arg(kind)
            .arg(expected)
            .arg(key)
            .invoke_async(&mut self.conn())
            .await
            .map_err(redis_err)?;
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
        let r: Value = self
            .inner
            .scripts
            .list
            .key(self.index_key())
            .arg(format!("{}k:", self.inner.prefix))
            .arg(start)
            .arg(limit + 1)
            .arg(prefix)
            .invoke_async(&mut self.conn())
            .await
            .map_err(redis_err)?;
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
        let mut inv = self.inner.scripts.set.key(self.value_key(key));
        inv.key(self.generation_key())
            .key(self.index_key())
            .key(self.set_dedupe_key(key, id))
            .arg(limits.max_value_bytes())
            .arg(key)
            .arg(id)
            .arg(fingerprint)
            .arg(retention_ms)
            .arg(change.add.len());
        for m in change.add.iter().chain(&change.remove) {
            inv.arg(m);
        }
        let r: Value = inv.invoke_async(&mut self.conn()).await.map_err(redis_err)?;
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
        let r: Value = self
            .inner
            .scripts
            .counter
            .key(self.value_key(key))
            .key(self.generation_key())
            .key(self.index_key())
            .key(self.dedupe_key(key, dedupe_id.unwrap_or("")))
            .arg(delta)
            .arg(dedupe_id.unwrap_or(""))
            .arg(retention_ms)
            .arg(key)
            .invoke_async(&mut self.conn())
            .await
            .map_err(redis_err)?;
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
