use std::time::Duration;

use crate::Generation;

/// Everything a store operation can fail with.
///
/// Callers branch with [`Error::is_precondition_failed`] and [`Error::current_generation`] rather than by
/// matching message text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key breaks a limit: see [`KeyProblem`].
    #[error("invalid key: {problem}")]
    InvalidKey {
        /// What is wrong with it.
        problem: KeyProblem,
    },
    /// The value is longer than [`Limits::max_value_bytes`](crate::Limits::max_value_bytes).
    #[error("value of {size} bytes exceeds the limit of {max} bytes")]
    ValueTooLarge {
        /// Length of the refused value, in bytes.
        size: usize,
        /// The configured maximum, in bytes.
        max: usize,
    },
    /// A TTL outside [`MIN_TTL`](crate::MIN_TTL)`..=`[`MAX_TTL`](crate::MAX_TTL) (1 s to 365 days).
    #[error("ttl of {}s is outside 1s..=365 days", ttl.as_secs_f64())]
    InvalidTtl {
        /// The refused TTL.
        ttl: Duration,
    },
    /// The write's [`Precondition`](crate::Precondition) did not hold; nothing was written.
    #[error("precondition failed: current generation is {}", match current { Some(g) => g.to_string(), None => "absent".to_owned() })]
    PreconditionFailed {
        /// The live value's generation when the write was refused, `None` when the key was absent or expired.
        current: Option<Generation>,
    },
    /// A set or counter operation found a value of another shape under the key.
    #[error("value is not a {expected}")]
    WrongType {
        /// `"set"` (a JSON array of strings) or `"counter"` (a decimal `i64`).
        expected: &'static str,
    },
    /// A counter add would leave the `i64` range.
    #[error("counter would overflow i64")]
    CounterOverflow,
    /// A dedupe id or set member is empty, longer than 255 bytes or contains NUL; or a listing's `limit` is
    /// outside 1..=1000. The message states the rule that `what` breaks.
    #[error("invalid {what}: {}", argument_rule(.what))]
    InvalidArgument {
        /// Which argument: `"dedupe id"`, `"set member"`, `"limit"`.
        what: &'static str,
    },
    /// A dedupe id already used on this key within [`Limits::dedupe_retention`](crate::Limits::dedupe_retention)
    /// came with another payload: a counter add with another delta, or a set change whose canonical form (see
    /// [`SetChange::fingerprint`](crate::SetChange::fingerprint)) differs. Nothing was written. Like a reused
    /// `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header §2.7), this is the client's mistake:
    /// the same payload again would be answered with the first outcome, a new payload needs a new id.
    #[error("dedupe id {dedupe_id:?} was already used on key {key:?} for another payload")]
    DedupeIdReused {
        /// The key the operation named.
        key: String,
        /// The dedupe id it reused.
        dedupe_id: String,
    },
    /// [`StoreExt::update`](crate::StoreExt::update) lost the race on every attempt.
    #[error("update gave up after {attempts} attempts that all lost a compare-and-swap race")]
    UpdateExhausted {
        /// How many read-modify-write attempts ran.
        attempts: u32,
    },
    /// The backend could not be reached (connection refused or lost, the server shutting down, starting or
    /// read-only), or cannot take the write for now (SQLite: the file locked or the disk full); retrying later
    /// may succeed ([`Error::is_unavailable`]).
    #[error("store unavailable")]
    Unavailable {
        /// What the backend said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The backend failed in a way a retry will not fix (corrupt file, bug). A full disk is [`Error::Unavailable`]:
    /// the same write succeeds once space returns.
    #[error("storage backend failed")]
    Backend {
        /// What the backend said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store was closed; no more operations are accepted.
    #[error("store is closed")]
    Closed,
}

/// Why a key was refused (keys are 1..=1024 bytes of UTF-8 without NUL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The key is the empty string.
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES).
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contains a NUL byte, which PostgreSQL text cannot hold; refused everywhere so backends agree.
    ContainsNul,
}

impl std::fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyProblem::Empty => f.write_str("key is empty"),
            KeyProblem::TooLong { len } => {
                write!(f, "key is {len} bytes, the limit is {} bytes", crate::MAX_KEY_BYTES)
            }
            KeyProblem::ContainsNul => f.write_str("key contains a NUL byte"),
        }
    }
}

/// The rule an [`Error::InvalidArgument`] broke, for its message: a listing's `limit` has a range of its own;
/// every other argument (dedupe id, set member) is a token checked by `Limits::check_token`, whose NUL rule the
/// message must name too, or a 3-byte id with a NUL is told it breaks a length limit it keeps.
fn argument_rule(what: &str) -> &'static str {
    match what {
        "limit" => "must be 1..=1000",
        _ => "must be 1..=255 bytes without NUL",
    }
}

impl Error {
    /// True for [`Error::PreconditionFailed`].
    pub fn is_precondition_failed(&self) -> bool {
        matches!(self, Error::PreconditionFailed { .. })
    }

    /// True when the store could not be reached or could not take the operation for now ([`Error::Unavailable`]:
    /// connection refused or lost, a server shutting down or starting, a read-only standby, a locked or full
    /// SQLite file): the same operation may succeed later, so a caller that can wait retries it with backoff.
    /// False for [`Error::Closed`], which is this process's own doing.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// True for [`Error::DedupeIdReused`].
    pub fn is_dedupe_id_reused(&self) -> bool {
        matches!(self, Error::DedupeIdReused { .. })
    }

    /// For a failed precondition, the current generation (`Some(None)` when absent); `None` for other errors.
    pub fn current_generation(&self) -> Option<Option<Generation>> {
        match self {
            Error::PreconditionFailed { current } => Some(*current),
            _ => None,
        }
    }

    /// True when the request itself was invalid (key, value, TTL or argument), so retrying cannot help.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey { .. }
                | Error::ValueTooLarge { .. }
                | Error::InvalidTtl { .. }
                | Error::InvalidArgument { .. }
        )
    }

    /// Wraps a backend error that a later retry may get past (connection lost, server restarting).
    pub fn unavailable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::Unavailable { source: source.into() }
    }

    /// Wraps a backend error that a retry will not fix.
    pub fn backend(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::Backend { source: source.into() }
    }
}

/// `e` and its causes ([`source`](std::error::Error::source), outermost first) on one line, `e: cause: its
/// cause`, each said once: a cause whose text the line already holds is left out, since many libraries repeat
/// their source's message in their own (`error trying to connect: tcp connect error: Connection refused`
/// over a `Connection refused`). The one form for idem's log fields and its command-line errors.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::{Error, error_chain};

    /// An error with a message and an optional cause.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn a_chain_says_each_cause_once() {
        let refused = Layer("Connection refused (os error 111)", None);
        let tcp = Layer("tcp connect error: Connection refused (os error 111)", Some(Box::new(refused)));
        let top = Layer("error sending request", Some(Box::new(tcp)));
        assert_eq!(error_chain(&top), "error sending request: tcp connect error: Connection refused (os error 111)");

        let c = Layer("c", None);
        let b = Layer("b", Some(Box::new(c)));
        assert_eq!(error_chain(&Layer("a", Some(Box::new(b)))), "a: b: c");
        assert_eq!(error_chain(&Layer("alone", None)), "alone");
    }

    #[test]
    fn invalid_argument_names_the_rule_it_broke() {
        assert_eq!(
            Error::InvalidArgument { what: "dedupe id" }.to_string(),
            "invalid dedupe id: must be 1..=255 bytes without NUL"
        );
        assert_eq!(Error::InvalidArgument { what: "limit" }.to_string(), "invalid limit: must be 1..=1000");
    }
}
