//! The HTTP front of idem: the KV API with RFC 9110 conditional requests, RFC 9457 problem details,
//! `GET /healthz` and Prometheus `GET /metrics`.
//!
//! [`app`] builds an axum `Router` over any [`Store`](idem_store::Store), testable without a socket; [`serve`]
//! runs it on a listener until a shutdown future resolves, finishing in-flight requests first.
//!
//! ```no_run
//! use idem_server::{ServerConfig, app};
//! use idem_store::MemoryStore;
//!
//! # async fn demo() -> std::io::Result<()> {
//! let router = app(MemoryStore::new(), ServerConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! idem_server::serve(router, listener, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

mod auth;
mod headers;
mod keypath;
mod kv;
mod metrics;
mod problem;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use idem_store::Store;

pub use keypath::encode_key;
pub use metrics::install_recorder;
pub use problem::Problem;

/// Settings of the HTTP layer (store settings live with the store).
#[derive(Clone, Debug, Default)]
pub struct ServerConfig {
    auth_token: Option<Arc<str>>,
}

impl ServerConfig {
    /// No authentication.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requires `Authorization: Bearer <token>` on every KV request (RFC 6750 §2.1); 401 without it.
    pub fn with_auth_token(mut self, token: impl Into<Arc<str>>) -> Self {
        self.auth_token = Some(token.into());
        self
    }
}

/// The router: the KV API under `/v1/kv`, `/healthz`, `/metrics`, and problem+json for unknown routes.
pub fn app<S: Store>(store: S, config: ServerConfig) -> Router {
    let handle = install_recorder();
    let kv = kv::routes(Arc::new(store)).layer(axum::middleware::from_fn_with_state(config, auth::require_token));
    Router::new()
        .merge(kv)
        .route("/healthz", get(|| async { "ok\n" }).fallback(|| async { kv::method_not_allowed("GET") }))
        .route(
            "/metrics",
            get(move || std::future::ready(handle.render())).fallback(|| async { kv::method_not_allowed("GET") }),
        )
        .fallback(|| async { Problem::not_found_route() })
        .layer(axum::middleware::from_fn(metrics::track))
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting and waits for in-flight
/// requests to finish.
///
/// # Errors
/// The listener's I/O errors.
pub async fn serve(
    router: Router,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}
