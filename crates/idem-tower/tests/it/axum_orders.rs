//! The `axum_orders` example as a user runs it: its own process on a SQLite file, one key sent twice (one
//! execution, one replay), SIGTERM (a clean exit after the drain), and a restart that still replays the key
//! from the file.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The example's binary, built on demand ([`idem_testkit::example`]): `cargo test --test it` builds only the
/// test target.
fn example_binary() -> PathBuf {
    idem_testkit::example("idem-tower", "axum_orders")
}

/// A running example: its process and its standard output, line by line.
struct Orders {
    child: Child,
    lines: mpsc::Receiver<String>,
    addr: String,
}

impl Orders {
    fn start(binary: &Path, db: &Path) -> Self {
        let mut child = Command::new(binary)
            .arg(format!("sqlite:{}", db.display()))
            .arg("127.0.0.1:0")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = forward(child.stdout.take().unwrap());
        let first = lines.recv_timeout(Duration::from_secs(60)).expect("the example says where it listens");
        let addr =
            first.strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected line {first:?}")).to_owned();
        Orders { child, lines, addr }
    }

    /// Sends SIGTERM and waits for the exit; returns the exit status's success and the lines printed meanwhile.
    fn terminate(mut self) -> (bool, Vec<String>) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the example did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Everything it printed: the pipe ends with the process, so the lines end too.
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(10)) {
            lines.push(line);
        }
        (status.success(), lines)
    }
}

fn forward(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// One HTTP/1.1 POST on a connection of its own; the raw answer (head and body).
fn post_order(addr: &str, key: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        stream,
        "POST /orders HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: \"{key}\"\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

fn replayed(answer: &str) -> bool {
    answer.to_ascii_lowercase().contains("\r\nidempotent-replayed: true\r\n")
}

fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

#[test]
fn the_example_executes_a_key_once_replays_it_and_drains_on_sigterm() {
    let binary = example_binary();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("orders.db");

    let orders = Orders::start(&binary, &db);
    let first = post_order(&orders.addr, "order-1", r#"{"item":"book"}"#);
    let retry = post_order(&orders.addr, "order-1", r#"{"item":"book"}"#);
    assert!(first.starts_with("HTTP/1.1 201"), "{first}");
    assert!(!replayed(&first), "{first}");
    assert!(retry.starts_with("HTTP/1.1 201"), "{retry}");
    assert!(replayed(&retry), "the retry is a replay: {retry}");
    assert_eq!(body(&retry), body(&first), "byte for byte");
    assert!(body(&first).contains(r#""order":1"#), "{first}");
    let reused = post_order(&orders.addr, "order-1", r#"{"item":"lamp"}"#);
    assert!(reused.starts_with("HTTP/1.1 422"), "another body under the key: {reused}");

    let (clean, lines) = orders.terminate();
    assert!(clean, "exit status 0 after SIGTERM; printed {lines:?}");
    let executed: Vec<&String> = lines.iter().filter(|l| l.starts_with("executed order")).collect();
    assert_eq!(executed, ["executed order 1"], "one execution for two requests under one key: {lines:?}");
    assert_eq!(lines.last().map(String::as_str), Some("drained, exiting"), "{lines:?}");

    // The record is in the file: a retry after a restart is still a replay, and nothing executes.
    let orders = Orders::start(&binary, &db);
    let later = post_order(&orders.addr, "order-1", r#"{"item":"book"}"#);
    assert!(replayed(&later), "{later}");
    assert_eq!(body(&later), body(&first));
    let (clean, lines) = orders.terminate();
    assert!(clean, "{lines:?}");
    assert!(!lines.iter().any(|l| l.starts_with("executed order")), "nothing executed after the restart: {lines:?}");
}
