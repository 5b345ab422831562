use std::path::PathBuf;

/// Everything `idem run` can fail with before or around running items. Failures of single items are not
/// errors: they are counted in the [`Summary`](crate::Summary) and the report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The run's settings are unusable (bad template, no command, zero jobs…). Nothing ran.
    #[error("{0}")]
    Config(String),
    /// Named job `job` would write the files of job `other` on this host (the same absolute output template,
    /// `output_path`): it would adopt them as its own and overwrite them. Nothing ran.
    #[error(
        "job {job} writes the outputs of job {other} on this host ({output_path}): it would adopt job {other}'s \
         files as its own and overwrite them (and job {other} would then run them all again); nothing ran. Give \
         job {job} another --output, or run it as --name {other}"
    )]
    OutputsOfAnother {
        /// The job refused.
        job: String,
        /// The job whose files they are.
        other: String,
        /// The output template, absolute.
        output_path: String,
    },
    /// The items file could not be read.
    #[error("cannot read items from {path}")]
    ReadItems {
        /// The items file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An item is malformed: not JSON when the file is JSON Lines, or without a usable id. Nothing ran.
    #[error("{path}:{line}: {reason}")]
    BadItem {
        /// The items file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// Two items map to the same output path, so one would overwrite the other. Nothing ran.
    #[error("{path}: lines {first} and {second} both write {output}")]
    DuplicateOutput {
        /// The items file.
        path: PathBuf,
        /// 1-based line of the first item.
        first: u64,
        /// 1-based line of the second item.
        second: u64,
        /// The output path they share.
        output: String,
    },
    /// An item read from a stream writes the output path of an item before it (from a regular file this is
    /// [`Error::DuplicateOutput`], found before anything runs).
    #[error("{path}:{line}: writes {output}, as an earlier item did (two items with one output path)")]
    RepeatedOutput {
        /// The stream (`-`: standard input).
        path: PathBuf,
        /// 1-based line of the item refused.
        line: u64,
        /// The output path.
        output: String,
    },
    /// The queue cannot be consumed at start-up: the broker does not answer, refuses the login, or has no such
    /// queue (stream, consumer). Later connection failures are retried, not errors.
    #[error("cannot consume {0}")]
    Queue(String),
    /// The ledger store failed (unreachable, closed, or holding an unreadable entry).
    #[error("ledger store failed")]
    Store(#[from] idem_store::Error),
    /// A ledger entry could not be decoded.
    #[error("ledger entry {key} is unreadable")]
    Entry {
        /// Its store key.
        key: String,
        /// Why.
        #[source]
        source: idem_core::Error,
    },
    /// Writing the report failed.
    #[error("cannot write report {path}")]
    Report {
        /// The report file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file operation of the runner itself failed.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Why the runner could not judge or record one item: the ledger failed, not the item. The item counts as
/// failed (without using an attempt) and this, as one line, is its `last_error` in the report.
///
/// The causes are printed in the line rather than chained as sources: the line is all the report keeps.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ItemError {
    /// Reading the item's entry or lease failed.
    #[error("ledger read failed: {0}")]
    LedgerRead(idem_store::Error),
    /// The item's entry could not be decoded.
    #[error("ledger entry unreadable: {0}")]
    EntryUnreadable(idem_core::Error),
    /// A ledger write failed (not refused by its precondition: that means judging the item again).
    #[error("ledger write failed: {0}")]
    LedgerWrite(idem_store::Error),
    /// A put of the claim answered without the generation the later writes are fenced on.
    #[error("ledger put returned no generation")]
    NoGeneration,
    /// Checking the file at the item's final path panicked or was cancelled on the blocking pool.
    #[error("{0}")]
    OutputCheck(tokio::task::JoinError),
}

impl ItemError {
    /// The ledger store was unavailable (and the run gave up waiting for it): not the item's failure.
    pub(crate) fn is_unavailable(&self) -> bool {
        matches!(self, ItemError::LedgerRead(e) | ItemError::LedgerWrite(e) if e.is_unavailable())
    }
}
