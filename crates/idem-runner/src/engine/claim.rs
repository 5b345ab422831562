//! Claiming an item and waiting: for a slot while the claim is held, for another runner's holder to finish,
//! and giving back a claim whose command never started.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use idem_core::{Held, ItemClaim};
use idem_store::{Error as StoreError, Store};

use super::Ctx;
use super::stop::stopped;
use crate::ItemError;
use idem_store::LeaseKeeper;
use idem_store::StoreExt;

/// Waits for a free slot while holding a claim made ahead, its lease renewed beside the wait (a slow command can
/// keep every slot for longer than a lease). `Err` when the run is stopping or the lease was lost (taken over,
/// or the ledger unreachable until it lapsed): the caller gives the claim back.
pub(super) async fn wait_for_slot<'a, S: Store>(
    ctx: &'a Ctx<S>,
    held: &mut Held,
    heartbeat: &mut LeaseKeeper<'_, S>,
) -> Result<tokio::sync::SemaphorePermit<'a>, ()> {
    let permit = tokio::select! {
        p = ctx.jobs.acquire() => p.map_err(|_| ())?,
        _ = heartbeat.until_lost(held) => return Err(()),
    };
    if ctx.stopping() {
        return Err(());
    }
    // The fence before the command starts: a lease set more than a third of its length ago is renewed first,
    // so a runner that was taken over meanwhile never starts the command.
    if !heartbeat.fence(held).await {
        return Err(());
    }
    Ok(permit)
}

/// Gives back a claim whose command never started: the entry as it was, then the lease. (One whose command
/// started is given back with [`Held::interrupted`] instead.)
pub(super) async fn unclaim<S: Store>(ctx: &Ctx<S>, held: &Held) -> Result<(), StoreError> {
    ctx.store.apply(held.unclaim()).await?;
    ctx.store.apply(held.release()).await.map(|_| ())
}

/// Another runner holds the item: counts this one as waiting (once) and pauses a quarter lease (0.1..=2 s)
/// before the item is judged again. True when the run was interrupted meanwhile.
pub(super) async fn wait_for_holder<S>(ctx: &Ctx<S>, waiting: &mut bool) -> bool {
    if !*waiting {
        *waiting = true;
        ctx.counters.waiting.fetch_add(1, Ordering::Relaxed);
    }
    let pause = (ctx.cfg.lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut stop = ctx.stop.subscribe();
    tokio::select! {
        () = tokio::time::sleep(pause) => false,
        () = stopped(&mut stop, 1) => true,
    }
}

/// How a claim went.
// Made once per claim and taken apart at once: boxing `Held` would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Claimed {
    /// The lease and the entry are ours.
    Held {
        /// The claim, holding both generations its later writes are fenced on.
        held: Held,
        /// When the lease write was sent (the heartbeat counts the lease from there).
        lease_sent: Instant,
        /// The owner and attempt of the entry claimed over, when it was running or interrupted: its temporary
        /// file is ours to remove.
        previous: Option<(String, u32)>,
    },
    /// Another runner holds the lease.
    Refused,
    /// The entry changed between the judgement and the claim: the lease was given back; judge again.
    Changed,
}

/// Claims an item: its lease, then its entry (each conditional on what the judgement read).
pub(super) async fn claim<S: Store>(ctx: &Ctx<S>, claim: ItemClaim) -> Result<Claimed, ItemError> {
    let lease_sent = Instant::now();
    let lease_gen = match ctx.store.apply(claim.lease_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(ItemError::NoGeneration),
        Err(e) if e.is_precondition_failed() => return Ok(Claimed::Refused),
        Err(e) => return Err(ItemError::LedgerWrite(e)),
    };
    let entry_gen = match ctx.store.apply(claim.entry_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(ItemError::NoGeneration),
        Err(e) => {
            // Someone changed the entry between our read and our claim: give the lease back, judge again.
            let _ = ctx.store.apply(claim.lease_release(lease_gen)).await;
            if e.is_precondition_failed() {
                return Ok(Claimed::Changed);
            }
            return Err(ItemError::LedgerWrite(e));
        }
    };
    let previous = claim.previous_attempt();
    Ok(Claimed::Held { held: claim.acquired(lease_gen, entry_gen), lease_sent, previous })
}
