//! Claiming an item ([`Claim`]) and the fenced writes of its holder ([`Held`]): count, done, failed,
//! interrupted, unclaim, and the lease's renewals.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, Ttl, Versioned};

use super::{Entry, Keys, RetryLimit};
#[cfg(doc)]
use super::{Plan, plan, uncount};
use crate::{Write, WriteOp};

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
            key: self.keys.lease().to_owned(),
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
            key: self.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: self.prev_precondition(),
        }
    }

    /// If the entry write is refused, the lease taken in step 1 is given back with this write.
    pub fn lease_release(&self, lease_generation: Generation) -> Write {
        Write {
            key: self.keys.lease().to_owned(),
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
            key: self.claim.keys.lease().to_owned(),
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
        let key = self.claim.keys.entry().to_owned();
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
            key: self.claim.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: self.entry_precondition(),
        }
    }
}
