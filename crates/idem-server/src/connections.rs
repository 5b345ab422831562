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

/// How long a response write may wait for a slow client to read before the connection is ended: 60 seconds,
/// nginx's `send_timeout` (counted between two writes that moved bytes, as nginx counts it, so a client that
/// reads slowly but steadily is never cut).
pub const DEFAULT_CLIENT_SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Header fields a request may carry, at most, over HTTP/1.1 (hyper's own default is 100; nginx counts none,
/// only bytes, so a request with a hundred or so fields that nginx accepts must pass here too). More: 431.
pub const MAX_HEADER_FIELDS: usize = 512;

/// Bytes of header fields a request may carry, at most: 32 KiB, nginx's `large_client_header_buffers 4 8k`
/// (a field line over 8 KiB, or the whole head over 32 KiB, is refused there). Counted as HTTP/2 counts a
/// header list (RFC 9113 §6.5.2: name + value + 32 per field), over both protocols. More: 431.
pub const MAX_HEADER_LIST_BYTES: usize = 32 * 1024;

/// A client connection's timeouts: `idle` (nginx's `keepalive_timeout` and `client_body_timeout`,
/// [`DEFAULT_CLIENT_IDLE_TIMEOUT`]) and `send` (nginx's `send_timeout`, [`DEFAULT_CLIENT_SEND_TIMEOUT`]). A
/// bare `Duration` converts to the idle timeout with the default send timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientTimeouts {
    /// No request running and nothing written for this long: the connection is closed.
    pub idle: Duration,
    /// A response write waiting this long for the client to read: the connection is ended, logged (warn) and
    /// counted in `idem_client_send_timeouts_total`.
    pub send: Duration,
}

impl From<Duration> for ClientTimeouts {
    fn from(idle: Duration) -> Self {
        Self { idle, send: DEFAULT_CLIENT_SEND_TIMEOUT }
    }
}

/// Serves `router` on every connection `listener` accepts until `shutdown` resolves; then stops accepting and
/// waits for the open connections to finish their requests. A connection with no request running and nothing
/// written for `timeouts.idle` is shut down, and dropped if still open [`CLOSING_GRACE`] later; one whose
/// response write waits `timeouts.send` for the client is ended.
pub(crate) async fn serve_connections<L, S: HttpService>(
    mut listener: L,
    service: S,
    tls: bool,
    timeouts: ClientTimeouts,
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
        tokio::spawn(serve_one(io, peer, service.clone(), tls, timeouts, stop_rx.clone()));
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
    timeouts: ClientTimeouts,
    mut stop: tokio::sync::watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let idle_timeout = timeouts.idle;
    let activity = Arc::new(Activity::new());
    let service = Tracked { service, peer, tls, idle_timeout, activity: Arc::clone(&activity) };
    // No hyper header timeout: hyper starts it when a response body has been handed to its write buffer, not
    // when the buffer has reached a slow reader, so a long download left less idle time than promised. The
    // watch below covers a half-sent header instead (no request running, nothing written: dropped).
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // nginx's header limits: more fields than hyper's 100, the byte bound below.
    builder.http1().max_headers(MAX_HEADER_FIELDS);
    builder.http2().max_header_list_size(u32::try_from(MAX_HEADER_LIST_BYTES).unwrap_or(u32::MAX));
    let io = Watched {
        inner: io,
        activity: Arc::clone(&activity),
        send_timeout: timeouts.send,
        stalled: None,
        cut: false,
        peer,
    };
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
    /// nginx's `send_timeout`: how long one write may wait for the client.
    send_timeout: Duration,
    /// Set while a write is waiting for the client: when the wait began to exceed `send_timeout`.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// The send timeout ended this connection: every later write fails at once (logged and counted once).
    cut: bool,
    peer: SocketAddr,
}

impl<I> Watched<I> {
    /// Notes what a write (or flush) did: bytes moved are activity and end a stall; a write still waiting for
    /// the client starts (or goes on with) the send timeout, and past it the connection is ended with an error,
    /// logged and counted.
    fn noted<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<T>>,
        moved: impl FnOnce(&T) -> bool,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        if self.cut {
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "ended by the send timeout")));
        }
        match &polled {
            Poll::Ready(Ok(v)) => {
                if moved(v) {
                    self.activity.touch();
                }
                self.stalled = None;
                self.activity.writing.store(false, Ordering::Relaxed);
            }
            Poll::Ready(Err(_)) => {
                self.stalled = None;
                self.activity.writing.store(false, Ordering::Relaxed);
            }
            Poll::Pending => {
                // A response on its way to a slow reader is not an idle connection: only the send timeout ends it.
                self.activity.writing.store(true, Ordering::Relaxed);
                let timeout = self.send_timeout;
                let stall = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if stall.as_mut().poll(cx).is_ready() {
                    self.stalled = None;
                    self.cut = true;
                    self.activity.writing.store(false, Ordering::Relaxed);
                    metrics::counter!("idem_client_send_timeouts_total").increment(1);
                    tracing::warn!(
                        peer = %self.peer,
                        timeout = ?timeout,
                        "closing a client connection: a response write waited longer than the send timeout \
                         (--client-send-timeout) for the client to read"
                    );
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client read nothing for the send timeout",
                    )));
                }
            }
        }
        polled
    }
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
        self.noted(cx, polled, |n| *n > 0)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.noted(cx, polled, |n| *n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.noted(cx, polled, |_| false)
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
    /// A write is waiting for the client to read (the send timeout, not the idle timeout, governs it).
    writing: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            writing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// When to look again: `timeout` after the last activity (or after now, while a request runs).
    fn idle_deadline(&self, timeout: Duration) -> Instant {
        if self.in_flight.load(Ordering::Relaxed) > 0 || self.writing.load(Ordering::Relaxed) {
            return Instant::now() + timeout;
        }
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + timeout
    }

    fn idle_for(&self, timeout: Duration) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0
            && !self.writing.load(Ordering::Relaxed)
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
    /// The service's body, or `None` for an answer of the connection loop's own (`own`).
    inner: Option<B>,
    own: Option<bytes::Bytes>,
    no_content: bool,
    _in_flight: InFlight,
}

impl<B: http_body::Body + Unpin> http_body::Body for Guarded<B>
where
    B::Data: From<bytes::Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.no_content {
            return std::task::Poll::Ready(None);
        }
        if let Some(own) = self.own.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(own.into()))));
        }
        match self.inner.as_mut() {
            Some(inner) => std::pin::Pin::new(inner).poll_frame(cx),
            None => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.no_content || (self.own.is_none() && self.inner.as_ref().is_none_or(http_body::Body::is_end_stream))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match (&self.own, &self.inner) {
            (Some(own), _) => http_body::SizeHint::with_exact(own.len() as u64),
            (None, Some(inner)) => inner.size_hint(),
            (None, None) => http_body::SizeHint::with_exact(0),
        }
    }
}

/// The request body an [`HttpService`] receives: hyper's, ended if it stalls for the idle timeout between two
/// frames (nginx's `client_body_timeout`).
pub type RequestBody = TimeoutBody<Incoming>;

/// What [`serve`](crate::serve) and [`serve_tls`](crate::serve_tls) run on every connection: an axum `Router`
/// (the KV API) or the reverse [`Proxy`](crate::Proxy), which runs without a router (one route; the router's
/// boxing and matching were a measurable share of a forwarded request). Any clonable tower
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
        if let Some(refusal) = over_header_limits(request.headers()) {
            let (parts, own) = refusal.into_parts();
            let guarded = Guarded { inner: None, own: Some(own), no_content, _in_flight: in_flight };
            return Box::pin(std::future::ready(Ok(http::Response::from_parts(parts, guarded))));
        }
        let handled = self.service.clone().oneshot(request);
        Box::pin(async move {
            let response = handled.await;
            // The guard rides in the response body: hyper drops the body after its last frame, or when the
            // connection goes; a long download is a request running, not an idle connection.
            Ok(response?.map(|inner| Guarded { inner: Some(inner), own: None, no_content, _in_flight: in_flight }))
        })
    }
}

/// 431 problem+json when the request's header fields are over nginx's byte limits
/// ([`MAX_HEADER_LIST_BYTES`] in all, counted as RFC 9113 §6.5.2 counts a header list; 8 KiB for one field
/// line, nginx's buffer size). hyper enforces the field count ([`MAX_HEADER_FIELDS`]) and HTTP/2's list size
/// itself, with a bare 431.
fn over_header_limits(headers: &http::HeaderMap) -> Option<http::Response<bytes::Bytes>> {
    const FIELD_LINE: usize = 8 * 1024;
    let mut total = 0usize;
    let mut longest = 0usize;
    for (name, value) in headers {
        let line = name.as_str().len() + value.len();
        longest = longest.max(line);
        total += line + 32;
    }
    let detail = if longest + 2 > FIELD_LINE {
        format!("a header field line is {} bytes; at most {FIELD_LINE} are accepted", longest + 2)
    } else if total > MAX_HEADER_LIST_BYTES {
        format!("the header fields take {total} bytes (RFC 9113 §6.5.2); at most {MAX_HEADER_LIST_BYTES} are accepted")
    } else {
        return None;
    };
    let kind = idem_core::ProblemType::HeaderFieldsTooLarge;
    Some(idem_tower::Problem::new(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, kind, detail).into_response())
}
