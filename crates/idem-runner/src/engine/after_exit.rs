//! Settling an attempt whose command exited 0: verify its output (and `--verify`), fsync it, fence the lease
//! and rename it into place ([`finish`]); then record how the attempt ended in the ledger ([`record_attempt`]).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::ledger::{Failure, Held};
use idem_store::{Jitter, RetryPolicy, Store};

use super::claim::unclaim;
use super::ctx::{Ctx, now_ms};
use super::ledger::{self, Waiting};
use super::outcome::{Final, poisoned};
use super::step::{Attempt, Step, failed};
use super::verify::verify_cmd;
use crate::config::OnPoison;
use crate::error::ItemError;
use crate::items::Item;
use crate::output;
use idem_store::LeaseKeeper;

/// Verifies the output the command wrote to `temp`, fsyncs it, and renames it to `output` behind the fence,
/// with the lease renewed beside each step.
pub(super) async fn finish<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    temp: &Path,
    output: &Path,
) -> Attempt {
    // Without `--verify`, verifying, fsyncing and renaming take one trip to the blocking pool instead of two,
    // as long as the fence below holds when the rename comes (a lease set less than a third of its length ago).
    let fence_until = ctx.cfg.verify.is_none().then(|| heartbeat.sent().into_std() + held.length() / 3);
    let (path, checks, to, renamer) =
        (temp.to_owned(), ctx.checks.clone(), output.to_owned(), Arc::clone(&ctx.renamer));
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
        _ = heartbeat.until_lost(held) => finishing.await,
    }
    .unwrap_or_else(|e| Err(Finish::Verify(e.to_string())));
    let digest = match finished {
        Ok((digest, true)) => return Attempt::Ok(digest),
        Ok((digest, false)) => digest,
        Err(Finish::Verify(why)) => {
            let _ = tokio::fs::remove_file(temp).await;
            return failed(format!("verify: {why}"), Vec::new());
        }
        Err(Finish::Rename(e)) => {
            let _ = tokio::fs::remove_file(temp).await;
            return failed("cannot rename the output into place", e.into_bytes());
        }
    };
    // `--verify` runs beside the heartbeat too. It only reads the output, so a lease lost meanwhile (taken
    // over, or lapsed in a store outage) lets it finish: the fence below decides whether the lease is ours again.
    let verify = verify_cmd(ctx, temp);
    tokio::pin!(verify);
    let verified = tokio::select! {
        verified = &mut verify => verified,
        _ = heartbeat.until_lost(held) => verify.await,
    };
    if let Err((ending, stderr)) = verified {
        let _ = tokio::fs::remove_file(temp).await;
        return failed(ending, stderr);
    }
    // The fence, checked right before the rename: the lease must have at least two thirds of its length left.
    // A lease set less than a third of its length ago certainly has (short commands need no extra write);
    // otherwise renew it, and a holder that was taken over (its renewal refused) never puts its output in
    // place. Only a pause of a whole lease between this check and the rename, a few instructions later, could
    // slip through; the done write is fenced as well, and the next run would see the digest differ.
    // The planted bug "runner-fence" (idem-verify, debug builds only): the fence not checked.
    if !idem_core::planted("runner-fence") && !ledger::fence(ctx, held, heartbeat).await {
        let unreachable = ctx.outage.exceeded() || (ctx.stop.level() >= 2 && ctx.outage.ongoing());
        tracing::debug!(unreachable, "the fence before the rename failed");
        if unreachable && keep_unrecorded(ctx, held, temp, output, &digest).await {
            // Not taken over: the store stayed unreachable past the limit (or the operator stopped the run during
            // an outage), so the lease could not be renewed.
            // The verified output stays at its temporary path with a note of its digest, for the next holder
            // to put in place and record done instead of running the item again (`adopt_noted`).
            return Attempt::Unrecorded;
        }
        let _ = tokio::fs::remove_file(temp).await;
        return Attempt::Lost;
    }
    let (from, to, renamer) = (temp.to_owned(), output.to_owned(), Arc::clone(&ctx.renamer));
    let why = match tokio::task::spawn_blocking(move || renamer.rename_into_place(&from, &to)).await {
        Ok(Ok(())) => return Attempt::Ok(digest),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    // A rename that failed (the final path is a directory, say) must not leave the temporary file behind.
    let _ = tokio::fs::remove_file(temp).await;
    failed("cannot rename the output into place", why.into_bytes())
}

/// Leaves a verified output the run could not put in place (the store unreachable past the limit) at its
/// temporary path, with a note of its digest beside the final path ([`output::unrecorded_path`]). False when
/// the note could not be written: the caller removes the output, and the item runs again.
async fn keep_unrecorded<S>(ctx: &Ctx<S>, held: &Held, temp: &Path, output: &Path, digest: &output::Digest256) -> bool {
    let note = output::unrecorded_path(output, &ctx.owner, held.attempt());
    let noted = digest.clone();
    matches!(tokio::task::spawn_blocking(move || output::write_unrecorded(&note, &noted)).await, Ok(Ok(())))
        && temp.exists()
}

/// Why finishing an output failed on the blocking pool.
enum Finish {
    /// It did not verify or could not be fsynced: the temporary file is removed.
    Verify(String),
    /// The rename failed.
    Rename(String),
}

/// Records how an attempt ended in the ledger (done, failed, interrupted, or nothing when the lease was
/// lost) and gives back the lease; says what comes next.
pub(super) async fn record_attempt<S: Store>(
    ctx: &Ctx<S>,
    item: &Item,
    held: &Held,
    outcome: Attempt,
    started: Instant,
) -> Result<Step, ItemError> {
    let end = |fin| Ok(Step::End(fin));
    match outcome {
        Attempt::Ok(digest) => record_done(ctx, item, held, digest, started, true).await,
        // The check found the effect before any command ran: recorded done as a success is.
        Attempt::AlreadyThere => record_done(ctx, item, held, output::Digest256::nothing(), started, false).await,
        Attempt::Failed { ending, stderr, message } => {
            ctx.counters.attempts_failed.fetch_add(1, Ordering::Relaxed);
            let mut fingerprint = idem_core::ledger::error_fingerprint(&ending, &stderr);
            if looks_transient(&ending, &stderr) {
                // Never the same twice, so never poison: a transient error met again is an outage that lasts,
                // not the item's fault. It spends the item's retries, and an item out of them is failed (a
                // rerun with a higher --retries gives it more), not poison (kept until forgotten).
                fingerprint.push_str(&format!(" [transient, attempt {}]", held.attempt()));
            }
            let (write, verdict) = held.failed(&fingerprint, &message, now_ms(), ctx.limit);
            match ledger::apply(ctx, Waiting::Started, write).await {
                Ok(_) => {}
                Err(e) if e.is_precondition_failed() => return Ok(Step::Judge),
                Err(e) => return Err(ItemError::LedgerWrite(e)),
            }
            let _ = ledger::apply(ctx, Waiting::Started, held.release()).await;
            match verdict {
                Failure::Retry => {
                    pause_before_retry(ctx, held.attempt()).await;
                    Ok(Step::Judge)
                }
                Failure::Poison => {
                    // It turned poison now: with --on-poison halt nothing new starts. One found poison by an
                    // earlier run (`Plan::Poison` in the judgement) halts nothing: it is a known fact, not a new
                    // failure, and halting every rerun before it ran anything would leave the rest undone for
                    // good.
                    if ctx.cfg.on_poison == OnPoison::Halt {
                        ctx.halt.store(true, Ordering::SeqCst);
                    }
                    end(poisoned(ctx, item, held.attempt(), message))
                }
                Failure::Exhausted => end(Final::Failed { attempts: held.attempt(), error: message }),
            }
        }
        Attempt::Lost => {
            tracing::warn!(item = %item.id, "lease lost; the result of this attempt is discarded");
            Ok(Step::Judge)
        }
        Attempt::Abandoned => {
            tracing::warn!(
                item = %item.id,
                "the command was stopped for its lease and is killed: the store stayed unavailable past \
                 --store-outage-limit (the attempt counts)"
            );
            end(Final::NotDone { reason: "store_unavailable" })
        }
        Attempt::Unrecorded => {
            tracing::warn!(
                item = %item.id,
                "the output is verified but the store is unreachable: kept with a note for the next run to record"
            );
            end(Final::NotDone { reason: "store_unavailable" })
        }
        Attempt::NotStarted => {
            // Stopped while it waited to start (the runner short of resources): nothing ran, so the claim is
            // undone as if it had never been made.
            let _ = unclaim(ctx, held).await;
            end(Final::NotDone { reason: "interrupted" })
        }
        Attempt::Interrupted => {
            // Killed by the operator (a second Ctrl-C, or SIGTERM), not by its own fault: the attempt is not
            // counted, so interrupting a run never uses up an item's retries (with `--retries 0` it would be
            // failed for good). But the entry says it was interrupted rather than going back to what it was:
            // the command may have written the final path itself, and with no entry that file would be
            // adopted as done. A crash still counts its attempts: the item may be what crashes the runner.
            let _ = ledger::apply(ctx, Waiting::Started, held.interrupted(now_ms())).await;
            let _ = ledger::apply(ctx, Waiting::Started, held.release()).await;
            end(Final::NotDone { reason: "interrupted" })
        }
    }
}

/// Records an attempt that succeeded (`ran`: its command ran; else `--check` found the effect first) done,
/// and gives back the lease.
async fn record_done<S: Store>(
    ctx: &Ctx<S>,
    item: &Item,
    held: &Held,
    digest: output::Digest256,
    started: Instant,
    ran: bool,
) -> Result<Step, ItemError> {
    let duration = started.elapsed();
    let write = held.done(&digest.sha256, digest.size, now_ms(), duration.as_millis() as u64);
    // Both fenced and independent, so they share one commit. If the done write is refused, giving
    // back the lease is still right: it was ours until now. In a store outage both wait for the store:
    // the output is in place, and the done write is fenced on the claim's entry generation, not the
    // lease, so it lands once the store is back unless someone took the item over.
    let (done, _) =
        tokio::join!(ledger::apply(ctx, Waiting::Started, write), ledger::apply(ctx, Waiting::Started, held.release()));
    match done {
        Ok(_) if !ran => Ok(Step::End(Final::Checked)),
        Ok(_) => Ok(Step::End(Final::Done { attempts: held.attempt(), digest, duration })),
        Err(e) if e.is_precondition_failed() => {
            tracing::warn!(item = %item.id, "taken over before recording done; judging again");
            Ok(Step::Judge)
        }
        Err(e) => {
            if e.is_unavailable()
                && let Some(output) = ctx.cfg.output_of(&item.id)
            {
                // The run gave up waiting for the store: leave the digest beside the output, for the
                // next holder to record it done instead of running the item again.
                let note = output::unrecorded_path(&output, &ctx.owner, held.attempt());
                let noted = digest.clone();
                let written = tokio::task::spawn_blocking(move || output::write_unrecorded(&note, &noted)).await;
                if !matches!(written, Ok(Ok(()))) {
                    tracing::warn!(item = %item.id, "cannot note the unrecorded output: it runs again");
                }
            }
            Err(ItemError::LedgerWrite(e))
        }
    }
}

/// The longest pause before a retry, however many attempts failed (unless `--retry-delay` is longer).
const RETRY_DELAY_CAP: Duration = Duration::from_secs(300);

/// The pause before retrying an item whose attempt number `failed` failed: `--retry-delay` doubled for each
/// earlier failure, capped at [`RETRY_DELAY_CAP`] (or `--retry-delay` when that is longer), drawn up to half
/// again as long ([`Jitter::Above`]) so items that failed together (a sink down for a moment) do not all come
/// back at once. Never shorter than that: two attempts that meet the same error, and so make the item poison,
/// are always at least the delay apart (an outage shorter than `--retry-delay` cannot make an item poison).
pub(crate) fn retry_pause(retry_delay: Duration, failed: u32) -> Duration {
    RetryPolicy::new()
        .with_base_delay(retry_delay)
        .with_max_delay(RETRY_DELAY_CAP.max(retry_delay))
        .with_jitter(Jitter::Above)
        .pause_after(failed)
}

/// Whether a failure looks transient, so that meeting it again never makes the item poison: the command exited
/// 75 (EX_TEMPFAIL, sysexits.h's "try again later"), or the last line of its standard error says the peer was
/// unreachable or overloaded for now: connection refused or reset, could not connect, timed out, temporarily
/// unavailable, temporary failure (of name resolution), service unavailable, too many requests, try again,
/// or an HTTP status 429, 502, 503 or 504 on its own (curl's `returned error: 503`).
pub(crate) fn looks_transient(ending: &str, stderr: &[u8]) -> bool {
    if ending == "exit 75" {
        return true;
    }
    let text = String::from_utf8_lossy(stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("").to_ascii_lowercase();
    const WORDS: &[&str] = &[
        "connection refused",
        "connection reset",
        "couldn't connect",
        "could not connect",
        "failed to connect",
        "timed out",
        "temporarily unavailable",
        "temporary failure",
        "service unavailable",
        "too many requests",
        "try again",
    ];
    WORDS.iter().any(|w| last.contains(w))
        || last.split(|c: char| !c.is_ascii_alphanumeric()).any(|t| matches!(t, "429" | "502" | "503" | "504"))
}

/// Waits [`retry_pause`] before an item's next attempt, as Airflow's `retry_delay` with
/// `retry_exponential_backoff` does: a transient failure (a sink restarting, a 503) would otherwise be met
/// again within milliseconds, and the same error twice makes the item poison. The lease is given back
/// already; the item keeps its slot (a failing item is retried before others start). A stop (Ctrl-C, a poison
/// item halting the run, a store outage past its limit) ends the wait: the retry then does not start.
async fn pause_before_retry<S>(ctx: &Ctx<S>, failed: u32) {
    pause_until(ctx, tokio::time::Instant::now() + retry_pause(ctx.cfg.retry_delay, failed)).await;
}

/// Waits until `until`, or less when the run stops (Ctrl-C, a poison item halting it, a store outage past its
/// limit).
pub(super) async fn pause_until<S>(ctx: &Ctx<S>, until: tokio::time::Instant) {
    // A halt is a flag, not a signal: looked at every 100 ms.
    while !ctx.stopping() && tokio::time::Instant::now() < until {
        let next = until.min(tokio::time::Instant::now() + Duration::from_millis(100));
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = ctx.stop.reached(1) => break,
        }
    }
}

/// What [`noted_output`] found of an attempt that may have ended unrecorded.
pub(super) enum Noted {
    /// The noted output is in place with its digest (moved there from the temporary path if it was left there);
    /// the note's path, to remove once the item is recorded done.
    Found(output::Digest256, std::path::PathBuf),
    /// No note: the attempt did not end unrecorded here (it crashed, was interrupted, or the job has no output).
    None,
    /// A note, but nothing it can vouch for: why, for the item's error. The note and the attempt's temporary
    /// file are removed: the item runs again if it has attempts left.
    Unusable(String),
}

/// The output an attempt that ended unrecorded left behind, noted with its digest
/// ([`output::unrecorded_path`]): at the final path (its runner put it in place, then gave up waiting for the
/// store to record it), or at that attempt's temporary path (the store was unreachable before the rename: it is
/// renamed into place now). The caller holds the item (its lease, or the previous holder is gone and the entry
/// write that follows is fenced on that holder's entry).
pub(super) async fn noted_output<S>(ctx: &Ctx<S>, output: Option<&Path>, previous: &(String, u32)) -> Noted {
    let Some(output) = output else {
        // No output, no note: an attempt that ended unrecorded runs again (with the same IDEM_KEY).
        return Noted::None;
    };
    let note = output::unrecorded_path(output, &previous.0, previous.1);
    let temp = output::temp_path(output, &previous.0, previous.1);
    let (path, read, renamer) = (output.to_owned(), note.clone(), Arc::clone(&ctx.renamer));
    let found = tokio::task::spawn_blocking(move || {
        if !read.exists() {
            return Ok(None);
        }
        let Some(digest) = output::read_unrecorded(&read) else {
            return Err("its note does not hold a digest".to_owned());
        };
        if output::matches(&path, &digest).is_ok() {
            return Ok(Some(digest));
        }
        match output::matches(&temp, &digest) {
            Ok(()) => {}
            Err(output::Invalid::Missing) => return Err("the output it noted is gone".to_owned()),
            Err(e) => return Err(format!("the output it noted changed: {e}")),
        }
        let moved = renamer
            .rename_into_place(&temp, &path)
            .and_then(|()| output::matches(&path, &digest).map_err(|e| std::io::Error::other(e.to_string())));
        moved.map(|()| Some(digest)).map_err(|e| format!("its noted output could not be put in place: {e}"))
    })
    .await
    .unwrap_or_else(|e| Err(format!("reading its note failed: {e}")));
    match found {
        Ok(Some(digest)) => Noted::Found(digest, note),
        Ok(None) => Noted::None,
        Err(why) => {
            let _ = tokio::fs::remove_file(&note).await;
            let _ = tokio::fs::remove_file(output::temp_path(output, &previous.0, previous.1)).await;
            Noted::Unusable(format!("attempt {} exited 0 but was left unrecorded, and {why}", previous.1))
        }
    }
}

/// Right after a claim over an attempt that ended unrecorded ([`noted_output`]): the output recorded done
/// instead of running the item again. `None` when there is nothing to adopt.
pub(super) async fn adopt_unrecorded<S: Store>(
    ctx: &Ctx<S>,
    held: &Held,
    output: Option<&Path>,
    previous: &(String, u32),
) -> Option<Result<Step, ItemError>> {
    let Noted::Found(digest, note) = noted_output(ctx, output, previous).await else { return None };
    let write = held.done(&digest.sha256, digest.size, now_ms(), 0);
    let (done, _) = tokio::join!(
        ledger::apply(ctx, Waiting::Unstarted, write),
        ledger::apply(ctx, Waiting::Unstarted, held.release())
    );
    Some(match done {
        Ok(_) => {
            let _ = tokio::fs::remove_file(&note).await;
            Ok(Step::End(Final::Adopted { digest }))
        }
        Err(e) if e.is_precondition_failed() => Ok(Step::Judge),
        Err(e) => Err(ItemError::LedgerWrite(e)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_pause_doubles_with_jitter_and_is_capped() {
        // Drawn at random within [floor, floor * 3/2]: many draws, each inside, the spread seen.
        let within = |base: Duration, failed: u32, floor: Duration| {
            let draws: Vec<Duration> = (0..200).map(|_| retry_pause(base, failed)).collect();
            assert!(draws.iter().all(|d| *d >= floor && *d <= floor * 3 / 2), "{floor:?}: {draws:?}");
            draws
        };
        let base = Duration::from_secs(1);
        let first = within(base, 1, base);
        assert!(first.iter().any(|d| *d > base * 5 / 4), "jitter above the floor");
        within(base, 3, base * 4);
        within(base, 30, RETRY_DELAY_CAP);
        within(Duration::from_secs(600), 4, Duration::from_secs(600));
        assert_eq!(retry_pause(Duration::ZERO, 5), Duration::ZERO);
    }

    #[test]
    fn transient_failures_are_told_by_exit_75_or_their_last_line() {
        for (ending, stderr) in [
            ("exit 75", ""),
            ("exit 7", "curl: (7) Failed to connect to 127.0.0.1 port 9: Connection refused"),
            ("exit 22", "curl: (22) The requested URL returned error: 503"),
            ("exit 1", "psql: error: connection to server failed: Connection refused\n"),
            ("exit 1", "first line\nread: Connection reset by peer"),
            ("exit 1", "Temporary failure in name resolution"),
            ("exit 1", "HTTP 429 Too Many Requests"),
        ] {
            assert!(looks_transient(ending, stderr.as_bytes()), "{ending}: {stderr}");
        }
        // Only the last line counts, and a status only as a number of its own.
        for (ending, stderr) in [
            ("exit 2", "No such file or directory"),
            ("timeout", ""),
            ("signal 9", ""),
            ("exit 1", "connection refused\nbut then: syntax error"),
            ("exit 1", "bad id 15030"),
        ] {
            assert!(!looks_transient(ending, stderr.as_bytes()), "{ending}: {stderr}");
        }
    }
}
