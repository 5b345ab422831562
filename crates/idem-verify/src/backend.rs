//! The store under test: an SQLite directory (on a small tmpfs where the machine allows, for the disk-full
//! fault), or a throw-away PostgreSQL or Redis server the harness starts on ports of its own (from
//! `idem-testkit`) behind a [`FaultProxy`], so it can restart the server and break the link, or one of the
//! test kit's highly available setups (a PostgreSQL primary with a streaming standby, a Redis primary and
//! replica under three Sentinels, a six-node Redis Cluster), reached directly by their multi-host URLs, whose
//! fault is a failover ([`StoreEnv::failover`]). The machine's own servers are never touched.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::faultproxy::{FaultProxy, local};
use crate::{Backend, Error};

/// The running store of one run.
#[derive(Debug)]
pub struct StoreEnv {
    /// Which backend.
    pub backend: Backend,
    server: Server,
    /// The proxy between idem and a PostgreSQL or Redis server.
    pub link: Option<FaultProxy>,
    /// The SQLite directory (on the tmpfs when [`StoreEnv::tmpfs`]).
    pub dir: PathBuf,
    /// Whether `dir` is a size-limited tmpfs the harness mounted (the disk-full fault needs one).
    pub tmpfs: bool,
    /// The durable setting of a highly available backend (see [`setting`]).
    pub durable: bool,
    _scratch: tempfile::TempDir,
}

#[derive(Debug)]
enum Server {
    None,
    Postgres(Box<idem_testkit::Postgres>),
    Redis(Box<idem_testkit::Redis>),
    PostgresHa(Box<idem_testkit::PostgresHa>),
    RedisSentinel(Box<idem_testkit::RedisSentinel>),
    RedisCluster(Box<idem_testkit::RedisCluster>),
}

/// The replication setting of a highly available `backend`, as the report names it: with `durable`,
/// synchronous replication (PostgreSQL: `synchronous_standby_names = '*'`, a commit acknowledged once the standby
/// flushed it) or `wait_replicas=1` (Redis: each write acknowledged once a replica has it); without, the
/// asynchronous defaults. Empty for the other backends.
pub fn setting(backend: Backend, durable: bool) -> &'static str {
    match (backend, durable) {
        (Backend::PostgresHa, true) => "synchronous replication",
        (Backend::PostgresHa, false) => "asynchronous replication",
        (Backend::RedisSentinel | Backend::RedisCluster, true) => "wait_replicas=1",
        (Backend::RedisSentinel | Backend::RedisCluster, false) => "no wait_replicas",
        _ => "",
    }
}

/// Runs a test-kit step that panics when it fails (the test kit's way) on a blocking thread; its panic message
/// as the error.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "a panic".into()),
        Err(e) => e.to_string(),
    })
}

/// Size of the SQLite tmpfs: room for the store and its WAL, small enough to fill in a moment.
const TMPFS_SIZE: &str = "64m";

impl StoreEnv {
    /// Starts the store for `backend`. For SQLite, `want_tmpfs` mounts a 64 MiB tmpfs for the data (as root;
    /// when the mount is refused the data stays on the ordinary disk and the disk-full fault is left out).
    ///
    /// # Errors
    /// [`Error::Setup`] when the PostgreSQL or Redis programs are missing, a port cannot be bound, or a highly
    /// available setup does not come up (with the test kit's message: a standby that does not stream, Sentinels
    /// that do not see each other, a Cluster that does not reach `cluster_state:ok` within a minute).
    ///
    /// The highly available backends take `durable` (see [`setting`]); the others ignore it.
    pub async fn start(backend: Backend, want_tmpfs: bool, durable: bool) -> Result<Self, Error> {
        let scratch = tempfile::tempdir().map_err(|e| Error::io("making a scratch directory", e))?;
        let dir = scratch.path().join("data");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("making the data directory", e))?;
        let mut env =
            Self { backend, server: Server::None, link: None, dir, tmpfs: false, durable: false, _scratch: scratch };
        match backend {
            Backend::Sqlite => env.tmpfs = want_tmpfs && mount_tmpfs(&env.dir),
            Backend::Postgres => {
                let pg = tokio::task::spawn_blocking(idem_testkit::Postgres::start)
                    .await
                    .map_err(|e| Error::Setup(e.to_string()))?
                    .ok_or_else(|| Error::Setup("no PostgreSQL server programs to start one with".into()))?;
                env.link = Some(FaultProxy::start(local(pg.port)).await.map_err(|e| Error::io("proxy", e))?);
                env.server = Server::Postgres(Box::new(pg));
            }
            Backend::Redis => {
                let redis = tokio::task::spawn_blocking(|| idem_testkit::Redis::start_with(true))
                    .await
                    .map_err(|e| Error::Setup(e.to_string()))?
                    .ok_or_else(|| Error::Setup("no redis-server program to start one with".into()))?;
                env.link = Some(FaultProxy::start(local(redis.port)).await.map_err(|e| Error::io("proxy", e))?);
                env.server = Server::Redis(Box::new(redis));
            }
            Backend::PostgresHa => {
                let replication = if durable {
                    idem_testkit::Replication::Synchronous
                } else {
                    idem_testkit::Replication::Asynchronous
                };
                let ha = blocking(move || idem_testkit::PostgresHa::start(replication))
                    .await
                    .map_err(Error::Setup)?
                    .ok_or_else(|| Error::Setup("no PostgreSQL server programs to start one with".into()))?;
                env.server = Server::PostgresHa(Box::new(ha));
            }
            Backend::RedisSentinel => {
                let set = blocking(idem_testkit::RedisSentinel::start)
                    .await
                    .map_err(Error::Setup)?
                    .ok_or_else(|| Error::Setup("no redis-server program to start one with".into()))?;
                env.server = Server::RedisSentinel(Box::new(set));
            }
            Backend::RedisCluster => {
                let cluster = blocking(idem_testkit::RedisCluster::start)
                    .await
                    .map_err(Error::Setup)?
                    .ok_or_else(|| Error::Setup("no redis-server program to start one with".into()))?;
                env.server = Server::RedisCluster(Box::new(cluster));
            }
        }
        env.durable = durable;
        Ok(env)
    }

    /// The store URL idem gets: an SQLite file `name.db` in the data directory, or the server through the proxy.
    pub fn url(&self, name: &str) -> String {
        let port = self.link.as_ref().map(|l| l.port).unwrap_or_default();
        match &self.server {
            Server::None => format!("sqlite:{}", self.dir.join(format!("{name}.db")).display()),
            Server::Postgres(_) => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Server::Redis(r) => format!("rediss://127.0.0.1:{port}?cacert={}", r.pki.ca.display()),
            // Both hosts, the primary first: after the failover idem finds the promoted standby by itself.
            Server::PostgresHa(ha) => ha.url("connect_timeout=2"),
            Server::RedisSentinel(set) => set.url(if self.durable { "wait_replicas=1" } else { "" }),
            Server::RedisCluster(cluster) => cluster.url(if self.durable { "wait_replicas=1" } else { "" }),
        }
    }

    /// The failover of a highly available backend, as a machine's crash and its supervisor would make it; what
    /// was done with its timings, or what failed. PostgreSQL: the primary killed (SIGKILL to the postmaster
    /// and every backend), the standby promoted (`pg_ctl promote`) 1 s later (a failure detector's delay).
    /// Sentinel: the master killed (SIGKILL), the Sentinels' election awaited, then the old master started
    /// again, empty, and synced as a replica of the new one (so `WAIT 1` can be met again). Cluster: the master
    /// serving `tag`'s slot (the hash tag of the workload's keys, e.g. `{idem:}`) killed, its replica's
    /// promotion awaited, the old master restarted as a replica. `None` on the other backends. Once per run: a
    /// second failover would kill the replica the first one restarted.
    pub async fn failover(&mut self, tag: &str) -> Option<Result<String, String>> {
        if !self.backend.is_ha() {
            return None;
        }
        let server = std::mem::replace(&mut self.server, Server::None);
        let tag = tag.to_owned();
        let done = blocking(move || {
            let mut server = server;
            let t0 = std::time::Instant::now();
            let ms = |t: std::time::Instant| t.elapsed().as_millis();
            let detail = match &mut server {
                Server::PostgresHa(ha) => {
                    ha.kill_primary();
                    std::thread::sleep(Duration::from_secs(1));
                    ha.promote();
                    format!("primary killed; standby promoted and writable {} ms later", ms(t0))
                }
                Server::RedisSentinel(set) => {
                    set.kill_primary();
                    set.wait_failover();
                    let elected = ms(t0);
                    set.restart_old_primary();
                    format!("master killed; replica elected master {elected} ms later; old master in sync as a replica at {} ms", ms(t0))
                }
                Server::RedisCluster(cluster) => {
                    let master = cluster.master_of(&tag);
                    cluster.kill(master);
                    cluster.wait_failover(&tag, master);
                    let elected = ms(t0);
                    cluster.restart(master);
                    format!("master {master} of {tag} killed; replica promoted {elected} ms later; old master in sync as a replica at {} ms", ms(t0))
                }
                _ => String::new(),
            };
            (server, detail)
        })
        .await;
        match done {
            Ok((server, detail)) => {
                self.server = server;
                Some(Ok(detail))
            }
            // The test kit gave up (and its servers went with the panic): the run goes on without a store and
            // its checker reports what that does.
            Err(why) => Some(Err(why)),
        }
    }

    /// Whether the store is a server the harness may restart (a highly available setup is not: its fault is a
    /// failover).
    pub fn restartable(&self) -> bool {
        matches!(self.server, Server::Postgres(_) | Server::Redis(_))
    }

    /// Restarts the PostgreSQL or Redis server as a crash would (SIGQUIT / SIGKILL), same port and data.
    pub async fn restart(&mut self) {
        let server = std::mem::replace(&mut self.server, Server::None);
        self.server = tokio::task::spawn_blocking(move || {
            let mut server = server;
            match &mut server {
                Server::Postgres(pg) => pg.restart(),
                Server::Redis(r) => r.restart(),
                _ => {}
            }
            server
        })
        .await
        .unwrap_or(Server::None);
    }

    /// Makes the store unavailable for `down`, then heals it; what was done, or `None` when there was nothing
    /// to act on (no SQLite ledger file yet). PostgreSQL: stopped (SIGQUIT, immediate shutdown) and started
    /// again on the same port and data. Redis: killed (SIGKILL; its `appendfsync always` file keeps every
    /// acknowledged write) and started again. SQLite: every `*.db` file in the data directory locked by an
    /// exclusive transaction another connection holds (writers wait out the busy timeout, then are told the
    /// store is busy), committed empty after `down`.
    pub async fn outage(&mut self, down: Duration) -> Option<String> {
        let ms = down.as_millis();
        let server = std::mem::replace(&mut self.server, Server::None);
        let (server, detail) = tokio::task::spawn_blocking(move || {
            let mut server = server;
            let detail = match &mut server {
                Server::Postgres(pg) => {
                    pg.stop();
                    std::thread::sleep(down);
                    pg.start_again();
                    Some(format!("stopped {ms} ms"))
                }
                Server::Redis(r) => {
                    r.kill();
                    std::thread::sleep(down);
                    r.start_again();
                    Some(format!("killed, started again {ms} ms later"))
                }
                _ => None,
            };
            (server, detail)
        })
        .await
        .unwrap_or((Server::None, None));
        self.server = server;
        if detail.is_some() {
            return detail;
        }
        let dbs: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "db"))
            .collect();
        if dbs.is_empty() {
            return None;
        }
        let locked = tokio::task::spawn_blocking(move || lock_sqlite(&dbs, down)).await.ok()?;
        match locked {
            Ok(n) => Some(format!("{n} file(s) locked {ms} ms")),
            Err(e) => {
                eprintln!("idem-verify: cannot lock the SQLite ledger: {e}");
                None
            }
        }
    }

    /// Fills the SQLite tmpfs to the last byte with a file of zeros; returns its path (remove it to free the
    /// space).
    ///
    /// # Errors
    /// When there is no tmpfs or the file cannot be written.
    pub fn fill_disk(&self) -> Result<PathBuf, Error> {
        if !self.tmpfs {
            return Err(Error::Setup("no tmpfs to fill".into()));
        }
        let filler = self.dir.join("filler");
        // dd stops at ENOSPC, which is the point; its exit status says so and is not an error here.
        let _ = Command::new("dd")
            .args(["if=/dev/zero", &format!("of={}", filler.display()), "bs=64k"])
            .stderr(std::process::Stdio::null())
            .status();
        // What dd's blocks left over, byte by byte would take long; one more small write usually finds it.
        let _ = Command::new("dd")
            .args(["if=/dev/zero", &format!("of={}", filler.display()), "bs=512", "oflag=append", "conv=notrunc"])
            .stderr(std::process::Stdio::null())
            .status();
        Ok(filler)
    }
}

impl Drop for StoreEnv {
    fn drop(&mut self) {
        if self.tmpfs {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Holds an exclusive transaction on each of `dbs` (an existing database; nothing is created) for `down`, then
/// commits it with nothing written. Waits up to 10 s for each lock, as idem's own connections do.
fn lock_sqlite(dbs: &[PathBuf], down: Duration) -> Result<usize, rusqlite::Error> {
    use rusqlite::OpenFlags;
    let mut held = Vec::new();
    for db in dbs {
        let conn = rusqlite::Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.execute_batch("BEGIN EXCLUSIVE")?;
        held.push(conn);
    }
    std::thread::sleep(down);
    for conn in &held {
        conn.execute_batch("COMMIT")?;
    }
    Ok(held.len())
}

/// Mounts a tmpfs of [`TMPFS_SIZE`] on `dir`; false when the machine refuses (not root, no CAP_SYS_ADMIN).
fn mount_tmpfs(dir: &Path) -> bool {
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={TMPFS_SIZE}"), "tmpfs"])
        .arg(dir)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "idem-verify: cannot mount a tmpfs on {} (needs root): the disk-full fault is left out",
            dir.display()
        );
    }
    ok
}
