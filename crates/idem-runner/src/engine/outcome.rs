//! How each item ended ([`Final`]), counted into the [`Summary`], the progress counters and the report.

use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_store::Store;

use super::ctx::Ctx;
use crate::error::{Error, ItemError};
use crate::items::Item;
use crate::output::Digest256;
use crate::report::ItemReport;
use crate::summary::{FailedItem, Summary};

/// What an item task hands back: the item and how it ended.
pub(super) type ItemTask = (Item, Result<Final, ItemError>);

/// How one item ended in this run. `Failed`: out of attempts; `Error`: the runner could not judge or record it
/// (the ledger failed), which is not the item's doing.
#[derive(Debug)]
pub(super) enum Final {
    Done {
        attempts: u32,
        digest: Digest256,
        duration: Duration,
    },
    Skipped {
        digest: Digest256,
    },
    /// `--check` said the item's effect is there before its command ran: recorded done, no command ran.
    Checked,
    Adopted {
        digest: Digest256,
    },
    /// Recorded done by another host, whose output only that host can see: not checked here.
    DoneElsewhere {
        host: String,
        digest: Digest256,
    },
    Failed {
        attempts: u32,
        error: String,
    },
    Error {
        error: ItemError,
    },
    Poison {
        attempts: u32,
        error: String,
    },
    NotDone {
        reason: &'static str,
    },
    /// An item whose last attempt failed with attempts left, not retried because the run stopped (halted by a
    /// poison item, or Ctrl-C): not done, counted so, but reported with its attempts and error, as the ledger
    /// (and `idem runs status`) has it.
    Unretried {
        attempts: u32,
        error: String,
    },
    WouldRun,
    /// A queue message that is no item (not UTF-8, empty, no usable id): rejected without running.
    Malformed {
        reason: String,
    },
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
    let mut host = None;
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
        Final::Checked => {
            summary.skipped += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("checked", 0, None, None, None)
        }
        Final::Adopted { digest } => {
            summary.adopted += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("adopted", 0, None, Some(digest), None)
        }
        Final::DoneElsewhere { host: h, digest } => {
            summary.done_elsewhere += 1;
            *summary.elsewhere.entry(h.clone()).or_default() += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            host = Some(h.as_str());
            ("done_elsewhere", 0, None, Some(digest), None)
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
        Final::Unretried { attempts, error } => {
            summary.not_done += 1;
            ("failed", *attempts, Some(error.clone()), None, None)
        }
        Final::Malformed { reason } => {
            summary.failed += 1;
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("malformed", 0, Some(reason.clone()), None, None)
        }
        Final::WouldRun => {
            summary.would_run += 1;
            c.done.fetch_add(1, Ordering::Relaxed);
            ("would_run", 0, None, None, None)
        }
    };
    if let Some(report) = &ctx.report {
        let output = ctx.cfg.output_of(&item.id);
        report.lock().unwrap_or_else(|p| p.into_inner()).item(&ItemReport {
            id: &item.id,
            line: item.line,
            status,
            attempts,
            last_error: error.as_deref(),
            // A job without output files has no digest to show (the ledger keeps that of nothing).
            sha256: digest.filter(|_| output.is_some()).map(|d| d.sha256.as_str()),
            duration_ms: duration.map(|d| d.as_millis() as u64),
            output: &output.map(|o| o.display().to_string()).unwrap_or_default(),
            host,
        })?;
    }
    Ok(())
}

/// Records a poison item: one that turned poison in this run, or one an earlier run found poison, which is not
/// run again (only the first halts the run: see the `ledger::Failure::Poison` arm of [`process`]).
pub(super) fn poisoned<S>(ctx: &Ctx<S>, item: &Item, attempts: u32, error: String) -> Final {
    ctx.poison.lock().unwrap_or_else(|p| p.into_inner()).push((item.id.clone(), error.clone()));
    Final::Poison { attempts, error }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::config::RunConfig;
    use crate::engine::ctx::test_ctx;
    use crate::report::Report;

    fn item(line: u64, id: &str) -> Item {
        Item { line, id: id.to_owned(), raw: id.to_owned() }
    }

    fn digest() -> Digest256 {
        Digest256 { sha256: "ab".repeat(32), size: 2 }
    }

    #[test]
    fn each_ending_is_counted_once_in_the_summary_and_the_progress() {
        let ctx = test_ctx(RunConfig::new("items", "out/{id}.txt", vec!["true".into()]));
        let mut summary = Summary { total: 9, ..Summary::default() };
        let ends = [
            Final::Done { attempts: 1, digest: digest(), duration: Duration::from_millis(5) },
            Final::Skipped { digest: digest() },
            Final::Adopted { digest: digest() },
            Final::Failed { attempts: 4, error: "exit 1: boom".into() },
            Final::Error { error: ItemError::NoGeneration },
            Final::Poison { attempts: 2, error: "exit 1: boom".into() },
            Final::NotDone { reason: "interrupted" },
            Final::NotDone { reason: "not_started" },
            Final::WouldRun,
        ];
        for (n, fin) in ends.into_iter().enumerate() {
            record_final(&ctx, &mut summary, &item(n as u64 + 1, &format!("i{n}")), fin).expect("no report");
        }
        assert_eq!(
            (summary.done, summary.skipped, summary.adopted, summary.failed, summary.not_done, summary.would_run),
            (1, 1, 1, 2, 2, 1)
        );
        // Poison items are listed from the context when the run ends, not here.
        assert!(summary.poison.is_empty());
        assert_eq!(summary.out_of_attempts.count, 1, "a ledger error is not out of attempts");
        assert_eq!(
            summary.out_of_attempts.first,
            vec![FailedItem { line: 4, id: "i3".into(), attempts: 4, error: "exit 1: boom".into() }]
        );
        let c = &ctx.counters;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        // Adopted counts as skipped, poison as failed, a dry run's listing as done.
        assert_eq!((load(&c.done), load(&c.skipped), load(&c.failed)), (2, 2, 3));
    }

    #[tokio::test]
    async fn a_panicked_item_task_counts_as_failed_without_a_report_line() {
        let ctx = test_ctx(RunConfig::new("items", "out/{id}.txt", vec!["true".into()]));
        let mut summary = Summary::default();
        let joined = tokio::spawn(async {
            let panics = true;
            assert!(!panics, "a bug in an item task");
            (item(1, "a"), Ok(Final::WouldRun))
        })
        .await;
        record(&ctx, &mut summary, joined).expect("recorded");
        assert_eq!((summary.failed, summary.would_run), (1, 0));
        assert_eq!(ctx.counters.failed.load(Ordering::Relaxed), 0, "the progress does not see it");
    }

    #[test]
    fn a_ledger_error_is_a_failure_and_the_report_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("report.json");
        let mut ctx = test_ctx(RunConfig::new("items", "out/{id}.txt", vec!["true".into()]));
        ctx.report = Some(Mutex::new(Report::create(&path, "job", "host", "").expect("report")));
        let mut summary = Summary::default();
        record(&ctx, &mut summary, Ok((item(1, "a"), Err(ItemError::NoGeneration)))).expect("recorded");
        assert_eq!(summary.failed, 1);
        let mut report = ctx.report.take().expect("report").into_inner().expect("lock");
        report.finish(&summary).expect("finish");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("the report is JSON");
        let line = &json["items"][0];
        assert_eq!(line["id"], "a");
        assert_eq!(line["status"], "failed");
        assert_eq!(line["attempts"], 0);
        assert_eq!(line["last_error"], "ledger put returned no generation");
        assert_eq!(line["output"], "out/a.txt");
        assert_eq!(json["summary"]["failed"], 1);
    }
}
