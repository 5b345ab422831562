//! [`PostgresHa`]: a PostgreSQL primary with one or two streaming standbys.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::partition::{Cut, Relay};
use super::{Proc, wait_until};
use crate::{free_port, is_root, missing, pg_bin, pg_command, user_ids};

/// Replication between the primary and the standbys of a [`PostgresHa`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// The PostgreSQL default: a commit is acknowledged once the primary flushed it; the standbys may lag.
    Asynchronous,
    /// `synchronous_standby_names = '*'` (with `synchronous_commit = on`), which is `FIRST 1 (*)`: a commit is
    /// acknowledged once one standby (the first connected) flushed it too. With two standbys, once that one
    /// is promoted the other becomes synchronous and acknowledges commits the promoted one never sees.
    Synchronous,
    /// `synchronous_standby_names = 'ANY n (s0, s1, …, sn)'`, n the number of standbys: a commit is
    /// acknowledged once every standby flushed it. The list names every server (`s0` is the primary as
    /// started), so that a promoted standby asks the same of the standbys it gets (a server is never its own).
    AllStandbys,
}

/// One server of the set. Standby `i` (from 1) is named `s{i}` (`application_name` in its
/// `primary_conninfo`) and reaches the primary through a [`Relay`] of its own, which a partition cuts and a
/// switchover points at the new primary.
#[derive(Debug)]
struct Server {
    port: u16,
    data: PathBuf,
    proc: Proc,
    link: Option<Relay>,
}

/// A PostgreSQL primary and one or two streaming standbys made from it with `pg_basebackup`, on free ports of
/// 127.0.0.1, `trust` authentication for user `postgres`, no TLS. [`PostgresHa::kill_primary`] kills the
/// primary as a crash would (SIGKILL to the postmaster and its backends); [`PostgresHa::promote`] runs
/// `pg_ctl promote` on the first standby; [`PostgresHa::switchover`] promotes a standby while the old primary
/// runs and stops that one after a while; [`PostgresHa::partition`] cuts standbys off from the primary. All
/// are stopped on drop.
#[derive(Debug)]
pub struct PostgresHa {
    /// The primary's port (as started).
    pub primary_port: u16,
    /// The first standby's port.
    pub standby_port: u16,
    /// Every standby's port, as started.
    pub standby_ports: Vec<u16>,
    /// The servers, the primary as started first.
    servers: Vec<Server>,
    /// The port of the primary now (after a promotion, the promoted standby).
    primary_now: u16,
    bin: PathBuf,
    owner: Option<(u32, u32)>,
    _dir: tempfile::TempDir,
}

/// `postgres` on `data` and `port`, with the settings every test cluster here shares.
fn postgres_cmd(bin: &Path, owner: Option<(u32, u32)>, data: &Path, port: u16, extra: &[String]) -> Command {
    let mut cmd = pg_command(bin, owner, "postgres");
    cmd.args(["-D".as_ref(), data.as_os_str()])
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="])
        // The OS keeps what was written when the process is killed; only a machine crash would need fsync.
        .args(["-c", "fsync=off", "-c", "max_connections=300", "-c", "wal_level=replica", "-c", "max_wal_senders=8"])
        .args(["-c", "hot_standby=on", "-c", "wal_receiver_status_interval=1s"])
        .args(extra);
    cmd
}

/// Runs a set-up step, panicking with its error output when it fails.
fn run(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// The primary's `synchronous_standby_names` for `replication` with `standbys` standbys.
fn sync_names(replication: Replication, standbys: usize) -> String {
    match replication {
        Replication::Asynchronous => String::new(),
        Replication::Synchronous => "*".to_owned(),
        Replication::AllStandbys => {
            let names: Vec<String> = (0..=standbys).map(|i| format!("s{i}")).collect();
            format!("ANY {standbys} ({})", names.join(", "))
        }
    }
}

impl PostgresHa {
    /// [`PostgresHa::start_with`] with one standby.
    ///
    /// # Panics
    /// When the programs are missing under `IDEM_TEST_REQUIRE_BACKENDS`, or a step fails (with its output).
    pub fn start(replication: Replication) -> Option<Self> {
        Self::start_with(replication, 1)
    }

    /// Makes and starts the primary (`initdb`), copies it to `standbys` standbys (1 or 2; `pg_basebackup -X
    /// stream`), starts them and waits until every one streams.
    ///
    /// `None` (with a printed reason) when the PostgreSQL programs are missing and `IDEM_TEST_REQUIRE_BACKENDS`
    /// is unset.
    ///
    /// # Panics
    /// When the programs are missing under `IDEM_TEST_REQUIRE_BACKENDS`, or a step fails (with its output).
    pub fn start_with(replication: Replication, standbys: usize) -> Option<Self> {
        assert!((1..=2).contains(&standbys), "1 or 2 standbys, not {standbys}");
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
        let mut initdb = pg_command(&bin, owner, "initdb");
        initdb.args(["-D".as_ref(), primary_data.as_os_str()]).args(["-U", "postgres", "-A", "trust", "-E", "UTF8"]);
        initdb.args(["--locale=C", "--no-sync"]);
        run(initdb, "initdb");
        std::fs::write(
            primary_data.join("pg_hba.conf"),
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        let primary_port = free_port();
        // In postgresql.auto.conf, not on the command line: the standbys' base backups copy it, so a promoted
        // standby asks the same of its own standbys at once.
        let names = sync_names(replication, standbys);
        append_conf(&primary_data, owner, &format!("synchronous_standby_names = '{names}'\n"));
        let primary = Proc::spawn(
            postgres_cmd(&bin, owner, &primary_data, primary_port, &[]),
            "database system is ready to accept connections",
            "the primary PostgreSQL",
            false,
        );
        // The primary's relay is unused until it is rebuilt as a standby ([`PostgresHa::rejoin`]).
        let link = Some(Relay::start(free_port(), primary_port));
        let mut servers = vec![Server { port: primary_port, data: primary_data, proc: primary, link }];
        for i in 1..=standbys {
            let data = dir.path().join(format!("standby{i}"));
            let (port, link) = (free_port(), Relay::start(free_port(), primary_port));
            let proc = standby(&bin, owner, &data, i, (port, primary_port, link.port));
            servers.push(Server { port, data, proc, link: Some(link) });
        }
        let standby_ports: Vec<u16> = servers[1..].iter().map(|s| s.port).collect();
        let ha = Self {
            primary_port,
            standby_port: standby_ports[0],
            standby_ports,
            servers,
            primary_now: primary_port,
            bin,
            owner,
            _dir: dir,
        };
        wait_until("every standby streaming from the primary", || {
            let sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'";
            (ha.psql(ha.primary_port, sql)? == standbys.to_string()).then_some(())
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

    fn server(&mut self, port: u16) -> &mut Server {
        self.servers.iter_mut().find(|s| s.port == port).unwrap_or_else(|| panic!("no server of this set on {port}"))
    }

    /// The port of the primary now: as started, or the standby last promoted.
    pub fn primary_now(&self) -> u16 {
        self.primary_now
    }

    /// Kills the primary as a crash of its machine would: SIGKILL to the postmaster and every backend at once.
    pub fn kill_primary(&mut self) {
        let port = self.primary_now;
        self.server(port).proc.kill9();
    }

    /// Promotes the first standby (`pg_ctl promote -w`) and waits until it accepts writes.
    ///
    /// # Panics
    /// When `pg_ctl` fails or the standby is still in recovery after a minute.
    pub fn promote(&mut self) {
        self.promote_standby(self.standby_port);
    }

    /// Promotes the standby on `port` (`pg_ctl promote -w`), whether the primary runs or not, and waits until
    /// it accepts writes; it is the primary now ([`PostgresHa::primary_now`]).
    ///
    /// # Panics
    /// When no standby has that port, `pg_ctl` fails or the standby is still in recovery after a minute.
    pub fn promote_standby(&mut self, port: u16) {
        let data = self.server(port).data.clone();
        let out = pg_command(&self.bin, self.owner, "pg_ctl")
            .args(["promote", "-w", "-D"])
            .arg(&data)
            .output()
            .expect("run pg_ctl");
        assert!(out.status.success(), "pg_ctl promote failed: {}", String::from_utf8_lossy(&out.stderr));
        wait_until("the promoted standby accepting writes", || {
            (self.psql(port, "SELECT pg_is_in_recovery()")? == "f").then_some(())
        });
        self.primary_now = port;
    }

    /// A switchover as an operator makes it: the standby on `port` promoted while the old primary still runs
    /// and takes commits, the old primary stopped `grace` later (fast shutdown: clients disconnected, a
    /// shutdown checkpoint), then every other server rebuilt as a standby of the new primary
    /// ([`PostgresHa::rejoin`]). Returns the old primary's port.
    ///
    /// # Panics
    /// As [`PostgresHa::promote_standby`] and [`PostgresHa::rejoin`].
    pub fn switchover(&mut self, port: u16, grace: Duration) -> u16 {
        let old = self.primary_now;
        self.promote_standby(port);
        // The operator's delay before fencing the old primary; the window in which it takes commits alone.
        std::thread::sleep(grace);
        self.stop_server(old);
        self.rejoin();
        old
    }

    /// Makes every server but the primary now a standby of it again, as an operator rebuilding the set after
    /// a failover: each stopped (fast shutdown) if it runs, its data replaced by a base backup of the primary
    /// (a standby that received WAL the new primary never had cannot follow it, nor can the old primary), and
    /// started streaming through its relay, pointed at the primary and healed. Waits until every one streams,
    /// so that `ANY n` commits can complete again.
    ///
    /// # Panics
    /// When a base backup or a start fails, or they do not all stream within four minutes.
    pub fn rejoin(&mut self) {
        let primary = self.primary_now;
        for i in 0..self.servers.len() {
            let s = &mut self.servers[i];
            if s.port == primary {
                continue;
            }
            s.proc.stop("-INT", Duration::from_secs(10));
            let _ = std::fs::remove_dir_all(&s.data);
            let link = s.link.as_ref().map_or(primary, |l| {
                l.heal();
                l.retarget(primary);
                l.port
            });
            s.proc = standby(&self.bin, self.owner, &s.data, i, (s.port, primary, link));
        }
        let n = (self.servers.len() - 1).to_string();
        let mut seen = String::new();
        let streaming = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            super::wait_within("every other server streaming from the new primary", super::REJOIN_TIMEOUT, || {
                let sql = "SELECT string_agg(application_name || ':' || state, ',') FROM pg_stat_replication";
                seen = self.psql(primary, sql).unwrap_or_default();
                (seen.matches(":streaming").count().to_string() == n).then_some(())
            })
        }));
        // Say what the primary saw, so a rebuild that never streams can be told from a slow one.
        assert!(streaming.is_ok(), "not every other server streams from the new primary: it lists [{seen}]");
    }

    /// Stops the server on `port` with a fast shutdown (SIGINT; SIGKILL after 10 s).
    ///
    /// # Panics
    /// When no server of this set has that port.
    pub fn stop_server(&mut self, port: u16) {
        self.server(port).proc.stop("-INT", Duration::from_secs(10));
    }

    /// Cuts every standby but `keep` (their ports) off from the primary: their links refuse and close. The
    /// clients (idem, through the multi-host URL) still reach every server. [`PostgresHa::heal`] restores them.
    pub fn partition(&self, keep: &[u16]) {
        for s in &self.servers {
            if let (Some(link), false) = (&s.link, keep.contains(&s.port) || s.port == self.primary_now) {
                link.cut(Cut::All);
            }
        }
    }

    /// Restores every link a [`PostgresHa::partition`] cut.
    pub fn heal(&self) {
        for s in &self.servers {
            if let Some(link) = &s.link {
                link.heal();
            }
        }
    }

    /// `postgres://postgres@127.0.0.1:PRIMARY,127.0.0.1:STANDBY…/postgres?target_session_attrs=read-write`
    /// and `&query` when not empty: the primary as started first, then the standbys.
    pub fn url(&self, query: &str) -> String {
        let q = if query.is_empty() { String::new() } else { format!("&{query}") };
        let hosts: Vec<String> = self.servers.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        format!("postgres://postgres@{}/postgres?target_session_attrs=read-write{q}", hosts.join(","))
    }

    /// Freezes the primary (SIGSTOP to the postmaster and its backends), as a hung machine or a network that
    /// drops packets looks to a client: connections are accepted by the kernel but never answered.
    /// [`PostgresHa::thaw_primary`] continues it; drop kills it frozen or not.
    pub fn freeze_primary(&mut self) {
        self.freeze(self.primary_now);
    }

    /// Continues a primary frozen by [`PostgresHa::freeze_primary`].
    pub fn thaw_primary(&mut self) {
        self.thaw(self.primary_now);
    }

    /// Freezes the server on `port` (SIGSTOP to its process group): a standby lagging or hung.
    ///
    /// # Panics
    /// When no server of this set has that port.
    pub fn freeze(&mut self, port: u16) {
        self.server(port).proc.signal("-STOP");
    }

    /// Continues the server on `port` after [`PostgresHa::freeze`].
    ///
    /// # Panics
    /// When no server of this set has that port.
    pub fn thaw(&mut self, port: u16) {
        self.server(port).proc.signal("-CONT");
    }

    /// Whether the primary still runs (it does until [`PostgresHa::kill_primary`]).
    pub fn primary_alive(&self) -> bool {
        self.servers.iter().any(|s| s.port == self.primary_now && s.proc.alive())
    }
}

/// Appends `line` to `data`'s postgresql.auto.conf (a later line wins over an earlier one).
fn append_conf(data: &Path, owner: Option<(u32, u32)>, line: &str) {
    let file = data.join("postgresql.auto.conf");
    let mut auto = std::fs::read_to_string(&file).unwrap_or_default();
    auto.push_str(line);
    std::fs::write(&file, auto).unwrap();
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&file, Some(uid), Some(gid)).unwrap();
    }
}

/// Server `i` (named `s{i}`) made a standby in `data` (which must not exist): a base backup of the primary on
/// `primary`, started on `port` streaming from it through the relay on `link`. `ports` is (port, primary,
/// link).
fn standby(bin: &Path, owner: Option<(u32, u32)>, data: &Path, i: usize, ports: (u16, u16, u16)) -> Proc {
    let (port, primary, link) = ports;
    let mut basebackup = pg_command(bin, owner, "pg_basebackup");
    basebackup.args(["-h", "127.0.0.1", "-p", &primary.to_string(), "-U", "postgres", "-D"]).arg(data).args([
        "-X",
        "stream",
        "--checkpoint=fast",
        "--no-sync",
    ]);
    run(basebackup, "pg_basebackup");
    // What `pg_basebackup -R` writes, with the standby's name (for synchronous_standby_names) and its relay;
    // after the primary's own primary_conninfo when it was a standby once, so this one wins.
    let conninfo = format!("host=127.0.0.1 port={link} user=postgres application_name=s{i}");
    append_conf(data, owner, &format!("primary_conninfo = '{conninfo}'\n"));
    std::fs::write(data.join("standby.signal"), "").unwrap();
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(data.join("standby.signal"), Some(uid), Some(gid)).unwrap();
    }
    Proc::spawn(
        postgres_cmd(bin, owner, data, port, &[]),
        "ready to accept read-only connections",
        "a standby PostgreSQL",
        false,
    )
}

impl Drop for PostgresHa {
    fn drop(&mut self) {
        for s in &mut self.servers {
            s.proc.quit();
        }
    }
}
