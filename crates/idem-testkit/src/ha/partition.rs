//! Links the test kit can cut: a TCP relay ([`Relay`]) in front of a server port, through which the servers
//! of a highly available setup reach each other, so that a partition can be made without privileges (no
//! network namespace, no firewall rules). The relay tells its clients apart by their source address: Redis 7
//! connects from the address `bind-source-addr` names (replication, Sentinel links, the Cluster bus), and
//! the kit gives each node and the Sentinels an address of their own in 127.0.0.0/8, while idem and the
//! kit's own `redis-cli` come from 127.0.0.1. PostgreSQL standbys cannot choose their source address, so
//! each gets a relay of its own to the primary and a cut there cuts every client of it.
//!
//! A cut closes the open connections from the addresses cut off and closes every new one at once: the far
//! end sees the link fail, as after a partition noticed by a timeout, only without waiting for the timeout.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Which clients a [`Relay`] turns away.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Cut {
    /// None: the link is whole.
    #[default]
    None,
    /// Those connecting from these addresses.
    From(Vec<IpAddr>),
    /// Everyone.
    All,
}

impl Cut {
    fn refuses(&self, ip: IpAddr) -> bool {
        match self {
            Cut::None => false,
            Cut::From(ips) => ips.contains(&ip),
            Cut::All => true,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    cut: Cut,
    /// Open connections by number: the client's address and both streams (to close them on a cut).
    open: HashMap<u64, (IpAddr, TcpStream, TcpStream)>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    target: AtomicU16,
    next: AtomicU64,
    stopped: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A TCP relay on a port of 127.0.0.1 to a port of 127.0.0.1 (std threads: the kit has no runtime), which
/// can be cut ([`Relay::cut`]) and pointed elsewhere ([`Relay::retarget`]). Stops when dropped.
#[derive(Debug)]
pub struct Relay {
    /// The port it listens on.
    pub port: u16,
    shared: Arc<Shared>,
}

impl Relay {
    /// Listens on `port` of 127.0.0.1 and relays to `target` on 127.0.0.1.
    ///
    /// # Panics
    /// When the port cannot be bound.
    pub fn start(port: u16, target: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| panic!("bind relay {port}: {e}"));
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            target: AtomicU16::new(target),
            next: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || accept_loop(&listener, &accepting));
        Self { port, shared }
    }

    /// From now on, turns away the clients `cut` names, and closes their open connections.
    pub fn cut(&self, cut: Cut) {
        let mut state = self.shared.lock();
        for (ip, a, b) in state.open.values() {
            if cut.refuses(*ip) {
                let _ = a.shutdown(Shutdown::Both);
                let _ = b.shutdown(Shutdown::Both);
            }
        }
        state.cut = cut;
    }

    /// Lets every client through again.
    pub fn heal(&self) {
        self.shared.lock().cut = Cut::None;
    }

    /// Relays new connections to `target` from now on, and closes the open ones (their clients reconnect to
    /// it), as a moved virtual address would.
    pub fn retarget(&self, target: u16) {
        self.shared.target.store(target, Ordering::SeqCst);
        for (_, a, b) in self.shared.lock().open.values() {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }

    /// The port it relays to now.
    pub fn target(&self) -> u16 {
        self.shared.target.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the stop and lets the port go.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        for (_, a, b) in self.shared.lock().open.values() {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for client in listener.incoming() {
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        let Ok(peer) = client.peer_addr() else { continue };
        if shared.lock().cut.refuses(peer.ip()) {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let shared = Arc::clone(shared);
        std::thread::spawn(move || relay(client, peer, &shared));
    }
}

/// Connects to the target and copies both ways until either side ends, then closes both: a half-open relay
/// would hide the failure from the other side.
fn relay(client: TcpStream, peer: SocketAddr, shared: &Shared) {
    let target = shared.target.load(Ordering::SeqCst);
    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) =
        (client.try_clone(), server.try_clone(), client.try_clone(), server.try_clone())
    else {
        return;
    };
    let id = shared.next.fetch_add(1, Ordering::SeqCst);
    {
        let mut state = shared.lock();
        // A cut made between the accept and here must not miss this connection.
        if state.cut.refuses(peer.ip()) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            return;
        }
        state.open.insert(id, (peer.ip(), c3, s3));
    }
    let up = std::thread::spawn(move || pump(c2, s2));
    pump(server, client);
    let _ = up.join();
    shared.lock().open.remove(&id);
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// The source address the kit gives node `i` of a Redis setup (`bind-source-addr`): 127.0.0.(10 + i).
pub(crate) fn node_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, u8::try_from(10 + i).unwrap_or(255)))
}

/// The source address of every Sentinel.
pub(crate) const SENTINEL_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
