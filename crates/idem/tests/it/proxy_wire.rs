//! What the proxy puts on the wire beyond the idempotency contract: the RFC 7239 `Forwarded` element the
//! upstream receives, per listener (plain, TLS) and request form (HTTP/1.1 origin-form and absolute-form,
//! HTTP/2), and a HEAD answered over HTTP/2, which must end with its header block (RFC 9110 §9.3.2).
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::common::proxy;
use crate::tls::{Ca, s};

/// An upstream that answers every request `200 ok` on kept-alive connections and keeps each request head it
/// received (lower-cased). Requests carry no body (GET and HEAD only).
fn capturing_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&heads);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        seen.lock().unwrap().push(String::from_utf8_lossy(&head).to_ascii_lowercase());
                        if stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").is_err() {
                            return;
                        }
                    }
                    match stream.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    (url, heads)
}

/// The `forwarded` field line of the head the upstream received for `path`.
fn forwarded_for(heads: &Mutex<Vec<String>>, path: &str) -> String {
    let heads = heads.lock().unwrap();
    let head = heads.iter().find(|h| h.split(' ').nth(1) == Some(path)).unwrap_or_else(|| panic!("{heads:?}"));
    head.lines().find(|l| l.starts_with("forwarded:")).unwrap_or_else(|| panic!("{head}")).to_owned()
}

/// An HTTP/2 connection (prior knowledge) to `authority`.
async fn h2(authority: &str) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>> {
    let stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    send
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_names_the_client_protocol_and_the_authority_the_client_asked_for() {
    let (up, heads) = capturing_upstream();
    let dir = tempfile::tempdir().unwrap();
    let plain = proxy(&dir, &up, &[]);
    let authority = plain.url.trim_start_matches("http://").to_owned();

    // HTTP/1.1, origin-form: Host names the authority.
    let answer = crate::common::client().get(format!("{}/h1", plain.url)).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    let line = forwarded_for(&heads, "/h1");
    assert!(line.contains(";proto=http;host=\"127.0.0.1:"), "{line}");

    // HTTP/1.1, absolute-form: the target's authority, not Host (RFC 9112 §3.2.2).
    let mut raw = std::net::TcpStream::connect(&authority).unwrap();
    raw.write_all(b"GET http://shop.example/absolute HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    raw.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let line = forwarded_for(&heads, "/absolute");
    assert!(line.ends_with(";proto=http;host=\"shop.example\""), "{line}");

    // HTTP/2 has no Host field: the authority is the :authority pseudo-header.
    let mut send = h2(&authority).await;
    let request = http::Request::get(format!("http://{authority}/h2")).body(Empty::new()).unwrap();
    let answer = send.send_request(request).await.unwrap();
    assert_eq!(answer.status(), 200);
    let line = forwarded_for(&heads, "/h2");
    assert!(line.ends_with(&format!(";proto=http;host=\"{authority}\"")), "{line}");

    // A TLS listener: proto=https.
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["127.0.0.1"], false, false);
    let tls_dir = tempfile::tempdir().unwrap();
    let tls = proxy(&tls_dir, &up, &["--tls-cert", s(&cert), "--tls-key", s(&key)]);
    let client = idem_client::client_builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&std::fs::read(&ca.pem).unwrap()).unwrap()])
        .build()
        .unwrap();
    let answer = client.get(format!("{}/tls", tls.url)).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    let line = forwarded_for(&heads, "/tls");
    assert!(line.contains(";proto=https;host=\"127.0.0.1:"), "{line}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_head_answered_by_the_proxy_over_http2_carries_no_body() {
    // An upstream that cannot be reached: the proxy answers 502 with a problem document of its own.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &format!("http://{closed}"), &[]);
    let authority = server.url.trim_start_matches("http://").to_owned();

    let mut send = h2(&authority).await;
    let head = http::Request::head(format!("http://{authority}/orders")).body(Empty::new()).unwrap();
    let answer = send.send_request(head).await.unwrap();
    assert_eq!(answer.status(), 502);
    let body = answer.into_body().collect().await.unwrap().to_bytes();
    assert!(body.is_empty(), "a HEAD answer carried {} bytes of body: {body:?}", body.len());

    // The same request as GET still gets its problem document, on the same connection.
    let get = http::Request::get(format!("http://{authority}/orders")).body(Empty::new()).unwrap();
    let answer = send.send_request(get).await.unwrap();
    assert_eq!(answer.status(), 502);
    let body = answer.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("urn:idem:problem:upstream-unreachable"), "{body:?}");
}
