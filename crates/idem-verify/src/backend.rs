//! The store under test: an SQLite directory (on a small tmpfs where the machine allows, for the disk-full
//! fault), or a throw-away PostgreSQL or Redis server the harness starts on ports of its own (from
//! `idem-testkit`) behind a [`FaultProxy`], so it can restart the server and break the link, or one of the
//! test kit's highly available setups (a PostgreSQL primary with two streaming standbys, a Redis primary and
//! two replicas under three Sentinels, a nine-node Redis Cluster), reached directly by their multi-host URLs, whose
//! faults are a failover, a switchover, a lagging or stopped replica and a partition ([`StoreEnv::ha_fault`]).
//! The machine's own servers are never touched.

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
    /// The setting without `durable`.
    pub lax: crate::Lax,
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

/// The replication setting of a highly available `backend` (a primary and two replicas or standbys), as the
/// report names it: with `durable`, every standby synchronous (PostgreSQL: `synchronous_standby_names = 'ANY 2
/// (s0, s1, s2)'` and idem's `synchronous_standbys=all`) or `wait_replicas=all` (Redis: each write
/// acknowledged once every replica has it); without, `lax`: one standby or replica (`'*'`, FIRST 1;
/// `wait_replicas=1`) or none (asynchronous). Empty for the other backends.
pub fn setting(backend: Backend, durable: bool, lax: crate::Lax) -> &'static str {
    use crate::Lax;
    match (backend, durable, lax) {
        (Backend::PostgresHa, true, _) => "synchronous_standbys=all (ANY 2)",
        (Backend::PostgresHa, false, Lax::One) => "synchronous_standby_names='*' (FIRST 1)",
        (Backend::PostgresHa, false, Lax::None) => "asynchronous replication",
        (Backend::RedisSentinel | Backend::RedisCluster, true, _) => "wait_replicas=all",
        (Backend::RedisSentinel | Backend::RedisCluster, false, Lax::One) => "wait_replicas=1",
        (Backend::RedisSentinel | Backend::RedisCluster, false, Lax::None) => "no wait_replicas",
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
    pub async fn start(backend: Backend, want_tmpfs: bool, durable: bool, lax: crate::Lax) -> Result<Self, Error> {
        let scratch = tempfile::tempdir().map_err(|e| Error::io("making a scratch directory", e))?;
        let dir = scratch.path().join("data");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("making the data directory", e))?;
        let mut env = Self {
            backend,
            server: Server::None,
            link: None,
            dir,
            tmpfs: false,
            durable: false,
            lax,
            _scratch: scratch,
        };
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
                let replication = match (durable, lax) {
                    (true, _) => idem_testkit::Replication::AllStandbys,
                    (false, crate::Lax::One) => idem_testkit::Replication::Synchronous,
                    (false, crate::Lax::None) => idem_testkit::Replication::Asynchronous,
                };
                let ha = blocking(move || idem_testkit::PostgresHa::start_with(replication, 2))
                    .await
                    .map_err(Error::Setup)?
                    .ok_or_else(|| Error::Setup("no PostgreSQL server programs to start one with".into()))?;
                env.server = Server::PostgresHa(Box::new(ha));
            }
            Backend::RedisSentinel => {
                let set = blocking(|| idem_testkit::RedisSentinel::start_with_replicas(2))
                    .await
                    .map_err(Error::Setup)?
                    .ok_or_else(|| Error::Setup("no redis-server program to start one with".into()))?;
                env.server = Server::RedisSentinel(Box::new(set));
            }
            Backend::RedisCluster => {
                let cluster = blocking(|| idem_testkit::RedisCluster::start_with_replicas(2))
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
            Server::PostgresHa(ha) => {
                ha.url(if self.durable { "connect_timeout=2&synchronous_standbys=all" } else { "connect_timeout=2" })
            }
            Server::RedisSentinel(set) => set.url(self.redis_wait()),
            Server::RedisCluster(cluster) => cluster.url(self.redis_wait()),
        }
    }

    /// The `wait_replicas` of the Redis URL for the setting.
    fn redis_wait(&self) -> &'static str {
        match (self.durable, self.lax) {
            (true, _) => "wait_replicas=all",
            (false, crate::Lax::One) => "wait_replicas=1",
            (false, crate::Lax::None) => "",
        }
    }

    /// A fault of a highly available backend ([`crate::hafaults`]): what was done with its timings, or what
    /// failed. On a Cluster it acts on the master serving `tag`'s slot (the hash tag of the workload's keys,
    /// e.g. `{idem:}`). `None` on the other backends.
    pub async fn ha_fault(&mut self, tag: &str, plan: crate::hafaults::Plan) -> Option<Result<String, String>> {
        if !self.backend.is_ha() {
            return None;
        }
        let server = std::mem::replace(&mut self.server, Server::None);
        let tag = tag.to_owned();
        let done = blocking(move || {
            let mut server = server;
            let detail = match &mut server {
                Server::PostgresHa(ha) => Some(crate::hafaults::postgres(ha, plan)),
                Server::RedisSentinel(set) => Some(crate::hafaults::sentinel(set, plan)),
                Server::RedisCluster(cluster) => crate::hafaults::cluster(cluster, &tag, plan),
                _ => None,
            };
            (server, detail)
        })
        .await;
        match done {
            Ok((server, detail)) => {
                self.server = server;
                detail.map(Ok)
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
