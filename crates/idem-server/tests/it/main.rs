//! `idem-server`'s integration tests, in one test binary (one binary per crate links the dependencies once).
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod kv_api;
mod records;
mod shutdown;
mod unread_body;
