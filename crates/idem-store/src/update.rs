use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use rand::Rng;

use crate::{Error, Generation, Precondition, Store, Ttl, Versioned};

/// What an [`update`](crate::StoreExt::update) closure wants done with the value it was shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<R> {
    /// Write this value, keeping the current expiry.
    Put(Bytes),
    /// Delete the value.
    Delete,
    /// Stop without writing, returning `R` to the caller.
    Abort(R),
}

/// What an update did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Updated<R> {
    /// Wrote a value with this generation, after `attempts` attempts (1 = no race lost).
    Put {
        /// The written value's generation.
        generation: Generation,
        /// Attempts used.
        attempts: u32,
    },
    /// Deleted the value (or found nothing to delete).
    Deleted {
        /// Attempts used.
        attempts: u32,
    },
    /// The closure aborted with this reason.
    Aborted(R),
}

/// How much of a backoff window ([`RetryPolicy::backoff`]) is drawn at random.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Jitter {
    /// Uniformly in `0..=window` ("full jitter", the default): contending writers spread out most.
    #[default]
    Full,
    /// Uniformly in `window/2..=window` ("equal jitter"): clients started together do not come back in one
    /// burst, and none comes back sooner than half the window.
    Equal,
    /// Exactly the window: a poll whose pauses are its schedule.
    None,
    /// Uniformly in `window..=window*3/2`: the window is a floor someone set (the runner's `--retry-delay`:
    /// two attempts that make an item poison are at least that far apart), and items that failed together
    /// still do not come back in one burst.
    Above,
}

/// Bounds of the retry loop: how many attempts, and the backoff between them. Every retry loop of idem takes
/// its pauses from one of these, each with its own base, cap and [`Jitter`].
///
/// Before attempt `n` (n >= 2) the loop sleeps a uniformly random time in
/// `0..=min(max_delay, base_delay * 2^(n-2))` ("full jitter"), so contending writers spread out instead of
/// colliding again in lockstep.
///
/// Within one process, updates of a key take turns once one of them has lost a race: the loser queues on a
/// per-key FIFO lock for its retries, and later updates of that key queue behind it until the queue drains.
/// Without that, a writer that just won goes straight back in while the losers sleep, and under a saturating
/// workload the losers starve whatever the bound. Across processes the compare-and-swap and the backoff
/// decide alone; for many machines on one hot key prefer the store's atomic set/counter operations, which
/// cannot lose a race at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    jitter: Jitter,
}

impl Default for RetryPolicy {
    /// 8 attempts, 2 ms base, 250 ms cap.
    fn default() -> Self {
        Self {
            max_attempts: 8,
            base_delay: Duration::from_millis(2),
            max_delay: Duration::from_millis(250),
            jitter: Jitter::Full,
        }
    }
}

impl RetryPolicy {
    /// The default policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the attempt bound (at least 1).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Sets the first backoff window.
    pub fn with_base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// Sets the largest backoff window.
    pub fn with_max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// Sets how much of each window is drawn at random ([`Jitter::Full`] unless set).
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The attempt bound.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff before attempt `attempt` (1-based; 0 for the first): drawn from the window
    /// `min(max_delay, base_delay * 2^(attempt-2))` as the policy's [`Jitter`] says.
    pub fn backoff(&self, attempt: u32) -> Duration {
        if attempt <= 1 {
            return Duration::ZERO;
        }
        let shift = (attempt - 2).min(20);
        let window = self.base_delay.saturating_mul(1 << shift).min(self.max_delay);
        let micros = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        let (least, most) = match self.jitter {
            Jitter::Full => (0, micros),
            Jitter::Equal => (micros / 2, micros),
            Jitter::None => (micros, micros),
            Jitter::Above => (micros, micros.saturating_add(micros / 2)),
        };
        Duration::from_micros(rand::rng().random_range(least..=most))
    }

    /// The pause after the `failures`-th failure in a row (1-based): [`backoff`](Self::backoff) before the
    /// attempt that follows it, so the first pause is `base_delay`'s window.
    pub fn pause_after(&self, failures: u32) -> Duration {
        self.backoff(failures.saturating_add(1))
    }
}

/// Keys on which an update in this process lost a race, each with the FIFO lock its updates queue on.
/// Keyed by key alone, across stores: two stores sharing a key name only share turns, never data.
static CONTENDED: LazyLock<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(Default::default);

/// Holding a turn on a contended key; the entry is removed when the last holder or waiter leaves.
struct Turn {
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Turn {
    /// Queues for a turn on `key`. With `create` false, only when the key is already contended.
    async fn take(key: &str, create: bool) -> Option<Turn> {
        let lock = {
            // The map is only touched briefly and never across an await, so a std mutex is right; a panic
            // while holding it leaves a consistent map.
            let mut map = CONTENDED.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(key) {
                Some(l) => l.clone(),
                None if create => map.entry(key.to_owned()).or_default().clone(),
                None => return None,
            }
        };
        let guard = lock.clone().lock_owned().await;
        Some(Turn { key: key.to_owned(), lock, guard: Some(guard) })
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = CONTENDED.lock().unwrap_or_else(|p| p.into_inner());
        // Two references left (the map's and ours) means nobody else holds or waits for this key.
        if Arc::strong_count(&self.lock) <= 2 {
            map.remove(&self.key);
        }
    }
}

pub(crate) async fn run<S, F, R>(store: &S, key: &str, mut f: F, policy: &RetryPolicy) -> Result<Updated<R>, Error>
where
    S: Store + ?Sized,
    F: FnMut(Option<&Versioned>) -> Decision<R> + Send,
    R: Send,
{
    // Queue behind updates of this key that already lost a race here, if any.
    let mut turn = Turn::take(key, false).await;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = store.get(key).await?;
        let precondition = match &current {
            Some(v) => Precondition::Generation(v.generation()),
            None => Precondition::Absent,
        };
        let result = match f(current.as_ref()) {
            Decision::Abort(r) => return Ok(Updated::Aborted(r)),
            Decision::Put(value) => store
                .put(key, value, precondition, Ttl::Keep)
                .await
                .map(|w| Updated::Put { generation: w.generation(), attempts: attempt }),
            Decision::Delete if current.is_none() => return Ok(Updated::Deleted { attempts: attempt }),
            Decision::Delete => store.delete(key, precondition).await.map(|_| Updated::Deleted { attempts: attempt }),
        };
        match result {
            Err(e) if e.is_precondition_failed() => {
                if attempt >= policy.max_attempts() {
                    tracing::warn!(key, attempts = attempt, "update exhausted its attempts");
                    return Err(Error::UpdateExhausted { attempts: attempt });
                }
                if turn.is_none() {
                    turn = Turn::take(key, true).await;
                }
                let delay = policy.backoff(attempt + 1);
                tracing::debug!(key, attempt, ?delay, current = ?e.current_generation(), "update lost a race; retrying");
                tokio::time::sleep(delay).await;
            }
            other => return other,
        }
    }
}
