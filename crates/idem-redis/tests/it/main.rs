//! `idem-redis`'s integration tests, in one test binary (one binary per crate links the dependencies once).
//! They skip with a printed reason when `IDEM_TEST_REDIS_URL` is unset (conformance) or `redis-server` is
//! missing (tls), unless `IDEM_TEST_REQUIRE_BACKENDS` is set.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod conformance;
mod ha;
mod switchover;
mod tls;

/// Prints what a run through a failover counted and asserts every acknowledged write is present.
pub(crate) fn assert_none_lost(tally: &idem_store::conformance::FailoverTally) {
    eprintln!(
        "acknowledged {}, present {}, lost {}, unavailable {}",
        tally.acknowledged,
        tally.present,
        tally.lost.len(),
        tally.unavailable
    );
    assert_eq!(
        (tally.present, tally.lost.len()),
        (tally.acknowledged, 0),
        "acknowledged writes lost: {:?}",
        tally.lost
    );
}
