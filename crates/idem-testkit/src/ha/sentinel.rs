//! [`RedisSentinel`]: a Redis primary with one or two replicas under three Sentinels.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;

use super::partition::{Cut, Relay, SENTINEL_IP, node_ip};
use super::{Proc, cli, redis_cli, redis_node, redis_program, wait_until};
use crate::free_port;

/// The Sentinel master name [`RedisSentinel`] monitors.
pub const SENTINEL_MASTER: &str = "idem";

/// One Redis node: `redis-server` on a port of its own, reached by everyone through a [`Relay`] on its
/// public port (the one the Sentinels know and name to clients), which a partition cuts.
#[derive(Debug)]
struct Node {
    port: u16,
    hidden: u16,
    ip: IpAddr,
    proc: Proc,
    relay: Relay,
}

/// A Redis primary and one or two replicas watched by three Sentinels (quorum 2, a node is down after 1 s),
/// all on free ports of 127.0.0.1, no persistence. [`RedisSentinel::kill_primary`] kills the primary
/// (SIGKILL); [`RedisSentinel::wait_failover`] waits until every Sentinel names a replica as the master;
/// [`RedisSentinel::switchover`] has the Sentinels promote a replica with the old master alive;
/// [`RedisSentinel::partition`] cuts the master off from the Sentinels and some replicas while clients still
/// reach it. Stopped on drop.
///
/// Each node listens on a port of its own behind a [`Relay`] on its public port, and connects to the others
/// from an address of its own (`bind-source-addr` 127.0.0.(10 + i); the Sentinels from 127.0.0.2), so a
/// relay can cut the links between the servers and leave those of clients (from 127.0.0.1) whole.
/// `protected-mode no` lets those addresses in: every port is bound to 127.0.0.1 only.
#[derive(Debug)]
pub struct RedisSentinel {
    /// The primary's port when started.
    pub primary_port: u16,
    /// The first replica's port.
    pub replica_port: u16,
    /// Every replica's port, as started.
    pub replica_ports: Vec<u16>,
    /// The Sentinels' ports.
    pub sentinel_ports: [u16; 3],
    nodes: Vec<Node>,
    _sentinels: Vec<Proc>,
    program: PathBuf,
    cli: PathBuf,
    dir: tempfile::TempDir,
}

/// Starts node `port` (hidden port `hidden`, source address `ip`), a replica of `master` when given.
fn start_node(set: (&PathBuf, &std::path::Path), hidden: u16, port: u16, ip: IpAddr, master: Option<u16>) -> Proc {
    let (program, dir) = set;
    let (port_s, ip_s, rdb) = (port.to_string(), ip.to_string(), format!("node-{port}.rdb"));
    let master_s = master.map(|m| m.to_string()).unwrap_or_default();
    let mut args = vec!["--protected-mode", "no", "--bind-source-addr", &ip_s, "--dbfilename", &rdb];
    // The master names its replicas to the Sentinels by what they announce: the public port, not the hidden.
    args.extend(["--replica-announce-ip", "127.0.0.1", "--replica-announce-port", &port_s]);
    if master.is_some() {
        args.extend(["--replicaof", "127.0.0.1", &master_s]);
    }
    redis_node(program, hidden, dir, &args)
}

impl RedisSentinel {
    /// [`RedisSentinel::start_with_replicas`] with one replica.
    ///
    /// # Panics
    /// When a process does not start or the set-up does not settle within a minute.
    pub fn start() -> Option<Self> {
        Self::start_with_replicas(1)
    }

    /// Starts the primary, `replicas` replicas (1 or 2) and the Sentinels, and waits until the Sentinels know
    /// every replica and each other (so a failover can be elected) and the replicas are in sync.
    ///
    /// `None` (with a printed reason) when `redis-server`/`redis-cli` are missing and
    /// `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When a process does not start or the set-up does not settle within a minute.
    pub fn start_with_replicas(replicas: usize) -> Option<Self> {
        assert!((1..=2).contains(&replicas), "1 or 2 replicas, not {replicas}");
        let program = redis_program()?;
        let cli_program = redis_cli()?;
        let dir = tempfile::tempdir().unwrap();
        let mut nodes = Vec::new();
        for i in 0..=replicas {
            let (hidden, port) = (free_port(), free_port());
            let master = nodes.first().map(|m: &Node| m.port);
            let proc = start_node((&program, dir.path()), hidden, port, node_ip(i), master);
            nodes.push(Node { port, hidden, ip: node_ip(i), proc, relay: Relay::start(port, hidden) });
        }
        let primary_port = nodes[0].port;
        let sentinel_ports = [free_port(), free_port(), free_port()];
        let sentinels = sentinel_ports.iter().map(|port| sentinel(&program, dir.path(), *port, primary_port)).collect();
        let replica_ports: Vec<u16> = nodes[1..].iter().map(|n| n.port).collect();
        let set = Self {
            primary_port,
            replica_port: replica_ports[0],
            replica_ports,
            sentinel_ports,
            nodes,
            _sentinels: sentinels,
            program,
            cli: cli_program,
            dir,
        };
        for port in &set.replica_ports {
            set.wait_in_sync(*port);
        }
        for port in sentinel_ports {
            wait_until("each Sentinel knowing the replicas and the other two", || {
                let replicas = cli(&set.cli, port, &["SENTINEL", "REPLICAS", SENTINEL_MASTER])?;
                let others = cli(&set.cli, port, &["SENTINEL", "SENTINELS", SENTINEL_MASTER])?;
                let known = others.lines().filter(|l| *l == "name").count();
                let all = set.replica_ports.iter().all(|p| replicas.lines().any(|l| l == p.to_string()));
                (all && known == 2).then_some(())
            });
        }
        Some(set)
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/idem` and `?query` when not empty.
    pub fn url(&self, query: &str) -> String {
        let hosts: Vec<String> = self.sentinel_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let q = if query.is_empty() { String::new() } else { format!("?{query}") };
        format!("redis+sentinel://{}/{SENTINEL_MASTER}{q}", hosts.join(","))
    }

    fn node(&self, port: u16) -> &Node {
        self.nodes.iter().find(|n| n.port == port).unwrap_or_else(|| panic!("no node of this set on port {port}"))
    }

    fn node_mut(&mut self, port: u16) -> &mut Node {
        self.nodes.iter_mut().find(|n| n.port == port).unwrap_or_else(|| panic!("no node of this set on port {port}"))
    }

    /// The port of the master the Sentinels name now (the first that answers).
    ///
    /// # Panics
    /// When no Sentinel answers.
    pub fn master_port(&self) -> u16 {
        self.sentinel_ports
            .iter()
            .find_map(|s| self.named_by(*s))
            .unwrap_or_else(|| panic!("no Sentinel names a master"))
    }

    /// The master Sentinel `port` names.
    fn named_by(&self, port: u16) -> Option<u16> {
        let addr = cli(&self.cli, port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER])?;
        addr.lines().nth(1)?.parse().ok()
    }

    /// The first line of `ROLE` on node `port` (`master`, `slave`), and for a replica its master's port and
    /// whether its link is up.
    fn role(&self, port: u16) -> Option<(String, Option<u16>, bool)> {
        let role = cli(&self.cli, port, &["ROLE"])?;
        // `master` …, or `slave`, its master's host, port, link state (`connected`), offset.
        let lines: Vec<&str> = role.lines().collect();
        let master = lines.get(2).and_then(|p| p.parse().ok());
        Some(((*lines.first()?).to_owned(), master, lines.get(3) == Some(&"connected")))
    }

    /// Kills the primary (SIGKILL).
    pub fn kill_primary(&mut self) {
        self.kill(self.primary_port);
    }

    /// Kills node `port` (SIGKILL), a replica or a master.
    ///
    /// # Panics
    /// When no node of this set has that port.
    pub fn kill(&mut self, port: u16) {
        self.node_mut(port).proc.kill9();
    }

    /// Freezes node `port` (SIGSTOP): a hung machine, or a replica lagging behind; [`RedisSentinel::thaw`]
    /// continues it.
    ///
    /// # Panics
    /// When no node of this set has that port.
    pub fn freeze(&self, port: u16) {
        self.node(port).proc.signal("-STOP");
    }

    /// Continues node `port` after [`RedisSentinel::freeze`].
    ///
    /// # Panics
    /// When no node of this set has that port.
    pub fn thaw(&self, port: u16) {
        self.node(port).proc.signal("-CONT");
    }

    /// Starts the killed primary again, empty, on its port, as its machine coming back would, a replica of the
    /// master the Sentinels name. Waits until it is in sync, so the new master has that replica again.
    ///
    /// # Panics
    /// When it does not start or sync within a minute.
    pub fn restart_old_primary(&mut self) {
        self.restart(self.primary_port);
    }

    /// Starts the killed node `port` again, empty, as a replica of the master the Sentinels name, and waits
    /// until it is in sync.
    ///
    /// # Panics
    /// When no node of this set has that port, or it does not start or sync within a minute.
    pub fn restart(&mut self, port: u16) {
        let master = self.master_port();
        let (program, dir) = (self.program.clone(), self.dir.path().to_owned());
        let node = self.node_mut(port);
        node.proc.kill9();
        node.proc = start_node((&program, &dir), node.hidden, port, node.ip, Some(master));
        self.wait_in_sync(port);
    }

    /// Waits until node `port` is a replica whose link to its master is up.
    ///
    /// # Panics
    /// When it is not within a minute.
    pub fn wait_in_sync(&self, port: u16) {
        wait_until("a replica in sync", || {
            cli(&self.cli, port, &["INFO", "replication"])?.contains("master_link_status:up").then_some(())
        });
    }

    /// Waits until every Sentinel names a master other than the primary as started, and it serves as master;
    /// returns its port.
    ///
    /// # Panics
    /// When they do not within a minute.
    pub fn wait_failover(&self) -> u16 {
        self.wait_new_master(self.primary_port)
    }

    /// Waits until every Sentinel names one master other than `old`, and it says it is a master; its port.
    ///
    /// # Panics
    /// When that does not happen within a minute.
    pub fn wait_new_master(&self, old: u16) -> u16 {
        wait_until("the Sentinels naming a new master that serves as one", || {
            let named: Vec<Option<u16>> = self.sentinel_ports.iter().map(|s| self.named_by(*s)).collect();
            let new = named[0].filter(|p| *p != old)?;
            let master = self.role(new).is_some_and(|(kind, _, _)| kind == "master");
            (master && named.iter().all(|n| *n == Some(new))).then_some(new)
        })
    }

    /// A switchover with the old master alive: `SENTINEL FAILOVER idem` to the first Sentinel, which promotes
    /// a replica without asking the others. Waits until every Sentinel names the new master, it says it is a
    /// master, and the old master has become its replica; returns the new master's port.
    ///
    /// # Panics
    /// When the Sentinel refuses, or that does not happen within a minute.
    pub fn switchover(&self) -> u16 {
        let old = self.master_port();
        let answer = cli(&self.cli, self.sentinel_ports[0], &["SENTINEL", "FAILOVER", SENTINEL_MASTER]);
        assert_eq!(answer.as_deref(), Some("OK"), "SENTINEL FAILOVER answered {answer:?}");
        let new = self.wait_new_master(old);
        wait_until("the old master a replica of the new one", || {
            let (kind, master, _) = self.role(old)?;
            (kind == "slave" && master == Some(new)).then_some(())
        });
        new
    }

    /// Cuts the master the Sentinels name now, with the replicas `keep` (their ports), off from the other
    /// replicas and the three Sentinels, both ways; clients (from 127.0.0.1) still reach every node. With one
    /// replica kept, the Sentinels elect another one while the old master goes on taking writes.
    /// [`RedisSentinel::heal`] restores every link. Returns the old master's port.
    ///
    /// # Panics
    /// When no Sentinel names a master.
    pub fn partition(&self, keep: &[u16]) -> u16 {
        let master = self.master_port();
        let side = |n: &Node| n.port == master || keep.contains(&n.port);
        let ours: Vec<IpAddr> = self.nodes.iter().filter(|n| side(n)).map(|n| n.ip).collect();
        let mut theirs: Vec<IpAddr> = self.nodes.iter().filter(|n| !side(n)).map(|n| n.ip).collect();
        theirs.push(SENTINEL_IP);
        for n in &self.nodes {
            n.relay.cut(Cut::From(if side(n) { theirs.clone() } else { ours.clone() }));
        }
        master
    }

    /// Restores every link a [`RedisSentinel::partition`] cut.
    pub fn heal(&self) {
        for n in &self.nodes {
            n.relay.heal();
        }
    }
}

/// A Sentinel on `port` watching `master` (quorum 2, down after 1 s), connecting from [`SENTINEL_IP`].
fn sentinel(program: &PathBuf, dir: &std::path::Path, port: u16, master: u16) -> Proc {
    // A Sentinel rewrites its configuration file, so each gets one of its own. It announces 127.0.0.1, where
    // it listens: by default it would name the address it connects from to the other Sentinels.
    let conf = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\nbind-source-addr {SENTINEL_IP}\n\
             sentinel announce-ip 127.0.0.1\n\
             sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master} 2\n\
             sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
             sentinel failover-timeout {SENTINEL_MASTER} 10000\n\
             sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
            dir.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(program);
    cmd.arg(&conf).arg("--sentinel");
    Proc::spawn(cmd, "+monitor master", "redis-server --sentinel", true)
}
