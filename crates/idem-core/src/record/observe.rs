//! An observer's judgement of the in-flight records it finds: a holder whose record's generation stayed the
//! same for a whole lease of the observer's own clock is dead, and its record may be taken over.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_store::Generation;

use super::{Record, RecordKey};

/// What an observer concluded about an in-flight record ([`Observations::observe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watch {
    /// The holder may be alive: its generation has not yet been seen unchanged for a whole lease. It cannot be
    /// judged dead before `again_in` has passed.
    Alive {
        /// How much longer the generation must stay unchanged before the holder counts as dead.
        again_in: Duration,
    },
    /// Seen unchanged for a whole lease: the holder is dead (or cut off from the store) and a request with the
    /// same fingerprint may take the record over, conditional on this generation ([`Claim::take_over`](super::Claim::take_over)).
    Lapsed(Generation),
}

/// One observed in-flight record: its generation and when this observer first saw it.
#[derive(Clone, Copy, Debug)]
struct Seen {
    generation: Generation,
    since: Instant,
    lease: Duration,
    /// When the last read that confirmed it was answered ([`Observations::watch`]'s gap rule).
    last: Instant,
}

/// An observer's memory of the in-flight records it found, as Kubernetes leader election keeps the leader
/// record it last saw: per record key, the generation last seen and when, by the observer's own monotonic
/// clock, it first saw that generation.
///
/// A holder renews its record every third of its lease, each renewal a new generation (generations are never
/// reused: [`idem_store::Generation`]). A generation that stayed the same for a whole lease of the observer's clock means
/// no renewal landed for that long: the holder's own keeper (which counts a lease from the moment it *sent*
/// its last accepted write, earlier than anyone could read it) has given the lease up by then, if its clock
/// runs at about the observer's rate — the usual lease assumption; no clock synchronisation is assumed, and
/// the store's clock plays no part.
///
/// Forgetting (a restart, [`Observations::forget`], the capacity bound) only ever delays a takeover: the
/// observation starts again.
#[derive(Debug)]
pub struct Observations {
    seen: HashMap<String, Seen>,
    capacity: usize,
}

impl Observations {
    /// An empty memory of at most `capacity` records (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self { seen: HashMap::new(), capacity: capacity.max(1) }
    }

    /// Judges the in-flight `record` found under `key` with `generation` at `now`. The lease is the one the
    /// record names (`lease_ms`), or `own_lease` for a record that names none. A first sighting, or a
    /// generation other than the last one seen, starts the observation.
    pub fn observe(
        &mut self,
        key: &RecordKey,
        record: &Record,
        generation: Generation,
        own_lease: Duration,
        now: Instant,
    ) -> Watch {
        let lease = match record {
            Record::InProgress { lease_ms, .. } if *lease_ms > 0 => Duration::from_millis(*lease_ms),
            _ => own_lease,
        };
        if let Some(seen) = self.seen.get(key.as_str())
            && seen.generation == generation
        {
            let watched = now.saturating_duration_since(seen.since);
            return if watched >= seen.lease {
                Watch::Lapsed(generation)
            } else {
                Watch::Alive { again_in: seen.lease - watched }
            };
        }
        if self.seen.len() >= self.capacity && !self.seen.contains_key(key.as_str()) {
            // Full: let go of what is most likely stale (watched for two leases), else of everything. Either
            // only delays a takeover.
            self.seen.retain(|_, s| now.saturating_duration_since(s.since) < s.lease * 2);
            if self.seen.len() >= self.capacity {
                self.seen.clear();
            }
        }
        self.seen.insert(key.as_str().to_owned(), Seen { generation, since: now, lease, last: now });
        Watch::Alive { again_in: lease }
    }

    /// Judges a holder by the largest generation seen for it under `key` (for a runner's item: the larger of
    /// its entry's and its lease's generations), read by a read sent at `sent` and answered at `answered`.
    ///
    /// Every write a holder makes gets a generation larger than any before it (generations are never reused,
    /// [`idem_store::Generation`]), so only a *larger* generation is a sign of life and restarts the watch; a smaller one
    /// (the lease key gone by the store's clock) does not. A first sighting starts the watch at `answered`: the
    /// holder's write it shows was sent no later. The holder counts as gone ([`Watch::Lapsed`]) once a read
    /// *sent* a whole `lease` after that still shows nothing larger: a read queued behind a locked store and
    /// answered late must not count its wait as watched. Reads more than half a `lease` apart (this
    /// observer was paused, or starved of the store) restart the watch, as [`Observations::clear`] does when
    /// the store comes back after an outage: the holder, who could not write either, gets a whole lease to
    /// renew or retake its lease before anyone claims over it.
    pub fn watch(
        &mut self,
        key: &str,
        generation: Generation,
        lease: Duration,
        sent: Instant,
        answered: Instant,
    ) -> Watch {
        if let Some(seen) = self.seen.get_mut(key)
            && generation <= seen.generation
        {
            let gap = sent.saturating_duration_since(seen.last);
            seen.last = answered;
            if gap > seen.lease / 2 {
                seen.since = answered;
                return Watch::Alive { again_in: seen.lease };
            }
            let watched = sent.saturating_duration_since(seen.since);
            return if watched >= seen.lease {
                Watch::Lapsed(generation)
            } else {
                Watch::Alive { again_in: seen.lease - watched }
            };
        }
        if self.seen.len() >= self.capacity && !self.seen.contains_key(key) {
            self.seen.retain(|_, s| answered.saturating_duration_since(s.since) < s.lease * 2);
            if self.seen.len() >= self.capacity {
                self.seen.clear();
            }
        }
        self.seen.insert(key.to_owned(), Seen { generation, since: answered, lease, last: answered });
        Watch::Alive { again_in: lease }
    }

    /// Forgets every watch, keeping nothing of what was seen: for an observer whose own operations were not
    /// served for a while (the store out, or this process paused), so every holder, equally unable to write,
    /// is watched afresh from the first read answered after.
    pub fn clear(&mut self) {
        self.seen.clear();
    }

    /// Drops what was seen under `key` (it was taken over, finished, or found absent).
    pub fn forget(&mut self, key: &RecordKey) {
        self.seen.remove(key.as_str());
    }

    /// How many records are being watched.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no record is being watched.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
