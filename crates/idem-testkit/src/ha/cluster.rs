//! [`RedisCluster`]: three Redis masters with one or two replicas each.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use super::partition::{Cut, Relay, node_ip};
use super::{Proc, cli, redis_cli, redis_node, redis_program, wait_until};
use crate::free_port;

/// How a replica takes over from its master in [`RedisCluster::failover`]: `CLUSTER FAILOVER` with no option
/// (the master stops its clients until the replica has caught up: nothing acknowledged is lost), `FORCE` (no
/// handshake with the master, the other masters still vote) or `TAKEOVER` (no vote either).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterFailover {
    /// `CLUSTER FAILOVER`.
    Coordinated,
    /// `CLUSTER FAILOVER FORCE`.
    Force,
    /// `CLUSTER FAILOVER TAKEOVER`.
    Takeover,
}

/// A Redis Cluster on free ports (at most 55535) of 127.0.0.1: three masters with one replica each (six nodes,
/// [`RedisCluster::start`]) or two (nine, [`RedisCluster::start_with_replicas`]), made by `redis-cli --cluster
/// create … --cluster-replicas N`, a node judged failed after 2 s, no persistence. Stopped on drop.
///
/// As in [`super::RedisSentinel`], each node listens on ports of its own (client and cluster bus, `cluster-port`)
/// behind a [`Relay`] on each of its public ports, which it announces (`cluster-announce-port`,
/// `cluster-announce-bus-port`), and connects to the others from an address of its own (`bind-source-addr`
/// 127.0.0.(10 + i)): replication and the cluster bus go through the relays and come from the node's address,
/// so [`RedisCluster::partition`] can cut the links between nodes and leave those of clients (from 127.0.0.1)
/// whole.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes' (public) ports.
    pub ports: Vec<u16>,
    nodes: Vec<Node>,
    program: PathBuf,
    cli: PathBuf,
    dir: tempfile::TempDir,
    /// The nodes on the minority side of the partition in force ([`RedisCluster::partition`]), if any.
    cut_off: Mutex<Vec<u16>>,
}

/// One Cluster node: its process, the ports it listens on, and the relays on its public ports.
#[derive(Debug)]
struct Node {
    addr: NodeAddr,
    proc: Proc,
    relay: Relay,
    bus_relay: Relay,
}

/// Where a node listens and what it announces.
#[derive(Clone, Copy, Debug)]
struct NodeAddr {
    /// The client port it announces (its relay's).
    port: u16,
    /// The cluster bus port it announces (its relay's).
    bus: u16,
    /// The client port it listens on.
    hidden: u16,
    /// The cluster bus port it listens on.
    hidden_bus: u16,
    /// The address it connects from.
    ip: IpAddr,
}

/// A Cluster node at `a`; its node table (`nodes-PORT.conf`) in `dir` survives a restart, so a restarted node
/// rejoins as what the Cluster made it meanwhile.
fn cluster_node(program: &Path, a: NodeAddr, dir: &Path) -> Proc {
    let conf = format!("nodes-{}.conf", a.port);
    let rdb = format!("dump-{}.rdb", a.port);
    let (port, bus, hidden_bus, ip) =
        (a.port.to_string(), a.bus.to_string(), a.hidden_bus.to_string(), a.ip.to_string());
    let args = [
        ["--cluster-enabled", "yes", "--cluster-config-file", &conf, "--cluster-node-timeout", "2000"].as_slice(),
        &["--cluster-port", &hidden_bus, "--cluster-announce-ip", "127.0.0.1", "--cluster-announce-port", &port],
        &["--cluster-announce-bus-port", &bus, "--bind-source-addr", &ip, "--protected-mode", "no"],
        &["--dbfilename", &rdb],
    ]
    .concat();
    redis_node(program, a.hidden, dir, &args)
}

/// A free port of 127.0.0.1, at most 55535, not among `taken`.
fn cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = free_port();
        if port <= 55535 && !taken.contains(&port) {
            return port;
        }
    }
}

impl RedisCluster {
    /// [`RedisCluster::start_with_replicas`] with one replica per master: six nodes.
    ///
    /// # Panics
    /// When a node does not start or the cluster does not form within a minute.
    pub fn start() -> Option<Self> {
        Self::start_with_replicas(1)
    }

    /// Starts three masters with `replicas` replicas each (1 or 2), creates the cluster and waits until every
    /// node reports `cluster_state:ok` and every replica is in sync.
    ///
    /// `None` (with a printed reason) when `redis-server`/`redis-cli` are missing and
    /// `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When a node does not start or the cluster does not form within a minute.
    pub fn start_with_replicas(replicas: usize) -> Option<Self> {
        assert!((1..=2).contains(&replicas), "1 or 2 replicas per master, not {replicas}");
        let program = redis_program()?;
        let cli_program = redis_cli()?;
        let dir = tempfile::tempdir().unwrap();
        let mut taken = Vec::new();
        let mut nodes = Vec::new();
        for i in 0..3 * (1 + replicas) {
            let mut port = || {
                let p = cluster_port(&taken);
                taken.push(p);
                p
            };
            let addr = NodeAddr { port: port(), bus: port(), hidden: port(), hidden_bus: port(), ip: node_ip(i) };
            let proc = cluster_node(&program, addr, dir.path());
            let (relay, bus_relay) = (Relay::start(addr.port, addr.hidden), Relay::start(addr.bus, addr.hidden_bus));
            nodes.push(Node { addr, proc, relay, bus_relay });
        }
        let ports = nodes.iter().map(|n| n.addr.port).collect();
        let cluster = Self { ports, nodes, program, cli: cli_program, dir, cut_off: Mutex::default() };
        let addrs: Vec<String> = cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new(&cluster.cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(out.status.success(), "redis-cli --cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        cluster.wait_ok();
        Some(cluster)
    }

    /// Waits until every live node says `cluster_state:ok` and every replica's link to its master is up.
    fn wait_ok(&self) {
        for (i, port) in self.ports.iter().enumerate() {
            if !self.nodes[i].proc.answers() {
                continue;
            }
            wait_until("every cluster node in state ok", || {
                cli(&self.cli, *port, &["CLUSTER", "INFO"])?.contains("cluster_state:ok").then_some(())
            });
            wait_until("every replica in sync", || {
                let info = cli(&self.cli, *port, &["INFO", "replication"])?;
                (info.contains("role:master") || info.contains("master_link_status:up")).then_some(())
            });
        }
    }

    /// `redis+cluster://127.0.0.1:P1,…,127.0.0.1:PN` and `?query` when not empty.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let q = if query.is_empty() { String::new() } else { format!("?{query}") };
        format!("redis+cluster://{}{q}", hosts.join(","))
    }

    /// The port of the master now serving `key`'s hash slot, asked of a live node.
    ///
    /// # Panics
    /// When no live node answers.
    pub fn master_of(&self, key: &str) -> u16 {
        self.try_master_of(key).unwrap_or_else(|nodes| panic!("no live master serves {key:?}:\n{nodes}"))
    }

    /// [`RedisCluster::master_of`], or the node table when no live master serves the slot (mid-failover).
    fn try_master_of(&self, key: &str) -> Result<u16, String> {
        let slot = self.slot(key);
        let nodes = self.ask(&["CLUSTER", "NODES"]);
        serving(&nodes, slot).ok_or(nodes)
    }

    /// `key`'s hash slot.
    fn slot(&self, key: &str) -> u16 {
        let slot = self.ask(&["CLUSTER", "KEYSLOT", key]);
        // A test kit's failure is a panic that says what the server answered.
        slot.parse().unwrap_or_else(|_| panic!("CLUSTER KEYSLOT answered {slot:?}"))
    }

    /// `args` asked of the first live node that answers, one cut off by [`RedisCluster::partition`] last (its
    /// view is the minority's).
    fn ask(&self, args: &[&str]) -> String {
        let cut_off = self.cut_off();
        let live = self.nodes.iter().filter(|n| n.proc.answers());
        let (whole, cut): (Vec<&Node>, Vec<&Node>) = live.partition(|n| !cut_off.contains(&n.addr.port));
        whole
            .into_iter()
            .chain(cut)
            .find_map(|n| cli(&self.cli, n.addr.port, args))
            .unwrap_or_else(|| panic!("no live cluster node answers {args:?}"))
    }

    fn cut_off(&self) -> Vec<u16> {
        self.cut_off.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Kills the node on `port` (SIGKILL).
    ///
    /// # Panics
    /// When no node of this cluster has that port.
    pub fn kill(&mut self, port: u16) {
        let i = self.index(port);
        self.nodes[i].proc.kill9();
    }

    /// Starts the killed node on `port` again, as its machine coming back would: it rejoins as a replica of
    /// the master that replaced it. Waits until every node says `cluster_state:ok` and it is in sync, so that
    /// master has a replica again (`WAIT 1` can be met).
    ///
    /// # Panics
    /// When no node of this cluster has that port, or it does not rejoin within a minute.
    pub fn restart(&mut self, port: u16) {
        let i = self.index(port);
        self.nodes[i].proc = cluster_node(&self.program, self.nodes[i].addr, self.dir.path());
        self.wait_ok();
    }

    /// Waits until `key`'s slot is served by a master other than `old` and every live node says
    /// `cluster_state:ok`.
    ///
    /// # Panics
    /// When that does not happen within a minute.
    pub fn wait_failover(&self, key: &str, old: u16) {
        wait_until("a replica promoted in the killed master's place", || {
            let ok =
                self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.proc.answers()).all(|(p, _)| {
                    cli(&self.cli, *p, &["CLUSTER", "INFO"]).is_some_and(|i| i.contains("cluster_state:ok"))
                });
            (ok && self.try_master_of(key).is_ok_and(|m| m != old)).then_some(())
        });
    }

    /// The node table (`CLUSTER NODES`) as a live node sees it: port, id, flags and master id of each node.
    fn table(&self) -> Vec<(u16, String, String, String)> {
        let nodes = self.ask(&["CLUSTER", "NODES"]);
        nodes
            .lines()
            .filter_map(|line| {
                let (f, port) = node_line(line)?;
                Some((port, (*f.first()?).to_owned(), (*f.get(2)?).to_owned(), (*f.get(3)?).to_owned()))
            })
            .collect()
    }

    /// The ports of the replicas of the master on `master`, as the Cluster knows them now.
    ///
    /// # Panics
    /// When no live node answers.
    pub fn replicas_of(&self, master: u16) -> Vec<u16> {
        let table = self.table();
        let Some((_, id, _, _)) = table.iter().find(|(p, ..)| *p == master) else { return Vec::new() };
        table.iter().filter(|(_, _, flags, of)| flags.contains("slave") && of == id).map(|(p, ..)| *p).collect()
    }

    fn index(&self, port: u16) -> usize {
        self.ports.iter().position(|p| *p == port).unwrap_or_else(|| panic!("no node of this cluster on {port}"))
    }

    /// Freezes the node on `port` (SIGSTOP): a hung machine, or a replica lagging behind; [`RedisCluster::thaw`]
    /// continues it.
    ///
    /// # Panics
    /// When no node of this cluster has that port.
    pub fn freeze(&self, port: u16) {
        self.nodes[self.index(port)].proc.signal("-STOP");
    }

    /// Continues the node on `port` after [`RedisCluster::freeze`].
    ///
    /// # Panics
    /// When no node of this cluster has that port.
    pub fn thaw(&self, port: u16) {
        self.nodes[self.index(port)].proc.signal("-CONT");
    }

    /// A switchover with the old master alive: `CLUSTER FAILOVER [FORCE|TAKEOVER]` sent to the replica on
    /// `replica`. Waits until every live node's table names it a master, the old master has become a replica,
    /// and every live node says `cluster_state:ok`.
    ///
    /// # Panics
    /// When the replica refuses, or that does not happen within a minute.
    pub fn failover(&self, replica: u16, how: ClusterFailover) {
        let mut args = vec!["CLUSTER", "FAILOVER"];
        match how {
            ClusterFailover::Coordinated => {}
            ClusterFailover::Force => args.push("FORCE"),
            ClusterFailover::Takeover => args.push("TAKEOVER"),
        }
        let old = self.table().into_iter().find(|(p, ..)| *p == replica).map(|(.., of)| of);
        let answer = cli(&self.cli, replica, &args);
        assert_eq!(answer.as_deref(), Some("OK"), "{args:?} answered {answer:?}");
        let live: Vec<u16> =
            self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.proc.answers()).map(|(p, _)| *p).collect();
        wait_until("the replica serving as master, seen by every node, the cluster ok", || {
            let all = live.iter().all(|p| {
                let nodes = cli(&self.cli, *p, &["CLUSTER", "NODES"]).unwrap_or_default();
                let info = cli(&self.cli, *p, &["CLUSTER", "INFO"]).unwrap_or_default();
                let promoted = nodes.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 2 && f[1].starts_with(&format!("127.0.0.1:{replica}@")) && f[2].contains("master")
                });
                promoted && info.contains("cluster_state:ok")
            });
            let demoted = old.as_ref().is_none_or(|id| {
                self.table()
                    .iter()
                    .any(|(_, i, flags, _)| i == id && (flags.contains("slave") || flags.contains("fail")))
            });
            (all && demoted).then_some(())
        });
    }

    /// Cuts the master serving `key`'s slot, with the replicas `keep` (their ports), off from every other node,
    /// both ways: replication and the cluster bus; clients (from 127.0.0.1) still reach every node. The other
    /// masters judge it failed after the node timeout (2 s) and a replica on their side is elected in its
    /// place, while the old master, reaching no majority of masters, says `cluster_state:fail` and refuses
    /// commands from then on ([`RedisCluster::wait_cut_off`], [`RedisCluster::wait_new_master`]).
    /// [`RedisCluster::heal`] restores every link. Returns the old master's port.
    ///
    /// # Panics
    /// When no live node answers, or `keep` names no node of this cluster.
    pub fn partition(&self, key: &str, keep: &[u16]) -> u16 {
        let master = self.master_of(key);
        for port in keep {
            self.index(*port);
        }
        let side = |n: &Node| n.addr.port == master || keep.contains(&n.addr.port);
        let ours: Vec<IpAddr> = self.nodes.iter().filter(|n| side(n)).map(|n| n.addr.ip).collect();
        let theirs: Vec<IpAddr> = self.nodes.iter().filter(|n| !side(n)).map(|n| n.addr.ip).collect();
        for n in &self.nodes {
            let cut = Cut::From(if side(n) { theirs.clone() } else { ours.clone() });
            n.relay.cut(cut.clone());
            n.bus_relay.cut(cut);
        }
        *self.cut_off.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            self.nodes.iter().filter(|n| side(n)).map(|n| n.addr.port).collect();
        master
    }

    /// Waits until the node on `port` says `cluster_state:fail`: cut off, it reaches no majority of masters.
    ///
    /// # Panics
    /// When it does not within a minute.
    pub fn wait_cut_off(&self, port: u16) {
        wait_until("the cut-off node saying cluster_state:fail", || {
            cli(&self.cli, port, &["CLUSTER", "INFO"])?.contains("cluster_state:fail").then_some(())
        });
    }

    /// Waits until every live node outside the partition's minority side says `cluster_state:ok` and names
    /// one master other than `old` for `key`'s slot; returns that master's port.
    ///
    /// # Panics
    /// When that does not happen within a minute.
    pub fn wait_new_master(&self, key: &str, old: u16) -> u16 {
        let slot = self.slot(key);
        let cut_off = self.cut_off();
        let majority: Vec<u16> = self
            .nodes
            .iter()
            .filter(|n| n.proc.answers() && !cut_off.contains(&n.addr.port))
            .map(|n| n.addr.port)
            .collect();
        wait_until("a new master for the slot, named by every node of the majority", || {
            let named: Vec<Option<u16>> = majority
                .iter()
                .map(|p| {
                    let ok = cli(&self.cli, *p, &["CLUSTER", "INFO"])?.contains("cluster_state:ok");
                    ok.then(|| serving(&cli(&self.cli, *p, &["CLUSTER", "NODES"])?, slot)).flatten()
                })
                .collect();
            let new = named.first().copied().flatten().filter(|n| *n != old)?;
            named.iter().all(|n| *n == Some(new)).then_some(new)
        })
    }

    /// Restores every link a [`RedisCluster::partition`] cut; [`RedisCluster::wait_settled`] waits for the
    /// Cluster to agree again.
    pub fn heal(&self) {
        for n in &self.nodes {
            n.relay.heal();
            n.bus_relay.heal();
        }
        self.cut_off.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    }

    /// Waits until every live node says `cluster_state:ok`, every one names the same masters (an old master
    /// back from a partition has learnt of its successor and become its replica), and every replica's link to
    /// its master is up.
    ///
    /// # Panics
    /// When that does not happen within a minute.
    pub fn wait_settled(&self) {
        let live: Vec<u16> = self.nodes.iter().filter(|n| n.proc.answers()).map(|n| n.addr.port).collect();
        wait_until("every node naming the same masters", || {
            let views: Vec<Vec<u16>> = live
                .iter()
                .map(|p| {
                    let ok = cli(&self.cli, *p, &["CLUSTER", "INFO"])?.contains("cluster_state:ok");
                    ok.then(|| Some(masters(&cli(&self.cli, *p, &["CLUSTER", "NODES"])?))).flatten()
                })
                .collect::<Option<_>>()?;
            views.windows(2).all(|w| w[0] == w[1]).then_some(())
        });
        self.wait_ok();
    }
}

/// The fields of a `CLUSTER NODES` line: `<id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <link>
/// <slot ranges…>`, and the port.
fn node_line(line: &str) -> Option<(Vec<&str>, u16)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    // `ip:port@bus`: a line whose address does not parse is skipped like any other that cannot be used.
    let port = f.get(1)?.split('@').next()?.rsplit_once(':')?.1.parse().ok()?;
    Some((f, port))
}

/// The port of the master `nodes` (a `CLUSTER NODES` answer) names for `slot`, not judged failed.
fn serving(nodes: &str, slot: u16) -> Option<u16> {
    nodes.lines().filter_map(node_line).find_map(|(f, port)| {
        if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
            return None;
        }
        let serves = f[8..].iter().any(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
        });
        serves.then_some(port)
    })
}

/// The ports of the masters serving slots that `nodes` (a `CLUSTER NODES` answer) names, not judged failed,
/// in order.
fn masters(nodes: &str) -> Vec<u16> {
    let mut ports: Vec<u16> = nodes
        .lines()
        .filter_map(node_line)
        .filter(|(f, _)| f.len() >= 9 && f[2].contains("master") && !f[2].contains("fail"))
        .map(|(_, port)| port)
        .collect();
    ports.sort_unstable();
    ports
}
