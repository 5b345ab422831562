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
mod ctx;
mod judge;
mod ledger;
mod lines;
mod outage;
mod outcome;
mod process;
mod room;
mod step;
mod turns;
mod verify;

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use idem_store::Store;
use tokio::task::JoinSet;

use crate::config::{CheckedConfig, RunConfig};
use crate::error::Error;
use crate::progress::{Counters, Progress};
use crate::report::Report;
use crate::summary::Summary;
use crate::supervise::{Watchdog, host_name};

use ctx::Ctx;
use outcome::record;

pub use idem_store::Stop;

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
    summary.poison.sort_by(|a, b| crate::shown::natural_cmp(&a.0, &b.0));
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
