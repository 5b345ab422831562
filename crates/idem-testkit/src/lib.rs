//! Test support for TLS to the backends: a private CA made at test time ([`Pki`]), and throw-away servers
//! that speak TLS with its certificate: a PostgreSQL cluster ([`Postgres`], `initdb` + `postgres` from the
//! machine's packages, in a temporary directory, on a free port) and a Redis server ([`Redis`],
//! `redis-server --tls-port`). For failover tests, highly available clusters: [`PostgresHa`] (a primary and a
//! streaming standby), [`RedisSentinel`] (a primary, a replica, three Sentinels) and [`RedisCluster`] (six
//! nodes). The machine's own servers are never touched.
//!
//! A server is stopped when its value is dropped, also when a test panics; [`shared`] lets the tests of one
//! binary share a server while any of them runs. When the programs are missing, `start` prints why and
//! returns `None`, unless `IDEM_TEST_REQUIRE_BACKENDS` is set (CI), where it panics: a TLS test must not skip
//! there.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test support reports failures by panicking

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub mod browser;
mod examples;
mod ha;

pub use examples::example;

pub use ha::partition::{Cut, Relay};
pub use ha::{ClusterFailover, PostgresHa, RedisCluster, RedisSentinel, Replication, SENTINEL_MASTER};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};

/// How long a server may take to say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Certificates made for one test run, as PEM files in a temporary directory: a CA, a server certificate it
/// signed for `localhost` and `127.0.0.1` (with its key), an expired one for the same names, and an unrelated
/// second CA.
#[derive(Debug)]
pub struct Pki {
    _dir: tempfile::TempDir,
    /// The CA that signed the server certificate.
    pub ca: PathBuf,
    /// A CA that signed nothing here: trusting only it must fail verification.
    pub other_ca: PathBuf,
    /// The server's certificate (PEM), names `localhost` and `127.0.0.1`.
    pub cert: PathBuf,
    /// The server certificate's private key (PEM, PKCS#8).
    pub key: PathBuf,
    /// A server certificate signed by `ca` for the same names that expired on 2001-01-01 (PEM).
    pub expired_cert: PathBuf,
    /// The expired certificate's private key (PEM, PKCS#8).
    pub expired_key: PathBuf,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

impl Pki {
    /// Makes the CA, the server certificate and the other CA.
    ///
    /// # Panics
    /// When the temporary directory cannot be written.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca_issuer = ca("idem test CA");
        let other = ca("idem test other CA");
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &ca_issuer).unwrap();
        let expired_key = KeyPair::generate().unwrap();
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        let expired = params.signed_by(&expired_key, &ca_issuer).unwrap();
        let write = |name: &str, pem: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        Self {
            ca: write("ca.pem", ca_issuer.pem()),
            other_ca: write("other-ca.pem", other.pem()),
            cert: write("server.pem", cert.pem()),
            key: write("server.key", key.serialize_pem()),
            expired_cert: write("expired.pem", expired.pem()),
            expired_key: write("expired.key", expired_key.serialize_pem()),
            _dir: dir,
        }
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

/// One server per test binary while any test holds it: the first caller starts it, the last drop stops it.
/// `None` when `start` returned `None` (the programs are missing).
pub fn shared<T>(slot: &'static Mutex<Weak<T>>, start: impl FnOnce() -> Option<T>) -> Option<Arc<T>> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(running) = slot.upgrade() {
        return Some(running);
    }
    let server = Arc::new(start()?);
    *slot = Arc::downgrade(&server);
    Some(server)
}

/// Whether a missing server program is a failure (CI) rather than a skip.
fn required() -> bool {
    std::env::var_os("IDEM_TEST_REQUIRE_BACKENDS").is_some()
}

/// Says why a server cannot be started: a skip, or a failure under `IDEM_TEST_REQUIRE_BACKENDS`.
pub(crate) fn missing(what: &str) {
    assert!(!required(), "{what}, and IDEM_TEST_REQUIRE_BACKENDS is set");
    eprintln!("skipped: {what}");
}

/// A port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Reads `out` on a thread of its own until the end (a server blocks when its log pipe is full), telling
/// when a line contains `ready`; `Err` with the log so far when the server exits or takes too long.
pub(crate) fn wait_for_line(out: impl Read + Send + 'static, ready: &'static str) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut log = String::new();
        let mut told = false;
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if !told {
                log.push_str(&line);
                log.push('\n');
                if line.contains(ready) {
                    told = tx.send(Ok(())).is_ok();
                }
            }
        }
        if !told {
            let _ = tx.send(Err(log));
        }
    });
    rx.recv_timeout(START_TIMEOUT).unwrap_or_else(|_| Err(format!("not ready within {START_TIMEOUT:?}")))
}

/// The uid and gid of `user` from /etc/passwd.
pub(crate) fn user_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&user) && f.len() > 3).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

pub(crate) fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

/// A throw-away PostgreSQL cluster with `ssl=on`, its certificate from a [`Pki`], on a free port of
/// 127.0.0.1, in a temporary directory; `trust` authentication for user `postgres` over TLS and plain TCP.
/// Stopped (immediate shutdown) on drop.
#[derive(Debug)]
pub struct Postgres {
    /// The port it listens on (127.0.0.1 only).
    pub port: u16,
    /// The certificates it serves.
    pub pki: Pki,
    child: Child,
    bin: PathBuf,
    owner: Option<(u32, u32)>,
    data: PathBuf,
    _dir: tempfile::TempDir,
}

/// The PostgreSQL programs: `IDEM_TEST_PG_BIN`, else the newest /usr/lib/postgresql/N/bin with `initdb`.
pub(crate) fn pg_bin() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("IDEM_TEST_PG_BIN") {
        return Some(PathBuf::from(dir)).filter(|bin| bin.join("initdb").exists());
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("initdb").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

impl Postgres {
    /// Runs `initdb` and starts the server, waiting until it accepts connections.
    ///
    /// `None` (with a printed reason) when the programs are missing and `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When the programs are missing under `IDEM_TEST_REQUIRE_BACKENDS`, or the cluster cannot be made or
    /// started (with its log).
    pub fn start() -> Option<Self> {
        let Some(bin) = pg_bin() else {
            missing("no PostgreSQL server programs (/usr/lib/postgresql/N/bin/initdb; set IDEM_TEST_PG_BIN)");
            return None;
        };
        // PostgreSQL refuses to run as root: as root, run it as the packages' `postgres` user.
        let owner = if is_root() {
            let Some(ids) = user_ids("postgres") else {
                missing("running as root and there is no postgres user to run a cluster as");
                return None;
            };
            Some(ids)
        } else {
            None
        };
        let cmd = |program: &str| pg_command(&bin, owner, program);
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let own = |path: &Path| {
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
            }
        };
        own(dir.path());
        let out = cmd("initdb")
            .args(["-D".as_ref(), data.as_os_str()])
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let pki = Pki::new();
        for (from, to) in [(&pki.cert, "server.crt"), (&pki.key, "server.key")] {
            let to = data.join(to);
            std::fs::copy(from, &to).unwrap();
            own(&to);
            // PostgreSQL refuses a key file others can read.
            std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        }
        std::fs::write(
            data.join("pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        let port = free_port();
        let child = spawn_postgres(&bin, owner, &data, port);
        Some(Self { port, pki, child, bin, owner, data, _dir: dir })
    }

    /// Stops the server as a crash would (SIGQUIT: immediate shutdown, no checkpoint) and starts it again on
    /// the same port and data directory, waiting until it accepts connections. Committed data survives: the
    /// operating system still holds what `fsync=off` did not flush.
    ///
    /// # Panics
    /// When it does not start again (with its log).
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Starts the server again after [`Postgres::stop`], on the same port and data directory, waiting until it
    /// accepts connections.
    ///
    /// # Panics
    /// When it does not start again (with its log).
    pub fn start_again(&mut self) {
        self.child = spawn_postgres(&self.bin, self.owner, &self.data, self.port);
    }

    /// Stops the server as a crash would (SIGQUIT: immediate shutdown, no checkpoint): connections are cut and
    /// new ones refused until [`Postgres::start_again`].
    pub fn stop(&mut self) {
        // SIGQUIT: immediate shutdown, the postmaster ends its backends and exits. Kill as the last resort.
        let sent = Command::new("kill").args(["-QUIT", &self.child.id().to_string()]).status();
        if !sent.is_ok_and(|s| s.success()) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    /// Asks the server for a smart shutdown (SIGTERM) and returns at once: until every session has ended it
    /// refuses new connections with SQLSTATE 57P03 ("the database system is shutting down"), then it exits.
    /// [`Postgres::stop`] then [`Postgres::start_again`] bring it back.
    pub fn begin_smart_shutdown(&self) {
        let sent = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "could not signal the postmaster");
    }

    /// `postgres://postgres@HOST:PORT/postgres?QUERY` (`query` without the `?`; empty for none).
    pub fn url(&self, host: &str, query: &str) -> String {
        let q = if query.is_empty() { String::new() } else { format!("?{query}") };
        format!("postgres://postgres@{host}:{}/postgres{q}", self.port)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `program` of the PostgreSQL installation in `bin`, run as `owner` (uid, gid) when given.
pub(crate) fn pg_command(bin: &Path, owner: Option<(u32, u32)>, program: &str) -> Command {
    let program = bin.join(program);
    match owner {
        Some((uid, gid)) => {
            let mut c = Command::new("setpriv");
            c.args([format!("--reuid={uid}"), format!("--regid={gid}"), "--clear-groups".to_owned()]);
            c.arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// Starts the postmaster on `data` and `port` and waits until it accepts connections.
fn spawn_postgres(bin: &Path, owner: Option<(u32, u32)>, data: &Path, port: u16) -> Child {
    let mut child = pg_command(bin, owner, "postgres")
        .args(["-D".as_ref(), data.as_os_str()])
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="])
        .args(["-c", "ssl=on", "-c", "ssl_cert_file=server.crt", "-c", "ssl_key_file=server.key"])
        // Throw-away data; every conformance check opens a pool of its own.
        .args(["-c", "fsync=off", "-c", "max_connections=300"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run postgres");
    let stderr = child.stderr.take().unwrap();
    if let Err(log) = wait_for_line(stderr, "database system is ready to accept connections") {
        let _ = child.kill();
        panic!("the throw-away PostgreSQL did not start:\n{log}");
    }
    child
}

/// A throw-away `redis-server` with TLS only (`--port 0 --tls-port P`), its certificate from a [`Pki`], no
/// client certificates asked for, nothing saved, on 127.0.0.1 and 127.0.0.2 (an address the certificate
/// does not name, for host-name checks). Killed on drop.
#[derive(Debug)]
pub struct Redis {
    /// The TLS port (on 127.0.0.1 and 127.0.0.2).
    pub port: u16,
    /// The certificates it serves.
    pub pki: Pki,
    child: Child,
    program: PathBuf,
    durable: bool,
    dir: tempfile::TempDir,
}

impl Redis {
    /// Starts the server, waiting until it accepts connections.
    ///
    /// `None` (with a printed reason) when `redis-server` is missing and `IDEM_TEST_REQUIRE_BACKENDS` is unset.
    ///
    /// # Panics
    /// When it is missing under `IDEM_TEST_REQUIRE_BACKENDS`, or does not start (with its log).
    pub fn start() -> Option<Self> {
        Self::start_with(false)
    }

    /// Like [`Redis::start`], but with `durable` the server keeps an append-only file fsynced on every write
    /// (`appendonly yes`, `appendfsync always`), so a [`Redis::restart`] loses no acknowledged write.
    ///
    /// # Panics
    /// As [`Redis::start`].
    pub fn start_with(durable: bool) -> Option<Self> {
        let program = std::env::var_os("IDEM_TEST_REDIS_SERVER").map(PathBuf::from).unwrap_or("redis-server".into());
        if Command::new(&program).arg("--version").output().is_err() {
            missing("no redis-server program (set IDEM_TEST_REDIS_SERVER)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new();
        let port = free_port();
        let child = spawn_redis(&program, &pki, port, dir.path(), durable);
        Some(Self { port, pki, child, program, durable, dir })
    }

    /// Kills the server (SIGKILL, as a crash) and starts it again on the same port and directory, waiting
    /// until it accepts connections. Only a server started `durable` keeps its data.
    ///
    /// # Panics
    /// When it does not start again (with its log).
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// Kills the server (SIGKILL, as a crash): connections are cut and new ones refused until
    /// [`Redis::start_again`].
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again after [`Redis::kill`], on the same port and directory (a `durable` one reloads
    /// its append-only file), waiting until it accepts connections.
    ///
    /// # Panics
    /// When it does not start again (with its log).
    pub fn start_again(&mut self) {
        self.child = spawn_redis(&self.program, &self.pki, self.port, self.dir.path(), self.durable);
    }

    /// Stops the server with SIGSTOP (a frozen machine, a long GC-like stall): connections stay open, and what
    /// clients send waits in the socket buffers until [`Redis::thaw`], then lands.
    pub fn freeze(&self) {
        signal_pid(self.child.id(), "-STOP");
    }

    /// Resumes a server stopped by [`Redis::freeze`] (SIGCONT).
    pub fn thaw(&self) {
        signal_pid(self.child.id(), "-CONT");
    }

    /// `rediss://HOST:PORT` with `query` (without the `?`; empty for none).
    pub fn url(&self, host: &str, query: &str) -> String {
        let q = if query.is_empty() { String::new() } else { format!("?{query}") };
        format!("rediss://{host}:{}{q}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `sig` (`-STOP`, `-CONT`) to process `pid`.
fn signal_pid(pid: u32, sig: &str) {
    let sent = Command::new("kill").args([sig, &pid.to_string()]).status();
    assert!(sent.is_ok_and(|s| s.success()), "kill {sig} {pid} failed");
}

/// Starts `redis-server` with TLS only on `port`, its files in `dir`, and waits until it accepts connections.
fn spawn_redis(program: &Path, pki: &Pki, port: u16, dir: &Path, durable: bool) -> Child {
    let persistence: [&str; 6] = if durable {
        ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
    } else {
        ["--save", "", "--appendonly", "no", "--appendfsync", "no"]
    };
    let mut child = Command::new(program)
        .args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1", "127.0.0.2"])
        .args(["--tls-cert-file".as_ref(), pki.cert.as_os_str(), "--tls-key-file".as_ref(), pki.key.as_os_str()])
        .args(["--tls-ca-cert-file".as_ref(), pki.ca.as_os_str(), "--tls-auth-clients".as_ref(), "no".as_ref()])
        .args(persistence)
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run redis-server");
    let stdout = child.stdout.take().unwrap();
    if let Err(log) = wait_for_line(stdout, "Ready to accept connections") {
        let _ = child.kill();
        panic!("the throw-away redis-server did not start (is it built with TLS?):\n{log}");
    }
    child
}

/// A TLS server on a free loopback port that presents `cert`/`key` (PEM files) and nothing else: for tests of
/// what a client says about a certificate it refuses. With `postgres`, each connection first gets PostgreSQL's
/// answer to an SSLRequest (`S`: go ahead with TLS). Runs on its own thread until the process ends; returns
/// the port.
///
/// # Panics
/// When the files cannot be read or the port cannot be bound.
pub fn tls_server_presenting(cert: &Path, key: &Path, postgres: bool) -> u16 {
    use rustls::pki_types::pem::PemObject;
    use std::io::Write;
    let chain: Vec<_> =
        rustls::pki_types::CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<_, _>>().unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let config = Arc::new(config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for tcp in listener.incoming() {
            let Ok(mut tcp) = tcp else { continue };
            let config = Arc::clone(&config);
            std::thread::spawn(move || {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
                if postgres {
                    let mut request = [0u8; 8];
                    if tcp.read_exact(&mut request).is_err() || tcp.write_all(b"S").is_err() {
                        return;
                    }
                }
                let Ok(mut tls) = rustls::ServerConnection::new(config) else { return };
                // The client refuses the certificate and sends an alert; the handshake then fails here.
                while tls.is_handshaking() {
                    if tls.complete_io(&mut tcp).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}
