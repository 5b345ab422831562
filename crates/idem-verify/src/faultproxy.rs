//! A TCP proxy in the harness between idem and what it talks to (its PostgreSQL or Redis store, its upstream),
//! through which the network faults are made: every open connection reset at once, new connections refused
//! for a while, or every chunk of bytes held back by a delay.
//!
//! A network namespace with veth and `tc` would fault the kernel's path too, but it needs privileges a CI
//! container may lack; the proxy needs none and produces the failures idem must survive: a connection that
//! breaks with a request written and no answer, a connection that cannot be made, and a slow link.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward at once.
    Pass,
    /// Hold every chunk back this long before forwarding it.
    Delay(Duration),
    /// Reset every new connection as soon as it is accepted.
    Refuse,
}

/// A running proxy to one target address; stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    /// The loopback port it listens on.
    pub port: u16,
    mode: watch::Sender<Mode>,
    /// Bumped to reset every open connection.
    epoch: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let (epoch, epoch_rx) = watch::channel(0u64);
        let task = tokio::spawn(accept_loop(listener, target, mode_rx, epoch_rx));
        Ok(Self { port, mode, epoch, task })
    }

    /// Sets what happens to traffic from now on (open connections included, for delays).
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Resets every open connection (both sides get an RST, as when a link or a middlebox fails).
    pub fn reset_all(&self) {
        self.epoch.send_modify(|e| *e += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset_all();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    mode: watch::Receiver<Mode>,
    epoch: watch::Receiver<u64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        if *mode.borrow() == Mode::Refuse {
            reset(client);
            continue;
        }
        let (mode, epoch) = (mode.clone(), epoch.clone());
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(target).await else {
                reset(client);
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            relay(client, server, mode, epoch).await;
        });
    }
}

/// Closes with an RST rather than a FIN: the peer sees the connection fail, not end.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
}

async fn relay(client: TcpStream, server: TcpStream, mode: watch::Receiver<Mode>, mut epoch: watch::Receiver<u64>) {
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, mode.clone());
    let down = pump(sr, cw, mode);
    let start = *epoch.borrow_and_update();
    tokio::select! {
        // Either direction ending ends both: a half-closed relay would hide the failure from the other side.
        () = async { tokio::join!(up, down); } => {}
        _ = epoch.wait_for(|e| *e != start) => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = match *mode.borrow() {
            Mode::Delay(d) => d,
            Mode::Pass | Mode::Refuse => Duration::ZERO,
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The proxy's address for a target URL's host and port: `127.0.0.1:PORT`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Shared handle, for the nemesis and the environment.
pub type Shared = Arc<FaultProxy>;
