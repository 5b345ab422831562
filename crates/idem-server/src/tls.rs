//! HTTPS listeners (rustls on the ring provider), certificates swappable while serving, and the plaintext
//! listener's check for TLS clients.
//!
//! Handshakes run in a task per connection, not in the accept loop, so a client that connects and sends
//! nothing delays nobody else; a finished handshake hands its stream to the connection loop, which owns
//! graceful shutdown and the idle timeout exactly as for plain TCP.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

/// How long a client may take to complete its TLS handshake (from accept) before its connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first byte of a TLS record carrying a handshake message (RFC 8446 §5.1, `ContentType.handshake`).
const TLS_HANDSHAKE: u8 = 0x16;

/// The `rustls::ServerConfig` that new handshakes use, replaceable while serving (certificate rotation on
/// SIGHUP). A connection keeps the configuration it was accepted with, so a swap drops no open connection.
/// Cheap to clone; clones share the slot, so one swap serves the main and the admin listener alike.
#[derive(Clone, Debug)]
pub struct TlsConfigSlot {
    current: Arc<RwLock<Arc<rustls::ServerConfig>>>,
}

impl TlsConfigSlot {
    /// A slot holding `config`. Set its ALPN protocols (`h2`, `http/1.1`) before: the slot takes it as given.
    pub fn new(config: Arc<rustls::ServerConfig>) -> Self {
        Self { current: Arc::new(RwLock::new(config)) }
    }

    /// Makes `config` the one for every handshake from now on; handshakes already under way finish with the
    /// old one.
    pub fn replace(&self, config: Arc<rustls::ServerConfig>) {
        // A panic elsewhere while holding the lock cannot leave an `Arc` half-written: the value is still good.
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = config;
    }

    /// The configuration new handshakes use now.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Serves `service` over TLS on `listener` until `shutdown` resolves, then stops accepting and waits for
/// in-flight requests to finish, as [`serve`](crate::serve) does over plain TCP. Each connection's handshake
/// uses the configuration in `tls` at the moment it was accepted, within [`HANDSHAKE_TIMEOUT`]. A client that
/// speaks plain HTTP to this listener gets `400` `urn:idem:problem:tls-required` and the connection is closed;
/// failed handshakes are logged (info) with the client's address and the cause. After the handshake,
/// `timeouts` apply as for [`serve`](crate::serve).
///
/// # Errors
/// The listener's I/O errors.
pub async fn serve_tls(
    service: impl crate::HttpService,
    listener: TcpListener,
    tls: TlsConfigSlot,
    timeouts: impl Into<crate::ClientTimeouts>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let incoming = TlsIncoming::start(listener, tls)?;
    crate::connections::serve_connections(incoming, service, true, timeouts.into(), shutdown).await
}

/// Accepted and handshaken TLS connections, as an axum [`Listener`].
struct TlsIncoming {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl TlsIncoming {
    fn start(listener: TcpListener, tls: TlsConfigSlot) -> io::Result<Self> {
        let local = listener.local_addr()?;
        // Bounded: handshaken connections wait for the serve loop instead of piling up without limit.
        let (tx, ready) = tokio::sync::mpsc::channel(128);
        let accept_loop = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((tcp, peer)) => {
                        tokio::spawn(handshake(tcp, peer, local, tls.current(), tx.clone()));
                    }
                    Err(e) => accept_failed(e).await,
                }
            }
        });
        Ok(Self { ready, local, accept_loop })
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        // The connection loop drops the listener when shutdown begins: stop accepting then, as a dropped TcpListener would.
        self.accept_loop.abort();
    }
}

impl Listener for TlsIncoming {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop holds a sender until it is aborted, which happens only when this is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// What axum's own accept loop does: errors of one connection (it was reset before `accept` returned) are
/// skipped; others (out of file descriptors) are logged and retried after a pause instead of spinning.
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset) {
        return;
    }
    tracing::error!(error = %e, "accept failed; retrying in 1s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// How the first bytes of a connection to the TLS listener looked.
enum Opening {
    Tls(Box<TlsStream<TcpStream>>),
    /// The client closed before sending a byte (a health check of the port, a scanner).
    Closed,
    /// Plain HTTP (or anything else that is not a TLS record).
    NotTls(TcpStream),
    /// The handshake failed (a client certificate refused, no cipher suite in common); the alert saying why
    /// has been sent.
    Refused(io::Error, TcpStream),
}

async fn handshake(
    tcp: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    config: Arc<rustls::ServerConfig>,
    ready: tokio::sync::mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    // Responses leave in TLS records of their own; without this, Nagle's algorithm holds a small record back
    // until the client's delayed ACK (40 ms).
    let _ = tcp.set_nodelay(true);
    let opened = tokio::time::timeout(HANDSHAKE_TIMEOUT, async move {
        let mut first = [0u8; 1];
        if tcp.peek(&mut first).await? == 0 {
            return Ok(Opening::Closed);
        }
        if first[0] != TLS_HANDSHAKE {
            return Ok(Opening::NotTls(tcp));
        }
        match tokio_rustls::TlsAcceptor::from(config).accept(tcp).into_fallible().await {
            Ok(stream) => Ok::<_, io::Error>(Opening::Tls(Box::new(stream))),
            Err((e, tcp)) => Ok(Opening::Refused(e, tcp)),
        }
    })
    .await;
    match opened {
        Ok(Ok(Opening::Tls(stream))) => {
            // Sending fails only when the server is shutting down: the connection is then closed unserved.
            let _ = ready.send((*stream, peer)).await;
        }
        Ok(Ok(Opening::Closed)) => {}
        Ok(Ok(Opening::NotTls(tcp))) => {
            tracing::info!(%peer, %local, "plain HTTP on the TLS listener: answered 400 tls-required (use https://)");
            refuse_plaintext(tcp).await;
        }
        Ok(Ok(Opening::Refused(e, tcp))) => {
            tracing::info!(%peer, %local, reason = %refusal(&e), "TLS handshake failed");
            linger(tcp).await;
        }
        Ok(Err(e)) => tracing::info!(%peer, %local, error = %e, "TLS handshake failed"),
        Err(_) => tracing::info!(%peer, %local, timeout = ?HANDSHAKE_TIMEOUT, "TLS handshake timed out"),
    }
}

/// Why a client's handshake failed, in words, from this server's side: a client certificate refused (by
/// idem's rules, so said as a client would say it of a server), or the client refusing this server's.
fn refusal(e: &io::Error) -> String {
    use rustls::AlertDescription as A;
    match idem_tls::rustls_error_in(e) {
        Some(rustls::Error::AlertReceived(alert)) => {
            let why = match alert {
                A::UnknownCA => "it does not trust the CA that signed this server's certificate (--cacert FILE there)",
                A::BadCertificate | A::CertificateUnknown => "it found this server's certificate invalid",
                A::CertificateExpired => "this server's certificate has expired, by its clock",
                _ => "",
            };
            if why.is_empty() {
                format!("the client ended the handshake: {e}")
            } else {
                format!("the client refused this server's certificate: {why}")
            }
        }
        Some(rustls::Error::NoCertificatesPresented) => {
            "the client presented no certificate, which --tls-client-ca requires".to_owned()
        }
        Some(tls) => idem_tls::describe(
            tls,
            idem_tls::Hints {
                peer: "client",
                trust: "--tls-client-ca FILE",
                client_cert: "",
                plaintext: "it does not speak TLS",
            },
        ),
        None => e.to_string(),
    }
}

/// Closes a connection whose handshake failed so that the client reads the alert: in TLS 1.3 the client has
/// finished its side of the handshake and may have sent its request, and closing with those bytes unread makes
/// the kernel send a reset, which destroys the alert before the client reads it (the client then sees
/// "connection reset" instead of "certificate required"). The same for the 400 to a plaintext client. Bounded
/// in bytes (1 MiB) and time (2 s), like the lingering close of `DrainLayer`.
async fn linger(mut tcp: TcpStream) {
    let drained = async {
        tcp.shutdown().await?;
        let mut sink = [0u8; 8192];
        let mut left: usize = 1 << 20;
        while left > 0 {
            let n = tcp.read(&mut sink).await?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        Ok::<(), io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), drained).await;
}

/// The answer to a plaintext request on the TLS listener, as nginx answers one ("The plain HTTP request was
/// sent to HTTPS port"): a client that speaks HTTP learns what to change instead of seeing a reset or garbage.
async fn refuse_plaintext(mut tcp: TcpStream) {
    let (parts, body) = idem_tower::Problem::new(
        http::StatusCode::BAD_REQUEST,
        idem_core::ProblemType::TlsRequired,
        "this listener speaks HTTPS only: use https:// (with --cacert FILE for a private CA)",
    )
    .into_response::<String>()
    .into_parts();
    // Written by hand: no HTTP connection is served on this socket.
    let mut head = format!("HTTP/1.1 {}\r\n", parts.status);
    for (name, value) in &parts.headers {
        head.push_str(&format!("{name}: {}\r\n", value.to_str().unwrap_or_default()));
    }
    head.push_str(&format!("content-length: {}\r\nconnection: close\r\n\r\n", body.len()));
    let written = async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await
    };
    if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(2), written).await {
        // The client's request is unread: close so that the answer is not destroyed by a reset.
        linger(tcp).await;
    }
}

/// A plain TCP listener whose connections log a TLS `ClientHello`: a client that uses https:// for a plaintext
/// listener sees a TLS error, and the server's log says why.
pub(crate) struct PlainListener {
    inner: TcpListener,
    local: SocketAddr,
}

impl PlainListener {
    pub(crate) fn new(inner: TcpListener) -> io::Result<Self> {
        let local = inner.local_addr()?;
        Ok(Self { inner, local })
    }
}

impl Listener for PlainListener {
    type Io = SniffedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (tcp, peer) = Listener::accept(&mut self.inner).await;
        (SniffedStream { inner: tcp, peer, local: self.local, checked: false }, peer)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// A TCP stream that looks at the first bytes it reads, once, for a TLS handshake record.
pub(crate) struct SniffedStream {
    inner: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    checked: bool,
}

impl AsyncRead for SniffedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if !self.checked && buf.filled().len() > before {
            self.checked = true;
            // A TLS record: content type 22, then protocol version 3.x.
            if buf.filled()[before..].starts_with(&[TLS_HANDSHAKE, 0x03]) {
                tracing::warn!(
                    peer = %self.peer,
                    local = %self.local,
                    "TLS handshake on a plain-HTTP listener: the client must use http:// here, or serve with \
                     --tls-cert and --tls-key"
                );
            }
        }
        polled
    }
}

impl AsyncWrite for SniffedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
