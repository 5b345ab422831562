//! The real `idem` processes the harness drives: finding the binary, starting `idem serve` and keeping its
//! ports across a kill -9 and restart, and sending signals (SIGKILL, SIGSTOP, SIGCONT).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::Error;

/// The environment variable that plants a bug in builds of idem with its `planted-bugs` feature: its value
/// names the bug (`kv-precondition`, `proxy-completion`, `proxy-fingerprint`, `runner-fence`,
/// `runner-lapse-by-clock`).
pub const PLANTED_BUG_VAR: &str = "IDEM_PLANTED_BUG";

/// The `idem` binary next to this executable: `target/<profile>/idem` for `target/<profile>/idem-verify` and
/// for a test binary in `target/<profile>/deps/`.
///
/// # Errors
/// [`Error::NoIdem`] when it is not there.
pub fn idem_next_to_me() -> Result<PathBuf, Error> {
    let me = std::env::current_exe().map_err(|e| Error::io("finding this executable", e))?;
    let mut dir = me.parent().map(Path::to_owned).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let idem = dir.join("idem");
    if idem.is_file() { Ok(idem) } else { Err(Error::NoIdem { path: idem }) }
}

/// Sends `signal` (`KILL`, `STOP`, `CONT`, `TERM`) to `pid` with kill(1): the crate forbids unsafe code.
pub async fn signal(pid: u32, signal: &str) {
    // A process that already exited is no error here: kill(1)'s complaint about it is noise.
    let _ = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).stderr(Stdio::null()).status().await;
}

/// One `idem serve` process that can be killed and started again on the same ports.
#[derive(Debug)]
pub struct Serve {
    idem: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    /// `http://127.0.0.1:PORT` of the main listener.
    pub url: String,
    /// `http://127.0.0.1:PORT` of the admin listener in proxy mode.
    pub admin: Option<String>,
    /// How many times it was started.
    pub starts: u32,
}

impl Serve {
    /// Starts `idem serve ARGS` on free loopback ports (`--listen 127.0.0.1:0`, and `--admin-listen` in proxy
    /// mode), appending its standard error to `log`, and waits until it listens.
    ///
    /// # Errors
    /// When it cannot be spawned or exits before listening.
    pub async fn start(idem: &Path, args: &[String], env: &[(String, String)], log: &Path) -> Result<Self, Error> {
        let mut serve = Self {
            idem: idem.to_owned(),
            args: args.to_vec(),
            env: env.to_vec(),
            log: log.to_owned(),
            child: None,
            url: String::new(),
            admin: None,
            starts: 0,
        };
        let proxy = args.iter().any(|a| a == "--upstream");
        let mut first = vec!["--listen".to_owned(), "127.0.0.1:0".to_owned()];
        if proxy {
            first.extend(["--admin-listen".to_owned(), "127.0.0.1:0".to_owned()]);
        }
        serve.spawn(&first).await?;
        Ok(serve)
    }

    async fn spawn(&mut self, listen: &[String]) -> Result<(), Error> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| Error::io(format!("opening {}", self.log.display()), e))?;
        let mut cmd = Command::new(&self.idem);
        cmd.arg("serve").args(listen).args(&self.args).env_remove(PLANTED_BUG_VAR);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", self.idem.display()), e))?;
        let stdout = child.stdout.take().ok_or_else(|| Error::Start("no standard output".into()))?;
        let mut lines = BufReader::new(stdout).lines();
        let proxy = self.args.iter().any(|a| a == "--upstream");
        let wanted = if proxy { 2 } else { 1 };
        let mut urls = Vec::new();
        let wait = async {
            while urls.len() < wanted {
                match lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                            urls.push(url.to_owned());
                        }
                    }
                    _ => return false,
                }
            }
            true
        };
        let listening = tokio::time::timeout(std::time::Duration::from_secs(30), wait).await.unwrap_or(false);
        if !listening {
            let _ = child.kill().await;
            let tail = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            return Err(Error::Start(format!("idem serve did not listen: {}", tail.join(" | "))));
        }
        // Nothing else is printed on standard output, but keep reading so the pipe never fills.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.url = urls[0].trim_end_matches('/').to_owned();
        self.admin = urls.get(1).map(|u| u.trim_end_matches('/').to_owned());
        self.child = Some(child);
        self.starts += 1;
        Ok(())
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// SIGKILL: no shutdown code runs; waits until it is gone.
    pub async fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts it again on the ports it had.
    ///
    /// # Errors
    /// When it does not listen again.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.kill9().await;
        let port = |url: &str| url.trim_start_matches("http://").to_owned();
        let mut listen = vec!["--listen".to_owned(), port(&self.url)];
        if let Some(admin) = &self.admin {
            listen.extend(["--admin-listen".to_owned(), port(admin)]);
        }
        // The old process's listening socket is gone with it, but allow the kernel a moment.
        let mut last = None;
        for _ in 0..50 {
            match self.spawn(&listen).await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Err(last.unwrap_or_else(|| Error::Start("restart".into())))
    }

    /// SIGTERM, then waits up to 40 s for the exit (idem drains in-flight requests for up to 30 s).
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                signal(pid, "TERM").await;
            }
            if tokio::time::timeout(std::time::Duration::from_secs(40), child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
        }
    }
}
