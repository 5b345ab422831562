//! One attempt at one held item: spawn the command in its own process group, wait for it beside the
//! heartbeat, its timeout and a second Ctrl-C, then verify, fsync, fence and rename its output into place.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::ledger::Held;
use idem_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::step::{Attempt, describe, failed};
use super::{Ctx, after_exit, ledger};
use crate::Item;
use crate::output;
use crate::watchdog::Watchdog;
use idem_store::LeaseKeeper;

/// A command's process group as the watchdog knows it: listed when made, unlisted when dropped.
pub(crate) struct Watched<'a> {
    watchdog: Option<&'a Watchdog>,
    pgid: Option<u32>,
}

impl<'a> Watched<'a> {
    pub(crate) fn new(watchdog: Option<&'a Watchdog>, pgid: Option<u32>) -> Self {
        if let (Some(w), Some(p)) = (watchdog, pgid) {
            w.started(p);
        }
        Self { watchdog, pgid }
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        if let (Some(w), Some(p)) = (self.watchdog, self.pgid) {
            w.ended(p);
        }
    }
}

/// Resolves when `rx` sees a new value; never without a watchdog (or once it is gone).
pub(crate) async fn changed(rx: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(rx) = rx
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// Sends `signal` to the process group `pgid` (the command's: SIGSTOP, SIGCONT).
pub(crate) fn signal_group(pgid: Option<u32>, signal: rustix::process::Signal) {
    if let Some(pid) = pgid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Kills the command and everything it started (its process group), then reaps it.
pub(crate) async fn kill_group(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        // The child leads its own group (`process_group(0)`), so this also reaches the shell's children,
        // which would otherwise outlive it and keep writing.
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill().await;
}

/// How long an attempt keeps trying to start its command while the runner is short of file descriptors or
/// processes, before it counts as the item's failure (a limit too low for even one command must end the run).
const SPAWN_PATIENCE: Duration = Duration::from_secs(30);

/// A spawn that failed for want of the runner's resources (descriptors, processes, memory), not the command's.
fn runner_short_of_resources(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e).is_some_and(|n| [Errno::MFILE, Errno::NFILE, Errno::AGAIN, Errno::NOMEM].contains(&n))
}

/// Keeps only the tail of a child's standard error: the last line is what the fingerprint needs.
const STDERR_TAIL: usize = 8 * 1024;

/// Keeps the last bytes of a command's standard error in `tail` (shared, so they can be taken before EOF).
async fn read_tail(mut stderr: tokio::process::ChildStderr, tail: Arc<std::sync::Mutex<Vec<u8>>>) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = stderr.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        tail.extend_from_slice(&buf[..n]);
        if tail.len() > 2 * STDERR_TAIL {
            let excess = tail.len() - STDERR_TAIL;
            tail.drain(..excess);
        }
    }
}

/// How long standard error may stay open after the command exited: a background process it started can hold
/// the pipe for ever, and the runner must not wait on it outside its timeout and heartbeat.
const STDERR_GRACE: Duration = Duration::from_millis(500);

/// `arg` with its placeholders replaced, and each escape `{{WORD}}` made the literal `{WORD}`
/// ([`crate::config::expand`]).
fn substitute(arg: &str, id: &str, out: &Path, item: &str, key: &str) -> String {
    crate::config::expand(arg, |word| match word {
        "id" => Some(id.to_owned()),
        "out" => Some(out.display().to_string()),
        "key" => Some(key.to_owned()),
        "item" => Some(item.to_owned()),
        _ => None,
    })
}

/// The item's idempotency key for its sink (`{key}`, `IDEM_KEY`): `JOB:ID:HASH`, the job's name
/// ([`crate::RunConfig::job`]), the item's id and the first 16 hex digits of the SHA-256 of its canonical text
/// (`idem_core::derive_key`). The same for every attempt, in every process, on every machine, so a sink that
/// dedupes on it sees one effect per item even when a runner died after the effect and before recording it.
fn item_key(job: &str, item: &Item) -> Result<idem_core::IdempotencyKey, idem_core::Error> {
    idem_core::derive_key(job, &item.id, item.raw.as_bytes())
}

/// One attempt at one held item: spawn, wait, verify, then rename into place while still holding the lease,
/// which `heartbeat` renews beside each of those steps. The command's slot (`permit`) is given up as soon as
/// it exited 0, before its output is checked.
pub(super) async fn attempt<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    output: &Path,
    permit: &mut Option<tokio::sync::SemaphorePermit<'_>>,
) -> Attempt {
    if !ctx.cfg.has_output() {
        return without_output(ctx, held, heartbeat, item, permit).await;
    }
    let temp = output::temp_path(output, &ctx.owner, held.attempt());
    // Inline, not on the blocking pool: a stat of an existing directory and a lookup of a file that is
    // usually absent take microseconds, less than the thread hand-off would.
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty())
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return failed("cannot create the output directory", e.to_string().into_bytes());
    }
    // The temporary path is unique to this process start and attempt, so it is almost never there: look
    // before unlinking, as an unlink takes the directory's lock even for a missing name (perf showed the
    // runner spinning on it while commands created files in the same directory).
    if std::fs::symlink_metadata(&temp).is_ok() {
        let _ = std::fs::remove_file(&temp);
    }
    let child = match spawn(ctx, held, heartbeat, item, &temp).await {
        Ok(child) => child,
        Err(ended) => return ended,
    };
    // Listed with the watchdog from now until this attempt returns, on every path.
    let _watched = Watched::new(ctx.watchdog.as_ref(), child.id());
    if let Err(ended) = wait(ctx, held, heartbeat, item, child, &temp).await {
        return ended;
    }
    // The command is over: its slot goes to the next item while this output is verified, fsynced and renamed
    // (`--jobs` counts running commands, as GNU parallel's does). A failed command keeps its slot above, so a
    // failing item is retried, and found poison, before others start.
    *permit = None;
    after_exit::finish(ctx, held, heartbeat, &temp, output).await
}

/// An attempt of a job without output files: done once the command exited 0 (the ledger records it next). With
/// `--check`, the check runs first (exit 0: the effect is already there, the command is skipped) and again after
/// the command (which must then exit 0 too), each beside the heartbeat.
async fn without_output<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    permit: &mut Option<tokio::sync::SemaphorePermit<'_>>,
) -> Attempt {
    let key = match item_key(&ctx.job, item) {
        Ok(k) => k,
        Err(e) => return failed("cannot derive the idempotency key", e.to_string().into_bytes()),
    };
    if ctx.cfg.check.is_some() {
        match check(ctx, held, heartbeat, item, key.as_str()).await {
            Ok(true) => {
                // Done elsewhere already (a runner died after the effect, or another tool did it): no command runs.
                ctx.executions.fetch_sub(1, Ordering::Relaxed);
                *permit = None;
                return Attempt::AlreadyThere;
            }
            Ok(false) => {}
            // The check itself failed: whether the effect is there is unknown, so the command must not run.
            Err((ending, stderr)) => {
                ctx.executions.fetch_sub(1, Ordering::Relaxed);
                return failed(format!("{ending} before the command (0: the effect is there, 1: it is not)"), stderr);
            }
        }
    }
    let child = match spawn(ctx, held, heartbeat, item, Path::new("")).await {
        Ok(child) => child,
        Err(ended) => return ended,
    };
    let watched = Watched::new(ctx.watchdog.as_ref(), child.id());
    if let Err(ended) = wait(ctx, held, heartbeat, item, child, Path::new("")).await {
        return ended;
    }
    drop(watched);
    *permit = None;
    if ctx.cfg.check.is_some() {
        match check(ctx, held, heartbeat, item, key.as_str()).await {
            Ok(true) => {}
            Ok(false) => return failed("check exit 1 after the command exited 0", Vec::new()),
            Err((ending, stderr)) => return failed(format!("{ending} after the command exited 0"), stderr),
        }
    }
    Attempt::Ok(output::Digest256::nothing())
}

/// `--check` for `item`, beside the heartbeat.
async fn check<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    key: &str,
) -> Result<bool, (String, Vec<u8>)> {
    let check = super::verify::check_cmd(ctx, &item.id, key);
    tokio::pin!(check);
    tokio::select! {
        checked = &mut check => checked,
        // A lease lost meanwhile is found by the done write, which is fenced.
        _ = heartbeat.until_lost(held) => check.await,
    }
}

/// Starts the item's command writing to `temp`: the program found in `PATH` at the start (looked up again
/// if it is gone), retried while the runner is short of descriptors or processes. `Err` is how the attempt
/// ended without a command running.
async fn spawn<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    temp: &Path,
) -> Result<tokio::process::Child, Attempt> {
    let key = match idem_core::derive_key(ctx.cfg.idempotency_prefix(), &item.id, item.raw.as_bytes()) {
        Ok(k) => k,
        Err(e) => return Err(failed("cannot derive the idempotency key", e.to_string().into_bytes())),
    };
    let sink_key = match item_key(&ctx.job, item) {
        Ok(k) => k,
        Err(e) => return Err(failed("cannot derive the idempotency key", e.to_string().into_bytes())),
    };
    let argv: Vec<String> =
        ctx.cfg.command.iter().map(|a| substitute(a, &item.id, temp, &item.raw, sink_key.as_str())).collect();
    // Counted before the spawn (`claim::count`), so the token is there.
    let token = held.fencing_token().map(|g| g.to_string()).unwrap_or_default();
    let attempt_no = held.attempt().to_string();
    let command = |program: Option<&Path>| {
        let mut cmd = match program {
            Some(path) => {
                let mut cmd = tokio::process::Command::new(path);
                cmd.arg0(&argv[0]);
                cmd
            }
            None => tokio::process::Command::new(&argv[0]),
        };
        cmd.args(&argv[1..])
            .env("IDEM_ITEM_ID", &item.id)
            .env("IDEM_OUTPUT", temp)
            .env("IDEM_FENCING_TOKEN", &token)
            .env("IDEM_IDEMPOTENCY_KEY", key.as_str())
            .env("IDEM_KEY", sink_key.as_str())
            .env("IDEM_ATTEMPT", &attempt_no)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own process group: a terminal's Ctrl-C reaches the runner only, which decides what to do.
            .process_group(0)
            .kill_on_drop(true);
        cmd
    };
    let cannot_start = |e: std::io::Error| Err(failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()));
    let mut cmd = command(ctx.program.as_deref());
    let mut backoff = Duration::from_millis(20);
    let patience = Instant::now() + SPAWN_PATIENCE;
    loop {
        match cmd.spawn() {
            Ok(c) => return Ok(c),
            // The runner is short of file descriptors or processes (other commands hold them): not the item's
            // fault, so it must not count towards poison. Keep the slot (which also keeps one command fewer
            // running) and the claim, and try again as commands finish.
            Err(e) if runner_short_of_resources(&e) && Instant::now() < patience => {
                if !ctx.short_of_resources.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "cannot start {}: {e}; waiting for running commands to finish (lower --jobs or raise \
                         `ulimit -n` / `ulimit -u`)",
                        argv[0]
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = ctx.stop.reached(1) => return Err(Attempt::NotStarted),
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                if !ledger::fence(ctx, held, heartbeat).await {
                    return Err(Attempt::Lost);
                }
            }
            // The program found at the start of the run is gone or changed: look it up again, as a shell would.
            Err(e) if ctx.program.is_some() && !runner_short_of_resources(&e) => {
                tracing::debug!("cannot start {}: {e}; looking it up in PATH again", argv[0]);
                cmd = command(None);
                return cmd.spawn().or_else(cannot_start);
            }
            Err(e) => return cannot_start(e),
        }
    }
}

/// Feeds the item to the command's standard input and waits for it to exit, beside the heartbeat, its
/// timeout and a second Ctrl-C (each of which kills its process group). `Ok` when it exited 0.
async fn wait<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    mut child: tokio::process::Child,
    temp: &Path,
) -> Result<(), Attempt> {
    if let Some(mut stdin) = child.stdin.take() {
        let mut input = item.raw.clone().into_bytes();
        input.push(b'\n');
        // A command that never reads its input closes the pipe; that is not an error.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await;
        });
    }
    let tail = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stderr_task = child.stderr.take().map(|s| tokio::spawn(read_tail(s, Arc::clone(&tail))));
    let stderr = || async {
        if let Some(mut task) = stderr_task
            && tokio::time::timeout(STDERR_GRACE, &mut task).await.is_err()
        {
            task.abort();
        }
        std::mem::take(&mut *tail.lock().unwrap_or_else(|p| p.into_inner()))
    };
    let deadline = ctx.cfg.timeout.map(|t| tokio::time::Instant::now() + t);
    let lease = heartbeat.length();
    // The command is stopped (SIGSTOP to its process group) this long before its lease would lapse with no
    // renewal accepted: past that instant another runner may take the item over, and the two commands must
    // not run side by side. It goes on (SIGCONT) once a renewal is accepted, or the lease was taken again.
    let margin = (lease / 5).clamp(Duration::from_millis(200), Duration::from_secs(2));
    let mut frozen = false;
    // The watchdog stops the command when this runner stops beating (paused): when it beats again, the command
    // goes on if its lease is still valid (else it stays stopped, and the lapse is handled as any other). The
    // watchdog may act on ticks it read just before the heartbeat that ended the pause, so the SIGCONT is sent
    // again a quiet limit later.
    let mut resumed = ctx.watchdog.as_ref().map(Watchdog::resumed);
    let quiet = crate::watchdog::quiet_for(lease);
    let mut cont_again: Option<tokio::time::Instant> = None;
    // Kept: once the command has been reaped, `child.id()` is gone, but its group may live on.
    let pgid = child.id();
    // The lease is renewed beside the wait (not inside an arm of it), so a slow ledger never delays noticing
    // the command's exit, its timeout or a second Ctrl-C.
    // The deadline follows the keeper's latest accepted renewal, read when it is needed: renewals are
    // accepted inside `until_lost` below, which does not resolve on them, so a deadline worked out at the top
    // of a turn goes stale and would stop a command whose lease was just renewed.
    let doubtful = |sent: tokio::time::Instant| sent + lease - margin;
    let status = loop {
        if frozen && ctx.outage.exceeded() {
            // Stopped for its lease, and the store stayed unavailable past the limit: the run ends, and the
            // command may not go on without a lease (another runner may take the item once the store is back).
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(temp).await;
            return Err(Attempt::Abandoned);
        }
        let due = doubtful(heartbeat.sent());
        if frozen && tokio::time::Instant::now() < due {
            tracing::warn!(item = %item.id, "lease renewed: the command goes on (SIGCONT)");
            signal_group(pgid, rustix::process::Signal::CONT);
            frozen = false;
        }
        if let Some(at) = cont_again
            && tokio::time::Instant::now() >= at
        {
            cont_again = None;
            if !frozen {
                signal_group(pgid, rustix::process::Signal::CONT);
            }
        }
        // Frozen, look every 50 ms whether a renewal was accepted meanwhile.
        let wake = if frozen { tokio::time::Instant::now() + Duration::from_millis(50) } else { due };
        let wake = cont_again.map_or(wake, |at| at.min(wake));
        tokio::select! {
            status = child.wait() => break status,
            () = changed(&mut resumed) => {
                if !frozen && tokio::time::Instant::now() < doubtful(heartbeat.sent()) {
                    tracing::debug!(item = %item.id, "the runner beats again: the command goes on (SIGCONT)");
                    signal_group(pgid, rustix::process::Signal::CONT);
                    cont_again = Some(tokio::time::Instant::now() + quiet);
                }
            }
            // The planted bug "runner-fence", its other half: a lost lease never noticed while the command runs.
            _ = heartbeat.until_lost(held), if !idem_core::planted("runner-fence") => {
                // No renewal accepted for a whole lease (the store unavailable, or this runner paused), or a
                // renewal refused: the command stays stopped until the lease is ours again, if nobody took the
                // item over meanwhile.
                if !frozen {
                    ctx.counters.stopped.fetch_add(1, Ordering::Relaxed);
                    signal_group(pgid, rustix::process::Signal::STOP);
                    frozen = true;
                }
                if !ledger::recover(ctx, held, heartbeat).await {
                    tracing::debug!(item = %item.id, "the lease was lost while the command ran, and not taken again");
                    kill_group(&mut child).await;
                    let _ = tokio::fs::remove_file(temp).await;
                    return Err(if ctx.outage.exceeded() { Attempt::Abandoned } else { Attempt::Lost });
                }
            }
            () = tokio::time::sleep_until(wake) => {
                if !frozen && tokio::time::Instant::now() >= doubtful(heartbeat.sent()) {
                    ctx.counters.stopped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        item = %item.id,
                        "no lease renewal accepted for {:.1}s of a {:.0}s lease: the command is stopped (SIGSTOP) \
                         until one is",
                        heartbeat.sent().elapsed().as_secs_f64(),
                        lease.as_secs_f64()
                    );
                    signal_group(pgid, rustix::process::Signal::STOP);
                    frozen = true;
                }
            }
            () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                kill_group(&mut child).await;
                let _ = tokio::fs::remove_file(temp).await;
                return Err(failed("timeout", Vec::new()));
            }
            () = ctx.stop.reached(2) => {
                kill_group(&mut child).await;
                let _ = tokio::fs::remove_file(temp).await;
                return Err(Attempt::Interrupted);
            }
        }
    };
    if frozen {
        // The command exited just before it was stopped; what it left running in its group goes on.
        signal_group(pgid, rustix::process::Signal::CONT);
    }
    let stderr = stderr().await;
    let status = match status {
        Ok(s) => s,
        Err(e) => return Err(failed("cannot wait for the command", e.to_string().into_bytes())),
    };
    if !status.success() {
        let _ = tokio::fs::remove_file(temp).await;
        return Err(failed(describe(status), stderr));
    }
    Ok(())
}
