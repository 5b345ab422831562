//! The connection loop shared by the plaintext and the TLS listener: hyper's HTTP/1.1 and HTTP/2 server on
//! each accepted stream, graceful shutdown, and the idle timeout axum's own `serve` lacks.
//!
//! Why not `axum::serve`: it gives hyper no timer, so a connection that never sends a request (a port scan
//! that stays open, a client that stalls half-way through its header, a TLS session that sends nothing after
//! its handshake) is held open forever; a few thousand of them exhaust the process's file descriptors.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tower_http::timeout::TimeoutBody;

/// The idle timeout of client connections that `idem serve` uses unless told otherwise: 75 seconds, nginx's
/// `keepalive_timeout`. It is longer than nginx's upstream `keepalive_timeout` (60 s), so an nginx in front
/// closes its idle connections first and never sends a request on a connection idem is closing (the
/// keep-alive race). Clients that keep idle connections longer (Go's `IdleConnTimeout` is 90 s) need a longer
/// timeout here or a shorter one of their own.
pub const DEFAULT_CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(75);

/// Serves `router` on every connection `listener` accepts until `shutdown` resolves; then stops accepting and
/// waits for the open connections to finish their requests. A connection with no request running and nothing
/// written for `idle_timeout` is shut down, and dropped if still open [`CLOSING_GRACE`] later.
pub(crate) async fn serve_connections<L, S: HttpService>(
    mut listener: L,
    service: S,
    tls: bool,
    idle_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
    L::Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Every connection task holds a receiver: when all are dropped, every connection has finished.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            conn = listener.accept() => conn,
            () = &mut shutdown => break,
        };
        tokio::spawn(serve_one(io, peer, service.clone(), tls, idle_timeout, stop_rx.clone()));
    }
    // Stop accepting (for the TLS listener this also ends its handshakes), then let open connections finish
    // what they are doing: HTTP/1.1 closes after the response in progress, HTTP/2 sends GOAWAY.
    drop(listener);
    drop(stop_rx);
    stop_tx.send_replace(());
    stop_tx.closed().await;
    Ok(())
}

async fn serve_one<I, S: HttpService>(
    io: I,
    peer: SocketAddr,
    service: S,
    tls: bool,
    idle_timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let service = Tracked { service, peer, tls, idle_timeout, activity: Arc::clone(&activity) };
    // No hyper header timeout: hyper starts it when a response body has been handed to its write buffer, not
    // when the buffer has reached a slow reader, so a long download left less idle time than promised. The
    // watch below covers a half-sent header instead (no request running, nothing written: dropped).
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let io = Watched { inner: io, activity: Arc::clone(&activity) };
    let mut conn = pin!(builder.serve_connection_with_upgrades(TokioIo::new(io), service));
    // Set once a graceful shutdown has begun (idle, or the server stopping): from then on the connection is
    // dropped as soon as it has had no request running for `CLOSING_GRACE`. A graceful shutdown alone waits
    // for the client: the rest of a half-sent header, or the acknowledgement of HTTP/2's GOAWAY ping, which a
    // stalled or hostile client never sends.
    let mut closing = false;
    loop {
        let wake = if closing { Instant::now() + CLOSING_GRACE } else { activity.idle_deadline(idle_timeout) };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            () = tokio::time::sleep_until(wake) => {
                if closing {
                    if activity.idle_for(CLOSING_GRACE) {
                        tracing::debug!(%peer, "dropping a closing connection with no request running");
                        return;
                    }
                } else if activity.idle_for(idle_timeout) {
                    tracing::debug!(%peer, timeout = ?idle_timeout, "closing an idle client connection");
                    // Graceful: HTTP/2 gets a GOAWAY, HTTP/1.1 between requests closes at once; one stalled
                    // part-way through a header waits for the rest, so the next wake drops it.
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// How long a connection that is shutting down may go on with no request running before it is dropped.
const CLOSING_GRACE: Duration = Duration::from_secs(1);

/// The connection's stream, noting in [`Activity`] every write that moved bytes: a response still being
/// written to a slow reader (hyper has taken the whole body into its buffer, so the body is done) is a
/// connection at work, not an idle one. Reads are not noted: bytes trickling in without making a request
/// (a slowloris header) must not keep a connection open; once they make one, the request counts.
struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// When a connection last moved bytes or had a request start or end, and how many requests are running on it
/// now (HTTP/2 runs several).
struct Activity {
    opened: Instant,
    /// Milliseconds from `opened` to the last time bytes moved or a request started or finished.
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Self {
        Self { opened: Instant::now(), last_ms: AtomicU64::new(0), in_flight: AtomicUsize::new(0) }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// When to look again: `timeout` after the last activity (or after now, while a request runs).
    fn idle_deadline(&self, timeout: Duration) -> Instant {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Instant::now() + timeout;
        }
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + timeout
    }

    fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0
            && self.opened.elapsed() >= Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + timeout
    }
}

/// Ends a request's share of [`Activity`] when its response has been sent to its last byte, or when it is
/// dropped unsent (a client that hangs up drops the handler's future or the response body).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::Relaxed);
        activity.touch();
        Self(Arc::clone(activity))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`InFlight`] until hyper drops it. Forwards the size hint and the
/// end of stream, so a body of known length still goes out with `Content-Length`, not chunked.
///
/// The answer to a HEAD request over HTTP/2 ends with its header block: hyper's HTTP/1 server leaves a HEAD
/// response's body out, its HTTP/2 server sent it as DATA, which RFC 9110 §9.3.2 forbids and clients treat as
/// a protocol error (a 502 problem answered by idem itself carries a body). The size hint stays, so the
/// Content-Length is the one a GET would have had.
pub(crate) struct Guarded<B> {
    inner: B,
    no_content: bool,
    _in_flight: InFlight,
}

impl<B: http_body::Body + Unpin> http_body::Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.no_content {
            return std::task::Poll::Ready(None);
        }
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.no_content || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The request body an [`HttpService`] receives: hyper's, ended if it stalls for the idle timeout between two
/// frames (nginx's `client_body_timeout`).
pub type RequestBody = TimeoutBody<Incoming>;

/// What [`serve`](crate::serve) and [`serve_tls`](crate::serve_tls) run on every connection: an axum `Router`
/// (the KV API) or the reverse [`Proxy`](crate::Proxy), which runs without a router (one route; the router's
/// boxing and matching were a measurable share of a forwarded request: BENCHMARKS.md). Any clonable tower
/// service that answers every request itself (never an error) qualifies; the trait is implemented for all of
/// them.
pub trait HttpService:
    Service<
        http::Request<RequestBody>,
        Response = http::Response<Self::ResponseBody>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static
{
    /// The body of its responses.
    type ResponseBody: http_body::Body<Data = bytes::Bytes, Error: Into<tower::BoxError>> + Send + Unpin + 'static;
}

impl<S, B> HttpService for S
where
    S: Service<http::Request<RequestBody>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<tower::BoxError>,
{
    type ResponseBody = B;
}

/// The service as hyper calls it: the client's address as axum's `ConnectInfo` (the proxy's `Forwarded`
/// header needs it), the request body ended if it stalls for the idle timeout between two frames (nginx's
/// `client_body_timeout`), and each request counted in the connection's [`Activity`] until its response body
/// has been sent.
#[derive(Clone)]
struct Tracked<S> {
    service: S,
    peer: SocketAddr,
    /// Whether the client connection is TLS: the proxy's `Forwarded` says `proto=https` then.
    tls: bool,
    idle_timeout: Duration,
    activity: Arc<Activity>,
}

/// A request extension: the client's connection is TLS (set by the TLS listener's connection loop).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ViaTls;

impl<S: HttpService> hyper::service::Service<http::Request<Incoming>> for Tracked<S> {
    type Response = http::Response<Guarded<S::ResponseBody>>;
    type Error = Infallible;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: http::Request<Incoming>) -> Self::Future {
        let mut request = request.map(|body| TimeoutBody::new(self.idle_timeout, body));
        request.extensions_mut().insert(ConnectInfo(self.peer));
        if self.tls {
            request.extensions_mut().insert(ViaTls);
        }
        let no_content = request.method() == http::Method::HEAD && request.version() == http::Version::HTTP_2;
        let in_flight = InFlight::begin(&self.activity);
        let handled = self.service.clone().oneshot(request);
        Box::pin(async move {
            let response = handled.await;
            // The guard rides in the response body: hyper drops the body after its last frame, or when the
            // connection goes; a long download is a request running, not an idle connection.
            Ok(response?.map(|inner| Guarded { inner, no_content, _in_flight: in_flight }))
        })
    }
}
