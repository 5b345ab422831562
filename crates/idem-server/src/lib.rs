//! The HTTP front of idem: the KV API with RFC 9110 conditional requests, RFC 9457 problem details,
//! `GET /healthz`, Prometheus `GET /metrics`, the idempotency record look-up, and the reverse [`proxy`].
//!
//! [`app`] builds an axum `Router` over any [`Store`](idem_store::Store), testable without a socket:
//!
//! ```
//! use axum::body::Body;
//! use axum::http::{Request, StatusCode, header};
//! use idem_server::{ServerConfig, app};
//! use idem_store::MemoryStore;
//! use tower::ServiceExt;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let router = app(MemoryStore::new(), ServerConfig::default());
//! // Create only if absent; the answer's ETag is the value's generation.
//! let put = Request::put("/v1/kv/greeting").header(header::IF_NONE_MATCH, "*").body(Body::from("hello")).unwrap();
//! let created = router.clone().oneshot(put).await.unwrap();
//! assert_eq!(created.status(), StatusCode::CREATED);
//! let etag = created.headers()[header::ETAG].clone();
//!
//! let read = router.oneshot(Request::get("/v1/kv/greeting").body(Body::empty()).unwrap()).await.unwrap();
//! assert_eq!((read.status(), &read.headers()[header::ETAG]), (StatusCode::OK, &etag));
//! # });
//! ```
//!
//! [`serve`] runs it on a listener until a shutdown future resolves, finishing in-flight requests first:
//!
//! ```no_run
//! # use idem_server::{ServerConfig, app};
//! # use idem_store::MemoryStore;
//! # async fn demo() -> std::io::Result<()> {
//! let router = app(MemoryStore::new(), ServerConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let idle = idem_server::DEFAULT_CLIENT_IDLE_TIMEOUT;
//! idem_server::serve(router, listener, idle, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

mod app;
mod auth;
mod connections;
mod headers;
mod keypath;
mod kv;
mod metrics;
mod problem;
mod proxy;
mod records;
mod server;
mod tls;
mod upstream_conn;
pub mod webhook;

pub use app::{ServerConfig, app, serve};
pub use connections::{
    ClientTimeouts, DEFAULT_CLIENT_IDLE_TIMEOUT, DEFAULT_CLIENT_SEND_TIMEOUT, HttpService, MAX_HEADER_FIELDS,
    MAX_HEADER_LIST_BYTES, RequestBody,
};
pub use idem_store::Stop;
pub use keypath::encode_key;
pub use metrics::install_recorder;
pub use problem::Problem;
pub use proxy::{DEFAULT_UPSTREAM_IDLE_TIMEOUT, Proxy, Upstream, UpstreamError, proxy};
pub use server::{DEFAULT_SHUTDOWN_GRACE, Ending, Server};
pub use tls::{HANDSHAKE_TIMEOUT, TlsConfigSlot, serve_tls};
