//! The writes of an invocation around its slot: the job record moved to the current slot (and the slots
//! that passed unseen recorded missed), the outcome of an attempt (fenced on the claim), and the history kept
//! to its newest slots.

use std::time::Duration;

use idem_core::slot::{
    self, Ending, FUTURE_TOLERANCE_MS, HISTORY, INTERRUPTED_EXIT, Job, MissedReason, is_kept_ahead, job_key,
    lease_prefix, missed, prune, slot_of_key, slot_prefix,
};
use idem_store::{Generation, Jitter, LeaseKeeper, Precondition, RetryPolicy, Store, StoreExt, Ttl};

use super::command::{Attempt, Ended};
use super::schedule::human_secs;
use super::{OnceConfig, Outcome, Report, lost_why, millis};
use crate::error::Error;

/// How often the job record's compare-and-swap is tried before the invocation gives up on moving it (it moves
/// only forward, so another invocation's write that won is as good as ours).
const ADVANCE_TRIES: usize = 8;

/// Moves the job record to the current `slot`: creates it (with the schedule) on the first invocation,
/// refuses settings other than the recorded ones ([`super::job::agree`]), and when slots passed since the last one any invocation
/// saw, records them missed (create-only: a slot an invocation wrote anything for keeps it) before moving.
/// Returns the job's newest slot as it stands after the move (later than `slot` when the clock read is
/// behind another invocation's: that slot is then never claimed).
pub(super) async fn advance<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    mut job: Option<(Generation, Job)>,
    slot: u64,
    now_ms: u64,
    pause: Option<&slot::Pause>,
    report: &mut Report,
) -> Result<u64, Error> {
    let key = job_key(&cfg.name);
    let schedule = cfg.schedule.canonical();
    let overlap = cfg.overlap.name().to_owned();
    for _ in 0..ADVANCE_TRIES {
        if let Some((_, j)) = &job {
            super::job::agree(cfg, j)?;
        }
        let (precondition, next) = match &job {
            None => (
                Precondition::Absent,
                Job {
                    schedule: schedule.clone(),
                    last_slot_ms: slot,
                    missed_unlisted: 0,
                    retries: Some(cfg.retries),
                    overlap: Some(overlap.clone()),
                    jitter_ms: super::job::millis(cfg.jitter),
                    catchup_window_ms: super::job::millis(cfg.catchup_window),
                    ..Job::default()
                },
            ),
            Some((g, j)) if j.last_slot_ms > slot && j.last_slot_ms.saturating_sub(now_ms) > FUTURE_TOLERANCE_MS => {
                let warning = format!(
                    "the job's newest slot {} is {} ahead of this clock's slot {}: a clock that ran ahead recorded \
                     it (or this one is behind by more than {} s); the job is taken back to this clock's slot and \
                     the slots recorded missed ahead of it are deleted (a slot that ran ahead stays done); check the \
                     clocks (NTP)",
                    cfg.schedule.format(j.last_slot_ms),
                    human_secs((j.last_slot_ms - slot) / 1000),
                    cfg.schedule.format(slot),
                    FUTURE_TOLERANCE_MS / 1000
                );
                if !report.warnings.contains(&warning) {
                    report.warnings.push(warning);
                }
                drop_missed_ahead(store, &cfg.name, slot, now_ms).await?;
                (
                    Precondition::Generation(*g),
                    Job { last_slot_ms: slot, retries: Some(cfg.retries), overlap: Some(overlap.clone()), ..j.clone() },
                )
            }
            Some((_, j)) if j.last_slot_ms >= slot && j.retries.is_some() && j.overlap.is_some() => {
                return Ok(j.last_slot_ms);
            }
            // A record from before --retries was kept takes this invocation's (moved or not).
            Some((g, j)) if j.last_slot_ms >= slot => (
                Precondition::Generation(*g),
                Job { retries: Some(cfg.retries), overlap: Some(overlap.clone()), ..j.clone() },
            ),
            Some((g, j)) => {
                let (passed, unlisted) = cfg.schedule.between(j.last_slot_ms, slot)?;
                record_missed(store, cfg, j.last_slot_ms, &passed, now_ms, pause, report).await?;
                report.missed_unlisted = unlisted;
                report.missed_capped = cfg.schedule.capped(unlisted);
                let next = j.advanced(slot, unlisted);
                let missed_capped = next.missed_capped || report.missed_capped;
                (
                    Precondition::Generation(*g),
                    Job { retries: Some(cfg.retries), missed_capped, overlap: Some(overlap.clone()), ..next },
                )
            }
        };
        match store.put(&key, next.encode(), precondition, Ttl::Clear).await {
            Ok(_) => return Ok(next.last_slot_ms),
            Err(e) if e.is_precondition_failed() => {
                report.missed_unlisted = 0;
                report.missed_capped = false;
                job = match store.get(&key).await? {
                    Some(v) => Some((
                        v.generation(),
                        Job::decode(v.value()).map_err(|source| Error::Entry { key: key.clone(), source })?,
                    )),
                    None => None,
                };
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Others kept moving the record: it is at or past `slot` by now (judged by the last read of it).
    Ok(job.map_or(slot, |(_, j)| j.last_slot_ms.max(slot)))
}

/// Deletes the missed entries a clock ahead of this one recorded: every missed slot after `slot` (in this
/// clock's future: none can have passed unseen), and `slot`'s own when recorded more than
/// [`FUTURE_TOLERANCE_MS`] after `now_ms`. Each delete is conditional on the entry's generation; a slot that
/// ran (or runs) keeps its entry.
async fn drop_missed_ahead<S: Store>(store: &S, name: &str, slot: u64, now_ms: u64) -> Result<(), Error> {
    let keys: Vec<String> = list_all(store, &slot_prefix(name))
        .await?
        .into_iter()
        .filter(|k| slot_of_key(k).is_some_and(|s| s >= slot))
        .collect();
    let values = store.get_many(&keys).await?;
    for (key, value) in keys.iter().zip(values) {
        let Some(value) = value else { continue };
        let Ok(slot::Entry::Missed { recorded_at_ms, .. }) = slot::Entry::decode(value.value()) else { continue };
        let ahead = slot_of_key(key).is_some_and(|s| s > slot) || recorded_at_ms > now_ms + FUTURE_TOLERANCE_MS;
        if ahead {
            match store.delete(key, Precondition::Generation(value.generation())).await {
                Ok(_) => {}
                Err(e) if e.is_precondition_failed() => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// Records missed: the slot the job record last named, if nothing was written for it (invocations came
/// but none started it), and each slot strictly after it that passed unseen.
async fn record_missed<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    last: u64,
    passed: &[u64],
    now_ms: u64,
    pause: Option<&slot::Pause>,
    report: &mut Report,
) -> Result<(), Error> {
    let unseen = passed.iter().map(|s| (*s, MissedReason::NoInvocation));
    let window = cfg.catchup_window.map_or(0, |w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
    let limit = idem_core::ledger::RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
    let catch_up = slot::Request { kind: slot::RequestKind::CatchUp, by: crate::supervise::host_name() };
    for (slot, reason) in std::iter::once((last, MissedReason::NotStarted)).chain(unseen) {
        let keys = slot::Keys::new(&cfg.name, slot);
        // A slot whose time fell within the job's pause is recorded paused, not missed: it was not run on
        // purpose.
        let paused = pause.filter(|p| p.since_ms <= slot && p.holds_at(slot));
        // One that passed unseen (an outage: no invocation came, or none reached the store) within
        // --catchup-window is requested instead, and run before the current slot. One that invocations saw
        // but did not start (an earlier slot ran under --overlap skip) stays missed: the policy said so.
        if paused.is_none()
            && window > 0
            && reason == MissedReason::NoInvocation
            && slot.saturating_add(window) >= now_ms
        {
            if request(store, &cfg.name, slot, &catch_up, limit, now_ms, false).await?.is_none() {
                report.requested.push(cfg.schedule.format(slot));
            }
            continue;
        }
        let write = match paused {
            Some(p) => slot::paused(&keys, p, now_ms),
            None => missed(&keys, reason, now_ms),
        };
        match store.apply(idem_core::planted_unconditional("once-missed-overwrite", write)).await {
            Ok(_) if paused.is_some() => {}
            Ok(_) => report.missed.push(cfg.schedule.format(slot)),
            Err(e) if e.is_precondition_failed() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Requests a slot (`slot_ms`) of job `name` to run ([`slot::request`]): its entry first, then its key
/// ([`slot::request_key`]). `Ok(None)` when it is requested (now or before), `Ok(Some(why))` when it will not
/// run. `check_history`: the slot may be older than the kept history (a backfill's): an absent entry is
/// created only if the slot is after the job record's `pruned_through_ms`, read again once the entry is made (the
/// prune writes it before it deletes, so a slot whose entry it deleted meanwhile is seen) and the entry
/// withdrawn if not.
pub(super) async fn request<S: Store>(
    store: &S,
    name: &str,
    slot_ms: u64,
    request: &slot::Request,
    limit: idem_core::ledger::RetryLimit,
    now_ms: u64,
    check_history: bool,
) -> Result<Option<&'static str>, Error> {
    const PRUNED: &str = "older than the kept history (it may have run)";
    let keys = slot::Keys::new(name, slot_ms);
    let entry = match store.get(keys.entry()).await? {
        Some(v) => Some((v.generation(), slot::Entry::decode(v.value()).map_err(|e| corrupt(keys.entry(), e))?)),
        None => None,
    };
    let pruned_over = async || -> Result<bool, Error> {
        let key = job_key(name);
        let Some(v) = store.get(&key).await? else { return Ok(false) };
        let job = Job::decode(v.value()).map_err(|e| corrupt(&key, e))?;
        Ok(job.pruned_through_ms.is_some_and(|p| slot_ms <= p))
    };
    if check_history && entry.is_none() && pruned_over().await? {
        return Ok(Some(PRUNED));
    }
    match slot::request(&keys, entry.as_ref().map(|(g, e)| (*g, e)), limit, &request.by, now_ms) {
        slot::RequestPlan::Nothing(why) => return Ok(Some(why)),
        slot::RequestPlan::KeyOnly => {}
        slot::RequestPlan::Entry(write) => match store.apply(write).await {
            Ok(Some(g)) if check_history && entry.is_none() && pruned_over().await? => {
                let _ = store.delete(keys.entry(), Precondition::Generation(g)).await;
                return Ok(Some(PRUNED));
            }
            Ok(_) => {}
            // Another invocation wrote the entry meanwhile (a claim, or the same request): the pass judges it.
            Err(e) if e.is_precondition_failed() => {}
            Err(e) => return Err(e.into()),
        },
    }
    store.put(&slot::request_key(&keys), request.encode(), Precondition::Any, Ttl::Clear).await?;
    Ok(None)
}

fn corrupt(key: &str, source: idem_core::Error) -> Error {
    Error::Entry { key: key.to_owned(), source }
}

/// After a claim that created the slot's entry: the newest slot of the job's entries when [`HISTORY`] or more
/// entries other than missed ones ([`is_kept_ahead`]) are newer than this slot's, `None` otherwise. An entry is
/// only pruned (deleted) once [`HISTORY`] such newer entries exist ([`idem_core::slot::prune`]), and those are deleted
/// only by the prune, from the oldest, so their count after the slot never falls back below [`HISTORY`] once it
/// reached it (missed entries are not counted: taking the job back from a clock that ran ahead deletes the
/// missed ones ahead of it). Below it, the entry the claim's read found missing was never pruned: that "no
/// entry" was true. At or above it, the read may be stale (the invocation paused between its read and its claim
/// while the slot ran elsewhere, a hundred slots more ran, and the prune deleted the slot's `done` entry, so the
/// claim's create-only write succeeded): the slot must not run.
pub(super) async fn newer_than_history<S: Store>(store: &S, keys: &slot::Keys) -> Result<Option<u64>, Error> {
    let page = store.list(&slot_prefix(keys.name()), Some(keys.entry()), HISTORY).await?;
    if page.items.len() < HISTORY {
        // Fewer entries of any kind: fewer of those counted (the usual case, one read).
        return Ok(None);
    }
    let newer: Vec<String> = list_all(store, &slot_prefix(keys.name()))
        .await?
        .into_iter()
        .filter(|k| slot_of_key(k).is_some_and(|s| s > keys.slot_ms()))
        .collect();
    // The newest HISTORY counted entries are never deleted (the prune leaves them), so reading them after the
    // listing finds them all.
    let counted = store
        .get_many(&newer)
        .await?
        .into_iter()
        .filter(|v| v.as_ref().and_then(|v| slot::Entry::decode(v.value()).ok()).is_some_and(|e| is_kept_ahead(&e)))
        .count();
    if counted < HISTORY {
        return Ok(None);
    }
    Ok(newer.last().and_then(|k| slot_of_key(k)))
}

/// The earliest slot of job `name` before `slot` whose lease is live (it runs now), if any.
pub(super) async fn running_before<S: Store>(store: &S, name: &str, slot: u64) -> Result<Option<u64>, Error> {
    let page = store.list(&lease_prefix(name), None, 1000).await?;
    Ok(page.items.iter().filter_map(|item| slot_of_key(&item.key)).find(|s| *s < slot))
}

/// The pauses between tries of an outcome write while the store fails: 200 ms doubling up to 2 s, exactly (one
/// invocation per slot writes: nobody to spread out from).
fn record_retries() -> RetryPolicy {
    RetryPolicy::new()
        .with_base_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(2))
        .with_jitter(Jitter::None)
}
/// How long an outcome write is tried while the store fails, at least (the lease, when longer): the write is
/// fenced on the claim's entry generation, so it stays right after the lease lapsed; only a takeover (which
/// makes it fail its precondition) ends it early. A store down for longer leaves the slot `running` with its
/// lease lapsed, and the first invocation after that runs it again.
pub const RECORD_PATIENCE: Duration = Duration::from_secs(60);

/// Records how the attempt ended (fenced on the claim) and gives the lease back; says what happened.
pub(super) async fn outcome<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
    attempt: Attempt,
) -> Outcome {
    let n = held.attempt();
    let duration_ms = u64::try_from(attempt.duration.as_millis()).unwrap_or(u64::MAX);
    let ending = |exit: String, code: Option<i32>| Ending {
        exit,
        code,
        duration_ms,
        finished_at_ms: held.started_at_ms().saturating_add(duration_ms),
        output: attempt.output.clone(),
    };
    let (write, result) = match attempt.ended {
        Ended::Lost { why, success } => {
            if success {
                ran_again(store, held).await;
            }
            return Outcome::LeaseLost { attempt: n, why: lost_why(why).to_owned(), succeeded: success };
        }
        Ended::Interrupted => {
            // The command had started: the attempt counts toward --retries (a failure, as Kubernetes counts a
            // Job's killed pod), else an invocation stopped again and again (cron's `timeout`, a shutdown) would
            // start the slot for ever as attempt 1. The renewal in flight first: the writes are fenced on it.
            let end = ending(INTERRUPTED_EXIT.to_owned(), None);
            keeper.await_renewal(held).await;
            let limit = idem_core::ledger::RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
            let (write, verdict) = held.failed(end, limit);
            let left = match verdict {
                slot::Failure::Retry => limit.max_attempts.saturating_sub(n),
                slot::Failure::Exhausted => 0,
            };
            // One try, not RECORD_PATIENCE's: a stopped invocation must end promptly. Unrecorded, the entry
            // stays `running` with its lease released, and the next invocation counts it as a crash.
            let _ = store.apply(write).await;
            let (key, change) = held.keys().interrupted(n);
            if let Err(e) = store.set_change(&key, change).await {
                tracing::warn!(error = %e, "cannot count the interrupted attempt");
            }
            let _ = store.apply(held.release()).await;
            return Outcome::Interrupted { attempt: n, left };
        }
        Ended::Exited { exit, code, success: true } => {
            (held.done(ending(exit, code)), Outcome::Succeeded { attempt: n })
        }
        Ended::Replaced { by_ms, exit, code } => {
            let by = cfg.schedule.format(by_ms);
            let limit = idem_core::ledger::RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
            let words = format!("{}{by} (--overlap {}; {exit})", slot::REPLACED_EXIT, cfg.overlap.name());
            let (write, _) = held.failed(ending(words, code), limit);
            (write, Outcome::Replaced { attempt: n, by, exit })
        }
        Ended::Exited { exit, code, success: false } => {
            let limit = idem_core::ledger::RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
            let (write, verdict) = held.failed(ending(exit.clone(), code), limit);
            let left = match verdict {
                slot::Failure::Retry => limit.max_attempts.saturating_sub(n),
                slot::Failure::Exhausted => 0,
            };
            (write, Outcome::Failed { attempt: n, exit, left })
        }
    };
    let succeeded = matches!(result, Outcome::Succeeded { .. });
    let finished_at_ms = held.started_at_ms().saturating_add(duration_ms);
    keeper.await_renewal(held).await;
    // Fenced on the claim: refused when another invocation took the slot over. A store that fails is tried
    // again, also after the lease lapsed: only a takeover can make the write wrong, and it makes it fail.
    let tried = tokio::time::Instant::now();
    let patience = RECORD_PATIENCE.max(cfg.lease);
    let (retries, mut failures) = (record_retries(), 0);
    loop {
        match store.apply(write.clone()).await {
            Ok(_) => break,
            Err(e) if e.is_precondition_failed() && landed(store, &write).await => break,
            Err(e) if e.is_precondition_failed() => {
                if succeeded {
                    ran_again(store, held).await;
                }
                return Outcome::LeaseLost {
                    attempt: n,
                    why: "the slot was taken over by another invocation; the fenced outcome write was refused".into(),
                    succeeded,
                };
            }
            Err(e) => {
                failures += 1;
                let pause = retries.pause_after(failures);
                if tried.elapsed() + pause >= patience {
                    return Outcome::NotRecorded {
                        attempt: n,
                        succeeded,
                        error: e.to_string(),
                        tried_for: format!("{} s", tried.elapsed().as_secs()),
                    };
                }
                tracing::warn!(error = %e, "recording the slot's outcome failed; trying again (fenced on the claim)");
                tokio::time::sleep(pause).await;
            }
        }
    }
    if succeeded {
        super::job::note_success(store, &cfg.name, finished_at_ms).await;
    }
    if matches!(result, Outcome::Replaced { .. }) {
        // Its stop request is done with (best effort: it expires by itself).
        let _ = store.delete(&slot::stop_key(held.keys()), Precondition::Any).await;
    }
    let _ = store.apply(held.release()).await;
    result
}

/// Whether `write` (a put refused for its precondition) is in the store already: an earlier try whose answer
/// never came (a store that stalled past the client's timeout) landed after all and moved the generation on,
/// so the retry's fence refuses it. The entry then holds exactly this write's value (attempt, host, times), which
/// no other invocation writes; anything else is a takeover.
async fn landed<S: Store + Sync>(store: &S, write: &idem_store::Write) -> bool {
    let idem_store::WriteOp::Put { value, .. } = &write.op else { return false };
    matches!(store.get(&write.key).await, Ok(Some(current)) if current.value().as_ref() == value.as_ref())
}

/// The fence before the command refused (the lease was taken over, lapsed, or could not be renewed): the
/// command never started; the attempt is given back (fenced: refused if another invocation took the slot) and
/// the lease released, both best effort.
pub(super) async fn not_started<S: Store + Sync>(
    store: &S,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
) -> Outcome {
    let why = match keeper.lost() {
        Some(lost) => lost_why(lost).to_owned(),
        None => "the lease could not be renewed before the command started (the store failed)".to_owned(),
    };
    let now = store.now().await.map(millis).unwrap_or_else(|_| held.started_at_ms());
    let _ = store.apply(held.interrupted(now)).await;
    let _ = store.apply(held.release()).await;
    Outcome::LeaseLost { attempt: held.attempt(), why: format!("{why}; the command was not started"), succeeded: false }
}

/// A signal came after the claim but before the command started: the attempt is given back (fenced: refused if
/// another invocation took the slot) and the lease released, both best effort; nothing ran.
pub(super) async fn stopped_before_start<S: Store + Sync>(
    store: &S,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
) -> Outcome {
    keeper.await_renewal(held).await;
    let now = store.now().await.map(millis).unwrap_or_else(|_| held.started_at_ms());
    let _ = store.apply(held.interrupted(now)).await;
    let _ = store.apply(held.release()).await;
    Outcome::Stopped { attempt: Some(held.attempt()) }
}

/// Adds the slot to the set of slots that ran to a successful end more than once (best effort).
async fn ran_again<S: Store>(store: &S, held: &slot::Held) {
    let (key, change) = held.keys().ran_again(&held.fencing_token().to_string());
    if let Err(e) = store.set_change(&key, change).await {
        tracing::warn!(error = %e, "cannot record that the slot ran more than once");
    }
}

/// Adds the slot to the set of slots found behind the job's newest (best effort).
pub(super) async fn behind<S: Store>(store: &S, keys: &slot::Keys) {
    let (key, change) = keys.behind();
    if let Err(e) = store.set_change(&key, change).await {
        tracing::warn!(error = %e, "cannot count the slot skipped behind");
    }
}

/// Adds the slot to the set of slots whose attempt was taken over from a vanished holder (best effort).
pub(super) async fn took_over<S: Store>(store: &S, held: &slot::Held) {
    let (key, change) = held.keys().took_over(&held.fencing_token().to_string());
    if let Err(e) = store.set_change(&key, change).await {
        tracing::warn!(error = %e, "cannot record that the slot's attempt was taken over");
    }
}

/// Deletes the job's finished slot entries older than its newest [`HISTORY`] (an entry other than a missed
/// one only once [`HISTORY`] such entries are newer: [`idem_core::slot::prune`]); the missed ones deleted are
/// added to the job record's `missed_unlisted`, so `status`'s missed total stays the job's whole (best
/// effort: an invocation killed between the delete and the record's move loses them from the count).
pub(super) async fn prune_history<S: Store>(store: &S, name: &str) -> Result<(), Error> {
    let mut keys = list_all(store, &slot_prefix(name)).await?;
    if keys.len() <= HISTORY {
        return Ok(());
    }
    // A requested slot's entry stays until its key goes (its pass deletes the key once the entry is final).
    let requested: std::collections::HashSet<u64> =
        list_all(store, &slot::requested_prefix(name)).await?.iter().filter_map(|k| slot_of_key(k)).collect();
    keys.retain(|k| slot_of_key(k).is_none_or(|s| !requested.contains(&s)));
    // All of them: an old entry other than a missed one stays while fewer than HISTORY such are newer
    // (idem_core::slot::prune).
    let values = store.get_many(&keys).await?;
    let listed: Vec<(String, Generation, slot::Entry)> = keys
        .iter()
        .zip(values)
        .filter_map(|(k, v)| {
            let v = v?;
            Some((k.clone(), v.generation(), slot::Entry::decode(v.value()).ok()?))
        })
        .collect();
    let writes = prune(&listed, HISTORY);
    // The newest slot about to be pruned, recorded before any delete: a backfill never re-creates an entry the
    // prune deleted (it may have run).
    if let Some(through) = writes.iter().filter_map(|w| slot_of_key(&w.key)).max() {
        let floor = |job: Job| Job { pruned_through_ms: Some(job.pruned_through_ms.unwrap_or(0).max(through)), ..job };
        if !update_job(store, name, floor).await? {
            // Not recorded: nothing is deleted (the next new slot's prune tries again).
            return Ok(());
        }
    }
    let mut missed_gone = 0u64;
    for write in writes {
        let was_missed = listed.iter().any(|(k, _, e)| *k == write.key && matches!(e, slot::Entry::Missed { .. }));
        if store.apply(write).await.is_ok() && was_missed {
            missed_gone += 1;
        }
    }
    if missed_gone > 0 {
        update_job(store, name, |job| Job { missed_unlisted: job.missed_unlisted.saturating_add(missed_gone), ..job })
            .await?;
    }
    Ok(())
}

/// Changes the job record by `change` (compare-and-swap, a few tries); `false` when there is no record, or
/// others kept changing it (with a warning).
async fn update_job<S: Store>(store: &S, name: &str, change: impl Fn(Job) -> Job) -> Result<bool, Error> {
    let key = job_key(name);
    for _ in 0..ADVANCE_TRIES {
        let Some(v) = store.get(&key).await? else { return Ok(false) };
        let job = Job::decode(v.value()).map_err(|source| Error::Entry { key: key.clone(), source })?;
        match store.put(&key, change(job).encode(), Precondition::Generation(v.generation()), Ttl::Clear).await {
            Ok(_) => return Ok(true),
            Err(e) if e.is_precondition_failed() => {}
            Err(e) => return Err(e.into()),
        }
    }
    tracing::warn!(job = name, "cannot update the job record for the pruned history");
    Ok(false)
}

/// Every live key under `prefix`, in ascending order.
pub(super) async fn list_all<S: Store>(store: &S, prefix: &str) -> Result<Vec<String>, Error> {
    let mut keys = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = store.list(prefix, cursor.as_deref(), 1000).await?;
        keys.extend(page.items.into_iter().map(|i| i.key));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return Ok(keys),
        }
    }
}
