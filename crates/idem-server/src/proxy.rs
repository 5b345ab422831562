//! The reverse proxy of `idem serve --upstream`: every request goes to one upstream over pooled HTTP/1.1
//! connections (TLS for an `https` upstream); POST and PATCH pass through an [`IdempotencyLayer`] first.

use idem_core::ProblemType;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::ConnectInfo;
use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{HttpConnector, capture_connection};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use idem_store::Store;
use idem_tower::Body;
use idem_tower::{BufferedBody, Drain, DrainFuture, DrainLayer, Idempotency, IdempotencyLayer, UpstreamFailure};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::time::Instant as Deadline;
use tower::Layer;

use axum::response::IntoResponse;

use crate::Problem;
use crate::connections::ViaTls;
use crate::metrics::ProxyMetrics;
use crate::upstream_conn::{Facts, ObservingConnector, TlsHandshakeFailed, TlsTarget, Unread};

/// The default of [`Upstream::new`]'s `idle_timeout`: a pooled connection idle longer than this is not
/// reused. Below the shortest keep-alive of common servers (gunicorn 2 s; Node, uvicorn and Apache 5 s;
/// nginx 75 s), so idem closes its idle connections before the upstream does.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(1);

/// A pass-through request body up to this many bytes, with a known length, is buffered before it is sent so
/// that it can be sent again when the upstream provably never read it. (Bodies of keyed requests are always
/// buffered by the layer, up to its `--max-request-body`.)
const REPLAY_BUFFER: u64 = 64 * 1024;

/// Why an upstream URL was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// Not an absolute `http://` or `https://HOST[:PORT][/PREFIX]` URL (user information, query and fragment
    /// refused).
    #[error("upstream URL {url:?} is not usable: {reason} (expected http[s]://HOST:PORT[/PREFIX])")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS client of an `https` upstream cannot be set up: no certificate in the platform's trust store,
    /// or a TLS configuration given for an `http` upstream.
    #[error("upstream TLS: {reason}")]
    Tls {
        /// What is wrong, on one line.
        reason: String,
    },
}

/// One upstream HTTP service: a pooled hyper client, the upstream's base URL and the response timeout.
///
/// As a tower `Service` it never fails: a connection that cannot be made answers 502 marked
/// [`UpstreamFailure::NotSent`]; an error after sending (reset, a response not started within the timeout)
/// answers 502 / 504 marked [`UpstreamFailure::OutcomeUnknown`], which the layer stores as unknown.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// Shared: the layer and the router clone their inner service for every request (about ten clones per
    /// proxied request), and two hyper clients cost a dozen reference counts and copies each.
    inner: Arc<UpstreamInner>,
}

#[derive(Debug)]
struct UpstreamInner {
    /// Pooled connections, each closed after `idle_timeout` without use.
    client: Client<ObservingConnector, Body>,
    /// No pool: the one retry of a request the upstream provably never read goes on a new connection.
    fresh: Client<ObservingConnector, Body>,
    scheme: Scheme,
    authority: Authority,
    prefix: String,
    host: HeaderValue,
    timeout: Duration,
}

impl Upstream {
    /// An upstream at `url` (`http://HOST:PORT`, optionally with a path prefix every request path is appended
    /// to), waiting at most `timeout` for a response to start, and reusing a pooled connection only while it
    /// has been idle for less than `idle_timeout` ([`DEFAULT_UPSTREAM_IDLE_TIMEOUT`] unless the upstream keeps
    /// idle connections open longer; a `Keep-Alive: timeout=N` the upstream announces shortens it).
    ///
    /// An `https://` upstream's certificate is checked against the platform's trust store (rustls-native-certs:
    /// on Debian `/etc/ssl/certs`); [`Upstream::with_tls`] takes a configuration of the caller's.
    ///
    /// # Errors
    /// [`UpstreamError::InvalidUrl`] when `url` is not an absolute `http://` or `https://` URL or carries a
    /// query; [`UpstreamError::Tls`] for `https` when the platform's trust store holds no certificate.
    pub fn new(url: &str, timeout: Duration, idle_timeout: Duration) -> Result<Self, UpstreamError> {
        Self::with_tls(url, timeout, idle_timeout, None)
    }

    /// [`Upstream::new`] with the TLS client configuration of an `https` upstream: whom it trusts, the client
    /// certificate it presents. Its ALPN list is replaced by `http/1.1` alone: the connection observer proves
    /// "not sent" per HTTP/1.1 connection, which an `h2` connection multiplexing many requests is not.
    /// `None`: the platform's trust store, no client certificate.
    ///
    /// # Errors
    /// As [`Upstream::new`]; [`UpstreamError::Tls`] when `tls` is given for an `http://` upstream.
    pub fn with_tls(
        url: &str,
        timeout: Duration,
        idle_timeout: Duration,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<Self, UpstreamError> {
        // Never repeat a password in an error message.
        let shown = idem_core::redact_url(url);
        let invalid = |reason: &str| UpstreamError::InvalidUrl { url: shown.clone(), reason: reason.to_owned() };
        let uri: Uri = url.parse().map_err(|e: http::uri::InvalidUri| invalid(&e.to_string()))?;
        let scheme = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP => Scheme::HTTP,
            Some(s) if *s == Scheme::HTTPS => Scheme::HTTPS,
            _ => return Err(invalid("the scheme must be http or https")),
        };
        let authority = uri.authority().cloned().ok_or_else(|| invalid("no host"))?;
        if uri.query().is_some() {
            return Err(invalid("a query is not allowed"));
        }
        if authority.as_str().contains('@') {
            // It would travel in the Host header and the logs; the upstream's credentials belong elsewhere.
            return Err(invalid("user information (user:password@) is not allowed"));
        }
        if authority.as_str().rsplit_once(':').is_some_and(|(_, p)| !p.ends_with(']') && p.parse::<u16>().is_err()) {
            return Err(invalid("the port must be a number from 0 to 65535"));
        }
        if url.contains('#') {
            return Err(invalid("a fragment is not allowed"));
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let host = HeaderValue::from_str(authority.as_str()).map_err(|e| invalid(&e.to_string()))?;
        let tls = match (&scheme, tls) {
            (s, Some(_)) if *s == Scheme::HTTP => {
                return Err(UpstreamError::Tls {
                    reason: format!("a TLS configuration was given for the plain http upstream {shown:?}"),
                });
            }
            (s, config) if *s == Scheme::HTTPS => Some(tls_target(&authority, config)?),
            _ => None,
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // hyper-util's connector makes the TCP connection only; TLS is ours, over the observed TCP stream.
        connector.enforce_http(false);
        // Connecting (with the TLS handshake) must fail, as "not sent", before the response timeout would call
        // the outcome unknown.
        let connect_timeout = (timeout / 2).min(Duration::from_secs(5));
        connector.set_connect_timeout(Some(connect_timeout));
        let connector = ObservingConnector::new(connector, tls, connect_timeout);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle_timeout)
            // Without a timer hyper-util checks the idle timeout only when it next takes a connection from the
            // pool: an idle connection stayed open (and, once the upstream closed it, in CLOSE_WAIT) until
            // then. With one, a reaper closes connections idle past the timeout.
            .pool_timer(TokioTimer::new())
            .pool_max_idle_per_host(256)
            .build(connector.clone());
        let fresh = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(connector);
        Ok(Self { inner: Arc::new(UpstreamInner { client, fresh, scheme, authority, prefix, host, timeout }) })
    }

    fn target(&self, original: &Uri) -> Result<Uri, http::Error> {
        let path_and_query = match (self.inner.prefix.as_str(), original.path_and_query()) {
            // No prefix: the request's own path and query, shared, not formatted and parsed again.
            ("", Some(pq)) => pq.clone(),
            (prefix, pq) => format!("{prefix}{}", pq.map_or("/", PathAndQuery::as_str)).parse()?,
        };
        Uri::builder()
            .scheme(self.inner.scheme.clone())
            .authority(self.inner.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }
}

/// The TLS half of an `https` upstream at `authority`: `config` (or the platform's trust store) offering only
/// `http/1.1` in ALPN, and the server name to verify and send as SNI.
fn tls_target(authority: &Authority, config: Option<Arc<rustls::ClientConfig>>) -> Result<TlsTarget, UpstreamError> {
    let mut config = match config {
        Some(config) => (*config).clone(),
        None => platform_config()?,
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // An IPv6 literal is bracketed in a URL, not in a certificate's IP address.
    let host = authority.host().trim_start_matches('[').trim_end_matches(']');
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| UpstreamError::Tls { reason: format!("{host:?} is not a server name: {e}") })?;
    Ok(TlsTarget { connector: tokio_rustls::TlsConnector::from(Arc::new(config)), name })
}

/// The platform's trust store on rustls's ring provider, no client certificate.
fn platform_config() -> Result<rustls::ClientConfig, UpstreamError> {
    let roots =
        idem_tls::platform_roots("--upstream-cacert").map_err(|e| UpstreamError::Tls { reason: e.to_string() })?;
    rustls::ClientConfig::builder_with_provider(idem_tls::provider())
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
        .map_err(|e| UpstreamError::Tls { reason: e.to_string() })
}

// Hop-by-hop fields (RFC 9110 §7.6.1) belong to one connection and are not forwarded. `Trailer` is not one
// (it names the trailer fields end to end, and hyper's HTTP/1 encoder sends only the trailer fields it names).
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry none of these: one pass over the names (standard names compare as enum values)
    // costs less than hashing every hop-by-hop name for a removal.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&listed) {
        headers.remove(name);
    }
}

/// The RFC 7239 `Forwarded` element for this hop: `for` the client, `proto` (`https` when the client's
/// connection is TLS), and `host` the client asked for.
fn forwarded(client: Option<SocketAddr>, tls: bool, host: Option<&str>) -> Option<HeaderValue> {
    use std::fmt::Write as _;
    let mut element = String::with_capacity(96);
    match client {
        // IPv6 addresses and ports must be quoted (RFC 7239 §6).
        Some(addr) => {
            let _ = write!(element, "for=\"{addr}\"");
        }
        None => element.push_str("for=unknown"),
    }
    element.push_str(if tls { ";proto=https" } else { ";proto=http" });
    if let Some(host) = host
        && host.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
    {
        element.push_str(";host=\"");
        element.push_str(host);
        element.push('"');
    }
    HeaderValue::from_maybe_shared(Bytes::from(element)).ok()
}

impl tower::Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The pooled client queues internally; there is no readiness to wait for.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await) })
    }
}

/// How one attempt to send a request upstream ended.
enum Sent {
    Answered(Response<hyper::body::Incoming>),
    /// No connection could be made: nothing was sent.
    NotConnected(hyper_util::client::legacy::Error),
    /// The connection failed before the answer; `unread` says whether the upstream provably never read it.
    Failed {
        error: hyper_util::client::legacy::Error,
        unread: Option<Unread>,
    },
    /// No answer began before the deadline.
    TimedOut,
}

impl Upstream {
    async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let deadline = Deadline::now() + self.inner.timeout;
        let (mut parts, body) = request.into_parts();
        let client = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let tls = parts.extensions.get::<ViaTls>().is_some();
        // The authority the client asked for: the request target's when it has one (HTTP/2's `:authority`,
        // an absolute-form target, whose authority RFC 9112 §3.2.2 puts before `Host`), else `Host`.
        let original_host = match parts.uri.authority() {
            Some(authority) => Some(authority.as_str()),
            None => parts.headers.get(header::HOST).and_then(|h| h.to_str().ok()),
        };
        let forwarded = forwarded(client, tls, original_host);
        let target = match self.target(&parts.uri) {
            Ok(target) => target,
            Err(e) => {
                return Problem::bad_request(ProblemType::InvalidTarget, e.to_string()).into_response().map(Body::new);
            }
        };
        // Trailer fields reach a client that accepts them (HTTP/2, or `TE: trailers`, RFC 9110 §10.1.4), so the
        // upstream is told this hop accepts them too: servers send trailers only when asked (hyper does).
        let wants_trailers = parts.version == http::Version::HTTP_2
            || parts
                .headers
                .get_all(header::TE)
                .iter()
                .any(|v| v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("trailers"))));
        strip_hop_by_hop(&mut parts.headers);
        if wants_trailers {
            parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let Some(value) = forwarded {
            parts.headers.append(header::FORWARDED, value);
        }
        parts.headers.insert(header::HOST, self.inner.host.clone());
        parts.uri = target;
        parts.version = http::Version::HTTP_11;
        let (body, replay) = match replayable(&parts, body).await {
            Ok(prepared) => prepared,
            Err(e) => {
                return Problem::bad_request(ProblemType::RequestBodyUnreadable, e.to_string())
                    .into_response()
                    .map(Body::new);
            }
        };
        // What a second attempt needs: the head, and the body when it is whole in memory.
        let again = replay.map(|bytes| {
            let mut head = Request::new(());
            *head.method_mut() = parts.method.clone();
            *head.uri_mut() = parts.uri.clone();
            *head.version_mut() = parts.version;
            *head.headers_mut() = parts.headers.clone();
            (head, bytes)
        });
        let started = Instant::now();
        let mut sent = self.send(&self.inner.client, Request::from_parts(parts, body), deadline).await;
        // RFC 9110 §9.2.2: a request may be retried automatically when it "was never applied"; the connection's
        // facts prove that only in the cases `upstream_conn` lists. One retry, on a new connection.
        if let Sent::Failed { unread: Some(unread), error } = &sent {
            tracing::info!(reason = %unread.reason(), error = %idem_store::error_chain(error), "upstream never read the request");
            if let (Some((head, bytes)), Some(label)) = (again, unread.retry_label()) {
                metrics::counter!("idem_upstream_retries_total", "reason" => label).increment(1);
                let (head, ()) = head.into_parts();
                let retry = Request::from_parts(head, Body::from(bytes));
                sent = match self.send(&self.inner.fresh, retry, deadline).await {
                    // Neither attempt was read: nothing took effect.
                    Sent::Failed { unread: Some(unread), error } => {
                        tracing::info!(reason = %unread.reason(), error = %idem_store::error_chain(&error), "upstream never read the retry");
                        Sent::Failed { unread: Some(unread), error }
                    }
                    other => other,
                };
            }
        }
        // Looked up once: the macro hashes the key in the registry on every call.
        static UPSTREAM_SECONDS: std::sync::OnceLock<metrics::Histogram> = std::sync::OnceLock::new();
        UPSTREAM_SECONDS
            .get_or_init(|| metrics::histogram!("idem_upstream_seconds"))
            .record(started.elapsed().as_secs_f64());
        match sent {
            Sent::Answered(response) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // The client's connection has its own version; an HTTP/1.0 upstream must not downgrade it.
                parts.version = http::Version::HTTP_11;
                Response::from_parts(parts, Body::new(body))
            }
            Sent::NotConnected(e) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "connect").increment(1);
                tracing::warn!(error = %idem_store::error_chain(&e), "upstream unreachable");
                match TlsHandshakeFailed::find(&e) {
                    // The caller cannot fix the upstream's certificate, but the cause saves the operator a
                    // trip to the logs; it names no secret.
                    Some(tls) => not_sent(&format!("{tls}; the request was not sent")),
                    None => not_sent("the upstream service could not be reached; the request was not sent"),
                }
            }
            Sent::Failed { unread: Some(unread), .. } => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "unread").increment(1);
                not_sent(&format!("{}; the request was not executed", unread.reason()))
            }
            Sent::Failed { error, unread: None } => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "failed").increment(1);
                let reason = idem_store::error_chain(&error);
                tracing::warn!(error = %reason, "upstream failed after the request was sent");
                unknown(
                    StatusCode::BAD_GATEWAY,
                    "the request was sent upstream but the connection failed before a response; it may or may \
                     not have taken effect"
                        .to_owned(),
                    reason,
                )
            }
            Sent::TimedOut => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "timeout").increment(1);
                let reason = format!("no response within {}", humantime::format_duration(self.inner.timeout));
                let detail = format!("the upstream sent {reason}; the request may or may not have taken effect");
                unknown(StatusCode::GATEWAY_TIMEOUT, detail, reason)
            }
        }
    }

    /// One attempt on `client`'s connections, with what the connection saw when it failed.
    async fn send(
        &self,
        client: &Client<ObservingConnector, Body>,
        mut request: Request<Body>,
        deadline: Deadline,
    ) -> Sent {
        let capture = capture_connection(&mut request);
        let request =
            request.map(|body| Body::new(Marked { body, capture: capture.clone(), marked: AtomicBool::new(false) }));
        match tokio::time::timeout_at(deadline, client.request(request)).await {
            Ok(Ok(response)) => {
                if let Some(facts) = response.extensions().get::<Arc<Facts>>()
                    && let Some(timeout) = keep_alive_timeout(response.headers())
                {
                    facts.announce_keep_alive(timeout);
                }
                Sent::Answered(response)
            }
            Ok(Err(error)) if error.is_connect() => Sent::NotConnected(error),
            Ok(Err(error)) => {
                let facts = capture.connection_metadata().as_ref().and_then(Facts::of);
                let unread = match facts {
                    Some(facts) => facts.unread(&error),
                    // No connection captured (the failure came before hyper handed it over): a certificate
                    // alert still proves the handshake, and with it the request, was refused.
                    None => Facts::refused_handshake(&error),
                };
                Sent::Failed { error, unread }
            }
            Err(_) => Sent::TimedOut,
        }
    }
}

/// A request body that marks its request's start on the upstream connection hyper chose for it
/// ([`Facts::begin_request`]), before any byte of the request is written: hyper's HTTP/1 dispatcher asks a
/// request's body whether it is empty (`is_end_stream`) right before it buffers the request's head, and writes
/// nothing of it before that; the connection is known by then (hyper-util's capture is set when the
/// connection is checked out, before the request is handed to it). The first poll marks too, in case.
struct Marked {
    body: Body,
    capture: hyper_util::client::legacy::connect::CaptureConnection,
    marked: AtomicBool,
}

impl Marked {
    fn mark(&self) {
        if self.marked.load(Ordering::Relaxed) {
            return;
        }
        if let Some(facts) = self.capture.connection_metadata().as_ref().and_then(Facts::of) {
            facts.begin_request();
            self.marked.store(true, Ordering::Relaxed);
        }
    }
}

impl http_body::Body for Marked {
    type Data = Bytes;
    type Error = tower::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.mark();
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.mark();
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The body to send, and its bytes when it can be sent again: the layer's buffered body, or a pass-through body
/// of known length up to [`REPLAY_BUFFER`] bytes, read here. Longer or chunked bodies stream through once.
async fn replayable(parts: &http::request::Parts, body: Body) -> Result<(Body, Option<Bytes>), tower::BoxError> {
    if let Some(BufferedBody(bytes)) = parts.extensions.get::<BufferedBody>() {
        return Ok((body, Some(bytes.clone())));
    }
    match http_body::Body::size_hint(&body).exact() {
        Some(length) if length <= REPLAY_BUFFER => {
            let bytes = body.collect().await?.to_bytes();
            Ok((Body::from(bytes.clone()), Some(bytes)))
        }
        _ => Ok((body, None)),
    }
}

/// The `timeout` parameter of a `Keep-Alive` response field (RFC 2068 §19.7.1.1; Node, Apache and others send
/// it): how long the upstream keeps an idle connection open, in whole seconds.
fn keep_alive_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("keep-alive")?.to_str().ok()?;
    value.split(',').find_map(|param| {
        let (name, seconds) = param.split_once('=')?;
        name.trim().eq_ignore_ascii_case("timeout").then(|| seconds.trim().parse().ok().map(Duration::from_secs))?
    })
}

/// 502 for a request the upstream did not execute: the layer releases the key ([`UpstreamFailure::NotSent`]).
fn not_sent(detail: &str) -> Response<Body> {
    let mut response =
        Problem::new(StatusCode::BAD_GATEWAY, ProblemType::UpstreamUnreachable, detail).into_response().map(Body::new);
    response.extensions_mut().insert(UpstreamFailure::NotSent);
    response
}

/// 502 or 504 for a request that may have taken effect: the layer stores it as unknown.
fn unknown(status: StatusCode, detail: String, reason: String) -> Response<Body> {
    let mut response = Problem::new(status, ProblemType::OutcomeUnknown, detail).into_response().map(Body::new);
    response.extensions_mut().insert(UpstreamFailure::OutcomeUnknown { reason });
    response
}

/// The service of the proxy listener: every path and method forwarded to `upstream`, methods the layer covers
/// (POST and PATCH by default) under Idempotency-Key handling; served by [`Server::proxy`](crate::Server::proxy).
pub fn proxy<St: Store>(layer: IdempotencyLayer<St>, upstream: Upstream) -> Proxy<St> {
    metrics::describe_histogram!("idem_upstream_seconds", "Time until the upstream's response headers, in seconds.");
    metrics::describe_counter!(
        "idem_upstream_errors_total",
        "Upstream calls that failed, by kind (connect, unread: provably never read, failed: outcome unknown, \
         timeout)."
    );
    for kind in ["connect", "unread", "failed", "timeout"] {
        metrics::counter!("idem_upstream_errors_total", "kind" => kind).increment(0);
    }
    metrics::describe_counter!(
        "idem_upstream_retries_total",
        "Requests sent again on a new connection because the upstream provably never read them, by reason."
    );
    metrics::counter!("idem_upstream_retries_total", "reason" => "not_written").increment(0);
    // A body refused by the layer's limit is drained before the 413 goes out (see `DrainLayer`).
    let drain = DrainLayer::new(layer.request_body_limit() as u64);
    Proxy { stack: drain.layer(crate::metrics::ProxyMetricsLayer.layer(layer.layer(upstream))) }
}

/// The proxy's tower service ([`proxy`]): the drain, metrics and idempotency layers around an [`Upstream`],
/// without a router: there is one route, and axum's router boxed and matched every request for nothing.
/// Always ready; never fails (every failure is an answer).
pub struct Proxy<St> {
    stack: Drain<ProxyMetrics<Idempotency<Upstream, St>>>,
}

impl<St> Clone for Proxy<St> {
    fn clone(&self) -> Self {
        Self { stack: self.stack.clone() }
    }
}

impl<St> std::fmt::Debug for Proxy<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").finish_non_exhaustive()
    }
}

impl<St: Store, B> tower::Service<Request<B>> for Proxy<St>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tower::BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = DrainFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower::Service::<Request<B>>::poll_ready(&mut self.stack, cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.stack.call(request)
    }
}
