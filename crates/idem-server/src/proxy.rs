//! The reverse proxy of `idem serve --upstream`: every request goes to one upstream over pooled HTTP/1.1
//! connections; POST and PATCH pass through an [`IdempotencyLayer`] first.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_store::Store;
use idem_tower::{DrainLayer, IdempotencyLayer, UpstreamFailure};
use tower::Layer;

use axum::response::IntoResponse;

use crate::Problem;

/// Why an upstream URL was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// Not an absolute `http://HOST[:PORT][/PREFIX]` URL (user information, query and fragment refused).
    #[error("upstream URL {url:?} is not usable: {reason} (expected http://HOST:PORT[/PREFIX])")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
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
    client: Client<HttpConnector, Body>,
    scheme: Scheme,
    authority: Authority,
    prefix: String,
    host: HeaderValue,
    timeout: Duration,
}

impl Upstream {
    /// An upstream at `url` (`http://HOST:PORT`, optionally with a path prefix every request path is appended
    /// to), waiting at most `timeout` for a response to start.
    ///
    /// # Errors
    /// [`UpstreamError::InvalidUrl`] when `url` is not an absolute `http://` URL (https upstreams would need a
    /// TLS client; put idem next to the service instead) or carries a query.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, UpstreamError> {
        // Never repeat a password in an error message.
        let shown = match url.split_once('@') {
            Some((head, tail)) => match head.split_once("://") {
                Some((scheme, _)) => format!("{scheme}://***@{tail}"),
                None => format!("***@{tail}"),
            },
            None => url.to_owned(),
        };
        let invalid = |reason: &str| UpstreamError::InvalidUrl { url: shown.clone(), reason: reason.to_owned() };
        let uri: Uri = url.parse().map_err(|e: http::uri::InvalidUri| invalid(&e.to_string()))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(invalid("the scheme must be http"));
        }
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
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // Connecting must fail (as "not sent") before the response timeout would call the outcome unknown.
        connector.set_connect_timeout(Some((timeout / 2).min(Duration::from_secs(5))));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(256)
            .build(connector);
        Ok(Self { client, scheme: Scheme::HTTP, authority, prefix, host, timeout })
    }

    fn target(&self, original: &Uri) -> Result<Uri, http::Error> {
        let path_and_query = original.path_and_query().map_or("/", PathAndQuery::as_str);
        let path_and_query: PathAndQuery = format!("{}{}", self.prefix, path_and_query).parse()?;
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }
}

// Hop-by-hop fields (RFC 9110 §7.6.1) belong to one connection and are not forwarded.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
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

/// The RFC 7239 `Forwarded` element for this hop: `for` the client, `proto`, and `host` the client asked for.
fn forwarded(client: Option<SocketAddr>, host: Option<&HeaderValue>) -> Option<HeaderValue> {
    let mut element = match client {
        // IPv6 addresses and ports must be quoted (RFC 7239 §6).
        Some(addr) => format!("for=\"{addr}\""),
        None => "for=unknown".to_owned(),
    };
    element.push_str(";proto=http");
    if let Some(host) = host.and_then(|h| h.to_str().ok())
        && host.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
    {
        element.push_str(&format!(";host=\"{host}\""));
    }
    HeaderValue::from_str(&element).ok()
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

impl Upstream {
    async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let client = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let original_host = parts.headers.get(header::HOST).cloned();
        let target = match self.target(&parts.uri) {
            Ok(target) => target,
            Err(e) => {
                return Problem::bad_request("invalid-target", "Invalid request target", e.to_string()).into_response();
            }
        };
        strip_hop_by_hop(&mut parts.headers);
        if let Some(value) = forwarded(client, original_host.as_ref()) {
            parts.headers.append(header::FORWARDED, value);
        }
        parts.headers.insert(header::HOST, self.host.clone());
        parts.uri = target;
        parts.version = http::Version::HTTP_11;
        let outgoing = Request::from_parts(parts, body);
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, self.client.request(outgoing)).await;
        metrics::histogram!("idem_upstream_seconds").record(started.elapsed().as_secs_f64());
        match result {
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // The client's connection has its own version; an HTTP/1.0 upstream must not downgrade it.
                parts.version = http::Version::HTTP_11;
                Response::from_parts(parts, Body::new(body))
            }
            Ok(Err(e)) if e.is_connect() => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "connect").increment(1);
                tracing::warn!(error = %crate::error_chain(&e), "upstream unreachable");
                let mut response = Problem::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unreachable",
                    "Upstream unreachable",
                    "the upstream service could not be reached; the request was not sent",
                )
                .into_response();
                response.extensions_mut().insert(UpstreamFailure::NotSent);
                response
            }
            Ok(Err(e)) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "failed").increment(1);
                let reason = crate::error_chain(&e);
                tracing::warn!(error = %reason, "upstream failed after the request was sent");
                let mut response = Problem::new(
                    StatusCode::BAD_GATEWAY,
                    "outcome-unknown",
                    "Outcome unknown",
                    "the request was sent upstream but the connection failed before a response; it may or may not \
                     have taken effect",
                )
                .into_response();
                response.extensions_mut().insert(UpstreamFailure::OutcomeUnknown { reason });
                response
            }
            Err(_) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "timeout").increment(1);
                let reason = format!("no response within {}", humantime::format_duration(self.timeout));
                let mut response = Problem::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "outcome-unknown",
                    "Outcome unknown",
                    format!("the upstream sent {reason}; the request may or may not have taken effect"),
                )
                .into_response();
                response.extensions_mut().insert(UpstreamFailure::OutcomeUnknown { reason });
                response
            }
        }
    }
}

/// The router of the proxy listener: every path and method forwarded to `upstream`, methods the layer covers
/// (POST and PATCH by default) under Idempotency-Key handling.
pub fn proxy<St: Store>(layer: IdempotencyLayer<St>, upstream: Upstream) -> Router {
    metrics::describe_histogram!("idem_upstream_seconds", "Time until the upstream's response headers, in seconds.");
    metrics::describe_counter!(
        "idem_upstream_errors_total",
        "Upstream calls that failed, by kind (connect, failed, timeout)."
    );
    for kind in ["connect", "failed", "timeout"] {
        metrics::counter!("idem_upstream_errors_total", "kind" => kind).increment(0);
    }
    // A body refused by the layer's limit is drained before the 413 goes out (see `DrainLayer`).
    let drain = DrainLayer::new(layer.request_body_limit() as u64);
    Router::new()
        .fallback_service(layer.layer(upstream))
        .layer(axum::middleware::from_fn(crate::metrics::track_proxy))
        .layer(drain)
}
