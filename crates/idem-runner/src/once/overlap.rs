//! A slot under an overlap policy other than `allow` ([`idem_core::slot::Overlap`]): the invocation takes the
//! slot's lease and writes a `waiting` entry first (no attempt counted), then judges the earlier slots whose
//! lease is live ([`idem_core::slot::overlap`]): runs, gives the slot back (`skip`), records it skipped
//! (`buffer-one`, one already waits) or waits, renewing its lease, until they ended (`buffer-*`). Taking the
//! lease before looking makes two slots that look at once see each other, and only earlier slots count: of
//! the two, the later one yields.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::slot::{self, OverlapPlan};
use idem_store::{Generation, Store, StoreExt};

use super::record::{self, list_all};
use super::{Error, OnceConfig, Outcome, millis};
use crate::supervise::{host_name, owner_token};

/// What the turn came to.
pub(super) enum Turn {
    /// The slot is held (entry `running`, attempt 1): run it. The instant is when its lease was last renewed.
    Held(Box<slot::Held>, tokio::time::Instant),
    /// Nothing runs here.
    Done(Outcome),
    /// Another invocation changed the slot meanwhile: judge it again.
    Changed,
}

/// Takes the slot of `keys` (its entry `entry`, none or a lapsed waiter's) in its turn under `cfg.overlap`.
pub(super) async fn take_turn<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    keys: &slot::Keys,
    entry: Option<(Generation, slot::Entry)>,
    now_ms: u64,
    mut interrupt: Pin<&mut impl Future<Output = ()>>,
) -> Result<Turn, Error> {
    let claim = slot::Claim::new(keys.clone(), owner_token(), host_name(), now_ms, cfg.lease, entry);
    let mut renewed = tokio::time::Instant::now();
    let mut lease = match store.apply(claim.lease_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(super::no_generation()),
        Err(e) if e.is_precondition_failed() => return Ok(Turn::Changed),
        Err(e) => return Err(e.into()),
    };
    let waiting = match store.apply(claim.waiting_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(super::no_generation()),
        Err(e) => {
            let _ = store.apply(claim.lease_release(lease)).await;
            return if e.is_precondition_failed() { Ok(Turn::Changed) } else { Err(e.into()) };
        }
    };
    let give_back = async |lease: Generation| {
        let _ = store.apply(claim.waiting_given_back(waiting)).await;
        let _ = store.apply(claim.lease_release(lease)).await;
    };
    if claim.creates() {
        // As a claim that creates the entry: the read of "no entry" may be stale by a whole history.
        match record::newer_than_history(store, keys).await {
            Ok(None) => {}
            Ok(Some(newest)) => {
                give_back(lease).await;
                record::behind(store, keys).await;
                return Ok(Turn::Done(Outcome::Behind { newest: cfg.schedule.format(newest) }));
            }
            Err(e) => {
                give_back(lease).await;
                return Err(e);
            }
        }
    }
    // Renewed well within the lease: a waiter whose lease lapsed is one a later invocation may replace.
    let poll = (cfg.lease / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut asked = Vec::new();
    loop {
        let ahead = match earlier_live(store, &cfg.name, keys.slot_ms()).await {
            Ok(_) if idem_core::planted("once-overlap") => Vec::new(),
            Ok(ahead) => ahead,
            Err(e) => {
                give_back(lease).await;
                return Err(e);
            }
        };
        match judge_turn(store, cfg, &ahead).await {
            OverlapPlan::Run => break,
            plan @ (OverlapPlan::GiveBack { earlier_ms } | OverlapPlan::RecordSkipped { earlier_ms }) => {
                // Recorded skipped now (under `skip` too, so a slot no later invocation starts is skipped, not
                // missed; a later invocation in the slot still starts it: [`slot::plan`]).
                let now = millis(store.now().await?);
                let _ = store.apply(claim.skipped(waiting, cfg.overlap.name(), earlier_ms, now)).await;
                let _ = store.apply(claim.lease_release(lease)).await;
                return Ok(Turn::Done(skipped(cfg, &plan, earlier_ms)));
            }
            OverlapPlan::Wait { .. } => {}
            OverlapPlan::Replace { .. } => ask_to_stop(store, cfg, keys, &ahead, &mut asked).await,
        }
        tokio::select! {
            biased;
            () = interrupt.as_mut() => {
                give_back(lease).await;
                return Ok(Turn::Done(Outcome::Stopped { attempt: None }));
            }
            () = tokio::time::sleep(poll) => {}
        }
        let sent = tokio::time::Instant::now();
        match store.apply(claim.lease_renewal(lease)).await {
            Ok(Some(g)) => (lease, renewed) = (g, sent),
            Ok(None) => return Err(super::no_generation()),
            Err(e) if e.is_precondition_failed() => {
                return Ok(Turn::Done(Outcome::LeaseLost {
                    attempt: 1,
                    why: "its lease lapsed while it waited for the earlier slot (this invocation was paused or cut \
                          off), and another invocation took the slot: nothing ran here"
                        .into(),
                    succeeded: false,
                }));
            }
            // The store failing: tried again at the next poll, while the lease lasts.
            Err(e) if sent.duration_since(renewed) < cfg.lease => {
                tracing::warn!(error = %e, "renewing a waiting slot's lease failed")
            }
            Err(e) => {
                give_back(lease).await;
                return Err(e.into());
            }
        }
    }
    let now = millis(store.now().await?);
    if let Some(by_ms) = replaced_while_waiting(store, cfg, keys).await {
        let _ = store.apply(claim.skipped(waiting, cfg.overlap.name(), by_ms, now)).await;
        let _ = store.apply(claim.lease_release(lease)).await;
        let by = cfg.schedule.format(by_ms);
        return Ok(Turn::Done(Outcome::Replaced { attempt: 0, by, exit: "not started".into() }));
    }
    let go = claim.after_wait(waiting, now);
    match store.apply(go.entry_write()).await {
        Ok(Some(entry)) => Ok(Turn::Held(Box::new(go.acquired(lease, entry)), renewed)),
        Ok(None) => Err(super::no_generation()),
        Err(e) => {
            let _ = store.apply(claim.lease_release(lease)).await;
            if e.is_precondition_failed() { Ok(Turn::Changed) } else { Err(e.into()) }
        }
    }
}

/// The slots of job `name` before `slot` whose lease is live (running, or waiting their turn), ascending.
async fn earlier_live<S: Store>(store: &S, name: &str, slot: u64) -> Result<Vec<u64>, Error> {
    Ok(list_all(store, &slot::lease_prefix(name))
        .await?
        .iter()
        .filter_map(|k| slot::slot_of_key(k))
        .filter(|s| *s < slot)
        .collect())
}

/// What a slot recorded skipped under `plan` reports.
fn skipped(cfg: &OnceConfig, plan: &OverlapPlan, earlier_ms: u64) -> Outcome {
    let earlier =
        if earlier_ms == slot::TRIGGERED_AHEAD { "(a triggered run)".into() } else { cfg.schedule.format(earlier_ms) };
    match plan {
        OverlapPlan::GiveBack { .. } => Outcome::EarlierRunning { slot: earlier },
        _ => Outcome::Skipped { policy: cfg.overlap.name().into(), earlier },
    }
}

/// Asks each slot of `ahead` not asked yet (`asked`) to stop, for the slot of `keys`: its stop key holds this
/// slot's time ([`slot::stop_key`]). Best effort: one that fails is asked again at the next turn.
async fn ask_to_stop<S: Store>(store: &S, cfg: &OnceConfig, keys: &slot::Keys, ahead: &[u64], asked: &mut Vec<u64>) {
    // Kept a day at most: a holder reads it within a third of a lease, or its lease lapses.
    let ttl = idem_store::Ttl::After(Duration::from_secs(86_400));
    let new: Vec<u64> = ahead.iter().copied().filter(|s| !asked.contains(s)).collect();
    for earlier in new {
        let key = slot::stop_key(&slot::Keys::new(&cfg.name, earlier));
        let value = bytes::Bytes::from(keys.slot_ms().to_string());
        // Create-only: the first later slot to ask is the one that replaced it (and the one the record names).
        match store.put(&key, value, idem_store::Precondition::Absent, ttl).await {
            Ok(_) => asked.push(earlier),
            Err(e) if e.is_precondition_failed() => asked.push(earlier),
            Err(e) => tracing::warn!(error = %e, slot = earlier, "cannot ask the earlier slot to stop"),
        }
    }
}

/// The slot's plan under the job's policy ([`slot::overlap`]), a triggered run going on counting as a run
/// ahead ([`slot::TRIGGERED_AHEAD`]): `skip` gives the slot back, the other policies wait for it (none stops it).
async fn judge_turn<S: Store>(store: &S, cfg: &OnceConfig, ahead: &[u64]) -> OverlapPlan {
    match slot::overlap(cfg.overlap, ahead) {
        OverlapPlan::Run if triggered_live(store, &cfg.name).await => match cfg.overlap {
            slot::Overlap::Skip => OverlapPlan::GiveBack { earlier_ms: slot::TRIGGERED_AHEAD },
            _ => OverlapPlan::Wait { earlier_ms: slot::TRIGGERED_AHEAD },
        },
        plan => plan,
    }
}

/// Whether a triggered run of job `name` holds a live lease (a store that fails counts as none: the slot's own
/// checks still hold).
async fn triggered_live<S: Store>(store: &S, name: &str) -> bool {
    store.list(&slot::trigger_lease_prefix(name), None, 1).await.is_ok_and(|p| !p.items.is_empty())
}

/// Under `cancel-other`/`terminate-other`, the later slot that asked this one to stop while it waited (its
/// stop key): it is then recorded skipped, its command never started.
async fn replaced_while_waiting<S: Store>(store: &S, cfg: &OnceConfig, keys: &slot::Keys) -> Option<u64> {
    if !cfg.overlap.replaces() {
        return None;
    }
    let v = store.get(&slot::stop_key(keys)).await.ok()??;
    std::str::from_utf8(v.value()).ok()?.parse().ok()
}
