//! [`Error`]: why a store URL cannot be used.

/// Why a store URL cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The scheme is none of `sqlite:`, `memory:`, `postgres://`, `redis://`, `rediss://`.
    #[error(
        "store URL {0:?} has an unknown scheme; use sqlite:PATH, memory:, postgres://…, redis://…, rediss://…, redis+sentinel://… or redis+cluster://…"
    )]
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

impl Error {
    /// True when the store could not be opened because it is down or unreachable for now (the connection was
    /// refused, reset or aborted, nothing answered in time, or a PostgreSQL server said it is starting up,
    /// in recovery or shutting down): opening it again later may succeed. False for
    /// what a retry cannot fix: a bad URL, a refused login, a failed TLS handshake, a schema too new.
    pub fn is_unavailable(&self) -> bool {
        let Error::Open { source, .. } = self else { return false };
        // A PostgreSQL server starting up, in recovery or shutting down says so with a SQLSTATE (57P03 "the
        // database system is not yet accepting connections"): a restart the run must wait out, not exit 2 for.
        if let Some(pg) = source.downcast_ref::<idem_postgres::Error>()
            && pg.is_unavailable()
        {
            return true;
        }
        if let Some(redis) = source.downcast_ref::<idem_redis::Error>() {
            return redis.is_unavailable();
        }
        // The backends keep the socket's error as a cause (redis::RedisError, tokio_postgres::Error); a TLS
        // failure or a login refused carries none of these kinds.
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind::*;
                if matches!(
                    io.kind(),
                    ConnectionRefused
                        | ConnectionReset
                        | ConnectionAborted
                        | TimedOut
                        | NotConnected
                        | BrokenPipe
                        | UnexpectedEof
                ) {
                    return true;
                }
            }
            cause = e.source();
        }
        false
    }
}
