//! Finished records kept in memory, so a replay is answered without a store read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use idem_core::record::Record;
use quick_cache::Weighter;
use quick_cache::sync::Cache;

/// Bytes counted per entry besides its key and stored response: the entry, its `Arc`, the header strings, the
/// map's slot and allocator overhead (measured: a 32 MiB bound counted at 160 bytes an entry grew the
/// proxy's resident set by 66 MiB).
const ENTRY_OVERHEAD: u64 = 512;

/// A finished record as the store holds it, with the store's expiry.
pub(crate) struct Cached {
    record: Record,
    expires_at: Option<SystemTime>,
    weight: u64,
}

#[derive(Clone)]
struct ByteWeight;

impl Weighter<String, Arc<Cached>> for ByteWeight {
    fn weight(&self, key: &String, val: &Arc<Cached>) -> u64 {
        key.len() as u64 + val.weight
    }
}

/// Finished records by record key, bounded in bytes (quick_cache's S3-FIFO eviction keeps keys that are
/// retried and lets one-off keys go first).
///
/// Only finished records are kept: the layer never changes one (a claim needs the key absent, renewals and
/// releases are fenced on an in-flight record's generation), so the only ways one stops being true are its
/// expiry, checked on every hit against the store's own expiry time, and a delete from outside the layer,
/// which must call [`ReplayCache::invalidate`] after it. A record read from the store while such a delete runs
/// could be put back after the delete removed it: an insert is refused once any invalidation happened since
/// its token was taken (before the read).
pub(crate) struct ReplayCache {
    records: Cache<String, Arc<Cached>, ByteWeight>,
    invalidations: AtomicU64,
    /// Inserts hold it shared (check the token, then insert), invalidations exclusively (count, then remove):
    /// once an invalidation returned, no copy read before it can be in the cache, not even for a moment.
    order: RwLock<()>,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("records", &self.records.len())
            .field("bytes", &self.records.weight())
            .field("capacity_bytes", &self.records.capacity())
            .finish()
    }
}

impl ReplayCache {
    pub(crate) fn new(max_bytes: u64) -> Self {
        // The estimate only sizes the map up front; the byte bound is what evicts.
        let estimated = usize::try_from(max_bytes / 2048).unwrap_or(usize::MAX).clamp(16, 1 << 20);
        Self {
            records: Cache::with_weighter(estimated, max_bytes, ByteWeight),
            invalidations: AtomicU64::new(0),
            order: RwLock::new(()),
        }
    }

    /// The cached finished record under `key`, if any and not expired.
    pub(crate) fn get(&self, key: &str) -> Option<Record> {
        let cached = self.records.get(key)?;
        if cached.expires_at.is_some_and(|at| at <= SystemTime::now()) {
            self.records.remove(key);
            return None;
        }
        Some(cached.record.clone())
    }

    /// A token to take before reading or writing the record that is then passed to [`ReplayCache::insert`].
    pub(crate) fn token(&self) -> u64 {
        self.invalidations.load(Ordering::SeqCst)
    }

    /// Keeps `record` (ignored unless finished) if no invalidation happened since `token` was taken.
    pub(crate) fn insert(&self, key: &str, record: &Record, expires_at: Option<SystemTime>, token: u64) {
        let weight = match record {
            Record::Finished { outcome, .. } => ENTRY_OVERHEAD + outcome_bytes(outcome),
            Record::InProgress { .. } => return,
        };
        let cached = Arc::new(Cached { record: record.clone(), expires_at, weight });
        let _shared = self.order.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.invalidations.load(Ordering::SeqCst) == token {
            self.records.insert(key.to_owned(), cached);
        }
    }

    /// Forgets `key`; called for every write to the store from outside the layer.
    pub(crate) fn invalidate(&self, key: &str) {
        let _exclusive = self.order.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.invalidations.fetch_add(1, Ordering::SeqCst);
        self.records.remove(key);
    }
}

fn outcome_bytes(outcome: &idem_core::record::Outcome) -> u64 {
    match outcome {
        idem_core::record::Outcome::Response(r) => {
            let headers: usize = r.headers.iter().map(|(n, v)| n.len() + v.len() + 48).sum();
            (r.body.len() + headers) as u64
        }
        idem_core::record::Outcome::TooLarge { .. } => 0,
        idem_core::record::Outcome::Unknown { reason } => reason.len() as u64,
        idem_core::record::Outcome::Resolved { reason, by, note, .. } => (reason.len() + by.len() + note.len()) as u64,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use idem_core::record::{Outcome, StoredResponse};
    use idem_core::{Fingerprint, RequestParts};

    use super::*;

    fn finished(body: &'static str) -> Record {
        let fingerprint = Fingerprint::of_request(&RequestParts::new("POST", "/", None, None, b""));
        let outcome = Outcome::Response(StoredResponse { status: 201, headers: vec![], body: Bytes::from(body) });
        Record::Finished { fingerprint, outcome, finished_at_ms: 0 }
    }

    #[test]
    fn keeps_finished_records_until_they_expire() {
        let cache = ReplayCache::new(1 << 20);
        let later = SystemTime::now() + Duration::from_secs(60);
        cache.insert("a", &finished("x"), Some(later), cache.token());
        assert_eq!(cache.get("a"), Some(finished("x")));
        let past = SystemTime::now() - Duration::from_millis(1);
        cache.insert("b", &finished("y"), Some(past), cache.token());
        assert_eq!(cache.get("b"), None, "an expired record is a miss");
        assert_eq!(cache.get("c"), None);
    }

    #[test]
    fn an_invalidation_after_the_token_wins_over_the_insert() {
        let cache = ReplayCache::new(1 << 20);
        let token = cache.token();
        cache.invalidate("a");
        cache.insert("a", &finished("stale"), None, token);
        assert_eq!(cache.get("a"), None, "a record read before a delete must not be cached after it");
        cache.insert("a", &finished("fresh"), None, cache.token());
        cache.invalidate("a");
        assert_eq!(cache.get("a"), None);
    }

    #[test]
    fn a_copy_read_before_an_invalidation_is_never_visible_after_it() {
        let cache = Arc::new(ReplayCache::new(1 << 20));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (cache, stop) = (Arc::clone(&cache), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut stale = 0;
                while !stop.load(Ordering::Relaxed) {
                    stale += usize::from(cache.get("k").is_some());
                }
                stale
            })
        };
        for _ in 0..20_000 {
            let token = cache.token();
            cache.invalidate("k");
            cache.insert("k", &finished("stale"), None, token);
        }
        stop.store(true, Ordering::Relaxed);
        assert_eq!(reader.join().unwrap(), 0, "a stale copy was visible after its invalidation returned");
    }

    #[test]
    fn in_flight_records_are_never_kept() {
        let cache = ReplayCache::new(1 << 20);
        let fingerprint = Fingerprint::of_request(&RequestParts::new("POST", "/", None, None, b""));
        let record = Record::InProgress { fingerprint, owner: "o".into(), started_at_ms: 0, lease_ms: 0 };
        cache.insert("a", &record, None, cache.token());
        assert_eq!(cache.get("a"), None);
    }

    #[test]
    fn the_byte_bound_evicts() {
        let cache = ReplayCache::new(64 * 1024);
        let body: &'static str = Box::leak("z".repeat(4096).into_boxed_str());
        for i in 0..100 {
            cache.insert(&format!("k{i}"), &finished(body), None, cache.token());
        }
        let kept = (0..100).filter(|i| cache.get(&format!("k{i}")).is_some()).count();
        assert!(kept > 0 && kept <= 16, "{kept} records of 4 KiB kept under a 64 KiB bound");
    }
}
