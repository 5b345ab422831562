//! A server process of the test kit's highly available setups, in a process group of its own.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::wait_for_line;

/// A server process of its own process group, so that [`Proc::kill9`] takes its children with it (a PostgreSQL
/// postmaster's backends), as a machine that dies would.
#[derive(Debug)]
pub(crate) struct Proc {
    child: Option<Child>,
    /// Stopped by SIGSTOP: asking it anything would hang.
    frozen: AtomicBool,
}

impl Proc {
    pub(crate) fn spawn(mut cmd: Command, ready: &'static str, what: &str, stdout: bool) -> Self {
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
            let mut p = Self { child: Some(child), frozen: AtomicBool::new(false) };
            p.kill9();
            panic!("{what} did not start:\n{log}");
        }
        Self { child: Some(child), frozen: AtomicBool::new(false) }
    }

    /// SIGKILL to the whole process group, then reaps the leader.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ =
                Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).stderr(Stdio::null()).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `sig` to the leader, then waits up to `grace` for it to exit, then SIGKILL to the group. SIGQUIT is
    /// PostgreSQL's immediate shutdown, SIGINT its fast one (clients disconnected, a shutdown checkpoint).
    pub(crate) fn stop(&mut self, sig: &str, grace: Duration) {
        // A frozen process would not act on the signal before the grace ran out.
        self.signal("-CONT");
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args([sig, &child.id().to_string()]).status();
            if let Some(mut child) = self.child.take() {
                let deadline = Instant::now() + grace;
                while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.child = Some(child);
            }
        }
        self.kill9();
    }

    /// SIGQUIT (PostgreSQL's immediate shutdown) to the leader, SIGKILL to the group after it.
    pub(crate) fn quit(&mut self) {
        self.stop("-QUIT", Duration::from_secs(5));
    }

    pub(crate) fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// Alive and not frozen: it can be asked something.
    pub(crate) fn answers(&self) -> bool {
        self.alive() && !self.frozen.load(Ordering::SeqCst)
    }

    /// `sig` (`-STOP`, `-CONT`) to the process group.
    pub(crate) fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args([sig, "--", &format!("-{}", child.id())]).stderr(Stdio::null()).status();
            match sig {
                "-STOP" => self.frozen.store(true, Ordering::SeqCst),
                "-CONT" => self.frozen.store(false, Ordering::SeqCst),
                _ => {}
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A frozen group would take SIGKILL too, but its leader must be reaped: continue it first.
        self.signal("-CONT");
        self.kill9();
    }
}
