//! A store wrapper that injects faults, for tests that must drive a lease keeper, a takeover or a fence through
//! a failing store deterministically (feature `testing`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::{
    CounterOutcome, Error, Generation, Limits, Page, Precondition, SetChange, SetOutcome, Store, Ttl, Versioned,
    Written,
};

/// What happens to one operation of a [`FaultyStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Not performed; answered [`Error::Unavailable`] at once.
    Fail,
    /// Performed, then answered [`Error::Unavailable`]: the write landed but its caller cannot know (a timeout
    /// after the commit, a connection lost before the reply).
    LoseAnswer,
    /// Performed after this long (tokio's clock), then answered as the inner store answered.
    Delay(Duration),
    /// Never answered (pending until the caller drops it); not performed.
    Hang,
}

/// The kind of a store operation, as a fault rule sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// [`Store::get`] (and each key of the default [`Store::get_many`]).
    Get,
    /// [`Store::put`].
    Put,
    /// [`Store::delete`].
    Delete,
    /// [`Store::list`].
    List,
    /// [`Store::set_change`].
    SetChange,
    /// [`Store::counter_add`].
    CounterAdd,
}

/// One operation as offered to the fault rule.
#[derive(Clone, Copy, Debug)]
pub struct Operation<'a> {
    /// 0 for the store's first operation, counting every kind.
    pub index: u64,
    /// What it is.
    pub kind: OpKind,
    /// The key it names (the prefix for a listing).
    pub key: &'a str,
    /// The value a put writes.
    pub value: Option<&'a Bytes>,
    /// The precondition of a put or delete.
    pub precondition: Option<Precondition>,
}

type Rule = dyn FnMut(&Operation<'_>) -> Option<Fault> + Send;

/// Wraps a store and asks a rule, before each operation, whether to inject a [`Fault`]: fail the N-th
/// operation, apply a write but lose its answer, delay it, or never answer. Cloning gives another handle to
/// the same store, rule and count.
///
/// ```
/// use idem_store::testing::{Fault, FaultyStore, OpKind};
/// use idem_store::{MemoryStore, Precondition, Store, Ttl};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // Every put lands, but its caller is told the store was unavailable.
/// let store = FaultyStore::new(MemoryStore::new(), |op| (op.kind == OpKind::Put).then_some(Fault::LoseAnswer));
/// assert!(store.put("k", "v".into(), Precondition::Any, Ttl::Keep).await.is_err());
/// assert!(store.get("k").await.unwrap().is_some());
/// # });
/// ```
#[derive(Clone)]
pub struct FaultyStore<S> {
    inner: S,
    rule: Arc<Mutex<Box<Rule>>>,
    count: Arc<AtomicU64>,
    injected: Arc<AtomicU64>,
}

impl<S: Store> FaultyStore<S> {
    /// `inner` behind `rule`, which sees every operation in the order they reach the store.
    pub fn new(inner: S, rule: impl FnMut(&Operation<'_>) -> Option<Fault> + Send + 'static) -> Self {
        Self { inner, rule: Arc::new(Mutex::new(Box::new(rule))), count: Arc::default(), injected: Arc::default() }
    }

    /// Replaces the rule; the operation count goes on.
    pub fn set_rule(&self, rule: impl FnMut(&Operation<'_>) -> Option<Fault> + Send + 'static) {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner()) = Box::new(rule);
    }

    /// The store behind the faults (to inspect what really landed).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Operations seen so far, of every kind.
    pub fn operations(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    fn fault(
        &self,
        kind: OpKind,
        key: &str,
        value: Option<&Bytes>,
        precondition: Option<Precondition>,
    ) -> Option<Fault> {
        let index = self.count.fetch_add(1, Ordering::Relaxed);
        let operation = Operation { index, kind, key, value, precondition };
        let fault = (self.rule.lock().unwrap_or_else(|p| p.into_inner()))(&operation);
        if fault.is_some() {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        fault
    }

    /// Runs `op` under the fault the rule picks.
    async fn run<T>(&self, fault: Option<Fault>, op: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match fault {
            None => op.await,
            Some(Fault::Fail) => Err(injected("failed")),
            Some(Fault::LoseAnswer) => {
                let _ = op.await;
                Err(injected("answer lost"))
            }
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                op.await
            }
            Some(Fault::Hang) => std::future::pending().await,
        }
    }
}

fn injected(what: &str) -> Error {
    Error::Unavailable { source: format!("injected fault: {what}").into() }
}

impl<S: Store> Store for FaultyStore<S> {
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, Error> {
        self.run(self.fault(OpKind::Get, key, None, None), self.inner.get(key)).await
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, Error> {
        let fault = self.fault(OpKind::Put, key, Some(&value), Some(precondition));
        self.run(fault, self.inner.put(key, value, precondition, ttl)).await
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, Error> {
        self.run(self.fault(OpKind::Delete, key, None, Some(precondition)), self.inner.delete(key, precondition)).await
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, Error> {
        self.run(self.fault(OpKind::List, prefix, None, None), self.inner.list(prefix, cursor, limit)).await
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, Error> {
        self.run(self.fault(OpKind::SetChange, key, None, None), self.inner.set_change(key, change)).await
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        self.run(self.fault(OpKind::CounterAdd, key, None, None), self.inner.counter_add(key, delta, dedupe_id)).await
    }

    async fn now(&self) -> Result<std::time::SystemTime, Error> {
        self.inner.now().await
    }
}
