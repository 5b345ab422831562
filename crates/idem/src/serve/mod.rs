//! `idem serve`: the checked configuration ([`config`]) made into an `idem_server::Server`, run until a signal.

mod config;
mod routes;

use std::net::SocketAddr;

use idem_backends::AnyStore;
use idem_server::{Server, ServerConfig, Stop, Upstream};
use idem_tower::{IdempotencyLayer, InvalidatingStore};

use config::DEFAULT_REPLAY_CACHE;
pub use config::{ServeArgs, ServeConfig};

use crate::error::Error;

/// Runs the server until SIGINT or SIGTERM, then finishes in-flight requests and flushes the store.
///
/// # Errors
/// [`Error::OpenStore`], [`Error::Bind`], [`Error::Io`] while serving.
pub async fn run(config: ServeConfig) -> Result<(), Error> {
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    // Bind first: a busy port must not leave a freshly created database file or schema behind.
    let listener = bind(config.listen).await?;
    let admin = match &config.proxy {
        Some(p) => Some(bind(p.admin_listen).await?),
        None => None,
    };
    let upstream = match &config.proxy {
        Some(p) => Some(
            Upstream::with_tls(&p.upstream, p.upstream_timeout, p.upstream_idle_timeout, p.upstream_tls.clone())
                .map_err(|e| Error::Config(e.to_string()))?,
        ),
        None => None,
    };
    // Before the store opens: what it reports while opening (the replicas a write does not wait for) must reach
    // /metrics.
    idem_server::install_recorder();
    // A store unavailable for now (a failover in progress, a primary restarting) is not a reason to stay down:
    // requests get 503 with Retry-After until it opens.
    let store = AnyStore::open_or_keep_trying(&config.store_url, &config.namespace, config.limits).await?;
    let local = listener.local_addr()?;
    let mut kv_config = ServerConfig::new();
    if let Some(t) = &config.auth_token {
        kv_config = kv_config.with_auth_token(t.as_str());
    }
    let tls = tls_slot(config.tls)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let stop = Stop::new();
    watch_signals(&stop);
    let pages_config = PagesConfig {
        enabled: config.admin_pages,
        token: config.admin_token.clone(),
        client_cert: config.client_cert,
        backend: backend_name(&config.store_url),
        namespace: config.namespace.clone(),
    };
    let server = match (config.proxy, admin, upstream) {
        (Some(p), Some(admin), Some(upstream)) => {
            let admin_local = admin.local_addr()?;
            let replay_cache = match p.replay_cache {
                Some(bytes) => bytes,
                None if config.store_url.is_exclusive() => DEFAULT_REPLAY_CACHE,
                None => 0,
            };
            let upstream_shown = p.upstream.clone();
            let layer = proxy_layer(&store, p, replay_cache)?;
            // Tests and scripts read the bound addresses from these lines (useful with port 0); they are the one
            // "listening" line a terminal shows (the log's copy is at debug, with the addresses as fields).
            // A standard output gone (`| head -1`) or failing must not stop the server: these lines are all
            // it prints there.
            let _ = crate::error::out(&format!(
                "idem listening on {scheme}://{local} (proxy to {}, store {})\nidem admin listening on \
                 {scheme}://{admin_local}\n",
                upstream_shown,
                config.store_url.redacted()
            ));
            tracing::debug!(%local, %admin_local, upstream = %upstream_shown, store = %config.store_url.redacted(), "listening");
            // Through the layer's invalidating store: a record released on the pages must leave its replay
            // cache too, or the next retry would still be answered from memory.
            let pages = InvalidatingStore::new(store.clone(), layer.clone());
            let pages = admin_pages(&pages_config, pages, layer.record_key_prefix(), tls.is_some());
            let server = Server::proxy(listener, admin, store.clone(), layer, upstream, kv_config);
            match pages {
                Some(p) => server.admin_routes(p),
                None => server,
            }
        }
        _ => {
            let _ = crate::error::out(&format!(
                "idem listening on {scheme}://{local} (store {})\n",
                config.store_url.redacted()
            ));
            tracing::debug!(%local, store = %config.store_url.redacted(), "listening");
            let pages = admin_pages(&pages_config, store.clone(), idem_tower::DEFAULT_RECORD_PREFIX, tls.is_some());
            let server = Server::kv(listener, store.clone(), kv_config);
            match pages {
                Some(p) => server.admin_routes(p),
                None => server,
            }
        }
    };
    let server = match tls {
        Some(slot) => server.tls(slot),
        None => server,
    };
    let served = server
        .client_idle_timeout(config.client_idle_timeout)
        .client_send_timeout(config.client_send_timeout)
        .run(stop)
        .await;
    match served {
        Ok(idem_server::Ending::GraceExpired) => {
            tracing::warn!("the shutdown grace ran out: requests still in flight were closed")
        }
        Ok(idem_server::Ending::Forced) => tracing::warn!("requests still in flight were closed at the second signal"),
        _ => {}
    }
    store.close().await;
    tracing::info!("store flushed; bye");
    // A stop that was asked for exits 0 even when it cut requests (a service manager would otherwise mark the
    // unit failed for doing what it was told); the warning above says so, and a cut keyed request is safe to
    // send again: its record's lease decides what a retry gets.
    served.map(|_| ()).map_err(Error::Io)
}

/// The certificate slot both listeners share, reloaded on SIGHUP; without TLS, SIGHUP only logs.
fn tls_slot(
    tls: Option<(crate::tls::TlsFiles, std::sync::Arc<rustls::ServerConfig>)>,
) -> Result<Option<idem_server::TlsConfigSlot>, Error> {
    // One slot for both listeners: a SIGHUP swaps the certificate of each for its new connections.
    Ok(match tls {
        Some((files, server_config)) => {
            let slot = idem_server::TlsConfigSlot::new(server_config);
            tokio::spawn(files.reload_on_sighup(slot.clone())?);
            Some(slot)
        }
        None => {
            // SIGHUP's default action ends the process. A reload sent to every instance (systemd's ExecReload)
            // must not kill one that has no certificate to re-read, and lose what it was doing.
            let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    tracing::info!(
                        "SIGHUP: no TLS certificate to reload; settings other than webhook secret files are read \
                         only at start-up"
                    );
                }
            });
            None
        }
    })
}

/// Installs the SIGINT/SIGTERM handlers that drain `stop`.
fn watch_signals(stop: &Stop) {
    // SIGTERM drains as SIGINT does: it is what service managers send first, a grace before SIGKILL. The
    // handlers are installed before the server says it listens: a service manager may signal as soon as it
    // reads that line, and the default action would end the process with no drain and an unflushed store.
    let watched = stop.on_signals(idem_store::stop::Sigterm::LikeSigint, |level| {
        if level == idem_store::stop::DRAIN {
            tracing::info!("shutting down: finishing in-flight requests (a second SIGINT or SIGTERM: at once)");
        } else {
            tracing::warn!("second signal: closing the requests still in flight now");
        }
    });
    match watched {
        Ok(watch) => drop(tokio::spawn(watch)),
        Err(e) => tracing::warn!("cannot listen for SIGINT/SIGTERM ({e}); the process stops only when killed"),
    }
}

/// The idempotency layer of the proxy, with its routes, and the webhook secrets reloaded on SIGHUP.
fn proxy_layer(
    store: &AnyStore,
    p: config::ProxyConfig,
    replay_cache: u64,
) -> Result<IdempotencyLayer<AnyStore>, Error> {
    let mut layer = IdempotencyLayer::new(store.clone())
        .retention(p.retention)
        .lease(p.lease)
        .key_policy(p.key_policy)
        .methods(p.methods)
        .max_stored_body(p.max_stored_body)
        .max_request_body(p.max_request_body)
        .in_flight(p.in_flight)
        .credential_headers(p.credential_headers)
        .unknown_outcome(p.unknown_outcome)
        .execution_timeout(p.upstream_timeout)
        .replay_cache(replay_cache);
    if !p.secret_files.is_empty() {
        tokio::spawn(routes::reload_secrets_on_sighup(p.secret_files)?);
    }
    for route in p.routes {
        tracing::info!(route = route.name(), path = route.path(), "route");
        layer = layer.route(route);
    }
    Ok(layer)
}

/// What the operator's pages are served with.
struct PagesConfig {
    enabled: bool,
    token: Option<String>,
    client_cert: bool,
    backend: &'static str,
    namespace: String,
}

/// The pages under /ui/ and /v1/admin/ over `store` (records under `prefix`), unless they are off.
fn admin_pages<S: idem_store::Store>(c: &PagesConfig, store: S, prefix: &str, tls: bool) -> Option<axum::Router> {
    if !c.enabled {
        return None;
    }
    let guard = idem_admin::guard::Guard::new(c.token.as_deref().map(Into::into), c.client_cert, tls);
    let info = idem_admin::StoreInfo { backend: c.backend.to_owned(), namespace: c.namespace.clone() };
    let metrics = idem_server::install_recorder();
    let admin =
        idem_admin::Admin::new(store, prefix, guard, info).metrics(std::sync::Arc::new(move || metrics.render()));
    Some(idem_admin::router(admin))
}

/// The store's kind, for the overview (never its URL, which may hold a password).
fn backend_name(url: &idem_backends::StoreUrl) -> &'static str {
    match url {
        idem_backends::StoreUrl::Memory => "memory",
        idem_backends::StoreUrl::Sqlite(_) => "sqlite",
        idem_backends::StoreUrl::Postgres(_) => "postgres",
        idem_backends::StoreUrl::Redis(_) => "redis",
    }
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr: addr.to_string(), source })
}
