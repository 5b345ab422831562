//! What the store keeps of a job and of each of its slots (JSON): the job record, a slot's entry, and how
//! an attempt ended.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::HISTORY;
#[cfg(doc)]
use super::INTERRUPTED_EXIT;
use crate::Error;

/// The job record: what every invocation of the job must agree on, and how far they have come.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// The schedule in canonical form (`every 3600s`, `cron 0 2 * * * tz Europe/Berlin`).
    pub schedule: String,
    /// The latest slot any invocation has seen as its current one, in milliseconds since the Unix epoch.
    pub last_slot_ms: u64,
    /// Missed slots without an entry: slots that passed unseen but were too many to record one by one (only
    /// the newest [`HISTORY`] of a gap are), and slots recorded missed whose entry was pruned from the history
    /// since (so the job's missed total is this plus its missed entries).
    #[serde(default)]
    pub missed_unlisted: u64,
    /// `--retries` as the job was first invoked with (or, for a record written before it was kept, first
    /// invoked with since): every invocation must give it, as the schedule, else a slot's attempts would be
    /// judged against two limits and "failed for good" (exit 3) would hold on one machine, not another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
    /// `missed_unlisted` is a lower bound: a gap of a cron schedule had more slots than are counted one by one
    /// (1,000,000).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub missed_capped: bool,
    /// `--overlap` as the job was first invoked with ([`Overlap::name`](super::Overlap::name)); `None` in a
    /// record written before the policy was kept (read as `allow`, and set by the next invocation). Every
    /// invocation must give the same, as the schedule: with two policies one machine would wait for a slot
    /// another stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<String>,
    /// The newest slot whose entry the history prune deleted (or was about to: it is written before the
    /// deletes), in milliseconds since the Unix epoch: a backfill does not request a slot at or before it whose
    /// entry is absent, since that slot may have run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pruned_through_ms: Option<u64>,
    /// `--jitter` in milliseconds as the job was first invoked with (0: none). Every invocation must give the
    /// same, else machines would compute different start times for one slot.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub jitter_ms: u64,
    /// `--catchup-window` in milliseconds as the job was first invoked with (0: none). Every invocation must
    /// give the same, else one machine would record missed the slots another runs late.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub catchup_window_ms: u64,
    /// When the job's newest successful run (a slot's, a requested slot's or a triggered run's) ended, in
    /// milliseconds since the Unix epoch by the store's clock: kept here, not only in the slots' entries, so
    /// it outlives a history of [`HISTORY`] failures. Moved only forward, best effort (a store failing just
    /// after the run leaves it behind; the entries still say the slot is done).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_success_ms: Option<u64>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Job {
    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Job::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a job record.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }

    /// The record after an invocation saw `slot_ms` as current, with `unlisted` more slots missed than it
    /// recorded one by one. A slot older than the recorded one leaves it as it is (the clock read came late).
    #[must_use]
    pub fn advanced(&self, slot_ms: u64, unlisted: u64) -> Self {
        Self {
            last_slot_ms: self.last_slot_ms.max(slot_ms),
            missed_unlisted: self.missed_unlisted.saturating_add(unlisted),
            ..self.clone()
        }
    }
}

/// How an attempt ended, as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    /// `exit N`, `signal N`, `timeout`, or `cannot start: …`.
    pub exit: String,
    /// The exit code when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// How long the attempt ran, in milliseconds.
    pub duration_ms: u64,
    /// When it ended, in milliseconds since the Unix epoch by the store's clock (the start plus the duration
    /// measured on the holder's monotonic clock).
    pub finished_at_ms: u64,
    /// The last lines of its standard output and error, interleaved as they came (bounded by the caller).
    #[serde(default)]
    pub output: Vec<String>,
}

/// Why a slot was recorded missed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum MissedReason {
    /// No invocation came while it was the current slot; recorded by the next one that came.
    NoInvocation,
    /// Invocations came, but none started it (the store failing, say; one that found an earlier slot running
    /// under `--overlap skip` recorded it skipped); recorded by the first invocation of a later slot.
    NotStarted,
    /// The first invocation that could start it came later than `--starting-deadline` after its time.
    PastDeadline {
        /// When that invocation came, by the store's clock, in milliseconds since the Unix epoch.
        came_at_ms: u64,
    },
}

/// What the store knows about one slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Entry {
    /// Claimed by `owner`; the slot's lease key says whether the claim is still live.
    Running {
        /// The claimant's owner token (unique per process start).
        owner: String,
        /// The claimant's host name.
        host: String,
        /// The number of this attempt (1 for the first): attempts are counted when claimed.
        attempt: u32,
        /// When it was claimed, by the store's clock.
        started_at_ms: u64,
        /// How the attempt before it ended, if one failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last: Option<Ending>,
    },
    /// The last attempt failed; the next invocation in the slot runs it again while attempts remain.
    Failed {
        /// Attempts claimed so far.
        attempts: u32,
        /// Where the last attempt ran.
        host: String,
        /// When the last attempt started, by the store's clock.
        started_at_ms: u64,
        /// How it ended.
        ending: Ending,
    },
    /// An attempt claimed whose command never started (the fence before the start refused: its holder was
    /// paused past its lease, or the store failed) was given back: not counted, so the next invocation in the
    /// slot runs it again. (An attempt whose command had started and was stopped by a signal to its
    /// invocation counts: it is recorded [`Entry::Failed`] with the exit [`INTERRUPTED_EXIT`].)
    Interrupted {
        /// Who ran it.
        owner: String,
        /// Where it ran.
        host: String,
        /// The number it ran as; the next claim runs as this number again.
        attempt: u32,
        /// When it was given back, by the store's clock.
        interrupted_at_ms: u64,
        /// How the attempt before it ended, if one failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last: Option<Ending>,
    },
    /// Done: an attempt's command exited 0 and its holder still held the lease when it recorded so.
    Done {
        /// Attempts it took.
        attempts: u32,
        /// Who ran the successful attempt.
        owner: String,
        /// Where it ran.
        host: String,
        /// When the successful attempt started, by the store's clock.
        started_at_ms: u64,
        /// How it ended (exit 0).
        ending: Ending,
    },
    /// Created by an invocation that waits, under the slot's lease, for an earlier slot of the job to end
    /// before it runs this one (`--overlap buffer-one` or `buffer-all`, [`Overlap`](super::Overlap)): no
    /// attempt counted. Its lease says whether the waiter is alive; one whose lease lapsed is claimed afresh.
    Waiting {
        /// The waiter's owner token.
        owner: String,
        /// The waiter's host name.
        host: String,
        /// When it began to wait, by the store's clock.
        since_ms: u64,
    },
    /// A run requested by `idem once trigger` (the entry of a trigger key, [`Keys::trigger`](super::Keys::trigger)),
    /// or a slot requested by a backfill or a catch-up ([`requested_prefix`](super::requested_prefix)), not run
    /// yet: the next invocation of the job, on any machine, claims and runs it.
    Requested {
        /// Who asked (`user@host`).
        by: String,
        /// When, by the store's clock.
        at_ms: u64,
    },
    /// Not run because the job was paused when an invocation came for it ([`Pause`](super::Pause)); a later
    /// invocation in the slot, within `--starting-deadline`, runs it once the pause ended (as Kubernetes runs
    /// a suspended CronJob's missed schedule on resume).
    Paused {
        /// Who paused the job (`user@host`).
        by: String,
        /// Why, as they said.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        /// When it was recorded, by the store's clock.
        recorded_at_ms: u64,
    },
    /// Not run under the job's overlap policy: `buffer-one`, another slot was already waiting for the same
    /// running one (never run); `skip`, an earlier slot (or a triggered run,
    /// [`TRIGGERED_AHEAD`](super::TRIGGERED_AHEAD)) was running when an invocation came (a later invocation
    /// in the slot, within `--starting-deadline`, still starts it).
    Skipped {
        /// The policy's name.
        policy: String,
        /// The slot that ran (or waited) ahead of it, in milliseconds since the Unix epoch.
        earlier_ms: u64,
        /// When it was recorded, by the store's clock.
        recorded_at_ms: u64,
    },
    /// Never run, and never will be.
    Missed {
        /// Why.
        #[serde(flatten)]
        reason: MissedReason,
        /// When it was recorded, by the store's clock.
        recorded_at_ms: u64,
    },
}

impl Entry {
    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Entry::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a slot entry.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }

    /// Attempts counted so far (an interrupted one is not).
    pub fn attempts(&self) -> u32 {
        match self {
            Entry::Running { attempt, .. } => *attempt,
            Entry::Interrupted { attempt, .. } => attempt.saturating_sub(1),
            Entry::Failed { attempts, .. } | Entry::Done { attempts, .. } => *attempts,
            Entry::Missed { .. }
            | Entry::Waiting { .. }
            | Entry::Requested { .. }
            | Entry::Paused { .. }
            | Entry::Skipped { .. } => 0,
        }
    }

    /// Whether nothing will ever change it again (done, missed, paused or skipped); a failed slot may still be
    /// retried.
    pub fn is_final(&self) -> bool {
        matches!(self, Entry::Done { .. } | Entry::Missed { .. } | Entry::Paused { .. } | Entry::Skipped { .. })
    }

    /// How the latest attempt that ended, ended.
    pub fn last_ending(&self) -> Option<&Ending> {
        match self {
            Entry::Failed { ending, .. } | Entry::Done { ending, .. } => Some(ending),
            Entry::Running { last, .. } | Entry::Interrupted { last, .. } => last.as_ref(),
            Entry::Missed { .. }
            | Entry::Waiting { .. }
            | Entry::Requested { .. }
            | Entry::Paused { .. }
            | Entry::Skipped { .. } => None,
        }
    }
}
