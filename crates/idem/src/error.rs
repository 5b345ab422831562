/// Everything the `idem` command can fail with; each maps to an exit status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad flags, config file or store URL: nothing was started. Exit status 2.
    #[error("{0}")]
    Config(String),
    /// The store could not be opened. Exit status 2.
    #[error("cannot open store {url}")]
    OpenStore {
        /// The store URL (passwords hidden).
        url: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The listener could not be bound. Exit status 2.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store is down or unreachable for now (connection refused or reset, no answer in time, a server
    /// starting up or shutting down), as opposed to a bad URL or a refused login: a later try may succeed.
    /// Exit status 75 (EX_TEMPFAIL, as `idem run` exits when its store stays unavailable).
    #[error("{0}")]
    Unavailable(String),
    /// The server answered 404. Exit status 3.
    #[error("not found: {0}")]
    NotFound(String),
    /// The server answered 412. Exit status 4.
    #[error("precondition failed: {0}")]
    PreconditionFailed(String),
    /// Any other failure of a request or of the server. Exit status 1.
    #[error("{0}")]
    Failed(String),
    /// I/O while serving or benchmarking. Exit status 1.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A store operation failed. Exit status 1.
    #[error(transparent)]
    Store(#[from] idem_store::Error),
    /// `idem send` did not get a success. Exit status 5 for 422 or a non-retryable 409 (the key belongs to
    /// another payload or state), 6 when attempts ran out, 7 for an unknown outcome, 1 otherwise.
    #[error(transparent)]
    Send(idem_client::Error),
}

/// Exit status of a temporary failure (sysexits.h EX_TEMPFAIL): the store was unavailable; try again later.
pub const EX_TEMPFAIL: i32 = 75;

impl From<idem_backends::Error> for Error {
    fn from(e: idem_backends::Error) -> Self {
        match e {
            idem_backends::Error::Open { url, source } => Error::OpenStore { url, source },
            other => Error::Config(other.to_string()),
        }
    }
}

impl Error {
    /// The process exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(_) | Error::OpenStore { .. } | Error::Bind { .. } => 2,
            Error::NotFound(_) => 3,
            Error::Unavailable(_) => EX_TEMPFAIL,
            Error::PreconditionFailed(_) => 4,
            Error::Send(idem_client::Error::KeyReused { .. } | idem_client::Error::Conflict { .. }) => 5,
            Error::Send(idem_client::Error::AttemptsExhausted { .. }) => 6,
            Error::Send(idem_client::Error::OutcomeUnknown { .. }) => 7,
            _ => 1,
        }
    }
}

/// `n` and the noun for it: `1 item`, `0 items`, `2 items` (the runner's summary counts the same way).
pub fn count<N: std::fmt::Display + PartialEq + From<u8>>(n: N, one: &str, many: &str) -> String {
    let noun = if n == N::from(1) { one } else { many };
    format!("{n} {noun}")
}

/// Writes `text` to standard output. A reader that went away (`idem once status | head`, EPIPE) is not a
/// failure of the command: `Ok`, nothing more written. Any other write error (a full disk, `> /dev/full`) is
/// [`Error::Io`], exit status 1, where `print!` would panic.
pub fn out(text: &str) -> Result<(), Error> {
    out_bytes(text.as_bytes())
}

/// [`out`] for bytes (a response body as received).
pub fn out_bytes(bytes: &[u8]) -> Result<(), Error> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Error::Failed(format!("cannot write to standard output: {e}"))),
    }
}

/// Writes `text` to standard error in one write, ignoring any failure: a reader that went away
/// (`idem run … 2>&1 | head -1`, EPIPE) ends what is shown, never the command (`eprintln!` would panic, exit
/// 101), and a failing standard error has nowhere to be reported. A run goes on doing its work.
pub fn say(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// `eprintln!` through [`say`]: one line to standard error that never panics.
macro_rules! sayln {
    ($($arg:tt)*) => {
        $crate::error::say(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use sayln;
