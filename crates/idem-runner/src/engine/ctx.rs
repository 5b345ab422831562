//! What every item of one run shares ([`Ctx`]), at the bottom of the engine: each step takes it, and it
//! takes nothing from them but the store's outage watch and the claim queue.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use idem_core::ledger::RetryLimit;
use idem_store::{Stop, system_time_to_millis};
use tokio::sync::Semaphore;

use super::outage::Outage;
use super::turns;
use crate::config::RunConfig;
use crate::output::{self, Checks};
use crate::progress::Counters;
use crate::report::Report;
use crate::supervise::{Watchdog, owner_token};

/// What every item of one run shares: the ledger, the settings and the run's shared state. Made once by
/// [`super::run_checked`] ([`Ctx::new`]) and shared by the item tasks behind an `Arc`.
pub(crate) struct Ctx<S> {
    /// The ledger.
    pub(super) store: S,
    /// The run's settings, checked ([`RunConfig::checked`]); `jobs` lowered to the open-file limit.
    pub(super) cfg: RunConfig,
    /// The job's name in the ledger keys ([`RunConfig::job`]).
    pub(super) job: String,
    /// This process start's owner token ([`owner_token`]): written in the entries it claims and in its
    /// temporary file names.
    pub(super) owner: String,
    /// Attempts an item may use in all (`--retries` + 1).
    pub(super) limit: RetryLimit,
    /// What an output must be to count (JSON when the template ends in `.json`, `--expect-field`s).
    pub(super) checks: Checks,
    /// Slots: `--jobs` commands run at once. An item holds one from just before its command starts until the
    /// command exits (a failed one keeps it for its retry).
    pub(super) jobs: Semaphore,
    /// Items claimed before a slot is free, at most `--jobs` of them: their claim writes commit while other
    /// commands run, instead of inside the slot.
    pub(super) ahead: Semaphore,
    /// Items queue for a claim in input order ([`super::turns`]).
    pub(super) turns: Arc<turns::Turns>,
    /// The operator's stop requests.
    pub(super) stop: Stop,
    /// An item turned poison in this run under `--on-poison halt`: nothing new starts.
    pub(super) halt: AtomicBool,
    /// What the progress display shows, updated as items move.
    pub(super) counters: Arc<Counters>,
    /// Commands this run started ([`Summary::executions`]).
    pub(super) executions: AtomicU64,
    /// The `--report` file, written item by item.
    pub(super) report: Option<Mutex<Report>>,
    /// Poison items (id, error) in the order found, for [`Summary::poison`].
    pub(super) poison: Mutex<Vec<(String, String)>>,
    /// Standard output of a dry run (one line per item it lists).
    pub(super) dry_out: Mutex<std::io::BufWriter<std::io::Stdout>>,
    /// Renames outputs into place, fsyncing each directory once.
    pub(super) renamer: Arc<output::Renamer>,
    /// The process that kills the commands' process groups if this runner is killed; `None` for a dry run (or
    /// when it could not start).
    pub(super) watchdog: Option<Watchdog>,
    /// The command's program found in `PATH` once for the run; `None` when it is a path already, contains a
    /// placeholder, or was not found (then each spawn looks it up, and fails with the usual error).
    pub(super) program: Option<PathBuf>,
    /// Set once a command could not start for want of descriptors or processes (warned about once).
    pub(super) short_of_resources: AtomicBool,
    /// The store's outages as the run rides them out; one outlasting `--store-outage-limit` ends the run.
    pub(super) outage: Outage,
    /// Items another runner holds, watched until their holder counts as gone (the judge's claim gate): by
    /// observation, not by the store's TTL, so after an outage the holder gets a lease to take its item again.
    pub(super) watches: Mutex<idem_core::record::Observations>,
    /// When this runner's last prompt probe write was answered (`writes_served` in the judge): a watch counts
    /// only while the store is seen to take writes, since a SQLite ledger locked by another connection still
    /// serves reads (WAL) while no holder can renew.
    pub(super) probe: tokio::sync::Mutex<Option<tokio::time::Instant>>,
}

impl<S> Ctx<S> {
    /// The context of one run of `cfg` (already checked) over `store`.
    pub(super) fn new(
        store: S,
        cfg: RunConfig,
        stop: Stop,
        report: Option<Report>,
        counters: Arc<Counters>,
        watchdog: Option<Watchdog>,
        program: Option<PathBuf>,
    ) -> Self {
        Self {
            job: cfg.job(),
            owner: owner_token(),
            limit: RetryLimit { max_attempts: cfg.retries.saturating_add(1) },
            checks: Checks { json: cfg.output.ends_with(".json"), expect_fields: cfg.expect_fields.clone() },
            jobs: Semaphore::new(cfg.jobs),
            ahead: Semaphore::new(cfg.jobs),
            turns: turns::Turns::new(),
            halt: AtomicBool::new(false),
            counters,
            executions: AtomicU64::new(0),
            report: report.map(Mutex::new),
            poison: Mutex::new(Vec::new()),
            dry_out: Mutex::new(std::io::BufWriter::new(std::io::stdout())),
            renamer: Arc::new(output::Renamer::default()),
            watchdog,
            program,
            short_of_resources: AtomicBool::new(false),
            outage: Outage::new(cfg.store_outage_limit),
            // Forgetting a watch only delays a claim; a bound keeps a huge run's memory flat.
            watches: Mutex::new(idem_core::record::Observations::new(4096)),
            probe: tokio::sync::Mutex::new(None),
            store,
            cfg,
            stop,
        }
    }

    /// No new command may start: Ctrl-C was pressed, a poison item halts the run, or the store was
    /// unavailable for longer than `--store-outage-limit`.
    /// Every watch starts again ([`idem_core::record::Observations::clear`]): this runner was not served for a while.
    pub(super) fn unwatch_all(&self) {
        self.watches.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.level() > 0 || self.halt.load(Ordering::SeqCst) || self.outage.exceeded()
    }
}

/// A context over a [`idem_store::MemoryStore`] for the steps' unit tests: no report, no watchdog.
#[cfg(test)]
pub(super) fn test_ctx(cfg: RunConfig) -> Ctx<idem_store::MemoryStore> {
    Ctx::new(idem_store::MemoryStore::new(), cfg, Stop::new(), None, Arc::default(), None, None)
}

pub(super) fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}
