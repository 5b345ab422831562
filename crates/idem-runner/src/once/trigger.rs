//! Runs requested outside the schedule ([`super::trigger`]): each invocation, after its own slot, runs the
//! job's requests not run yet, one after another, each claimed, fenced and recorded as a slot is (under the
//! trigger's own keys, so a request runs once whichever invocations find it).

use std::future::Future;
use std::pin::Pin;

use idem_core::ledger::RetryLimit;
use idem_core::slot;
use idem_store::Store;

use super::record::list_all;
use super::{Error, OnceConfig, Outcome, claim_slot, decode_entry, run_held};

/// Runs the job's pending triggered runs; returns each one's id and outcome (the ones run or found held).
pub(super) async fn run_requested<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    now_ms: u64,
    mut interrupt: Pin<&mut impl Future<Output = ()>>,
) -> Result<Vec<(String, Outcome)>, Error> {
    let keys = list_all(store, &slot::trigger_prefix(&cfg.name)).await?;
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let limit = RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
    let mut ran = Vec::new();
    for key in keys {
        let Some(id) = key.rsplit('/').next().map(str::to_owned) else { continue };
        let read = store.get(&key).await?;
        let probe = slot::Keys::trigger(&cfg.name, &id, 0);
        let Some((generation, entry)) = decode_entry(read, &probe)? else { continue };
        if entry.is_final() || matches!(entry, slot::Entry::Done { .. }) {
            continue;
        }
        let lease_live = store.get(probe.lease()).await?.is_some();
        let slot::Plan::Run { .. } = slot::plan(Some(&entry), lease_live, limit, false, false) else { continue };
        // Named in the counted sets by the time it was requested (or its last attempt started).
        let at_ms = match &entry {
            slot::Entry::Requested { at_ms, .. } => *at_ms,
            slot::Entry::Running { started_at_ms, .. } | slot::Entry::Failed { started_at_ms, .. } => *started_at_ms,
            _ => now_ms,
        };
        let keys = slot::Keys::trigger(&cfg.name, &id, at_ms);
        // Claimed at the store's now, not the invocation's: the entry's start is when this run starts.
        let started_ms = super::millis(store.now().await?).max(now_ms);
        let claim = slot::Claim::new(
            keys,
            crate::supervise::owner_token(),
            crate::supervise::host_name(),
            started_ms,
            cfg.lease,
            Some((generation, entry)),
        );
        // Under a policy other than allow a triggered run waits for no run of the job to be going on (the next
        // invocation tries again), as a slot does.
        let sent = tokio::time::Instant::now();
        let held = if cfg.overlap == slot::Overlap::Allow {
            claim_slot(store, &claim, None).await?.map(|(held, _)| held)
        } else {
            super::requested::claim_alone(store, cfg, &claim, probe.lease()).await?
        };
        let Some(held) = held else {
            if cfg.overlap == slot::Overlap::Allow {
                continue;
            }
            break;
        };
        if claim.takes_over() {
            super::record::took_over(store, &held).await;
        }
        let label = super::utc(at_ms);
        let outcome = run_held(store, cfg, held, sent, &label, interrupt.as_mut()).await;
        let stop = matches!(outcome, Outcome::Interrupted { .. } | Outcome::Stopped { .. });
        ran.push((id, outcome));
        if stop {
            break;
        }
    }
    Ok(ran)
}
