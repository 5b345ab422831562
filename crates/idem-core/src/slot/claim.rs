//! Claiming a slot ([`Claim`]) and the fenced writes of the holder ([`Held`]): done, failed, interrupted,
//! withdrawn, and the lease's renewals.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, Ttl, Versioned};

#[cfg(doc)]
use super::INTERRUPTED_EXIT;
use super::{Ending, Entry, Keys};
use crate::ledger::RetryLimit;
use crate::{Write, WriteOp};

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
            key: self.keys.lease().to_owned(),
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
            key: self.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: match &self.prev {
                Some((g, _)) => Precondition::Generation(*g),
                None => Precondition::Absent,
            },
        }
    }

    /// Step 2 under a buffering overlap policy, once the lease is held: the entry says the slot waits (no
    /// attempt counted), conditional on the entry being unchanged since read. Once the slot may run, the claim
    /// goes on from it: [`Claim::after_wait`].
    pub fn waiting_write(&self) -> Write {
        let entry = Entry::Waiting { owner: self.owner.clone(), host: self.host.clone(), since_ms: self.now_ms };
        Write {
            key: self.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: self.entry_precondition(),
        }
    }

    /// The claim to make, at `now_ms`, of a slot whose [`Claim::waiting_write`] the store accepted with
    /// `waiting_generation`: its [`Claim::entry_write`] is conditional on the waiting entry (the lease is
    /// held already).
    #[must_use]
    pub fn after_wait(&self, waiting_generation: Generation, now_ms: u64) -> Self {
        let waiting = Entry::Waiting { owner: self.owner.clone(), host: self.host.clone(), since_ms: self.now_ms };
        Self { now_ms, prev: Some((waiting_generation, waiting)), ..self.clone() }
    }

    /// Extends the lease held with `lease_generation` by its length from now (the store's now), only if still
    /// held: a waiting claim keeps itself alive with it.
    pub fn lease_renewal(&self, lease_generation: Generation) -> Write {
        Write {
            key: self.keys.lease().to_owned(),
            op: WriteOp::Put { value: Bytes::from(self.owner.clone()), ttl: Ttl::After(self.lease) },
            precondition: Precondition::Generation(lease_generation),
        }
    }

    /// Puts back what a [`Claim::waiting_write`] replaced (generation `entry_generation`), only if no one
    /// changed it since: the slot is as it was before the claim (no entry, or the `skipped` entry an earlier
    /// turn under `--overlap skip` left, or the `paused` one a pause left).
    pub fn waiting_given_back(&self, entry_generation: Generation) -> Write {
        let op = match &self.prev {
            Some((_, prev @ (Entry::Skipped { .. } | Entry::Paused { .. }))) => {
                WriteOp::Put { value: prev.encode(), ttl: Ttl::Clear }
            }
            _ => WriteOp::Delete,
        };
        Write { key: self.keys.entry().to_owned(), op, precondition: Precondition::Generation(entry_generation) }
    }

    /// Records the slot skipped under `policy` (the slot `earlier_ms` was ahead of it), fenced on the waiting
    /// entry it replaces (generation `entry_generation`).
    pub fn skipped(&self, entry_generation: Generation, policy: &str, earlier_ms: u64, now_ms: u64) -> Write {
        let entry = Entry::Skipped { policy: policy.to_owned(), earlier_ms, recorded_at_ms: now_ms };
        Write {
            key: self.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: Precondition::Generation(entry_generation),
        }
    }

    fn entry_precondition(&self) -> Precondition {
        match &self.prev {
            Some((g, _)) => Precondition::Generation(*g),
            None => Precondition::Absent,
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
            key: self.claim.keys.lease().to_owned(),
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
            key: self.claim.keys.entry().to_owned(),
            op: WriteOp::Delete,
            precondition: Precondition::Generation(self.entry_generation),
        }
    }

    fn entry(&self, entry: Entry) -> Write {
        Write {
            key: self.claim.keys.entry().to_owned(),
            op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
            precondition: Precondition::Generation(self.entry_generation),
        }
    }
}
