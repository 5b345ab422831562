//! Takes a killed runner's commands down with it.
//!
//! Commands run in their own process groups (so a terminal's Ctrl-C reaches only the runner), which also
//! means nothing stops them when the runner itself is killed with SIGKILL: they would go on running, and
//! writing, while a rerun redoes their items once the leases lapse. The usual fix, a parent-death signal, needs
//! code between fork and exec (`pre_exec`, unsafe). Instead one `awk` process per run, in a process group of
//! its own, reads "+ PGID" when a command starts and "- PGID" when it has ended from a pipe that only the runner
//! holds. When the runner dies, however it dies, the pipe reaches end of file and awk sends SIGTERM, then
//! a second later SIGKILL, to every group still listed. A normal end of run closes the pipe with no group
//! listed, and awk exits without doing anything.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;

/// The awk program: keeps the set of live groups, and on end of input signals each that is left.
const PROGRAM: &str = r#"
$1 == "+" { live[$2] = 1; next }
$1 == "-" { delete live[$2]; next }
END {
    n = 0
    for (g in live) { system("kill -TERM -" g " 2>/dev/null"); n++ }
    if (n > 0) {
        system("sleep 1")
        for (g in live) system("kill -KILL -" g " 2>/dev/null")
    }
}
"#;

/// The watchdog process and the write end of its pipe.
#[derive(Debug)]
pub(crate) struct Watchdog {
    child: Mutex<Child>,
    pipe: Mutex<Option<ChildStdin>>,
}

impl Watchdog {
    /// Starts the watchdog; `None` (with a warning) when awk cannot be started, and the run goes on without it.
    pub(crate) fn start() -> Option<Self> {
        let spawned = Command::new("awk")
            .arg(PROGRAM)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Out of the terminal's foreground group: a Ctrl-C must not kill the watchdog before the runner.
            .process_group(0)
            .spawn();
        match spawned {
            Ok(mut child) => {
                let pipe = child.stdin.take();
                Some(Self { child: Mutex::new(child), pipe: Mutex::new(pipe) })
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start awk: commands of a runner killed with SIGKILL will outlive it");
                None
            }
        }
    }

    /// A command leading process group `pgid` started.
    pub(crate) fn started(&self, pgid: u32) {
        self.send('+', pgid);
    }

    /// The command leading process group `pgid` ended (or was killed).
    pub(crate) fn ended(&self, pgid: u32) {
        self.send('-', pgid);
    }

    fn send(&self, op: char, pgid: u32) {
        let mut pipe = self.pipe.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A few bytes into a pipe awk drains at once; if awk died, stop telling it anything.
        if let Some(p) = pipe.as_mut()
            && writeln!(p, "{op} {pgid}").is_err()
        {
            *pipe = None;
        }
    }

    /// End of run: closes the pipe (no group is listed any more, so awk just exits) and reaps awk.
    pub(crate) fn finish(&self) {
        drop(self.pipe.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take());
        let _ = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner).wait();
    }
}
