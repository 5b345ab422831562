//! `idem-redis`'s integration tests, in one test binary (one binary per crate links the dependencies once).
//! They skip with a printed reason when `IDEM_TEST_REDIS_URL` is unset (conformance) or `redis-server` is
//! missing (tls), unless `IDEM_TEST_REQUIRE_BACKENDS` is set.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod conformance;
mod ha;
mod switchover;
mod tls;
