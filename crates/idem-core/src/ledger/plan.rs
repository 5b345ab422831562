//! Judging an item by its entry ([`plan`]) and the writes made outside a claim: adopting an output found in
//! place, giving back a count, recording an output an attempt noted.

use idem_store::{Generation, Precondition, Ttl};

use super::{Entry, Keys};
use crate::{Write, WriteOp};

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
        key: keys.entry().to_owned(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Absent,
    }
}

/// Gives back a count that landed after its holder gave up waiting for its answer (the store unavailable past
/// the run's limit, or a stop), its command never started: the entry `prior` the count replaced again (or
/// none), fenced on `generation`, the counted entry's as a later run reads it. Without it that attempt would
/// count as a crash (with no retries left: failed without ever running).
pub fn uncount(keys: &Keys, generation: Generation, prior: Option<&Entry>) -> Write {
    let key = keys.entry().to_owned();
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
        key: keys.entry().to_owned(),
        op: WriteOp::Put { value: entry.encode(), ttl: Ttl::Clear },
        precondition: Precondition::Generation(generation),
    }
}
