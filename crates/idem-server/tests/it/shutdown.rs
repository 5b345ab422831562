//! `Server::run` and its [`Stop`]: a request in flight when the stop begins (drains) is finished, not cut;
//! one that outlasts the grace is closed and the run says so, as is one still in flight at an abort; nothing
//! is accepted after the stop began.

use std::time::Duration;

use idem_server::{Ending, Server, ServerConfig, Stop};
use idem_store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Starts a KV server on a free port with `grace`; returns its address, its stop and the run's task.
async fn start(grace: Duration) -> (std::net::SocketAddr, Stop, tokio::task::JoinHandle<std::io::Result<Ending>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = Stop::new();
    let server = Server::kv(listener, MemoryStore::new(), ServerConfig::new()).shutdown_grace(grace);
    let run = tokio::spawn(server.run(shutdown.clone()));
    (addr, shutdown, run)
}

/// Sends a PUT whose body is announced as `len` bytes but only `sent` of them are written now.
async fn partial_put(addr: std::net::SocketAddr, len: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!("PUT /v1/kv/k HTTP/1.1\r\nhost: x\r\ncontent-length: {len}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b'x'; sent]).await.unwrap();
    stream
}

#[tokio::test]
async fn a_request_in_flight_is_finished_and_the_run_ends_drained() {
    let (addr, shutdown, run) = start(Duration::from_secs(10)).await;
    let mut stream = partial_put(addr, 10, 5).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    shutdown.drain();
    assert_eq!(shutdown.level(), idem_store::stop::DRAIN);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The rest of the body arrives after the shutdown began: the request is still served.
    stream.write_all(b"yyyyy").await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 201") || answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(run.await.unwrap().unwrap(), Ending::Drained);
    assert!(TcpStream::connect(addr).await.is_err(), "nothing accepted after the run ended");
}

#[tokio::test]
async fn a_request_that_outlasts_the_grace_is_closed_and_the_run_says_so() {
    let (addr, shutdown, run) = start(Duration::from_millis(300)).await;
    let _stalled = partial_put(addr, 10, 5).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    shutdown.drain();
    let ending = tokio::time::timeout(Duration::from_secs(5), run).await.expect("the grace bounds the run");
    assert_eq!(ending.unwrap().unwrap(), Ending::GraceExpired);
}

#[tokio::test]
async fn an_abort_during_the_grace_closes_what_is_in_flight_at_once() {
    let (addr, shutdown, run) = start(Duration::from_secs(3600)).await;
    let _stalled = partial_put(addr, 10, 5).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(shutdown.request(), idem_store::stop::DRAIN);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished(), "a stalled request holds a draining run within its grace");
    assert_eq!(shutdown.request(), idem_store::stop::ABORT);
    let ending = tokio::time::timeout(Duration::from_secs(5), run).await.expect("the abort ends the run");
    assert_eq!(ending.unwrap().unwrap(), Ending::Forced);
}
