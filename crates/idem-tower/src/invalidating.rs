//! A store whose writes also leave a layer's replay cache: what a server that exposes the layer's store
//! (an admin API, an operator's tool) must write through, so a record deleted or overwritten there is not
//! replayed from memory afterwards.

use bytes::Bytes;
use idem_store::{
    CounterOutcome, Error as StoreError, Generation, Limits, Page, Precondition, SetChange, SetOutcome, Store, Ttl,
    Versioned, Written,
};

use crate::IdempotencyLayer;

/// `store` as seen by writers outside the layer: every write also drops its key from `layer`'s replay cache
/// ([`IdempotencyLayer::invalidate`]), so an operator's delete of a record is not undone by a cached copy.
/// Reads pass through. Cheap to clone when the store is.
pub struct InvalidatingStore<St> {
    store: St,
    layer: IdempotencyLayer<St>,
}

impl<St: Clone> Clone for InvalidatingStore<St> {
    fn clone(&self) -> Self {
        Self { store: self.store.clone(), layer: self.layer.clone() }
    }
}

impl<St> std::fmt::Debug for InvalidatingStore<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvalidatingStore").finish_non_exhaustive()
    }
}

impl<St: Store + Clone + 'static> InvalidatingStore<St> {
    /// Writes to `store` (the one `layer` keeps its records in) that invalidate `layer`'s replay cache.
    pub fn new(store: St, layer: IdempotencyLayer<St>) -> Self {
        Self { store, layer }
    }

    /// Runs `write`, then drops `key` from the replay cache, as one task: a client that hangs up mid-request
    /// drops this future, and must not leave the store changed but the cached copy in place. Invalidating only
    /// after the write: a replay that read the old record meanwhile then drops its copy (the cache refuses
    /// inserts whose read predates an invalidation), and a hit before the write lands answers what the store
    /// still holds.
    async fn then_invalidate<T: Send + 'static>(
        &self,
        key: &str,
        write: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (layer, key) = (self.layer.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            let result = write.await;
            layer.invalidate(&key);
            result
        });
        task.await.unwrap_or_else(|e| Err(StoreError::unavailable(format!("the write's task failed: {e}"))))
    }
}

impl<St: Store + Clone + 'static> Store for InvalidatingStore<St> {
    fn limits(&self) -> &Limits {
        self.store.limits()
    }

    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.store.get(key).await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, StoreError> {
        self.store.get_many(keys).await
    }

    async fn now(&self) -> Result<std::time::SystemTime, StoreError> {
        self.store.now().await
    }

    async fn put(&self, key: &str, value: Bytes, precondition: Precondition, ttl: Ttl) -> Result<Written, StoreError> {
        let (store, k) = (self.store.clone(), key.to_owned());
        self.then_invalidate(key, async move { store.put(&k, value, precondition, ttl).await }).await
    }

    async fn delete(&self, key: &str, precondition: Precondition) -> Result<Option<Generation>, StoreError> {
        let (store, k) = (self.store.clone(), key.to_owned());
        self.then_invalidate(key, async move { store.delete(&k, precondition).await }).await
    }

    async fn list(&self, prefix: &str, cursor: Option<&str>, limit: usize) -> Result<Page, StoreError> {
        self.store.list(prefix, cursor, limit).await
    }

    async fn set_change(&self, key: &str, change: SetChange) -> Result<SetOutcome, StoreError> {
        let (store, k) = (self.store.clone(), key.to_owned());
        self.then_invalidate(key, async move { store.set_change(&k, change).await }).await
    }

    async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, StoreError> {
        let (store, k, id) = (self.store.clone(), key.to_owned(), dedupe_id.map(str::to_owned));
        self.then_invalidate(key, async move { store.counter_add(&k, delta, id.as_deref()).await }).await
    }
}
