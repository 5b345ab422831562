use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Installs the process-wide Prometheus recorder once and returns its handle; later calls return the same one.
///
/// Latencies are histograms in seconds; batch sizes in writes per commit.
pub fn install_recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".into()),
                    // Up to a minute: upstream calls may take as long as --upstream-timeout (60 s by default).
                    &[
                        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0, 30.0, 60.0,
                    ],
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("idem_sqlite_batch_size".into()),
                        &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0],
                    )
                });
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                // Only an empty bucket list fails, and ours are constants.
                Err(_) => PrometheusBuilder::new().build_recorder(),
            };
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding application's); then ours only renders.
            let _ = metrics::set_global_recorder(recorder);
            // Histogram samples accumulate until drained; without a scrape they grew the proxy by about 20 bytes
            // a request. The exporter leaves the periodic drain to whoever builds only the recorder.
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new().name("idem-metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(5));
                    upkeep.run_upkeep();
                }
            });
            handle
        })
        .clone()
}

/// Counts requests by route template, method and status, and times them.
pub(crate) async fn track(req: Request, next: Next) -> Response {
    let route =
        req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned()).unwrap_or_else(|| "unmatched".into());
    record(route, req, next).await
}

/// Counts and times proxied requests under one route label, `proxy` (upstream paths are unbounded), as a
/// plain tower layer: axum's `from_fn` boxes the rest of the stack and its future for every request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ProxyMetricsLayer;

impl<S> tower::Layer<S> for ProxyMetricsLayer {
    type Service = ProxyMetrics<S>;

    fn layer(&self, inner: S) -> ProxyMetrics<S> {
        ProxyMetrics { inner }
    }
}

/// See [`ProxyMetricsLayer`].
#[derive(Clone, Debug)]
pub(crate) struct ProxyMetrics<S> {
    inner: S,
}

impl<S, B, ResBody> tower::Service<http::Request<B>> for ProxyMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<ResBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Timed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Timed<S::Future> {
        let method = method_label(request.method());
        Timed { inner: self.inner.call(request), method, started: Instant::now() }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`ProxyMetrics`]: counts and times the answer when it is ready.
    pub(crate) struct Timed<F> {
        #[pin]
        inner: F,
        method: &'static str,
        started: Instant,
    }
}

impl<F, ResBody, E> Future for Timed<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let output = std::task::ready!(this.inner.poll(cx));
        if let Ok(response) = &output {
            count_proxied(this.method, response.status(), *this.started);
        }
        Poll::Ready(output)
    }
}

/// The handles are looked up once per (method, status) and kept: a registry look-up builds the labelled key
/// and hashes it, which cost about 4,000 instructions of every proxied request.
fn count_proxied(method: &'static str, status: http::StatusCode, started: Instant) {
    static SECONDS: OnceLock<metrics::Histogram> = OnceLock::new();
    static COUNTS: OnceLock<Vec<OnceLock<metrics::Counter>>> = OnceLock::new();
    let counts = COUNTS.get_or_init(|| (0..METHODS.len() * STATUSES).map(|_| OnceLock::new()).collect());
    let slot = METHODS.iter().position(|m| *m == method).unwrap_or(0) * STATUSES + usize::from(status.as_u16() - 100);
    counts[slot]
        .get_or_init(|| {
            metrics::counter!("idem_http_requests_total", "route" => "proxy", "method" => method,
                "status" => status.as_u16().to_string())
        })
        .increment(1);
    SECONDS
        .get_or_init(|| metrics::histogram!("idem_http_request_seconds", "route" => "proxy"))
        .record(started.elapsed().as_secs_f64());
}

/// The method label values (see [`method_label`]).
const METHODS: [&str; 8] = ["GET", "PUT", "POST", "DELETE", "HEAD", "PATCH", "OPTIONS", "other"];
/// Status codes 100..=999, the range `http::StatusCode` allows.
const STATUSES: usize = 900;

/// Label values must stay few: a client can send any token as a method, and each new one would be a new time
/// series held in memory forever.
fn method_label(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET => "GET",
        http::Method::PUT => "PUT",
        http::Method::POST => "POST",
        http::Method::DELETE => "DELETE",
        http::Method::HEAD => "HEAD",
        http::Method::PATCH => "PATCH",
        http::Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

async fn record(route: String, req: Request, next: Next) -> Response {
    let method = method_label(req.method());
    let started = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16().to_string();
    metrics::counter!("idem_http_requests_total", "route" => route.clone(), "method" => method, "status" => status)
        .increment(1);
    metrics::histogram!("idem_http_request_seconds", "route" => route).record(started.elapsed().as_secs_f64());
    resp
}
