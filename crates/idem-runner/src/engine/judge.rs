//! Judging an item before anything runs: its ledger entry and the file at its final path decide whether it is
//! done, adoptable, or needs running; a chunk of items is judged at once for a cheap resume.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use idem_core::ledger::{Entry, Keys, Plan};
use idem_store::{Precondition, Store, Ttl};

use super::after_exit::{Noted, noted_output};
use super::ctx::{Ctx, now_ms};
use super::ledger::{self, Waiting};
use super::outcome::{Final, poisoned};
use super::step::{ItemRun, Prefetched, Step};
use super::verify::verify_cmd;
use crate::error::ItemError;
use crate::items::Item;
use crate::output::{self, Digest256, Invalid};

/// Items judged together: one ledger read and one trip to the blocking pool per chunk.
pub(super) const CHUNK: usize = 128;

/// What the judging of a whole chunk decided for one item.
pub(super) enum Judged {
    /// Done: its entry says so and its output has the recorded digest (skipped without a task).
    Done(Digest256),
    /// A dry run's new item: no ledger entry and nothing at its output path, listed "new" without a task.
    DryNew,
    /// Judged one by one ([`process`](super::process::process)), starting from the entry read here.
    Open(Prefetched),
}

/// Judges the items of `chunk` that can be judged together, in one `get_many` and one batch of file checks,
/// so a resume pass over finished work, or a dry run over new items, costs no task per item: the items that
/// are done ([`Judged::Done`]) and, in a dry run, the new ones ([`Judged::DryNew`]). The rest
/// ([`Judged::Open`]) go through `process`, which judges them again one by one.
pub(super) async fn judge_done<S: Store>(ctx: &Ctx<S>, chunk: &[Item]) -> Vec<Judged> {
    let keys: Vec<String> = chunk.iter().map(|i| Keys::new(&ctx.job, &i.id).entry().to_owned()).collect();
    let Ok(values) = ctx.store.get_many(&keys).await else {
        return chunk.iter().map(|_| Judged::Open(None)).collect();
    };
    let verdicts = check_done(ctx, chunk, &values).await;
    verdicts.into_iter().zip(values).map(|(verdict, value)| verdict.unwrap_or(Judged::Open(Some(value)))).collect()
}

/// What one item of a chunk needs looked at on disk before it is judged together with the others.
enum Look {
    /// Recorded done here: its output (if the job has output files) must still have this digest.
    Done(Option<std::path::PathBuf>, Digest256),
    /// A dry run's item without an entry: new if nothing is at its output path (if the job has output files).
    Absent(Option<std::path::PathBuf>),
}

async fn check_done<S: Store>(
    ctx: &Ctx<S>,
    chunk: &[Item],
    values: &[Option<idem_store::Versioned>],
) -> Vec<Option<Judged>> {
    let none = || chunk.iter().map(|_| None).collect();
    let looks: Vec<Option<Look>> = values
        .iter()
        .zip(chunk)
        .map(|(value, item)| {
            let Some(value) = value else {
                return ctx.cfg.dry_run.then(|| Look::Absent(ctx.cfg.output_of(&item.id)));
            };
            match Entry::decode(value.value()).ok()? {
                // An entry recorded for another text is judged one by one, where it is said (or refused).
                Entry::Done { item_sha256: Some(recorded), .. } if recorded != crate::items::text_sha256(&item.raw) => {
                    None
                }
                // Done on another host: judged one by one, where it is counted as such.
                Entry::Done { owner, .. } if elsewhere(ctx, &owner).is_some() => None,
                Entry::Done { sha256, size, .. } => {
                    Some(Look::Done(ctx.cfg.output_of(&item.id), Digest256 { sha256, size }))
                }
                _ => None,
            }
        })
        .collect();
    let on_disk = |look: &Option<Look>| matches!(look, Some(Look::Done(Some(_), _) | Look::Absent(Some(_))));
    if !looks.iter().any(on_disk) {
        // No file to look at (none done, or a job without output files, where recorded done is done).
        return looks.into_iter().map(|look| look.and_then(|l| decide(l, |_| true))).collect();
    }
    tokio::task::spawn_blocking(move || {
        looks.into_iter().map(|look| look.and_then(|l| decide(l, |path| path.is_none_or(absent)))).collect()
    })
    .await
    .unwrap_or_else(|_| none())
}

/// The verdict on one item from what is on disk (`nothing_at` says whether nothing is at an output path);
/// `None` sends it to be judged one by one.
fn decide(look: Look, nothing_at: impl Fn(Option<&Path>) -> bool) -> Option<Judged> {
    match look {
        Look::Done(Some(path), digest) => output::matches(&path, &digest).ok().map(|()| Judged::Done(digest)),
        Look::Done(None, digest) => Some(Judged::Done(digest)),
        Look::Absent(path) => nothing_at(path.as_deref()).then_some(Judged::DryNew),
    }
}

/// Nothing at `path`, not even a dangling link or a file this runner may not read (those are judged one by
/// one, where the reason is said).
fn absent(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
}

/// Lists `id` with the reason a dry run would execute it, in input order: after every item before it
/// (`turn`, when it has one) has been listed or has left.
pub(super) async fn say_dry<S>(ctx: &Ctx<S>, turn: Option<&super::turns::Turn>, id: &str, reason: &str) {
    if let Some(turn) = turn {
        turn.wait().await;
    }
    if let Ok(mut out) = ctx.dry_out.lock() {
        let _ = writeln!(out, "{id}\t{reason}");
    }
}

/// The host that recorded a done entry of `owner`, when it is not this one and its outputs are not required
/// here (`--require-local-output`): its output is on that host, which alone verifies it.
fn elsewhere<S>(ctx: &Ctx<S>, owner: &str) -> Option<String> {
    if ctx.cfg.require_local_output {
        return None;
    }
    let (theirs, ours) = (crate::supervise::owner_host(owner)?, crate::supervise::owner_host(&ctx.owner)?);
    (theirs != ours).then(|| theirs.to_owned())
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
    output: Option<&Path>,
) -> Result<Option<Result<Digest256, Invalid>>, ItemError> {
    let Some(output) = output else {
        // Without output files, done is what the ledger recorded and nothing is adopted: a new item runs.
        return Ok(match plan {
            Plan::New => Some(Err(Invalid::Missing)),
            Plan::CheckDone { sha256, size } => Some(Ok(Digest256 { sha256: sha256.clone(), size: *size })),
            _ => None,
        });
    };
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

/// An item whose id names an entry recorded for another text. From a queue it is rejected without running
/// (the message is dead-lettered; JetStream: terminated) and counted as failed: a producer reusing a message
/// id for another payload would otherwise have it acknowledged as done, or retried under another's count.
/// From a file or a pipe it is warned about once and judged by its entry as usual (the items file may have
/// changed, and the entry still says whether that id ran): `None`.
fn reused<S>(ctx: &Ctx<S>, item: &Item, warned: &mut bool) -> Option<Final> {
    if ctx.cfg.queue.is_some() {
        let reason = format!(
            "id reused with another body: the ledger has {} recorded for another item text; the message is \
             rejected without requeue and not run",
            item.id
        );
        tracing::warn!("{reason}");
        return Some(Final::Malformed { reason });
    }
    if !std::mem::replace(warned, true) {
        tracing::warn!(
            "item {} (line {}): id reused with another body: the ledger has it recorded for another item text \
             (the items file changed?); judged by that entry (done stays done): `idem runs forget` it to run \
             this text",
            item.id,
            item.line
        );
    }
    None
}

/// The claim gate: whether the runner whose attempt the item's entry says is running counts as gone, so the
/// item may be claimed over. Gone means its lease key is absent *and* this runner has watched the item for a
/// whole lease without seeing a generation larger than the largest it saw (of the entry, or of the lease key:
/// every write of the holder, a renewal, a retake, a done, makes one), by its own clock
/// ([`idem_core::record::Observations::watch`]).
///
/// The store's TTL alone would do for safety (every claim is conditional), not for waste: after an outage, or
/// a SQLite ledger locked, longer than a lease, every lease has lapsed by the store's clock and whoever reached
/// the store first would claim, discarding the holder's attempt, which may have finished meanwhile. Watches
/// start again when this runner was not served (`ledger::patient`, `ledger::recover`), so the holder, back at
/// the same moment, has a lease to take its lease again ([`ledger::regain`]) before anyone claims over it.
/// The cost: a crashed runner's items are claimed a lease after they are first seen, not at once.
async fn holder_gone<S: Store>(ctx: &Ctx<S>, keys: &Keys) -> Result<bool, ItemError> {
    if idem_core::planted("runner-lapse-by-clock") {
        // Planted: the store's TTL decides alone.
        let lease = ledger::get(ctx, Waiting::Unstarted, keys.lease()).await.map_err(ItemError::LedgerRead)?;
        return Ok(lease.is_none());
    }
    if !writes_served(ctx).await {
        return Ok(false);
    }
    let sent = tokio::time::Instant::now();
    let lease = ledger::get(ctx, Waiting::Unstarted, keys.lease()).await.map_err(ItemError::LedgerRead)?;
    let entry = ledger::get(ctx, Waiting::Unstarted, keys.entry()).await.map_err(ItemError::LedgerRead)?;
    let answered = tokio::time::Instant::now();
    let Some(observed) = [&lease, &entry].into_iter().flatten().map(idem_store::Versioned::generation).max() else {
        // Nothing left to watch (forgotten meanwhile): the claim's own preconditions decide.
        return Ok(true);
    };
    let watch = ctx.watches.lock().unwrap_or_else(|p| p.into_inner()).watch(
        keys.lease(),
        observed,
        ctx.cfg.lease,
        sent.into_std(),
        answered.into_std(),
    );
    Ok(lease.is_none() && matches!(watch, idem_core::record::Watch::Lapsed(_)))
}

/// An entry counted by an attempt whose runner gave up waiting for the count's answer (the store unavailable
/// past the limit, or a stop), noted beside the output ([`output::uncounted_path`]): that count landed late,
/// and the command never started. Once that runner's lease is gone the entry goes back to what the count
/// replaced ([`idem_core::ledger::uncount`], fenced on the counted entry), and the item is judged again: the
/// attempt is not spent. `None` when there is no such note for this entry's attempt.
async fn uncount_noted<S: Store>(
    ctx: &Ctx<S>,
    run: &ItemRun<'_>,
    output: &Path,
    generation: idem_store::Generation,
    owner: &str,
    attempt: u32,
) -> Result<Option<Step>, ItemError> {
    let note = output::uncounted_path(output);
    let read = note.clone();
    let Ok(Some(noted)) = tokio::task::spawn_blocking(move || output::read_uncounted(&read)).await else {
        return Ok(None);
    };
    if noted.owner != owner || noted.attempt != attempt {
        // Another attempt's count: that one did not land, or the item moved on since.
        return Ok(None);
    }
    if !holder_gone(ctx, &run.keys).await? {
        return Ok(Some(Step::WaitForHolder));
    }
    let write = idem_core::ledger::uncount(&run.keys, generation, noted.prior.as_ref());
    match ledger::apply(ctx, Waiting::Unstarted, write).await {
        Ok(_) => {
            tracing::info!(item = %run.item.id, attempt, "an attempt counted after its runner gave up waiting for the count never started: not counted");
            let _ = tokio::fs::remove_file(&note).await;
            Ok(Some(Step::Judge))
        }
        // Claimed or recorded meanwhile: judged again from what is there now.
        Err(e) if e.is_precondition_failed() => Ok(Some(Step::Judge)),
        Err(e) => Err(ItemError::LedgerWrite(e)),
    }
}

/// Whether the store takes this runner's writes promptly now: a holder that wrote nothing while the store
/// could not take writes is not gone. A SQLite ledger locked by another connection (a stray `sqlite3` shell, a
/// backup holding a write transaction) still answers reads in WAL mode, so watching by reads alone would see
/// every holder "silent" for the whole lock. A probe write (this runner's own key under the job, a TTL of two
/// leases; at most one per quarter lease, shared by every item the runner watches) answered within a third of a
/// lease counts as evidence; a slower or failed one, or a gap of more than half a lease since the last prompt
/// one, starts every watch again ([`idem_core::record::Observations::clear`]).
async fn writes_served<S: Store>(ctx: &Ctx<S>) -> bool {
    let lease = ctx.cfg.lease;
    let mut last = ctx.probe.lock().await;
    if last.is_some_and(|at| at.elapsed() < lease / 4) {
        return true;
    }
    let key = format!("run/{}/watcher/{}", ctx.job, ctx.owner);
    let sent = tokio::time::Instant::now();
    // TTLs are whole seconds: two leases, rounded up.
    let ttl = Duration::from_secs((lease * 2).as_secs_f64().ceil() as u64).max(Duration::from_secs(1));
    let wrote = ctx.store.put(&key, bytes::Bytes::from(ctx.owner.clone()), Precondition::Any, Ttl::After(ttl)).await;
    let answered = tokio::time::Instant::now();
    // Any answer but "unavailable" means the store took the write in hand (a refusal is no stall).
    let taken = wrote.as_ref().map_or_else(|e| !e.is_unavailable(), |_| true);
    let prompt = taken && answered - sent <= lease / 3;
    if !prompt || last.is_none_or(|at| sent.saturating_duration_since(at) > lease / 2) {
        ctx.unwatch_all();
    }
    *last = prompt.then_some(answered);
    prompt
}

/// An item out of attempts: failed, unless its last attempt finished but was left unrecorded (its runner gave
/// up waiting for the store, and noted the output's digest): then recorded done now, rather than failed as
/// a crash.
async fn exhausted<S: Store>(
    ctx: &Ctx<S>,
    run: &ItemRun<'_>,
    generation: Option<idem_store::Generation>,
    entry: Option<&Entry>,
    attempts: u32,
    last_error: String,
) -> Result<Step, ItemError> {
    let keys = &run.keys;
    // Its holder is gone (checked by the caller), and the write is fenced on its entry.
    let mut error = last_error;
    if let (Some(g), Some(over @ Entry::Running { owner, attempt, .. })) = (generation, entry)
        && !ctx.cfg.dry_run
    {
        match noted_output(ctx, run.output.as_deref(), &(owner.clone(), *attempt)).await {
            Noted::Found(digest, note) => {
                let write = idem_core::ledger::record_noted(keys, g, over, &digest.sha256, digest.size, now_ms());
                return match ledger::apply(ctx, Waiting::Unstarted, write).await {
                    Ok(_) => {
                        let _ = tokio::fs::remove_file(&note).await;
                        Ok(Step::End(Final::Adopted { digest }))
                    }
                    Err(e) if e.is_precondition_failed() => Ok(Step::Judge),
                    Err(e) => Err(ItemError::LedgerWrite(e)),
                };
            }
            // Not a crash: say what became of the output it finished.
            Noted::Unusable(why) => error = why,
            Noted::None => {}
        }
    }
    Ok(Step::End(Final::Failed { attempts, error }))
}

/// Judges an item from its ledger entry (read ahead with its chunk the first time, else now) and the file at
/// its final path: it ends here (skipped, adopted, poison, out of attempts; in a dry run, would run), waits
/// for another runner's last attempt, or needs running.
pub(super) async fn judge<S: Store>(ctx: &Ctx<S>, run: &mut ItemRun<'_>) -> Result<Step, ItemError> {
    let (item, keys) = (run.item, &run.keys);
    let read = match run.prefetched.take() {
        Some(read) => read,
        None => ledger::get(ctx, Waiting::Unstarted, keys.entry()).await.map_err(ItemError::LedgerRead)?,
    };
    let (generation, entry) = match read {
        Some(v) => {
            let entry = Entry::decode(v.value()).map_err(ItemError::EntryUnreadable)?;
            (Some(v.generation()), Some(entry))
        }
        None => (None, None),
    };
    if let (Some(g), Some(Entry::Running { owner, attempt, .. })) = (generation, &entry)
        && let Some(output) = run.output.as_deref()
        && !ctx.cfg.dry_run
        && let Some(step) = uncount_noted(ctx, run, output, g, owner, *attempt).await?
    {
        return Ok(step);
    }
    if let Some(recorded) = entry.as_ref().and_then(Entry::item_sha256)
        && recorded != run.text_sha256
        && let Some(fin) = reused(ctx, item, &mut run.text_warned)
    {
        return Ok(Step::End(fin));
    }
    let plan = idem_core::ledger::plan(entry.as_ref(), ctx.limit);
    if let Some(Entry::Done { owner, sha256, size, .. }) = &entry
        && let Some(host) = elsewhere(ctx, owner)
    {
        // Recorded done by another host: its output is there (not on this disk), so it is not looked for here.
        return Ok(Step::End(Final::DoneElsewhere { host, digest: Digest256 { sha256: sha256.clone(), size: *size } }));
    }
    // Its last allowed attempt may still be running in another runner: "out of attempts" only once that
    // runner counts as gone (it crashed), else wait for its result like any held item.
    if matches!(plan, Plan::Exhausted { .. })
        && matches!(entry, Some(Entry::Running { .. }))
        && !ctx.cfg.dry_run
        && !holder_gone(ctx, keys).await?
    {
        return Ok(Step::WaitForHolder);
    }
    let out_state = output_state(ctx, &plan, run.output.as_deref()).await?;
    if ctx.cfg.dry_run {
        let unit = out_state.as_ref().map(|r| r.as_ref().map(|_| ()).map_err(Clone::clone));
        // A running entry is only held while its lease lives: a crashed or interrupted holder's is not.
        let held = matches!(entry, Some(Entry::Running { .. }))
            && ledger::get(ctx, Waiting::Unstarted, keys.lease()).await.map_err(ItemError::LedgerRead)?.is_some();
        if let Some(reason) = dry_reason(entry.as_ref(), &plan, &unit.unwrap_or(Ok(())), held) {
            // Listed in input order, as they would be claimed.
            say_dry(ctx, run.turn.as_ref(), &item.id, &reason).await;
            return Ok(Step::End(Final::WouldRun));
        }
    }
    let fin = match (&plan, out_state) {
        (Plan::New, Some(Ok(digest))) => {
            if ctx.cfg.dry_run {
                say_dry(ctx, run.turn.as_ref(), &item.id, "adopt: a verified output without a ledger entry").await;
                return Ok(Step::End(Final::Adopted { digest }));
            }
            // A verified output nobody recorded (a lost ledger, or a run killed between rename and record).
            let write = idem_core::ledger::adopt(keys, &digest.sha256, digest.size, now_ms(), Some(&run.text_sha256));
            match ledger::apply(ctx, Waiting::Unstarted, write).await {
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
            return exhausted(ctx, run, generation, entry.as_ref(), *attempts, last_error.clone()).await;
        }
        _ if ctx.cfg.dry_run => Final::WouldRun,
        // Running in another runner: claimed over only once that runner counts as gone.
        _ if matches!(entry, Some(Entry::Running { .. })) && !holder_gone(ctx, keys).await? => {
            return Ok(Step::WaitForHolder);
        }
        _ => {
            // A retry is at least --retry-delay after the failure it follows, also when that failure was
            // another run's (a run stopped during the pause, then run again at once), so two attempts that make
            // the item poison are always that far apart. Not the doubled pause: a rerun after a fix must not
            // wait minutes for an item that failed often. The claim that follows is fenced on the entry read
            // before the wait: one changed meanwhile is judged again.
            if let Some(Entry::Failed { finished_at_ms, .. }) = &entry {
                let floor = ctx.cfg.retry_delay;
                let since = Duration::from_millis(now_ms().saturating_sub(*finished_at_ms));
                if since < floor {
                    super::after_exit::pause_until(ctx, tokio::time::Instant::now() + (floor - since)).await;
                }
            }
            let prev = match (generation, entry) {
                (Some(g), Some(e)) => Some((g, e)),
                _ => None,
            };
            return Ok(Step::Run(prev));
        }
    };
    Ok(Step::End(fin))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_store::{MemoryStore, Precondition, Ttl};
    use sha2::{Digest as _, Sha256};

    use super::*;
    use crate::config::RunConfig;
    use crate::engine::ctx::test_ctx;

    fn item(id: &str) -> Item {
        Item { line: 1, id: id.to_owned(), raw: id.to_owned() }
    }

    fn ctx_in(dir: &tempfile::TempDir, dry_run: bool) -> Ctx<MemoryStore> {
        let mut cfg = RunConfig::new("items", format!("{}/{{id}}.txt", dir.path().display()), vec!["true".into()]);
        cfg.dry_run = dry_run;
        test_ctx(cfg)
    }

    async fn judged(ctx: &Ctx<MemoryStore>, item: &Item) -> Step {
        let mut run = ItemRun {
            item,
            keys: Keys::new(&ctx.job, &item.id),
            output: ctx.cfg.output_of(&item.id),
            prefetched: None,
            waiting: false,
            text_sha256: crate::items::text_sha256(&item.raw),
            text_warned: false,
            permit: None,
            room: None,
            turn: None,
        };
        judge(ctx, &mut run).await.expect("the memory store answers")
    }

    async fn put_entry(ctx: &Ctx<MemoryStore>, id: &str, entry: &Entry) {
        let key = Keys::new(&ctx.job, id).entry().to_owned();
        ctx.store.put(&key, entry.encode(), Precondition::Any, Ttl::Clear).await.expect("put");
    }

    async fn entry_of(ctx: &Ctx<MemoryStore>, id: &str) -> Option<Entry> {
        let read = ctx.store.get(Keys::new(&ctx.job, id).entry()).await.expect("get");
        read.map(|v| Entry::decode(v.value()).expect("decodes"))
    }

    fn done(text: &str) -> Entry {
        Entry::Done {
            attempts: 1,
            sha256: hex::encode(Sha256::digest(text.as_bytes())),
            size: text.len() as u64,
            owner: "o".into(),
            finished_at_ms: 0,
            duration_ms: 0,
            item_sha256: None,
        }
    }

    fn failed(attempts: u32, poison: bool) -> Entry {
        Entry::Failed {
            attempts,
            failures: vec!["exit 1".into(); attempts as usize],
            last_error: "exit 1: boom".into(),
            poison,
            finished_at_ms: 0,
            item_sha256: None,
        }
    }

    #[tokio::test]
    async fn a_new_item_without_output_needs_running_from_no_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, false);
        assert!(matches!(judged(&ctx, &item("a")).await, Step::Run(None)));
        assert_eq!(entry_of(&ctx, "a").await, None, "judging writes nothing");
    }

    #[tokio::test]
    async fn a_verified_output_without_entry_is_adopted_and_recorded_done() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, false);
        std::fs::write(dir.path().join("a.txt"), "out").expect("write");
        let Step::End(Final::Adopted { digest }) = judged(&ctx, &item("a")).await else { panic!("not adopted") };
        assert_eq!(digest.size, 3);
        match entry_of(&ctx, "a").await {
            Some(Entry::Done { sha256, size: 3, owner, .. }) => {
                assert_eq!(sha256, digest.sha256);
                assert_eq!(owner, "adopted");
            }
            other => panic!("entry {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_dry_run_adopts_nothing_in_the_ledger() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, true);
        std::fs::write(dir.path().join("a.txt"), "out").expect("write");
        assert!(matches!(judged(&ctx, &item("a")).await, Step::End(Final::Adopted { .. })));
        assert_eq!(entry_of(&ctx, "a").await, None);
        assert!(matches!(judged(&ctx, &item("b")).await, Step::End(Final::WouldRun)));
    }

    /// A dry run decides its new items (no entry, nothing at the output path) with their chunk, no task each;
    /// an item with a file at its path, one with an entry, and every item of a real run are judged one by one.
    #[tokio::test]
    async fn a_dry_run_lists_new_items_with_their_chunk() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("b.txt"), "out").expect("write");
        std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join("d.txt")).expect("symlink");
        let chunk = [item("a"), item("b"), item("c"), item("d")];
        let dry = ctx_in(&dir, true);
        put_entry(&dry, "c", &done("out")).await;
        let kinds = |judged: Vec<Judged>| -> Vec<&'static str> {
            judged
                .iter()
                .map(|j| match j {
                    Judged::Done(_) => "done",
                    Judged::DryNew => "new",
                    Judged::Open(_) => "open",
                })
                .collect()
        };
        assert_eq!(kinds(judge_done(&dry, &chunk).await), ["new", "open", "open", "open"]);
        let real = ctx_in(&dir, false);
        assert_eq!(kinds(judge_done(&real, &chunk).await), ["open", "open", "open", "open"]);
    }

    #[tokio::test]
    async fn done_is_skipped_while_the_output_matches_and_run_again_once_it_changed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, false);
        std::fs::write(dir.path().join("a.txt"), "out").expect("write");
        put_entry(&ctx, "a", &done("out")).await;
        let Step::End(Final::Skipped { digest }) = judged(&ctx, &item("a")).await else { panic!("not skipped") };
        assert_eq!(digest.size, 3);
        std::fs::write(dir.path().join("a.txt"), "changed").expect("write");
        match judged(&ctx, &item("a")).await {
            Step::Run(Some((_, entry))) => assert_eq!(entry, done("out")),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn poison_from_an_earlier_run_ends_poison_without_halting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, false);
        put_entry(&ctx, "a", &failed(2, true)).await;
        match judged(&ctx, &item("a")).await {
            Step::End(Final::Poison { attempts: 2, error }) => assert_eq!(error, "exit 1: boom"),
            other => panic!("{other:?}"),
        }
        assert_eq!(*ctx.poison.lock().expect("lock"), vec![("a".to_owned(), "exit 1: boom".to_owned())]);
        assert!(!ctx.stopping(), "a known poison item halts nothing");
    }

    #[tokio::test]
    async fn out_of_attempts_fails_and_with_attempts_left_runs_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx_in(&dir, false);
        // --retries 3: four attempts in all.
        put_entry(&ctx, "a", &failed(4, false)).await;
        match judged(&ctx, &item("a")).await {
            Step::End(Final::Failed { attempts: 4, error }) => assert_eq!(error, "exit 1: boom"),
            other => panic!("{other:?}"),
        }
        put_entry(&ctx, "b", &failed(3, false)).await;
        assert!(matches!(judged(&ctx, &item("b")).await, Step::Run(Some((_, Entry::Failed { attempts: 3, .. })))));
    }

    #[tokio::test]
    async fn a_last_attempt_running_elsewhere_is_waited_for_until_its_lease_is_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = RunConfig::new("items", format!("{}/{{id}}.txt", dir.path().display()), vec!["true".into()]);
        cfg.lease = Duration::from_millis(400);
        let ctx = test_ctx(cfg);
        let running = Entry::Running {
            owner: "other".into(),
            attempt: 4,
            started_at_ms: 0,
            failures: vec!["a".into(), "b".into(), "c".into()],
            last_error: Some("exit 1: c".into()),
            item_sha256: None,
        };
        put_entry(&ctx, "a", &running).await;
        let lease = Keys::new(&ctx.job, "a").lease().to_owned();
        ctx.store
            .put(&lease, "other".into(), Precondition::Any, Ttl::After(Duration::from_secs(60)))
            .await
            .expect("put");
        assert!(matches!(judged(&ctx, &item("a")).await, Step::WaitForHolder));
        ctx.store.delete(&lease, Precondition::Any).await.expect("delete");
        // The lease gone (the holder crashed): out of attempts once the holder was watched for a whole lease
        // without a sign of life, not before.
        let gone = std::time::Instant::now();
        loop {
            match judged(&ctx, &item("a")).await {
                Step::WaitForHolder => {
                    assert!(gone.elapsed() < Duration::from_secs(5), "never judged gone");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Step::End(Final::Failed { attempts: 4, .. }) => break,
                other => panic!("{other:?}"),
            }
        }
        assert!(gone.elapsed() >= Duration::from_millis(400), "judged gone after {:?}", gone.elapsed());
    }

    #[test]
    fn dry_run_reasons_name_why_an_item_runs() {
        let missing = Err(Invalid::Missing);
        assert_eq!(dry_reason(None, &Plan::New, &missing, false).as_deref(), Some("new"));
        assert_eq!(dry_reason(None, &Plan::New, &Ok(()), false), None);
        let entry = failed(1, false);
        assert_eq!(
            dry_reason(Some(&entry), &Plan::Retry { attempts: 1 }, &missing, false).as_deref(),
            Some("failed 1 time(s): exit 1: boom")
        );
        let poison = failed(2, true);
        let plan = Plan::Poison { last_error: "exit 1: boom".into() };
        assert_eq!(dry_reason(Some(&poison), &plan, &missing, false), None);
    }
}
