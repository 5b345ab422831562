//! Throw-away highly available clusters on 127.0.0.1 for failover tests: a PostgreSQL primary with one or two
//! streaming standbys ([`PostgresHa`]), a Redis primary with one or two replicas watched by three Sentinels
//! ([`RedisSentinel`]), and a Redis Cluster of three masters with one or two replicas each ([`RedisCluster`]).
//! Besides crashes, they make what an operator or a network does to a live primary: a switchover with the old
//! primary still running, a replica frozen (SIGSTOP) or stopped, and a partition of the old primary from its
//! replicas and Sentinels, or a Cluster master from its replicas and the other masters, while clients still
//! reach it (through the kit's relays, [`partition`]). Every
//! process is stopped when its value is dropped.

mod cluster;
pub mod partition;
mod postgres;
mod proc;
mod sentinel;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use cluster::{ClusterFailover, RedisCluster};
pub use postgres::{PostgresHa, Replication};
pub use sentinel::{RedisSentinel, SENTINEL_MASTER};

use proc::Proc;

use crate::missing;

/// How long a failover or a replication catch-up may take before a test gives up.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long rebuilding every other server as a standby may take: a base backup each, taken while the
/// workload writes, then a catch-up, on a machine whose two cores CI shares with other tests (it once took
/// more than a minute there, 2026-12-06). Nothing checked depends on how fast the harness rebuilds.
const REJOIN_TIMEOUT: Duration = Duration::from_secs(240);

/// Polls `f` every 100 ms until it returns `Some`, panicking with `what` after [`FAILOVER_TIMEOUT`].
pub(crate) fn wait_until<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_within(what, FAILOVER_TIMEOUT, f)
}

/// Polls `f` every 100 ms until it returns `Some`, panicking with `what` after `limit`.
pub(crate) fn wait_within<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `redis-server` program: `IDEM_TEST_REDIS_SERVER`, else from the `PATH`; `None` (printed, or a panic under
/// `IDEM_TEST_REQUIRE_BACKENDS`) when it cannot run.
pub(crate) fn redis_program() -> Option<PathBuf> {
    let program = std::env::var_os("IDEM_TEST_REDIS_SERVER").map(PathBuf::from).unwrap_or("redis-server".into());
    if Command::new(&program).arg("--version").output().is_err() {
        missing("no redis-server program (set IDEM_TEST_REDIS_SERVER)");
        return None;
    }
    Some(program)
}

/// `redis-cli`, beside `redis-server` (the same package).
pub(crate) fn redis_cli() -> Option<PathBuf> {
    let cli = std::env::var_os("IDEM_TEST_REDIS_CLI").map(PathBuf::from).unwrap_or("redis-cli".into());
    if Command::new(&cli).arg("--version").output().is_err() {
        missing("no redis-cli program (set IDEM_TEST_REDIS_CLI)");
        return None;
    }
    Some(cli)
}

/// A plain `redis-server` on `port` of 127.0.0.1 with `args`, nothing saved unless `args` says so.
pub(crate) fn redis_node(program: &Path, port: u16, dir: &Path, args: &[&str]) -> Proc {
    let mut cmd = Command::new(program);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(args);
    Proc::spawn(cmd, "Ready to accept connections", "redis-server", true)
}

/// Runs `redis-cli -p PORT ARGS…`, its output trimmed, `None` when it fails.
pub(crate) fn cli(program: &Path, port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new(program)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
