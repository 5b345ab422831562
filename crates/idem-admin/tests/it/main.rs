//! `idem-admin`'s integration tests, in one binary.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod listing;
