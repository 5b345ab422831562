//! The one error type of the admin crate.

/// What an admin read or action can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store failed (unreachable, refused, timed out).
    #[error("store: {0}")]
    Store(#[from] idem_store::Error),
    /// The runner's ledger could not be read or changed.
    #[error("{0}")]
    Runner(#[from] idem_runner::Error),
    /// A value under a key the admin pages read is not what its writer writes.
    #[error("{key}: unreadable: {reason}")]
    Unreadable {
        /// The store key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A request named something that is not of the form the page or action takes (a filter, a cursor, a key
    /// outside the record prefix).
    #[error("{0}")]
    BadRequest(String),
    /// Nothing is stored under what the request named.
    #[error("{0}")]
    NotFound(String),
    /// An action's precondition does not hold: the record changed since the operator saw it, or the item is
    /// not in a state the action applies to.
    #[error("{0}")]
    Conflict(String),
}

impl Error {
    /// The HTTP status the pages and the JSON endpoints answer this error with.
    pub fn status(&self) -> http::StatusCode {
        use http::StatusCode;
        match self {
            Error::Store(idem_store::Error::PreconditionFailed { .. }) => StatusCode::CONFLICT,
            Error::Store(_) | Error::Runner(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Unreadable { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::Conflict(_) => StatusCode::CONFLICT,
        }
    }
}
