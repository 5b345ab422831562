//! The run itself: stream items, judge each against the ledger and its output, claim, run, verify, rename.
//!
//! The steps of one item, each in its own module: [`judge`] (the ledger entry and the output file decide
//! what the item needs), [`claim`] (the lease and the entry, then a slot), [`attempt`] (spawn the command and
//! wait for it), [`after_exit`] (output checks, fsync, fence, rename; then record the attempt in the ledger), and
//! [`process`], which drives them per item as a loop over [`process::Step`]; [`outcome`] counts how each item
//! ended and [`summary`] says what the run did. [`Stop`] is the operator's Ctrl-C. The command itself is
//! spawned and watched by [`crate::supervise`].

mod after_exit;
mod attempt;
mod claim;
mod consume;
mod judge;
mod ledger;
mod lines;
mod outcome;
mod process;
mod step;
mod turns;
mod verify;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use idem_core::ledger::RetryLimit;
use idem_store::{Store, system_time_to_millis};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::output::{self, Checks};
use crate::progress::{Counters, Progress};
use crate::report::Report;
use crate::supervise::{Watchdog, host_name, owner_token};
use crate::{CheckedConfig, Error, Item, ItemError, RunConfig, Summary};

use outcome::{Final, record};

pub use idem_store::Stop;

/// What every item of one run shares: the ledger, the settings and the run's shared state. Made once by
/// [`run_checked`] ([`Ctx::new`]) and shared by the item tasks behind an `Arc`.
pub(crate) struct Ctx<S> {
    /// The ledger.
    store: S,
    /// The run's settings, checked ([`RunConfig::checked`]); `jobs` lowered to the open-file limit.
    cfg: RunConfig,
    /// The job's name in the ledger keys ([`RunConfig::job`]).
    job: String,
    /// This process start's owner token ([`owner_token`]): written in the entries it claims and in its
    /// temporary file names.
    owner: String,
    /// Attempts an item may use in all (`--retries` + 1).
    limit: RetryLimit,
    /// What an output must be to count (JSON when the template ends in `.json`, `--expect-field`s).
    checks: Checks,
    /// Slots: `--jobs` commands run at once. An item holds one from just before its command starts until the
    /// command exits (a failed one keeps it for its retry).
    jobs: Semaphore,
    /// Items claimed before a slot is free, at most `--jobs` of them: their claim writes commit while other
    /// commands run, instead of inside the slot.
    ahead: Semaphore,
    /// Items queue for a claim in input order ([`turns`]).
    turns: Arc<turns::Turns>,
    /// The operator's stop requests.
    stop: Stop,
    /// An item turned poison in this run under `--on-poison halt`: nothing new starts.
    halt: AtomicBool,
    /// What the progress display shows, updated as items move.
    counters: Arc<Counters>,
    /// Commands this run started ([`Summary::executions`]).
    executions: AtomicU64,
    /// The `--report` file, written item by item.
    report: Option<Mutex<Report>>,
    /// Poison items (id, error) in the order found, for [`Summary::poison`].
    poison: Mutex<Vec<(String, String)>>,
    /// Standard output of a dry run (one line per item it lists).
    dry_out: Mutex<std::io::BufWriter<std::io::Stdout>>,
    /// Renames outputs into place, fsyncing each directory once.
    renamer: Arc<output::Renamer>,
    /// The process that kills the commands' process groups if this runner is killed; `None` for a dry run (or
    /// when it could not start).
    watchdog: Option<Watchdog>,
    /// The command's program found in `PATH` once for the run; `None` when it is a path already, contains a
    /// placeholder, or was not found (then each spawn looks it up, and fails with the usual error).
    program: Option<PathBuf>,
    /// Set once a command could not start for want of descriptors or processes (warned about once).
    short_of_resources: AtomicBool,
    /// The store's outages as the run rides them out; one outlasting `--store-outage-limit` ends the run.
    outage: ledger::Outage,
    /// Items another runner holds, watched until their holder counts as gone ([`judge`]'s claim gate): by
    /// observation, not by the store's TTL, so after an outage the holder gets a lease to take its item again.
    watches: Mutex<idem_core::record::Observations>,
    /// When this runner's last prompt probe write was answered (`writes_served` in the judge): a watch counts
    /// only while the store is seen to take writes, since a SQLite ledger locked by another connection still
    /// serves reads (WAL) while no holder can renew.
    probe: tokio::sync::Mutex<Option<tokio::time::Instant>>,
}

impl<S> Ctx<S> {
    /// The context of one run of `cfg` (already checked) over `store`.
    fn new(
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
            outage: ledger::Outage::new(cfg.store_outage_limit),
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
    fn unwatch_all(&self) {
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

/// What an item task hands back: the item and how it ended.
type ItemTask = (Item, Result<Final, ItemError>);

pub(super) fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}

/// Runs `cfg` against the ledger in `store` until every item is done, a poison item halts it, or `stop` is
/// requested.
///
/// Items are streamed: at most a few hundred are in flight at once whatever the file's size.
///
/// # Panics
/// On a current-thread tokio runtime: reading the items file uses `block_in_place`, which needs the
/// multi-thread runtime.
///
/// # Errors
/// Refusals before anything runs ([`Error::Config`], [`Error::BadItem`], [`Error::DuplicateOutput`],
/// [`Error::ReadItems`]) and report write failures. Failures of single items are counted in the [`Summary`].
pub async fn run<S: Store + Clone>(store: S, cfg: RunConfig, stop: Stop) -> Result<Summary, Error> {
    let checked = tokio::task::block_in_place(|| cfg.checked())?;
    run_checked(store, checked, stop).await
}

/// [`run`] with a configuration checked already ([`RunConfig::checked`]): a caller that checks before it opens
/// or creates the ledger leaves none behind when the run is refused.
///
/// # Errors
/// [`Error::ReadItems`] when the items file went away since it was checked, and report write failures.
pub async fn run_checked<S: Store + Clone>(store: S, checked: CheckedConfig, stop: Stop) -> Result<Summary, Error> {
    let CheckedConfig { cfg, total, program, source } = checked;
    let started = Instant::now();
    let report = match &cfg.report {
        Some(path) => Some(Report::create(path, &cfg.job(), &host_name(), &cfg.output)?),
        None => None,
    };
    let counters = Arc::new(Counters::default());
    let known = (!cfg.streamed()).then_some(total);
    let progress = Progress::start(cfg.progress, known, counters.clone(), cfg.dry_run);
    let watchdog = if cfg.dry_run { None } else { Watchdog::for_lease(cfg.lease) };
    let ctx = Arc::new(Ctx::new(store, cfg, stop, report, counters, watchdog, program));
    let mut set = JoinSet::new();
    let mut summary = Summary {
        total,
        dry_run: ctx.cfg.dry_run,
        retries: ctx.cfg.retries,
        output: ctx.cfg.output.clone(),
        name: ctx.cfg.name.clone(),
        queue: ctx.cfg.queue.is_some(),
        ..Summary::default()
    };
    let seen = match &ctx.cfg.queue {
        Some(url) => consume::run_queue(&ctx, url, source, &mut summary, &mut set).await?,
        None => lines::run_lines(&ctx, &mut summary, &mut set, ctx.cfg.streamed()).await?,
    };
    while let Some(joined) = set.join_next().await {
        record(&ctx, &mut summary, joined)?;
    }
    if ctx.cfg.streamed() {
        // Nothing was counted up front: the total is what came.
        summary.total = seen;
    }
    // Lines appended to the items file during the run are seen but were not counted up front.
    summary.not_done += total.saturating_sub(seen);
    summary.interrupted = ctx.stop.level() > 0;
    summary.halted = ctx.halt.load(Ordering::SeqCst);
    summary.store_unavailable = ctx.outage.exceeded();
    summary.executions = ctx.executions.load(Ordering::SeqCst);
    summary.stopped = ctx.counters.stopped.load(Ordering::Relaxed);
    summary.poison = std::mem::take(&mut *ctx.poison.lock().unwrap_or_else(|p| p.into_inner()));
    // Recorded as items turned poison (whichever command ended first); shown by id, as people number them.
    summary.poison.sort_by(|a, b| crate::natural_cmp(&a.0, &b.0));
    summary.elapsed = started.elapsed();
    progress.finish().await;
    if let Some(watchdog) = &ctx.watchdog {
        watchdog.finish();
    }
    if let Ok(mut out) = ctx.dry_out.lock() {
        let _ = out.flush();
    }
    if let Some(report) = &ctx.report {
        report.lock().unwrap_or_else(|p| p.into_inner()).finish(&summary)?;
    }
    Ok(summary)
}
