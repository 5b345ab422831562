//! Takes a killed runner's commands down with it, and stops a paused runner's commands before their leases
//! lapse.
//!
//! Commands run in their own process groups (so a terminal's Ctrl-C reaches only the runner), which also
//! means nothing stops them when the runner itself is killed with SIGKILL: they would go on running, and
//! writing, while a rerun redoes their items once the leases lapse. The usual fix, a parent-death signal, needs
//! code between fork and exec (`pre_exec`, unsafe). Instead one `awk` process per run, in a process group of
//! its own, reads "+ PGID" when a command starts and "- PGID" when it has ended from a pipe that only the runner
//! holds. When the runner dies, however it dies, the pipe reaches end of file and awk sends SIGTERM, then
//! a second later SIGKILL, to every group still listed. A normal end of run closes the pipe with no group
//! listed, and awk exits without doing anything.
//!
//! A runner that is paused (SIGSTOP, Ctrl-Z, a debugger, a long stall) cannot renew its leases, and another
//! runner takes its items over once they lapse: its commands must not go on beside their successors'. With
//! [`Watchdog::start`]'s `quiet` limit, a thread of the runner writes "h" (a heartbeat) into the pipe every
//! quarter of it, and a ticker (`sleep` in a shell loop, awk has no clock) writes "t" into awk's input as often.
//! After `quiet` without a heartbeat awk stops (SIGSTOP) every listed group. The runner continues them
//! (SIGCONT) once it runs again and finds their leases still valid ([`Watchdog::resumed`]); otherwise it
//! takes the lease again or kills the group, as after any lost lease. `quiet` is a quarter of the lease (0.25 s
//! to 2 s): renewals come every third of it, so a paused runner's commands are stopped before its leases lapse.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// The awk program: keeps the set of live groups; stops them all after `quiet` ticks without a heartbeat; on
/// end of input signals each that is left.
const PROGRAM: &str = r#"
$1 == "+" { live[$2] = 1; next }
$1 == "-" { delete live[$2]; next }
$1 == "h" { ticks = 0; next }
$1 == "t" {
    if (quiet > 0 && ++ticks == quiet) for (g in live) system("kill -STOP -" g " 2>/dev/null")
    next
}
END {
    n = 0
    for (g in live) { system("kill -TERM -" g " 2>/dev/null; kill -CONT -" g " 2>/dev/null"); n++ }
    if (n > 0) {
        system("sleep 1")
        for (g in live) system("kill -KILL -" g " 2>/dev/null")
    }
}
"#;

/// The shell around awk when heartbeats are watched: a ticker writes "t" every `$1` seconds into awk's input
/// beside the runner's pipe (copied by `cat`), and is ended when the pipe closes, so awk then sees end of input.
/// The ticker's `sleep` writes nowhere: left running by the kill, it would hold awk's input open until it
/// ended, and every end of run ([`Watchdog::finish`] waits for awk) would wait up to a tick (half a second
/// per `idem once` attempt with the default lease).
const TICKING: &str = r#"{ (while sleep "$1" >/dev/null; do echo t || exit; done) & ticker=$!; cat; kill "$ticker" 2>/dev/null; } | awk -v quiet="$2" "$3""#;

/// Ticks per `quiet` limit: awk acts between `quiet` and `quiet` plus a quarter of it after the last heartbeat.
const TICKS: u32 = 4;

/// The write end of the watchdog's pipe, shared with the heartbeat thread; `None` once closed.
type Pipe = Arc<Mutex<Option<ChildStdin>>>;

/// The watchdog process and the write end of its pipe.
#[derive(Debug)]
pub(crate) struct Watchdog {
    child: Mutex<Child>,
    pipe: Pipe,
    /// Counts the times the heartbeat thread found it had not run for half of `quiet` or longer (the runner was
    /// paused, or starved): the watchdog may have stopped the commands, which look whether to continue them.
    resumed: watch::Sender<u64>,
}

/// The `quiet` limit for leases of `lease`: a quarter of it, 0.25 s to 2 s.
pub(crate) fn quiet_for(lease: Duration) -> Duration {
    (lease / 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
}

impl Watchdog {
    /// Starts the watchdog; `None` (with a warning) when awk cannot be started, and the run goes on without it.
    /// With `quiet`, it also stops every listed group after that long without a heartbeat of this process.
    pub(crate) fn start(quiet: Option<Duration>) -> Option<Self> {
        let mut command = match quiet {
            Some(quiet) => {
                let tick = quiet / TICKS;
                let mut c = Command::new("sh");
                c.args([
                    "-c",
                    TICKING,
                    "idem-watchdog",
                    &format!("{:.3}", tick.as_secs_f64()),
                    &TICKS.to_string(),
                    PROGRAM,
                ]);
                c
            }
            None => {
                let mut c = Command::new("awk");
                c.arg(PROGRAM);
                c
            }
        };
        let spawned = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Out of the terminal's foreground group: a Ctrl-C must not kill the watchdog before the runner.
            .process_group(0)
            .spawn();
        match spawned {
            Ok(mut child) => {
                let pipe: Pipe = Arc::new(Mutex::new(child.stdin.take()));
                let (resumed, _) = watch::channel(0);
                if let Some(quiet) = quiet {
                    beat(Arc::clone(&pipe), resumed.clone(), quiet);
                }
                Some(Self { child: Mutex::new(child), pipe, resumed })
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start awk: commands of a runner killed with SIGKILL will outlive it");
                None
            }
        }
    }

    /// [`Watchdog::start`] with the `quiet` limit of leases of `lease` ([`quiet_for`]).
    pub(crate) fn for_lease(lease: Duration) -> Option<Self> {
        Self::start(Some(quiet_for(lease)))
    }

    /// A command leading process group `pgid` started.
    pub(crate) fn started(&self, pgid: u32) {
        send(&self.pipe, &format!("+ {pgid}"));
    }

    /// The command leading process group `pgid` ended (or was killed).
    pub(crate) fn ended(&self, pgid: u32) {
        send(&self.pipe, &format!("- {pgid}"));
    }

    /// Changes each time the runner found it had been paused for half the `quiet` limit or longer: the
    /// watchdog may have stopped the commands meanwhile.
    pub(crate) fn resumed(&self) -> watch::Receiver<u64> {
        self.resumed.subscribe()
    }

    /// End of run: closes the pipe (no group is listed any more, so awk just exits) and reaps the watchdog.
    pub(crate) fn finish(&self) {
        drop(self.pipe.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take());
        let _ = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner).wait();
    }
}

/// Writes one line into the pipe; if the watchdog died, stops telling it anything.
fn send(pipe: &Pipe, line: &str) {
    let mut pipe = pipe.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // A few bytes into a pipe the watchdog drains at once.
    if let Some(p) = pipe.as_mut()
        && writeln!(p, "{line}").is_err()
    {
        *pipe = None;
    }
}

/// The heartbeat thread: "h" every quarter of `quiet` until the pipe is closed. A thread, not a task: a busy or
/// blocked runtime must not pass for a paused process, and a paused process stops every thread at once.
fn beat(pipe: Pipe, resumed: watch::Sender<u64>, quiet: Duration) {
    let every = quiet / TICKS;
    let spawned = std::thread::Builder::new().name("idem-heartbeat".into()).spawn(move || {
        let mut last = Instant::now();
        loop {
            if pipe.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_none() {
                return;
            }
            send(&pipe, "h");
            std::thread::sleep(every);
            // Half the limit, where awk needs at least three quarters of it between two heartbeats to count
            // four ticks: whenever awk may have stopped the commands, the runner hears of it.
            if last.elapsed() >= quiet / 2 {
                // Not run for a while (paused, or starved): the watchdog may have stopped the commands.
                // Heartbeat first, so it does not stop them again, then tell the attempts.
                send(&pipe, "h");
                resumed.send_modify(|n| *n = n.wrapping_add(1));
            }
            last = Instant::now();
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the heartbeat thread: a paused runner's commands are not stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The end of a run does not wait for the ticker's sleep: with ticks of 10 s, `finish` returns long before
    /// one tick (it waited for the tick's end while the sleep held awk's input open).
    #[test]
    fn finish_does_not_wait_for_a_tick() {
        let Some(watchdog) = Watchdog::start(Some(Duration::from_secs(40))) else {
            panic!("awk and sh are needed");
        };
        // Once the ticker's first sleep runs (in the watchdog's process group, led by its shell).
        let pgid = watchdog.child.lock().unwrap().id().to_string();
        let sleeping = || Command::new("pgrep").args(["-g", &pgid, "-x", "sleep"]).output().unwrap().status.success();
        let waiting = Instant::now();
        while !sleeping() {
            assert!(waiting.elapsed() < Duration::from_secs(10), "the ticker never slept");
            std::thread::yield_now();
        }
        let started = Instant::now();
        watchdog.finish();
        assert!(started.elapsed() < Duration::from_secs(5), "finish waited {:?}", started.elapsed());
    }
}
