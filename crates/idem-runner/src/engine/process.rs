//! One item from judgement to its end: judge, claim, wait for a slot, run one attempt, record; again after a
//! failure that may be retried, a lost lease or a claim refused.

use std::io::Write as _;
use std::sync::atomic::Ordering;
use std::time::Instant;

use idem_core::{Entry, FailureVerdict, ItemClaim, ItemKeys, Plan};
use idem_store::Store;

use super::attempt::{Attempt, attempt, verify_cmd};
use super::claim::{unclaim, wait_for_holder, wait_for_slot};
use super::judge::{Prefetched, dry_reason};
use super::outcome::{Final, poisoned};
use super::{Ctx, apply, now_ms};
use crate::heartbeat::Heartbeat;
use crate::output::{self, Digest256, Invalid};
use crate::{Item, OnPoison};

pub(super) async fn process<S: Store>(ctx: &Ctx<S>, item: &Item, mut prefetched: Prefetched) -> Result<Final, String> {
    let keys = ItemKeys::new(&ctx.job, &item.id);
    let output = ctx.cfg.output_path(&item.id);
    let mut waiting = false;
    let mut permit = None;
    let result = loop {
        let read = match prefetched.take() {
            Some(read) => read,
            None => ctx.store.get(keys.entry()).await.map_err(|e| format!("ledger read failed: {e}"))?,
        };
        let (generation, entry) = match read {
            Some(v) => {
                let entry = Entry::decode(v.value()).map_err(|e| format!("ledger entry unreadable: {e}"))?;
                (Some(v.generation()), Some(entry))
            }
            None => (None, None),
        };
        let plan = idem_core::plan(entry.as_ref(), ctx.limit);
        // Its last allowed attempt may still be running in another runner: "out of attempts" only once that
        // runner's lease is gone (it crashed), else wait for its result like any held item.
        if matches!(plan, Plan::Exhausted { .. })
            && matches!(entry, Some(Entry::Running { .. }))
            && !ctx.cfg.dry_run
            && ctx.store.get(keys.lease()).await.map_err(|e| format!("ledger read failed: {e}"))?.is_some()
        {
            if wait_for_holder(ctx, &mut waiting).await {
                break Final::NotDone { reason: "interrupted" };
            }
            continue;
        }
        // What the output at its final path says, where the plan depends on it.
        let out_state = match &plan {
            Plan::New => {
                let (path, checks) = (output.clone(), ctx.checks.clone());
                match tokio::task::spawn_blocking(move || output::verify(&path, &checks)).await {
                    Ok(Ok(digest)) => match verify_cmd(ctx, &output).await {
                        Ok(()) => Some(Ok(digest)),
                        Err(_) => Some(Err(Invalid::Unreadable("--verify refused it".into()))),
                    },
                    Ok(Err(why)) => Some(Err(why)),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Plan::CheckDone { sha256, size } => {
                let expected = Digest256 { sha256: sha256.clone(), size: *size };
                let path = output.clone();
                let got = tokio::task::spawn_blocking(move || output::matches(&path, &expected).map(|()| expected))
                    .await
                    .map_err(|e| e.to_string())?;
                Some(got)
            }
            _ => None,
        };
        if ctx.cfg.dry_run {
            let unit = out_state.as_ref().map(|r| r.as_ref().map(|_| ()).map_err(Clone::clone));
            // A running entry is only held while its lease lives: a crashed or interrupted holder's is not.
            let held = matches!(entry, Some(Entry::Running { .. }))
                && ctx.store.get(keys.lease()).await.map_err(|e| format!("ledger read failed: {e}"))?.is_some();
            if let Some(reason) = dry_reason(entry.as_ref(), &plan, &unit.unwrap_or(Ok(())), held) {
                if let Ok(mut out) = ctx.dry_out.lock() {
                    let _ = writeln!(out, "{}\t{}", item.id, reason);
                }
                break Final::WouldRun;
            }
        }
        match (&plan, out_state) {
            (Plan::New, Some(Ok(digest))) => {
                if ctx.cfg.dry_run {
                    if let Ok(mut out) = ctx.dry_out.lock() {
                        let _ = writeln!(out, "{}\tadopt: a verified output without a ledger entry", item.id);
                    }
                    break Final::Adopted { digest };
                }
                // A verified output nobody recorded (a lost ledger, or a run killed between rename and record).
                let write = idem_core::adopt(&keys, &digest.sha256, digest.size, now_ms());
                match apply(&ctx.store, write).await {
                    Ok(_) => break Final::Adopted { digest },
                    Err(e) if e.is_precondition_failed() => continue,
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
            }
            (Plan::CheckDone { .. }, Some(Ok(digest))) => break Final::Skipped { digest },
            (Plan::Poison { last_error }, _) => {
                break poisoned(ctx, item, entry.as_ref().map_or(0, Entry::attempts), last_error.clone());
            }
            (Plan::Exhausted { attempts, last_error }, _) => {
                break Final::Failed { attempts: *attempts, error: last_error.clone() };
            }
            _ => {}
        }
        if ctx.cfg.dry_run {
            break Final::WouldRun;
        }
        // It needs running. Claim it first and then wait for a slot: the claim's two commits (each waiting for
        // an fsync) then overlap the commands running, rather than keeping a slot idle (on a VM whose fsyncs
        // slowed down, claiming inside the slot cut the throughput by a third). At most `--jobs` items wait
        // claimed. A retry keeps the slot it had, so a failing item is retried (and found poison) before
        // other items start.
        let ahead = if permit.is_none() {
            match ctx.ahead.acquire().await {
                Ok(p) => Some(p),
                Err(_) => break Final::NotDone { reason: "not_started" },
            }
        } else {
            None
        };
        if ctx.stopping() {
            break Final::NotDone { reason: "not_started" };
        }
        let prev = match (generation, entry) {
            (Some(g), Some(e)) => Some((g, e)),
            _ => None,
        };
        let claim = ItemClaim::new(keys.clone(), &ctx.owner, now_ms(), ctx.cfg.lease, prev);
        let lease_sent = Instant::now();
        let lease_gen = match apply(&ctx.store, claim.lease_write()).await {
            Ok(Some(g)) => g,
            Ok(None) => return Err("ledger put returned no generation".into()),
            Err(e) if e.is_precondition_failed() => {
                // Another runner holds it: look again after a while (it may finish, or its lease may lapse).
                permit = None;
                drop(ahead);
                if wait_for_holder(ctx, &mut waiting).await {
                    break Final::NotDone { reason: "interrupted" };
                }
                continue;
            }
            Err(e) => return Err(format!("ledger write failed: {e}")),
        };
        let entry_gen = match apply(&ctx.store, claim.entry_write()).await {
            Ok(Some(g)) => g,
            Ok(None) => return Err("ledger put returned no generation".into()),
            Err(e) => {
                // Someone changed the entry between our read and our claim: give the lease back, judge again.
                let _ = apply(&ctx.store, claim.lease_release(lease_gen)).await;
                if e.is_precondition_failed() {
                    continue;
                }
                return Err(format!("ledger write failed: {e}"));
            }
        };
        if waiting {
            waiting = false;
            ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let previous = claim.previous_attempt();
        let mut held = claim.acquired(lease_gen, entry_gen);
        let mut heartbeat = Heartbeat::new(&ctx.store, ctx.cfg.lease, lease_sent);
        if permit.is_none() {
            match wait_for_slot(ctx, &mut held, &mut heartbeat).await {
                Ok(p) => permit = Some(p),
                Err(()) => {
                    // Stopping, or the claim was lost while it waited: it never started, so its attempt is
                    // given back (the undo is fenced on the claim's entry generation, so it changes nothing
                    // if another runner has claimed the item since).
                    heartbeat.settle(&mut held).await;
                    let _ = unclaim(ctx, &held).await;
                    drop(ahead);
                    if ctx.stopping() {
                        break Final::NotDone { reason: "not_started" };
                    }
                    continue;
                }
            }
            drop(ahead);
        }
        if let Some((owner, attempt)) = previous {
            // The previous holder crashed, lost its lease or was interrupted: its temporary file is ours to remove.
            let _ = tokio::fs::remove_file(output::temp_path(&output, &owner, attempt)).await;
        }
        ctx.executions.fetch_add(1, Ordering::Relaxed);
        ctx.counters.running.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let outcome = attempt(ctx, &mut held, &mut heartbeat, item, &output, &mut permit).await;
        ctx.counters.running.fetch_sub(1, Ordering::Relaxed);
        // A renewal still in flight is answered first: the release below is fenced on its generation.
        heartbeat.settle(&mut held).await;
        match outcome {
            Attempt::Ok(digest) => {
                let duration = started.elapsed();
                let write = held.done(&digest.sha256, digest.size, now_ms(), duration.as_millis() as u64);
                // Both fenced and independent, so they share one commit. If the done write is refused, giving
                // back the lease is still right: it was ours until now.
                let (done, _) = tokio::join!(apply(&ctx.store, write), apply(&ctx.store, held.release()));
                match done {
                    Ok(_) => break Final::Done { attempts: held.attempt(), digest, duration },
                    Err(e) if e.is_precondition_failed() => {
                        tracing::warn!(item = %item.id, "taken over before recording done; judging again");
                        continue;
                    }
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
            }
            Attempt::Failed { ending, stderr, message } => {
                ctx.counters.attempts_failed.fetch_add(1, Ordering::Relaxed);
                let fingerprint = idem_core::error_fingerprint(&ending, &stderr);
                let (write, verdict) = held.failed(&fingerprint, &message, now_ms(), ctx.limit);
                match apply(&ctx.store, write).await {
                    Ok(_) => {}
                    Err(e) if e.is_precondition_failed() => continue,
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
                let _ = apply(&ctx.store, held.release()).await;
                match verdict {
                    FailureVerdict::Retry => continue,
                    FailureVerdict::Poison => {
                        // It turned poison now: with --on-poison halt nothing new starts. One found poison by an
                        // earlier run (`Plan::Poison` above) halts nothing: it is a known fact, not a new failure,
                        // and halting every rerun before it ran anything would leave the rest undone for good.
                        if ctx.cfg.on_poison == OnPoison::Halt {
                            ctx.halt.store(true, Ordering::SeqCst);
                        }
                        break poisoned(ctx, item, held.attempt(), message);
                    }
                    FailureVerdict::Exhausted => break Final::Failed { attempts: held.attempt(), error: message },
                }
            }
            Attempt::Lost => {
                tracing::warn!(item = %item.id, "lease lost; the result of this attempt is discarded");
                continue;
            }
            Attempt::NotStarted => {
                // Stopped while it waited to start (the runner short of resources): nothing ran, so the claim is
                // undone as if it had never been made.
                let _ = unclaim(ctx, &held).await;
                break Final::NotDone { reason: "interrupted" };
            }
            Attempt::Interrupted => {
                // Killed by the operator (a second Ctrl-C, or SIGTERM), not by its own fault: the attempt is not
                // counted, so interrupting a run never uses up an item's retries (with `--retries 0` it would be
                // failed for good). But the entry says it was interrupted rather than going back to what it was:
                // the command may have written the final path itself, and with no entry that file would be
                // adopted as done. A crash still counts its attempts: the item may be what crashes the runner.
                let _ = apply(&ctx.store, held.interrupted(now_ms())).await;
                let _ = apply(&ctx.store, held.release()).await;
                break Final::NotDone { reason: "interrupted" };
            }
        }
    };
    if waiting {
        ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
    }
    Ok(result)
}
