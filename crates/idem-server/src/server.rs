//! One `idem serve` process: its listeners (the KV API alone, or the proxy and its admin listener), their
//! shared TLS configuration and idle timeout, and the shutdown choreography: stop accepting, let requests
//! finish within a grace period, record executions whose clients hung up, then return so the caller can close
//! the store.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use idem_store::Store;
use idem_tower::{IdempotencyLayer, InvalidatingStore};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::{DEFAULT_CLIENT_IDLE_TIMEOUT, ServerConfig, TlsConfigSlot, Upstream};

/// How long in-flight requests may run on after shutdown begins ([`Server::shutdown_grace`]'s default).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// A named shutdown, shared by everything that must stop together (as mini-redis's `Shutdown`): one
/// [`Shutdown::begin`] and every [`Shutdown::begun`] resolves. Cloning gives another handle to the same one.
#[derive(Clone, Debug)]
pub struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A shutdown not begun yet.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::channel(false).0) }
    }

    /// Begins the shutdown (idempotent).
    pub fn begin(&self) {
        self.tx.send_replace(true);
    }

    /// Whether it has begun.
    pub fn is_begun(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves once the shutdown has begun (at once if it already has).
    pub async fn begun(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|begun| *begun).await;
    }

    /// Begins the shutdown on the first SIGINT or SIGTERM, logging it; resolves then.
    pub async fn on_signals(&self) {
        let ctrl_c = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = ctrl_c => {},
            () = term => {},
            () = self.begun() => return,
        }
        tracing::info!("shutting down: finishing in-flight requests");
        self.begin();
    }
}

/// How [`Server::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every request finished (and every detached execution was recorded) after the shutdown began.
    Drained,
    /// The grace period ran out with requests still in flight; they were closed.
    GraceExpired,
}

type Drain = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a server serves.
enum Routes {
    /// The KV API on the main listener.
    Kv(Router),
    /// The proxy on the main listener; the KV API, records, /metrics and /healthz on the admin one; `drain`
    /// waits for the layer's executions whose clients hung up.
    Proxy { main: Router, admin: (TcpListener, Router), drain: Box<dyn FnOnce() -> Drain + Send> },
}

/// A configured server, ready to [`Server::run`].
pub struct Server {
    listener: TcpListener,
    routes: Routes,
    tls: Option<TlsConfigSlot>,
    idle_timeout: Duration,
    grace: Duration,
}

impl Server {
    /// The KV API ([`crate::app`]) over `store` on `listener`.
    pub fn kv<S: Store>(listener: TcpListener, store: S, config: ServerConfig) -> Self {
        Self::with(listener, Routes::Kv(crate::app(store, config)))
    }

    /// The reverse proxy ([`crate::proxy`]) under `layer` on `listener`, and on `admin` the KV API over the
    /// layer's store (`store`, the one `layer` was made with): writes there leave the layer's replay cache
    /// ([`InvalidatingStore`]) and the record look-up reads under the layer's record prefix.
    pub fn proxy<S: Store + Clone>(
        listener: TcpListener,
        admin: TcpListener,
        store: S,
        layer: IdempotencyLayer<S>,
        upstream: Upstream,
        config: ServerConfig,
    ) -> Self {
        let config = config.with_record_prefix(layer.record_key_prefix());
        let kv = crate::app(InvalidatingStore::new(store, layer.clone()), config);
        let drained = layer.clone();
        let drain = Box::new(move || Box::pin(async move { drained.drain().await }) as Drain);
        Self::with(listener, Routes::Proxy { main: crate::proxy(layer, upstream), admin: (admin, kv), drain })
    }

    fn with(listener: TcpListener, routes: Routes) -> Self {
        Self { listener, routes, tls: None, idle_timeout: DEFAULT_CLIENT_IDLE_TIMEOUT, grace: DEFAULT_SHUTDOWN_GRACE }
    }

    /// Serves HTTPS on every listener with the configuration in `slot` (swapped on SIGHUP by its owner, for
    /// new connections).
    pub fn tls(mut self, slot: TlsConfigSlot) -> Self {
        self.tls = Some(slot);
        self
    }

    /// Closes a client connection with no request running for this long ([`crate::serve`]).
    pub fn client_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How long requests may run on after the shutdown begins ([`DEFAULT_SHUTDOWN_GRACE`]).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Serves until `shutdown` begins, then stops accepting, lets requests in flight finish within the grace
    /// period, and (proxy) waits for executions whose clients hung up to be recorded: without that, a retry
    /// after a restart would execute them again. The caller closes the store afterwards.
    ///
    /// # Errors
    /// A listener's I/O error while serving.
    pub async fn run(self, shutdown: Shutdown) -> std::io::Result<Ending> {
        let Server { listener, routes, tls, idle_timeout, grace } = self;
        let serve_on =
            |router: Router, listener: TcpListener| -> Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> {
                let stop = shutdown.clone();
                let stop = async move { stop.begun().await };
                match &tls {
                    Some(slot) => Box::pin(crate::serve_tls(router, listener, slot.clone(), idle_timeout, stop)),
                    None => Box::pin(crate::serve(router, listener, idle_timeout, stop)),
                }
            };
        let serving: Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> = match routes {
            Routes::Kv(router) => serve_on(router, listener),
            Routes::Proxy { main, admin: (admin, kv), drain } => {
                let (main, admin) = (serve_on(main, listener), serve_on(kv, admin));
                Box::pin(async move {
                    let (a, b) = tokio::join!(main, admin);
                    drain().await;
                    a.and(b)
                })
            }
        };
        // After the shutdown begins, requests get a bounded grace: a client that stalls mid-request must not
        // keep the process from exiting.
        tokio::select! {
            served = serving => served.map(|()| Ending::Drained),
            () = async { shutdown.begun().await; tokio::time::sleep(grace).await } => {
                tracing::warn!(?grace, "requests still in flight after the grace period; closing them");
                Ok(Ending::GraceExpired)
            }
        }
    }
}
