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
//! ```no_run
//! use idem_runner::{RunConfig, Stop, run};
//! use idem_store::MemoryStore;
//!
//! # async fn demo() -> Result<(), idem_runner::Error> {
//! let mut cfg = RunConfig::new("items.jsonl", "out/{id}.json", vec!["./work.sh".into(), "{id}".into(), "{out}".into()]);
//! cfg.jobs = 4;
//! let summary = run(MemoryStore::new(), cfg, Stop::new()).await?;
//! std::process::exit(summary.status().exit_code());
//! # }
//! ```

mod admin;
mod config;
mod engine;
mod error;
mod items;
pub mod once;
mod output;
mod progress;
mod queue;
mod report;
mod watchdog;

pub use admin::{JobRecord, LedgerStatus, claim_outputs, forget, job_exists, job_record, note_job, status};
pub use config::{
    CheckedConfig, OnPoison, ProgressMode, RunConfig, check_job_name, default_ledger_path, job_id, output_root,
};
pub use engine::{FailedItem, OutOfAttempts, RunStatus, Stop, Summary, owner_token, run, run_checked};
pub use error::Error;
use error::ItemError;
pub use items::{Item, ItemFormat, ItemReader, is_stream, short_hash};
pub use queue::QueueUrl;
