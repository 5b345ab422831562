//! What a client connection may do, as nginx users expect it (README, "Limits"): a client that stops reading a
//! large response is cut after `--client-send-timeout` (logged and counted), one that reads slowly but steadily
//! is not; a request with about a hundred header fields is accepted, and one over the byte limits gets 431.
//! Real sockets against a real `idem serve` process.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::common::{self, client, start_upstream};

/// 64 MiB: far more than the loopback socket buffers hold, so the proxy's writes wait for the reader.
const BIG: usize = 64 << 20;

fn addr(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// Sends a pass-through request for a `BIG`-byte response (no Idempotency-Key) on a raw connection.
fn ask_for_big(url: &str) -> TcpStream {
    let mut conn = TcpStream::connect(addr(url)).unwrap();
    let request = format!("POST /big/{BIG} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    conn.write_all(request.as_bytes()).unwrap();
    conn
}

/// Reads until the end of the connection (or `limit` passes); the bytes read.
fn read_to_end_within(conn: &mut TcpStream, limit: Duration) -> usize {
    conn.set_read_timeout(Some(limit)).unwrap();
    let mut total = 0;
    let mut buf = vec![0u8; 1 << 16];
    let started = Instant::now();
    while started.elapsed() < limit {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
    total
}

async fn send_timeouts(admin: &str) -> u64 {
    let text = client().get(format!("{admin}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find(|l| l.starts_with("idem_client_send_timeouts_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_is_cut_after_the_send_timeout_and_a_steady_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let (up, _) = start_upstream().await;
    // The idle timeout is far longer: only the send timeout may cut these connections.
    let server = common::proxy(&dir, &up, &["--client-send-timeout", "1s", "--client-idle-timeout", "60s"]);
    let url = server.url.clone();

    // A steady reader: 1 MiB every 100 ms for 4 s (40 of the 64 MiB). Slower readers would be cut too: the
    // kernel wakes a waiting writer only once a good part of the send buffer (megabytes on loopback) is free,
    // as it does for nginx's send_timeout; what matters is that each write that moves bytes starts the wait
    // over, so a reader that keeps up is never cut however long the download takes.
    let steady = {
        let url = url.clone();
        std::thread::spawn(move || {
            let mut conn = ask_for_big(&url);
            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = vec![0u8; 1 << 20];
            let started = Instant::now();
            let mut total = 0;
            while started.elapsed() < Duration::from_secs(4) {
                match conn.read_exact(&mut buf) {
                    Err(_) => return (total, false),
                    Ok(()) => total += buf.len(),
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (total, true)
        })
    };
    // A reader that stops: reads the head, then nothing for 4 s.
    let stopped = {
        let url = url.clone();
        std::thread::spawn(move || {
            let mut conn = ask_for_big(&url);
            let mut head = [0u8; 1024];
            let n = conn.read(&mut head).unwrap();
            assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head[..n]));
            std::thread::sleep(Duration::from_secs(4));
            // What the socket buffers held, then the end: the proxy gave up on this connection.
            read_to_end_within(&mut conn, Duration::from_secs(20))
        })
    };
    let (steady_read, steady_open) = tokio::task::spawn_blocking(move || steady.join().unwrap()).await.unwrap();
    assert!(steady_open, "the steady reader was cut after {steady_read} bytes");
    let stopped_read = tokio::task::spawn_blocking(move || stopped.join().unwrap()).await.unwrap();
    assert!(stopped_read < BIG, "the stopped reader got the whole response ({stopped_read} bytes)");
    server.wait_for_log("--client-send-timeout", 1, Duration::from_secs(5));
    assert_eq!(send_timeouts(&server.admin).await, 1, "one connection cut (the stopped reader's), counted once");
}

/// `n` extra fields of about 20 bytes each.
fn with_fields(request: reqwest::RequestBuilder, n: usize, value: &str) -> reqwest::RequestBuilder {
    (0..n).fold(request, |r, i| r.header(format!("x-extra-{i}"), value))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_header_fields_pass_and_requests_over_the_byte_limits_get_431() {
    let dir = tempfile::tempdir().unwrap();
    let (up, counts) = start_upstream().await;
    let server = common::proxy(&dir, &up, &[]);
    // 95 extra fields (with reqwest's own, over hyper's default of 100), as nginx accepts them.
    let ok = with_fields(client().post(format!("{}/orders", server.url)), 95, "v").send().await.unwrap();
    assert_eq!(ok.status(), 201);
    // Over the field count, or over 32 KiB in all, or one field line over 8 KiB: 431, nothing executed.
    let executed = counts.executions();
    for (n, value) in [(600, "v".to_owned()), (40, "v".repeat(1000)), (1, "v".repeat(9000))] {
        let refused = with_fields(client().post(format!("{}/orders", server.url)), n, &value).send().await.unwrap();
        assert_eq!(refused.status(), 431, "{n} fields of {} bytes", value.len());
    }
    let over = with_fields(client().post(format!("{}/orders", server.url)), 40, &"v".repeat(1000)).send().await;
    let body: serde_json::Value = over.unwrap().json().await.unwrap();
    assert_eq!(body["type"], "urn:idem:problem:header-fields-too-large");
    assert_eq!(counts.executions(), executed);
}

/// An upstream that answers every request with a chunked body and a declared trailer field.
fn trailing_upstream() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let asked = String::from_utf8_lossy(&head).to_ascii_lowercase().contains("te: trailers");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\
                     connection: close\r\n\r\n5\r\nhello\r\n0\r\n{}\r\n",
                    if asked { "x-checksum: abc\r\n" } else { "" }
                );
                let _ = stream.write_all(answer.as_bytes());
            });
        }
    });
    url
}

/// The response to `request` on a raw HTTP/1.1 connection, whole.
fn raw_exchange(url: &str, request: &str) -> String {
    let mut conn = TcpStream::connect(addr(url)).unwrap();
    conn.write_all(request.as_bytes()).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut text = Vec::new();
    let _ = conn.read_to_end(&mut text);
    String::from_utf8_lossy(&text).to_ascii_lowercase()
}

#[tokio::test(flavor = "multi_thread")]
async fn response_trailers_reach_a_client_that_accepts_them() {
    let dir = tempfile::tempdir().unwrap();
    let up = trailing_upstream();
    let server = common::proxy(&dir, &up, &[]);
    for key in ["", "idempotency-key: t1\r\n"] {
        let request = format!(
            "POST /x HTTP/1.1\r\nhost: x\r\nte: trailers\r\n{key}content-length: 0\r\nconnection: close\r\n\r\n"
        );
        let text = raw_exchange(&server.url, &request);
        assert!(text.starts_with("http/1.1 200"), "{text}");
        assert!(text.contains("hello"), "{text}");
        assert!(text.contains("\r\n0\r\nx-checksum: abc\r\n"), "{key:?}: the trailer was dropped: {text}");
    }
}
