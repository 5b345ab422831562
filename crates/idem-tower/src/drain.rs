//! [`DrainLayer`]: reads and discards what a service left unread of a request body before the answer goes out,
//! within bounds, so that a client that writes its whole body before reading sees the answer.
//!
//! Why: when a service answers without reading the body (a 413 over a limit, a 401, a 400) and hyper then
//! closes the connection with request bytes still unread, the kernel resets it (RFC 9293 §3.6.1, RFC 1122
//! §4.2.2.13). A client that is still writing (Python's `http.client` and everything built on it writes the
//! whole body before reading) gets `EPIPE`/`ECONNRESET` and never the answer. nginx avoids this with its
//! "lingering close" (`lingering_time` 30 s, `lingering_timeout` 5 s); this layer does the same before
//! answering, with the same time bounds and a byte bound.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, Version, header};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::{Layer, Service};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How far past the wrapped service's own body limit an unread body is still read to its end: 8 MiB.
///
/// Draining costs bandwidth and time, never memory (the bytes are discarded as they come), so the bound is
/// on how much more a refused request may make the server read than an accepted one; 8 MiB takes well under
/// a second on a LAN and covers the usual mistake, a body somewhat over the limit (the 17 MiB value sent to a
/// 16 MiB limit).
pub const DRAIN_SLACK_BYTES: u64 = 8 << 20;

/// The longest wait for the next piece of an unread body before giving up on it: 5 s (nginx's
/// `lingering_timeout`).
pub const DRAIN_IDLE: Duration = Duration::from_secs(5);

/// The longest time spent reading an unread body: 30 s (nginx's `lingering_time`).
pub const DRAIN_TIME: Duration = Duration::from_secs(30);

/// Wraps a service so that a request body it left unread is read and discarded before its answer is sent,
/// and the connection is kept; within bounds: at most `limit +` [`DRAIN_SLACK_BYTES`] bytes of body in all,
/// at most [`DRAIN_IDLE`] between two pieces and [`DRAIN_TIME`] in all. A body that cannot be read to its end
/// within them (its declared length is already past the byte bound, it runs past it, or it stalls) is left,
/// and the answer carries `Connection: close` (RFC 9112 §9.6); the client may then see a reset instead.
///
/// A request with `Expect: 100-continue` whose body the service never started to read is not drained: reading
/// would send the `100 Continue` that invites the very body being refused (RFC 9110 §10.1.1). It is answered
/// at once with `Connection: close`.
///
/// Only HTTP/1.x is drained: HTTP/2 ends one stream without closing the connection (RFC 9113 §8.1). A body
/// the service handed on (a proxy still streaming it upstream) is not the layer's to read and is left alone.
///
/// Put it outside the [`IdempotencyLayer`](crate::IdempotencyLayer), with that layer's
/// `max_request_body` as `limit`, so its 413 reaches such clients.
#[derive(Clone, Copy, Debug)]
pub struct DrainLayer {
    max_body_bytes: u64,
}

impl DrainLayer {
    /// Drains bodies of up to `limit` (the largest body the wrapped service accepts, in bytes) plus
    /// [`DRAIN_SLACK_BYTES`].
    pub fn new(limit: u64) -> Self {
        Self { max_body_bytes: limit.saturating_add(DRAIN_SLACK_BYTES) }
    }

    /// The byte bound: the most body bytes a request may have in all and still be drained.
    pub fn max_body_bytes(&self) -> u64 {
        self.max_body_bytes
    }
}

impl<S> Layer<S> for DrainLayer {
    type Service = Drain<S>;

    fn layer(&self, inner: S) -> Drain<S> {
        Drain { inner, max_body_bytes: self.max_body_bytes }
    }
}

/// The service [`DrainLayer`] produces around `S`.
#[derive(Clone, Debug)]
pub struct Drain<S> {
    inner: S,
    max_body_bytes: u64,
}

/// The future of [`Drain`]: the inner service's answer, after draining.
pub type DrainFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

impl<S, B, ResBody> Service<Request<B>> for Drain<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = DrainFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let http1 = request.version() <= Version::HTTP_11;
        let expects_continue = expects_continue(request.headers());
        let declared = declared_length(request.headers());
        let (back, mut returned) = oneshot::channel();
        let request = request.map(|body| Body::new(Watched::new(Body::new(body), back)));
        let answer = self.inner.call(request);
        let max = self.max_body_bytes;
        Box::pin(async move {
            let mut response = answer.await?;
            // Nothing comes back when the body was read to its end, or is still held by someone (a proxy
            // streaming it upstream); both are fine as they are.
            let Ok(unread) = returned.try_recv() else { return Ok(response) };
            if http1 && !drain(unread, expects_continue, declared, max).await {
                tracing::debug!(status = %response.status(), "request body left unread; closing the connection");
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response)
        })
    }
}

/// True when any `Expect` field line asks for `100-continue` (case-insensitive, RFC 9110 §10.1.1).
fn expects_continue(headers: &HeaderMap) -> bool {
    headers.get_all(header::EXPECT).iter().any(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// A body the service dropped before its end, with how much of it was read.
struct Unread {
    body: Body,
    read: u64,
    polled: bool,
}

/// Reads and discards the rest of `unread` within the bounds; true when it reached the body's end.
async fn drain(unread: Unread, expects_continue: bool, declared: Option<u64>, max: u64) -> bool {
    let Unread { mut body, mut read, polled } = unread;
    if expects_continue && !polled {
        return false;
    }
    // A length already known to run past the bound is not worth starting on: the client would be reset anyway.
    let remaining = [body.size_hint().upper(), declared.map(|d| d.saturating_sub(read))].into_iter().flatten().min();
    if remaining.is_some_and(|r| read.saturating_add(r) > max) {
        return false;
    }
    let deadline = Instant::now() + DRAIN_TIME;
    loop {
        let wait = (Instant::now() + DRAIN_IDLE).min(deadline);
        match tokio::time::timeout_at(wait, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    read = read.saturating_add(data.len() as u64);
                    if read > max {
                        return false;
                    }
                }
            }
            Ok(None) => return true,
            // A broken body or a stalled client: nothing more will come in time.
            Ok(Some(Err(_))) | Err(_) => return false,
        }
    }
}

/// The request body as the service sees it: counts what was read and, if dropped before its end, hands the
/// rest back to [`Drain`].
struct Watched {
    body: Option<Body>,
    read: u64,
    polled: bool,
    ended: bool,
    back: Option<oneshot::Sender<Unread>>,
}

impl Watched {
    fn new(body: Body, back: oneshot::Sender<Unread>) -> Self {
        Self { body: Some(body), read: 0, polled: false, ended: false, back: Some(back) }
    }
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else { return Poll::Ready(None) };
        this.polled = true;
        let polled = Pin::new(body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.read = this.read.saturating_add(data.len() as u64);
                }
            }
            // A body that failed is as far as it will ever get.
            Poll::Ready(None | Some(Err(_))) => this.ended = true,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.as_ref().is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body.as_ref().map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let (Some(body), Some(back)) = (self.body.take(), self.back.take())
            && !body.is_end_stream()
        {
            // The receiver is gone only when the answer future was dropped (client hung up): nothing to do.
            let _ = back.send(Unread { body, read: self.read, polled: self.polled });
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use http::StatusCode;
    use tokio::time::Sleep;
    use tower::ServiceExt;

    use super::*;

    const LIMIT: u64 = 1024;
    const CHUNK: usize = 64 * 1024;

    /// A body of `len` bytes (`None`: endless) in `CHUNK`-byte frames, one every `every`, that stalls forever
    /// after `stall_after` bytes if set; counts what was pulled from it.
    struct Paced {
        left: Option<u64>,
        every: Duration,
        stall_after: Option<u64>,
        exact: bool,
        sleep: Pin<Box<Sleep>>,
        pulled: Arc<AtomicU64>,
    }

    fn paced(len: Option<u64>, every: Duration) -> (Paced, Arc<AtomicU64>) {
        let pulled = Arc::new(AtomicU64::new(0));
        let body = Paced {
            left: len,
            every,
            stall_after: None,
            exact: len.is_some(),
            sleep: Box::pin(tokio::time::sleep(every)),
            pulled: pulled.clone(),
        };
        (body, pulled)
    }

    impl http_body::Body for Paced {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.left == Some(0) {
                return Poll::Ready(None);
            }
            let pulled = self.pulled.load(Ordering::SeqCst);
            if self.stall_after.is_some_and(|s| pulled >= s) {
                return Poll::Pending;
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let next = Instant::now() + self.every;
            self.sleep.as_mut().reset(next);
            let n = self.left.map_or(CHUNK as u64, |l| l.min(CHUNK as u64));
            if let Some(l) = self.left.as_mut() {
                *l -= n;
            }
            self.pulled.fetch_add(n, Ordering::SeqCst);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; n as usize])))))
        }

        fn size_hint(&self) -> SizeHint {
            match self.left {
                Some(l) if self.exact => SizeHint::with_exact(l),
                _ => SizeHint::default(),
            }
        }
    }

    /// The answer of a service that answers 413 after reading `reads` bytes of the body (0: without touching
    /// it), wrapped in the layer.
    async fn answer(reads: usize, request: Request<Paced>) -> Response<Body> {
        let refusing = tower::service_fn(move |request: Request<Body>| async move {
            if reads > 0 {
                let _ = http_body_util::Limited::new(request.into_body(), reads).collect().await;
            }
            Ok::<_, Infallible>(Response::builder().status(StatusCode::PAYLOAD_TOO_LARGE).body(Body::empty()).unwrap())
        });
        DrainLayer::new(LIMIT).layer(refusing).oneshot(request).await.unwrap()
    }

    fn put(body: Paced) -> Request<Paced> {
        Request::put("/k").body(body).unwrap()
    }

    fn closes(response: &Response<Body>) -> bool {
        response.headers().get(header::CONNECTION).is_some_and(|v| v == "close")
    }

    #[tokio::test]
    async fn an_unread_body_within_the_bound_is_read_to_its_end_and_the_connection_kept() {
        let max = LIMIT + DRAIN_SLACK_BYTES;
        for (reads, len) in [(0, 3 * CHUNK as u64), (0, max), (LIMIT as usize, max), (0, 1)] {
            let (body, pulled) = paced(Some(len), Duration::ZERO);
            let response = answer(reads, put(body)).await;
            assert_eq!(pulled.load(Ordering::SeqCst), len, "reads {reads}, len {len}");
            assert!(!closes(&response));
        }
    }

    #[tokio::test]
    async fn a_body_read_by_the_service_is_left_alone() {
        let service = DrainLayer::new(LIMIT).layer(tower::service_fn(|request: Request<Body>| async move {
            let _ = request.into_body().collect().await;
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }));
        let (body, pulled) = paced(Some(5000), Duration::ZERO);
        let response = service.oneshot(put(body)).await.unwrap();
        assert_eq!(pulled.load(Ordering::SeqCst), 5000);
        assert!(!closes(&response));
    }

    #[tokio::test]
    async fn a_length_known_to_pass_the_bound_is_not_read() {
        let max = LIMIT + DRAIN_SLACK_BYTES;
        // Known from the body (hyper's Content-Length) ...
        let (body, pulled) = paced(Some(max + 1), Duration::ZERO);
        let response = answer(0, put(body)).await;
        assert_eq!(pulled.load(Ordering::SeqCst), 0);
        assert!(closes(&response));
        // ... or only from the header.
        let (mut body, pulled) = paced(Some(max + 1), Duration::ZERO);
        body.exact = false;
        let mut request = put(body);
        request.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(max + 1));
        let response = answer(0, request).await;
        assert_eq!(pulled.load(Ordering::SeqCst), 0);
        assert!(closes(&response));
    }

    #[tokio::test]
    async fn an_endless_body_is_cut_off_right_after_the_bound() {
        let max = LIMIT + DRAIN_SLACK_BYTES;
        for reads in [0, LIMIT as usize] {
            let (body, pulled) = paced(None, Duration::ZERO);
            let response = answer(reads, put(body)).await;
            let pulled = pulled.load(Ordering::SeqCst);
            assert!(pulled > max && pulled <= max + CHUNK as u64, "pulled {pulled}, bound {max}");
            assert!(closes(&response));
        }
    }

    #[tokio::test]
    async fn expect_continue_is_never_invited_by_the_drain() {
        let (body, pulled) = paced(Some(3 * CHUNK as u64), Duration::ZERO);
        let mut request = put(body);
        request.headers_mut().insert(header::EXPECT, HeaderValue::from_static("100-Continue"));
        let response = answer(0, request).await;
        assert_eq!(pulled.load(Ordering::SeqCst), 0);
        assert!(closes(&response));
        // Once the service has started reading, the client was invited and is sending: drain as usual.
        let (body, pulled) = paced(Some(3 * CHUNK as u64), Duration::ZERO);
        let mut request = put(body);
        request.headers_mut().insert(header::EXPECT, HeaderValue::from_static("100-continue"));
        let response = answer(LIMIT as usize, request).await;
        assert_eq!(pulled.load(Ordering::SeqCst), 3 * CHUNK as u64);
        assert!(!closes(&response));
    }

    #[tokio::test]
    async fn http2_bodies_are_not_drained() {
        let (body, pulled) = paced(Some(3 * CHUNK as u64), Duration::ZERO);
        let mut request = put(body);
        *request.version_mut() = Version::HTTP_2;
        let response = answer(0, request).await;
        assert_eq!(pulled.load(Ordering::SeqCst), 0);
        assert!(!closes(&response), "HTTP/2 has no Connection header");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_given_up_after_the_idle_bound() {
        let (mut body, pulled) = paced(Some(10 * CHUNK as u64), Duration::ZERO);
        body.stall_after = Some(2 * CHUNK as u64);
        let started = Instant::now();
        let response = answer(0, put(body)).await;
        assert_eq!(started.elapsed(), DRAIN_IDLE);
        assert_eq!(pulled.load(Ordering::SeqCst), 2 * CHUNK as u64);
        assert!(closes(&response));
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_is_given_up_after_the_time_bound() {
        // One 64 KiB frame a second is never idle for DRAIN_IDLE, and 30 of them stay within the byte bound.
        let (body, pulled) = paced(None, Duration::from_secs(1));
        let started = Instant::now();
        let response = answer(0, put(body)).await;
        assert_eq!(started.elapsed(), DRAIN_TIME);
        // Frames come at 1 s, 2 s, ... 30 s; at 30 s the frame is taken first (a timeout polls its future before
        // its timer), and the deadline ends the wait for the 31st.
        assert_eq!(pulled.load(Ordering::SeqCst), 30 * CHUNK as u64);
        assert!(closes(&response));
    }
}
