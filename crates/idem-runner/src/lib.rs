//! The engine of `idem run`: run a command over work items (a file, a pipe, or the messages of a RabbitMQ
//! queue or a NATS JetStream consumer) so that reruns, crashes, duplicate runners, redeliveries and retries are
//! boring.
//!
//! For each item the engine reads its ledger entry (`idem_core`'s ledger state machine) and its output file:
//! done items whose output still has the recorded SHA-256 are skipped, a verified output without an entry is
//! adopted, anything else is claimed under a lease, run with `{id}`, `{out}` and `{item}` substituted, verified,
//! fsynced, renamed into place while the lease is still held, and recorded done with its digest. Every ledger
//! write after the claim is conditional on the claim's generation (the fencing token).
//!
//! ```
//! use idem_runner::{ProgressMode, RunConfig, RunStatus, Stop, run};
//! use idem_store::MemoryStore;
//!
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! let dir = tempfile::tempdir()?;
//! std::fs::write(dir.path().join("items.txt"), "a\nb\nc\n")?;
//! // One command per item; it writes `{out}`, which is fsynced and renamed to the output path once it exits 0.
//! let mut cfg = RunConfig::new(
//!     dir.path().join("items.txt"),
//!     format!("{}/{{id}}.txt", dir.path().display()),
//!     vec!["sh".into(), "-c".into(), "echo done > {out}".into()],
//! );
//! cfg.progress = ProgressMode::Off;
//! let ledger = MemoryStore::new(); // a durable store (SQLite, PostgreSQL) keeps it across processes
//!
//! let first = run(ledger.clone(), cfg.clone(), Stop::new()).await?;
//! assert_eq!((first.done, first.status()), (3, RunStatus::AllDone));
//! // Run again: every item is done, with its output intact, so nothing runs.
//! let again = run(ledger, cfg, Stop::new()).await?;
//! assert_eq!((again.skipped, again.executions), (3, 0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! The RabbitMQ and NATS JetStream clients are cargo features, `amqp` and `nats`, both on by default; without
//! one, a run given its queue URL is refused at start-up.

mod admin;
mod config;
mod engine;
mod error;
mod items;
mod job;
pub mod once;
mod output;
mod progress;
mod queue;
mod queue_url;
mod report;
mod shown;
mod summary;
mod supervise;

pub use admin::{JobRecord, LedgerStatus, claim_outputs, forget, job_exists, job_record, note_job, status};
pub use config::{
    CheckedConfig, DoneBy, OnPoison, ProgressMode, RunConfig, check_job_name, default_ledger_path, job_id, output_root,
};
pub use engine::{Stop, run, run_checked};
pub use error::Error;
pub use items::{Item, ItemFormat, ItemReader, is_stream, short_hash};
pub use job::{absolute_template, admit, ledger_url, new_default_ledger_notice};
pub use queue_url::QueueUrl;
pub use shown::natural_cmp;
pub use summary::{FailedItem, OutOfAttempts, RunStatus, Summary};
pub use supervise::owner_token;
