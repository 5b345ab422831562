//! What a job's operators and its overlap policy decide beyond the schedule: the [`Overlap`] policy and what it
//! does when an earlier slot still runs ([`overlap`]), a [`Pause`], and the keys of runs requested outside the
//! schedule ([`Keys::trigger`]). Pure: times are arguments, by the store's clock.

use bytes::Bytes;
use idem_store::{Generation, Precondition, Ttl};
use serde::{Deserialize, Serialize};

use super::{Entry, Keys};
use crate::ledger::RetryLimit;
use crate::{Error, Write, WriteOp};

/// What a slot does when it comes while an earlier slot of the job still runs (`--overlap`). Named as
/// Temporal's `ScheduleOverlapPolicy`; [`Overlap::kubernetes`] gives Kubernetes' `concurrencyPolicy` where it
/// has one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overlap {
    /// Run it beside the earlier one (the default; Kubernetes `Allow`).
    #[default]
    Allow,
    /// Do not start it while the earlier one runs: it is recorded skipped, and a later invocation in the slot
    /// (within `--starting-deadline`) still starts it once that ended (Kubernetes `Forbid`; `--no-overlap`).
    Skip,
    /// Its invocation waits (holding the slot's lease, nothing else) until the earlier one ended, then runs it;
    /// a slot that comes while one is already waiting is recorded skipped.
    BufferOne,
    /// Every slot's invocation waits its turn, in slot order.
    BufferAll,
    /// The new slot's invocation asks the running slot's holder, on whatever machine, to stop its command
    /// (SIGTERM to its process group, SIGKILL a lease later if it still runs), waits for it to end, then runs
    /// (Temporal `CANCEL_OTHER`, Kubernetes `Replace`). The stopped slot is recorded replaced.
    CancelOther,
    /// As [`Overlap::CancelOther`], but the command is killed at once (SIGKILL; Temporal `TERMINATE_OTHER`).
    TerminateOther,
}

/// The `earlier_ms` of a slot recorded [`Entry::Skipped`] (or of a plan made) because a triggered run of the
/// job was going on, not an earlier slot.
pub const TRIGGERED_AHEAD: u64 = u64::MAX;

impl Overlap {
    /// Every policy, for messages and the documentation's table.
    pub const ALL: [Overlap; 6] = [
        Overlap::Allow,
        Overlap::Skip,
        Overlap::BufferOne,
        Overlap::BufferAll,
        Overlap::CancelOther,
        Overlap::TerminateOther,
    ];

    /// Parses `--overlap`'s value (`allow`, `skip`, `buffer-one`, `buffer-all`); `None` for another.
    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == value)
    }

    /// The name `--overlap` takes and the job record keeps.
    pub fn name(self) -> &'static str {
        match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
            Overlap::BufferOne => "buffer-one",
            Overlap::BufferAll => "buffer-all",
            Overlap::CancelOther => "cancel-other",
            Overlap::TerminateOther => "terminate-other",
        }
    }

    /// Temporal's name for it (`SCHEDULE_OVERLAP_POLICY_…`).
    pub fn temporal(self) -> &'static str {
        match self {
            Overlap::Allow => "ALLOW_ALL",
            Overlap::Skip => "SKIP",
            Overlap::BufferOne => "BUFFER_ONE",
            Overlap::BufferAll => "BUFFER_ALL",
            Overlap::CancelOther => "CANCEL_OTHER",
            Overlap::TerminateOther => "TERMINATE_OTHER",
        }
    }

    /// Kubernetes' `concurrencyPolicy` for it, where a CronJob has one.
    pub fn kubernetes(self) -> Option<&'static str> {
        match self {
            Overlap::Allow => Some("Allow"),
            Overlap::Skip => Some("Forbid"),
            // A Job deleted by Replace has its pods sent SIGTERM, then SIGKILL after their grace period.
            Overlap::CancelOther => Some("Replace"),
            Overlap::BufferOne | Overlap::BufferAll | Overlap::TerminateOther => None,
        }
    }

    /// Whether a running slot is stopped when a later one comes ([`Overlap::CancelOther`],
    /// [`Overlap::TerminateOther`]).
    pub fn replaces(self) -> bool {
        matches!(self, Overlap::CancelOther | Overlap::TerminateOther)
    }
}

/// What a slot's invocation does under its job's policy, judged by [`overlap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverlapPlan {
    /// No earlier slot is in the way: run.
    Run,
    /// Do not start now (`skip`): give the claim back; a later invocation in the slot may start it.
    GiveBack {
        /// The earliest slot still running.
        earlier_ms: u64,
    },
    /// Keep waiting under the slot's lease (`buffer-one`, `buffer-all`) and judge again.
    Wait {
        /// The slot waited for: the latest of those ahead.
        earlier_ms: u64,
    },
    /// Record the slot skipped (`buffer-one`: another slot already waits ahead of it).
    RecordSkipped {
        /// The slot waiting ahead of it.
        earlier_ms: u64,
    },
    /// Ask every slot ahead to stop ([`stop_key`]; `cancel-other`, `terminate-other`), then wait as
    /// [`OverlapPlan::Wait`] and judge again.
    Replace {
        /// The latest of those ahead.
        earlier_ms: u64,
    },
}

/// Judges a slot whose lease this invocation holds, by `ahead`: the earlier slots of the job whose lease is live
/// (running, or waiting under `buffer-*`), ascending. Only earlier slots count, so of two slots that both took
/// their lease the later one yields, whichever looked first: two slots never both go on.
pub fn overlap(policy: Overlap, ahead: &[u64]) -> OverlapPlan {
    let (Some(&first), Some(&last)) = (ahead.first(), ahead.last()) else { return OverlapPlan::Run };
    match policy {
        Overlap::Allow => OverlapPlan::Run,
        Overlap::Skip => OverlapPlan::GiveBack { earlier_ms: first },
        // One runs and one waits already: this one is the second in the buffer.
        Overlap::BufferOne if ahead.len() >= 2 => OverlapPlan::RecordSkipped { earlier_ms: last },
        Overlap::BufferOne | Overlap::BufferAll => OverlapPlan::Wait { earlier_ms: last },
        Overlap::CancelOther | Overlap::TerminateOther => OverlapPlan::Replace { earlier_ms: last },
    }
}

/// The prefix of a job's stop requests (`once/NAME/stop/T`, T as in [`slot_prefix`](super::slot_prefix)):
/// under `cancel-other` and `terminate-other` a later slot's invocation puts the key of each slot ahead of it,
/// holding its own slot's time; the holder of that slot, on whatever machine, reads it while its command runs
/// (at once, then every third of a lease) and stops the command.
pub fn stop_prefix(name: &str) -> String {
    format!("once/{name}/stop/")
}

/// The stop request's key for the slot of `keys`.
pub fn stop_key(keys: &Keys) -> String {
    format!("{}{:013}", stop_prefix(keys.name()), keys.slot_ms())
}

/// The pause record's store key.
pub fn pause_key(name: &str) -> String {
    format!("once/{name}/pause")
}

/// The prefix of a job's trigger entries (runs requested outside the schedule), by id.
pub fn trigger_prefix(name: &str) -> String {
    format!("once/{name}/trigger/")
}

/// The prefix of a job's trigger leases (not under [`lease_prefix`](super::lease_prefix): a triggered run is
/// not a slot, and the overlap policy does not wait for it).
pub fn trigger_lease_prefix(name: &str) -> String {
    format!("once/{name}/trigger-lease/")
}

/// The prefix of a job's requested slots (`once/NAME/requested/T`, T as in [`slot_prefix`](super::slot_prefix)):
/// slots older than the job's newest that a backfill (`idem once backfill`) or a catch-up (`--catchup-window`)
/// asked to run. A slot older than the job's newest is otherwise never claimed ([`Plan::Behind`](super::Plan::Behind));
/// one listed here is, by the invocations' pass over this prefix, until its entry is final (then its key is
/// deleted). The slot's entry is written first ([`Entry::Requested`](super::Entry::Requested), or kept when it
/// is failed or given back), then this key: a key whose entry is absent stands for a slot whose entry the
/// history pruned, and is dropped, never run.
pub fn requested_prefix(name: &str) -> String {
    format!("once/{name}/requested/")
}

/// Why a slot older than the job's newest was requested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestKind {
    /// `idem once backfill`.
    Backfill,
    /// The invocation that found it passed unseen within `--catchup-window`.
    CatchUp,
}

impl RequestKind {
    /// The name messages and `status` use.
    pub fn name(self) -> &'static str {
        match self {
            RequestKind::Backfill => "backfill",
            RequestKind::CatchUp => "catch-up",
        }
    }
}

/// The key of a requested slot ([`requested_prefix`]) and its value.
pub fn request_key(keys: &Keys) -> String {
    format!("{}{:013}", requested_prefix(keys.name()), keys.slot_ms())
}

/// The value of a requested slot's key: why, and who asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Why.
    pub kind: RequestKind,
    /// Who asked (`user@host`).
    pub by: String,
}

impl Request {
    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Request::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a request.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }
}

/// Whether `id` may name a trigger: 1 to 100 ASCII letters, digits, `.`, `_`, `-`, the first a letter or a
/// digit (it is part of a store key, and `..` or `-x` would read as something else).
pub fn is_trigger_id(id: &str) -> bool {
    (1..=100).contains(&id.len())
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Keys {
    /// The keys of the run of job `name` requested with trigger `id` ([`is_trigger_id`]) at `at_ms`: its
    /// entry `once/NAME/trigger/ID` and lease `once/NAME/trigger-lease/ID`; claimed, fenced and recorded as a
    /// slot's are, and named by `at_ms` in the counted sets.
    pub fn trigger(name: &str, id: &str, at_ms: u64) -> Self {
        Self::with(name, at_ms, format!("{}{id}", trigger_prefix(name)), format!("{}{id}", trigger_lease_prefix(name)))
    }
}

/// A job paused by an operator (`idem once pause`): no slot starts while it holds ([`Pause::holds_at`]); each
/// slot an invocation comes for meanwhile is recorded [`Entry::Paused`](super::Entry::Paused).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pause {
    /// Who paused it (`user@host`).
    pub by: String,
    /// Why, as they said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// When, by the store's clock, in milliseconds since the Unix epoch.
    pub since_ms: u64,
    /// When it ends by itself (`--until`); `None`: until resumed. `idem once resume` sets it to the time it
    /// resumed, so the record says when the last pause was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    /// Who resumed it, when it was resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_by: Option<String>,
}

impl Pause {
    /// Whether the job is paused at `now_ms`.
    pub fn holds_at(&self, now_ms: u64) -> bool {
        self.until_ms.is_none_or(|until| now_ms < until)
    }

    /// The record once resumed by `by` at `now_ms` (kept, not deleted: `status` says when the last pause was).
    #[must_use]
    pub fn resumed(&self, by: &str, now_ms: u64) -> Self {
        let until = self.until_ms.map_or(now_ms, |u| u.min(now_ms));
        Self { until_ms: Some(until), resumed_by: Some(by.to_owned()), ..self.clone() }
    }

    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Pause::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a pause record.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }
}

/// The write that records the slot of `keys` paused under `pause`: create-only, as [`missed`](super::missed),
/// so a claim that came first wins.
pub fn paused(keys: &Keys, pause: &Pause, now_ms: u64) -> Write {
    let entry = Entry::Paused { by: pause.by.clone(), note: pause.note.clone(), recorded_at_ms: now_ms };
    create(keys, &entry)
}

/// The write that requests a run outside the schedule (`idem once trigger`) under the trigger's `keys`
/// ([`Keys::trigger`]): create-only, so a request retried with the same id is one run.
pub fn requested(keys: &Keys, by: &str, at_ms: u64) -> Write {
    create(keys, &Entry::Requested { by: by.to_owned(), at_ms })
}

/// What a backfill or a catch-up does to a slot before it writes the slot's request key ([`request_key`]).
#[derive(Clone, Debug, PartialEq)]
pub enum RequestPlan {
    /// Apply this write to the entry ([`Entry::Requested`]: create-only when absent, fenced on the generation
    /// when missed, paused or skipped), then write the key.
    Entry(Write),
    /// Write the key alone: the entry stays as it is (failed with attempts left, given back, crashed or
    /// requested already) and the requested slots' pass runs it again.
    KeyOnly,
    /// Nothing: the slot is done, failed for good, or waited for by a live invocation; said in words.
    Nothing(&'static str),
}

/// Judges a slot for a backfill or a catch-up from its entry (`None`: absent; the caller has checked that it
/// was not pruned). `limit`: the job's attempts allowed; `by`, `at_ms`: who asks, and when.
pub fn request(
    keys: &Keys,
    entry: Option<(Generation, &Entry)>,
    limit: RetryLimit,
    by: &str,
    at_ms: u64,
) -> RequestPlan {
    let requested = Entry::Requested { by: by.to_owned(), at_ms };
    match entry {
        None => RequestPlan::Entry(create(keys, &requested)),
        Some((g, Entry::Missed { .. } | Entry::Paused { .. } | Entry::Skipped { .. })) => RequestPlan::Entry(Write {
            key: keys.entry().to_owned(),
            op: WriteOp::Put { value: requested.encode(), ttl: Ttl::Clear },
            precondition: Precondition::Generation(g),
        }),
        Some((_, Entry::Done { .. })) => RequestPlan::Nothing("done"),
        Some((_, e @ (Entry::Failed { .. } | Entry::Running { .. }))) if e.attempts() >= limit.max_attempts => {
            RequestPlan::Nothing("failed for good")
        }
        Some((_, Entry::Waiting { .. })) => RequestPlan::Nothing("waiting to run"),
        Some((_, _)) => RequestPlan::KeyOnly,
    }
}

fn create(keys: &Keys, entry: &Entry) -> Write {
    Write {
        key: keys.entry().to_owned(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Absent,
    }
}
