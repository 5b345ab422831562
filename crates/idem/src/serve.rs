//! `idem serve`: flags, environment and an optional TOML file merged into one typed config, then the server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use idem_server::ServerConfig;
use idem_store::Limits;
use serde::Deserialize;

use crate::any_store::{AnyStore, redact};
use crate::error::Error;

/// Flags of `idem serve`. Each is also read from its `IDEM_*` environment variable and from the config file;
/// a flag beats the environment, which beats the file, which beats the default.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "IDEM_LISTEN")]
    listen: Option<String>,
    /// Store URL: sqlite:PATH, memory:, postgres://… or redis://… [default: sqlite:./idem-data/idem.db].
    #[arg(long, env = "IDEM_STORE")]
    store: Option<String>,
    /// PostgreSQL schema / Redis key prefix for this deployment's data [default: idem].
    #[arg(long, env = "IDEM_NAMESPACE")]
    namespace: Option<String>,
    /// Largest value accepted, in bytes [default: 16777216 (16 MiB)].
    #[arg(long, env = "IDEM_MAX_VALUE_BYTES")]
    max_value_bytes: Option<usize>,
    /// File holding the bearer token every KV request must present.
    #[arg(long, env = "IDEM_AUTH_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// Allow listening on a non-loopback address without a token (env: 1/0, true/false, yes/no, on/off).
    #[arg(long, env = "IDEM_INSECURE", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    insecure: bool,
    /// Optional TOML file with the same settings (listen, store, namespace, max_value_bytes, auth_token_file,
    /// insecure).
    #[arg(long, env = "IDEM_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    store: Option<String>,
    namespace: Option<String>,
    max_value_bytes: Option<usize>,
    auth_token_file: Option<PathBuf>,
    insecure: Option<bool>,
}

/// The validated configuration of one server.
#[derive(Debug)]
pub struct ServeConfig {
    listen: SocketAddr,
    store_url: String,
    namespace: String,
    limits: Limits,
    auth_token: Option<String>,
}

fn read_token(path: &Path) -> Result<String, Error> {
    let token = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("cannot read --auth-token-file {}: {e}", path.display())))?;
    let token = token.trim().to_owned();
    if token.is_empty() {
        return Err(Error::Config(format!("--auth-token-file {} is empty", path.display())));
    }
    Ok(token)
}

impl ServeArgs {
    /// Merges flags, environment, file and defaults, and checks them.
    ///
    /// # Errors
    /// [`Error::Config`] for an unreadable config or token file, a bad address, a zero value limit, or a
    /// non-loopback address without a token and without `--insecure`.
    pub fn resolve(self) -> Result<ServeConfig, Error> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| Error::Config(format!("cannot read config file {}: {e}", p.display())))?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| Error::Config(format!("config file {}: {e}", p.display())))?
            }
            None => FileConfig::default(),
        };
        let listen_s = self.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen: SocketAddr =
            listen_s.parse().map_err(|_| Error::Config(format!("--listen {listen_s:?} is not an IP:PORT address")))?;
        let store_url = self.store.or(file.store).unwrap_or_else(|| "sqlite:./idem-data/idem.db".into());
        let namespace = self.namespace.or(file.namespace).unwrap_or_else(|| "idem".into());
        let valid = namespace.len() <= 63
            && namespace.bytes().next().is_some_and(|b| b == b'_' || b.is_ascii_lowercase())
            && namespace.bytes().all(|b| b == b'_' || b.is_ascii_lowercase() || b.is_ascii_digit());
        if !valid {
            return Err(Error::Config(format!(
                "--namespace {namespace:?} must match [a-z_][a-z0-9_]*, at most 63 bytes"
            )));
        }
        let max_value_bytes = self.max_value_bytes.or(file.max_value_bytes).unwrap_or(16 * 1024 * 1024);
        if max_value_bytes == 0 {
            return Err(Error::Config("--max-value-bytes must be at least 1".into()));
        }
        let auth_token = self.auth_token_file.or(file.auth_token_file).map(|p| read_token(&p)).transpose()?;
        let insecure = self.insecure || file.insecure.unwrap_or(false);
        if !listen.ip().is_loopback() && auth_token.is_none() && !insecure {
            return Err(Error::Config(format!(
                "refusing to listen on non-loopback {listen} without --auth-token-file; pass --insecure to allow it"
            )));
        }
        Ok(ServeConfig {
            listen,
            store_url,
            namespace,
            limits: Limits::default().with_max_value_bytes(max_value_bytes),
            auth_token,
        })
    }
}

/// How long in-flight requests may run on after SIGINT/SIGTERM.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing in-flight requests");
}

/// Runs the server until SIGINT or SIGTERM, then finishes in-flight requests and flushes the store.
///
/// # Errors
/// [`Error::OpenStore`], [`Error::Bind`], [`Error::Io`] while serving.
pub async fn run(config: ServeConfig) -> Result<(), Error> {
    // Bind first: a busy port must not leave a freshly created database file or schema behind.
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind { addr: config.listen.to_string(), source })?;
    let store = AnyStore::open(&config.store_url, &config.namespace, config.limits).await?;
    let local = listener.local_addr()?;
    let mut server_config = ServerConfig::new();
    if let Some(t) = &config.auth_token {
        server_config = server_config.with_auth_token(t.as_str());
    }
    let router = idem_server::app(store.clone(), server_config);
    // Tests and scripts read the bound address from this line (useful with --listen 127.0.0.1:0).
    println!("idem listening on http://{local} (store {})", redact(&config.store_url));
    tracing::info!(%local, store = %redact(&config.store_url), "listening");
    // After the signal, in-flight requests get a bounded grace period: a client that stalls mid-request must
    // not keep the process from exiting.
    let (signalled, mut on_signal) = tokio::sync::watch::channel(false);
    let serving = idem_server::serve(router, listener, async move {
        shutdown_signal().await;
        let _ = signalled.send(true);
    });
    let served = tokio::select! {
        r = serving => r,
        () = async {
            let _ = on_signal.wait_for(|s| *s).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "requests still in flight after the grace period; closing them");
            Ok(())
        }
    };
    store.close().await;
    tracing::info!("store flushed; bye");
    served.map_err(Error::Io)
}
