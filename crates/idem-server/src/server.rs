//! One `idem serve` process: its listeners (the KV API alone, or the proxy and its admin listener), their
//! shared TLS configuration and idle timeout, and the shutdown choreography: stop accepting, let requests
//! finish within a grace period, record executions whose clients hung up, then return so the caller can close
//! the store.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_store::Store;
use idem_tower::{IdempotencyLayer, InvalidatingStore};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::HttpService;
use crate::{ClientTimeouts, DEFAULT_CLIENT_IDLE_TIMEOUT, ServerConfig, TlsConfigSlot, Upstream};

/// How long in-flight requests may run on after shutdown begins ([`Server::shutdown_grace`]'s default).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// A named shutdown, shared by everything that must stop together (as mini-redis's `Shutdown`): one
/// [`Shutdown::begin`] and every [`Shutdown::begun`] resolves; a [`Shutdown::force`] after it ends the grace
/// at once. Cloning gives another handle to the same one.
#[derive(Clone, Debug)]
pub struct Shutdown {
    /// 0 running, 1 shutting down (grace), 2 forced.
    tx: Arc<watch::Sender<u8>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A shutdown not begun yet.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::channel(0).0) }
    }

    /// Begins the shutdown (idempotent).
    pub fn begin(&self) {
        self.tx.send_if_modified(|state| std::mem::replace(state, (*state).max(1)) != *state);
    }

    /// Ends the grace at once: requests still in flight are closed (begins the shutdown too).
    pub fn force(&self) {
        self.tx.send_replace(2);
    }

    /// Whether it has begun.
    pub fn is_begun(&self) -> bool {
        *self.tx.borrow() >= 1
    }

    /// Resolves once the shutdown has begun (at once if it already has).
    pub async fn begun(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|state| *state >= 1).await;
    }

    /// Resolves once the shutdown was forced.
    pub async fn forced(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|state| *state >= 2).await;
    }

    /// Begins the shutdown on the first SIGINT or SIGTERM and forces it on the second, logging each (as nginx
    /// and most servers do: a second Ctrl-C means "now"). Resolves after the second signal, or once the
    /// shutdown was forced otherwise.
    pub async fn on_signals(&self) {
        let (Ok(mut int), Ok(mut term)) = (
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()),
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot listen for SIGINT/SIGTERM; the process stops only when killed");
            return;
        };
        tokio::select! {
            () = either(&mut int, &mut term) => {},
            () = self.begun() => {},
        }
        if !self.is_begun() {
            tracing::info!("shutting down: finishing in-flight requests (a second SIGINT or SIGTERM: at once)");
            self.begin();
        }
        tokio::select! {
            () = either(&mut int, &mut term) => {
                tracing::warn!("second signal: closing the requests still in flight now");
                self.force();
            }
            () = self.forced() => {},
        }
    }
}

/// The next SIGINT or SIGTERM.
async fn either(int: &mut tokio::signal::unix::Signal, term: &mut tokio::signal::unix::Signal) {
    tokio::select! {
        _ = int.recv() => {},
        _ = term.recv() => {},
    }
}

/// How [`Server::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every request finished (and every detached execution was recorded) after the shutdown began.
    Drained,
    /// The grace period ran out with requests still in flight; they were closed.
    GraceExpired,
    /// The shutdown was forced ([`Shutdown::force`], a second signal) with requests still in flight; they were
    /// closed.
    Forced,
}

/// Waits for the layer's detached executions to be recorded.
type Drain = Pin<Box<dyn Future<Output = ()> + Send>>;
/// Resolves once the shutdown has begun: a listener stops accepting then.
type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;
type Serving = Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>;
/// Starts serving one listener (with TLS when a configuration is given) until its future resolves. The
/// service's type is erased here, once per listener, rather than boxed per request.
type ServeFn = Box<dyn FnOnce(TcpListener, Option<TlsConfigSlot>, ClientTimeouts, Stop) -> Serving + Send>;

fn serve_fn<S: HttpService>(service: S) -> ServeFn {
    Box::new(move |listener, tls, timeouts, stop| match tls {
        Some(slot) => Box::pin(crate::serve_tls(service, listener, slot, timeouts, stop)),
        None => Box::pin(crate::serve(service, listener, timeouts, stop)),
    })
}

/// What a server serves.
enum Routes {
    /// The KV API on the main listener.
    Kv(ServeFn),
    /// The proxy on the main listener; the KV API, records, /metrics and /healthz on the admin one; `drain`
    /// waits for the layer's executions whose clients hung up.
    Proxy { main: ServeFn, admin: (TcpListener, ServeFn), drain: Box<dyn FnOnce() -> Drain + Send> },
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
        Self::with(listener, Routes::Kv(serve_fn(crate::app(store, config))))
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
        Self::with(
            listener,
            Routes::Proxy { main: serve_fn(crate::proxy(layer, upstream)), admin: (admin, serve_fn(kv)), drain },
        )
    }

    fn with(listener: TcpListener, routes: Routes) -> Self {
        let timeouts = ClientTimeouts::from(DEFAULT_CLIENT_IDLE_TIMEOUT);
        Self { listener, routes, tls: None, timeouts, grace: DEFAULT_SHUTDOWN_GRACE }
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

    /// Serves until `shutdown` begins, then stops accepting, lets requests in flight finish within the grace
    /// period, and (proxy) waits for executions whose clients hung up to be recorded: without that, a retry
    /// after a restart would execute them again. The caller closes the store afterwards.
    ///
    /// # Errors
    /// A listener's I/O error while serving.
    pub async fn run(self, shutdown: Shutdown) -> std::io::Result<Ending> {
        let Server { listener, routes, tls, timeouts, grace } = self;
        let serve_on = |serve: ServeFn, listener: TcpListener| -> Serving {
            let stop = shutdown.clone();
            serve(listener, tls.clone(), timeouts, Box::pin(async move { stop.begun().await }))
        };
        let serving: Serving = match routes {
            Routes::Kv(serve) => serve_on(serve, listener),
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
            () = shutdown.forced() => Ok(Ending::Forced),
            () = async { shutdown.begun().await; tokio::time::sleep(grace).await } => {
                tracing::warn!(?grace, "requests still in flight after the grace period; closing them");
                Ok(Ending::GraceExpired)
            }
        }
    }
}
