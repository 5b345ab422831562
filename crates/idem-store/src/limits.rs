use std::time::Duration;

use crate::{Error, KeyProblem, Ttl};

/// Longest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 1024;
/// Shortest TTL a write may set.
pub const MIN_TTL: Duration = Duration::from_secs(1);
/// Longest TTL a write may set: 365 days.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Longest dedupe id or set member, in bytes.
pub(crate) const MAX_TOKEN_BYTES: usize = 255;

/// The limits every backend enforces before touching storage, so a refused write changes nothing.
///
/// Key length and the TTL range are fixed by the contract; the value limit is configurable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    max_value_bytes: usize,
    dedupe_retention: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_value_bytes: 16 * 1024 * 1024, dedupe_retention: Duration::from_secs(24 * 3600) }
    }
}

impl Limits {
    /// The defaults: values up to 16 MiB, set and counter dedupe ids remembered for 24 hours.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the largest value accepted, in bytes.
    pub fn with_max_value_bytes(mut self, bytes: usize) -> Self {
        self.max_value_bytes = bytes;
        self
    }

    /// Sets how long a set or counter dedupe id is remembered after its first use.
    pub fn with_dedupe_retention(mut self, retention: Duration) -> Self {
        self.dedupe_retention = retention;
        self
    }

    /// Largest value accepted, in bytes.
    pub fn max_value_bytes(&self) -> usize {
        self.max_value_bytes
    }

    /// How long a set or counter dedupe id is remembered.
    pub fn dedupe_retention(&self) -> Duration {
        self.dedupe_retention
    }

    /// Checks a key: 1..=1024 bytes, no NUL.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] naming the problem.
    pub fn check_key(&self, key: &str) -> Result<(), Error> {
        let problem = if key.is_empty() {
            KeyProblem::Empty
        } else if key.len() > MAX_KEY_BYTES {
            KeyProblem::TooLong { len: key.len() }
        } else if key.contains('\0') {
            KeyProblem::ContainsNul
        } else {
            return Ok(());
        };
        Err(Error::InvalidKey { problem })
    }

    /// Checks a value's length against [`Limits::max_value_bytes`].
    ///
    /// # Errors
    /// [`Error::ValueTooLarge`].
    pub fn check_value(&self, value: &[u8]) -> Result<(), Error> {
        if value.len() > self.max_value_bytes {
            return Err(Error::ValueTooLarge { size: value.len(), max: self.max_value_bytes });
        }
        Ok(())
    }

    /// Checks that a [`Ttl::After`] lies within [`MIN_TTL`]`..=`[`MAX_TTL`].
    ///
    /// # Errors
    /// [`Error::InvalidTtl`].
    pub fn check_ttl(&self, ttl: &Ttl) -> Result<(), Error> {
        match ttl {
            Ttl::After(d) if *d < MIN_TTL || *d > MAX_TTL => Err(Error::InvalidTtl { ttl: *d }),
            _ => Ok(()),
        }
    }

    /// Checks all three for a put.
    ///
    /// # Errors
    /// As [`Limits::check_key`], [`Limits::check_value`] and [`Limits::check_ttl`].
    pub fn check_put(&self, key: &str, value: &[u8], ttl: &Ttl) -> Result<(), Error> {
        self.check_key(key)?;
        self.check_value(value)?;
        self.check_ttl(ttl)
    }

    /// Checks a set change: its key, every member and its dedupe id.
    ///
    /// # Errors
    /// [`Error::InvalidKey`]; [`Error::InvalidArgument`] for a member or dedupe id outside 1..=255 bytes or with
    /// NUL.
    pub fn check_set_change(&self, key: &str, change: &crate::SetChange) -> Result<(), Error> {
        self.check_key(key)?;
        change.add.iter().chain(&change.remove).try_for_each(|m| self.check_token("set member", m))?;
        change.dedupe_id.as_deref().map_or(Ok(()), |id| self.check_token("dedupe id", id))
    }

    /// Checks a counter add: its key and dedupe id.
    ///
    /// # Errors
    /// [`Error::InvalidKey`]; [`Error::InvalidArgument`] for a dedupe id outside 1..=255 bytes or with NUL.
    pub fn check_counter(&self, key: &str, dedupe_id: Option<&str>) -> Result<(), Error> {
        self.check_key(key)?;
        dedupe_id.map_or(Ok(()), |id| self.check_token("dedupe id", id))
    }

    /// Checks a dedupe id or set member: 1..=255 bytes, no NUL.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `what`.
    pub fn check_token(&self, what: &'static str, token: &str) -> Result<(), Error> {
        // NUL is refused for the same reason as in keys: PostgreSQL text cannot hold it.
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES || token.contains('\0') {
            return Err(Error::InvalidArgument { what });
        }
        Ok(())
    }
}
