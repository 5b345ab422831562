//! The work ledger of `idem run` and its state machine: which items ran, who holds one now, and what each
//! attempt ended as.
//!
//! Each work item has two store keys:
//!
//! - its **entry**, `run/{job}/item/{id}`, kept without expiry: who ran it, how many attempts were claimed,
//!   the fingerprints of its failures and, once done, the SHA-256 of its output;
//! - its **lease**, `run/{job}/lease/{id}`, whose store TTL is the lease length.
//!
//! The lease is a separate key because a lapsed lease must disappear (the store's clock decides, a lapsed key
//! reads as absent and the next create takes it over) while the attempt count must survive a crashed holder:
//! attempts are counted just before the command starts ([`Held::count`]), so a runner killed mid-item still
//! used up one, and an item claimed ahead of a free slot and never started (the run stopped, or the store was
//! unreachable past the limit so the claim could not be given back) spent none: its lease simply lapses.
//!
//! ```text
//!            claim: create lease (Absent, TTL = lease); just before the command starts: count,
//!                   entry := Running{attempt + 1} (fenced on the entry read before the claim)
//!   absent | Failed | Running(lapsed) | Done(output gone) ──────────────────────────────▶ Running
//!                                                    Running ──done (fenced)──▶ Done{sha256}
//!                                                    Running ──failed (fenced)─▶ Failed{fingerprints}
//!                       Running, command never started ──unclaim (fenced)─▶ the entry before the claim
//!                          claimed, not counted, not started ──release the lease──▶ (entry untouched)
//!                     Running, command started, stopped ──interrupted (fenced)─▶ Interrupted{attempt}
//!                                                    lease ──renew (fenced on the lease generation)──▶ lease
//! ```
//!
//! Only an item without an entry may have a file at its final path **adopted** (recorded done without running):
//! every entry says that an attempt ran or may have run, and a command may write its final path itself, so a
//! file there after a crash (a lapsed `Running`), a failure (`Failed`) or an interruption (`Interrupted`) is
//! never taken for its output; the item runs again and its new, verified output replaces the file. That is why
//! an attempt whose command started is given back as [`Entry::Interrupted`], never by removing the entry.
//!
//! Every write after the claim is conditional: the entry on the generation the claim gave it (the **fencing
//! token**, handed to the command as `IDEM_FENCING_TOKEN`), the lease on its own last generation. A runner that
//! was taken over finds its writes refused. Nothing here performs I/O or reads the clock.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, Ttl, Versioned};
use serde::{Deserialize, Serialize};

use crate::{Error, Write, WriteOp};

/// The store keys of one item of one job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Keys {
    entry: String,
    lease: String,
}

impl Keys {
    /// The keys of item `id` of job `job` (a short hash naming the job, so two jobs share a store safely).
    pub fn new(job: &str, id: &str) -> Self {
        Self { entry: format!("{}{id}", entry_prefix(job)), lease: format!("run/{job}/lease/{id}") }
    }

    /// The entry's store key.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The lease's store key.
    pub fn lease(&self) -> &str {
        &self.lease
    }
}

/// The prefix under which a job's entries live: list it to see every item the ledger knows.
pub fn entry_prefix(job: &str) -> String {
    format!("run/{job}/item/")
}

/// What the ledger knows about one item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Entry {
    /// Claimed by `owner`; the item's lease key says whether the claim is still live.
    Running {
        /// The claimant's owner token (unique per process start).
        owner: String,
        /// The number of this attempt (1 for the first): attempts are counted when claimed.
        attempt: u32,
        /// When it was claimed, in milliseconds since the Unix epoch (informational).
        started_at_ms: u64,
        /// Error fingerprints of the earlier failed attempts, oldest first.
        #[serde(default)]
        failures: Vec<String>,
        /// The last error message, if an earlier attempt failed.
        #[serde(default)]
        last_error: Option<String>,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// The last attempt failed.
    Failed {
        /// Attempts claimed so far.
        attempts: u32,
        /// Error fingerprints of every failed attempt, oldest first.
        failures: Vec<String>,
        /// The last attempt's error, for people.
        last_error: String,
        /// True when one fingerprint occurred twice: a poison item, never retried until forgotten.
        poison: bool,
        /// When it failed, in milliseconds since the Unix epoch.
        finished_at_ms: u64,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// An attempt whose command started was stopped by the operator (a second Ctrl-C, or SIGTERM) and given
    /// back. It is not counted (an interruption is not the item's failure, so even with no retries left the
    /// item runs again), but it is remembered: the command may have written the item's final path itself, so
    /// a file there is never adopted.
    Interrupted {
        /// Who ran the interrupted attempt (its temporary file is named after the owner and the attempt).
        owner: String,
        /// The number the interrupted attempt ran as; it was not counted, so the next claim runs as this
        /// number again.
        attempt: u32,
        /// When it was given back, in milliseconds since the Unix epoch.
        interrupted_at_ms: u64,
        /// Error fingerprints of the earlier failed attempts, oldest first.
        #[serde(default)]
        failures: Vec<String>,
        /// The last error message, if an earlier attempt failed.
        #[serde(default)]
        last_error: Option<String>,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
    /// Finished: the output was verified, renamed into place and has this digest.
    Done {
        /// Attempts it took.
        attempts: u32,
        /// Lowercase hex SHA-256 of the output file.
        sha256: String,
        /// The output's length, in bytes.
        size: u64,
        /// Who finished it (`adopted` when an existing output was taken over without running).
        owner: String,
        /// When it finished, in milliseconds since the Unix epoch.
        finished_at_ms: u64,
        /// How long the successful attempt ran, in milliseconds.
        duration_ms: u64,
        /// Lowercase hex SHA-256 of the item's text as read (a message body, an items line), when the writer
        /// recorded it (entries written before it was recorded lack it, and are not compared).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        item_sha256: Option<String>,
    },
}

impl Entry {
    /// Encodes as stored (JSON).
    pub fn encode(&self) -> Bytes {
        // Serialising strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes what [`Entry::encode`] wrote.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a ledger entry.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::RecordCorrupt { reason: e.to_string() })
    }

    /// Attempts claimed so far.
    pub fn attempts(&self) -> u32 {
        match self {
            Entry::Running { attempt, .. } => *attempt,
            Entry::Interrupted { attempt, .. } => attempt.saturating_sub(1),
            Entry::Failed { attempts, .. } | Entry::Done { attempts, .. } => *attempts,
        }
    }

    /// The SHA-256 (lowercase hex) of the item text the entry was written for, if recorded.
    pub fn item_sha256(&self) -> Option<&str> {
        match self {
            Entry::Running { item_sha256, .. }
            | Entry::Failed { item_sha256, .. }
            | Entry::Interrupted { item_sha256, .. }
            | Entry::Done { item_sha256, .. } => item_sha256.as_deref(),
        }
    }

    /// The last error recorded, if any.
    pub fn last_error(&self) -> Option<&str> {
        match self {
            Entry::Running { last_error, .. } | Entry::Interrupted { last_error, .. } => last_error.as_deref(),
            Entry::Failed { last_error, .. } => Some(last_error),
            Entry::Done { .. } => None,
        }
    }
}

/// How many attempts an item gets and what a repeated failure means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryLimit {
    /// Attempts allowed in total (first run plus retries), at least 1.
    pub max_attempts: u32,
}

/// What to do with an item, judged from its entry alone (the runner then looks at the output file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// No entry: no attempt ever ran (or `idem runs forget` removed its output with its entry). Run it,
    /// unless a verified output is already in place: then adopt it. The only plan that may adopt a file.
    New,
    /// Done: skip it if the output still has this digest and length, else run it again.
    CheckDone {
        /// Lowercase hex SHA-256 the output must have.
        sha256: String,
        /// Length the output must have, in bytes.
        size: u64,
    },
    /// Failed earlier, interrupted, or claimed by a runner whose lease may have lapsed: claim and run it (a
    /// file at its final path may be from that attempt, so it is replaced, never adopted).
    Retry {
        /// Attempts claimed so far.
        attempts: u32,
    },
    /// Failed twice the same way: never run again until forgotten.
    Poison {
        /// The last error.
        last_error: String,
    },
    /// Used every attempt without succeeding.
    Exhausted {
        /// Attempts claimed.
        attempts: u32,
        /// The last error.
        last_error: String,
    },
}

/// Judges an item by its entry.
pub fn plan(entry: Option<&Entry>, limit: RetryLimit) -> Plan {
    match entry {
        None => Plan::New,
        Some(Entry::Done { sha256, size, .. }) => Plan::CheckDone { sha256: sha256.clone(), size: *size },
        Some(Entry::Failed { poison: true, last_error, .. }) => Plan::Poison { last_error: last_error.clone() },
        Some(e) if e.attempts() >= limit.max_attempts => {
            Plan::Exhausted { attempts: e.attempts(), last_error: e.last_error().unwrap_or("crashed").to_owned() }
        }
        Some(e) => Plan::Retry { attempts: e.attempts() },
    }
}

/// The write that records an output found in place, verified, with no entry: create-only, so it never
/// overwrites what another runner recorded meanwhile. `item_sha256`: the SHA-256 of the item's text, if known.
pub fn adopt(keys: &Keys, sha256: &str, size: u64, now_ms: u64, item_sha256: Option<&str>) -> Write {
    let entry = Entry::Done {
        attempts: 0,
        sha256: sha256.to_owned(),
        size,
        owner: "adopted".into(),
        finished_at_ms: now_ms,
        duration_ms: 0,
        item_sha256: item_sha256.map(str::to_owned),
    };
    Write {
        key: keys.entry.clone(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Absent,
    }
}

/// Gives back a count that landed after its holder gave up waiting for its answer (the store unavailable past
/// the run's limit, or a stop), its command never started: the entry `prior` the count replaced again (or
/// none), fenced on `generation`, the counted entry's as a later run reads it. Without it that attempt would
/// count as a crash (with no retries left: failed without ever running).
pub fn uncount(keys: &Keys, generation: Generation, prior: Option<&Entry>) -> Write {
    let key = keys.entry.clone();
    let precondition = Precondition::Generation(generation);
    match prior {
        Some(prior) => Write { key, op: WriteOp::Put { value: prior.encode(), ttl: Ttl::Clear }, precondition },
        None => Write { key, op: WriteOp::Delete, precondition },
    }
}

/// The write that records done an output the attempt of entry `over` (read with generation `generation`)
/// left behind unrecorded (its runner gave up waiting for the store; the output verified against the digest it
/// noted): fenced on that generation, so it is refused if anyone claimed the item over meanwhile. Its attempts
/// are the entry's.
pub fn record_noted(keys: &Keys, generation: Generation, over: &Entry, sha256: &str, size: u64, now_ms: u64) -> Write {
    let owner = match over {
        Entry::Running { owner, .. } | Entry::Interrupted { owner, .. } | Entry::Done { owner, .. } => owner.clone(),
        Entry::Failed { .. } => "adopted".to_owned(),
    };
    let entry = Entry::Done {
        attempts: over.attempts(),
        sha256: sha256.to_owned(),
        size,
        owner,
        finished_at_ms: now_ms,
        duration_ms: 0,
        item_sha256: over.item_sha256().map(str::to_owned),
    };
    Write {
        key: keys.entry.clone(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Generation(generation),
    }
}

/// A claim about to be made on an item: [`Claim::lease_write`]; once the store accepted it,
/// [`Claim::leased`] makes a [`Held`] item whose attempt is counted ([`Held::count`], the same write as
/// [`Claim::entry_write`]) just before its command starts.
#[derive(Clone, Debug)]
pub struct Claim {
    keys: Keys,
    owner: String,
    now_ms: u64,
    lease: Duration,
    /// The entry read before claiming and its generation; the entry write is conditional on it.
    prev: Option<(Generation, Entry)>,
    /// The SHA-256 of the item's text, recorded in every entry this claim writes.
    item_sha256: Option<String>,
}

impl Claim {
    /// Prepares a claim by `owner` at `now_ms` (milliseconds since the Unix epoch) with a lease of `lease`
    /// (at least the store's minimum TTL, 1 s), over the entry `prev` read just before (`None`: no entry).
    pub fn new(
        keys: Keys,
        owner: impl Into<String>,
        now_ms: u64,
        lease: Duration,
        prev: Option<(Generation, Entry)>,
    ) -> Self {
        Self { keys, owner: owner.into(), now_ms, lease, prev, item_sha256: None }
    }

    /// Records `item_sha256` (lowercase hex SHA-256 of the item's text) in every entry the claim writes, so a
    /// later item under the same id with another text can be told apart ([`Entry::item_sha256`]).
    #[must_use]
    pub fn with_item_sha256(mut self, item_sha256: impl Into<String>) -> Self {
        self.item_sha256 = Some(item_sha256.into());
        self
    }

    /// The item's ledger keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The generation of the entry read before claiming (`None`: there was no entry): the count is fenced on it.
    pub fn judged_generation(&self) -> Option<Generation> {
        self.prev.as_ref().map(|(g, _)| *g)
    }

    /// The attempt number this claim starts. A done item being redone starts again at 1.
    pub fn attempt(&self) -> u32 {
        match &self.prev {
            Some((_, Entry::Done { .. })) | None => 1,
            Some((_, e)) => e.attempts().saturating_add(1),
        }
    }

    /// The owner and attempt of the entry read before claiming, if it was running or interrupted: the
    /// temporary file of that attempt may be left over from a holder that crashed or lost its lease, or have
    /// been recreated after an interruption by a process that left the command's process group.
    pub fn previous_attempt(&self) -> Option<(String, u32)> {
        match &self.prev {
            Some((_, Entry::Running { owner, attempt, .. } | Entry::Interrupted { owner, attempt, .. })) => {
                Some((owner.clone(), *attempt))
            }
            _ => None,
        }
    }

    /// The failure fingerprints and last error the entry read before claiming carries over to this attempt.
    fn carried(&self) -> (Vec<String>, Option<String>) {
        match &self.prev {
            Some((
                _,
                Entry::Running { failures, last_error, .. } | Entry::Interrupted { failures, last_error, .. },
            )) => (failures.clone(), last_error.clone()),
            Some((_, Entry::Failed { failures, last_error, .. })) => (failures.clone(), Some(last_error.clone())),
            Some((_, Entry::Done { .. })) | None => (Vec::new(), None),
        }
    }

    /// Step 1: create the lease, only if no live lease exists.
    pub fn lease_write(&self) -> Write {
        Write {
            key: self.keys.lease.clone(),
            op: WriteOp::Put { value: Bytes::from(self.owner.clone()), ttl: Ttl::After(self.lease) },
            precondition: Precondition::Absent,
        }
    }

    /// Step 2, once the lease is held and just before the command starts: count the attempt, conditional on
    /// the entry being unchanged since read ([`Held::count`] makes the same write).
    pub fn entry_write(&self) -> Write {
        let (failures, last_error) = self.carried();
        let entry = Entry::Running {
            owner: self.owner.clone(),
            attempt: self.attempt(),
            started_at_ms: self.now_ms,
            failures,
            last_error,
            item_sha256: self.item_sha256.clone(),
        };
        Write {
            key: self.keys.entry.clone(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: self.prev_precondition(),
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

    /// The item held once the store accepted both writes with these generations.
    pub fn acquired(self, lease_generation: Generation, entry_generation: Generation) -> Held {
        let mut held = self.leased(lease_generation);
        held.counted(entry_generation);
        held
    }

    /// The item held once the store accepted the lease write with this generation; its attempt is not counted
    /// until [`Held::count`] is accepted.
    pub fn leased(self, lease_generation: Generation) -> Held {
        let (failures, last_error) = self.carried();
        let attempt = self.attempt();
        Held { claim: self, attempt, failures, last_error, lease_generation, entry_generation: None }
    }

    /// The precondition of a write over the entry as read before the claim.
    fn prev_precondition(&self) -> Precondition {
        match &self.prev {
            Some((g, _)) => Precondition::Generation(*g),
            None => Precondition::Absent,
        }
    }
}

/// What a failed attempt leaves the item as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Attempts remain: run it again.
    Retry,
    /// The same fingerprint occurred twice: a poison item.
    Poison,
    /// No attempts remain.
    Exhausted,
}

/// An item held under a live lease. Every write it produces is fenced.
#[derive(Clone, Debug)]
pub struct Held {
    claim: Claim,
    attempt: u32,
    failures: Vec<String>,
    last_error: Option<String>,
    lease_generation: Generation,
    /// The entry's generation since the attempt was counted ([`Held::count`]); `None` before, while the entry is
    /// still as read before the claim.
    entry_generation: Option<Generation>,
}

/// Kept by [`idem_store::LeaseKeeper`] while the item waits for a slot, runs and is recorded.
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

    /// The lease's value is the owner token, unique to a runner process; one process holds an item through
    /// one keeper at a time, so a lease with its token is this claim's.
    fn is_mine(&self, current: &Versioned) -> bool {
        current.value().as_ref() == self.claim.owner.as_bytes()
    }
}

impl Held {
    /// The fencing token: the entry generation the count wrote ([`Held::count`]), greater than every earlier
    /// holder's; `None` until the attempt is counted.
    pub fn fencing_token(&self) -> Option<Generation> {
        self.entry_generation
    }

    /// Count the attempt, just before its command starts: the entry becomes [`Entry::Running`] with this
    /// attempt's number, conditional on it being unchanged since read before the claim (so it is refused if
    /// anyone claimed the item over, or recorded it, meanwhile). Record the generation with [`Held::counted`]:
    /// it is the fencing token. Counting here rather than with the lease means a claim made ahead of a free slot
    /// and never started (the run stopped, or the store stayed unreachable past the limit so the claim could
    /// not be given back) leaves the entry untouched: no attempt spent, nothing said to have run.
    pub fn count(&self) -> Write {
        self.claim.entry_write()
    }

    /// The entry as read before the claim, which [`Held::count`] replaces (`None`: there was none). A holder
    /// whose count went unanswered as its run gave up keeps it (beside the output) for [`uncount`].
    pub fn prior(&self) -> Option<&Entry> {
        self.claim.prev.as_ref().map(|(_, e)| e)
    }

    /// Records the generation the store gave [`Held::count`].
    pub fn counted(&mut self, entry_generation: Generation) {
        self.entry_generation = Some(entry_generation);
    }

    /// True once the attempt is counted ([`Held::counted`]).
    pub fn is_counted(&self) -> bool {
        self.entry_generation.is_some()
    }

    /// This attempt's number (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The lease length.
    pub fn length(&self) -> Duration {
        self.claim.lease
    }

    /// The item's ledger keys.
    pub fn keys(&self) -> &Keys {
        &self.claim.keys
    }

    /// Take the lease again after it lapsed (the holder was paused, or the store unreachable, for longer than a
    /// lease): created only if no live lease exists, with this holder's owner token. Once accepted (record its
    /// generation with [`Renewable::renewed`]), write [`Held::reassert`]: only if that is accepted too is the
    /// item this holder's again. Otherwise someone claimed it over: give the lease back with [`Held::release`]
    /// and discard the attempt.
    pub fn retake(&self) -> Write {
        self.claim.lease_write()
    }

    /// After [`Held::retake`]: the claim's entry written again as it is, only if its generation is still the
    /// fencing token (nobody claimed the item over while the lease was lapsed). It moves the generation on, so a
    /// claim over the entry that was read before the lease was retaken (a successor that took the lapsed lease
    /// and paused before its entry write) is refused. Record the new generation with [`Held::reasserted`].
    ///
    /// `None` before the attempt is counted: the count itself is fenced on the entry as read before the claim,
    /// so it is refused if anyone claimed the item over meanwhile, and the retaken lease is all there is to
    /// hold.
    pub fn reassert(&self) -> Option<Write> {
        let generation = self.entry_generation?;
        let mut write = self.claim.entry_write();
        write.precondition = Precondition::Generation(generation);
        Some(write)
    }

    /// Records the generation the store gave [`Held::reassert`]: the new fencing token of every later write. The
    /// command keeps the token it started with, still greater than every earlier holder's and smaller than any
    /// later one's.
    pub fn reasserted(&mut self, entry_generation: Generation) {
        self.entry_generation = Some(entry_generation);
    }

    /// The precondition of every entry write after the claim: the count's generation, or before the count, the
    /// entry as read before the claim.
    fn entry_precondition(&self) -> Precondition {
        match self.entry_generation {
            Some(g) => Precondition::Generation(g),
            None => self.claim.prev_precondition(),
        }
    }

    /// Give the lease back (after done or failed, or when interrupted), only if still held.
    pub fn release(&self) -> Write {
        self.claim.lease_release(self.lease_generation)
    }

    /// Undo a claim whose command never started (the run stopped first): the entry goes back to what it was
    /// before the claim (removed if there was none), only if no one took it over, so the attempt is not counted.
    /// Give the lease back with [`Held::release`] after it.
    ///
    /// Only for a command that never started: once it has, the attempt is given back with
    /// [`Held::interrupted`], since removing the entry would let its partial output be adopted. `None` when the
    /// attempt was never counted: the entry is as it was, and only the lease is given back.
    pub fn unclaim(&self) -> Option<Write> {
        let key = self.claim.keys.entry.clone();
        let precondition = Precondition::Generation(self.entry_generation?);
        Some(match &self.claim.prev {
            Some((_, prev)) => Write { key, op: WriteOp::Put { value: prev.encode(), ttl: Ttl::Clear }, precondition },
            None => Write { key, op: WriteOp::Delete, precondition },
        })
    }

    /// Give back an attempt whose command started and was stopped by the operator (a second Ctrl-C, or
    /// SIGTERM), only if no one took it over: [`Entry::Interrupted`], which does not count the attempt (so
    /// `--retries 0` still runs the item again) but keeps that it ran, since its command may have written the
    /// item's final path: [`plan`] then says [`Plan::Retry`], never [`Plan::New`], and that file is never
    /// adopted. Give the lease back with [`Held::release`] after it.
    pub fn interrupted(&self, now_ms: u64) -> Write {
        self.entry(Entry::Interrupted {
            owner: self.claim.owner.clone(),
            attempt: self.attempt,
            interrupted_at_ms: now_ms,
            failures: self.failures.clone(),
            last_error: self.last_error.clone(),
            item_sha256: self.claim.item_sha256.clone(),
        })
    }

    /// Record the item done with its output's digest, only if no one took it over. Before the attempt is
    /// counted (an earlier holder's output adopted from its note), the attempts are the earlier ones.
    pub fn done(&self, sha256: &str, size: u64, now_ms: u64, duration_ms: u64) -> Write {
        let attempts = if self.is_counted() { self.attempt } else { self.attempt.saturating_sub(1).max(1) };
        let entry = Entry::Done {
            attempts,
            sha256: sha256.to_owned(),
            size,
            owner: self.claim.owner.clone(),
            finished_at_ms: now_ms,
            duration_ms,
            item_sha256: self.claim.item_sha256.clone(),
        };
        self.entry(entry)
    }

    /// Record a failed attempt with its error `fingerprint` and message, only if no one took it over; says
    /// whether the item may run again under `limit`.
    pub fn failed(&self, fingerprint: &str, message: &str, now_ms: u64, limit: RetryLimit) -> (Write, Failure) {
        let poison = self.failures.iter().any(|f| f == fingerprint);
        let mut failures = self.failures.clone();
        failures.push(fingerprint.to_owned());
        let verdict = if poison {
            Failure::Poison
        } else if self.attempt >= limit.max_attempts {
            Failure::Exhausted
        } else {
            Failure::Retry
        };
        let entry = Entry::Failed {
            attempts: self.attempt,
            failures,
            last_error: message.to_owned(),
            poison,
            finished_at_ms: now_ms,
            item_sha256: self.claim.item_sha256.clone(),
        };
        (self.entry(entry), verdict)
    }

    fn entry(&self, entry: Entry) -> Write {
        Write {
            key: self.claim.keys.entry.clone(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: self.entry_precondition(),
        }
    }
}

/// The error fingerprint of a failed attempt: how it ended (`exit 3`, `signal 9`, `timeout`, or a
/// verification problem) plus the last non-empty line of its standard error with every run of decimal digits
/// replaced by `N` and every other run of hex digits that contains a digit or is 8 or more long by `H`, so the
/// same failure with a different timestamp, address or id still matches.
pub fn error_fingerprint(ending: &str, stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("");
    format!("{ending}: {}", normalise(last))
}

fn normalise(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        // A hex run stands for a number, address or id when it has a digit or is long; words like "bad" stay.
        if run.chars().all(|c| c.is_ascii_digit()) && !run.is_empty() {
            out.push('N');
        } else if run.len() >= 8 || run.chars().any(|c| c.is_ascii_digit()) {
            out.push('H');
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in line.chars() {
        if c.is_ascii_hexdigit() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn unclaim_puts_back_the_entry_it_replaced_fenced_on_the_claim() {
        let keys = Keys::new("job", "a");
        let fresh = Claim::new(keys.clone(), "o1", 1, Duration::from_secs(10), None)
            .acquired(Generation::new(5), Generation::new(6));
        let undo = fresh.unclaim().expect("counted");
        assert_eq!(undo.key, keys.entry());
        assert_eq!(undo.op, WriteOp::Delete, "a new item goes back to having no entry");
        assert_eq!(undo.precondition, Precondition::Generation(Generation::new(6)));
        let failed = Entry::Failed {
            attempts: 1,
            failures: vec!["exit 1".into()],
            last_error: "boom".into(),
            poison: false,
            finished_at_ms: 0,
            item_sha256: None,
        };
        let retry = Claim::new(keys, "o1", 1, Duration::from_secs(10), Some((Generation::new(3), failed.clone())))
            .acquired(Generation::new(7), Generation::new(8));
        assert_eq!(retry.attempt(), 2);
        let undo = retry.unclaim().expect("counted");
        assert_eq!(undo.op, WriteOp::Put { value: failed.encode(), ttl: Ttl::Clear }, "attempt 2 is not spent");
        assert_eq!(undo.precondition, Precondition::Generation(Generation::new(8)));
    }

    use super::*;

    const LIMIT: RetryLimit = RetryLimit { max_attempts: 3 };

    /// A claim made ahead of a free slot holds the lease only: until its count, nothing in the entry says an
    /// attempt ran, so one given up (stopped, or the store unreachable past the limit) spends no attempt even
    /// when nothing can be written to give it back.
    #[test]
    fn an_uncounted_claim_leaves_the_entry_as_it_was() {
        let failed = Entry::Failed {
            attempts: 1,
            failures: vec!["exit 1".into()],
            last_error: "boom".into(),
            poison: false,
            finished_at_ms: 0,
            item_sha256: None,
        };
        let once = RetryLimit { max_attempts: 2 };
        let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), Some((Generation::new(3), failed.clone())));
        let mut held = claim.clone().leased(Generation::new(4));
        assert_eq!(held.fencing_token(), None);
        assert!(!held.is_counted());
        assert_eq!(held.unclaim(), None, "nothing to undo in the entry");
        assert_eq!(held.reassert(), None, "a retaken lease is all there is to hold");
        // The entry as the next run reads it: still attempt 1 of 2, so the item runs again.
        assert_eq!(plan(Some(&failed), once), Plan::Retry { attempts: 1 });
        // The count is the claim's entry write, fenced on the entry read before the claim.
        let count = held.count();
        assert_eq!(count, claim.entry_write());
        assert_eq!(count.precondition, Precondition::Generation(Generation::new(3)));
        assert_eq!(decoded(&count).attempts(), 2);
        held.counted(Generation::new(5));
        assert_eq!(held.fencing_token(), Some(Generation::new(5)));
        assert_eq!(held.done("ab", 1, 2, 3).precondition, Precondition::Generation(Generation::new(5)));
        assert_eq!(held.unclaim().map(|w| w.precondition), Some(Precondition::Generation(Generation::new(5))));
        // Before the count, a write over the entry (an earlier holder's output adopted) is fenced on what was read.
        let fresh = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).leased(Generation::new(1));
        assert_eq!(fresh.done("ab", 1, 2, 3).precondition, Precondition::Absent);
    }

    fn keys() -> Keys {
        Keys::new("job1", "a")
    }

    #[test]
    fn keys_are_namespaced_by_job() {
        assert_eq!(keys().entry(), "run/job1/item/a");
        assert_eq!(keys().lease(), "run/job1/lease/a");
        assert!(keys().entry().starts_with(&entry_prefix("job1")));
        assert_ne!(Keys::new("job2", "a").entry(), keys().entry());
    }

    #[test]
    fn fingerprints_ignore_numbers_and_hex_runs() {
        let a = error_fingerprint("exit 1", b"starting\nerror at 12:00:01 id=deadbeef01 port 8080\n\n");
        let b = error_fingerprint("exit 1", b"error at 13:59:07 id=0badf00d99 port 9\n");
        assert_eq!(a, b);
        assert_eq!(a, "exit 1: error at N:N:N id=H port N");
        assert_ne!(a, error_fingerprint("exit 2", b"error at 13:59:07 id=0badf00d99 port 9"));
        assert_eq!(error_fingerprint("signal 9", b""), "signal 9: ");
        assert_eq!(error_fingerprint("exit 1", b"bad face"), "exit 1: bad face");
    }

    #[test]
    fn attempts_are_counted_at_claim_and_carried_over_a_crash() {
        let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
        assert_eq!(claim.attempt(), 1);
        assert_eq!(claim.lease_write().precondition, Precondition::Absent);
        assert_eq!(claim.entry_write().precondition, Precondition::Absent);
        let WriteOp::Put { value, ttl } = claim.entry_write().op else { panic!("put") };
        assert_eq!(ttl, Ttl::Clear);
        let running = Entry::decode(&value).unwrap();
        assert_eq!(running.attempts(), 1);
        // The holder crashed: its lease lapsed but the entry still says attempt 1.
        assert_eq!(plan(Some(&running), LIMIT), Plan::Retry { attempts: 1 });
        let again = Claim::new(keys(), "o2", 2, Duration::from_secs(10), Some((Generation::new(7), running)));
        assert_eq!(again.attempt(), 2);
        assert_eq!(again.previous_attempt(), Some(("o1".to_owned(), 1)));
        assert_eq!(again.entry_write().precondition, Precondition::Generation(Generation::new(7)));
    }

    #[test]
    fn every_write_after_the_claim_is_fenced() {
        let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
        let mut held = claim.acquired(Generation::new(3), Generation::new(4));
        assert_eq!(held.fencing_token(), Some(Generation::new(4)));
        assert_eq!(held.renewal().precondition, Precondition::Generation(Generation::new(3)));
        held.renewed(Generation::new(9));
        assert_eq!(held.renewal().precondition, Precondition::Generation(Generation::new(9)));
        assert_eq!(held.release().precondition, Precondition::Generation(Generation::new(9)));
        assert_eq!(held.release().op, WriteOp::Delete);
        let done = held.done("ab", 2, 5, 1);
        assert_eq!(done.precondition, Precondition::Generation(Generation::new(4)));
        assert_eq!(done.key, "run/job1/item/a");
        let (failed, _) = held.failed("exit 1: x", "x", 5, LIMIT);
        assert_eq!(failed.precondition, Precondition::Generation(Generation::new(4)));
    }

    #[test]
    fn the_same_fingerprint_twice_is_poison() {
        let claim = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None);
        let held = claim.acquired(Generation::new(1), Generation::new(2));
        let (w, verdict) = held.failed("exit 1: boom", "boom", 3, LIMIT);
        assert_eq!(verdict, Failure::Retry);
        let WriteOp::Put { value, .. } = w.op else { panic!("put") };
        let failed = Entry::decode(&value).unwrap();
        assert_eq!(plan(Some(&failed), LIMIT), Plan::Retry { attempts: 1 });
        let second = Claim::new(keys(), "o1", 4, Duration::from_secs(10), Some((Generation::new(5), failed)));
        let held = second.acquired(Generation::new(6), Generation::new(7));
        assert_eq!(held.attempt(), 2);
        let (w, verdict) = held.failed("exit 1: boom", "boom", 8, LIMIT);
        assert_eq!(verdict, Failure::Poison);
        let WriteOp::Put { value, .. } = w.op else { panic!("put") };
        let poisoned = Entry::decode(&value).unwrap();
        assert_eq!(plan(Some(&poisoned), LIMIT), Plan::Poison { last_error: "boom".into() });
    }

    #[test]
    fn different_failures_exhaust_the_attempts() {
        let limit = RetryLimit { max_attempts: 2 };
        let mut prev = None;
        let mut verdicts = Vec::new();
        for (i, fp) in ["exit 1: a", "exit 1: b"].iter().enumerate() {
            let claim = Claim::new(keys(), "o", 0, Duration::from_secs(10), prev.take());
            let held = claim.acquired(Generation::new(1), Generation::new(2 + i as u64));
            let (w, verdict) = held.failed(fp, fp, 0, limit);
            verdicts.push(verdict);
            let WriteOp::Put { value, .. } = w.op else { panic!("put") };
            prev = Some((Generation::new(10 + i as u64), Entry::decode(&value).unwrap()));
        }
        assert_eq!(verdicts, [Failure::Retry, Failure::Exhausted]);
        let (_, last) = prev.unwrap();
        assert!(matches!(plan(Some(&last), limit), Plan::Exhausted { attempts: 2, .. }));
    }

    fn decoded(write: &Write) -> Entry {
        let WriteOp::Put { value, ttl } = &write.op else { panic!("put") };
        assert_eq!(*ttl, Ttl::Clear, "entries never expire");
        Entry::decode(value).unwrap()
    }

    #[test]
    fn an_interrupted_attempt_is_not_counted_and_its_file_is_never_adopted() {
        // `--retries 0`: one attempt in all.
        let once = RetryLimit { max_attempts: 1 };
        let held =
            Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).acquired(Generation::new(3), Generation::new(4));
        let write = held.interrupted(9);
        assert_eq!(write.key, keys().entry());
        assert_eq!(write.precondition, Precondition::Generation(Generation::new(4)), "fenced on the claim");
        let entry = decoded(&write);
        assert_eq!(
            entry,
            Entry::Interrupted {
                owner: "o1".into(),
                attempt: 1,
                interrupted_at_ms: 9,
                failures: Vec::new(),
                last_error: None,
                item_sha256: None,
            }
        );
        assert_eq!(entry.attempts(), 0, "the interrupted attempt is not counted");
        // Not New (which may adopt a file at the final path) and not out of attempts: it runs again.
        assert_eq!(plan(Some(&entry), once), Plan::Retry { attempts: 0 });
        assert_eq!(Entry::decode(&entry.encode()).unwrap(), entry);

        // The next claim runs as the same attempt number and sweeps the interrupted attempt's temporary file.
        let next = Claim::new(keys(), "o2", 10, Duration::from_secs(10), Some((Generation::new(5), entry.clone())));
        assert_eq!(next.attempt(), 1);
        assert_eq!(next.previous_attempt(), Some(("o1".to_owned(), 1)));
        assert_eq!(next.entry_write().precondition, Precondition::Generation(Generation::new(5)));
        // If that claim's command never starts, undoing it keeps the mark.
        let undo = next.acquired(Generation::new(6), Generation::new(7)).unclaim().expect("counted");
        assert_eq!(decoded(&undo), entry);
        assert_eq!(undo.precondition, Precondition::Generation(Generation::new(7)));
    }

    #[test]
    fn an_interrupted_retry_keeps_the_failures_before_it() {
        let failed = Entry::Failed {
            attempts: 1,
            failures: vec!["exit 1: boom".into()],
            last_error: "boom".into(),
            poison: false,
            finished_at_ms: 0,
            item_sha256: None,
        };
        let held = Claim::new(keys(), "o1", 1, Duration::from_secs(10), Some((Generation::new(2), failed)))
            .acquired(Generation::new(3), Generation::new(4));
        assert_eq!(held.attempt(), 2);
        let entry = decoded(&held.interrupted(5));
        assert_eq!(entry.attempts(), 1, "the earlier failure still counts, the interruption does not");
        assert_eq!(entry.last_error(), Some("boom"));
        assert_eq!(plan(Some(&entry), RetryLimit { max_attempts: 2 }), Plan::Retry { attempts: 1 });
        assert_eq!(
            plan(Some(&entry), RetryLimit { max_attempts: 1 }),
            Plan::Exhausted { attempts: 1, last_error: "boom".into() }
        );
        // The same failure after the interruption is still the second occurrence: poison.
        let again = Claim::new(keys(), "o2", 6, Duration::from_secs(10), Some((Generation::new(5), entry)))
            .acquired(Generation::new(6), Generation::new(7));
        assert_eq!(again.attempt(), 2);
        let (_, verdict) = again.failed("exit 1: boom", "boom", 8, LIMIT);
        assert_eq!(verdict, Failure::Poison);
    }

    /// Every way an attempt can end short of done, from an item with no entry: only a claim whose command never
    /// started leaves no entry behind, so only then may a file found at the final path be adopted.
    #[test]
    fn only_an_attempt_that_never_started_leaves_the_item_adoptable() {
        let held = || {
            Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).acquired(Generation::new(1), Generation::new(2))
        };
        let running = decoded(&Claim::new(keys(), "o1", 1, Duration::from_secs(10), None).entry_write());
        let endings: Vec<(&str, Entry)> = vec![
            // kill -9, a crash, a lost lease (taken over or the ledger unreachable): the claim's entry stays.
            ("crashed or lost its lease", running),
            // A failed command, a timeout, a spawn that failed for want of resources for 30 s.
            ("failed", decoded(&held().failed("timeout: ", "timeout", 3, LIMIT).0)),
            (
                "failed with no attempts left",
                decoded(&held().failed("timeout: ", "timeout", 3, RetryLimit { max_attempts: 1 }).0),
            ),
            // A second Ctrl-C or SIGTERM while the command ran.
            ("interrupted", decoded(&held().interrupted(3))),
        ];
        for (how, entry) in &endings {
            for limit in [RetryLimit { max_attempts: 1 }, LIMIT] {
                let plan = plan(Some(entry), limit);
                assert!(!matches!(plan, Plan::New | Plan::CheckDone { .. }), "{how}: {plan:?} may adopt a file");
            }
        }
        // Stopped before its command started: nothing ran, the item is as it was.
        assert_eq!(held().unclaim().expect("counted").op, WriteOp::Delete);
        assert_eq!(plan(None, LIMIT), Plan::New);
    }

    #[test]
    fn done_items_are_checked_and_redone_from_attempt_one() {
        let done = Entry::Done {
            attempts: 2,
            sha256: "ff".into(),
            size: 1,
            owner: "o".into(),
            finished_at_ms: 0,
            duration_ms: 0,
            item_sha256: None,
        };
        assert_eq!(plan(Some(&done), LIMIT), Plan::CheckDone { sha256: "ff".into(), size: 1 });
        let redo = Claim::new(keys(), "o", 0, Duration::from_secs(10), Some((Generation::new(3), done)));
        assert_eq!(redo.attempt(), 1);
        // A redo interrupted does not put the old digest back: the file may be the interrupted command's.
        let interrupted = decoded(&redo.clone().acquired(Generation::new(4), Generation::new(5)).interrupted(6));
        assert_eq!(plan(Some(&interrupted), LIMIT), Plan::Retry { attempts: 0 });
        let adopt = adopt(&keys(), "ff", 1, 0, None);
        assert_eq!(adopt.precondition, Precondition::Absent);
    }

    #[test]
    fn entries_written_before_the_item_text_was_recorded_decode_without_it_and_new_ones_carry_it() {
        let old =
            br#"{"state":"done","attempts":1,"sha256":"ab","size":2,"owner":"o","finished_at_ms":1,"duration_ms":0}"#;
        assert_eq!(Entry::decode(old).unwrap().item_sha256(), None);
        let held = Claim::new(keys(), "o1", 1, Duration::from_secs(10), None)
            .with_item_sha256("cd")
            .acquired(Generation::new(3), Generation::new(4));
        assert_eq!(decoded(&held.done("ab", 2, 5, 1)).item_sha256(), Some("cd"));
        assert!(!String::from_utf8_lossy(&Entry::decode(old).unwrap().encode()).contains("item_sha256"));
    }
}
