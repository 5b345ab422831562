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
