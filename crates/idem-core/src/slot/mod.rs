//! The slots of `idem once` and their state machine: each scheduled run of a job happens once, whichever
//! machine invokes it.
//!
//! A job `NAME` has, in the store:
//!
//! - its **job record**, `once/NAME/job`: the schedule it was first invoked with (a later invocation with
//!   another is refused: two schedules would key the same run differently) and the latest slot any invocation
//!   has seen, from which the next invocation knows which slots passed unseen;
//! - per slot, its **entry**, `once/NAME/slot/T` (T: the slot's scheduled time in milliseconds since the Unix
//!   epoch, 13 digits, so keys sort by time), kept without expiry (the newest [`HISTORY`] are kept, older
//!   finished ones pruned), and its **lease**, `once/NAME/lease/T`, whose store TTL is the lease length;
//! - the set `once/NAME/ran-more-than-once` of slots whose command ran to a successful end twice (a holder
//!   whose lease was taken over found its success refused): it must stay empty.
//!
//! ```text
//!                          claim: create lease (Absent, TTL = lease), then entry := Running{attempt + 1}
//!   absent | Failed (attempts left) | Running (lease lapsed) | Interrupted ─────────────────────────▶ Running
//!                                                      Running ──done (fenced)──▶ Done
//!                                                      Running ──failed (fenced)─▶ Failed{attempts}
//!                                  Running, stopped by a signal ──failed (fenced)─▶ Failed{exit interrupted}
//!                          Running, its command never started ──given back (fenced)─▶ Interrupted
//!   absent, never started by --starting-deadline, or the slot passed unstarted ──missed (create-only)─▶ Missed
//!   any state but Done/Missed, in a slot older than the job record's newest ─────never claimed (Behind)
//!                                                        lease ──renew (fenced on the lease generation)──▶ lease
//! ```
//!
//! As in the work ledger ([`ledger::Claim`](crate::ledger::Claim)), the lease is a key of its own because it must vanish when
//! its holder dies (the store's clock decides) while the attempt count must survive: attempts are counted when
//! claimed, so a holder killed mid-command still used one. Every write after the claim is conditional on the
//! entry generation the claim wrote (the fencing token) or on the lease's last generation; a holder that was
//! taken over has them refused.
//!
//! The job record's `last_slot_ms` is a high-water mark: it only moves forward, and a slot older than it is
//! never claimed ([`Plan::Behind`]), whatever its entry says. Its time has passed for every invocation
//! whose clock agrees with the one that moved the mark, and its entry may be gone (the history keeps the
//! newest [`HISTORY`] slots, and a gap's older slots are only counted): without the rule an invocation
//! whose clock is behind would find no entry and run a slot that already ran, again on every invocation.
//! Nothing here performs I/O or reads the clock: times are arguments, in
//! milliseconds since the Unix epoch by the store's clock.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, SetChange, Ttl, Versioned};
use serde::{Deserialize, Serialize};

use crate::ledger::RetryLimit;
use crate::{Error, Write, WriteOp};

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

/// The `exit` an attempt stopped by a signal to its invocation is recorded with (a [`Entry::Failed`]).
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
        Self {
            name: name.to_owned(),
            slot_ms,
            entry: format!("{}{slot_ms:013}", slot_prefix(name)),
            lease: format!("{}{slot_ms:013}", lease_prefix(name)),
        }
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
            schedule: self.schedule.clone(),
            last_slot_ms: self.last_slot_ms.max(slot_ms),
            missed_unlisted: self.missed_unlisted.saturating_add(unlisted),
            retries: self.retries,
            missed_capped: self.missed_capped,
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
    /// Invocations came, but none started it (each found an earlier slot still running under `--no-overlap`,
    /// or the store failing); recorded by the first invocation of a later slot.
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
            Entry::Missed { .. } => 0,
        }
    }

    /// Whether nothing will ever change it again (done or missed); a failed slot may still be retried.
    pub fn is_final(&self) -> bool {
        matches!(self, Entry::Done { .. } | Entry::Missed { .. })
    }

    /// How the latest attempt that ended, ended.
    pub fn last_ending(&self) -> Option<&Ending> {
        match self {
            Entry::Failed { ending, .. } | Entry::Done { ending, .. } => Some(ending),
            Entry::Running { last, .. } | Entry::Interrupted { last, .. } => last.as_ref(),
            Entry::Missed { .. } => None,
        }
    }
}

/// What an invocation does about its current slot, judged from the slot's entry and lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Done already (here or elsewhere): nothing to run.
    Done,
    /// Failed on every attempt allowed (or its last attempt crashed with none left): nothing to run.
    FailedForGood,
    /// Recorded missed: nothing to run.
    Missed,
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
        key: keys.entry.clone(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Absent,
    }
}

/// The deletes that keep a job's history to the newest `keep` slots: `listed` are its entries (key,
/// generation, entry) in ascending key order; each older one that is finished (done, failed, missed,
/// interrupted) goes, conditional on its generation so an entry that changed meanwhile stays. A `Running`
/// entry stays: its holder's outcome write is fenced on it. An entry other than a missed one also stays
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
        .filter(|((_, _, e), prunable)| *prunable && !matches!(e, Entry::Running { .. }))
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

/// A claim about to be made on a slot: first [`Claim::lease_write`], then, once the store accepted it,
/// [`Claim::entry_write`]; both accepted make a [`Held`].
#[derive(Clone, Debug)]
pub struct Claim {
    keys: Keys,
    owner: String,
    host: String,
    now_ms: u64,
    lease: Duration,
    /// The entry read before claiming and its generation; the entry write is conditional on it.
    prev: Option<(Generation, Entry)>,
}

impl Claim {
    /// Prepares a claim by `owner` on `host` at `now_ms` (the store's clock) with a lease of `lease` (at
    /// least the store's minimum TTL, 1 s), over the entry `prev` read just before (`None`: no entry).
    pub fn new(
        keys: Keys,
        owner: impl Into<String>,
        host: impl Into<String>,
        now_ms: u64,
        lease: Duration,
        prev: Option<(Generation, Entry)>,
    ) -> Self {
        Self { keys, owner: owner.into(), host: host.into(), now_ms, lease, prev }
    }

    /// The attempt number this claim starts: one more than counted (an interrupted attempt was not).
    pub fn attempt(&self) -> u32 {
        self.prev.as_ref().map_or(1, |(_, e)| e.attempts().saturating_add(1))
    }

    /// Whether this claim creates the slot's entry (none was read): the claim to re-check against the
    /// history once made ([`Held::withdraw`]), since an entry pruned after the read looks the same as one
    /// never written.
    pub fn creates(&self) -> bool {
        self.prev.is_none()
    }

    /// Whether this claim takes over an attempt whose holder vanished (a `Running` entry, its lease lapsed).
    pub fn takes_over(&self) -> bool {
        matches!(self.prev, Some((_, Entry::Running { .. })))
    }

    /// How the last attempt before this claim ended, carried into the entries this claim writes.
    fn last(&self) -> Option<Ending> {
        self.prev.as_ref().and_then(|(_, e)| e.last_ending().cloned())
    }

    /// Step 1: create the lease, only if no live lease exists.
    pub fn lease_write(&self) -> Write {
        Write {
            key: self.keys.lease.clone(),
            op: WriteOp::Put { value: Bytes::from(self.owner.clone()), ttl: Ttl::After(self.lease) },
            precondition: Precondition::Absent,
        }
    }

    /// Step 2, once the lease is held: count the attempt, conditional on the entry being unchanged since read.
    pub fn entry_write(&self) -> Write {
        let entry = Entry::Running {
            owner: self.owner.clone(),
            host: self.host.clone(),
            attempt: self.attempt(),
            started_at_ms: self.now_ms,
            last: self.last(),
        };
        Write {
            key: self.keys.entry.clone(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: match &self.prev {
                Some((g, _)) => Precondition::Generation(*g),
                None => Precondition::Absent,
            },
        }
    }

    /// If the entry write is refused, the lease taken in step 1 is given back with this write.
    pub fn lease_release(&self, lease_generation: Generation) -> Write {
        Write {
            key: self.keys.lease.clone(),
            op: WriteOp::Delete,
            precondition: Precondition::Generation(lease_generation),
        }
    }

    /// The slot held once the store accepted both writes with these generations.
    pub fn acquired(self, lease_generation: Generation, entry_generation: Generation) -> Held {
        let attempt = self.attempt();
        Held { claim: self, attempt, lease_generation, entry_generation }
    }
}

/// What a failed attempt leaves the slot as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Attempts remain: the next invocation in the slot runs it again.
    Retry,
    /// No attempts remain: the slot is failed for good.
    Exhausted,
}

/// A slot held under a live lease. Every write it produces is fenced.
#[derive(Clone, Debug)]
pub struct Held {
    claim: Claim,
    attempt: u32,
    lease_generation: Generation,
    entry_generation: Generation,
}

/// Kept by [`idem_store::LeaseKeeper`] while the command runs.
impl Renewable for Held {
    fn length(&self) -> Duration {
        Held::length(self)
    }

    /// Extend the lease by its length from now (the store's now), only if still held.
    fn renewal(&self) -> Write {
        Write {
            key: self.claim.keys.lease.clone(),
            op: WriteOp::Put { value: Bytes::from(self.claim.owner.clone()), ttl: Ttl::After(self.claim.lease) },
            precondition: Precondition::Generation(self.lease_generation),
        }
    }

    fn renewed(&mut self, lease_generation: Generation) {
        self.lease_generation = lease_generation;
    }

    /// The lease's value is the owner token, unique to one invocation.
    fn is_mine(&self, current: &Versioned) -> bool {
        current.value().as_ref() == self.claim.owner.as_bytes()
    }
}

impl Held {
    /// The lease length.
    pub fn length(&self) -> Duration {
        self.claim.lease
    }

    /// The fencing token: the entry generation the claim wrote, larger than every earlier holder's.
    pub fn fencing_token(&self) -> Generation {
        self.entry_generation
    }

    /// This attempt's number (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The slot's keys.
    pub fn keys(&self) -> &Keys {
        &self.claim.keys
    }

    /// When the claim was made, by the store's clock.
    pub fn started_at_ms(&self) -> u64 {
        self.claim.now_ms
    }

    /// Give the lease back (after done, failed or interrupted), only if still held.
    pub fn release(&self) -> Write {
        self.claim.lease_release(self.lease_generation)
    }

    /// Record the slot done, only if no one took it over.
    pub fn done(&self, ending: Ending) -> Write {
        self.entry(Entry::Done {
            attempts: self.attempt,
            owner: self.claim.owner.clone(),
            host: self.claim.host.clone(),
            started_at_ms: self.claim.now_ms,
            ending,
        })
    }

    /// Record a failed attempt, only if no one took it over; says whether the slot may run again under `limit`.
    pub fn failed(&self, ending: Ending, limit: RetryLimit) -> (Write, Failure) {
        let verdict = if self.attempt >= limit.max_attempts { Failure::Exhausted } else { Failure::Retry };
        let entry = Entry::Failed {
            attempts: self.attempt,
            host: self.claim.host.clone(),
            started_at_ms: self.claim.now_ms,
            ending,
        };
        (self.entry(entry), verdict)
    }

    /// Give back an attempt whose command never started, only if no one took it over: not counted. (One
    /// whose command started and was stopped by a signal is [`Held::failed`] with [`INTERRUPTED_EXIT`].)
    pub fn interrupted(&self, now_ms: u64) -> Write {
        self.entry(Entry::Interrupted {
            owner: self.claim.owner.clone(),
            host: self.claim.host.clone(),
            attempt: self.attempt,
            interrupted_at_ms: now_ms,
            last: self.claim.last(),
        })
    }

    /// Delete the entry this claim created, only if no one changed it since: for a claim found, once made, on
    /// a slot whose entry may have been pruned from the history meanwhile (its claim's read of "no entry" was
    /// stale), which therefore must not run.
    pub fn withdraw(&self) -> Write {
        Write {
            key: self.claim.keys.entry.clone(),
            op: WriteOp::Delete,
            precondition: Precondition::Generation(self.entry_generation),
        }
    }

    fn entry(&self, entry: Entry) -> Write {
        Write {
            key: self.claim.keys.entry.clone(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: Precondition::Generation(self.entry_generation),
        }
    }
}

#[cfg(test)]
mod tests;
