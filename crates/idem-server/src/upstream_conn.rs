//! Upstream connections that remember what they saw, so that the proxy can tell a request the upstream
//! provably never read from one whose outcome is unknown (docs/DESIGN.md, "Upstream connections").
//!
//! An HTTP/1.1 server may close an idle keep-alive connection at any moment (RFC 9112 §9.6), and a request
//! written just as it does is lost with it. RFC 9110 §9.2.2 lets a client retry a non-idempotent request only
//! when it can "detect that the original request was never applied". Each connection here is wrapped in
//! [`Observed`], which records per request the facts that decide it:
//! - whether this wrapper refused to write the request at all (the upstream had already closed, sent bytes no
//!   request asked for, or outlived the keep-alive it announced): nothing was sent;
//! - whether the upstream closed its side (FIN) before any byte of the answer and then reset the connection
//!   (RST). This is recorded for logs but is **not** proof: it shows only that part of the request was left
//!   unread, and an upstream that acted on the head and closed with the body unread sends exactly that.
//!
//! Only the first is proof; any failure after writing is an unknown outcome.

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection idle for longer than this is checked for a close or stray bytes before a request is
/// written to it (one non-blocking `recv(MSG_PEEK)`); busier connections skip the system call.
const PEEK_AFTER_IDLE: Duration = Duration::from_millis(50);

/// Why a request is known not to have been read by the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unread {
    /// Refused before a byte was written: the connection was closed, reset, carried unrequested bytes, or had
    /// been idle past the keep-alive the upstream announced.
    NotWritten(&'static str),
}

impl Unread {
    /// For logs, metrics labels and problem details.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Unread::NotWritten(why) => why,
        }
    }

    /// The `reason` label of `idem_upstream_retries_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Unread::NotWritten(_) => "not_written",
        }
    }
}

/// What one connection has seen, shared by its [`Observed`] I/O and the proxy (through hyper-util's
/// connection metadata, see [`Facts::of`]).
#[derive(Debug)]
pub(crate) struct Facts {
    state: Mutex<State>,
    /// A second descriptor for the same socket, to read a pending error after hyper has given the connection
    /// up (the late reset). Closing it is what finally closes the socket after hyper's descriptor.
    socket: Option<std::net::TcpStream>,
}

#[derive(Debug, Default)]
struct State {
    /// Requests begun on this connection: a write that follows a read of response bytes starts one.
    requests: u64,
    /// A request is being written or answered (the last operation with data was a write).
    in_request: bool,
    /// Response bytes read since the current request began.
    response_bytes: u64,
    /// When the last response byte arrived: the connection's idle age before the next request.
    last_read: Option<Instant>,
    /// The keep-alive timeout the upstream announced (`Keep-Alive: timeout=N`, RFC 2068 §19.7.1.1).
    keep_alive: Option<Duration>,
    /// This wrapper refused to write the current request.
    refused: Option<&'static str>,
    /// The upstream's FIN came before any byte of the answer to the current request.
    eof: bool,
    /// ... and a reset followed it.
    reset_after_eof: bool,
}

impl Facts {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the plain counters inconsistent in a way that matters
        // more than losing the connection's facts, so a poisoned lock is used as it is.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The facts of the connection a request was sent on, from hyper-util's connection metadata.
    pub(crate) fn of(connected: &Connected) -> Option<Arc<Facts>> {
        let mut extensions = http::Extensions::new();
        connected.get_extras(&mut extensions);
        extensions.remove::<Arc<Facts>>()
    }

    /// Records the keep-alive timeout the upstream announced in a response.
    pub(crate) fn announce_keep_alive(&self, timeout: Duration) {
        self.lock().keep_alive = Some(timeout);
    }

    /// Whether the current request on this connection was provably never sent: refused before its first
    /// byte. An upstream FIN before any answer byte followed by a reset is recorded but is *not* proof: an
    /// upstream that acted on the head and closed with the body unread (Python's socketserver after a handler
    /// raises) sends exactly that (docs/DESIGN.md, "Upstream connections").
    pub(crate) fn unread(&self) -> Option<Unread> {
        self.lock().refused.map(Unread::NotWritten)
    }
}

/// A reset as Linux reports it: `ECONNRESET`, or `EPIPE` when it arrives after the peer's FIN (`CLOSE_WAIT`).
fn is_reset(error: Option<&io::Error>) -> bool {
    error.is_some_and(|e| matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe))
}

/// A TCP connection that records [`Facts`] as hyper reads and writes it.
#[derive(Debug)]
pub(crate) struct Observed {
    io: TcpStream,
    facts: Arc<Facts>,
}

impl Observed {
    /// Decides, before the first byte of a new request on a reused connection, whether to refuse it.
    fn refuse_reuse(&self, state: &State) -> Option<&'static str> {
        let idle = state.last_read.map(|t| t.elapsed())?;
        if let Some(announced) = state.keep_alive {
            // The announced value is in whole seconds and counted by the upstream from a little earlier than
            // our `last_read`; keep a fifth of it (at least 100 ms) as margin.
            let margin = (announced / 5).max(Duration::from_millis(100));
            if idle + margin >= announced {
                return Some("the connection had been idle as long as the upstream's announced keep-alive");
            }
        }
        if idle < PEEK_AFTER_IDLE {
            return None;
        }
        let socket = self.facts.socket.as_ref()?;
        let mut probe = [0u8; 1];
        // The descriptor shares tokio's non-blocking file description: an open, quiet connection answers
        // `WouldBlock` at once.
        match socket.peek(&mut probe) {
            Ok(0) => Some("the upstream had closed the idle connection"),
            Ok(_) => Some("the upstream sent bytes on the idle connection that no request asked for"),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(_) => Some("the idle connection had been reset"),
        }
    }

    fn before_write(&self) -> io::Result<()> {
        let mut state = self.facts.lock();
        if !state.in_request {
            state.in_request = true;
            state.requests += 1;
            state.response_bytes = 0;
            state.eof = false;
            state.reset_after_eof = false;
            state.refused = if state.requests > 1 { self.refuse_reuse(&state) } else { None };
        }
        match state.refused {
            Some(why) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)),
            None => Ok(()),
        }
    }

    fn after_write_error(&self, error: &io::Error) {
        let mut state = self.facts.lock();
        if state.eof && state.response_bytes == 0 && is_reset(Some(error)) {
            state.reset_after_eof = true;
        }
    }
}

impl AsyncRead for Observed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        match &polled {
            Poll::Ready(Ok(())) if read > 0 => {
                let mut state = self.facts.lock();
                state.in_request = false;
                state.response_bytes += read as u64;
                state.last_read = Some(Instant::now());
            }
            Poll::Ready(Ok(())) => {
                let mut state = self.facts.lock();
                if state.in_request && state.response_bytes == 0 {
                    state.eof = true;
                    // On loopback the reset for our unread bytes has usually arrived with the FIN.
                    if is_reset(self.io.take_error().ok().flatten().as_ref()) {
                        state.reset_after_eof = true;
                    }
                }
            }
            Poll::Ready(Err(e)) => {
                let mut state = self.facts.lock();
                if state.eof && state.response_bytes == 0 && is_reset(Some(e)) {
                    state.reset_after_eof = true;
                }
            }
            Poll::Pending => {}
        }
        polled
    }
}

impl AsyncWrite for Observed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.before_write()?;
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Err(e)) = &polled {
            self.after_write_error(e);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.before_write()?;
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Err(e)) = &polled {
            self.after_write_error(e);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        {
            let state = self.facts.lock();
            if state.eof && state.response_bytes == 0 && !state.reset_after_eof {
                // Our FIN would reach an upstream that has shut down its side but not yet closed its socket,
                // and its close would then discard our unread request without the reset that proves it. The
                // socket closes when the last descriptor does, after the proxy has looked for that reset.
                return Poll::Ready(Ok(()));
            }
        }
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Connection for Observed {
    fn connected(&self) -> Connected {
        self.io.connected().extra(Arc::clone(&self.facts))
    }
}

/// hyper-util's [`HttpConnector`] with every connection wrapped in [`Observed`].
#[derive(Clone, Debug)]
pub(crate) struct ObservingConnector {
    inner: HttpConnector,
}

impl ObservingConnector {
    pub(crate) fn new(inner: HttpConnector) -> Self {
        Self { inner }
    }
}

impl tower::Service<Uri> for ObservingConnector {
    type Response = TokioIo<Observed>;
    type Error = <HttpConnector as tower::Service<Uri>>::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<TokioIo<Observed>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await?.into_inner();
            // Without the second descriptor the proxy only loses the late-reset check and the idle peek.
            let socket = io.as_fd().try_clone_to_owned().ok().map(std::net::TcpStream::from);
            let facts = Arc::new(Facts { state: Mutex::new(State::default()), socket });
            Ok(TokioIo::new(Observed { io, facts }))
        })
    }
}
