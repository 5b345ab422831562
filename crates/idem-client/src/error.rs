/// Why a write or a KV call did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `422`: the key was already used with another payload (draft §2.6). Retrying cannot help; a new
    /// logical write needs a new key.
    #[error("idempotency key reused with another payload (422): {detail}")]
    KeyReused {
        /// The server's explanation.
        detail: String,
    },
    /// A `409` that is not "still in flight" (no `Retry-After`, or another problem type): some servers use 409
    /// for key reuse, and idem for a stored response too large to replay.
    #[error("conflict (409): {detail}")]
    Conflict {
        /// The server's explanation.
        detail: String,
    },
    /// idem's `outcome-unknown` answer: the request was sent upstream but no complete answer came back, so it
    /// may or may not have taken effect, and idem will not execute it again under this key.
    #[error("outcome unknown ({status}): {detail}")]
    OutcomeUnknown {
        /// 502 or 504.
        status: u16,
        /// The server's explanation.
        detail: String,
    },
    /// A final answer that is not a success: a `3xx` (not followed), another `4xx`, or a `5xx` the server stored
    /// and replays.
    #[error("the server answered {status}{}: {detail}", if *replayed { " (replayed)" } else { "" })]
    Status {
        /// The HTTP status.
        status: u16,
        /// Whether it was a replay of the stored first answer.
        replayed: bool,
        /// The server's explanation or body.
        detail: String,
    },
    /// Every attempt failed with a retryable outcome.
    #[error("gave up after {attempts} attempt{}; last: {last}", if *attempts == 1 { "" } else { "s" })]
    AttemptsExhausted {
        /// Attempts made.
        attempts: u32,
        /// The last attempt's outcome.
        last: String,
    },
    /// After a replayed `201`, the object at its `Location` is gone: the key outlived what it created.
    #[error("replayed 201 points at {location}, which now answers {status}")]
    ReadBackGone {
        /// The `Location` followed.
        location: String,
        /// What the GET answered (404 or 410).
        status: u16,
    },
    /// `422` `dedupe-id-reused` from the KV API: a set change or counter addition was sent with a dedupe id that
    /// an earlier, different change under this key used. Resending cannot help; a new change needs a new id.
    #[error("dedupe id reused on {key} with another change (422): {detail}")]
    DedupeIdReused {
        /// The key.
        key: String,
        /// The server's explanation.
        detail: String,
    },
    /// `412` from the KV API: the precondition did not hold.
    #[error("precondition failed on {key} (current generation {})", current.map_or("none".to_owned(), |g| g.to_string()))]
    PreconditionFailed {
        /// The key.
        key: String,
        /// Its current generation (from the ETag), `None` when absent.
        current: Option<idem_store::Generation>,
    },
    /// The request could not be built or sent as given (bad URL or scheme, header, key, a redirect loop).
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What was wrong.
        reason: String,
    },
    /// The TLS connection failed: the server's certificate was refused (`certificate verify failed: unknown
    /// issuer`, `expired`, `host name mismatch`), the server refused ours, or the server does not speak TLS.
    /// Nothing was sent; retrying cannot help until the certificates or the URL change.
    #[error("{reason}")]
    Tls {
        /// The cause, one line.
        reason: String,
    },
    /// A `--cacert`, `--cert` or `--key` file could not be read or holds no usable PEM.
    #[error("{reason}")]
    TlsFiles {
        /// The file and what is wrong with it.
        reason: String,
    },
    /// The payload could not be serialised, or a KV value is not the JSON expected.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The key could not be derived (prefix with `:`, not printable ASCII, too long).
    #[error(transparent)]
    Key(#[from] idem_core::Error),
    /// A KV call failed at the transport level (the write helpers retry these instead).
    #[error("request failed")]
    Transport(#[from] reqwest::Error),
}
