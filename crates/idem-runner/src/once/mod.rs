//! `idem once`: each scheduled slot of a cron job runs once, whichever machines invoke it and however often.
//!
//! An invocation reads the store's clock ([`Store::now`]), takes the current slot of the job's [`Schedule`],
//! records the slots that passed unseen as missed, and judges the current slot by its entry and lease
//! (`idem_core`'s slot state machine): done, held elsewhere, failed for good and missed end it at once;
//! otherwise it claims the slot under a lease, runs the command while an [`idem_store::LeaseKeeper`] renews
//! the lease, and records the outcome with a write fenced on the claim.

mod command;
mod config;
mod control;
mod job;
mod metrics;
mod overlap;
mod record;
mod report;
mod requested;
mod schedule;
mod status;
mod trigger;

use std::future::Future;
use std::time::{Duration, SystemTime};

use idem_core::ledger::RetryLimit;
use idem_core::slot::{self, Job, MissedReason, job_key, missed};
use idem_store::{Generation, LeaseKeeper, Lost, Store, StoreExt, system_time_to_millis};

use crate::error::Error;
use crate::supervise::{host_name, owner_token};

pub use config::{OnceConfig, check_name, default_store_path};
pub use control::{JobView, PauseView, Triggered, list, pause, pause_state, render_list, resume, trigger, who};
pub use idem_core::slot::Overlap;
pub use metrics::{invocation_only, prometheus};
pub use record::RECORD_PATIENCE;
pub use report::{
    EXIT_DONE, EXIT_FAILED, EXIT_FAILED_FOR_GOOD, EXIT_HELD, EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_MISSED,
    EXIT_STORE_UNAVAILABLE, EXIT_USAGE, Outcome, Report,
};
pub use requested::{Backfilled, MAX_BACKFILL, backfill};
pub use schedule::{Schedule, parse_canonical, parse_time};
pub use status::{History, SlotView, forget, history};

/// Runs one invocation of `cfg` (checked: [`OnceConfig::check`]) against `store`; `interrupt` resolves when
/// a signal asks the invocation to stop (a running command is then killed; its attempt counts).
///
/// # Errors
/// [`Error::Config`] for a schedule other than the job's recorded one; [`Error::Store`] when the store fails
/// before the claim (nothing ran); [`Error::Entry`] for a record that cannot be decoded.
pub async fn once<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    interrupt: impl Future<Output = ()>,
) -> Result<Report, Error> {
    // Once fired it stays fired, so every later look (`fired`, the passes after an interrupted run) sees it
    // again instead of polling a finished future.
    let mut interrupt = std::pin::pin!(Sticky(Some(Box::pin(interrupt))));
    // Everything before the first write is reads and waits: a signal stops it at once (a store that stalls
    // would otherwise hold the invocation for the client's whole timeout), nothing claimed nor recorded.
    let fired_for = millis(SystemTime::now());
    let reads = async {
        let now_ms = system_time_to_millis(store.now().await?);
        let local_ms = millis(SystemTime::now());
        let skew = skew_warning(now_ms, local_ms);
        let now_ms = wait_for_boundary(store, &cfg.schedule, now_ms, local_ms).await?;
        let slot = cfg.schedule.slot_at(now_ms)?;
        let offset = match cfg.jitter {
            Some(jitter) => cfg.schedule.jitter_offset(&cfg.name, slot, jitter)?,
            None => 0,
        };
        let now_ms = wait_until(store, slot.saturating_add(offset), now_ms).await?;
        let keys = slot::Keys::new(&cfg.name, slot);
        let read = store.get_many(&[job_key(&cfg.name), keys.entry().to_owned(), slot::pause_key(&cfg.name)]).await?;
        Ok::<_, Error>((now_ms, skew, slot, offset, keys, read))
    };
    let (now_ms, skew, slot, offset, keys, read) = tokio::select! {
        // Reads that are done go on to the claim (a signal is looked at again right before it): the same
        // path whichever of the two was seen first.
        biased;
        reads = reads => reads?,
        () = interrupt.as_mut() => {
            // Named by the slot this machine's clock was in when it was invoked: the one its cron fired for.
            let slot = cfg.schedule.slot_at(fired_for)?;
            return Ok(Report::new(cfg, slot, Outcome::Stopped { attempt: None }, Vec::new()));
        }
    };
    let job_key = job_key(&cfg.name);
    let [job, entry, pause]: [_; 3] = read
        .try_into()
        .map_err(|_| Error::Config("the store answered a read of three keys with another count".into()))?;
    let pause_key = slot::pause_key(&cfg.name);
    let pause = match pause {
        Some(v) => Some(slot::Pause::decode(v.value()).map_err(|e| corrupt(&pause_key, e))?),
        None => None,
    };
    let job = match job {
        Some(v) => Some((v.generation(), Job::decode(v.value()).map_err(|e| corrupt(&job_key, e))?)),
        None => None,
    };
    let mut report = Report::new(cfg, slot, Outcome::Held { host: None, attempt: None }, skew.into_iter().collect());
    let newest = record::advance(store, cfg, job, slot, now_ms, pause.as_ref(), &mut report).await?;
    // Requested slots older than this one: a catch-up's run before it, in order; a backfill's after it (a long
    // backfill does not make the schedule late).
    let paused = pause.as_ref().is_some_and(|p| p.holds_at(now_ms));
    let (catch_up, backfill): (Vec<_>, Vec<_>) = requested::pending(store, &cfg.name)
        .await?
        .into_iter()
        .filter(|(s, _)| *s < slot)
        .partition(|(_, kind)| *kind == slot::RequestKind::CatchUp);
    let slots = |v: Vec<(u64, slot::RequestKind)>| v.into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    let mut read = Read { entry, slot, offset, newest, now_ms, came_ms: now_ms };
    if !catch_up.is_empty() {
        report.requested_runs = requested::run(store, cfg, &slots(catch_up), now_ms, paused, interrupt.as_mut()).await;
        if !report.requested_runs.is_empty() {
            // They took time: the slot is claimed by what the store says now (its deadline is still judged by
            // when the invocation came: the catch-up made it late, not the invocation).
            read.now_ms = system_time_to_millis(store.now().await?);
            read.entry = store.get(keys.entry()).await?;
        }
    }
    let mut report = judge(store, cfg, &keys, report, read, pause.as_ref(), interrupt.as_mut()).await?;
    // Runs requested outside the schedule, after the slot, unless this invocation was stopped or lost its lease.
    if !matches!(
        report.outcome,
        Outcome::Interrupted { .. } | Outcome::Stopped { .. } | Outcome::LeaseLost { .. } | Outcome::NotRecorded { .. }
    ) {
        let ran = requested::run(store, cfg, &slots(backfill), now_ms, paused, interrupt.as_mut()).await;
        report.requested_runs.extend(ran);
        report.triggers = trigger::run_requested(store, cfg, now_ms, interrupt.as_mut()).await?;
    }
    Ok(report)
}

/// The store's time once it reached `target_ms` (milliseconds since the Unix epoch): `now_ms` when it has, else
/// after sleeping until it has by the store's clock (a few reads: ours runs at its rate).
async fn wait_until<S: Store + Sync>(store: &S, target_ms: u64, mut now_ms: u64) -> Result<u64, Error> {
    for _ in 0..4 {
        if now_ms >= target_ms {
            break;
        }
        tokio::time::sleep(Duration::from_millis(target_ms - now_ms)).await;
        now_ms = system_time_to_millis(store.now().await?);
    }
    Ok(now_ms)
}

/// What an invocation read before judging its slot.
struct Read {
    /// The slot's entry, read in the same atomic read as the job record.
    entry: Option<idem_store::Versioned>,
    /// The slot, its jitter offset, the job's newest slot and the store's now, in milliseconds (since the
    /// Unix epoch, but the offset).
    slot: u64,
    offset: u64,
    newest: u64,
    now_ms: u64,
    /// When the invocation came (the store's clock): what `--starting-deadline` is judged by.
    came_ms: u64,
}

/// Judges the slot and does what the judgement says.
async fn judge<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    keys: &slot::Keys,
    mut report: Report,
    read: Read,
    pause: Option<&slot::Pause>,
    mut interrupt: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<Report, Error> {
    let Read { entry, slot, offset, newest, now_ms, came_ms } = read;
    let keys = keys.clone();
    let behind = newest > slot;
    let mut entry = decode_entry(entry, &keys)?;
    let limit = RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
    let late = came_ms.saturating_sub(slot.saturating_add(offset)); // from its start: time plus jitter
    let past_deadline = cfg.starting_deadline.is_some_and(|d| u128::from(late) > d.as_millis());
    // A claim refused because another invocation changed the slot meanwhile is judged again, a few times.
    for _ in 0..4 {
        let lease_live = match &entry {
            Some((_, e)) if e.is_final() => false,
            _ => store.get(keys.lease()).await?.is_some(),
        };
        let current = entry.as_ref().map(|(_, e)| e);
        report.outcome = match slot::plan(current, lease_live, limit, past_deadline, behind) {
            slot::Plan::Done => already_done(current),
            slot::Plan::Missed => Outcome::Missed { reason: missed_reason(current), recorded_now: false },
            slot::Plan::Paused => paused_outcome(current, pause, false),
            slot::Plan::Skipped => skipped_outcome(current),
            slot::Plan::FailedForGood => failed_for_good(current),
            slot::Plan::Held => held(current),
            slot::Plan::Behind => {
                record::behind(store, &keys).await;
                Outcome::Behind { newest: cfg.schedule.format(newest) }
            }
            slot::Plan::RecordMissed => {
                let reason = MissedReason::PastDeadline { came_at_ms: came_ms };
                match store.apply(missed(&keys, reason, now_ms)).await {
                    Ok(_) => Outcome::Missed { reason, recorded_now: true },
                    Err(e) if e.is_precondition_failed() => {
                        entry = reread(store, &keys).await?;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            slot::Plan::Run { .. } if pause.is_some_and(|p| p.holds_at(now_ms)) => {
                let Some(p) = pause else { continue };
                if current.is_some() {
                    // A slot started before the pause (failed, given back) is not retried while it holds.
                    paused_outcome(None, Some(p), false)
                } else {
                    match store.apply(slot::paused(&keys, p, now_ms)).await {
                        Ok(_) => paused_outcome(None, Some(p), true),
                        Err(e) if e.is_precondition_failed() => {
                            entry = reread(store, &keys).await?;
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            slot::Plan::Run { .. } if cfg.overlap != slot::Overlap::Allow && takes_a_turn(current) => {
                if fired(interrupt.as_mut()) {
                    report.outcome = Outcome::Stopped { attempt: None };
                    return Ok(report);
                }
                match overlap::take_turn(store, cfg, &keys, entry.clone(), now_ms, interrupt.as_mut()).await? {
                    overlap::Turn::Held(held, sent) => {
                        run_held(store, cfg, *held, sent, &report.slot, interrupt.as_mut()).await
                    }
                    overlap::Turn::Done(outcome) => outcome,
                    overlap::Turn::Changed => {
                        entry = reread(store, &keys).await?;
                        continue;
                    }
                }
            }
            slot::Plan::Run { .. } => {
                // A retry under a policy other than allow does not wait: it starts when no other slot runs.
                if cfg.overlap != slot::Overlap::Allow
                    && let Some(earlier) = record::running_before(store, &cfg.name, slot).await?
                {
                    report.outcome = Outcome::EarlierRunning { slot: cfg.schedule.format(earlier) };
                    return Ok(report);
                }
                if fired(interrupt.as_mut()) {
                    report.outcome = Outcome::Stopped { attempt: None };
                    return Ok(report);
                }
                let claim =
                    slot::Claim::new(keys.clone(), owner_token(), host_name(), now_ms, cfg.lease, entry.clone());
                let alone = (cfg.overlap != slot::Overlap::Allow).then_some(&keys);
                match claim_slot(store, &claim, alone).await? {
                    Some((held, sent)) => {
                        if claim.creates()
                            && let Some(behind) = behind_history(store, cfg, &keys, &held).await?
                        {
                            report.outcome = behind;
                            return Ok(report);
                        }
                        if claim.takes_over() {
                            record::took_over(store, &held).await;
                        }
                        run_held(store, cfg, held, sent, &report.slot, interrupt.as_mut()).await
                    }
                    None => {
                        entry = reread(store, &keys).await?;
                        continue;
                    }
                }
            }
        };
        return Ok(report);
    }
    report.outcome = held(entry.as_ref().map(|(_, e)| e));
    Ok(report)
}

/// A slot claimed by creating its entry, checked once made: a read of "no entry" may be stale by a whole
/// history ([`record::newer_than_history`]). [`Outcome::Behind`] (the claim withdrawn and released) when the job
/// has seen a newer slot.
async fn behind_history<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    keys: &slot::Keys,
    held: &slot::Held,
) -> Result<Option<Outcome>, Error> {
    let newer = record::newer_than_history(store, keys).await;
    if !matches!(newer, Ok(None)) {
        let _ = store.apply(held.withdraw()).await;
        let _ = store.apply(held.release()).await;
    }
    match newer? {
        None => Ok(None),
        Some(newest) => {
            record::behind(store, keys).await;
            Ok(Some(Outcome::Behind { newest: cfg.schedule.format(newest) }))
        }
    }
}

/// How far this machine's clock may be ahead of the store's for an invocation fired at a slot boundary by
/// its own clock (cron) to take that slot rather than the one before: it waits up to this long for the
/// store's clock to reach the boundary.
pub const SKEW_TOLERANCE: Duration = Duration::from_secs(5);

/// The warning for a machine whose clock (`local_ms`) is ahead of the store's (`store_ms`) by more than
/// [`SKEW_TOLERANCE`]: an invocation cron fires at a slot boundary by it takes the slot before that boundary
/// (and, under `--starting-deadline`, may find it missed). A clock behind the store's is harmless here: it
/// fires late, and the store's clock chooses the slot.
fn skew_warning(store_ms: u64, local_ms: u64) -> Option<String> {
    let ahead = local_ms.saturating_sub(store_ms);
    (u128::from(ahead) > SKEW_TOLERANCE.as_millis()).then(|| {
        format!(
            "this machine's clock is {:.1} s ahead of the store's, more than the {} s an invocation fired at a slot \
             boundary waits for the store's clock to reach it: it takes the slot before; synchronise the clocks \
             (NTP)",
            ahead as f64 / 1000.0,
            SKEW_TOLERANCE.as_secs()
        )
    })
}

/// The store's time to take the slot by: `now_ms` (the store's clock), unless this machine's clock
/// (`local_ms`) has passed a slot boundary that the store's clock reaches within [`SKEW_TOLERANCE`]; then
/// the invocation waits until the store's clock reached it (a cron-fired invocation on a machine ahead of
/// the store runs the slot it was fired for, not the one before, late or never under `--starting-deadline`).
async fn wait_for_boundary<S: Store + Sync>(
    store: &S,
    schedule: &Schedule,
    mut now_ms: u64,
    local_ms: u64,
) -> Result<u64, Error> {
    let next = schedule.next_after(now_ms)?;
    let tolerance = u64::try_from(SKEW_TOLERANCE.as_millis()).unwrap_or(u64::MAX);
    if local_ms < next || next - now_ms > tolerance {
        return Ok(now_ms);
    }
    // A few tries: the store's clock runs at the rate of ours, so one wait normally reaches the boundary.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(next.saturating_sub(now_ms) + 20)).await;
        now_ms = system_time_to_millis(store.now().await?);
        if now_ms >= next {
            break;
        }
    }
    Ok(now_ms)
}

/// Claims the slot: the lease, then the entry. `None` when another invocation got there first (the lease
/// was live, or the entry changed since it was read), or, with `alone` (the slot's keys, under a policy other
/// than `allow`), when another lease of the job is live once this one is taken (a backfilled slot or a
/// triggered run started meanwhile: taking the lease before looking makes two that look at once see each
/// other); the lease taken is then given back.
async fn claim_slot<S: Store + Sync>(
    store: &S,
    claim: &slot::Claim,
    alone: Option<&slot::Keys>,
) -> Result<Option<(slot::Held, tokio::time::Instant)>, Error> {
    let sent = tokio::time::Instant::now();
    let lease_generation = match store.apply(claim.lease_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(no_generation()),
        Err(e) if e.is_precondition_failed() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if let Some(keys) = alone
        && !matches!(requested::others_live(store, keys.name(), keys.lease()).await, Ok(false))
    {
        let _ = store.apply(claim.lease_release(lease_generation)).await;
        return Ok(None);
    }
    match store.apply(claim.entry_write()).await {
        Ok(Some(entry_generation)) => Ok(Some((claim.clone().acquired(lease_generation, entry_generation), sent))),
        Ok(None) => Err(no_generation()),
        Err(e) => {
            // Give the lease back (fenced on its generation): the slot was not ours after all.
            let _ = store.apply(claim.lease_release(lease_generation)).await;
            if e.is_precondition_failed() { Ok(None) } else { Err(e.into()) }
        }
    }
}

/// Runs the held slot's command while its lease is kept, then records how it ended.
async fn run_held<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    mut held: slot::Held,
    sent: tokio::time::Instant,
    slot: &str,
    mut interrupt: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Outcome {
    let mut keeper = LeaseKeeper::new(store, cfg.lease, sent);
    // The fence before the command starts (as `idem run`'s): a claim made more than a third of a lease ago
    // (this invocation was paused or slow since) is renewed first, so one taken over meanwhile never starts
    // its command beside the successor's.
    if !keeper.fence(&mut held).await {
        return record::not_started(store, &mut held, &mut keeper).await;
    }
    // A signal that came before the start gives the claim back: the attempt never began (one that comes after
    // the start counts, record::outcome).
    if fired(interrupt.as_mut()) {
        return record::stopped_before_start(store, &mut held, &mut keeper).await;
    }
    let stop = cfg.overlap.replaces().then(|| command::Stop {
        key: slot::stop_key(held.keys()),
        grace: (cfg.overlap == slot::Overlap::CancelOther).then_some(cfg.lease),
        every: cfg.lease / 3,
    });
    let spawn = command::Spawn { command: &cfg.command, name: &cfg.name, slot, timeout: cfg.timeout, stop };
    let attempt = command::run(store, &spawn, &mut held, &mut keeper, interrupt).await;
    let outcome = record::outcome(store, cfg, &mut held, &mut keeper, attempt).await;
    if held.attempt() == 1 {
        // A new slot: keep the job's history to its newest slots (best effort; the next new slot tries again).
        let _ = record::prune_history(store, &cfg.name).await;
    }
    outcome
}

/// A future that, once ready, is ready on every later poll (a signal seen stays seen).
struct Sticky<F>(Option<std::pin::Pin<Box<F>>>);

impl<F: Future<Output = ()>> Future for Sticky<F> {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let Some(inner) = self.0.as_mut() else { return std::task::Poll::Ready(()) };
        let ready = inner.as_mut().poll(cx).is_ready();
        if ready {
            self.0 = None;
            return std::task::Poll::Ready(());
        }
        std::task::Poll::Pending
    }
}

/// Whether the interrupt has fired (its handlers are installed before the invocation begins, so a signal
/// that came while nothing watched it is seen here).
fn fired(interrupt: std::pin::Pin<&mut impl Future<Output = ()>>) -> bool {
    futures_util::FutureExt::now_or_never(interrupt).is_some()
}

fn decode_entry(
    v: Option<idem_store::Versioned>,
    keys: &slot::Keys,
) -> Result<Option<(Generation, slot::Entry)>, Error> {
    match v {
        Some(v) => Ok(Some((v.generation(), slot::Entry::decode(v.value()).map_err(|e| corrupt(keys.entry(), e))?))),
        None => Ok(None),
    }
}

async fn reread<S: Store>(store: &S, keys: &slot::Keys) -> Result<Option<(Generation, slot::Entry)>, Error> {
    decode_entry(store.get(keys.entry()).await?, keys)
}

fn corrupt(key: &str, source: idem_core::Error) -> Error {
    Error::Entry { key: key.to_owned(), source }
}

fn no_generation() -> Error {
    Error::Store(idem_store::Error::backend("a put answered without a generation"))
}

fn utc(ms: u64) -> String {
    schedule::format_in(ms, None)
}

fn already_done(entry: Option<&slot::Entry>) -> Outcome {
    match entry {
        Some(slot::Entry::Done { host, attempts, ending, .. }) => {
            Outcome::AlreadyDone { host: host.clone(), finished: utc(ending.finished_at_ms), attempts: *attempts }
        }
        _ => Outcome::AlreadyDone { host: "?".into(), finished: "?".into(), attempts: 0 },
    }
}

fn failed_for_good(entry: Option<&slot::Entry>) -> Outcome {
    let attempts = entry.map_or(0, slot::Entry::attempts);
    let exit = match entry {
        Some(slot::Entry::Running { .. }) => "a crash (its holder's lease lapsed)".to_owned(),
        Some(e) => e.last_ending().map_or_else(|| "?".to_owned(), |end| end.exit.clone()),
        None => "?".to_owned(),
    };
    Outcome::FailedForGood { attempts, exit }
}

fn held(entry: Option<&slot::Entry>) -> Outcome {
    match entry {
        Some(slot::Entry::Running { host, attempt, .. }) => {
            Outcome::Held { host: Some(host.clone()), attempt: Some(*attempt) }
        }
        _ => Outcome::Held { host: None, attempt: None },
    }
}

/// Whether a slot never started (no entry, a waiter's, or the marker a skip or a pause left) is claimed in
/// its turn under a policy other than `allow` ([`overlap::take_turn`]); a retry of a started slot is not.
fn takes_a_turn(entry: Option<&slot::Entry>) -> bool {
    matches!(entry, None | Some(slot::Entry::Waiting { .. } | slot::Entry::Skipped { .. } | slot::Entry::Paused { .. }))
}

fn paused_outcome(entry: Option<&slot::Entry>, pause: Option<&slot::Pause>, recorded_now: bool) -> Outcome {
    match (entry, pause) {
        // Found paused, and not to be run any more (past its deadline, or behind the job's newest slot).
        (Some(slot::Entry::Paused { by, note, .. }), _) => {
            Outcome::Paused { by: by.clone(), note: note.clone(), until: None, recorded_now, holds: false }
        }
        (_, Some(p)) => Outcome::Paused {
            by: p.by.clone(),
            note: p.note.clone(),
            until: p.until_ms.map(utc),
            recorded_now,
            holds: true,
        },
        _ => Outcome::Paused { by: "?".into(), note: None, until: None, recorded_now, holds: false },
    }
}

fn skipped_outcome(entry: Option<&slot::Entry>) -> Outcome {
    let policy = match entry {
        Some(slot::Entry::Skipped { policy, .. }) => policy.clone(),
        _ => "?".into(),
    };
    Outcome::Skipped { policy, earlier: skipped_after(entry) }
}

fn skipped_after(entry: Option<&slot::Entry>) -> String {
    match entry {
        Some(slot::Entry::Skipped { earlier_ms: slot::TRIGGERED_AHEAD, .. }) => "(a triggered run)".into(),
        Some(slot::Entry::Skipped { earlier_ms, .. }) => utc(*earlier_ms),
        _ => "?".into(),
    }
}

fn missed_reason(entry: Option<&slot::Entry>) -> MissedReason {
    match entry {
        Some(slot::Entry::Missed { reason, .. }) => *reason,
        _ => MissedReason::NotStarted,
    }
}

/// The store's clock now, in milliseconds since the Unix epoch.
///
/// # Errors
/// [`Error::Store`] when the store fails.
pub async fn store_millis<S: Store>(store: &S) -> Result<u64, Error> {
    Ok(millis(store.now().await?))
}

/// Milliseconds since the Unix epoch of a store clock reading.
pub(crate) fn millis(t: SystemTime) -> u64 {
    system_time_to_millis(t)
}

/// Why a lease was lost, in words.
pub(crate) fn lost_why(why: Lost) -> &'static str {
    match why {
        Lost::Refused => "the lease was taken over by another invocation (this one was paused or cut off past it)",
        Lost::Lapsed => {
            "no lease renewal was accepted for a whole lease (the store did not answer in time, or this invocation \
             was paused or starved of CPU): the lease lapsed"
        }
    }
}
