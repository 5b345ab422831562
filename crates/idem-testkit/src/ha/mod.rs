//! Throw-away highly available clusters on 127.0.0.1 for failover tests: a PostgreSQL primary with a streaming
//! standby ([`PostgresHa`]), a Redis primary with a replica watched by three Sentinels ([`RedisSentinel`]), and
//! a six-node Redis Cluster ([`RedisCluster`]). Every process is stopped when its value is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, is_root, missing, pg_bin, pg_command, user_ids, wait_for_line};

/// How long a failover or a replication catch-up may take before a test gives up.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// A server process of its own process group, so that [`Proc::kill9`] takes its children with it (a PostgreSQL
/// postmaster's backends), as a machine that dies would.
#[derive(Debug)]
struct Proc {
    child: Option<Child>,
}

impl Proc {
    fn spawn(mut cmd: Command, ready: &'static str, what: &str, stdout: bool) -> Self {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0).stdin(Stdio::null());
        if stdout {
            cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        } else {
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("run {what}: {e}"));
        let out: Box<dyn std::io::Read + Send> =
            if stdout { Box::new(child.stdout.take().unwrap()) } else { Box::new(child.stderr.take().unwrap()) };
        if let Err(log) = wait_for_line(out, ready) {
            let mut p = Self { child: Some(child) };
            p.kill9();
            panic!("{what} did not start:\n{log}");
        }
        Self { child: Some(child) }
    }

    /// SIGKILL to the whole process group, then reaps the leader.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGQUIT (PostgreSQL's immediate shutdown) to the leader, SIGKILL to the group after it.
    fn quit(&mut self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args(["-QUIT", &child.id().to_string()]).status();
            if let Some(mut child) = self.child.take() {
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.child = Some(child);
            }
        }
        self.kill9();
    }

    fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// `sig` (`-STOP`, `-CONT`) to the process group.
    fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args([sig, "--", &format!("-{}", child.id())]).status();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Polls `f` every 100 ms until it returns `Some`, panicking with `what` after [`FAILOVER_TIMEOUT`].
fn wait_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + FAILOVER_TIMEOUT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {FAILOVER_TIMEOUT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Replication between the primary and the standby of a [`PostgresHa`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// The PostgreSQL default: a commit is acknowledged once the primary flushed it; the standby may lag.
    Asynchronous,
    /// `synchronous_standby_names = '*'` (with `synchronous_commit = on`): a commit is acknowledged only once
    /// the standby flushed it too.
    Synchronous,
}

/// A PostgreSQL primary and a streaming standby made from it with `pg_basebackup -R`, on two free ports of
/// 127.0.0.1, `trust` authentication for user `postgres`, no TLS. [`PostgresHa::kill_primary`] kills the primary
/// as a crash would (SIGKILL to the postmaster and its backends); [`PostgresHa::promote`] runs `pg_ctl promote`
/// on the standby. Both are stopped on drop.
#[derive(Debug)]
pub struct PostgresHa {
    /// The primary's port.
    pub primary_port: u16,
    /// The standby's port.
    pub standby_port: u16,
    primary: Proc,
    standby: Proc,
    bin: PathBuf,
    owner: Option<(u32, u32)>,
    standby_data: PathBuf,
    _dir: tempfile::TempDir,
}

/// `postgres` on `data` and `port`, with the settings every test cluster here shares.
fn postgres_cmd(bin: &Path, owner: Option<(u32, u32)>, data: &Path, port: u16, extra: &[String]) -> Command {
    let mut cmd = pg_command(bin, owner, "postgres");
    cmd.args(["-D".as_ref(), data.as_os_str()])
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="])
        // The OS keeps what was written when the process is killed; only a machine crash would need fsync.
        .args(["-c", "fsync=off", "-c", "max_connections=300", "-c", "wal_level=replica", "-c", "max_wal_senders=5"])
        .args(["-c", "hot_standby=on"])
        .args(extra);
    cmd
}

impl PostgresHa {
    /// Makes and starts the primary (`initdb`), copies it to the standby (`pg_basebackup -R -X stream`), starts
    /// the standby and waits until it streams.
    ///
    /// `None` (with a printed reason) when the PostgreSQL programs are missing and `IDEM_TEST_REQUIRE_BACKENDS`
    /// is unset.
    ///
    /// # Panics
    /// When the programs are missing under `IDEM_TEST_REQUIRE_BACKENDS`, or a step fails (with its output).
    pub fn start(replication: Replication) -> Option<Self> {
        let Some(bin) = pg_bin() else {
            missing("no PostgreSQL server programs (/usr/lib/postgresql/N/bin/initdb; set IDEM_TEST_PG_BIN)");
            return None;
        };
        let owner = if is_root() {
            let Some(ids) = user_ids("postgres") else {
                missing("running as root and there is no postgres user to run a cluster as");
                return None;
            };
            Some(ids)
        } else {
            None
        };
        let dir = tempfile::tempdir().unwrap();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        }
        let primary_data = dir.path().join("primary");
        let standby_data = dir.path().join("standby");
        let run = |mut cmd: Command, what: &str| {
            let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
            assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
        };
        let mut initdb = pg_command(&bin, owner, "initdb");
        initdb.args(["-D".as_ref(), primary_data.as_os_str()]).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(initdb, "initdb");
        std::fs::write(
            primary_data.join("pg_hba.conf"),
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        let primary_port = free_port();
        let sync = match replication {
            Replication::Asynchronous => String::new(),
            Replication::Synchronous => "*".to_owned(),
        };
        let extra = ["-c".to_owned(), format!("synchronous_standby_names={sync}")];
        let primary = Proc::spawn(
            postgres_cmd(&bin, owner, &primary_data, primary_port, &extra),
            "database system is ready to accept connections",
            "the primary PostgreSQL",
            false,
        );
        let mut basebackup = pg_command(&bin, owner, "pg_basebackup");
        basebackup
            .args(["-h", "127.0.0.1", "-p", &primary_port.to_string(), "-U", "postgres", "-D"])
            .arg(&standby_data)
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]);
        run(basebackup, "pg_basebackup");
        let standby_port = free_port();
        // No synchronous_standby_names here: once promoted the standby has no standby of its own to wait for.
        let standby = Proc::spawn(
            postgres_cmd(&bin, owner, &standby_data, standby_port, &[]),
            "ready to accept read-only connections",
            "the standby PostgreSQL",
            false,
        );
        let ha = Self { primary_port, standby_port, primary, standby, bin, owner, standby_data, _dir: dir };
        wait_until("the standby streaming from the primary", || {
            (ha.psql(ha.primary_port, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")? == "1")
                .then_some(())
        });
        Some(ha)
    }

    /// One value from `sql` on the server at `port` (`psql -At`), `None` when it cannot be asked.
    fn psql(&self, port: u16, sql: &str) -> Option<String> {
        let out = pg_command(&self.bin, self.owner, "psql")
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres", "-d", "postgres", "-At", "-c", sql])
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Kills the primary as a crash of its machine would: SIGKILL to the postmaster and every backend at once.
    pub fn kill_primary(&mut self) {
        self.primary.kill9();
    }

    /// Promotes the standby (`pg_ctl promote -w`) and waits until it accepts writes.
    ///
    /// # Panics
    /// When `pg_ctl` fails or the standby is still in recovery after a minute.
    pub fn promote(&mut self) {
        let out = pg_command(&self.bin, self.owner, "pg_ctl")
            .args(["promote", "-w", "-D"])
            .arg(&self.standby_data)
            .output()
            .expect("run pg_ctl");
        assert!(out.status.success(), "pg_ctl promote failed: {}", String::from_utf8_lossy(&out.stderr));
        wait_until("the promoted standby accepting writes", || {
            (self.psql(self.standby_port, "SELECT pg_is_in_recovery()")? == "f").then_some(())
        });
    }

    /// `postgres://postgres@127.0.0.1:PRIMARY,127.0.0.1:STANDBY/postgres?target_session_attrs=read-write` and
    /// `&query` when not empty.
    pub fn url(&self, query: &str) -> String {
        let q = if query.is_empty() { String::new() } else { format!("&{query}") };
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write{q}",
            self.primary_port, self.standby_port
        )
    }

    /// Freezes the primary (SIGSTOP to the postmaster and its backends), as a hung machine or a network that
    /// drops packets looks to a client: connections are accepted by the kernel but never answered.
    /// [`PostgresHa::thaw_primary`] continues it; drop kills it frozen or not.
    pub fn freeze_primary(&mut self) {
        self.primary.signal("-STOP");
    }

    /// Continues a primary frozen by [`PostgresHa::freeze_primary`].
    pub fn thaw_primary(&mut self) {
        self.primary.signal("-CONT");
    }

    /// Whether the primary still runs (it does until [`PostgresHa::kill_primary`]).
    pub fn primary_alive(&self) -> bool {
        self.primary.alive()
    }
}

impl Drop for PostgresHa {
    fn drop(&mut self) {
        self.primary.quit();
        self.standby.quit();
    }
}

/// The `redis-server` program: `IDEM_TEST_REDIS_SERVER`, else from the `PATH`; `None` (printed, or a panic under
/// `IDEM_TEST_REQUIRE_BACKENDS`) when it cannot run.
fn redis_program() -> Option<PathBuf> {
    let program = std::env::var_os("IDEM_TEST_REDIS_SERVER").map(PathBuf::from).unwrap_or("redis-server".into());
    if Command::new(&program).arg("--version").output().is_err() {
        missing("no redis-server program (set IDEM_TEST_REDIS_SERVER)");
        return None;
    }
    Some(program)
}

/// `redis-cli`, beside `redis-server` (the same package).
fn redis_cli() -> Option<PathBuf> {
    let cli = std::env::var_os("IDEM_TEST_REDIS_CLI").map(PathBuf::from).unwrap_or("redis-cli".into());
    if Command::new(&cli).arg("--version").output().is_err() {
        missing("no redis-cli program (set IDEM_TEST_REDIS_CLI)");
        return None;
    }
    Some(cli)
}

/// A plain `redis-server` on `port` of 127.0.0.1 with `args`, nothing saved unless `args` says so.
fn redis_node(program: &Path, port: u16, dir: &Path, args: &[&str]) -> Proc {
    let mut cmd = Command::new(program);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(args);
    Proc::spawn(cmd, "Ready to accept connections", "redis-server", true)
}

/// Runs `redis-cli -p PORT ARGS…`, its output trimmed, `None` when it fails.
fn cli(program: &Path, port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new(program)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The Sentinel master name [`RedisSentinel`] monitors.
pub const SENTINEL_MASTER: &str = "idem";

/// A Redis primary and one replica watched by three Sentinels (quorum 2, a node is down after 1 s), all on
/// free ports of 127.0.0.1, no persistence. [`RedisSentinel::kill_primary`] kills the primary (SIGKILL);
/// [`RedisSentinel::wait_failover`] waits until every Sentinel names the replica as the master. Stopped on drop.
#[derive(Debug)]
pub struct RedisSentinel {
    /// The primary's port when started.
    pub primary_port: u16,
    /// The replica's port.
    pub replica_port: u16,
    /// The Sentinels' ports.
    pub sentinel_ports: [u16; 3],
    primary: Proc,
    _replica: Proc,
    _sentinels: Vec<Proc>,
    program: PathBuf,
    cli: PathBuf,
    dir: tempfile::TempDir,
}

impl RedisSentinel {
    /// Starts the primary, the replica and the Sentinels, and waits until the Sentinels know the replica and
    /// each other (so a failover can be elected) and the replica is in sync.
    ///
    /// `None` (with a printed reason) when `redis-server`/`redis-cli` are missing and
    /// `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When a process does not start or the set-up does not settle within a minute.
    pub fn start() -> Option<Self> {
        let program = redis_program()?;
        let cli_program = redis_cli()?;
        let dir = tempfile::tempdir().unwrap();
        let primary_port = free_port();
        let replica_port = free_port();
        let primary = redis_node(&program, primary_port, dir.path(), &[]);
        let replica = redis_node(
            &program,
            replica_port,
            dir.path(),
            &["--replicaof", "127.0.0.1", &primary_port.to_string(), "--dbfilename", "replica.rdb"],
        );
        let sentinel_ports = [free_port(), free_port(), free_port()];
        let sentinels = sentinel_ports
            .iter()
            .map(|port| {
                // A Sentinel rewrites its configuration file, so each gets one of its own.
                let conf = dir.path().join(format!("sentinel-{port}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {}\n\
                         sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary_port} 2\n\
                         sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                         sentinel failover-timeout {SENTINEL_MASTER} 10000\n\
                         sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                        dir.path().display()
                    ),
                )
                .unwrap();
                let mut cmd = Command::new(&program);
                cmd.arg(&conf).arg("--sentinel");
                Proc::spawn(cmd, "+monitor master", "redis-server --sentinel", true)
            })
            .collect();
        let set = Self {
            primary_port,
            replica_port,
            sentinel_ports,
            primary,
            _replica: replica,
            _sentinels: sentinels,
            program,
            cli: cli_program,
            dir,
        };
        wait_until("the replica in sync", || {
            cli(&set.cli, replica_port, &["INFO", "replication"])?.contains("master_link_status:up").then_some(())
        });
        for port in sentinel_ports {
            wait_until("each Sentinel knowing the replica and the other two", || {
                let replicas = cli(&set.cli, port, &["SENTINEL", "REPLICAS", SENTINEL_MASTER])?;
                let others = cli(&set.cli, port, &["SENTINEL", "SENTINELS", SENTINEL_MASTER])?;
                let known = others.lines().filter(|l| *l == "name").count();
                (replicas.contains(&replica_port.to_string()) && known == 2).then_some(())
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

    /// Kills the primary (SIGKILL).
    pub fn kill_primary(&mut self) {
        self.primary.kill9();
    }

    /// Starts the killed primary again, empty, on its port, as its machine coming back would; the Sentinels
    /// make it a replica of the new master. Waits until it is in sync, so the new master has a replica again
    /// (`WAIT 1` can be met).
    ///
    /// # Panics
    /// When it does not start or sync within a minute.
    pub fn restart_old_primary(&mut self) {
        self.primary = redis_node(&self.program, self.primary_port, self.dir.path(), &[]);
        wait_until("the old primary back as a replica in sync", || {
            cli(&self.cli, self.primary_port, &["INFO", "replication"])?.contains("master_link_status:up").then_some(())
        });
    }

    /// Waits until every Sentinel names the replica as the master.
    ///
    /// # Panics
    /// When they do not within a minute.
    pub fn wait_failover(&self) {
        for port in self.sentinel_ports {
            wait_until("the Sentinels naming the replica as the master", || {
                let addr = cli(&self.cli, port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER])?;
                addr.lines().nth(1).is_some_and(|p| p == self.replica_port.to_string()).then_some(())
            });
        }
        wait_until("the replica serving as master", || {
            cli(&self.cli, self.replica_port, &["ROLE"])?.starts_with("master").then_some(())
        });
    }
}

/// A Redis Cluster of six nodes on free ports of 127.0.0.1 (at most 55535, as each node's cluster bus listens
/// on its port + 10000): three masters with one replica each (`redis-cli --cluster create … --cluster-replicas
/// 1`), a node judged failed after 2 s, no persistence. Stopped on drop.
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
    /// Starts six nodes, creates the cluster and waits until every node reports `cluster_state:ok` and every
    /// replica is in sync.
    ///
    /// `None` (with a printed reason) when `redis-server`/`redis-cli` are missing and
    /// `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When a node does not start or the cluster does not form within a minute.
    pub fn start() -> Option<Self> {
        let program = redis_program()?;
        let cli_program = redis_cli()?;
        let dir = tempfile::tempdir().unwrap();
        let mut ports = Vec::new();
        for _ in 0..6 {
            ports.push(cluster_port(&ports));
        }
        let nodes = ports.iter().map(|port| cluster_node(&program, *port, dir.path())).collect();
        let cluster = Self { ports, nodes, program, cli: cli_program, dir };
        let addrs: Vec<String> = cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new(&cluster.cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
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
            if !self.nodes[i].alive() {
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

    /// `redis+cluster://127.0.0.1:P1,…,127.0.0.1:P6` and `?query` when not empty.
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
            .filter(|(_, n)| n.alive())
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
                self.ports.iter().zip(&self.nodes).filter(|(_, n)| n.alive()).all(|(p, _)| {
                    cli(&self.cli, *p, &["CLUSTER", "INFO"]).is_some_and(|i| i.contains("cluster_state:ok"))
                });
            (ok && self.try_master_of(key).is_ok_and(|m| m != old)).then_some(())
        });
    }
}
