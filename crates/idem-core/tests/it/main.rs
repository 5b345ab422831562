//! `idem-core`'s integration tests, in one test binary.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod holders;
mod slots;
