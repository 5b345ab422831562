//! `idem-store`'s integration tests, in one test binary (one binary per crate links the dependencies once).
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod lease;
mod memory_conformance;
mod update;
