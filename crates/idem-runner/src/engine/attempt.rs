//! One attempt at one held item: spawn the command in its own process group, wait for it beside the
//! heartbeat, its timeout and a second Ctrl-C, then verify, fsync, fence and rename its output into place.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::Held;
use idem_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::Ctx;
use super::stop::stopped;
use crate::Item;
use crate::heartbeat::Heartbeat;
use crate::output::{self, Digest256};
use crate::watchdog::Watchdog;

pub(super) enum Attempt {
    Ok(Digest256),
    Failed {
        ending: String,
        stderr: Vec<u8>,
        message: String,
    },
    Lost,
    /// The run stopped before the command could start: nothing ran.
    NotStarted,
    /// The command ran and was killed by a second Ctrl-C or SIGTERM: it may have written anything.
    Interrupted,
}

fn failed(ending: impl Into<String>, stderr: Vec<u8>) -> Attempt {
    let ending = ending.into();
    let text = String::from_utf8_lossy(&stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("");
    let message = if last.is_empty() { ending.clone() } else { format!("{ending}: {last}") };
    Attempt::Failed { ending, stderr, message }
}

/// A command's process group as the watchdog knows it: listed when made, unlisted when dropped.
struct Watched<'a> {
    watchdog: Option<&'a Watchdog>,
    pgid: Option<u32>,
}

impl<'a> Watched<'a> {
    fn new(watchdog: Option<&'a Watchdog>, pgid: Option<u32>) -> Self {
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

/// Kills the command and everything it started (its process group), then reaps it.
async fn kill_group(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        // The child leads its own group (`process_group(0)`), so this also reaches the shell's children,
        // which would otherwise outlive it and keep writing.
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill().await;
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "unknown ending".into(),
    }
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

fn substitute(arg: &str, id: &str, out: &Path, item: &str) -> String {
    if !arg.contains('{') {
        return arg.to_owned();
    }
    arg.replace("{id}", id).replace("{out}", &out.display().to_string()).replace("{item}", item)
}

/// One attempt at one held item: spawn, wait, verify, then rename into place while still holding the lease,
/// which `heartbeat` renews beside each of those steps.
pub(super) async fn attempt<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut Heartbeat<'_, S>,
    item: &Item,
    output: &Path,
    permit: &mut Option<tokio::sync::SemaphorePermit<'_>>,
) -> Attempt {
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
    let key = match idem_core::derive_key(&ctx.cfg.key_prefix, &item.id, item.raw.as_bytes()) {
        Ok(k) => k,
        Err(e) => return failed("cannot derive the idempotency key", e.to_string().into_bytes()),
    };
    let argv: Vec<String> = ctx.cfg.command.iter().map(|a| substitute(a, &item.id, &temp, &item.raw)).collect();
    let lease = held.lease();
    let (token, attempt_no) = (held.fencing_token().to_string(), held.attempt().to_string());
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
            .env("IDEM_OUTPUT", &temp)
            .env("IDEM_FENCING_TOKEN", &token)
            .env("IDEM_IDEMPOTENCY_KEY", key.as_str())
            .env("IDEM_ATTEMPT", &attempt_no)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own process group: a terminal's Ctrl-C reaches the runner only, which decides what to do.
            .process_group(0)
            .kill_on_drop(true);
        cmd
    };
    let mut cmd = command(ctx.program.as_deref());
    let mut stop = ctx.stop.subscribe();
    let mut backoff = Duration::from_millis(20);
    let patience = Instant::now() + SPAWN_PATIENCE;
    let mut child = loop {
        match cmd.spawn() {
            Ok(c) => break c,
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
                    () = stopped(&mut stop, 1) => return Attempt::NotStarted,
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                if !heartbeat.fence(held).await {
                    return Attempt::Lost;
                }
            }
            // The program found at the start of the run is gone or changed: look it up again, as a shell would.
            Err(e) if ctx.program.is_some() && !runner_short_of_resources(&e) => {
                tracing::debug!("cannot start {}: {e}; looking it up in PATH again", argv[0]);
                cmd = command(None);
                match cmd.spawn() {
                    Ok(c) => break c,
                    Err(e) => return failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()),
                }
            }
            Err(e) => return failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()),
        }
    };
    // Listed with the watchdog from now until this attempt returns, on every path.
    let _watched = Watched::new(ctx.watchdog.as_ref(), child.id());
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
    // The lease is renewed beside the wait (not inside an arm of it), so a slow ledger never delays noticing
    // the command's exit, its timeout or a second Ctrl-C.
    let status = tokio::select! {
        status = child.wait() => status,
        () = heartbeat.until_lost(held) => {
            // Taken over, or the ledger unreachable until the lease lapsed: the item is no longer ours.
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Lost;
        }
        () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return failed("timeout", Vec::new());
        }
        () = stopped(&mut stop, 2) => {
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Interrupted;
        }
    };
    let stderr = stderr().await;
    let status = match status {
        Ok(s) => s,
        Err(e) => return failed("cannot wait for the command", e.to_string().into_bytes()),
    };
    if !status.success() {
        let _ = tokio::fs::remove_file(&temp).await;
        return failed(describe(status), stderr);
    }
    // The command is over: its slot goes to the next item while this output is verified, fsynced and renamed
    // (`--jobs` counts running commands, as GNU parallel's does). A failed command keeps its slot above, so a
    // failing item is retried, and found poison, before others start.
    *permit = None;
    // Without `--verify`, verifying, fsyncing and renaming take one trip to the blocking pool instead of two,
    // as long as the fence below holds when the rename comes (a lease set less than a third of its length ago).
    let fence_until = ctx.cfg.verify.is_none().then(|| heartbeat.sent() + lease / 3);
    let (path, checks, to, renamer) = (temp.clone(), ctx.checks.clone(), output.to_owned(), Arc::clone(&ctx.renamer));
    let mut finishing = tokio::task::spawn_blocking(move || {
        let digest =
            output::verify(&path, &checks).map_err(|why| Finish::Verify(format!("{why}: {}", why.remedy())))?;
        output::sync_file(&path).map_err(|e| Finish::Verify(format!("cannot fsync the output: {e}")))?;
        match fence_until {
            Some(until) if Instant::now() < until => {
                renamer.rename_into_place(&path, &to).map_err(|e| Finish::Rename(e.to_string()))?;
                Ok((digest, true))
            }
            _ => Ok((digest, false)),
        }
    });
    // Heartbeats go on while the output is read, digested and fsynced: a large output on a slow disk takes
    // longer than a short lease, and losing it there would discard every attempt. The blocking work cannot be
    // called off: a lease lost meanwhile is left to the fence before the rename, which then refuses.
    let finished = tokio::select! {
        done = &mut finishing => done,
        () = heartbeat.until_lost(held) => finishing.await,
    }
    .unwrap_or_else(|e| Err(Finish::Verify(e.to_string())));
    let digest = match finished {
        Ok((digest, true)) => return Attempt::Ok(digest),
        Ok((digest, false)) => digest,
        Err(Finish::Verify(why)) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed(format!("verify: {why}"), Vec::new());
        }
        Err(Finish::Rename(e)) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed("cannot rename the output into place", e.into_bytes());
        }
    };
    // `--verify` runs beside the heartbeat too; a lease lost meanwhile ends it (killed on drop).
    let verified = tokio::select! {
        verified = verify_cmd(ctx, &temp) => Some(verified),
        () = heartbeat.until_lost(held) => None,
    };
    match verified {
        Some(Ok(())) => {}
        Some(Err((ending, stderr))) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed(ending, stderr);
        }
        None => {
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Lost;
        }
    }
    // The fence, checked right before the rename: the lease must have at least two thirds of its length left.
    // A lease set less than a third of its length ago certainly has (short commands need no extra write);
    // otherwise renew it, and a holder that was taken over (its renewal refused) never puts its output in
    // place. Only a pause of a whole lease between this check and the rename, a few instructions later, could
    // slip through; the done write is fenced as well, and the next run would see the digest differ.
    if !heartbeat.fence(held).await {
        let _ = tokio::fs::remove_file(&temp).await;
        return Attempt::Lost;
    }
    let (from, to, renamer) = (temp.clone(), output.to_owned(), Arc::clone(&ctx.renamer));
    let why = match tokio::task::spawn_blocking(move || renamer.rename_into_place(&from, &to)).await {
        Ok(Ok(())) => return Attempt::Ok(digest),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    // A rename that failed (the final path is a directory, say) must not leave the temporary file behind.
    let _ = tokio::fs::remove_file(&temp).await;
    failed("cannot rename the output into place", why.into_bytes())
}

/// Why finishing an output failed on the blocking pool.
enum Finish {
    /// It did not verify or could not be fsynced: the temporary file is removed.
    Verify(String),
    /// The rename failed.
    Rename(String),
}

/// Runs `--verify` on `path`; `Err` carries the ending and standard error when it refuses.
pub(super) async fn verify_cmd<S>(ctx: &Ctx<S>, path: &Path) -> Result<(), (String, Vec<u8>)> {
    let Some(script) = &ctx.cfg.verify else { return Ok(()) };
    // Quoted for the shell: an output path is built from item text, which must never run as code.
    let quoted = format!("'{}'", path.display().to_string().replace('\'', "'\\''"));
    let script = script.replace("{out}", &quoted);
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("IDEM_OUTPUT", path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ("verify: cannot start sh".to_owned(), e.to_string().into_bytes()))?;
    if out.status.success() { Ok(()) } else { Err((format!("verify {}", describe(out.status)), out.stderr)) }
}
