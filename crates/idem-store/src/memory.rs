use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use bytes::Bytes;

use crate::backend::{apply_counter, apply_set};
use crate::{
    CounterOutcome, Error, Generation, Limits, ListItem, Page, Precondition, SetChange, SetOutcome, Store, Ttl,
    Versioned, Written, millis_to_system_time, system_time_to_millis,
};

/// A store in process memory: nothing survives the process. For tests, and for embedding idem's helpers where
/// durability is not needed. Cloning gives another handle to the same data.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    limits: Limits,
    clock: Clock,
}

/// Where a [`MemoryStore`] reads "now" for TTLs and dedupe retention.
#[derive(Clone, Debug, Default)]
enum Clock {
    /// The system clock.
    #[default]
    System,
    /// Tokio's clock, from `origin` (the system time, in ms, when the store was made) at `start`: a test with
    /// paused time moves it with `tokio::time::advance`, so leases lapse when the test says.
    Tokio { origin_ms: u64, start: tokio::time::Instant },
    /// The system clock plus `ms` (negative: behind), as a database server's clock may be off the client's.
    #[cfg(feature = "testing")]
    Offset { ms: i64 },
    /// A time in ms since the Unix epoch that only [`ManualClock`] moves.
    #[cfg(feature = "testing")]
    Manual(ManualClock),
}

/// The clock of a [`MemoryStore::with_manual_clock`]: milliseconds since the Unix epoch, moved only by the
/// test that holds it (a slot schedule's gaps, a clock that jumps ahead or back), so the test decides what
/// time every invocation reads without sleeping. Cloning gives another handle to the same clock.
#[cfg(feature = "testing")]
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<std::sync::atomic::AtomicU64>);

#[cfg(feature = "testing")]
impl ManualClock {
    /// Its time, in milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Sets its time to `ms` since the Unix epoch (earlier than now too: a clock stepped back).
    pub fn set_ms(&self, ms: u64) {
        self.0.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Moves it on by `by`.
    pub fn advance(&self, by: std::time::Duration) {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.0.fetch_add(by, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock {
    fn now_ms(&self) -> u64 {
        match self {
            Clock::System => system_time_to_millis(SystemTime::now()),
            Clock::Tokio { origin_ms, start } => {
                origin_ms + u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX - origin_ms)
            }
            #[cfg(feature = "testing")]
            Clock::Offset { ms } => system_time_to_millis(SystemTime::now()).saturating_add_signed(*ms),
            #[cfg(feature = "testing")]
            Clock::Manual(clock) => clock.now_ms(),
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    map: BTreeMap<String, Entry>,
    last_generation: u64,
    /// Counter adds: (key, dedupe id) -> (outcome of the first application, its delta, forget after ms).
    dedupe: HashMap<(String, String), (CounterOutcome, i64, u64)>,
    /// Set changes: (key, dedupe id) -> (outcome of the first application, its fingerprint, forget after ms).
    set_dedupe: HashMap<(String, String), (SetOutcome, String, u64)>,
}

#[derive(Debug, Clone)]
struct Entry {
    value: Bytes,
    generation: Generation,
    expires_at_ms: Option<u64>,
}

impl Entry {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|e| e > now_ms)
    }
}

impl Inner {
    fn live(&self, key: &str, now_ms: u64) -> Option<&Entry> {
        self.map.get(key).filter(|e| e.live(now_ms))
    }

    fn next_generation(&mut self) -> Generation {
        self.last_generation += 1;
        Generation::new(self.last_generation)
    }
}

impl MemoryStore {
    /// An empty store with default [`Limits`].
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store with these limits.
    pub fn with_limits(limits: Limits) -> Self {
        Self { inner: Arc::default(), limits, clock: Clock::System }
    }

    /// An empty store whose TTLs run on tokio's clock instead of the system's, for tests with paused time
    /// (`#[tokio::test(start_paused = true)]`): `tokio::time::advance` makes a lease lapse exactly when the test
    /// says. Expiry instants it reports are the system time at creation plus tokio's elapsed time. Must be
    /// called inside a tokio runtime.
    pub fn with_tokio_clock() -> Self {
        let clock =
            Clock::Tokio { origin_ms: system_time_to_millis(SystemTime::now()), start: tokio::time::Instant::now() };
        Self { inner: Arc::default(), limits: Limits::default(), clock }
    }

    /// An empty store whose clock (for TTLs and [`Store::now`]) is the system's plus `offset_ms` milliseconds
    /// (negative: behind), for tests of clients whose clock is off the store's (`idem once`'s skew
    /// tolerance).
    #[cfg(feature = "testing")]
    pub fn with_clock_offset(offset_ms: i64) -> Self {
        Self { inner: Arc::default(), limits: Limits::default(), clock: Clock::Offset { ms: offset_ms } }
    }

    /// An empty store whose clock (for TTLs and [`Store::now`]) stands at `start_ms` (milliseconds since the
    /// Unix epoch) until the returned [`ManualClock`] moves it: tests of schedules and leases that jump
    /// through time instead of sleeping through it. Leases lapse only when the test moves the clock past them.
    #[cfg(feature = "testing")]
    pub fn with_manual_clock(start_ms: u64) -> (Self, ManualClock) {
        let clock = ManualClock::default();
        clock.set_ms(start_ms);
        (Self { inner: Arc::default(), limits: Limits::default(), clock: Clock::Manual(clock.clone()) }, clock)
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the map consistent (every mutation is a single insert or remove),
        // so a poisoned lock is safe to keep using.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for MemoryStore {
    fn limits(&self) -> &Limits {
        &self.limits
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        self.limits.check_key(key)?;
        let inner = self.lock();
        Ok(inner
            .live(key, self.now_ms())
            .map(|e| Versioned::new(e.value.clone(), e.generation, e.expires_at_ms.map(millis_to_system_time))))
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        self.limits.check_put(key, &value, &ttl)?;
        let now = self.now_ms();
        let mut inner = self.lock();
        let current = inner.live(key, now);
        precondition.check(current.map(|e| e.generation))?;
        let expires_at_ms = ttl.expiry_millis(now, current.and_then(|e| e.expires_at_ms));
        let created = current.is_none();
        let generation = inner.next_generation();
        inner.map.insert(key.to_owned(), Entry { value, generation, expires_at_ms });
        Ok(Written::new(generation, created))
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        self.limits.check_key(key)?;
        let now = self.now_ms();
        let mut inner = self.lock();
        let current = inner.live(key, now).map(|e| e.generation);
        precondition.check(current)?;
        inner.map.remove(key);
        Ok(current)
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        if !(1..=1000).contains(&limit) {
            return Err(Error::InvalidArgument { what: "limit" });
        }
        let now = self.now_ms();
        let inner = self.lock();
        let start = match cursor {
            Some(c) if c >= prefix => std::ops::Bound::Excluded(c.to_owned()),
            _ => std::ops::Bound::Included(prefix.to_owned()),
        };
        let items: Vec<ListItem> = inner
            .map
            .range((start, std::ops::Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter(|(_, e)| e.live(now))
            .take(limit + 1)
            .map(|(k, e)| ListItem { key: k.clone(), generation: e.generation, expires_at_ms: e.expires_at_ms })
            .collect();
        Ok(Page::from_fetched(items, limit))
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        self.limits.check_set_change(key, &change)?;
        let now = self.now_ms();
        let fingerprint = change.dedupe_id.as_ref().map(|_| change.fingerprint());
        let mut inner = self.lock();
        inner.set_dedupe.retain(|_, (_, _, until)| *until > now);
        if let Some(id) = &change.dedupe_id
            && let Some((first, seen, _)) = inner.set_dedupe.get(&(key.to_owned(), id.clone()))
        {
            if Some(seen) != fingerprint.as_ref() {
                return Err(Error::DedupeIdReused { key: key.to_owned(), dedupe_id: id.clone() });
            }
            return Ok(SetOutcome { applied: false, ..*first });
        }
        let current = inner.live(key, now).cloned();
        let applied = apply_set(current.as_ref().map(|e| e.value.as_ref()), &change)?;
        let mut generation = current.as_ref().map(|e| e.generation);
        if applied.changed {
            match applied.value {
                Some(value) => {
                    self.limits.check_value(&value)?;
                    let g = inner.next_generation();
                    let expires_at_ms = current.and_then(|e| e.expires_at_ms);
                    inner.map.insert(key.to_owned(), Entry { value, generation: g, expires_at_ms });
                    generation = Some(g);
                }
                None => {
                    inner.map.remove(key);
                    generation = None;
                }
            }
        }
        let outcome = SetOutcome {
            generation,
            members: applied.members,
            added: applied.added,
            removed: applied.removed,
            applied: true,
        };
        if let (Some(id), Some(fingerprint)) = (change.dedupe_id, fingerprint) {
            let until = now.saturating_add(self.limits.dedupe_retention().as_millis() as u64);
            inner.set_dedupe.insert((key.to_owned(), id), (outcome, fingerprint, until));
        }
        Ok(outcome)
    }

    /// The clock TTLs are judged by: the system's, or tokio's ([`MemoryStore::with_tokio_clock`]).
    async fn now(&self) -> Result<SystemTime, Error> {
        Ok(millis_to_system_time(self.now_ms()))
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        self.limits.check_counter(key, dedupe_id)?;
        let now = self.now_ms();
        let mut inner = self.lock();
        inner.dedupe.retain(|_, (_, _, until)| *until > now);
        if let Some(id) = dedupe_id
            && let Some((first, seen, _)) = inner.dedupe.get(&(key.to_owned(), id.to_owned()))
        {
            if *seen != delta {
                return Err(Error::DedupeIdReused { key: key.to_owned(), dedupe_id: id.to_owned() });
            }
            return Ok(CounterOutcome { applied: false, ..*first });
        }
        let current = inner.live(key, now).cloned();
        let applied = apply_counter(current.as_ref().map(|e| e.value.as_ref()), delta)?;
        let generation = inner.next_generation();
        let expires_at_ms = current.and_then(|e| e.expires_at_ms);
        inner.map.insert(key.to_owned(), Entry { value: applied.encode(), generation, expires_at_ms });
        let outcome = CounterOutcome { value: applied.value, generation, applied: true };
        if let Some(id) = dedupe_id {
            let until = now.saturating_add(self.limits.dedupe_retention().as_millis() as u64);
            inner.dedupe.insert((key.to_owned(), id.to_owned()), (outcome, delta, until));
        }
        Ok(outcome)
    }
}
