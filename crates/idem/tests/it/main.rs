//! The `idem` binary's integration tests, in one test binary: each module was a binary of its own, and every
//! one of them linked tokio, hyper, reqwest and the stores again (issue 19: one binary per crate cut the cold
//! `cargo test --workspace`). Filter by module: `cargo test -p idem --test it proxy::`.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod admin_ui;
mod backend_restart;
mod check;
mod cli;
mod client_limits;
mod common;
mod crash;
mod idle;
mod once;
mod proxy;
mod proxy_tls;
mod proxy_wire;
mod queues;
mod readme;
mod replication;
mod run;
mod run_named;
mod run_pipe;
mod send;
mod shared_backends;
mod store_outage;
mod tls;
mod tls_backends;
mod webhooks;
