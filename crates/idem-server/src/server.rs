//! One `idem serve` process: its listeners (the KV API alone, or the proxy and its admin listener), their
//! shared TLS configuration and idle timeout, and the shutdown choreography: stop accepting, let requests
//! finish within a grace period, record executions whose clients hung up, then return so the caller can close
//! the store.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_store::{Stop, Store};
use idem_tower::{IdempotencyLayer, InvalidatingStore};
use tokio::net::TcpListener;

use crate::HttpService;
use crate::{ClientTimeouts, DEFAULT_CLIENT_IDLE_TIMEOUT, ServerConfig, TlsConfigSlot, Upstream};

/// How long in-flight requests may run on after shutdown begins ([`Server::shutdown_grace`]'s default).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How [`Server::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every request finished (and every detached execution was recorded) after the stop began.
    Drained,
    /// The grace period ran out with requests still in flight; they were closed.
    GraceExpired,
    /// The stop was made an abort ([`Stop::abort`], a second signal) with requests still in flight; they were
    /// closed.
    Forced,
}

/// Waits for the layer's detached executions to be recorded.
type Drain = Pin<Box<dyn Future<Output = ()> + Send>>;
/// Resolves once the stop has begun: a listener stops accepting then.
type Stopping = Pin<Box<dyn Future<Output = ()> + Send>>;
type Serving = Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>;
/// Starts serving one listener (with TLS when a configuration is given) until its future resolves. The
/// service's type is erased here, once per listener, rather than boxed per request.
type ServeFn = Box<dyn FnOnce(TcpListener, Option<TlsConfigSlot>, ClientTimeouts, Stopping) -> Serving + Send>;

fn serve_fn<S: HttpService>(service: S) -> ServeFn {
    Box::new(move |listener, tls, timeouts, stop| match tls {
        Some(slot) => Box::pin(crate::serve_tls(service, listener, slot, timeouts, stop)),
        None => Box::pin(crate::serve(service, listener, timeouts, stop)),
    })
}

/// What a server serves.
enum Routes {
    /// The KV API on the main listener.
    Kv(axum::Router),
    /// The proxy on the main listener; the KV API, records, /metrics and /healthz on the admin one; `drain`
    /// waits for the layer's executions whose clients hung up.
    Proxy { main: ServeFn, admin: (TcpListener, axum::Router), drain: Box<dyn FnOnce() -> Drain + Send> },
}

/// A configured server, ready to [`Server::run`].
pub struct Server {
    listener: TcpListener,
    routes: Routes,
    tls: Option<TlsConfigSlot>,
    timeouts: ClientTimeouts,
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
        Self::with(listener, Routes::Proxy { main: serve_fn(crate::proxy(layer, upstream)), admin: (admin, kv), drain })
    }

    fn with(listener: TcpListener, routes: Routes) -> Self {
        let timeouts = ClientTimeouts::from(DEFAULT_CLIENT_IDLE_TIMEOUT);
        Self { listener, routes, tls: None, timeouts, grace: DEFAULT_SHUTDOWN_GRACE }
    }

    /// Adds `routes` (the operator's pages, say) to the listener of the KV API: the admin listener of a proxy,
    /// the main listener otherwise. They are served beside the KV API, with the listener's TLS settings, but
    /// not behind its bearer token: `routes` guard themselves. Their paths must not be the KV API's, and they
    /// must have no fallback of their own (the KV API's answers unknown paths).
    pub fn admin_routes(mut self, routes: axum::Router) -> Self {
        self.routes = match self.routes {
            Routes::Kv(kv) => Routes::Kv(kv.merge(routes)),
            Routes::Proxy { main, admin: (listener, kv), drain } => {
                Routes::Proxy { main, admin: (listener, kv.merge(routes)), drain }
            }
        };
        self
    }

    /// Serves HTTPS on every listener with the configuration in `slot` (swapped on SIGHUP by its owner, for
    /// new connections).
    pub fn tls(mut self, slot: TlsConfigSlot) -> Self {
        self.tls = Some(slot);
        self
    }

    /// Closes a client connection with no request running for this long ([`crate::serve`]).
    pub fn client_idle_timeout(mut self, timeout: Duration) -> Self {
        self.timeouts.idle = timeout;
        self
    }

    /// Ends a client connection when a response write has waited this long for the client to read
    /// (nginx's `send_timeout`; [`DEFAULT_CLIENT_SEND_TIMEOUT`](crate::DEFAULT_CLIENT_SEND_TIMEOUT)); logged and counted in
    /// `idem_client_send_timeouts_total`.
    pub fn client_send_timeout(mut self, timeout: Duration) -> Self {
        self.timeouts.send = timeout;
        self
    }

    /// How long requests may run on after the shutdown begins ([`DEFAULT_SHUTDOWN_GRACE`]).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Serves until `stop` drains, then stops accepting, lets requests in flight finish within the grace
    /// period (an abort ends it at once), and (proxy) waits for executions whose clients hung up to be recorded:
    /// without that, a retry after a restart would execute them again. The caller closes the store afterwards.
    ///
    /// # Errors
    /// A listener's I/O error while serving.
    pub async fn run(self, stop: Stop) -> std::io::Result<Ending> {
        let Server { listener, routes, tls, timeouts, grace } = self;
        let serve_on = |serve: ServeFn, listener: TcpListener| -> Serving {
            let stop = stop.clone();
            serve(listener, tls.clone(), timeouts, Box::pin(async move { stop.reached(idem_store::stop::DRAIN).await }))
        };
        let serving: Serving = match routes {
            Routes::Kv(kv) => serve_on(serve_fn(kv), listener),
            Routes::Proxy { main, admin: (admin, kv), drain } => {
                let (main, admin) = (serve_on(main, listener), serve_on(serve_fn(kv), admin));
                Box::pin(async move {
                    let (a, b) = tokio::join!(main, admin);
                    drain().await;
                    a.and(b)
                })
            }
        };
        // After the stop begins, requests get a bounded grace: a client that stalls mid-request must not
        // keep the process from exiting.
        tokio::select! {
            served = serving => served.map(|()| Ending::Drained),
            () = stop.reached(idem_store::stop::ABORT) => Ok(Ending::Forced),
            () = async { stop.reached(idem_store::stop::DRAIN).await; tokio::time::sleep(grace).await } => {
                tracing::warn!(?grace, "requests still in flight after the grace period; closing them");
                Ok(Ending::GraceExpired)
            }
        }
    }
}
