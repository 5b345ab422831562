//! One attempt at a held slot: the command in its own process group (listed with the watchdog, so it dies
//! with a killed invocation), its output passed through to ours and its last lines kept, waited for beside
//! the lease's renewals, `--timeout` and a signal to the invocation.

use std::future::Future;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem_core::slot;
use idem_store::{LeaseKeeper, Lost, Store};

use crate::supervise::{self, Event, Group, Lines, OnLapse, Watchdog};

/// How an attempt ended, before it is recorded.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The command exited (or was killed by a signal, or by `--timeout`).
    Exited {
        /// `exit N`, `signal N`, `timeout`, or `cannot start …`.
        exit: String,
        /// Its exit code, when it exited.
        code: Option<i32>,
        /// Whether it succeeded (exit 0).
        success: bool,
    },
    /// The lease was lost while it ran: the command was killed (unless it had exited 0 already, `success`).
    Lost {
        /// Why.
        why: Lost,
        /// It had exited 0 before the loss was seen: it ran to the end, but its outcome is not this holder's
        /// to record.
        success: bool,
    },
    /// A signal to the invocation stopped it: the command was killed.
    Interrupted,
}

/// What the attempt left: how it ended, how long it ran, its last lines of output.
pub(crate) struct Attempt {
    pub(crate) ended: Ended,
    pub(crate) duration: Duration,
    pub(crate) output: Vec<String>,
}

/// The environment and arguments of one attempt.
pub(crate) struct Spawn<'a> {
    pub(crate) command: &'a [String],
    pub(crate) name: &'a str,
    pub(crate) slot: &'a str,
    pub(crate) timeout: Option<Duration>,
}

/// Runs one attempt while `keeper` keeps `held`'s lease; `interrupt` resolves on a signal to the invocation.
pub(crate) async fn run<S: Store + Sync>(
    spawn: &Spawn<'_>,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
    interrupt: impl Future<Output = ()>,
) -> Attempt {
    let started = Instant::now();
    let mut tail = Lines::default();
    let mut cmd = tokio::process::Command::new(&spawn.command[0]);
    cmd.args(&spawn.command[1..])
        .env("IDEM_NAME", spawn.name)
        .env("IDEM_SLOT", spawn.slot)
        .env("IDEM_ATTEMPT", held.attempt().to_string())
        .env("IDEM_FENCING_TOKEN", held.fencing_token().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // With a quiet limit, as for `idem run`: an invocation paused (SIGSTOP, a debugger, a stall) has its
    // command stopped by the watchdog before its lease can lapse, so the command never runs beside the one of
    // an invocation that took the slot over meanwhile. Started before the command, so that the command is
    // listed with it a moment after it starts: started after, a kill -9 of the invocation while the watchdog
    // was being started (a fork and two execs on a loaded machine) left the command running.
    let watchdog = Watchdog::for_lease(keeper.length());
    let (ended, group) = match Group::spawn(&mut cmd, watchdog.as_ref()) {
        Ok(mut group) => {
            tail.copy(group.child());
            (watch(spawn, held, keeper, &mut group, interrupt).await, Some(group))
        }
        Err(e) => {
            let exit = format!("cannot start {}: {e}", spawn.command[0]);
            tail.push_line(&exit);
            (Ended::Exited { exit, code: None, success: false }, None)
        }
    };
    let duration = started.elapsed();
    let output = tail.take().await;
    // Listed with the watchdog until its output is read: what it left running in its group dies with us.
    drop(group);
    if let Some(w) = &watchdog {
        w.finish();
    }
    Attempt { ended, duration, output }
}

/// Waits for the command beside its lease, `--timeout` and `interrupt`; kills it on any of them.
async fn watch<S: Store + Sync>(
    spawn: &Spawn<'_>,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
    group: &mut Group<'_>,
    interrupt: impl Future<Output = ()>,
) -> Ended {
    let mut watch = supervise::Watch {
        label: spawn.slot,
        on_lapse: OnLapse::Run,
        deadline: spawn.timeout.map(|t| tokio::time::Instant::now() + t),
        interrupt: std::pin::pin!(interrupt),
    };
    match group.watch(keeper, held, &mut watch).await {
        Event::Exited(Ok(status)) => exited(status),
        Event::Exited(Err(e)) => {
            Ended::Exited { exit: format!("cannot wait for the command: {e}"), code: None, success: false }
        }
        Event::Lost(why) => {
            // Taken over (a renewal refused), or no renewal accepted for a whole lease: the slot is no longer
            // ours. A command that exited 0 meanwhile (the invocation was paused while it finished) ran to the
            // end all the same.
            let success = group.exited_ok();
            group.kill().await;
            Ended::Lost { why, success }
        }
        Event::TimedOut => Ended::Exited { exit: "timeout".into(), code: None, success: false },
        // Only `idem run` gives up on a stopped command.
        Event::Interrupted | Event::GaveUp => Ended::Interrupted,
    }
}

fn exited(status: std::process::ExitStatus) -> Ended {
    use std::os::unix::process::ExitStatusExt as _;
    let exit = match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "unknown ending".into(),
    };
    Ended::Exited { exit, code: status.code(), success: status.success() }
}
