//! [`Error`], and how what Redis answers is judged: connection trouble and a failover in progress are
//! unavailable (503, retry later), a refusal that ran nothing may be sent again, anything else is a backend
//! error.

use std::sync::Arc;
use std::time::Duration;

use idem_store::Error as StoreError;

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
    /// A query parameter neither idem (`cacert`, `wait_replicas`, `wait_timeout_ms`, and on Sentinel URLs
    /// `sentinel_username`, `sentinel_password`) nor the redis crate (`protocol`) reads from a TCP URL (the
    /// crate ignores `db`, `user` and `pass` there: the database goes in the path, the user and password before
    /// the host). Refused rather than ignored: a setting the user believes in must not be dropped
    /// silently (`ssl_cert_reqs=none`, say, would not switch certificate checks off).
    #[error(
        "unknown Redis URL parameter {0:?}: idem knows cacert=FILE, wait_replicas=N, wait_timeout_ms=MS, \
         protocol=resp2|resp3 and on redis+sentinel:// URLs sentinel_username and sentinel_password (the database \
         number goes in the path: redis://HOST:PORT/2)"
    )]
    UnknownParameter(String),
    /// A parameter idem knows has a value it cannot take (`why` says what it takes).
    #[error("Redis URL parameter {name}: expected {why}")]
    InvalidParameter {
        /// The parameter.
        name: String,
        /// What it takes.
        why: &'static str,
    },
    /// A host of a Sentinel or Cluster URL is not `host`, `host:port` or `[v6]:port`, or its path is not a
    /// master name and database number.
    #[error("invalid host or path {0:?} in a Redis URL")]
    InvalidHost(String),
    /// A `redis+sentinel://` URL without the master's name (`redis+sentinel://HOST:26379/MASTER`).
    #[error("a redis+sentinel:// URL names the master after the hosts: redis+sentinel://HOST:26379,HOST:26379/MASTER")]
    NoMasterName,
    /// A key prefix with `{` or `}` on a Cluster, where idem puts the prefix in braces as the hash tag of every
    /// key of the store.
    #[error("key prefix {0:?}: on a Redis Cluster the prefix is the keys' hash tag and may not contain braces")]
    InvalidPrefix(String),
    /// No Sentinel knows a master of the URL's name (each that answered said "No such master with that name"):
    /// a misspelt name, not a failover in progress (then the Sentinels know the name and, for a moment, no
    /// master to give for it: [`Error::Connect`], unavailable).
    #[error("no Sentinel monitors a master named {0:?} (SENTINEL MASTERS lists the names)")]
    NoSuchMaster(String),
    /// The Sentinels monitor the master of the URL's name but it could not be reached as a master (down,
    /// refusing connections, or demoted mid-failover and none promoted yet): an outage, unavailable like
    /// [`Error::Connect`]. `addr` is where the Sentinels last said the master is (`host:port`), when one said.
    #[error(
        "the Sentinels monitor master {name:?}{} but it does not answer as a master (down, or a failover in \
         progress): the store is unavailable",
        addr.as_deref().map(|a| format!(" at {a}")).unwrap_or_default()
    )]
    MasterAway {
        /// The master's name in the URL.
        name: String,
        /// Where the Sentinels say it is.
        addr: Option<String>,
        /// What connecting to it said.
        #[source]
        source: redis::RedisError,
    },
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
    /// The server (or no Sentinel, or no Cluster node) could not be reached or did not answer in time (the
    /// cause is the source).
    #[error("cannot connect")]
    Connect(#[source] redis::RedisError),
    /// An operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Error {
    /// True when the server could not be reached for now ([`Error::Connect`] for a refused, reset or dropped
    /// connection or no answer in time; a store operation that found it unavailable): trying again later may
    /// succeed. A bad URL, a refused login or a failed TLS handshake is false.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::Connect(e) => redis_err(e.clone()).is_unavailable(),
            Error::MasterAway { .. } => true,
            Error::Store(e) => e.is_unavailable(),
            _ => false,
        }
    }
}

/// Connection trouble is `Unavailable` (503, retry later); anything else Redis said is `Backend`. A failover
/// in progress is connection trouble too: a demoted master's `READONLY`, a Cluster's `CLUSTERDOWN`,
/// `MASTERDOWN` or `TRYAGAIN`, a server still `LOADING` its data, Sentinels that name no reachable master, a
/// Cluster node the client has no connection to yet.
pub(crate) fn redis_err(e: redis::RedisError) -> StoreError {
    use redis::ServerErrorKind as K;
    let failover = matches!(
        e.kind(),
        redis::ErrorKind::Server(K::ReadOnly | K::ClusterDown | K::MasterDown | K::TryAgain | K::BusyLoading)
            // The Sentinels name no reachable master: the old one is down and none is promoted yet.
            | redis::ErrorKind::MasterNameNotFoundBySentinel
            | redis::ErrorKind::ClusterConnectionNotFound
    ) || ran_nothing(&e)
        // A `WAIT` released because its node became a replica (a switchover took the master away while the
        // write waited for its replicas): the write ran and may or may not survive.
        || said(&e, "UNBLOCKED")
        // The master's own floor of replicas (`min-replicas-to-write`) is not met: it ran nothing, and will
        // once a replica is back.
        || said(&e, "NOREPLICAS");
    if failover || e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        StoreError::unavailable(e)
    } else {
        StoreError::backend(e)
    }
}

/// Whether the server answered `code` (an error code the redis crate has no kind for), to a command or to one
/// of a pipeline's.
fn said(e: &redis::RedisError, code: &str) -> bool {
    e.clone().into_server_errors().is_some_and(|errors| errors.iter().any(|(_, s)| s.code() == code))
}

/// Whether a Cluster refused a command without running it (so sending it again cannot apply it twice).
pub(crate) fn ran_nothing(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as K;
    matches!(
        e.kind(),
        redis::ErrorKind::Server(K::Moved | K::Ask | K::TryAgain | K::ClusterDown | K::MasterDown | K::ReadOnly)
            // No connection to the node the slot map names: nothing was sent.
            | redis::ErrorKind::ClusterConnectionNotFound
    )
}

/// `WAIT` counted fewer replicas than `wait_replicas` asks for.
#[derive(Debug)]
pub(crate) struct ReplicasMissing {
    pub(crate) wanted: u32,
    pub(crate) acked: i64,
    pub(crate) timeout: Duration,
}

impl std::fmt::Display for ReplicasMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} replicas acknowledged the write within {} ms (wait_replicas); it is applied on the master but \
             could be lost in a failover",
            self.acked,
            self.wanted,
            self.timeout.as_millis()
        )
    }
}

impl std::error::Error for ReplicasMissing {}

/// The kind of the I/O error behind `e`, if that is what it is (the redis crate keeps it in an `Arc`).
fn io_error_kind(e: &redis::RedisError) -> Option<std::io::ErrorKind> {
    let source = std::error::Error::source(e)?;
    let inner = match source.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>() {
        Some(shared) => &**shared as &(dyn std::error::Error + 'static),
        None => source,
    };
    inner.downcast_ref::<std::io::Error>().map(std::io::Error::kind)
}

/// One plain connection to `client`'s server, made and dropped: an unreachable server fails start-up at once.
pub(crate) async fn probe(
    client: &redis::Client,
    tls: bool,
    timeout: Option<std::time::Duration>,
) -> Result<(), Error> {
    let probe = redis::AsyncConnectionConfig::new().set_connection_timeout(timeout);
    match client.get_multiplexed_async_connection_with_config(&probe).await {
        Ok(_) => Ok(()),
        Err(e) => {
            Err(first_connect_error(e, tls, std::slice::from_ref(client.get_connection_info().addr()), false).await)
        }
    }
}

/// What a plain URL's server said when it was a TLS port.
const TLS_PORT: &str =
    "the server reset the connection: is this a TLS port? then use rediss:// (with cacert=FILE for a private CA)";
/// What a TLS URL's server said when it was a plain port.
const PLAIN_PORT: &str = "no TLS answer within 5s: is this a plain Redis port? (it never answers a TLS handshake; use \
                          redis:// or the server's tls-port)";

/// A failed first connection to the servers at `addrs` (the one server, the Sentinels or the Cluster's seed
/// nodes), as a usage mistake (exit 2 for `idem once`) or an outage (75):
/// - a plain connection reset is a TLS port (it resets a plain command) only when one of them answers a TLS
///   hello; a server that accepts and closes every connection while it still has the command unread (a proxy
///   in front of a store that is down, a failover in progress) resets it too, and is an outage;
/// - no TLS answer in time is a plain Redis port (it reads the hello as a command and waits for the rest of
///   the line) only when one of them answers a plain `PING`; a frozen or overloaded server answers neither.
///
/// `opaque`: the error does not show its cause (the Cluster client's "Failed to create initial connections"
/// hides the I/O error), so the servers are asked whatever it was.
pub(crate) async fn first_connect_error(
    e: redis::RedisError,
    tls: bool,
    addrs: &[redis::ConnectionAddr],
    opaque: bool,
) -> Error {
    if idem_tls::rustls_error_in(&e).is_some() {
        return connect_error(e);
    }
    if !tls && (opaque || io_error_kind(&e) == Some(std::io::ErrorKind::ConnectionReset)) {
        for addr in addrs {
            if speaks_tls(addr).await {
                return Error::Handshake(TLS_PORT.into());
            }
        }
        return Error::Connect(e);
    }
    if tls && (opaque || e.is_timeout()) {
        for addr in addrs {
            if answers_plain_ping(addr).await {
                return Error::Handshake(PLAIN_PORT.into());
            }
        }
        return Error::Connect(e);
    }
    connect_error(e)
}

/// Whether the server at `addr` (a `rediss://` address) answers a plain `PING` within a second (after a TLS
/// handshake timed out: then it is a plain Redis port).
async fn answers_plain_ping(addr: &redis::ConnectionAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis::ConnectionAddr::TcpTls { host, port, .. } = addr else { return false };
    let ping = async {
        let mut stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut first = [0u8; 1];
        stream.read_exact(&mut first).await.ok()?;
        Some(matches!(first[0], b'+' | b'-'))
    };
    tokio::time::timeout(std::time::Duration::from_secs(1), ping).await.ok().flatten().unwrap_or(false)
}

/// Whether the server of `info` (a plain `redis://` address) answers a TLS hello with TLS within a second: a
/// handshake that gets as far as a certificate to refuse (no root is trusted here) or an alert from the server.
/// A server that closes the connection, resets it or says nothing does not.
async fn speaks_tls(addr: &redis::ConnectionAddr) -> bool {
    let redis::ConnectionAddr::Tcp(host, port) = addr else { return false };
    let (host, port) = (host.clone(), *port);
    let handshake = move || -> Option<bool> {
        use std::net::ToSocketAddrs;
        let config = rustls::ClientConfig::builder_with_provider(idem_tls::provider())
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from(host.clone()).ok()?;
        let mut tls = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
        let addr = (host.as_str(), port).to_socket_addrs().ok()?.next()?;
        let mut socket = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        socket.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        socket.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
        while tls.is_handshaking() {
            if let Err(e) = tls.complete_io(&mut socket) {
                // rustls puts its own error (a refused certificate, an alert received) inside the I/O error.
                return Some(e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()));
            }
        }
        Some(true)
    };
    tokio::task::spawn_blocking(handshake).await.ok().flatten().unwrap_or(false)
}

/// A failed first connection in words: a refused certificate said as [`idem_tls::describe`] says it.
fn connect_error(e: redis::RedisError) -> Error {
    if let Some(refused) = idem_tls::rustls_error_in(&e) {
        let hints = idem_tls::Hints {
            peer: "Redis server",
            trust: "cacert=FILE in the URL",
            client_cert: "idem does not send client certificates to Redis",
            plaintext: "is this a plain Redis port? then use redis://",
        };
        return Error::Handshake(idem_tls::describe(refused, hints));
    }
    Error::Connect(e)
}
