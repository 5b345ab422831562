//! One item from judgement to its end, as a loop over [`Step`]s: judge, claim, wait for a slot, run one
//! attempt, record it; then judge again after a failure that may be retried, a lost lease or a claim refused.

use std::sync::atomic::Ordering;
use std::time::Instant;

use idem_core::ledger::{Claim, Entry, Keys};
use idem_store::{Generation, Store};

use super::after_exit::{adopt_unrecorded, record_attempt};
use super::attempt::attempt;
use super::claim::{Claimed, Counted, claim, count, unclaim, wait_for_holder, wait_for_slot};
use super::ctx::{Ctx, now_ms};
use super::judge::judge;
use super::ledger;
use super::outcome::Final;
use super::room::Room;
use super::step::{ItemRun, Prefetched, Step};
use super::turns::Turn;
use crate::error::ItemError;
use crate::items::Item;
use crate::output;
use idem_store::LeaseKeeper;

/// Runs one item to its end in this run. `Err`: the ledger failed, which is not the item's doing.
pub(super) async fn process<S: Store>(
    ctx: &Ctx<S>,
    item: &Item,
    prefetched: Prefetched,
    room: Option<Room>,
    turn: Turn,
) -> Result<Final, ItemError> {
    let mut run = ItemRun {
        item,
        keys: Keys::new(&ctx.job, &item.id),
        output: ctx.cfg.output_of(&item.id),
        prefetched,
        waiting: false,
        text_sha256: crate::items::text_sha256(&item.raw),
        text_warned: false,
        permit: None,
        room,
        turn: Some(turn),
    };
    let result = steps(ctx, &mut run).await;
    if run.waiting {
        ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
    }
    match result {
        // The store stayed unavailable past --store-outage-limit (or the operator stopped the wait for it): the
        // item did not finish in this run, which is not its failure. Its attempts, if any ran, are in the ledger
        // as they were, and a rerun goes on from there.
        Err(e) if e.is_unavailable() => {
            Ok(Final::NotDone { reason: if ctx.stop.level() > 0 { "interrupted" } else { "store_unavailable" } })
        }
        other => other,
    }
}

/// The item's steps until it ends, or until the ledger fails (`Err`).
async fn steps<'a, S: Store>(ctx: &'a Ctx<S>, run: &mut ItemRun<'a>) -> Result<Final, ItemError> {
    let mut step = Step::Judge;
    loop {
        step = match step {
            Step::Judge => judge(ctx, run).await?,
            Step::WaitForHolder => {
                // Waiting for another runner's holder is no reason to hold back the items after this one.
                run.turn.take();
                match wait_for_holder(ctx, &mut run.waiting, run.room.as_mut()).await {
                    true => Step::End(Final::NotDone { reason: "interrupted" }),
                    false => Step::Judge,
                }
            }
            Step::Run(prev) => claim_and_run(ctx, run, prev).await?,
            Step::End(fin) => return Ok(fin),
        };
    }
}

/// Claims the item, waits for a slot, runs one attempt and records it.
///
/// It is claimed (its lease) first and then waits for a slot: the lease's commit (waiting for an fsync) then
/// overlaps the commands running, rather than keeping a slot idle (on a VM whose fsyncs slowed down, making
/// both claim writes inside the slot cut the throughput by a third). The attempt is counted in the entry only
/// once the slot is free, just before the command starts: a claim made ahead and given up without starting
/// (the run stopped, or the store unreachable past `--store-outage-limit`, when not even the lease can be given
/// back) then spends no attempt, whatever the store kept. At most `--jobs` items wait claimed. A retry keeps
/// the slot it had, so a failing item is retried (and found poison) before other items start.
async fn claim_and_run<'a, S: Store>(
    ctx: &'a Ctx<S>,
    run: &mut ItemRun<'a>,
    prev: Option<(Generation, Entry)>,
) -> Result<Step, ItemError> {
    // Not started because the run is stopping: an item whose earlier attempts failed says so (attempts, error),
    // as its entry does, rather than "not_started" with no attempts after its command ran.
    let unretried = match &prev {
        Some((_, Entry::Failed { attempts, last_error, .. })) => Some((*attempts, last_error.clone())),
        _ => None,
    };
    let not_started = || {
        Step::End(match &unretried {
            Some((attempts, error)) => Final::Unretried { attempts: *attempts, error: error.clone() },
            None => Final::NotDone { reason: "not_started" },
        })
    };
    let ahead = if run.permit.is_none() {
        // Queued for a claim in its turn, and the turn passed once it has its place in the (FIFO) queue.
        let mut acquire = std::pin::pin!(ctx.ahead.acquire());
        if let Some(turn) = &run.turn {
            turn.wait().await;
        }
        let first = futures_util::poll!(acquire.as_mut());
        run.turn.take();
        let acquired = match first {
            std::task::Poll::Ready(p) => p,
            std::task::Poll::Pending => acquire.await,
        };
        match acquired {
            Ok(p) => Some(p),
            Err(_) => return Ok(not_started()),
        }
    } else {
        None
    };
    if ctx.stopping() {
        return Ok(not_started());
    }
    let claim_ = Claim::new(run.keys.clone(), &ctx.owner, now_ms(), ctx.cfg.lease, prev)
        .with_item_sha256(run.text_sha256.clone());
    let (mut held, lease_sent, previous) = match claim(ctx, claim_).await? {
        Claimed::Held { held, lease_sent, previous } => (held, lease_sent, previous),
        Claimed::Refused => {
            // Another runner holds it: look again after a while (it may finish, or its lease may lapse).
            run.permit = None;
            drop(ahead);
            return Ok(Step::WaitForHolder);
        }
        Claimed::Changed => return Ok(Step::Judge),
    };
    if run.waiting {
        run.waiting = false;
        ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
    }
    if let Some(previous) = &previous
        && let Some(adopted) = adopt_unrecorded(ctx, &held, run.output.as_deref(), previous).await
    {
        drop(ahead);
        return adopted;
    }
    // A renewal unanswered when the lease lapses is waited for, not dropped (`ledger::recover`).
    let mut heartbeat = LeaseKeeper::new(&ctx.store, ctx.cfg.lease, lease_sent).keeping_late_answers();
    if run.permit.is_none() {
        match wait_for_slot(ctx, &mut held, &mut heartbeat).await {
            Ok(p) => run.permit = Some(p),
            Err(()) => {
                // Stopping, or the claim was lost while it waited: it never started, so its attempt is given
                // back (the undo is fenced on the claim's entry generation, so it changes nothing if another
                // runner has claimed the item since).
                ledger::await_renewal(ctx, &mut held, &mut heartbeat).await;
                let _ = unclaim(ctx, &held).await;
                drop(ahead);
                return Ok(if ctx.stopping() { not_started() } else { Step::Judge });
            }
        }
        drop(ahead);
    }
    // Counted only now, just before the command starts: a claim given up before this point (the run stopped,
    // the store unreachable past the limit, so not even the lease could be given back) spent no attempt.
    if ctx.stopping() {
        ledger::await_renewal(ctx, &mut held, &mut heartbeat).await;
        let _ = unclaim(ctx, &held).await;
        return Ok(not_started());
    }
    match count(ctx, &mut held, &mut heartbeat, run.output.as_deref()).await? {
        Counted::Yes => {}
        Counted::Changed => return Ok(Step::Judge),
    }
    if let (Some((owner, attempt)), Some(output)) = (previous, &run.output) {
        // The previous holder crashed, lost its lease or was interrupted: its temporary file is ours to remove.
        let _ = tokio::fs::remove_file(output::temp_path(output, &owner, attempt)).await;
    }
    ctx.executions.fetch_add(1, Ordering::Relaxed);
    ctx.counters.running.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let outcome = attempt(ctx, &mut held, &mut heartbeat, run.item, run.output.as_deref(), &mut run.permit).await;
    ctx.counters.running.fetch_sub(1, Ordering::Relaxed);
    // A renewal still in flight is answered first: the release below is fenced on its generation.
    ledger::await_renewal(ctx, &mut held, &mut heartbeat).await;
    record_attempt(ctx, run.item, &held, outcome, started).await
}
