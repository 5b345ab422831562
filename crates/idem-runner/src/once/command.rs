//! One attempt at a held slot: the command in its own process group (listed with the watchdog, so it dies
//! with a killed invocation), its output passed through to ours and its last lines kept, waited for beside
//! the lease's renewals, `--timeout` and a signal to the invocation.

use std::collections::VecDeque;
use std::future::Future;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::slot;
use idem_store::{LeaseKeeper, Lost, Store};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::engine::{Watched, kill_group};
use crate::watchdog::Watchdog;

/// Lines of output kept per attempt (the last ones), and the longest line kept, in bytes.
pub const TAIL_LINES: usize = 20;
const LINE_BYTES: usize = 400;

/// How long the output pipes may stay open after the command exited (a background process it started can
/// hold them for ever).
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

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
    let tail = Arc::new(Mutex::new(Tail::default()));
    let mut cmd = tokio::process::Command::new(&spawn.command[0]);
    cmd.args(&spawn.command[1..])
        .env("IDEM_NAME", spawn.name)
        .env("IDEM_SLOT", spawn.slot)
        .env("IDEM_ATTEMPT", held.attempt().to_string())
        .env("IDEM_FENCING_TOKEN", held.fencing_token().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: a terminal's Ctrl-C reaches the invocation only, which decides; a kill of
        // the group reaches what the command started.
        .process_group(0)
        .kill_on_drop(true);
    // With a quiet limit, as for `idem run`: an invocation paused (SIGSTOP, a debugger, a stall) has its
    // command stopped by the watchdog before its lease can lapse, so the command never runs beside the one of
    // an invocation that took the slot over meanwhile. Started before the command, so that the command is
    // listed with it a moment after it starts: started after, a kill -9 of the invocation while the watchdog
    // was being started (a fork and two execs on a loaded machine) left the command running.
    let lease = keeper.length();
    let quiet = crate::watchdog::quiet_for(lease);
    let watchdog = Watchdog::start(Some(quiet));
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            if let Some(w) = &watchdog {
                w.finish();
            }
            let exit = format!("cannot start {}: {e}", spawn.command[0]);
            tail.lock().unwrap_or_else(|p| p.into_inner()).push_line(exit.as_bytes());
            let output = take(&tail);
            return Attempt {
                ended: Ended::Exited { exit, code: None, success: false },
                duration: started.elapsed(),
                output,
            };
        }
    };
    let watched = Watched::new(watchdog.as_ref(), child.id());
    let mut resumed = watchdog.as_ref().map(Watchdog::resumed);
    let pgid = child.id();
    let mut cont_again: Option<tokio::time::Instant> = None;
    let mut copies = Vec::new();
    if let Some(out) = child.stdout.take() {
        copies.push(tokio::spawn(copy(out, tokio::io::stdout(), Arc::clone(&tail))));
    }
    if let Some(err) = child.stderr.take() {
        copies.push(tokio::spawn(copy(err, tokio::io::stderr(), Arc::clone(&tail))));
    }
    let deadline = spawn.timeout.map(|t| tokio::time::Instant::now() + t);
    tokio::pin!(interrupt);
    let ended = loop {
        tokio::select! {
            // The command's exit first: a lease loss seen in the same round must not hide that it finished.
            biased;
            status = child.wait() => break match status {
                Ok(s) => exited(s),
                Err(e) => Ended::Exited { exit: format!("cannot wait for the command: {e}"), code: None, success: false },
            },
            why = keeper.until_lost(held) => {
                // Taken over (a renewal refused), or no renewal accepted for a whole lease: the slot is no longer
                // ours. A command that exited 0 meanwhile (the invocation was paused while it finished) ran to the
                // end all the same.
                let success = matches!(child.try_wait(), Ok(Some(s)) if s.success());
                kill_group(&mut child).await;
                break Ended::Lost { why, success };
            }
            () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                kill_group(&mut child).await;
                break Ended::Exited { exit: "timeout".into(), code: None, success: false };
            }
            () = &mut interrupt => {
                kill_group(&mut child).await;
                break Ended::Interrupted;
            }
            // The invocation runs again after a pause, and the watchdog may have stopped the command: it goes on
            // while the lease is still ours (a lapse is `until_lost`'s, which kills it). Sent again a quiet limit
            // later, in case the watchdog acted on ticks it read just before the heartbeat that ended the pause.
            () = crate::engine::changed(&mut resumed) => {
                if keeper.sent().elapsed() < lease {
                    crate::engine::signal_group(pgid, rustix::process::Signal::CONT);
                    cont_again = Some(tokio::time::Instant::now() + quiet);
                }
            }
            () = async { match cont_again { Some(at) => tokio::time::sleep_until(at).await, None => std::future::pending().await } } => {
                cont_again = None;
                if keeper.sent().elapsed() < lease {
                    crate::engine::signal_group(pgid, rustix::process::Signal::CONT);
                }
            }
        }
    };
    let duration = started.elapsed();
    for mut copy in copies {
        if tokio::time::timeout(OUTPUT_GRACE, &mut copy).await.is_err() {
            copy.abort();
        }
    }
    drop(watched);
    if let Some(w) = &watchdog {
        w.finish();
    }
    Attempt { ended, duration, output: take(&tail) }
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

/// The last [`TAIL_LINES`] lines of the command's output, each cut to [`LINE_BYTES`].
#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    /// A line not yet ended, per stream in turn (the two streams' partial lines are not told apart: a line
    /// is kept as the bytes came).
    partial: Vec<u8>,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.partial);
                self.push_line(&line);
            } else if self.partial.len() < LINE_BYTES + 4 {
                self.partial.push(b);
            }
        }
    }

    fn push_line(&mut self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end_matches('\r');
        let kept = &text[..text.floor_char_boundary(LINE_BYTES)];
        // A cut line says so: the status reader must not take a prefix for the whole line.
        let cut = if kept.len() < text.len() { " [cut]" } else { "" };
        self.lines.push_back(format!("{kept}{cut}"));
        if self.lines.len() > TAIL_LINES {
            self.lines.pop_front();
        }
    }
}

fn take(tail: &Mutex<Tail>) -> Vec<String> {
    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
    if !tail.partial.is_empty() {
        let line = std::mem::take(&mut tail.partial);
        tail.push_line(&line);
    }
    tail.lines.drain(..).collect()
}

/// Copies a stream of the command to ours as it comes (so cron still mails it), keeping its last lines.
async fn copy(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, tail: Arc<Mutex<Tail>>) {
    let mut buf = [0u8; 8192];
    let mut passing = true;
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        tail.lock().unwrap_or_else(|p| p.into_inner()).push(&buf[..n]);
        // Our own output gone (a closed pipe) must not stop the command: keep reading, stop passing.
        if passing && (to.write_all(&buf[..n]).await.is_err() || to.flush().await.is_err()) {
            passing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_keeps_the_last_lines_whole_and_bounded() {
        let mut tail = Tail::default();
        for i in 0..30 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        tail.push("é".repeat(300).as_bytes());
        let tail = Mutex::new(tail);
        let lines = take(&tail);
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 11");
        assert_eq!(
            lines[TAIL_LINES - 1],
            format!("{} [cut]", "é".repeat(LINE_BYTES / 2)),
            "cut on a character, marked"
        );
    }
}
