use std::future::Future;
use std::time::SystemTime;

use bytes::Bytes;

use crate::update::{self, Decision, RetryPolicy, Updated};
use crate::{
    CounterOutcome, Error, Generation, Limits, Page, Precondition, SetChange, SetOutcome, Ttl, Versioned, Written,
};

/// The primitives every backend provides.
///
/// # Contract
/// - Every successful write (put, a set change that changed something, an applied counter add) gets a
///   [`Generation`] greater than every generation the store handed out before, also for other keys and also after
///   a delete; generations are never reused.
/// - A value whose expiry has passed (by the store's clock) reads as absent at once, satisfies
///   [`Precondition::Absent`] and is not listed; a sweeper removes it later.
/// - A write is acknowledged only once it is durable as far as the backend promises (SQLite: fsynced).
/// - Invalid input ([`Limits`]) is refused before anything is written.
/// - A failed precondition writes nothing and returns [`Error::PreconditionFailed`] with the current generation.
pub trait Store: Send + Sync + 'static {
    /// The limits this store enforces.
    fn limits(&self) -> &Limits;

    /// Reads the live value under `key`; `Ok(None)` when absent or expired.
    ///
    /// # Errors
    /// [`Error::InvalidKey`]; [`Error::Unavailable`] / [`Error::Backend`] from the backend.
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Versioned>, Error>> + Send;

    /// Reads the live values under `keys`, in the same order; `None` where absent or expired. Each value is as
    /// [`Store::get`] would return it, though the reads need not share one snapshot. A backend may answer
    /// in one round trip (the work runner checks thousands of finished items this way); this default reads
    /// one key at a time.
    ///
    /// # Errors
    /// As [`Store::get`], for the first key that fails.
    fn get_many(&self, keys: &[String]) -> impl Future<Output = Result<Vec<Option<Versioned>>, Error>> + Send {
        async move {
            let mut out = Vec::with_capacity(keys.len());
            for key in keys {
                out.push(self.get(key).await?);
            }
            Ok(out)
        }
    }

    /// Writes `value` under `key` if `precondition` holds, with the expiry `ttl` says.
    ///
    /// # Errors
    /// [`Error::PreconditionFailed`]; [`Error::InvalidKey`], [`Error::ValueTooLarge`], [`Error::InvalidTtl`];
    /// backend errors.
    fn put(
        &self,
        key: &str,
        value: Bytes,
        precondition: Precondition,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Written, Error>> + Send;

    /// Deletes the live value under `key` if `precondition` holds. Returns the deleted value's generation, or
    /// `None` when there was nothing to delete (which is not an error under [`Precondition::Any`]).
    ///
    /// # Errors
    /// [`Error::PreconditionFailed`]; [`Error::InvalidKey`]; backend errors.
    fn delete(
        &self,
        key: &str,
        precondition: Precondition,
    ) -> impl Future<Output = Result<Option<Generation>, Error>> + Send;

    /// Lists live keys starting with `prefix` in ascending byte order, at most `limit` (1..=1000) per page,
    /// starting after `cursor` (the previous page's `next_cursor`).
    ///
    /// A key that stays live during a whole paged listing appears exactly once, whatever else is written meanwhile.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `limit` outside 1..=1000; backend errors.
    fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> impl Future<Output = Result<Page, Error>> + Send;

    /// Adds and removes set members in one atomic step (see [`SetChange`] for the stored form). The TTL is kept.
    ///
    /// With a `change.dedupe_id`, the id is remembered with the change's [`SetChange::fingerprint`] and the
    /// outcome for [`Limits::dedupe_retention`]: a repeat with the same fingerprint changes nothing and returns
    /// the first outcome with `applied: false`; a different change under the id is refused. Like an
    /// `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header §2.2, §2.7), at most one change is ever
    /// applied per key and id, also when two arrive at once.
    ///
    /// # Errors
    /// [`Error::DedupeIdReused`] for another change under a remembered id; [`Error::WrongType`] when the value is
    /// not a set; [`Error::InvalidKey`], [`Error::InvalidArgument`] for a member or dedupe id outside 1..=255
    /// bytes, [`Error::ValueTooLarge`]; backend errors.
    fn set_change(&self, key: &str, change: SetChange) -> impl Future<Output = Result<SetOutcome, Error>> + Send;

    /// Adds `delta` to the counter under `key` (absent counts as 0) in one atomic step. With a `dedupe_id`, the
    /// id is remembered with the delta and the outcome for [`Limits::dedupe_retention`]: a repeat with the same
    /// delta changes nothing and returns the first result with `applied: false`; another delta under the id is
    /// refused. At most one add is ever applied per key and id, also when two arrive at once.
    ///
    /// # Errors
    /// [`Error::DedupeIdReused`] for another delta under a remembered id; [`Error::WrongType`],
    /// [`Error::CounterOverflow`], [`Error::InvalidArgument`] for a dedupe id outside 1..=255 bytes; backend
    /// errors.
    fn counter_add(
        &self,
        key: &str,
        delta: i64,
        dedupe_id: Option<&str>,
    ) -> impl Future<Output = Result<CounterOutcome, Error>> + Send;

    /// The store's clock: the time by which it judges expiry (a [`Ttl::After`] counts from it), read now.
    ///
    /// A backend on a server of its own answers with the server's clock (PostgreSQL `now()`, Redis `TIME`),
    /// so processes on several machines sharing the store agree on the time whatever their own clocks say;
    /// this default, for a store in this process (SQLite, memory), is this machine's clock. Wrappers must
    /// forward it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] / [`Error::Backend`] from the backend.
    fn now(&self) -> impl Future<Output = Result<SystemTime, Error>> + Send {
        std::future::ready(Ok(SystemTime::now()))
    }
}

/// Helpers built on [`Store`]'s primitives, for every store.
pub trait StoreExt: Store {
    /// Read-modify-write without lost updates: reads `key`, calls `f` with the live value, writes its
    /// [`Decision`] conditioned on the generation read (keeping the TTL), and on a lost race re-reads and calls
    /// `f` again, up to `policy`'s attempts with exponential backoff and full jitter between them.
    ///
    /// # Errors
    /// [`Error::UpdateExhausted`] with the attempt count when every attempt lost the race; any other error from
    /// the store at once, without retrying.
    fn update<F, R>(
        &self,
        key: &str,
        f: F,
        policy: &RetryPolicy,
    ) -> impl Future<Output = Result<Updated<R>, Error>> + Send
    where
        F: FnMut(Option<&Versioned>) -> Decision<R> + Send,
        R: Send,
    {
        update::run(self, key, f, policy)
    }

    /// Performs `write` as given: its put (returning the new generation) or delete (returning `None`), only
    /// if its precondition holds. The fencing token of a lease is such a precondition: a holder that lost the
    /// lease gets [`Error::PreconditionFailed`] instead of overwriting its successor.
    ///
    /// # Errors
    /// As [`Store::put`] and [`Store::delete`].
    fn apply(&self, write: crate::Write) -> impl Future<Output = Result<Option<Generation>, Error>> + Send
    where
        Self: Sync,
    {
        async move {
            match write.op {
                crate::WriteOp::Put { value, ttl } => {
                    self.put(&write.key, value, write.precondition, ttl).await.map(|w| Some(w.generation()))
                }
                crate::WriteOp::Delete => self.delete(&write.key, write.precondition).await.map(|_| None),
            }
        }
    }
}

impl<S: Store + ?Sized> StoreExt for S {}
