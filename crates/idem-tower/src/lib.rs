//! [`IdempotencyLayer`]: makes any tower service (axum, hyper, tonic) safe to retry with the `Idempotency-Key` request
//! header (IETF `draft-ietf-httpapi-idempotency-key-header`), Stripe compatible.
//!
//! For a covered method (POST and PATCH by default) carrying a key, the first request under (scope, key) is
//! executed once and its response stored; an identical retry gets the stored status, allow-listed headers and
//! byte-exact body plus `Idempotent-Replayed: true`; the same key with another request gets 422; a retry
//! while the first is still executing gets 409 with `Retry-After`. The inner call and the completion write run
//! in a task detached from the client connection, so a client that hangs up cannot cancel them, and the lease
//! on the record is renewed while the call runs. Refusals are responses (RFC 9457 problem+json), never errors.
//!
//! ```
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idem_store::MemoryStore;
//! use idem_tower::IdempotencyLayer;
//! use std::sync::{Arc, atomic::{AtomicU32, Ordering}};
//! use tower::ServiceExt;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let executions = Arc::new(AtomicU32::new(0));
//! let counted = Arc::clone(&executions);
//! let app = Router::new()
//!     .route("/orders", post(move || async move {
//!         counted.fetch_add(1, Ordering::SeqCst);
//!         (StatusCode::CREATED, "order 1\n")
//!     }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//!
//! let order = || Request::post("/orders").header("Idempotency-Key", "\"order-1\"").body(Body::from("{}")).unwrap();
//! let first = app.clone().oneshot(order()).await.unwrap();
//! let retry = app.oneshot(order()).await.unwrap();
//! assert_eq!((first.status(), retry.status()), (StatusCode::CREATED, StatusCode::CREATED));
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(executions.load(Ordering::SeqCst), 1);
//! # });
//! ```
//!
//! With a durable store (the workspace's `idem-sqlite` or `idem-postgres` crate, or any store by URL through
//! `idem-backends`) and a drained shutdown ([`IdempotencyLayer::drain`]): the example `axum_orders` in this
//! crate (`cargo run -p idem-tower --example axum_orders -- sqlite:orders.db 127.0.0.1:3000`). The example
//! above uses `tower::ServiceExt` (tower with its `util` feature) to call the router without a socket.
//!
//! # Steps
//!
//! A covered request goes through these steps, in order:
//!
//! 1. **Prepare**, without touching the store: the key (none: pass through, or 400 with
//!    [`KeyPolicy::Required`]; malformed: 400), the scope, the body read whole up to its limit (over: 413) and
//!    the request's fingerprint.
//! 2. **Claim** the key's record with a create-if-absent, or find the record that is there.
//! 3. **Existing record**: another fingerprint is 422; in flight is 409 with `Retry-After` (or a wait, with
//!    [`InFlight::Wait`]); finished is a replay of the stored status, the allow-listed headers
//!    ([`DEFAULT_REPLAY_HEADERS`]) and the byte-exact body, with `Idempotent-Replayed: true`.
//! 4. **Execute once, detached** from the client connection, with the record's lease renewed every third of
//!    its length while the call runs.
//! 5. **Outcome policy**: a response is stored and replayed (5xx included), except 429 and 503, which release
//!    the key so a retry executes; an inner service that marks its response with [`UpstreamFailure::NotSent`]
//!    releases the key too, and one marked [`UpstreamFailure::OutcomeUnknown`] (or an inner error, or a
//!    panic) is stored as unknown and answered 502, never executed again under that key (unless
//!    [`UnknownOutcome::Release`]).
//! 6. **Response not stored**: a body over the stored-body limit reaches its first caller whole; every retry
//!    gets 409 `response-not-stored`.
//! 7. **No leaks**: refusals carry fixed text, statuses and limits, never another request's data.

mod body;
mod cache;
mod config;
mod counters;
mod decide;
mod drain;
mod execute;
mod future;
mod invalidating;
mod layer;
mod prepare;
mod problem;
mod route;
mod service;

pub use body::Body;
pub use config::{InFlight, KeyPolicy, UnknownOutcome};
pub use drain::{DRAIN_IDLE, DRAIN_SLACK_BYTES, DRAIN_TIME, Drain, DrainFuture, DrainLayer};
pub use execute::UpstreamFailure;
pub use future::ResponseFuture;
pub use invalidating::InvalidatingStore;
pub use layer::{DEFAULT_RECORD_PREFIX, DEFAULT_REPLAY_HEADERS, IdempotencyLayer};
pub use prepare::BufferedBody;
pub use problem::Problem;
pub use route::{
    Ignore, KeySource, MissingKey, OnFailure, Refusal, RefusalReason, RouteError, RoutePolicy, Verify,
    WEBHOOK_IN_FLIGHT_WAIT, delivery_path, normalise_path, route_scope,
};
pub use service::Idempotency;
