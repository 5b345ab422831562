//! The behaviour every backend must show, as async checks that panic on a violation.
//!
//! Backends run all of them with [`conformance_tests!`](crate::conformance_tests). Every check works under its
//! own random key prefix, so several checks (and several test processes) can share one database.
//! Concurrency is real: checks that race spawn tasks on the caller's multi-threaded runtime and count exactly.

// Test-support code: a panic is how a check reports a violation.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;

use crate::{Decision, Error, Generation, Precondition, RetryPolicy, SetChange, Store, StoreExt, Ttl, Updated};

/// Expands to one `#[tokio::test]` per conformance check.
///
/// `$make` is an async closure returning `Option<(store, guard)>`: `None` skips the test (print the reason
/// first, e.g. an unset `IDEM_TEST_POSTGRES_URL`); the guard (a temporary directory, say) lives as long as the
/// test. The store must be `Clone` so checks can hand it to spawned tasks.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            preconditions_on_put, preconditions_on_delete, expired_keys_read_absent, generations_never_reused,
            ttl_keep_and_clear, list_pages_while_writing, update_under_contention, raw_cas_under_contention, counter_dedupe_under_contention,
            set_changes_under_contention, limits_refuse_bad_input, matches_btreemap_model, get_many_matches_get,
            counter_dedupe_refuses_another_delta, set_dedupe_replays_and_refuses, dedupe_reuse_under_contention,
            refusals_carry_the_generation_that_refused, clock_judges_expiry);
    };
    (@each $make:expr; $($check:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let Some((store, _guard)) = ($make)().await else { return };
                $crate::conformance::$check(&store).await;
            }
        )*
    };
}

pub(super) fn prefix(check: &str) -> String {
    format!("conformance/{check}/{:016x}/", rand::random::<u64>())
}

pub(super) fn gen_of(e: Error) -> Option<Generation> {
    match e {
        Error::PreconditionFailed { current } => current,
        other => panic!("expected a failed precondition, got {other:?}"),
    }
}

pub(super) async fn ok_put<S: Store>(s: &S, key: &str, v: &str, pre: Precondition, ttl: Ttl) -> Generation {
    s.put(key, Bytes::from(v.to_owned()), pre, ttl).await.expect("put").generation()
}

mod contention;
mod failover;

pub use failover::{FailoverTally, writes_through_failover};
mod dedupe;
mod kv;
mod model;

pub use contention::{
    counter_dedupe_under_contention, raw_cas_under_contention, refusals_carry_the_generation_that_refused,
    set_changes_under_contention, update_under_contention,
};
pub use dedupe::{
    counter_dedupe_refuses_another_delta, dedupe_reuse_under_contention, limits_refuse_bad_input,
    set_dedupe_replays_and_refuses,
};
pub use kv::{
    clock_judges_expiry, expired_keys_read_absent, generations_never_reused, get_many_matches_get,
    list_pages_while_writing, preconditions_on_delete, preconditions_on_put, ttl_keep_and_clear,
};
pub use model::matches_btreemap_model;
