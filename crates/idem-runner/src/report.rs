//! The JSON report of `--report`, written item by item so a million items never sit in memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::Error;
use crate::summary::Summary;

/// One item's line of the report.
#[derive(Serialize)]
pub(crate) struct ItemReport<'a> {
    pub id: &'a str,
    pub line: u64,
    /// `done`, `skipped`, `checked` (`--check` found its effect there before the command: no command ran,
    /// attempts 0), `adopted`, `done_elsewhere`, `failed`, `poison`, `not_started`, `interrupted`,
    /// `store_unavailable`, `would_run`. `failed` with attempts left: not retried because the run stopped (the summary counts it
    /// not done; a rerun retries it).
    pub status: &'a str,
    /// The item's attempts counted across runs where this run ended it `done`, `failed` or `poison`; 0 where
    /// it did not (`skipped`, `checked`, `adopted`, `done_elsewhere`, `would_run`, and the not-done statuses).
    pub attempts: u32,
    pub last_error: Option<&'a str>,
    pub sha256: Option<&'a str>,
    pub duration_ms: Option<u64>,
    pub output: &'a str,
    /// The host that recorded it done, for `done_elsewhere`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<&'a str>,
}

pub(crate) struct Report {
    path: PathBuf,
    out: BufWriter<File>,
    first: bool,
}

impl Report {
    /// Starts the report at `path` with what it is of: the job's name (`--name`, else the hash of
    /// `--output`), the host that ran it (`IDEM_HOST`, else the machine's name, as the ledger records it) and
    /// the output template (empty without `--output`).
    pub(crate) fn create(path: &Path, job: &str, host: &str, output: &str) -> Result<Self, Error> {
        let err = |source| Error::Report { path: path.to_owned(), source };
        let mut out = BufWriter::new(File::create(path).map_err(err)?);
        let head = serde_json::json!({ "job": job, "host": host, "output": output });
        // The head's fields, then the items as they end: `{"job":…,"host":…,"output":…,"items":[`.
        let head = head.to_string();
        let fields = head.strip_suffix('}').unwrap_or(&head);
        writeln!(out, "{fields},\"items\":[").map_err(err)?;
        Ok(Self { path: path.to_owned(), out, first: true })
    }

    pub(crate) fn item(&mut self, item: &ItemReport<'_>) -> Result<(), Error> {
        let err = |source| Error::Report { path: self.path.clone(), source };
        if !self.first {
            self.out.write_all(b",\n").map_err(err)?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, item).map_err(|e| err(e.into()))
    }

    pub(crate) fn finish(&mut self, summary: &Summary) -> Result<(), Error> {
        let err = |source| Error::Report { path: self.path.clone(), source };
        let poison: Vec<_> =
            summary.poison.iter().map(|(id, error)| serde_json::json!({"id": id, "error": error})).collect();
        let tail = serde_json::json!({
            "total": summary.total,
            "done": summary.done,
            "skipped": summary.skipped,
            "adopted": summary.adopted,
            "done_elsewhere": summary.elsewhere,
            "failed": summary.failed,
            "poison": poison,
            "not_done": summary.not_done,
            "executions": summary.executions,
            "stopped": summary.stopped,
            "would_run": summary.would_run,
            "interrupted": summary.interrupted,
            "store_unavailable": summary.store_unavailable,
            "elapsed_ms": summary.elapsed.as_millis() as u64,
            "exit_status": summary.status().exit_code(),
        });
        write!(self.out, "\n],\"summary\":{tail}}}\n").map_err(err)?;
        self.out.flush().map_err(err)
    }
}
