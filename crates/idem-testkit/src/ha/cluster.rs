//! [`RedisCluster`]: three Redis masters with one or two replicas each.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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

/// A Redis Cluster on free ports of 127.0.0.1 (at most 55535, as each node's cluster bus listens on its port +
/// 10000): three masters with one replica each (six nodes, [`RedisCluster::start`]) or two (nine,
/// [`RedisCluster::start_with_replicas`]), made by `redis-cli --cluster create … --cluster-replicas N`, a node
/// judged failed after 2 s, no persistence. Stopped on drop.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes' ports.
    pub ports: Vec<u16>,
    nodes: Vec<Proc>,
    program: PathBuf,
    cli: PathBuf,
    dir: tempfile::TempDir,
}

/// A Cluster node on `port`; its node table (`nodes-PORT.conf`) in `dir` survives a restart, so a restarted
/// node rejoins as what the Cluster made it meanwhile.
fn cluster_node(program: &Path, port: u16, dir: &Path) -> Proc {
    let conf = format!("nodes-{port}.conf");
    let rdb = format!("dump-{port}.rdb");
    redis_node(
        program,
        port,
        dir,
        &["--cluster-enabled", "yes", "--cluster-config-file", &conf, "--cluster-node-timeout", "2000"]
            .into_iter()
            .chain(["--dbfilename", &rdb])
            .collect::<Vec<_>>(),
    )
}

/// A free port whose cluster bus port (+10000) is free too.
fn cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = free_port();
        if port <= 55535 && !taken.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
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
        let mut ports = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            ports.push(cluster_port(&ports));
        }
        let nodes = ports.iter().map(|port| cluster_node(&program, *port, dir.path())).collect();
        let cluster = Self { ports, nodes, program, cli: cli_program, dir };
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
            if !self.nodes[i].answers() {
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
        let slot = self.ask(&["CLUSTER", "KEYSLOT", key]);
        // A test kit's failure is a panic that says what the server answered.
        let slot: u16 = slot.parse().unwrap_or_else(|_| panic!("CLUSTER KEYSLOT answered {slot:?}"));
        let nodes = self.ask(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            // <id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <link> <slot ranges…>
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let serves = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            // `ip:port@bus`: a line whose address does not parse is skipped like any other it cannot use, and
            // the caller gets the whole `CLUSTER NODES` answer to show.
            let port = f[1].split('@').next().and_then(|a| a.rsplit_once(':')).and_then(|(_, p)| p.parse().ok());
            if let (true, Some(port)) = (serves, port) {
                return Ok(port);
            }
        }
        Err(nodes)
    }

    fn ask(&self, args: &[&str]) -> String {
        self.ports
            .iter()
            .zip(&self.nodes)
            .filter(|(_, n)| n.answers())
            .find_map(|(port, _)| cli(&self.cli, *port, args))
            .unwrap_or_else(|| panic!("no live cluster node answers {args:?}"))
    }

    /// Kills the node on `port` (SIGKILL).
    ///
    /// # Panics
    /// When no node of this cluster has that port.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).expect("a node of this cluster");
        self.nodes[i].kill9();
    }

    /// Starts the killed node on `port` again, as its machine coming back would: it rejoins as a replica of
    /// the master that replaced it. Waits until every node says `cluster_state:ok` and it is in sync, so that
    /// master has a replica again (`WAIT 1` can be met).
    ///
    /// # Panics
    /// When no node of this cluster has that port, or it does not rejoin within a minute.
    pub fn restart(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).expect("a node of this cluster");
        self.nodes[i] = cluster_node(&self.program, port, self.dir.path());
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
                self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.answers()).all(|(p, _)| {
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
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split('@').next()?.rsplit_once(':')?.1.parse().ok()?;
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
        self.nodes[self.index(port)].signal("-STOP");
    }

    /// Continues the node on `port` after [`RedisCluster::freeze`].
    ///
    /// # Panics
    /// When no node of this cluster has that port.
    pub fn thaw(&self, port: u16) {
        self.nodes[self.index(port)].signal("-CONT");
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
        let live: Vec<u16> = self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.answers()).map(|(p, _)| *p).collect();
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
}
