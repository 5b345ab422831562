//! `idem serve`'s configuration: flags, environment and an optional TOML file merged into one checked
//! [`ServeConfig`] (a flag beats the environment, which beats the file, which beats the default).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idem_tower::{InFlight, KeyPolicy, UnknownOutcome};

use idem_store::Limits;
use serde::Deserialize;

use super::routes::{RouteFile, Routes, resolve_routes};
use crate::error::Error;
use crate::tls::{TlsFiles, UpstreamTlsFiles};
use idem_backends::StoreUrl;

/// Flags of `idem serve`. Each is also read from its `IDEM_*` environment variable and from the config file;
/// a flag beats the environment, which beats the file, which beats the default.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "IDEM_LISTEN")]
    listen: Option<String>,
    /// Store URL: sqlite:PATH, memory:, postgres://… (several hosts, sslmode=, sslrootcert=), redis://…, rediss://… (cacert=), redis+sentinel://… or redis+cluster://… (wait_replicas=) [default: sqlite:./idem-data/idem.db].
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
    /// File holding the admin token: the operator's pages under /ui/ ask for it once (a session cookie
    /// follows), the JSON endpoints under /v1/admin/ take it as a bearer token; their actions (release a
    /// record, resolve an unknown outcome, forget a poison item, pause/resume/trigger a cron job) need it or a client certificate (--tls-client-ca).
    #[arg(long, env = "IDEM_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Allow a non-loopback listener without TLS (TLS is terminated in front of idem) and the KV API on one
    /// without --auth-token-file or --tls-client-ca (env: 1/0, true/false, yes/no, on/off).
    #[arg(long, env = "IDEM_INSECURE", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    insecure: bool,
    /// Serve HTTPS on the main and the admin listener with this certificate chain (PEM, leaf first); with
    /// --tls-key. Re-read with the key on SIGHUP, for new connections.
    #[arg(long, env = "IDEM_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "IDEM_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Require a client certificate issued by a CA in this PEM file at the TLS handshake (needs --tls-cert).
    #[arg(long, env = "IDEM_TLS_CLIENT_CA", value_name = "FILE")]
    tls_client_ca: Option<PathBuf>,
    /// Close a client connection that has had no request running for this long, between requests or
    /// part-way through a request header, e.g. 75s [default: 75s, nginx's keepalive_timeout; keep it longer
    /// than the idle timeout of a proxy or client pool in front].
    #[arg(long, env = "IDEM_CLIENT_IDLE_TIMEOUT")]
    client_idle_timeout: Option<String>,
    /// How long one response write may wait for a client to read before its connection is ended, logged
    /// and counted (idem_client_send_timeouts_total), e.g. 60s [default: 60s, nginx's send_timeout; counted
    /// between two writes that moved bytes, so a slow but steady reader is never cut].
    #[arg(long, env = "IDEM_CLIENT_SEND_TIMEOUT")]
    client_send_timeout: Option<String>,
    /// Optional TOML file with the same settings, named as the flags with `_` for `-` (listen, store,
    /// upstream, admin_listen, retention, …).
    #[arg(long, env = "IDEM_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    proxy: ProxyArgs,
}

/// Reverse-proxy flags: with `--upstream`, the main listener forwards every request to the upstream and
/// applies Idempotency-Key handling to the covered methods; the KV API, /metrics, /healthz and the record
/// look-up move to `--admin-listen`.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    /// Forward every request to this upstream (http[s]://HOST:PORT[/PREFIX]; HOST:PORT means http://). An
    /// https upstream's certificate is checked against the platform's trust store unless --upstream-cacert.
    #[arg(long, env = "IDEM_UPSTREAM")]
    upstream: Option<String>,
    /// Trust only the CA certificates in this PEM file for an https upstream.
    #[arg(long, env = "IDEM_UPSTREAM_CACERT", value_name = "FILE")]
    upstream_cacert: Option<PathBuf>,
    /// Present this client certificate chain (PEM, leaf first) to an https upstream; with --upstream-cert-key.
    #[arg(long, env = "IDEM_UPSTREAM_CERT", value_name = "FILE")]
    upstream_cert: Option<PathBuf>,
    /// The private key (PEM) of --upstream-cert.
    #[arg(long, env = "IDEM_UPSTREAM_CERT_KEY", value_name = "FILE")]
    upstream_cert_key: Option<PathBuf>,
    /// With --upstream: address of the admin listener (KV API, /metrics, /healthz, records)
    /// [default: 127.0.0.1:8081].
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// How long a completed response is kept and replayed, e.g. 24h (1s..=365d) [default: 24h].
    #[arg(long, env = "IDEM_RETENTION")]
    retention: Option<String>,
    /// Lease of an executing request: how long a key stays locked after its holder dies, e.g. 10s (≥ 1s;
    /// renewed every third of it while the request runs) [default: 10s].
    #[arg(long, env = "IDEM_LEASE")]
    lease: Option<String>,
    /// Answer 400 to requests of the --methods without an Idempotency-Key (env: 1/0, true/false, yes/no).
    #[arg(long, env = "IDEM_REQUIRE_KEY", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    require_key: bool,
    /// Methods under Idempotency-Key handling, comma-separated [default: POST,PATCH].
    #[arg(long, env = "IDEM_METHODS")]
    methods: Option<String>,
    /// Largest response body stored for replay, in bytes; larger ones are never replayed nor re-executed
    /// [default: 1048576 (1 MiB)].
    #[arg(long, env = "IDEM_MAX_STORED_BODY")]
    max_stored_body: Option<usize>,
    /// Largest request body accepted with an Idempotency-Key, in bytes [default: 16777216 (16 MiB)].
    #[arg(long, env = "IDEM_MAX_REQUEST_BODY")]
    max_request_body: Option<usize>,
    /// A retry of an executing request waits up to this long for its response instead of getting 409 at once,
    /// e.g. 5s [default: 0s, answer 409 at once].
    #[arg(long, env = "IDEM_IN_FLIGHT_WAIT")]
    in_flight_wait: Option<String>,
    /// How long the upstream may take to answer a request (its headers, and for a keyed request also the part
    /// of the body that is stored); after it the outcome is unknown [default: 60s].
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT")]
    upstream_timeout: Option<String>,
    /// A pooled upstream connection idle for longer than this is closed instead of reused; keep it below the
    /// upstream's keep-alive timeout (a `Keep-Alive: timeout=N` the upstream sends is honoured too) [default:
    /// 1s].
    #[arg(long, env = "IDEM_UPSTREAM_IDLE_TIMEOUT")]
    upstream_idle_timeout: Option<String>,
    /// Headers whose values scope keys to a caller, comma-separated; requests with none of them share the
    /// "anonymous" scope [default: authorization,x-api-key].
    #[arg(long, env = "IDEM_CREDENTIAL_HEADER")]
    credential_header: Option<String>,
    /// Release the key when the outcome is unknown (reset or timeout after sending), so a retry executes again;
    /// only for upstreams that dedupe on the forwarded Idempotency-Key.
    #[arg(long, env = "IDEM_RELEASE_UNKNOWN", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    release_unknown: bool,
    /// Memory for finished records kept to answer replays without a store read, in bytes; 0 turns it off.
    /// Only with the embedded store (sqlite: or memory:), which no other process writes; refused with a shared
    /// store, where another proxy may delete a record this one would go on replaying
    /// [default: 16777216 (16 MiB) with sqlite: and memory:, 0 otherwise].
    #[arg(long, env = "IDEM_REPLAY_CACHE")]
    replay_cache: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    store: Option<String>,
    namespace: Option<String>,
    max_value_bytes: Option<usize>,
    auth_token_file: Option<PathBuf>,
    admin_token_file: Option<PathBuf>,
    insecure: Option<bool>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    client_idle_timeout: Option<String>,
    client_send_timeout: Option<String>,
    upstream: Option<String>,
    upstream_cacert: Option<PathBuf>,
    upstream_cert: Option<PathBuf>,
    upstream_cert_key: Option<PathBuf>,
    admin_listen: Option<String>,
    retention: Option<String>,
    lease: Option<String>,
    require_key: Option<bool>,
    methods: Option<String>,
    max_stored_body: Option<usize>,
    max_request_body: Option<usize>,
    in_flight_wait: Option<String>,
    upstream_timeout: Option<String>,
    upstream_idle_timeout: Option<String>,
    credential_header: Option<String>,
    release_unknown: Option<bool>,
    replay_cache: Option<u64>,
    /// `[[route]]` tables: webhook and other per-path policies (proxy only).
    #[serde(default)]
    route: Vec<RouteFile>,
}

/// The validated configuration of one server.
#[derive(Debug)]
pub struct ServeConfig {
    pub(super) listen: SocketAddr,
    pub(super) store_url: StoreUrl,
    pub(super) namespace: String,
    pub(super) limits: Limits,
    pub(super) auth_token: Option<String>,
    /// The admin token of the pages and /v1/admin/ (`--admin-token-file`).
    pub(super) admin_token: Option<String>,
    /// Whether every connection presents a trusted client certificate (`--tls-client-ca`).
    pub(super) client_cert: bool,
    /// Whether /ui/ and /v1/admin/ are served: not on a non-loopback listener that has neither an admin
    /// token nor client certificates.
    pub(super) admin_pages: bool,
    /// The files and the configuration read from them at start-up.
    pub(super) tls: Option<(TlsFiles, std::sync::Arc<rustls::ServerConfig>)>,
    pub(super) proxy: Option<ProxyConfig>,
    pub(super) client_idle_timeout: Duration,
    pub(super) client_send_timeout: Duration,
    /// What `--insecure` allowed, logged at start-up.
    pub(super) warnings: Vec<String>,
}

/// The validated reverse-proxy settings.
#[derive(Debug)]
pub(super) struct ProxyConfig {
    pub(super) upstream: String,
    /// The TLS client of an https upstream, read from the files at start-up; `None`: the platform's store.
    pub(super) upstream_tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    pub(super) admin_listen: SocketAddr,
    pub(super) retention: Duration,
    pub(super) lease: Duration,
    pub(super) key_policy: KeyPolicy,
    pub(super) methods: Vec<http::Method>,
    pub(super) max_stored_body: usize,
    pub(super) max_request_body: usize,
    pub(super) in_flight: InFlight,
    pub(super) upstream_timeout: Duration,
    pub(super) upstream_idle_timeout: Duration,
    pub(super) credential_headers: Vec<http::HeaderName>,
    pub(super) unknown_outcome: UnknownOutcome,
    /// `None`: the default for the store.
    pub(super) replay_cache: Option<u64>,
    /// The `[[route]]` tables, checked.
    pub(super) routes: Vec<idem_tower::RoutePolicy>,
    /// The routes' secret files, re-read on SIGHUP.
    pub(super) secret_files: Vec<super::routes::SecretFile>,
    /// What the route tables allow but start-up warns about (unsigned key sources, readable secrets).
    pub(super) route_warnings: Vec<String>,
}

/// The replay cache's size when `--replay-cache` is not given and the store is the embedded one.
pub(super) const DEFAULT_REPLAY_CACHE: u64 = 16 << 20;

fn duration(flag: &str, value: Option<String>, default: Duration) -> Result<Duration, Error> {
    match value {
        None => Ok(default),
        Some(v) => humantime::parse_duration(&v)
            .map_err(|e| Error::Config(format!("--{flag} {v:?} is not a duration like 10s or 24h: {e}"))),
    }
}

/// Without `--upstream`, a proxy-only setting is a mistake worth one line, not a silent no-op.
fn refuse_proxy_flags(args: &ProxyArgs, file: &FileConfig) -> Result<(), Error> {
    let given = [
        ("upstream-cacert", args.upstream_cacert.is_some() || file.upstream_cacert.is_some()),
        ("upstream-cert", args.upstream_cert.is_some() || file.upstream_cert.is_some()),
        ("upstream-cert-key", args.upstream_cert_key.is_some() || file.upstream_cert_key.is_some()),
        ("admin-listen", args.admin_listen.is_some() || file.admin_listen.is_some()),
        ("retention", args.retention.is_some() || file.retention.is_some()),
        ("lease", args.lease.is_some() || file.lease.is_some()),
        ("require-key", args.require_key || file.require_key.is_some()),
        ("methods", args.methods.is_some() || file.methods.is_some()),
        ("max-stored-body", args.max_stored_body.is_some() || file.max_stored_body.is_some()),
        ("max-request-body", args.max_request_body.is_some() || file.max_request_body.is_some()),
        ("in-flight-wait", args.in_flight_wait.is_some() || file.in_flight_wait.is_some()),
        ("upstream-timeout", args.upstream_timeout.is_some() || file.upstream_timeout.is_some()),
        ("upstream-idle-timeout", args.upstream_idle_timeout.is_some() || file.upstream_idle_timeout.is_some()),
        ("credential-header", args.credential_header.is_some() || file.credential_header.is_some()),
        ("release-unknown", args.release_unknown || file.release_unknown.is_some()),
        ("replay-cache", args.replay_cache.is_some() || file.replay_cache.is_some()),
        ("[[route]]", !file.route.is_empty()),
    ];
    match given.iter().find(|(_, set)| *set) {
        Some((flag, _)) if flag.starts_with('[') => {
            Err(Error::Config(format!("{flag} applies to the proxy only: add --upstream URL")))
        }
        Some((flag, _)) => Err(Error::Config(format!("--{flag} applies to the proxy only: add --upstream URL"))),
        None => Ok(()),
    }
}

fn resolve_proxy(args: ProxyArgs, file: &mut FileConfig) -> Result<Option<ProxyConfig>, Error> {
    let Some(upstream) = args.upstream.clone().or(file.upstream.take()) else {
        return refuse_proxy_flags(&args, file).map(|()| None);
    };
    // HOST:PORT means http://HOST:PORT, as for `idem kv --url` and curl.
    let upstream = crate::client::with_default_scheme(&upstream).into_owned();
    let tls_files = UpstreamTlsFiles {
        cacert: args.upstream_cacert.or(file.upstream_cacert.take()),
        client: match (
            args.upstream_cert.or(file.upstream_cert.take()),
            args.upstream_cert_key.or(file.upstream_cert_key.take()),
        ) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::Config("--upstream-cert needs --upstream-cert-key (its private key)".into()));
            }
            (None, Some(_)) => {
                return Err(Error::Config("--upstream-cert-key needs --upstream-cert (its certificate)".into()));
            }
        },
    };
    let https = upstream.get(..8).is_some_and(|s| s.eq_ignore_ascii_case("https://"));
    if !https && (tls_files.cacert.is_some() || tls_files.client.is_some()) {
        let flag = if tls_files.cacert.is_some() { "upstream-cacert" } else { "upstream-cert" };
        return Err(Error::Config(format!("--{flag} applies to an https upstream only: --upstream https://…")));
    }
    // Read now: a bad file is a start-up error (exit 2), not a failure of the first request.
    let upstream_tls = tls_files.load()?;
    let admin_s = args.admin_listen.or(file.admin_listen.take()).unwrap_or_else(|| "127.0.0.1:8081".into());
    let admin_listen: SocketAddr =
        admin_s.parse().map_err(|_| Error::Config(format!("--admin-listen {admin_s:?} is not an IP:PORT address")))?;
    let retention = duration("retention", args.retention.or(file.retention.take()), Duration::from_secs(86_400))?;
    if !(idem_store::MIN_TTL..=idem_store::MAX_TTL).contains(&retention) {
        return Err(Error::Config(format!(
            "--retention {} is outside 1s..=365d",
            humantime::format_duration(retention)
        )));
    }
    let lease = duration("lease", args.lease.or(file.lease.take()), Duration::from_secs(10))?;
    if lease < Duration::from_secs(1) || lease > retention {
        return Err(Error::Config(format!(
            "--lease {} must be at least 1s and at most the retention",
            humantime::format_duration(lease)
        )));
    }
    let methods_s = args.methods.or(file.methods.take()).unwrap_or_else(|| "POST,PATCH".into());
    let methods = methods_s
        .split(',')
        .map(|m| {
            let m = m.trim().to_ascii_uppercase();
            http::Method::from_bytes(m.as_bytes())
                .map_err(|_| Error::Config(format!("--methods: {m:?} is not a method")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let max_stored_body = args.max_stored_body.or(file.max_stored_body).unwrap_or(1 << 20);
    let max_request_body = args.max_request_body.or(file.max_request_body).unwrap_or(16 << 20);
    if max_request_body == 0 {
        return Err(Error::Config("--max-request-body must be at least 1".into()));
    }
    let wait = duration("in-flight-wait", args.in_flight_wait.or(file.in_flight_wait.take()), Duration::ZERO)?;
    let in_flight = if wait.is_zero() { InFlight::Reject } else { InFlight::Wait(wait) };
    let upstream_timeout =
        duration("upstream-timeout", args.upstream_timeout.or(file.upstream_timeout.take()), Duration::from_secs(60))?;
    if upstream_timeout.is_zero() {
        return Err(Error::Config("--upstream-timeout must be more than 0s".into()));
    }
    // Zero is allowed: every request then gets a new connection.
    let upstream_idle_timeout = duration(
        "upstream-idle-timeout",
        args.upstream_idle_timeout.or(file.upstream_idle_timeout.take()),
        idem_server::DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    )?;
    let header_s =
        args.credential_header.or(file.credential_header.take()).unwrap_or_else(|| "authorization,x-api-key".into());
    let credential_headers = header_s
        .split(',')
        .map(|h| {
            http::HeaderName::try_from(h.trim())
                .map_err(|_| Error::Config(format!("--credential-header: {h:?} is not a header name")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Routes { routes, secret_files, warnings: route_warnings } =
        resolve_routes(std::mem::take(&mut file.route), retention)?;
    let require_key = args.require_key || file.require_key.unwrap_or(false);
    let release_unknown = args.release_unknown || file.release_unknown.unwrap_or(false);
    Ok(Some(ProxyConfig {
        upstream,
        upstream_tls,
        admin_listen,
        retention,
        lease,
        key_policy: if require_key { KeyPolicy::Required } else { KeyPolicy::Optional },
        methods,
        max_stored_body,
        max_request_body,
        in_flight,
        upstream_timeout,
        upstream_idle_timeout,
        credential_headers,
        unknown_outcome: if release_unknown { UnknownOutcome::Release } else { UnknownOutcome::Keep },
        replay_cache: args.replay_cache.or(file.replay_cache),
        routes,
        secret_files,
        route_warnings,
    }))
}

fn read_token(path: &Path, flag: &str) -> Result<String, Error> {
    let token = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("cannot read --{flag} {}: {e}", path.display())))?;
    let token = token.trim().to_owned();
    if token.is_empty() {
        return Err(Error::Config(format!("--{flag} {} is empty", path.display())));
    }
    Ok(token)
}

/// The TOML configuration file, or defaults without one.
fn read_config_file(path: Option<&std::path::Path>) -> Result<FileConfig, Error> {
    let Some(p) = path else { return Ok(FileConfig::default()) };
    let text = std::fs::read_to_string(p)
        .map_err(|e| Error::Config(format!("cannot read config file {}: {e}", p.display())))?;
    // The error's message and line, not its Display, which quotes the offending line: a secret written into the
    // file where it does not belong would be echoed.
    toml::from_str::<FileConfig>(&text).map_err(|e| {
        let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        Error::Config(format!("config file {}: line {line}: {}", p.display(), e.message().trim()))
    })
}

/// A namespace names SQL tables and key prefixes: `[a-z_][a-z0-9_]*`, at most 63 bytes (PostgreSQL's limit).
fn check_namespace(namespace: &str) -> Result<(), Error> {
    let valid = namespace.len() <= 63
        && namespace.bytes().next().is_some_and(|b| b == b'_' || b.is_ascii_lowercase())
        && namespace.bytes().all(|b| b == b'_' || b.is_ascii_lowercase() || b.is_ascii_digit());
    if valid {
        Ok(())
    } else {
        Err(Error::Config(format!("--namespace {namespace:?} must match [a-z_][a-z0-9_]*, at most 63 bytes")))
    }
}

impl ServeArgs {
    /// Merges flags, environment, file and defaults, and checks them.
    ///
    /// # Errors
    /// [`Error::Config`] for an unreadable config or token file, a bad address, a zero value limit, or a
    /// non-loopback address without a token and without `--insecure`.
    pub fn resolve(self) -> Result<ServeConfig, Error> {
        let mut file = read_config_file(self.config.as_deref())?;
        let proxy = resolve_proxy(self.proxy, &mut file)?;
        let listen_s = self.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen: SocketAddr =
            listen_s.parse().map_err(|_| Error::Config(format!("--listen {listen_s:?} is not an IP:PORT address")))?;
        let store_url = self.store.or(file.store).unwrap_or_else(|| "sqlite:./idem-data/idem.db".into());
        // Parsed now: an unknown scheme is a start-up error before anything is bound.
        let store_url = StoreUrl::parse(&store_url)?;
        if let Some(p) = &proxy
            && p.replay_cache.is_some_and(|bytes| bytes > 0)
            && !store_url.is_exclusive()
        {
            return Err(Error::Config(format!(
                "--replay-cache needs the embedded store (sqlite: or memory:); with {} another proxy may delete a \
                 record this one would go on replaying",
                store_url.redacted()
            )));
        }
        let namespace = self.namespace.or(file.namespace).unwrap_or_else(|| "idem".into());
        check_namespace(&namespace)?;
        let max_value_bytes = self.max_value_bytes.or(file.max_value_bytes).unwrap_or(16 * 1024 * 1024);
        if max_value_bytes == 0 {
            return Err(Error::Config("--max-value-bytes must be at least 1".into()));
        }
        let auth_token =
            self.auth_token_file.or(file.auth_token_file).map(|p| read_token(&p, "auth-token-file")).transpose()?;
        let admin_token =
            self.admin_token_file.or(file.admin_token_file).map(|p| read_token(&p, "admin-token-file")).transpose()?;
        let insecure = self.insecure || file.insecure.unwrap_or(false);
        let tls_files = match (self.tls_cert.or(file.tls_cert), self.tls_key.or(file.tls_key)) {
            (Some(cert), Some(key)) => {
                Some(TlsFiles { cert, key, client_ca: self.tls_client_ca.or(file.tls_client_ca) })
            }
            (None, None) if self.tls_client_ca.is_some() || file.tls_client_ca.is_some() => {
                return Err(Error::Config("--tls-client-ca needs --tls-cert and --tls-key".into()));
            }
            (None, None) => None,
            (Some(_), None) => return Err(Error::Config("--tls-cert needs --tls-key (its private key)".into())),
            (None, Some(_)) => return Err(Error::Config("--tls-key needs --tls-cert (its certificate)".into())),
        };
        // Read now: a bad file is a start-up error (exit 2), not a failure of the first handshake.
        let tls = tls_files.map(|f| f.load().map(|config| (f, config))).transpose()?;
        // Traffic to a non-loopback address crosses a network: in clear text only when TLS ends in front of
        // idem, which only the operator knows (--insecure).
        let listeners = std::iter::once(listen).chain(proxy.as_ref().map(|p| p.admin_listen));
        let mut warnings: Vec<String> = proxy.as_ref().map(|p| p.route_warnings.clone()).unwrap_or_default();
        for open in listeners.filter(|a| !a.ip().is_loopback()).filter(|_| tls.is_none()) {
            if !insecure {
                return Err(Error::Config(format!(
                    "refusing to serve plain HTTP on non-loopback {open}: give --tls-cert FILE --tls-key FILE, or \
                     --insecure if TLS is terminated in front of idem"
                )));
            }
            warnings.push(format!(
                "serving plain HTTP on non-loopback {open} (--insecure): requests, bearer tokens included, cross the \
                 network unencrypted unless TLS is terminated in front of idem"
            ));
        }
        // The KV API is what the token protects: in proxy mode it lives on the admin listener, and the main
        // listener serves the upstream's API under the upstream's own authentication. A required client
        // certificate authenticates the caller too.
        let kv_listen = proxy.as_ref().map_or(listen, |p| p.admin_listen);
        let client_auth = tls.as_ref().is_some_and(|(f, _)| f.client_ca.is_some());
        if !kv_listen.ip().is_loopback() && auth_token.is_none() && !client_auth {
            if !insecure {
                return Err(Error::Config(format!(
                    "refusing to serve the KV API on non-loopback {kv_listen} without --auth-token-file or \
                     --tls-client-ca; pass --insecure to allow it"
                )));
            }
            warnings.push(format!(
                "the KV API on non-loopback {kv_listen} answers anyone who can reach it (--insecure, no \
                 --auth-token-file or --tls-client-ca)"
            ));
        }
        // The pages show stored answers: on a listener others can reach, only to an admin.
        let admin_pages = kv_listen.ip().is_loopback() || admin_token.is_some() || client_auth;
        if !admin_pages {
            warnings.push(format!(
                "not serving /ui/ and /v1/admin/ on non-loopback {kv_listen}: give --admin-token-file or \
                 --tls-client-ca"
            ));
        }
        let client_idle_timeout = duration(
            "client-idle-timeout",
            self.client_idle_timeout.or(file.client_idle_timeout),
            idem_server::DEFAULT_CLIENT_IDLE_TIMEOUT,
        )?;
        if client_idle_timeout < Duration::from_secs(1) {
            return Err(Error::Config("--client-idle-timeout must be at least 1s".into()));
        }
        let client_send_timeout = duration(
            "client-send-timeout",
            self.client_send_timeout.or(file.client_send_timeout),
            idem_server::DEFAULT_CLIENT_SEND_TIMEOUT,
        )?;
        if client_send_timeout < Duration::from_secs(1) {
            return Err(Error::Config("--client-send-timeout must be at least 1s".into()));
        }
        Ok(ServeConfig {
            warnings,
            client_idle_timeout,
            client_send_timeout,
            listen,
            store_url,
            namespace,
            limits: Limits::default().with_max_value_bytes(max_value_bytes),
            auth_token,
            admin_token,
            client_cert: client_auth,
            admin_pages,
            tls,
            proxy,
        })
    }
}
