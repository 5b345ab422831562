//! Judging an item before anything runs: its ledger entry and the file at its final path decide whether it is
//! done, adoptable, or needs running; a chunk of items is judged at once for a cheap resume.

use std::io::Write as _;
use std::path::Path;

use idem_core::{Entry, ItemKeys, Plan};
use idem_store::Store;

use super::attempt::verify_cmd;
use super::outcome::{Final, poisoned};
use super::process::{ItemRun, Step};
use super::{Ctx, apply, now_ms};
use crate::output::{self, Digest256, Invalid};
use crate::{Item, ItemError};

/// Items judged together: one ledger read and one trip to the blocking pool per chunk.
pub(super) const CHUNK: usize = 128;

/// Finds the items of `chunk` that are done (ledger entry done, output with the recorded digest) in one
/// `get_many` and one batch of file checks, so a resume pass over finished work costs no task per item. The
/// rest (`None`) go through [`process`], which judges them again one by one, starting from the entries read
/// here.
pub(super) async fn settle_done<S: Store>(ctx: &Ctx<S>, chunk: &[Item]) -> (Vec<Option<Digest256>>, Vec<Prefetched>) {
    let keys: Vec<String> = chunk.iter().map(|i| ItemKeys::new(&ctx.job, &i.id).entry().to_owned()).collect();
    let Ok(values) = ctx.store.get_many(&keys).await else {
        return (vec![None; chunk.len()], vec![None; chunk.len()]);
    };
    let done = check_done(ctx, chunk, &values).await;
    (done, values.into_iter().map(Some).collect())
}

/// An entry read ahead for an item: `Some(read)` saves [`process`] its first ledger read.
pub(super) type Prefetched = Option<Option<idem_store::Versioned>>;

async fn check_done<S: Store>(
    ctx: &Ctx<S>,
    chunk: &[Item],
    values: &[Option<idem_store::Versioned>],
) -> Vec<Option<Digest256>> {
    let none = || vec![None; chunk.len()];
    let checks: Vec<Option<(std::path::PathBuf, Digest256)>> = values
        .iter()
        .zip(chunk)
        .map(|(value, item)| match Entry::decode(value.as_ref()?.value()).ok()? {
            Entry::Done { sha256, size, .. } => Some((ctx.cfg.output_path(&item.id), Digest256 { sha256, size })),
            _ => None,
        })
        .collect();
    if checks.iter().all(Option::is_none) {
        return none();
    }
    tokio::task::spawn_blocking(move || {
        checks
            .into_iter()
            .map(|check| {
                let (path, digest) = check?;
                output::matches(&path, &digest).ok().map(|()| digest)
            })
            .collect()
    })
    .await
    .unwrap_or_else(|_| none())
}

/// Why a dry run would execute an item, or `None` when it would not.
pub(super) fn dry_reason(
    entry: Option<&Entry>,
    plan: &Plan,
    output: &Result<(), Invalid>,
    held: bool,
) -> Option<String> {
    match (plan, entry) {
        (Plan::New, _) => Some(match output {
            Err(Invalid::Missing) => "new".to_owned(),
            Err(why) => format!("partial output at the final path ({why})"),
            Ok(()) => return None,
        }),
        (Plan::CheckDone { .. }, _) => output.as_ref().err().map(|why| format!("done, but the output changed: {why}")),
        (Plan::Retry { attempts }, Some(Entry::Running { owner, .. })) if held => {
            Some(format!("claimed by {owner} (attempt {attempts}), runs once its lease lapses"))
        }
        (Plan::Retry { attempts }, Some(Entry::Running { owner, .. })) => {
            Some(format!("abandoned by {owner} during attempt {attempts} (no live lease): runs again"))
        }
        // Said whatever the file at the final path looks like: the interrupted command may have written it.
        (Plan::Retry { .. }, Some(Entry::Interrupted { owner, attempt, .. })) => Some(format!(
            "attempt {attempt} interrupted (run by {owner}; not counted, and a file at the final path is not \
             adopted): runs again"
        )),
        (Plan::Retry { attempts }, e) => {
            Some(format!("failed {attempts} time(s): {}", e.and_then(Entry::last_error).unwrap_or("unknown error")))
        }
        (Plan::Poison { .. } | Plan::Exhausted { .. }, _) => None,
    }
}

/// What the file at an item's final path says, where its plan depends on it: for [`Plan::New`] whether it is a
/// verified output (passing `--verify` too) that may be adopted, for [`Plan::CheckDone`] whether it still has
/// the recorded digest; `None` for the other plans.
async fn output_state<S: Store>(
    ctx: &Ctx<S>,
    plan: &Plan,
    output: &Path,
) -> Result<Option<Result<Digest256, Invalid>>, ItemError> {
    Ok(match plan {
        Plan::New => {
            let (path, checks) = (output.to_owned(), ctx.checks.clone());
            match tokio::task::spawn_blocking(move || output::verify(&path, &checks)).await {
                Ok(Ok(digest)) => match verify_cmd(ctx, output).await {
                    Ok(()) => Some(Ok(digest)),
                    Err(_) => Some(Err(Invalid::Unreadable("--verify refused it".into()))),
                },
                Ok(Err(why)) => Some(Err(why)),
                Err(e) => return Err(ItemError::OutputCheck(e)),
            }
        }
        Plan::CheckDone { sha256, size } => {
            let expected = Digest256 { sha256: sha256.clone(), size: *size };
            let path = output.to_owned();
            let got = tokio::task::spawn_blocking(move || output::matches(&path, &expected).map(|()| expected))
                .await
                .map_err(ItemError::OutputCheck)?;
            Some(got)
        }
        _ => None,
    })
}

/// Judges an item from its ledger entry (read ahead with its chunk the first time, else now) and the file at
/// its final path: it ends here (skipped, adopted, poison, out of attempts; in a dry run, would run), waits
/// for another runner's last attempt, or needs running.
pub(super) async fn judge<S: Store>(ctx: &Ctx<S>, run: &mut ItemRun<'_>) -> Result<Step, ItemError> {
    let (item, keys) = (run.item, &run.keys);
    let read = match run.prefetched.take() {
        Some(read) => read,
        None => ctx.store.get(keys.entry()).await.map_err(ItemError::LedgerRead)?,
    };
    let (generation, entry) = match read {
        Some(v) => {
            let entry = Entry::decode(v.value()).map_err(ItemError::EntryUnreadable)?;
            (Some(v.generation()), Some(entry))
        }
        None => (None, None),
    };
    let plan = idem_core::plan(entry.as_ref(), ctx.limit);
    // Its last allowed attempt may still be running in another runner: "out of attempts" only once that
    // runner's lease is gone (it crashed), else wait for its result like any held item.
    if matches!(plan, Plan::Exhausted { .. })
        && matches!(entry, Some(Entry::Running { .. }))
        && !ctx.cfg.dry_run
        && ctx.store.get(keys.lease()).await.map_err(ItemError::LedgerRead)?.is_some()
    {
        return Ok(Step::WaitForHolder);
    }
    let out_state = output_state(ctx, &plan, &run.output).await?;
    if ctx.cfg.dry_run {
        let unit = out_state.as_ref().map(|r| r.as_ref().map(|_| ()).map_err(Clone::clone));
        // A running entry is only held while its lease lives: a crashed or interrupted holder's is not.
        let held = matches!(entry, Some(Entry::Running { .. }))
            && ctx.store.get(keys.lease()).await.map_err(ItemError::LedgerRead)?.is_some();
        if let Some(reason) = dry_reason(entry.as_ref(), &plan, &unit.unwrap_or(Ok(())), held) {
            if let Ok(mut out) = ctx.dry_out.lock() {
                let _ = writeln!(out, "{}\t{}", item.id, reason);
            }
            return Ok(Step::End(Final::WouldRun));
        }
    }
    let fin = match (&plan, out_state) {
        (Plan::New, Some(Ok(digest))) => {
            if ctx.cfg.dry_run {
                if let Ok(mut out) = ctx.dry_out.lock() {
                    let _ = writeln!(out, "{}\tadopt: a verified output without a ledger entry", item.id);
                }
                return Ok(Step::End(Final::Adopted { digest }));
            }
            // A verified output nobody recorded (a lost ledger, or a run killed between rename and record).
            let write = idem_core::adopt(keys, &digest.sha256, digest.size, now_ms());
            match apply(&ctx.store, write).await {
                Ok(_) => Final::Adopted { digest },
                Err(e) if e.is_precondition_failed() => return Ok(Step::Judge),
                Err(e) => return Err(ItemError::LedgerWrite(e)),
            }
        }
        (Plan::CheckDone { .. }, Some(Ok(digest))) => Final::Skipped { digest },
        (Plan::Poison { last_error }, _) => {
            poisoned(ctx, item, entry.as_ref().map_or(0, Entry::attempts), last_error.clone())
        }
        (Plan::Exhausted { attempts, last_error }, _) => {
            Final::Failed { attempts: *attempts, error: last_error.clone() }
        }
        _ if ctx.cfg.dry_run => Final::WouldRun,
        _ => {
            let prev = match (generation, entry) {
                (Some(g), Some(e)) => Some((g, e)),
                _ => None,
            };
            return Ok(Step::Run(prev));
        }
    };
    Ok(Step::End(fin))
}
