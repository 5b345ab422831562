//! What the ledger keeps of one item: its store keys and its entry (JSON).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::Error;

/// The store keys of one item of one job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Keys {
    entry: String,
    lease: String,
}

impl Keys {
    /// The keys of item `id` of job `job` (a short hash naming the job, so two jobs share a store safely).
    pub fn new(job: &str, id: &str) -> Self {
        Self { entry: format!("{}{id}", entry_prefix(job)), lease: format!("run/{job}/lease/{id}") }
    }

    /// The entry's store key.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The lease's store key.
    pub fn lease(&self) -> &str {
        &self.lease
    }
}

/// The prefix under which a job's entries live: list it to see every item the ledger knows.
pub fn entry_prefix(job: &str) -> String {
    format!("run/{job}/item/")
}

/// What the ledger knows about one item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Entry {
    /// Claimed by `owner`; the item's lease key says whether the claim is still live.
    Running {
        /// The claimant's owner token (unique per process start).
        owner: String,
        /// The number of this attempt (1 for the first): attempts are counted when claimed.
        attempt: u32,
        /// When it was claimed, in milliseconds since the Unix epoch (informational).
        started_at_ms: u64,
        /// Error fingerprints of the earlier failed attempts, oldest first.
        #[serde(default)]
        failures: Vec<String>,
        /// The last error message, if an earlier attempt failed.
        #[serde(default)]
        last_error: Option<String>,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// The last attempt failed.
    Failed {
        /// Attempts claimed so far.
        attempts: u32,
        /// Error fingerprints of every failed attempt, oldest first.
        failures: Vec<String>,
        /// The last attempt's error, for people.
        last_error: String,
        /// True when one fingerprint occurred twice: a poison item, never retried until forgotten.
        poison: bool,
        /// When it failed, in milliseconds since the Unix epoch.
        finished_at_ms: u64,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// An attempt whose command started was stopped by the operator (a second Ctrl-C, or SIGTERM) and given
    /// back. It is not counted (an interruption is not the item's failure, so even with no retries left the
    /// item runs again), but it is remembered: the command may have written the item's final path itself, so
    /// a file there is never adopted.
    Interrupted {
        /// Who ran the interrupted attempt (its temporary file is named after the owner and the attempt).
        owner: String,
        /// The number the interrupted attempt ran as; it was not counted, so the next claim runs as this
        /// number again.
        attempt: u32,
        /// When it was given back, in milliseconds since the Unix epoch.
        interrupted_at_ms: u64,
        /// Error fingerprints of the earlier failed attempts, oldest first.
        #[serde(default)]
        failures: Vec<String>,
        /// The last error message, if an earlier attempt failed.
        #[serde(default)]
        last_error: Option<String>,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// Finished: the output was verified, renamed into place and has this digest.
    Done {
        /// Attempts it took.
        attempts: u32,
        /// Lowercase hex SHA-256 of the output file.
        sha256: String,
        /// The output's length, in bytes.
        size: u64,
        /// Who finished it (`adopted` when an existing output was taken over without running).
        owner: String,
        /// When it finished, in milliseconds since the Unix epoch.
        finished_at_ms: u64,
        /// How long the successful attempt ran, in milliseconds.
        duration_ms: u64,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
}

impl Entry {
    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        // Serialising strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Entry::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a ledger entry.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }

    /// Attempts claimed so far.
    pub fn attempts(&self) -> u32 {
        match self {
            Entry::Running { attempt, .. } => *attempt,
            Entry::Interrupted { attempt, .. } => attempt.saturating_sub(1),
            Entry::Failed { attempts, .. } | Entry::Done { attempts, .. } => *attempts,
        }
    }

    /// The SHA-256 (lowercase hex) of the item text the entry was written for, if recorded.
    pub fn item_sha256(&self) -> Option<&str> {
        match self {
            Entry::Running { item_sha256, .. }
            | Entry::Failed { item_sha256, .. }
            | Entry::Interrupted { item_sha256, .. }
            | Entry::Done { item_sha256, .. } => item_sha256.as_deref(),
        }
    }

    /// The last error recorded, if any.
    pub fn last_error(&self) -> Option<&str> {
        match self {
            Entry::Running { last_error, .. } | Entry::Interrupted { last_error, .. } => last_error.as_deref(),
            Entry::Failed { last_error, .. } => Some(last_error),
            Entry::Done { .. } => None,
        }
    }
}
