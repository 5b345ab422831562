/// Errors connecting to PostgreSQL. Operations on a connected store return [`idem_store::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL is not a PostgreSQL connection string.
    #[error("invalid PostgreSQL URL")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// `sslmode` is not one of libpq's `disable`, `prefer`, `require`, `verify-ca`, `verify-full`.
    #[error("invalid sslmode {0:?}: use disable, prefer, require, verify-ca or verify-full")]
    InvalidSslMode(String),
    /// The `sslrootcert` file cannot be read or holds no usable CA certificate (PEM), or the platform's trust
    /// store is empty.
    #[error(transparent)]
    TlsFiles(idem_tls::Error),
    /// `sslcert`, `sslkey` or `sslpassword`: client certificates to PostgreSQL are not supported; refused rather
    /// than dropped, since the server would then authenticate the connection some other way.
    #[error("{0}: client certificates to PostgreSQL are not supported by idem; use password or trust authentication")]
    ClientCertificate(String),
    /// The TLS handshake with the server failed: its certificate was refused (the message says why: unknown
    /// issuer, expired, host name mismatch) or the server does not speak TLS.
    #[error("TLS to the PostgreSQL server failed: {0}")]
    Handshake(String),
    /// The TLS client could not be set up (e.g. the platform trust store is empty).
    #[error("TLS: {0}")]
    Tls(String),
    /// The schema name is not a plain lowercase identifier (`[a-z_][a-z0-9_]{0,62}`).
    #[error("invalid schema name {0:?}: use [a-z_][a-z0-9_]*, at most 63 bytes")]
    InvalidSchema(String),
    /// The connection pool could not be built.
    #[error("cannot build the connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
    /// The connection pool failed for a reason of its own.
    #[error("cannot connect")]
    Connect(#[source] deadpool_postgres::PoolError),
    /// The server could not be reached, refused the connection, or refused the login (the cause is the source).
    #[error("cannot connect")]
    Server(#[source] tokio_postgres::Error),
    /// Nothing answered within the connect timeout (`connect_timeout`, 5 s by default, per host); the field is
    /// the timeout per host, as the URL set it.
    #[error("no answer within {}s (connect_timeout): is PostgreSQL listening on this host and port?", .0.as_secs())]
    ConnectTimeout(std::time::Duration),
    /// `target_session_attrs` is not `read-write`: idem writes on every connection, so a session on a standby
    /// (`any`, `read-only`, `prefer-standby`, …) would refuse them all.
    #[error("target_session_attrs={0:?}: idem only writes, use read-write (the default) or leave it out")]
    TargetSessionAttrs(String),
    /// `synchronous_standbys=all` was asked for and the primary's commits do not wait for every standby.
    #[error(
        "synchronous_standbys=all: a commit waits for {waited} of {standbys} standbys ({setting}); set \
         synchronous_standby_names = 'ANY {standbys} (every server's application_name)' and synchronous_commit = on \
         on the primary and on each standby (for after a failover)"
    )]
    NotSynchronous {
        /// Standbys that could be promoted: the URL's hosts after the first, or the primary's connected
        /// standbys when more.
        standbys: u32,
        /// Standbys a commit waits for.
        waited: u32,
        /// The primary's `synchronous_commit` and `synchronous_standby_names`.
        setting: String,
    },
    /// `synchronous_standbys` has a value other than `all`.
    #[error("synchronous_standbys={0:?}: the one value is all (every standby must acknowledge each commit)")]
    InvalidSynchronous(String),
    /// Creating or migrating the schema failed.
    #[error("cannot migrate schema {schema}")]
    Migrate {
        /// The schema.
        schema: String,
        /// What PostgreSQL said.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The schema does not exist (a reader that creates nothing found no such namespace).
    #[error("no schema {0} in the database")]
    NoSchema(String),
    /// The schema was migrated by a newer idem.
    #[error("schema {schema} is at version {found}; this idem knows up to {known}")]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// Its version.
        found: i32,
        /// The newest this build knows.
        known: i32,
    },
    /// An operation failed.
    #[error(transparent)]
    Store(#[from] idem_store::Error),
}

impl Error {
    /// True when connecting again later may succeed: nothing answered within the connect timeout, or the server
    /// answered with a SQLSTATE that says "not now" (57P01-57P03: shutting down, crashed, starting up or in
    /// recovery, "the database system is not yet accepting connections"; 53300: too many connections; 25006;
    /// class 08), a connection closed during the handshake, or every host answered as a standby (no read-write
    /// session: a failover in progress). False for what a retry cannot fix (a bad URL or sslmode, a refused login, a schema too new);
    /// an error without a SQLSTATE (refused, reset, TLS) is for the caller to judge by its cause.
    pub fn is_unavailable(&self) -> bool {
        let e = match self {
            Error::ConnectTimeout(_) => return true,
            Error::Connect(deadpool_postgres::PoolError::Timeout(_)) => return true,
            Error::Connect(deadpool_postgres::PoolError::Backend(e)) | Error::Server(e) => e,
            Error::Migrate { source, .. } => source,
            _ => return false,
        };
        // A connection the server (or a proxy, a failover) closed before or during the handshake says so
        // with no SQLSTATE and no I/O cause: an outage, not a bad URL.
        e.code().is_some_and(crate::store::transient_code) || only_standbys(e) || e.is_closed()
    }
}

/// Whether tokio-postgres refused every host as read-only (`target_session_attrs=read-write` found no primary:
/// mid-failover, or every primary demoted). It says so with an I/O error of kind `PermissionDenied` and no
/// SQLSTATE, the only way to tell it from a refused login (which has SQLSTATE 28P01 or 28000).
fn only_standbys(e: &tokio_postgres::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::PermissionDenied
            && io.to_string().contains("does not allow writes")
        {
            return true;
        }
        cause = c.source();
    }
    false
}
