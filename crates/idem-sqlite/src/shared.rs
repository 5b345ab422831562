//! One SQLite store shared by several processes (`idem run`'s ledger), without weakening the store's one-writer lock.
//!
//! `SqliteStore::open` takes an exclusive lock on `<db>.lock` because its writer keeps the next generation in
//! memory: two processes writing one file at once would hand out the same generations. So processes take
//! turns instead: each holds the store only while it has ledger work, and gives it up
//!
//! - when it has been idle for [`IDLE_RELEASE`] (a runner whose items are all long commands, or a runner that
//!   is paused between heartbeats, then holds nothing), or
//! - as soon as no operation of its own is running while another process waits (waiters hold a shared lock
//!   on `<db>.want`, which the holder tests with a non-blocking exclusive lock after each operation), and
//!   after holding it [`TURN`] even if its operations keep coming.
//!
//! A turn therefore lasts one burst of operations, not the idle time after it: many processes on one file
//! (`idem once` jobs, each renewing a lease every third of it) each wait for the bursts of the others, not
//! for their idle tails (a tail of [`IDLE_RELEASE`] per turn starved 30 jobs with 3 s leases: about 8 turns a
//! second for the 30 renewals a second they need). Waiting is made fair enough by age: a process that has
//! waited [`STARVING`] holds a shared lock on `<db>.starving` as well, and a process that has waited less does
//! not try the file while that lock is held, so newcomers (a cron minute starting many invocations) cannot
//! keep taking turns ahead of a lease holder's renewal.
//!
//! Every open reads the highest generation on disk, and a close commits and checkpoints everything first, so
//! generations keep increasing across turns exactly as within one process. A process that dies mid-turn drops
//! its OS locks with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::SqliteStore;
use crate::lockfile;
use bytes::Bytes;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, Page, Precondition, SetChange, SetOutcome, Store, Ttl,
    Versioned, Written,
};
use tokio::sync::RwLock;

/// A holder with no ledger operation for this long closes the store so others can open it.
const IDLE_RELEASE: Duration = Duration::from_millis(100);
/// A holder that sees another process waiting gives the store up after holding it this long.
const TURN: Duration = Duration::from_millis(200);
/// How often a waiting process tries the lock again.
const RETRY: Duration = Duration::from_millis(5);
/// A process that has waited this long for its turn goes ahead of those that have waited less.
const STARVING: Duration = Duration::from_millis(250);
/// A holder whose lock file says it never takes turns ([`lockfile::EXCLUSIVE`]) is given this long to close
/// (it may be stopping, or be a turn-taker between its open and its mark) before the wait ends in
/// [`crate::Error::HeldElsewhere`].
const EXCLUSIVE_GRACE: Duration = Duration::from_secs(2);
/// The longest wait for a turn: turns last a burst of operations ([`TURN`] at most while others wait), so a
/// wait this long means a holder stopped (SIGSTOP) or hung; it ends in [`crate::Error::WaitedTooLong`], which
/// callers treat as the store being unavailable, rather than hanging every process of the machine with it.
const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// A SQLite store opened on demand and given up between bursts of use (see the module docs).
#[derive(Clone, Debug)]
pub struct SharedSqlite {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    limits: Limits,
    /// `None` while another process has its turn. Operations hold a read guard for their duration; giving
    /// the store up takes the write guard, so it waits for running operations and holds off new ones.
    slot: RwLock<Option<Held>>,
    /// Milliseconds since `epoch` of the last operation's end.
    last_used_ms: AtomicU64,
    epoch: Instant,
    want: PathBuf,
    /// `<db>.starving`: held (shared) by processes that have waited [`STARVING`] or more.
    starving: PathBuf,
    /// Operations of this process running now.
    running: AtomicUsize,
}

#[derive(Debug)]
struct Held {
    store: SqliteStore,
    since: Instant,
}

impl SharedSqlite {
    /// Opens (and holds) the store at `path` once, so a bad path is reported at start-up, and starts the task
    /// that gives it up when idle or when another process waits.
    ///
    /// # Errors
    /// What `SqliteStore::open` fails with, except that a store in use by another process is waited for.
    pub async fn open(path: &Path, limits: Limits) -> Result<Self, crate::Error> {
        let beside = |suffix: &str| {
            let mut p = path.as_os_str().to_owned();
            p.push(suffix);
            PathBuf::from(p)
        };
        let inner = Arc::new(Inner {
            path: path.to_owned(),
            limits,
            slot: RwLock::new(None),
            last_used_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            want: beside(".want"),
            starving: beside(".starving"),
            running: AtomicUsize::new(0),
        });
        let store = open_waiting(&inner).await?;
        *inner.slot.write().await = Some(Held { store, since: Instant::now() });
        tokio::spawn(yield_turns(Arc::downgrade(&inner)));
        Ok(Self { inner })
    }

    /// Gives the store up for good (commits, checkpoints, unlocks).
    pub async fn close(&self) {
        if let Some(held) = self.inner.slot.write().await.take() {
            held.store.close().await;
        }
    }

    /// Runs `op` on the open store, opening it first (waiting for our turn) if needed.
    async fn with<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(SqliteStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let read = self.inner.slot.read().await;
        let guard = if read.is_some() {
            read
        } else {
            drop(read);
            let mut slot = self.inner.slot.write().await;
            // Another operation of this process may have opened it while we waited for the write guard.
            if slot.is_none() {
                let store = open_waiting(&self.inner).await.map_err(StoreError::unavailable)?;
                *slot = Some(Held { store, since: Instant::now() });
            }
            slot.downgrade()
        };
        let Some(held) = guard.as_ref() else { return Err(StoreError::Closed) };
        self.inner.running.fetch_add(1, Ordering::SeqCst);
        let result = op(held.store.clone()).await;
        self.inner.last_used_ms.store(self.inner.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        let last = self.inner.running.fetch_sub(1, Ordering::SeqCst) == 1;
        drop(guard);
        // The last operation of a burst ends the turn at once when another process waits.
        if last && someone_waits(&self.inner.want) {
            give_up(&self.inner).await;
        }
        result
    }
}

/// Opens the store, waiting while another process holds it; while waiting, holds a shared lock on `want` so
/// the holder knows to give it up, and after [`STARVING`] one on `starving` too, which keeps processes that
/// have waited less from trying the file meanwhile.
async fn open_waiting(inner: &Inner) -> Result<SqliteStore, crate::Error> {
    let mut flag: Option<std::fs::File> = None;
    let mut starving: Option<std::fs::File> = None;
    let since = Instant::now();
    let mut exclusive_since: Option<Instant> = None;
    loop {
        if starving.is_some() || !someone_waits(&inner.starving) {
            // Opening waits out SQLite's busy timeout while another connection holds the file locked (a backup,
            // a stray `sqlite3` shell): on the blocking pool, not on a runtime thread, which would stall every
            // task it runs meanwhile (a runner stopped noticing its commands' exits for seconds).
            let (path, limits) = (inner.path.clone(), inner.limits);
            let opened = match tokio::task::spawn_blocking(move || SqliteStore::open(&path, limits)).await {
                Ok(opened) => opened,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Only a runtime shutting down cancels a blocking task.
                Err(_) => Err(crate::Error::Store(idem_store::Error::Closed)),
            };
            match opened {
                Ok(store) => {
                    store.mark_shared();
                    return Ok(store);
                }
                Err(crate::Error::InUse { path, lock }) => {
                    let holder = lockfile::holder(&lock).unwrap_or_else(|| "unknown".into());
                    if holder.starts_with(lockfile::EXCLUSIVE) {
                        if exclusive_since.get_or_insert_with(Instant::now).elapsed() >= EXCLUSIVE_GRACE {
                            return Err(crate::Error::HeldElsewhere { path, holder });
                        }
                    } else {
                        exclusive_since = None;
                    }
                    if since.elapsed() >= WAIT_LIMIT {
                        return Err(crate::Error::WaitedTooLong { path, holder, waited_s: since.elapsed().as_secs() });
                    }
                }
                Err(e) => return Err(e),
            }
        }
        if flag.is_none() {
            flag = lock_shared(&inner.want);
        }
        if starving.is_none() && since.elapsed() >= STARVING {
            starving = lock_shared(&inner.starving);
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// A shared lock on `path` (created if needed), held while the file stays open; `None` when it cannot be had
/// now (only during another process's instant test: the next round tries again).
fn lock_shared(path: &Path) -> Option<std::fs::File> {
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).ok()?;
    file.try_lock_shared().ok()?;
    Some(file)
}

/// True when some process holds the shared "I am waiting" lock on `want`.
fn someone_waits(want: &Path) -> bool {
    let Ok(file) = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(want) else {
        return false;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            false
        }
        Err(_) => true,
    }
}

/// Gives the store up when idle or when another process waits; ends when the store is dropped.
async fn yield_turns(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let Some(inner) = inner.upgrade() else { return };
        let (held_for, idle_for) = {
            let slot = inner.slot.read().await;
            let Some(held) = slot.as_ref() else { continue };
            let last = Duration::from_millis(inner.last_used_ms.load(Ordering::Relaxed));
            (held.since.elapsed(), inner.epoch.elapsed().saturating_sub(last))
        };
        let between_operations = inner.running.load(Ordering::SeqCst) == 0;
        let hand_over =
            idle_for >= IDLE_RELEASE || ((held_for >= TURN || between_operations) && someone_waits(&inner.want));
        if hand_over {
            give_up(&inner).await;
            // Let a waiting process in before this one tries again.
            tokio::time::sleep(RETRY * 4).await;
        }
    }
}

/// Closes the store (commits, checkpoints) and drops its lock file, so another process can open it; waits
/// for this process's running operations first (the write guard).
async fn give_up(inner: &Inner) {
    let taken = inner.slot.write().await.take();
    if let Some(held) = taken {
        held.store.close().await;
        // Dropping the last handle releases `<db>.lock`.
        drop(held);
    }
}

impl Store for SharedSqlite {
    fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.with(|s| async move { s.get(key).await }).await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, StoreError> {
        self.with(|s| async move { s.get_many(keys).await }).await
    }

    /// This machine's clock, as the file's every opener judges expiry by it; no turn is taken for it.
    async fn now(&self) -> Result<std::time::SystemTime, StoreError> {
        Ok(std::time::SystemTime::now())
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        self.with(|s| async move { s.put(key, value, precondition, ttl).await }).await
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        self.with(|s| async move { s.delete(key, precondition).await }).await
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        self.with(|s| async move { s.list(prefix, cursor, limit).await }).await
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        self.with(|s| async move { s.set_change(key, change).await }).await
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        self.with(|s| async move { s.counter_add(key, delta, dedupe_id).await }).await
    }
}
