//! Judging an item before anything runs: its ledger entry and the file at its final path decide whether it is
//! done, adoptable, or needs running; a chunk of items is judged at once for a cheap resume.

use idem_core::{Entry, ItemKeys, Plan};
use idem_store::Store;

use super::Ctx;
use crate::Item;
use crate::output::{self, Digest256, Invalid};

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
