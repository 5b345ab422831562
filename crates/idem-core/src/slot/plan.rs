//! Judging a slot from what the store holds ([`plan`]), recording it missed, and pruning a job's history.

use idem_store::{Generation, Precondition, Ttl};

use super::{Entry, Keys, MissedReason, Overlap};
use crate::ledger::RetryLimit;
use crate::{Write, WriteOp};

/// What an invocation does about its current slot, judged from the slot's entry and lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Done already (here or elsewhere): nothing to run.
    Done,
    /// Failed on every attempt allowed (or its last attempt crashed with none left): nothing to run.
    FailedForGood,
    /// Recorded missed: nothing to run.
    Missed,
    /// Recorded paused (the job was paused when an invocation came for it): nothing to run.
    Paused,
    /// Recorded skipped under the job's overlap policy: nothing to run.
    Skipped,
    /// Another holder is running it (or claiming it) under a live lease.
    Held,
    /// Never started and past `--starting-deadline`: record it missed ([`missed`]) instead of running it.
    RecordMissed,
    /// Older than the newest slot the job record has seen (a clock behind, or set back): never claimed, so a
    /// slot whose entry was pruned or never listed cannot run again.
    Behind,
    /// Claim it and run attempt `attempt`.
    Run {
        /// The attempt number the claim starts.
        attempt: u32,
    },
}

/// Judges the current slot by its `entry`, whether its lease is live, the attempts allowed, and whether its
/// starting deadline has passed (which matters only for a slot that never started: retries of a started slot
/// are bounded by `limit` alone, as a Kubernetes Job's backoff is by its own limit, not the CronJob's
/// `startingDeadlineSeconds`). `behind`: the slot is older than the job record's newest slot (read in the
/// same atomic read as the entry); such a slot is reported as its entry says, never claimed nor recorded.
pub fn plan(entry: Option<&Entry>, lease_live: bool, limit: RetryLimit, past_deadline: bool, behind: bool) -> Plan {
    match entry {
        Some(Entry::Done { .. }) => Plan::Done,
        Some(Entry::Missed { .. }) => Plan::Missed,
        // Skipped under `skip` while an earlier slot ran: still started by a later invocation in the slot once
        // the earlier one ended (Kubernetes' Forbid within `startingDeadlineSeconds`); recorded skipped, not
        // missed, when none comes.
        Some(Entry::Skipped { policy, .. }) if policy == Overlap::Skip.name() && !past_deadline && !behind => {
            if lease_live {
                Plan::Held
            } else {
                Plan::Run { attempt: 1 }
            }
        }
        // Paused while the job's pause held: run by a later invocation in the slot once the pause ended (as
        // Kubernetes runs a suspended CronJob's missed schedule on resume, within `startingDeadlineSeconds`);
        // the caller keeps it paused while the pause holds.
        Some(Entry::Paused { .. }) if !past_deadline && !behind => {
            if lease_live {
                Plan::Held
            } else {
                Plan::Run { attempt: 1 }
            }
        }
        Some(Entry::Paused { .. }) => Plan::Paused,
        Some(Entry::Skipped { .. }) => Plan::Skipped,
        Some(e @ Entry::Failed { .. }) if e.attempts() >= limit.max_attempts => Plan::FailedForGood,
        _ if lease_live => Plan::Held,
        _ if behind => Plan::Behind,
        None if past_deadline => Plan::RecordMissed,
        None => Plan::Run { attempt: 1 },
        Some(e @ Entry::Running { .. }) if e.attempts() >= limit.max_attempts => Plan::FailedForGood,
        Some(e) => Plan::Run { attempt: e.attempts().saturating_add(1) },
    }
}

/// The write that records a slot missed: create-only, so it never overwrites an entry an invocation of that
/// slot wrote (a claim that came first wins, and a missed record that came first makes that claim fail).
pub fn missed(keys: &Keys, reason: MissedReason, now_ms: u64) -> Write {
    let entry = Entry::Missed { reason, recorded_at_ms: now_ms };
    Write {
        key: keys.entry().to_owned(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Absent,
    }
}

/// The deletes that keep a job's history to the newest `keep` slots: `listed` are its entries (key,
/// generation, entry) in ascending key order; each older one that is finished (done, failed, missed,
/// interrupted, paused, skipped) goes, conditional on its generation so an entry that changed meanwhile stays. A
/// `Running` or `Waiting` entry stays: its holder's writes are fenced on it. An entry other than a missed one also stays
/// while fewer than `keep` such entries are newer than it: missed entries ahead of a slot can be deleted
/// again (a clock that ran ahead recorded them, and the job is taken back), so only entries that are never
/// deleted but by this prune may stand for a pruned slot ([`is_kept_ahead`]; a claim below `keep` of them
/// knows its slot's entry was never pruned).
pub fn prune(listed: &[(String, Generation, Entry)], keep: usize) -> Vec<Write> {
    let old = listed.len().saturating_sub(keep);
    let mut kept_newer = 0usize;
    let mut prunable = vec![false; listed.len()];
    for (i, (_, _, e)) in listed.iter().enumerate().rev() {
        prunable[i] = i < old && (!is_kept_ahead(e) || kept_newer >= keep);
        if is_kept_ahead(e) {
            kept_newer += 1;
        }
    }
    listed[..old]
        .iter()
        .zip(prunable)
        .filter(|((_, _, e), prunable)| {
            // A requested slot not run yet stays: a requested slot whose entry is gone is dropped unrun.
            *prunable && !matches!(e, Entry::Running { .. } | Entry::Waiting { .. } | Entry::Requested { .. })
        })
        .map(|(l, _)| l)
        .map(|(key, generation, _)| Write {
            key: key.clone(),
            op: WriteOp::Delete,
            precondition: Precondition::Generation(*generation),
        })
        .collect()
}

/// Whether `entry` counts toward the entries newer than a slot that show its entry may have been pruned
/// ([`prune`]): every entry but a missed one. Missed entries are deleted also when a job is taken back from a
/// clock that ran ahead, so counting them, a slot that ran and was pruned could look never pruned.
pub fn is_kept_ahead(entry: &Entry) -> bool {
    !matches!(entry, Entry::Missed { .. })
}
