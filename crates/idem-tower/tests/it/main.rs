//! idem-tower's integration tests, in one test binary (one per crate, as elsewhere in the workspace).
//! Filter by module: `cargo test -p idem-tower --test it layer::`.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod axum_orders;
mod backends;
mod layer;
mod routes;
mod takeover;

#[allow(dead_code, clippy::unwrap_used)]
#[path = "../../../idem/examples/upstream.rs"]
mod upstream;
