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
    /// A later slot asked for it to stop (`--overlap cancel-other`, `terminate-other`): the command was stopped.
    Replaced {
        /// The later slot, in milliseconds since the Unix epoch.
        by_ms: u64,
        /// How the command ended: `signal 15` / `signal 9`, or its exit when it exited on SIGTERM.
        exit: String,
        /// Its exit code, when it exited.
        code: Option<i32>,
    },
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
    /// Under `cancel-other` or `terminate-other`: how a later slot's request to stop this one is honoured.
    pub(crate) stop: Option<Stop>,
}

/// A stop request watched for while the command runs ([`idem_core::slot::stop_key`]).
pub(crate) struct Stop {
    /// The request's key.
    pub(crate) key: String,
    /// `cancel-other`: SIGTERM first, SIGKILL this long after if it still runs; `None` (`terminate-other`):
    /// SIGKILL at once.
    pub(crate) grace: Option<Duration>,
    /// How often the key is read (and read once at the start).
    pub(crate) every: Duration,
}

/// Runs one attempt while `keeper` keeps `held`'s lease; `interrupt` resolves on a signal to the invocation.
pub(crate) async fn run<S: Store + Sync>(
    store: &S,
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
        // A triggered run (`idem once trigger`) is told so: its IDEM_SLOT is the time it was requested.
        .env("IDEM_TRIGGER_ID", held.keys().entry().strip_prefix(&slot::trigger_prefix(spawn.name)).unwrap_or(""))
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
            (watch(store, spawn, held, keeper, &mut group, interrupt).await, Some(group))
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

/// Waits for the command beside its lease, `--timeout`, `interrupt` and a stop request; kills it on any of them.
async fn watch<S: Store + Sync>(
    store: &S,
    spawn: &Spawn<'_>,
    held: &mut slot::Held,
    keeper: &mut LeaseKeeper<'_, S>,
    group: &mut Group<'_>,
    interrupt: impl Future<Output = ()>,
) -> Ended {
    let replaced = std::sync::OnceLock::new();
    let pgid = group.child().id();
    let stopped = async {
        match &spawn.stop {
            Some(stop) => stop_requested(store, stop, pgid, &replaced).await,
            None => std::future::pending().await,
        }
    };
    let either = async {
        tokio::select! {
            () = interrupt => {}
            () = stopped => {}
        }
    };
    let mut watch = supervise::Watch {
        label: spawn.slot,
        on_lapse: OnLapse::Run,
        deadline: spawn.timeout.map(|t| tokio::time::Instant::now() + t),
        interrupt: std::pin::pin!(either),
    };
    let event = group.watch(keeper, held, &mut watch).await;
    // A command that finished with exit 0 as the request came ran to its end: done, not replaced.
    let succeeded = matches!(&event, Event::Exited(Ok(status)) if status.success());
    if let Some(&by_ms) = replaced.get().filter(|_| !succeeded) {
        let (exit, code) = match &event {
            Event::Exited(Ok(status)) => match exited(*status) {
                Ended::Exited { exit, code, .. } => (exit, code),
                _ => ("signal 15".to_owned(), None),
            },
            _ => ("signal 9".to_owned(), None),
        };
        return Ended::Replaced { by_ms, exit, code };
    }
    match event {
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

/// Resolves once a later slot asked this one to stop (its key holds the later slot's time) and, under
/// `cancel-other`, the command had its grace after SIGTERM to its process group `pgid`; the caller then kills
/// what is left. The key is read at once, then every `stop.every`; a read that fails is tried at the next turn.
async fn stop_requested<S: Store>(store: &S, stop: &Stop, pgid: Option<u32>, replaced: &std::sync::OnceLock<u64>) {
    loop {
        if let Ok(Some(v)) = store.get(&stop.key).await {
            let by_ms = std::str::from_utf8(v.value()).ok().and_then(|s| s.parse().ok()).unwrap_or(0);
            let _ = replaced.set(by_ms);
            tracing::info!(by_ms, "a later slot replaces this one (--overlap): its command is stopped");
            if let Some(grace) = stop.grace {
                crate::supervise::signal_group(pgid, rustix::process::Signal::TERM);
                tokio::time::sleep(grace).await;
            }
            return;
        }
        tokio::time::sleep(stop.every).await;
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
