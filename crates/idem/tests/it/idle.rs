//! Client connections that stop talking are closed (`--client-idle-timeout`): between requests, part-way
//! through a request header, before a first byte, and after a TLS handshake; a request that runs longer than
//! the timeout is not cut. Without the timeout each of these connections stayed open for as long as the
//! client wanted, and a few thousand of them used up the server's file descriptors.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;

use crate::common::{self, Server, start_upstream};
use crate::tls::{Ca, s};

/// Reads until the server closes the connection (end of file or a reset); how long that took.
fn closed_after(name: &str, mut conn: TcpStream, limit: Duration) -> Duration {
    let start = Instant::now();
    conn.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return start.elapsed(),
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("{name}: connection still open after {limit:?}")
            }
            Err(_) => return start.elapsed(),
        }
    }
}

fn addr(url: &str) -> &str {
    url.trim_start_matches("http://").trim_start_matches("https://")
}

#[test]
fn silent_half_sent_and_idle_keep_alive_connections_are_closed_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let server = Server::start(&["--store", &store, "--client-idle-timeout", "1s"], &[]);
    let a = addr(&server.url);

    let silent = TcpStream::connect(a).unwrap();
    let mut half = TcpStream::connect(a).unwrap();
    half.write_all(b"PUT /kv/k HTTP/1.1\r\nHost: x\r\nContent-Le").unwrap();
    let mut kept = TcpStream::connect(a).unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = [0u8; 512];
    let n = kept.read(&mut answer).unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
    // The body that carries the request's in-flight count keeps the length known: Content-Length, not chunked.
    let head = String::from_utf8_lossy(&answer[..n]).to_ascii_lowercase();
    assert!(head.contains("content-length: 3") && !head.contains("chunked"), "{head}");

    for (name, conn) in [("silent", silent), ("half a header", half), ("idle keep-alive", kept)] {
        let took = closed_after(name, conn, Duration::from_secs(10));
        assert!(took < Duration::from_secs(4), "{name}: closed only after {took:?}");
    }
    // The server is still serving.
    let mut fresh = TcpStream::connect(a).unwrap();
    fresh.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    fresh.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[test]
fn a_connection_that_sends_nothing_after_its_tls_handshake_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let server = Server::start(
        &["--store", &store, "--tls-cert", s(&cert), "--tls-key", s(&key), "--client-idle-timeout", "1s"],
        &[],
    );

    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(&ca.pem).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut tls = rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap()).unwrap();
    let mut tcp = TcpStream::connect(addr(&server.url)).unwrap();
    while tls.is_handshaking() {
        tls.complete_io(&mut tcp).unwrap();
    }
    let start = Instant::now();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server's close_notify, then end of file: the session is over.
    let mut stream = rustls::Stream::new(&mut tls, &mut tcp);
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected {n} bytes"),
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(4), "closed only after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_running_longer_than_the_idle_timeout_is_answered() {
    let (upstream, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = common::proxy(&dir, &upstream, &["--client-idle-timeout", "1s"]);
    let client = common::client();
    // 2.5 s in the upstream: two and a half idle timeouts with the request in flight.
    let r = client.post(format!("{}/slow/2500", proxy.url)).header("idempotency-key", "slow-1").send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(counts.executions(), 1);
}

/// The idle timer must start when a response has been sent, not when the handler returned its headers: a
/// response whose body took 1.5 s to stream through the proxy (idle timeout 1 s) left the connection "idle"
/// for 0.5 s the moment it ended, and the next request, sent 0.3 s later, found it closed (no `connection:
/// close` was sent; found by a break-it review). With the default 75 s, a download longer than 15 s left less
/// keep-alive than nginx's 60 s: the keep-alive race the default was chosen to avoid. (A large stored value
/// does not show it: the kernel's socket buffers take the whole body at once, and the server is then idle.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_timeout_counts_from_the_end_of_the_response_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // An upstream whose body comes in three chunks 0.5 s apart.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/slow-body",
        axum::routing::get(|| async {
            let chunks = futures_util::stream::unfold(0u8, |n| async move {
                if n == 3 {
                    return None;
                }
                if n > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Some((Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"chunk\n")), n + 1))
            });
            axum::body::Body::from_stream(chunks)
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let dir = tempfile::tempdir().unwrap();
    let proxy = common::proxy(&dir, &upstream, &["--client-idle-timeout", "1s"]);
    let mut conn = tokio::net::TcpStream::connect(addr(&proxy.url)).await.unwrap();
    conn.write_all(b"GET /slow-body HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let start = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // Chunked: the body ends with the zero-length chunk.
    while !seen.ends_with(b"0\r\n\r\n") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed mid-response: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let took = start.elapsed();
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    assert!(took > Duration::from_millis(1000), "the body took only {took:?}; the test needs it slower");
    // Well inside the idle timeout after the response ended.
    tokio::time::sleep(Duration::from_millis(300)).await;
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await.unwrap().unwrap_or(0);
    assert!(
        buf[..n].starts_with(b"HTTP/1.1"),
        "second request 0.3 s after a {took:?} response (idle timeout 1 s): {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
}

/// An HTTP/2 connection between requests is shut down with GOAWAY and a PING; h2 closes it only when the PING
/// is answered. A client that never answers (a stalled or hostile peer) kept it open for ever, as axum::serve
/// did: 1000 such connections held 1000 descriptors for as long as the clients wanted.
#[test]
fn an_idle_http2_connection_that_ignores_the_goaway_ping_is_closed() {
    let server = Server::start(&["--store", "memory:", "--client-idle-timeout", "1s"], &[]);
    let mut conn = TcpStream::connect(addr(&server.url)).unwrap();
    // Preface and an empty SETTINGS frame; the server's SETTINGS is acknowledged, its PING never is.
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").unwrap();
    conn.write_all(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00").unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("idle HTTP/2 connection still open {:?} after it opened (idle timeout 1 s)", start.elapsed())
            }
            Err(_) => break,
        }
    }
    assert!(start.elapsed() < Duration::from_secs(4), "closed only after {:?}", start.elapsed());
}

/// SIGTERM with no request in flight, only a connection that sent part of a request header (or an HTTP/2
/// preface and nothing more): the server waited the whole 30 s grace period, then logged "requests still in
/// flight after the grace period". It should exit at once.
#[test]
fn sigterm_does_not_wait_for_a_half_sent_header() {
    let server = Server::start(&["--store", "memory:"], &[]);
    let mut half = TcpStream::connect(addr(&server.url)).unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHo").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let term = std::process::Command::new("kill").args(["-TERM", &server.pid().to_string()]).status().unwrap();
    assert!(term.success());
    let status = server.terminate_wait();
    assert!(status.success(), "{status:?}");
    assert!(start.elapsed() < Duration::from_secs(5), "exited only after {:?}", start.elapsed());
    drop(half);
}

/// A request body that stops arriving (`Content-Length: 10`, 2 bytes sent) is ended after the idle timeout
/// between two frames, as nginx's `client_body_timeout` does: the server answers and closes, instead of holding
/// the connection for as long as the client wants (found by a break-it review: still open after 100 s).
#[test]
fn a_request_body_that_stalls_is_ended_after_the_idle_timeout() {
    let server = Server::start(&["--store", "memory:", "--client-idle-timeout", "1s"], &[]);
    let mut conn = TcpStream::connect(addr(&server.url)).unwrap();
    conn.write_all(b"PUT /v1/kv/stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab").unwrap();
    let took = closed_after("stalled body", conn, Duration::from_secs(10));
    assert!(took < Duration::from_secs(4), "closed only after {took:?}");
    // Nothing was written.
    let (code, _, err) = common::idem(&["kv", "--url", &server.url, "get", "stalled"], &[]);
    assert_eq!(code, 3, "{err}");
}
