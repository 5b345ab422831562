//! The store keys of a job and of its slots, and the constants every invocation of a job agrees on.

use idem_store::SetChange;

/// How many slots of a job are kept: older finished entries are pruned when a new slot is claimed.
pub const HISTORY: usize = 100;

/// The job record's store key.
pub fn job_key(name: &str) -> String {
    format!("once/{name}/job")
}

/// The prefix of a job's slot entries: list it for the job's history, oldest first.
pub fn slot_prefix(name: &str) -> String {
    format!("once/{name}/slot/")
}

/// The prefix of a job's leases: a live key under it is a slot running now.
pub fn lease_prefix(name: &str) -> String {
    format!("once/{name}/lease/")
}

/// The set of slots (their times in milliseconds, as decimal strings) that ran to a successful end more than
/// once.
pub fn repeats_key(name: &str) -> String {
    format!("once/{name}/ran-more-than-once")
}

/// The set of slots (as [`repeats_key`]'s) where a claim took over an attempt whose holder vanished with its
/// lease lapsed (killed, or cut off for a whole lease) after its claim: that holder's command may have run,
/// even to its end, so the slot may have run more than once (at-least-once; `idem once` cannot know).
pub fn takeovers_key(name: &str) -> String {
    format!("once/{name}/taken-over")
}

/// The set of attempts (`T-N`: slot time in milliseconds, attempt number) whose command had started when a
/// signal to their invocation (SIGINT, SIGTERM) stopped it: each counted toward `--retries` as a failure, as
/// Kubernetes counts a Job's pod that was killed among its failed pods.
pub fn interrupted_key(name: &str) -> String {
    format!("once/{name}/interrupted")
}

/// The set of slots (as [`repeats_key`]'s) an invocation found older than the job's newest slot and so never
/// claimed (a clock behind the one that moved the job record, within [`FUTURE_TOLERANCE_MS`]).
pub fn behind_key(name: &str) -> String {
    format!("once/{name}/behind")
}

/// How far the job record's newest slot may be ahead of an invocation's clock (the store's) and still hold it
/// back, in milliseconds: 60 s. A newest slot further ahead was recorded by a clock that ran ahead (a machine's
/// clock jumped forward, on a SQLite file each machine reads with its own clock), or this clock is behind by
/// more than any synchronised clock is: the invocation's clock wins, the job record is taken back to its
/// slot, and the missed entries recorded ahead of it are deleted (a slot that ran ahead keeps its entry).
pub const FUTURE_TOLERANCE_MS: u64 = 60_000;

/// How the `exit` of an attempt stopped for a later slot (`--overlap cancel-other`, `terminate-other`) begins,
/// recorded in a [`Entry::Failed`](super::Entry::Failed): `replaced by SLOT (HOW)`.
pub const REPLACED_EXIT: &str = "replaced by ";

/// The `exit` an attempt stopped by a signal to its invocation is recorded with (a [`Entry::Failed`](super::Entry::Failed)).
pub const INTERRUPTED_EXIT: &str = "interrupted";

/// The slot time a key under [`slot_prefix`] or [`lease_prefix`] names.
pub fn slot_of_key(key: &str) -> Option<u64> {
    key.rsplit('/').next()?.parse().ok()
}

/// The store keys of one slot of one job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Keys {
    name: String,
    slot_ms: u64,
    entry: String,
    lease: String,
}

impl Keys {
    /// The keys of the slot scheduled at `slot_ms` (milliseconds since the Unix epoch) of job `name`.
    pub fn new(name: &str, slot_ms: u64) -> Self {
        Self::with(
            name,
            slot_ms,
            format!("{}{slot_ms:013}", slot_prefix(name)),
            format!("{}{slot_ms:013}", lease_prefix(name)),
        )
    }

    /// Keys with the given entry and lease keys (a triggered run's, [`Keys::trigger`]).
    pub(super) fn with(name: &str, slot_ms: u64, entry: String, lease: String) -> Self {
        Self { name: name.to_owned(), slot_ms, entry, lease }
    }

    /// The entry's store key.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The lease's store key.
    pub fn lease(&self) -> &str {
        &self.lease
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The slot's scheduled time, in milliseconds since the Unix epoch.
    pub fn slot_ms(&self) -> u64 {
        self.slot_ms
    }

    /// Records that this slot's command ran to a successful end once more than the entry shows: a
    /// [`Store::set_change`](idem_store::Store::set_change) on [`repeats_key`] (a retried write counts once: a
    /// set has each member once). `_owner`: the holder, kept for callers.
    pub fn ran_again(&self, _owner: &str) -> (String, SetChange) {
        (repeats_key(&self.name), self.member())
    }
}

impl Keys {
    /// Records that a claim on this slot took over a vanished holder's attempt: a
    /// [`Store::set_change`](idem_store::Store::set_change) on [`takeovers_key`]. `_owner`: the new holder.
    pub fn took_over(&self, _owner: &str) -> (String, SetChange) {
        (takeovers_key(&self.name), self.member())
    }

    /// Records that attempt `attempt` of this slot was stopped by a signal to its invocation after its
    /// command started: a [`Store::set_change`](idem_store::Store::set_change) on [`interrupted_key`], one
    /// member per attempt (a retried write counts once).
    pub fn interrupted(&self, attempt: u32) -> (String, SetChange) {
        let member = format!("{}-{attempt}", self.slot_ms);
        (interrupted_key(&self.name), SetChange { add: vec![member], remove: Vec::new(), dedupe_id: None })
    }

    /// Records that an invocation found this slot behind the job's newest: a
    /// [`Store::set_change`](idem_store::Store::set_change) on [`behind_key`].
    pub fn behind(&self) -> (String, SetChange) {
        (behind_key(&self.name), self.member())
    }

    /// Adds this slot to a set. No dedupe id: adding a member twice leaves one member already, and a dedupe id
    /// would leave a record `forget` cannot delete (kept for the store's dedupe retention).
    fn member(&self) -> SetChange {
        SetChange { add: vec![self.slot_ms.to_string()], remove: Vec::new(), dedupe_id: None }
    }
}
