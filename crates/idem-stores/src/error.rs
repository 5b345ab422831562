//! [`Error`]: why a store URL cannot be used.

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
