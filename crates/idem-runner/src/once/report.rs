//! What one invocation did about its current slot ([`Outcome`]), its message and exit status ([`Report`]).

use idem_core::slot::MissedReason;

use crate::shown::count;

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
/// Exit status with `--fail-if-held`: the slot (or, with `--overlap skip`, an earlier one) runs elsewhere.
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
    /// `--overlap skip` (`--no-overlap`): an earlier slot of the job is still running, so this one did not start.
    EarlierRunning {
        /// The earlier slot (RFC 3339).
        slot: String,
    },
    /// The job is paused (`idem once pause`): nothing ran; the slot is recorded paused.
    Paused {
        /// Who paused it.
        by: String,
        /// Why.
        note: Option<String>,
        /// Until when (RFC 3339, UTC); `None`: until resumed.
        until: Option<String>,
        /// This invocation recorded it.
        recorded_now: bool,
        /// The pause holds now; `false`: the slot was recorded paused in its time, which has passed (past its
        /// `--starting-deadline`, or behind the job's newest slot), so it is not run after the pause either.
        holds: bool,
    },
    /// Not run under the overlap policy (`buffer-one`: another slot already waited for the running one;
    /// `skip`: an earlier slot ran when the slot's invocations came, and none came later in time).
    Skipped {
        /// The policy (`buffer-one`, `skip`).
        policy: String,
        /// The slot ahead of it (RFC 3339).
        earlier: String,
    },
    /// Stopped while it ran, as `--overlap cancel-other` or `terminate-other` asked for a later slot; recorded
    /// failed with the ending `replaced by …`, and never run again (it is behind the later slot).
    Replaced {
        /// The attempt stopped.
        attempt: u32,
        /// The slot that replaced it (RFC 3339).
        by: String,
        /// How the command ended (`signal 15`, `signal 9`, or its exit when it exited on SIGTERM).
        exit: String,
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
    /// [`RECORD_PATIENCE`](super::RECORD_PATIENCE) (or the lease, if longer): the slot stays `running` in the store, and the first
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
    /// Runs requested outside the schedule (`idem once trigger`) that this invocation found pending, by id,
    /// and what became of each.
    pub triggers: Vec<(String, Outcome)>,
    /// Earlier slots this invocation requested to catch up (RFC 3339), oldest first: they passed unseen within
    /// `--catchup-window`.
    pub requested: Vec<String>,
    /// Requested earlier slots (a catch-up's, a backfill's) this invocation ran or found held, by slot (RFC
    /// 3339), and what became of each.
    pub requested_runs: Vec<(String, Outcome)>,
    /// Trouble with the clocks, in words: this machine's clock ahead of the store's by more than
    /// [`SKEW_TOLERANCE`](super::SKEW_TOLERANCE), a job record whose newest slot was ahead of the store's clock by more than
    /// [`idem_core::slot::FUTURE_TOLERANCE_MS`].
    pub warnings: Vec<String>,
}

impl Report {
    /// The report of `cfg`'s slot starting at `slot` (ms since the epoch), nothing missed.
    pub(crate) fn new(cfg: &super::OnceConfig, slot: u64, outcome: Outcome, warnings: Vec<String>) -> Self {
        Report {
            name: cfg.name.clone(),
            slot: cfg.schedule.format(slot),
            outcome,
            missed: Vec::new(),
            missed_unlisted: 0,
            missed_capped: false,
            triggers: Vec::new(),
            requested: Vec::new(),
            requested_runs: Vec::new(),
            warnings,
        }
    }

    /// The exit status (the `EXIT_*` constants); `fail_if_held` makes a held slot [`EXIT_HELD`].
    /// The exit status is the own slot's, unless a requested slot (a backfill's, a catch-up's) or a triggered
    /// run it ran ended worse: then a failure (1), a failure for good (3), a lost lease (6) or a signal (130)
    /// among those wins, in that order, so a monitor never reads a stopped or failed backfill as success.
    pub fn exit_code(&self, fail_if_held: bool) -> i32 {
        // From harmless to grave: what a requested or triggered run may raise the own slot's status to.
        const RANK: [i32; 5] = [EXIT_DONE, EXIT_FAILED, EXIT_FAILED_FOR_GOOD, EXIT_LEASE_LOST, EXIT_INTERRUPTED];
        let rank = |code: i32| RANK.iter().position(|c| *c == code).unwrap_or(0);
        let own = Self::code_of(&self.outcome, fail_if_held);
        let extras = self.requested_runs.iter().chain(&self.triggers).map(|(_, o)| Self::code_of(o, false));
        match extras.max_by_key(|c| rank(*c)) {
            // A missed or held own slot (4, 5) keeps its status but to a signal: the invocation was stopped.
            Some(worst) if !RANK.contains(&own) => {
                if worst == EXIT_INTERRUPTED {
                    worst
                } else {
                    own
                }
            }
            Some(worst) if rank(worst) > rank(own) => worst,
            _ => own,
        }
    }

    fn code_of(outcome: &Outcome, fail_if_held: bool) -> i32 {
        match outcome {
            Outcome::Succeeded { .. }
            | Outcome::AlreadyDone { .. }
            | Outcome::Paused { .. }
            | Outcome::Skipped { .. }
            | Outcome::Replaced { .. } => EXIT_DONE,
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
        !self.missed.is_empty()
            || self.missed_unlisted > 0
            || !self.requested.is_empty()
            || self.requested_runs.iter().any(|(_, o)| !matches!(o, Outcome::Succeeded { .. }))
            || self.outcome_changed_state()
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
            Outcome::Missed { recorded_now, .. } | Outcome::Paused { recorded_now, .. } => *recorded_now,
            Outcome::Skipped { .. } | Outcome::Replaced { .. } => true,
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
        // The slot's own line first: `--quiet` leaves it out when it is routine.
        let mut line = format!("{head}: {}", describe(&self.outcome));
        if !self.requested.is_empty() {
            line.push_str(&format!(
                "\nidem once: {}: requested {} that passed unseen within --catchup-window, run before {}: {}",
                self.name,
                count(self.requested.len(), "earlier slot", "earlier slots"),
                self.slot,
                self.requested.join(", ")
            ));
        }
        for (slot, outcome) in &self.requested_runs {
            line.push_str(&format!("\nidem once: {} {slot} (requested): {}", self.name, describe(outcome)));
        }
        for (id, outcome) in &self.triggers {
            line.push_str(&format!("\nidem once: {} trigger {id}: {}", self.name, describe(outcome)));
        }
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

/// What became of a slot (or a triggered run), in words.
fn describe(outcome: &Outcome) -> String {
    match outcome {
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
        Outcome::EarlierRunning { slot } => format!(
            "not started: the slot {slot} still runs (--overlap skip); recorded skipped, a later invocation in this \
             slot starts it once that ended"
        ),
        Outcome::Paused { by, note, holds: false, .. } => {
            let note = note.as_ref().map_or_else(String::new, |n| format!(" ({n})"));
            format!("recorded paused: the job was paused by {by}{note} in the slot's time, which has passed; not run")
        }
        Outcome::Paused { by, note, until, recorded_now, .. } => {
            let until = until.as_ref().map_or_else(|| " until resumed".to_owned(), |u| format!(" until {u}"));
            let note = note.as_ref().map_or_else(String::new, |n| format!(" ({n})"));
            let when = if *recorded_now { "recorded paused now" } else { "paused" };
            format!("{when}: the job is paused by {by}{until}{note}; not run")
        }
        Outcome::Skipped { policy, earlier } if policy == "buffer-one" => {
            format!("skipped (--overlap buffer-one): the slot {earlier} already waits for the running one; not run")
        }
        Outcome::Skipped { policy, earlier } => {
            format!("skipped (--overlap {policy}): the slot {earlier} ran when this slot's invocations came; not run")
        }
        Outcome::Replaced { attempt: 0, by, .. } => {
            format!("replaced by the slot {by} before it started (--overlap): recorded skipped; not run")
        }
        Outcome::Replaced { attempt, by, exit } => {
            format!("replaced by the slot {by}: its command was stopped ({exit}; attempt {attempt}), recorded replaced")
        }
        Outcome::FailedForGood { attempts, exit } if exit == idem_core::slot::INTERRUPTED_EXIT => {
            format!(
                "failed for good: {}, the last interrupted by a signal; not run",
                count(*attempts, "attempt", "attempts")
            )
        }
        Outcome::FailedForGood { attempts, exit } => {
            format!("failed for good: {}, the last ended with {exit}; not run", count(*attempts, "attempt", "attempts"))
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(outcome: Outcome, extras: Vec<Outcome>) -> Report {
        Report {
            name: "j".into(),
            slot: "s".into(),
            outcome,
            missed: Vec::new(),
            missed_unlisted: 0,
            missed_capped: false,
            triggers: Vec::new(),
            requested: Vec::new(),
            requested_runs: extras.into_iter().map(|o| ("r".to_owned(), o)).collect(),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn a_requested_run_that_failed_or_was_stopped_raises_the_exit_status() {
        let done = || Outcome::AlreadyDone { host: "h".into(), finished: "f".into(), attempts: 1 };
        let failed = |left| Outcome::Failed { attempt: 1, exit: "exit 7".into(), left };
        let stopped = || Outcome::Interrupted { attempt: 1, left: 1 };
        assert_eq!(report(done(), vec![]).exit_code(false), EXIT_DONE);
        assert_eq!(report(done(), vec![Outcome::Succeeded { attempt: 1 }]).exit_code(false), EXIT_DONE);
        assert_eq!(report(done(), vec![failed(2)]).exit_code(false), EXIT_FAILED);
        assert_eq!(report(done(), vec![failed(2), failed(0)]).exit_code(false), EXIT_FAILED_FOR_GOOD);
        assert_eq!(report(done(), vec![failed(0), stopped()]).exit_code(false), EXIT_INTERRUPTED);
        assert_eq!(report(failed(0), vec![failed(2)]).exit_code(false), EXIT_FAILED_FOR_GOOD, "never lowered");
        let missed = Outcome::Missed { reason: idem_core::slot::MissedReason::NotStarted, recorded_now: false };
        assert_eq!(report(missed.clone(), vec![failed(2)]).exit_code(false), EXIT_MISSED);
        assert_eq!(report(missed, vec![stopped()]).exit_code(false), EXIT_INTERRUPTED);
    }
}
