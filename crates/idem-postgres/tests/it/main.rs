//! `idem-postgres`'s integration tests, in one test binary (one binary per crate links the dependencies once).
//! They skip with a printed reason when `IDEM_TEST_POSTGRES_URL` is unset (conformance, migrations) or the
//! PostgreSQL server programs are missing (tls), unless `IDEM_TEST_REQUIRE_BACKENDS` is set.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod conformance;
mod generations;
mod migrations;
mod tls;
