//! One attempt at one held item: spawn the command in its own process group, wait for it beside the
//! heartbeat, its timeout and a second Ctrl-C, then verify, fsync, fence and rename its output into place.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::ledger::Held;
use idem_store::LeaseKeeper;
use idem_store::{Jitter, RetryPolicy, Store};
use tokio::io::AsyncWriteExt;

use super::ctx::Ctx;
use super::step::{Attempt, describe, failed};
use super::{after_exit, ledger};
use crate::items::Item;
use crate::output;
use crate::supervise::{self, Event, Freeze, Group, OnLapse};

/// How long an attempt keeps trying to start its command while the runner is short of file descriptors or
/// processes, before it counts as the item's failure (a limit too low for even one command must end the run).
const SPAWN_PATIENCE: Duration = Duration::from_secs(30);

/// A spawn that failed for want of the runner's resources (descriptors, processes, memory), not the command's.
fn runner_short_of_resources(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e).is_some_and(|n| [Errno::MFILE, Errno::NFILE, Errno::AGAIN, Errno::NOMEM].contains(&n))
}

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
    output: Option<&Path>,
    permit: &mut Option<tokio::sync::SemaphorePermit<'_>>,
) -> Attempt {
    let Some(output) = output else {
        return without_output(ctx, held, heartbeat, item, permit).await;
    };
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
    // Listed with the watchdog from now until this attempt returns, on every path.
    let mut group = match spawn(ctx, held, heartbeat, item, &temp).await {
        Ok(group) => group,
        Err(ended) => return ended,
    };
    if let Err(ended) = wait(ctx, held, heartbeat, item, &mut group, &temp).await {
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
    let checked = ctx.cfg.done_by() == crate::config::DoneBy::Check;
    if checked {
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
    let mut group = match spawn(ctx, held, heartbeat, item, Path::new("")).await {
        Ok(group) => group,
        Err(ended) => return ended,
    };
    if let Err(ended) = wait(ctx, held, heartbeat, item, &mut group, Path::new("")).await {
        return ended;
    }
    drop(group);
    *permit = None;
    if checked {
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
async fn spawn<'c, S: Store>(
    ctx: &'c Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    item: &Item,
    temp: &Path,
) -> Result<Group<'c>, Attempt> {
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
            .stderr(Stdio::piped());
        cmd
    };
    let cannot_start = |e: std::io::Error| Err(failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()));
    let mut cmd = command(ctx.program.as_deref());
    // 20 ms doubling up to 1 s, exactly: a poll for descriptors or processes that running commands give back.
    let polls = RetryPolicy::new()
        .with_base_delay(Duration::from_millis(20))
        .with_max_delay(Duration::from_secs(1))
        .with_jitter(Jitter::None);
    let mut waits = 0;
    let patience = Instant::now() + SPAWN_PATIENCE;
    loop {
        match Group::spawn(&mut cmd, ctx.watchdog.as_ref()) {
            Ok(group) => return Ok(group),
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
                waits += 1;
                tokio::select! {
                    () = tokio::time::sleep(polls.pause_after(waits)) => {}
                    () = ctx.stop.reached(1) => return Err(Attempt::NotStarted),
                }
                if !ledger::fence(ctx, held, heartbeat).await {
                    return Err(Attempt::Lost);
                }
            }
            // The program found at the start of the run is gone or changed: look it up again, as a shell would.
            Err(e) if ctx.program.is_some() && !runner_short_of_resources(&e) => {
                tracing::debug!("cannot start {}: {e}; looking it up in PATH again", argv[0]);
                cmd = command(None);
                return Group::spawn(&mut cmd, ctx.watchdog.as_ref()).or_else(cannot_start);
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
    group: &mut Group<'_>,
    temp: &Path,
) -> Result<(), Attempt> {
    if let Some(mut stdin) = group.child().stdin.take() {
        let mut input = item.raw.clone().into_bytes();
        input.push(b'\n');
        // A command that never reads its input closes the pipe; that is not an error.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await;
        });
    }
    let stderr = supervise::Bytes::read(group.child().stderr.take());
    // The command is stopped this long before its lease would lapse with no renewal accepted: past that
    // instant another runner may take the item over, and the two commands must not run side by side. It goes
    // on once a renewal is accepted, or the lease was taken again.
    let margin = (heartbeat.length() / 5).clamp(Duration::from_millis(200), Duration::from_secs(2));
    // Stopped for its lease, and the store stayed unavailable past the limit: the run ends, and the command
    // may not go on without a lease (another runner may take the item once the store is back).
    let give_up = || ctx.outage.exceeded();
    let mut watch = supervise::Watch {
        label: &item.id,
        on_lapse: OnLapse::Freeze(Freeze {
            margin,
            stopped: &ctx.counters.stopped,
            give_up: &give_up,
            // The planted bug "runner-fence", its other half: a lost lease never noticed while the command runs.
            notice_loss: !idem_core::planted("runner-fence"),
        }),
        deadline: ctx.cfg.timeout.map(|t| tokio::time::Instant::now() + t),
        interrupt: std::pin::pin!(ctx.stop.reached(2)),
    };
    let status = loop {
        let ended = match group.watch(heartbeat, held, &mut watch).await {
            Event::Exited(status) => break status,
            Event::Lost(_) => {
                if ledger::recover(ctx, held, heartbeat).await {
                    continue;
                }
                tracing::debug!(item = %item.id, "the lease was lost while the command ran, and not taken again");
                group.kill().await;
                if ctx.outage.exceeded() { Attempt::Abandoned } else { Attempt::Lost }
            }
            Event::GaveUp => Attempt::Abandoned,
            Event::TimedOut => failed("timeout", Vec::new()),
            Event::Interrupted => Attempt::Interrupted,
        };
        let _ = tokio::fs::remove_file(temp).await;
        return Err(ended);
    };
    let stderr = stderr.take().await;
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
