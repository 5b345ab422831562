//! `Server::run` and its named `Shutdown`: a request in flight when the shutdown begins is finished, not cut;
//! one that outlasts the grace is closed and the run says so; nothing is accepted after the shutdown began.

use std::time::Duration;

use idem_server::{Ending, Server, ServerConfig, Shutdown};
use idem_store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Starts a KV server on a free port with `grace`; returns its address, its shutdown and the run's task.
async fn start(grace: Duration) -> (std::net::SocketAddr, Shutdown, tokio::task::JoinHandle<std::io::Result<Ending>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = Shutdown::new();
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
    shutdown.begin();
    assert!(shutdown.is_begun());
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
    shutdown.begin();
    let ending = tokio::time::timeout(Duration::from_secs(5), run).await.expect("the grace bounds the run");
    assert_eq!(ending.unwrap().unwrap(), Ending::GraceExpired);
}
