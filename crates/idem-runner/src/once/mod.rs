//! `idem once`: each scheduled slot of a cron job runs once, whichever machines invoke it and however often.
//!
//! An invocation reads the store's clock ([`Store::now`]), takes the current slot of the job's [`Schedule`],
//! records the slots that passed unseen as missed, and judges the current slot by its entry and lease
//! (`idem_core`'s slot state machine): done, held elsewhere, failed for good and missed end it at once;
//! otherwise it claims the slot under a lease, runs the command while an [`idem_store::LeaseKeeper`] renews
//! the lease, and records the outcome with a write fenced on the claim.

mod command;
mod config;
mod record;
mod schedule;
mod status;

use std::future::Future;
use std::time::{Duration, SystemTime};

use idem_core::ledger::RetryLimit;
use idem_core::slot::{self, Job, MissedReason, job_key, missed};
use idem_store::{Generation, LeaseKeeper, Lost, Store, StoreExt, system_time_to_millis};

use crate::Error;
use crate::shown::count;
use crate::supervise::{host_name, owner_token};

pub use config::{OnceConfig, check_name, default_store_path};
pub use record::RECORD_PATIENCE;
pub use schedule::{Schedule, parse_canonical};
pub use status::{History, SlotView, forget, history};

/// Exit status: the slot is done (ran now, or earlier here or elsewhere), or it is held elsewhere (without
/// `--fail-if-held`).
pub const EXIT_DONE: i32 = 0;
/// Exit status: the command ran here and failed; attempts remain (the next invocation in the slot retries).
pub const EXIT_FAILED: i32 = 1;
/// Exit status: nothing ran: bad usage, a schedule other than the job's recorded one, a store that cannot be
/// opened (a bad URL, a refused login) or failed before the claim.
pub const EXIT_USAGE: i32 = 2;
/// Exit status: nothing ran: the store was down or unreachable (`is_unavailable`) at the start or before the
/// claim; the next invocation tries again (sysexits.h EX_TEMPFAIL, as `idem run`'s store outage).
pub const EXIT_STORE_UNAVAILABLE: i32 = 75;
/// Exit status: the slot failed for good (its last attempt failed now, or every attempt had failed already).
pub const EXIT_FAILED_FOR_GOOD: i32 = 3;
/// Exit status: the slot is missed (past `--starting-deadline`, recorded now or before), or it is older than
/// the newest slot the job has seen (the clock that chose it is behind): nothing ran.
pub const EXIT_MISSED: i32 = 4;
/// Exit status with `--fail-if-held`: the slot (or, with `--no-overlap`, an earlier one) runs elsewhere.
pub const EXIT_HELD: i32 = 5;
/// Exit status: the lease was lost while the command ran (taken over, or the store unreachable for a whole
/// lease), or its outcome could not be recorded: this invocation's result does not count.
pub const EXIT_LEASE_LOST: i32 = 6;
/// Exit status: SIGINT or SIGTERM stopped the command; the attempt counts toward `--retries`.
pub const EXIT_INTERRUPTED: i32 = 130;

/// What one invocation did about its current slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The command ran here and exited 0; the slot is recorded done.
    Succeeded {
        /// The attempt it was.
        attempt: u32,
    },
    /// The command ran here and failed; recorded.
    Failed {
        /// The attempt it was.
        attempt: u32,
        /// How it ended (`exit 3`, `signal 9`, `timeout`).
        exit: String,
        /// Attempts left for later invocations in the slot (0: failed for good).
        left: u32,
    },
    /// Done already.
    AlreadyDone {
        /// Where it ran.
        host: String,
        /// When it finished (RFC 3339, UTC).
        finished: String,
        /// Attempts it took.
        attempts: u32,
    },
    /// Another invocation holds the slot under a live lease (running it, or claiming it).
    Held {
        /// Where, when known.
        host: Option<String>,
        /// Its attempt, when known.
        attempt: Option<u32>,
    },
    /// `--no-overlap`: an earlier slot of the job is still running, so this one did not start.
    EarlierRunning {
        /// The earlier slot (RFC 3339).
        slot: String,
    },
    /// Every attempt allowed failed (or crashed); nothing ran.
    FailedForGood {
        /// Attempts used.
        attempts: u32,
        /// How the last one ended.
        exit: String,
    },
    /// The slot is missed.
    Missed {
        /// Why.
        reason: MissedReason,
        /// This invocation recorded it (past `--starting-deadline`).
        recorded_now: bool,
    },
    /// The slot is older than the newest slot the job record has seen: the clock that chose it (the store's)
    /// is behind the one that moved the record, so it is never claimed here (it may have run already, and its
    /// entry may be pruned).
    Behind {
        /// The job's newest slot (RFC 3339).
        newest: String,
    },
    /// The lease was lost while the command ran, or the outcome could not be recorded.
    LeaseLost {
        /// The attempt it was.
        attempt: u32,
        /// What happened.
        why: String,
        /// The command had exited 0: it ran to its end, and the slot now counts as run more than once.
        succeeded: bool,
    },
    /// The command ended, but the store failed on every try of its fenced outcome write for
    /// [`RECORD_PATIENCE`] (or the lease, if longer): the slot stays `running` in the store, and the first
    /// invocation after its lease lapsed runs it again.
    NotRecorded {
        /// The attempt it was.
        attempt: u32,
        /// The command had exited 0.
        succeeded: bool,
        /// The store's last error.
        error: String,
        /// How long the write was tried, in words (`61 s`).
        tried_for: String,
    },
    /// A signal to the invocation came before the command started: nothing ran; a claim made was given back
    /// (fenced; not counted).
    Stopped {
        /// The attempt the claim given back was, if a claim was made.
        attempt: Option<u32>,
    },
    /// A signal to the invocation stopped the command after it started; the attempt counts toward
    /// `--retries` (recorded failed, exit `interrupted`).
    Interrupted {
        /// The attempt it was.
        attempt: u32,
        /// Attempts left for later invocations in the slot (0: the slot is failed for good).
        left: u32,
    },
}

/// What one invocation did, for its message and exit status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The job.
    pub name: String,
    /// The current slot (RFC 3339).
    pub slot: String,
    /// What happened to it.
    pub outcome: Outcome,
    /// Earlier slots this invocation recorded missed (RFC 3339), oldest first.
    pub missed: Vec<String>,
    /// More earlier slots that passed unseen, counted but not recorded one by one.
    pub missed_unlisted: u64,
    /// `missed_unlisted` is a lower bound (a cron gap longer than a million slots).
    pub missed_capped: bool,
    /// Trouble with the clocks, in words: this machine's clock ahead of the store's by more than
    /// [`SKEW_TOLERANCE`], a job record whose newest slot was ahead of the store's clock by more than
    /// [`idem_core::slot::FUTURE_TOLERANCE_MS`].
    pub warnings: Vec<String>,
}

impl Report {
    /// The exit status (the `EXIT_*` constants); `fail_if_held` makes a held slot [`EXIT_HELD`].
    pub fn exit_code(&self, fail_if_held: bool) -> i32 {
        match &self.outcome {
            Outcome::Succeeded { .. } | Outcome::AlreadyDone { .. } => EXIT_DONE,
            Outcome::Held { .. } | Outcome::EarlierRunning { .. } => {
                if fail_if_held {
                    EXIT_HELD
                } else {
                    EXIT_DONE
                }
            }
            Outcome::Failed { left: 0, .. } | Outcome::FailedForGood { .. } => EXIT_FAILED_FOR_GOOD,
            Outcome::Failed { .. } => EXIT_FAILED,
            Outcome::Missed { .. } | Outcome::Behind { .. } => EXIT_MISSED,
            Outcome::LeaseLost { .. } | Outcome::NotRecorded { .. } => EXIT_LEASE_LOST,
            Outcome::Interrupted { .. } | Outcome::Stopped { .. } => EXIT_INTERRUPTED,
        }
    }

    /// Whether this invocation changed the slot's state for the worse or met trouble: what `--quiet` still
    /// reports, once per change as Kubernetes reports an event. A failed attempt, a slot (or earlier slots)
    /// recorded missed now, a lost lease or unrecorded outcome, an interruption, and a clock behind the job's
    /// are; a success, and a slot found done, held, failed for good or missed by an earlier invocation are
    /// not (the invocation that made it so said it).
    pub fn changed_state(&self) -> bool {
        !self.missed.is_empty() || self.missed_unlisted > 0 || self.outcome_changed_state()
    }

    /// Whether the invocation's own slot changed state or met trouble (as [`Report::changed_state`], without
    /// the earlier slots recorded missed): under `--quiet` a routine outcome is left out of the message even
    /// when the same invocation recorded missed slots.
    pub fn outcome_changed_state(&self) -> bool {
        match &self.outcome {
            Outcome::Succeeded { .. }
            | Outcome::AlreadyDone { .. }
            | Outcome::Held { .. }
            | Outcome::EarlierRunning { .. }
            | Outcome::FailedForGood { .. } => false,
            Outcome::Missed { recorded_now, .. } => *recorded_now,
            Outcome::Failed { .. }
            | Outcome::Behind { .. }
            | Outcome::LeaseLost { .. }
            | Outcome::NotRecorded { .. }
            | Outcome::Interrupted { .. }
            | Outcome::Stopped { .. } => true,
        }
    }

    /// The invocation's message, one line (two when it recorded earlier slots missed).
    pub fn render(&self) -> String {
        let head = format!("idem once: {} {}", self.name, self.slot);
        let what = match &self.outcome {
            Outcome::Succeeded { attempt } => format!("done (attempt {attempt})"),
            Outcome::Failed { attempt, exit, left: 0 } => {
                format!("failed for good: attempt {attempt} ended with {exit}, no retries left")
            }
            Outcome::Failed { attempt, exit, left } => format!(
                "attempt {attempt} failed with {exit}; the next invocation in this slot retries ({} left)",
                count(*left, "attempt", "attempts")
            ),
            Outcome::AlreadyDone { host, finished, attempts } => {
                format!("done already, on {host} at {finished} (attempt {attempts}); nothing to run")
            }
            Outcome::Held { host, attempt } => match (host, attempt) {
                (Some(h), Some(a)) => format!("running on {h} (attempt {a}) under a live lease; not run here"),
                _ => "being claimed by another invocation; not run here".to_owned(),
            },
            Outcome::EarlierRunning { slot } => {
                format!("not started: the slot {slot} still runs (--no-overlap); a later invocation starts it")
            }
            Outcome::FailedForGood { attempts, exit } if exit == idem_core::slot::INTERRUPTED_EXIT => {
                format!(
                    "failed for good: {}, the last interrupted by a signal; not run",
                    count(*attempts, "attempt", "attempts")
                )
            }
            Outcome::FailedForGood { attempts, exit } => {
                format!(
                    "failed for good: {}, the last ended with {exit}; not run",
                    count(*attempts, "attempt", "attempts")
                )
            }
            Outcome::Missed { reason, recorded_now } => {
                let why = match reason {
                    MissedReason::PastDeadline { .. } => "not started within --starting-deadline",
                    MissedReason::NoInvocation => "no invocation came while it was current",
                    MissedReason::NotStarted => "it passed without starting",
                };
                let when = if *recorded_now { "recorded missed now" } else { "missed" };
                format!("{when} ({why}); not run")
            }
            Outcome::Behind { newest } => format!(
                "not run: the job has already seen the later slot {newest}, so this clock is behind the one that \
                 recorded it (set back, or another machine's on a shared file); a slot older than the job's newest \
                 never runs"
            ),
            Outcome::LeaseLost { attempt, why, succeeded } => {
                let ran = if *succeeded { "; the command had exited 0, so the slot ran more than once" } else { "" };
                format!("attempt {attempt}: {why}; its outcome is not recorded{ran}")
            }
            Outcome::NotRecorded { attempt, succeeded, error, tried_for } => {
                let ended = if *succeeded { "exited 0" } else { "failed" };
                format!(
                    "attempt {attempt}: the command {ended}, but the store failed on every try of its outcome write \
                     for {tried_for} ({error}); the slot stays running in the store, so the first invocation after \
                     its lease lapsed runs it again"
                )
            }
            Outcome::Stopped { attempt: Some(a) } => {
                format!("interrupted before the command started: nothing ran; attempt {a} given back (not counted)")
            }
            Outcome::Stopped { attempt: None } => "interrupted before the claim: nothing ran".to_owned(),
            Outcome::Interrupted { attempt, left: 0 } => format!(
                "interrupted: attempt {attempt} killed; it counts toward --retries and was the last allowed, so \
                 the slot failed for good"
            ),
            Outcome::Interrupted { attempt, left } => format!(
                "interrupted: attempt {attempt} killed; it counts toward --retries ({} left; the next invocation \
                 in this slot retries)",
                count(*left, "attempt", "attempts")
            ),
        };
        let mut line = format!("{head}: {what}");
        if !self.missed.is_empty() || self.missed_unlisted > 0 {
            let shown: Vec<&str> = self.missed.iter().rev().take(3).rev().map(String::as_str).collect();
            let more = self.missed.len() - shown.len();
            let earlier = if more > 0 { format!("{more} more, ") } else { String::new() };
            let unlisted = if self.missed_unlisted > 0 {
                let at_least = if self.missed_capped { "at least " } else { "" };
                format!(" and {at_least}{} earlier ones counted, not listed", self.missed_unlisted)
            } else {
                String::new()
            };
            line.push_str(&format!(
                "\nidem once: {}: recorded {} missed ({earlier}{}){unlisted}",
                self.name,
                count(self.missed.len(), "earlier slot", "earlier slots"),
                shown.join(", ")
            ));
        }
        for warning in &self.warnings {
            line.push_str(&format!("\nidem once: {}: warning: {warning}", self.name));
        }
        line
    }
}

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
    let mut interrupt = std::pin::pin!(interrupt);
    // Everything before the first write is reads and waits: a signal stops it at once (a store that stalls
    // would otherwise hold the invocation for the client's whole timeout), nothing claimed nor recorded.
    let fired_for = millis(SystemTime::now());
    let reads = async {
        let now_ms = system_time_to_millis(store.now().await?);
        let local_ms = millis(SystemTime::now());
        let skew = skew_warning(now_ms, local_ms);
        let now_ms = wait_for_boundary(store, &cfg.schedule, now_ms, local_ms).await?;
        let slot = cfg.schedule.slot_at(now_ms)?;
        let keys = slot::Keys::new(&cfg.name, slot);
        let read = store.get_many(&[job_key(&cfg.name), keys.entry().to_owned()]).await?;
        Ok::<_, Error>((now_ms, skew, slot, keys, read))
    };
    let (now_ms, skew, slot, keys, read) = tokio::select! {
        // Reads that are done go on to the claim (a signal is looked at again right before it): the same
        // path whichever of the two was seen first.
        biased;
        reads = reads => reads?,
        () = interrupt.as_mut() => {
            // Named by the slot this machine's clock was in when it was invoked: the one its cron fired for.
            let slot = cfg.schedule.slot_at(fired_for)?;
            return Ok(Report {
                name: cfg.name.clone(),
                slot: cfg.schedule.format(slot),
                outcome: Outcome::Stopped { attempt: None },
                missed: Vec::new(),
                missed_unlisted: 0,
                missed_capped: false,
                warnings: Vec::new(),
            });
        }
    };
    let job_key = job_key(&cfg.name);
    let [job, entry]: [_; 2] = read
        .try_into()
        .map_err(|_| Error::Config("the store answered a read of two keys with another count".into()))?;
    let job = match job {
        Some(v) => Some((v.generation(), Job::decode(v.value()).map_err(|e| corrupt(&job_key, e))?)),
        None => None,
    };
    let mut report = Report {
        name: cfg.name.clone(),
        slot: cfg.schedule.format(slot),
        outcome: Outcome::Held { host: None, attempt: None },
        missed: Vec::new(),
        missed_unlisted: 0,
        missed_capped: false,
        warnings: skew.into_iter().collect(),
    };
    let newest = record::advance(store, cfg, job, slot, now_ms, &mut report).await?;
    let behind = newest > slot;
    let mut entry = decode_entry(entry, &keys)?;
    let limit = RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
    let late = now_ms.saturating_sub(slot);
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
            slot::Plan::FailedForGood => failed_for_good(current),
            slot::Plan::Held => held(current),
            slot::Plan::Behind => {
                record::behind(store, &keys).await;
                Outcome::Behind { newest: cfg.schedule.format(newest) }
            }
            slot::Plan::RecordMissed => {
                let reason = MissedReason::PastDeadline { came_at_ms: now_ms };
                match store.apply(missed(&keys, reason, now_ms)).await {
                    Ok(_) => Outcome::Missed { reason, recorded_now: true },
                    Err(e) if e.is_precondition_failed() => {
                        entry = reread(store, &keys).await?;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            slot::Plan::Run { .. } => {
                if cfg.no_overlap
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
                match claim_slot(store, &claim).await? {
                    Some((held, sent)) => {
                        if claim.creates() {
                            // Re-checked once made: a read of "no entry" may be stale by a whole history
                            // (record::newer_than_history).
                            let newer = record::newer_than_history(store, &keys).await;
                            if !matches!(newer, Ok(None)) {
                                let _ = store.apply(held.withdraw()).await;
                                let _ = store.apply(held.release()).await;
                            }
                            match newer {
                                Ok(None) => {}
                                Ok(Some(newest)) => {
                                    record::behind(store, &keys).await;
                                    report.outcome = Outcome::Behind { newest: cfg.schedule.format(newest) };
                                    return Ok(report);
                                }
                                Err(e) => return Err(e),
                            }
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
/// was live, or the entry changed since it was read); the lease taken is then given back.
async fn claim_slot<S: Store + Sync>(
    store: &S,
    claim: &slot::Claim,
) -> Result<Option<(slot::Held, tokio::time::Instant)>, Error> {
    let sent = tokio::time::Instant::now();
    let lease_generation = match store.apply(claim.lease_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(no_generation()),
        Err(e) if e.is_precondition_failed() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
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
    let spawn = command::Spawn { command: &cfg.command, name: &cfg.name, slot, timeout: cfg.timeout };
    let attempt = command::run(&spawn, &mut held, &mut keeper, interrupt).await;
    let outcome = record::outcome(store, cfg, &mut held, &mut keeper, attempt).await;
    if held.attempt() == 1 {
        // A new slot: keep the job's history to its newest slots (best effort; the next new slot tries again).
        let _ = record::prune_history(store, &cfg.name).await;
    }
    outcome
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

fn missed_reason(entry: Option<&slot::Entry>) -> MissedReason {
    match entry {
        Some(slot::Entry::Missed { reason, .. }) => *reason,
        _ => MissedReason::NotStarted,
    }
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
