//! Upstream connections that remember what they saw, so that the proxy can tell a request the upstream
//! provably never read from one whose outcome is unknown (docs/DESIGN.md, "Upstream connections").
//!
//! An HTTP/1.1 server may close an idle keep-alive connection at any moment (RFC 9112 §9.6), and a request
//! written just as it does is lost with it. RFC 9110 §9.2.2 lets a client retry a non-idempotent request only
//! when it can "detect that the original request was never applied". Each connection here is wrapped in
//! [`Observed`], which records per request whether it refused to write the request at all (the upstream had
//! already closed, sent bytes no request asked for, or outlived the keep-alive it announced): nothing was sent.
//!
//! That is the only proof. Any failure after the first byte is written is an unknown outcome: even the
//! upstream's FIN before any answer byte followed by a reset shows only that part of the request was left
//! unread, and an upstream that acted on the head and closed with the body unread sends exactly that.

use std::io;
use std::mem::MaybeUninit;
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
///
/// It holds no descriptor of the socket: hyper-util keeps these facts (in the response's connection
/// metadata) after the connection itself is gone, and a descriptor kept here would keep a socket the upstream
/// closed open in `CLOSE_WAIT` for as long.
#[derive(Debug, Default)]
pub(crate) struct Facts {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Requests begun on this connection: a write that follows a read of response bytes starts one.
    requests: u64,
    /// A request is being written or answered (the last operation with data was a write).
    in_request: bool,
    /// When the last response byte arrived: the connection's idle age before the next request.
    last_read: Option<Instant>,
    /// The keep-alive timeout the upstream announced (`Keep-Alive: timeout=N`, RFC 2068 §19.7.1.1).
    keep_alive: Option<Duration>,
    /// This wrapper refused to write the current request.
    refused: Option<&'static str>,
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
    /// byte. Nothing seen after writing is proof: an upstream that acted on the head and closed with the body
    /// unread (Python's socketserver after a handler raises) sends a FIN and then a reset, just like one that
    /// never read the request (docs/DESIGN.md, "Upstream connections").
    pub(crate) fn unread(&self) -> Option<Unread> {
        self.lock().refused.map(Unread::NotWritten)
    }
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
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        // A system call, not tokio's cached readiness, which lags a FIN that has just arrived. The socket is
        // non-blocking (tokio's): an open, quiet connection answers `WouldBlock` at once.
        match socket2::SockRef::from(&self.io).peek(&mut probe) {
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
            state.refused = if state.requests > 1 { self.refuse_reuse(&state) } else { None };
        }
        match state.refused {
            Some(why) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)),
            None => Ok(()),
        }
    }
}

impl AsyncRead for Observed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if let Poll::Ready(Ok(())) = &polled
            && read > 0
        {
            let mut state = self.facts.lock();
            state.in_request = false;
            state.last_read = Some(Instant::now());
        }
        polled
    }
}

impl AsyncWrite for Observed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.before_write()?;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.before_write()?;
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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
            Ok(TokioIo::new(Observed { io, facts: Arc::default() }))
        })
    }
}
