//! Starting and stopping real `idem serve` processes.
#![allow(clippy::unwrap_used)] // tests report failures by panicking
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_idem");

/// The counting example upstream (`examples/upstream.rs`), for tests that put a proxy in front of it.
#[allow(dead_code, clippy::unwrap_used)]
#[path = "../../../examples/upstream.rs"]
pub mod upstream;

/// The example upstream on a free port, in the caller's runtime: its URL and its execution counts.
pub async fn start_upstream() -> (String, std::sync::Arc<upstream::Counts>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let counts = std::sync::Arc::new(upstream::Counts::default());
    let app = upstream::router(std::sync::Arc::clone(&counts));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, counts)
}

/// `idem serve --upstream UPSTREAM` on a SQLite store in `dir`, its admin listener on a free port.
pub fn proxy(dir: &tempfile::TempDir, upstream: &str, extra: &[&str]) -> Server {
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let mut args = vec!["--upstream", upstream, "--admin-listen", "127.0.0.1:0", "--store", &store];
    args.extend_from_slice(extra);
    Server::start(&args, &[])
}

pub struct Server {
    pub child: Child,
    pub url: String,
    /// The admin listener's URL in proxy mode (`--upstream`), else empty.
    pub admin: String,
    /// Everything the server wrote to standard error so far, and a signal for each new line.
    pub log: Log,
}

/// A server's standard error as it arrives.
pub type Log = std::sync::Arc<(std::sync::Mutex<String>, std::sync::Condvar)>;

/// The first address (`http://` or `https://`) on a listening line.
fn address_in(line: &str) -> Option<String> {
    line.split_whitespace().find(|w| w.starts_with("http://") || w.starts_with("https://")).map(str::to_owned)
}

impl Server {
    /// Starts `idem serve` on a free loopback port with the given extra args; waits until it listens.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve");
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn idem serve");
        // Drain stderr so the server never blocks on a full pipe; keep it for failure messages.
        let stderr = child.stderr.take().unwrap();
        let log: Log = std::sync::Arc::default();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut text = sink.0.lock().unwrap();
                text.push_str(&line);
                text.push('\n');
                sink.1.notify_all();
            }
        });
        let stdout = child.stdout.take().unwrap();
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let Some(url) = address_in(&line) else {
            let _ = child.wait();
            std::thread::sleep(Duration::from_millis(100));
            panic!("server did not start: {line:?} {}", log.0.lock().unwrap());
        };
        let mut admin = String::new();
        if line.contains("(proxy to ") {
            let mut second = String::new();
            stdout.read_line(&mut second).unwrap();
            admin = address_in(&second).unwrap_or_default();
        }
        Server { child, url, admin, log }
    }

    /// Waits until the server's standard error holds `needle` `count` times (up to `within`); returns the log.
    pub fn wait_for_log(&self, needle: &str, count: usize, within: Duration) -> String {
        let (text, more) = &*self.log;
        let (text, timeout) =
            more.wait_timeout_while(text.lock().unwrap(), within, |t| t.matches(needle).count() < count).unwrap();
        assert!(!timeout.timed_out(), "no {count}x {needle:?} in the server's log within {within:?}:\n{}", *text);
        text.clone()
    }

    pub fn sqlite(path: &Path) -> Server {
        Self::start(&["--store", &format!("sqlite:{}", path.display())], &[])
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for the exit status of a server already sent SIGTERM.
    pub fn terminate_wait(mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn client() -> reqwest::Client {
    idem_client::client_builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// Runs `idem` with args to completion: (exit code, stdout, stderr).
pub fn idem(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
