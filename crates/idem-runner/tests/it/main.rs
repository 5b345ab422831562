//! The runner's own tests, in one binary (each test file its own binary linked the whole dependency tree
//! again, and ran its slow tests after the previous file's had finished instead of beside them).
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod layers;
mod once_clock;
mod once_controls;
mod once_faults;
mod once_races;
mod once_schedules;
mod run_checks;
mod run_concurrency;
mod run_harness;
mod run_outputs;
mod run_poison;
mod run_retries;
mod slow_ledger;
