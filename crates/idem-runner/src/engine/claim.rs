//! Claiming an item and waiting: for a slot while the claim is held, for another runner's holder to finish,
//! and giving back a claim whose command never started.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use idem_core::ledger::{Claim, Held};
use idem_store::{Error as StoreError, Store};

use super::ctx::Ctx;
use super::ledger::{self, Waiting};
use super::room::Room;
use crate::error::ItemError;
use crate::output;
use idem_store::LeaseKeeper;

/// Waits for a free slot while holding a claim made ahead, its lease renewed beside the wait (a slow command can
/// keep every slot for longer than a lease). `Err` when the run is stopping or the lease was lost and could not
/// be taken again (taken over, or the store unavailable past the limit): the caller gives the claim back.
pub(super) async fn wait_for_slot<'a, S: Store>(
    ctx: &'a Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
) -> Result<tokio::sync::SemaphorePermit<'a>, ()> {
    let permit = loop {
        tokio::select! {
            p = ctx.jobs.acquire() => break p.map_err(|_| ())?,
            // Lost while waiting (a store outage, this runner paused): kept if nobody took the item over.
            _ = heartbeat.until_lost(held) => {
                if !ledger::recover(ctx, held, heartbeat).await {
                    return Err(());
                }
            }
        }
    };
    if ctx.stopping() {
        return Err(());
    }
    // The fence before the command starts: a lease set more than a third of its length ago is renewed first,
    // so a runner that was taken over meanwhile never starts the command.
    if !ledger::fence(ctx, held, heartbeat).await {
        return Err(());
    }
    Ok(permit)
}

/// Gives back a claim whose command never started: the entry as it was (when the attempt was counted), then
/// the lease. (One whose command started is given back with [`Held::interrupted`] instead.)
pub(super) async fn unclaim<S: Store>(ctx: &Ctx<S>, held: &Held) -> Result<(), StoreError> {
    if let Some(undo) = held.unclaim() {
        ledger::apply(ctx, Waiting::Unstarted, undo).await?;
    }
    ledger::apply(ctx, Waiting::Unstarted, held.release()).await.map(|_| ())
}

/// How counting an attempt went ([`count`]).
pub(super) enum Counted {
    /// The entry says this attempt runs; its generation is the fencing token.
    Yes,
    /// The entry changed since it was judged (another runner recorded or claimed the item meanwhile): the
    /// lease was given back; judge again.
    Changed,
}

/// Counts the attempt just before its command starts ([`Held::count`]), riding out an outage like every
/// ledger write. `Err` when the store stayed unavailable past the limit or the operator stopped the run while
/// it waited: the lease is left to lapse, and the entry is as it was unless the count landed unanswered; for
/// that case a note beside `output` ([`output::uncounted_path`]) lets the next run give the count back.
pub(super) async fn count<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
    output: Option<&Path>,
) -> Result<Counted, ItemError> {
    match ledger::apply(ctx, Waiting::Unstarted, held.count()).await {
        Ok(Some(g)) => {
            held.counted(g);
            if let Some(output) = output {
                // A note of an earlier count that went unanswered says nothing any more: that count can no longer
                // land (it was fenced on a generation this one moved past), or it did and was given back.
                let _ = tokio::fs::remove_file(output::uncounted_path(output)).await;
            }
            Ok(Counted::Yes)
        }
        Ok(None) => Err(ItemError::NoGeneration),
        Err(e) if e.is_precondition_failed() => {
            ledger::await_renewal(ctx, held, heartbeat).await;
            let _ = ledger::apply(ctx, Waiting::Unstarted, held.release()).await;
            Ok(Counted::Changed)
        }
        Err(e) => {
            if e.is_unavailable()
                && let Some(output) = output
            {
                // Given up unanswered: the count may still land (a stopped server takes it once it is
                // continued, after this run ended), counting an attempt whose command never started.
                let note = output::uncounted_path(output);
                let uncounted = output::Uncounted {
                    owner: ctx.owner.clone(),
                    attempt: held.attempt(),
                    prior: held.prior().cloned(),
                };
                let written = tokio::task::spawn_blocking(move || output::write_uncounted(&note, &uncounted)).await;
                if !matches!(written, Ok(Ok(()))) {
                    tracing::warn!(key = %held.keys().entry(), "cannot note an unanswered count: if it landed, the attempt counts");
                }
            }
            Err(ItemError::LedgerWrite(e))
        }
    }
}

/// Another runner holds the item: counts this one as waiting (once) and pauses a quarter lease (0.1..=2 s)
/// before the item is judged again. From a queue, its message is set aside meanwhile ([`Room::set_aside`]):
/// redeliveries of a killed consumer's messages, whose items its leases still hold, must not fill every place
/// the run has for messages while others could run. True when the run was interrupted meanwhile.
pub(super) async fn wait_for_holder<S>(ctx: &Ctx<S>, waiting: &mut bool, room: Option<&mut Room>) -> bool {
    if !*waiting {
        *waiting = true;
        ctx.counters.waiting.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(room) = room {
        room.set_aside();
    }
    let pause = (ctx.cfg.lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
    tokio::select! {
        () = tokio::time::sleep(pause) => false,
        () = ctx.stop.reached(1) => true,
    }
}

/// How a claim went.
// Made once per claim and taken apart at once: boxing `Held` would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Claimed {
    /// The lease and the entry are ours.
    Held {
        /// The claim: the lease's generation, and the entry as read, which the count is fenced on.
        held: Held,
        /// When the lease write was sent (the heartbeat counts the lease from there).
        lease_sent: Instant,
        /// The owner and attempt of the entry claimed over, when it was running or interrupted: its temporary
        /// file is ours to remove.
        previous: Option<(String, u32)>,
    },
    /// Another runner holds the lease.
    Refused,
    /// The entry changed since it was judged: the lease was given back; judge again.
    Changed,
}

/// Claims an item: its lease (conditional on there being none). The attempt is counted in the entry only
/// just before the command starts ([`count`]). While the store is unavailable the claim waits for it
/// ([`ledger::apply`]): nothing new is claimed during an outage.
pub(super) async fn claim<S: Store>(ctx: &Ctx<S>, claim: Claim) -> Result<Claimed, ItemError> {
    let (lease_gen, lease_sent) = match ledger::apply_sent(ctx, Waiting::Unstarted, claim.lease_write()).await {
        Ok((Some(g), sent)) => (g, sent),
        Ok((None, _)) => return Err(ItemError::NoGeneration),
        Err(e) if e.is_precondition_failed() => return Ok(Claimed::Refused),
        Err(e) => return Err(ItemError::LedgerWrite(e)),
    };
    // The judgement may be stale (an entry read ahead with its chunk, before another runner counted an attempt
    // of its own; that runner's lease lapsed in an outage since). Held on a stale view until a slot is free, the
    // lease would keep that runner from taking its lease again (`ledger::regain` sees another's lease and
    // discards an attempt nobody else will run): so the entry is read again now, and a changed one gives the
    // lease back at once and is judged again.
    let entry = ledger::get(ctx, Waiting::Unstarted, claim.keys().entry()).await;
    let current = match entry {
        Ok(entry) => entry.map(|v| v.generation()),
        Err(e) => {
            let _ = ledger::apply(ctx, Waiting::Unstarted, claim.lease_release(lease_gen)).await;
            return Err(ItemError::LedgerRead(e));
        }
    };
    if current != claim.judged_generation() {
        let _ = ledger::apply(ctx, Waiting::Unstarted, claim.lease_release(lease_gen)).await;
        return Ok(Claimed::Changed);
    }
    let previous = claim.previous_attempt();
    Ok(Claimed::Held { held: claim.leased(lease_gen), lease_sent, previous })
}
