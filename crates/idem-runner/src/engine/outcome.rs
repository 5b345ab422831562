//! How each item ended ([`Final`]), counted into the [`Summary`], the progress counters and the report.

use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_store::Store;

use super::Ctx;
use crate::output::Digest256;
use crate::report::ItemReport;
use crate::{Error, FailedItem, Item, ItemError, Summary};

/// How one item ended in this run. `Failed`: out of attempts; `Error`: the runner could not judge or record it
/// (the ledger failed), which is not the item's doing.
#[derive(Debug)]
pub(super) enum Final {
    Done { attempts: u32, digest: Digest256, duration: Duration },
    Skipped { digest: Digest256 },
    Adopted { digest: Digest256 },
    Failed { attempts: u32, error: String },
    Error { error: ItemError },
    Poison { attempts: u32, error: String },
    NotDone { reason: &'static str },
    WouldRun,
}

pub(super) fn record(
    ctx: &Ctx<impl Store>,
    summary: &mut Summary,
    joined: Result<(Item, Result<Final, ItemError>), tokio::task::JoinError>,
) -> Result<(), Error> {
    let (item, result) = match joined {
        Ok(r) => r,
        Err(e) => {
            // A panicking item task is a bug; count it as not done rather than losing the run.
            tracing::error!("item task failed: {e}");
            summary.failed += 1;
            return Ok(());
        }
    };
    let fin = result.unwrap_or_else(|error| Final::Error { error });
    record_final(ctx, summary, &item, fin)
}

pub(super) fn record_final(ctx: &Ctx<impl Store>, summary: &mut Summary, item: &Item, fin: Final) -> Result<(), Error> {
    let c = &ctx.counters;
    let (status, attempts, error, digest, duration) = match &fin {
        Final::Done { attempts, digest, duration } => {
            summary.done += 1;
            c.done.fetch_add(1, Ordering::Relaxed);
            ("done", *attempts, None, Some(digest), Some(*duration))
        }
        Final::Skipped { digest } => {
            summary.skipped += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("skipped", 0, None, Some(digest), None)
        }
        Final::Adopted { digest } => {
            summary.adopted += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("adopted", 0, None, Some(digest), None)
        }
        Final::Failed { attempts, error } => {
            summary.failed += 1;
            summary.out_of_attempts.add(FailedItem {
                line: item.line,
                id: item.id.clone(),
                attempts: *attempts,
                error: error.clone(),
            });
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("failed", *attempts, Some(error.clone()), None, None)
        }
        Final::Error { error } => {
            summary.failed += 1;
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("failed", 0, Some(error.to_string()), None, None)
        }
        Final::Poison { attempts, error } => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("poison", *attempts, Some(error.clone()), None, None)
        }
        Final::NotDone { reason } => {
            summary.not_done += 1;
            (*reason, 0, None, None, None)
        }
        Final::WouldRun => {
            summary.would_run += 1;
            c.done.fetch_add(1, Ordering::Relaxed);
            ("would_run", 0, None, None, None)
        }
    };
    if let Some(report) = &ctx.report {
        let output = ctx.cfg.output_path(&item.id);
        report.lock().unwrap_or_else(|p| p.into_inner()).item(&ItemReport {
            id: &item.id,
            line: item.line,
            status,
            attempts,
            last_error: error.as_deref(),
            sha256: digest.map(|d| d.sha256.as_str()),
            duration_ms: duration.map(|d| d.as_millis() as u64),
            output: &output.display().to_string(),
        })?;
    }
    Ok(())
}

/// Records a poison item: one that turned poison in this run, or one an earlier run found poison, which is not
/// run again (only the first halts the run: see the `FailureVerdict::Poison` arm of [`process`]).
pub(super) fn poisoned<S>(ctx: &Ctx<S>, item: &Item, attempts: u32, error: String) -> Final {
    ctx.poison.lock().unwrap_or_else(|p| p.into_inner()).push((item.id.clone(), error.clone()));
    Final::Poison { attempts, error }
}
