//! A conditional write as a value: produced by a state machine that does no I/O (the idempotency record's,
//! the work ledger's in `idem-core`), performed by whoever holds a store ([`StoreExt::apply`]).
//!
//! [`StoreExt::apply`]: crate::StoreExt::apply

use bytes::Bytes;

use crate::{Precondition, Ttl};

/// A store write, to be performed as given: `op` on `key`, only if `precondition` holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Write {
    /// The record's store key.
    pub key: String,
    /// Put or delete.
    pub op: WriteOp,
    /// The condition; after the claim always `Generation(fencing token)` or `Absent`.
    pub precondition: Precondition,
}

/// The operation of a [`Write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOp {
    /// Store `value` with `ttl`.
    Put {
        /// The encoded value (an idempotency record, a ledger entry or a slot, a lease's owner token).
        value: Bytes,
        /// How long it lives: for a lease its length, for a finished record the retention.
        ttl: Ttl,
    },
    /// Remove the record (release).
    Delete,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{Generation, MemoryStore, StoreExt};

    #[tokio::test]
    async fn apply_puts_and_deletes_only_under_its_precondition() {
        let store = MemoryStore::new();
        let put = |precondition| Write {
            key: "k".into(),
            op: WriteOp::Put { value: Bytes::from_static(b"v"), ttl: Ttl::Keep },
            precondition,
        };
        let first = store.apply(put(Precondition::Absent)).await.unwrap().unwrap();
        // A stale fencing token is refused: the holder that lost the lease cannot overwrite its successor.
        let second = store.apply(put(Precondition::Generation(first))).await.unwrap().unwrap();
        let stale = store.apply(put(Precondition::Generation(first))).await.unwrap_err();
        assert!(stale.is_precondition_failed(), "{stale}");
        let delete = Write { key: "k".into(), op: WriteOp::Delete, precondition: Precondition::Generation(second) };
        assert_eq!(store.apply(delete).await.unwrap(), None);
        assert!(second > first && second != Generation::new(0));
    }
}
