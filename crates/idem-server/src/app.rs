//! [`app`], the KV server's router, with its [`ServerConfig`], and [`serve`], the plain-HTTP listener loop.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use idem_store::Store;
use idem_tower::DrainLayer;

use crate::{Problem, auth, connections, install_recorder, kv, metrics, records, tls};

/// Settings of the HTTP layer (store settings live with the store).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub(crate) auth_token: Option<Arc<str>>,
    record_prefix: Arc<str>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self { auth_token: None, record_prefix: idem_tower::DEFAULT_RECORD_PREFIX.into() }
    }
}

impl ServerConfig {
    /// No authentication; records looked up under the layer's default prefix
    /// ([`idem_tower::DEFAULT_RECORD_PREFIX`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The store key prefix of the idempotency records that `/v1/idempotency/{scope}/{key}` reads and deletes.
    /// Pass the prefix of the layer that writes them ([`idem_tower::IdempotencyLayer::record_key_prefix`]);
    /// with any other the look-up finds nothing.
    pub fn with_record_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.record_prefix = prefix.into();
        self
    }

    /// Requires `Authorization: Bearer <token>` on every KV request (RFC 6750 §2.1); 401 without it.
    pub fn with_auth_token(mut self, token: impl Into<Arc<str>>) -> Self {
        self.auth_token = Some(token.into());
        self
    }
}

/// The router: the KV API under `/v1/kv`, idempotency records under `/v1/idempotency/{scope}/{key}` (`GET`,
/// `DELETE`), `/healthz` (the process serves), `/readyz` (the store answers), `/metrics`, and problem+json for unknown routes.
///
/// A request body left unread by an answer (413 over the value limit, 401, 400) is read and discarded first,
/// up to the largest accepted body (the store's value limit or the 1 MiB set/counter body) plus
/// [`DRAIN_SLACK_BYTES`](idem_tower::DRAIN_SLACK_BYTES), so a client that writes its whole body before
/// reading sees the answer (see [`DrainLayer`](idem_tower::DrainLayer) for the bounds).
pub fn app<S: Store>(store: S, config: ServerConfig) -> Router {
    let handle = install_recorder();
    let largest_body = store.limits().max_value_bytes().max(kv::MAX_OP_BODY);
    let store = Arc::new(store);
    let ready = Arc::clone(&store);
    let kv = kv::routes(Arc::clone(&store))
        .merge(records::routes(store, Arc::clone(&config.record_prefix)))
        .layer(axum::middleware::from_fn_with_state(config, auth::require_token));
    Router::new()
        .merge(kv)
        .route("/healthz", get(|| async { "ok\n" }).fallback(|| async { kv::method_not_allowed("GET") }))
        .route("/readyz", get(move || readyz(Arc::clone(&ready))).fallback(|| async { kv::method_not_allowed("GET") }))
        .route(
            "/metrics",
            get(move || std::future::ready(handle.render())).fallback(|| async { kv::method_not_allowed("GET") }),
        )
        .fallback(|| async { Problem::not_found_route() })
        .layer(axum::middleware::from_fn(metrics::track))
        .layer(DrainLayer::new(largest_body as u64))
}

/// How long `/readyz` waits for the store's answer before it says not ready.
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /readyz`: 200 when the store answers (its clock, [`Store::now`]) within [`READY_TIMEOUT`], else the
/// 503 problem a request would get. `/healthz` says only that the process serves: a load balancer or a
/// Kubernetes readiness probe wants this one, which is 503 while the store is away or still opening.
async fn readyz<S: Store>(store: Arc<S>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match tokio::time::timeout(READY_TIMEOUT, store.now()).await {
        Ok(Ok(_)) => "ready\n".into_response(),
        Ok(Err(e)) => Problem::from(e).into_response(),
        Err(_) => Problem::from(idem_store::Error::unavailable(std::io::Error::from(std::io::ErrorKind::TimedOut)))
            .into_response(),
    }
}

use crate::ClientTimeouts;

/// Serves `service` (the KV API's `Router`, the [`Proxy`](crate::Proxy)) over HTTP/1.1 and HTTP/2 (prior knowledge) on `listener` until `shutdown` resolves, then
/// stops accepting and waits for in-flight requests to finish. A connection with no request running is
/// closed `timeouts.idle` after its last request ended or after it was accepted, whether it sits between
/// requests or stalls part-way through a request header ([`DEFAULT_CLIENT_IDLE_TIMEOUT`](crate::DEFAULT_CLIENT_IDLE_TIMEOUT): 75 s); a response
/// write that waits for a slow reader longer than `timeouts.send` ends the connection
/// ([`ClientTimeouts`]; a bare `Duration` is the idle timeout with the default send timeout). A client
/// that opens with a TLS handshake is logged (warn) with its address, since it only sees a TLS error of its
/// own; [`serve_tls`](crate::serve_tls) serves HTTPS.
///
/// # Errors
/// The listener's I/O errors.
pub async fn serve(
    service: impl crate::HttpService,
    listener: tokio::net::TcpListener,
    timeouts: impl Into<ClientTimeouts>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let timeouts = timeouts.into();
    connections::serve_connections(tls::PlainListener::new(listener)?, service, false, timeouts, shutdown).await
}
