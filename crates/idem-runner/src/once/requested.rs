//! Slots older than the job's newest that were asked to run ([`idem_core::slot::requested_prefix`]): by
//! [`backfill`], or by an invocation that found them passed unseen within `--catchup-window`. Any invocation of
//! the job runs them, oldest first, one after another, each claimed, fenced and recorded as its slot (so each
//! runs once, whichever invocations find it, and a pass killed halfway is taken up by the next invocation).

use std::future::Future;
use std::pin::Pin;

use idem_core::ledger::RetryLimit;
use idem_core::slot::{self, Job, Overlap, Request, RequestKind, job_key, lease_prefix, slot_of_key};
use idem_store::{Precondition, Store, StoreExt};

use super::record::{self, list_all};
use super::schedule::{format_in, parse_canonical};
use super::{Error, OnceConfig, Outcome, check_name, decode_entry, millis, run_held};
use crate::supervise::{host_name, owner_token};

/// The most slots one backfill requests: each is two writes now and one run later.
pub const MAX_BACKFILL: usize = 10_000;

/// What [`backfill`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Backfilled {
    /// Slots requested (RFC 3339), oldest first.
    pub requested: Vec<String>,
    /// Slots not requested, each with why (done, failed for good, older than the kept history).
    pub not_requested: Vec<(String, &'static str)>,
    /// The range's end was after the job's newest slot: clamped to it (later slots are its invocations').
    pub clamped_to: Option<String>,
}

/// Requests every slot of job `name` from `from_ms` to `to_ms` (milliseconds since the Unix epoch, both
/// included) not done yet: the job's next invocations run them, oldest first, each once, after their own slot
/// and under the job's overlap policy (a backfill made again over the same range requests nothing twice).
/// Slots after the job's newest are left to its invocations. `Ok(None)` when the store has no such job.
///
/// # Errors
/// [`Error::Config`] for a bad name, `from_ms` after `to_ms`, or more than [`MAX_BACKFILL`] slots in the range;
/// [`Error::Store`] when the store fails (what was requested before stays requested: run it again).
pub async fn backfill<S: Store>(
    store: &S,
    name: &str,
    from_ms: u64,
    to_ms: u64,
    who: &str,
) -> Result<Option<Backfilled>, Error> {
    check_name(name)?;
    if from_ms > to_ms {
        return Err(Error::Config(format!(
            "--from {} is after --to {}: nothing requested",
            format_in(from_ms, None),
            format_in(to_ms, None)
        )));
    }
    let key = job_key(name);
    let Some(v) = store.get(&key).await? else { return Ok(None) };
    let job = Job::decode(v.value()).map_err(|source| Error::Entry { key, source })?;
    let schedule = parse_canonical(&job.schedule)?;
    let mut done = Backfilled::default();
    let to = if to_ms > job.last_slot_ms {
        done.clamped_to = Some(schedule.format(job.last_slot_ms));
        job.last_slot_ms
    } else {
        to_ms
    };
    let slots = schedule.slots_in(from_ms, to, MAX_BACKFILL)?;
    let now_ms = millis(store.now().await?);
    let limit = RetryLimit { max_attempts: job.retries.unwrap_or(3).saturating_add(1) };
    let request = Request { kind: RequestKind::Backfill, by: who.to_owned() };
    for slot_ms in slots {
        match record::request(store, name, slot_ms, &request, limit, now_ms, true).await? {
            None => done.requested.push(schedule.format(slot_ms)),
            Some(why) => done.not_requested.push((schedule.format(slot_ms), why)),
        }
    }
    Ok(Some(done))
}

/// The job's requested slots, oldest first, each with why it was requested (a key whose value cannot be
/// read counts as a backfill's).
pub(super) async fn pending<S: Store>(store: &S, name: &str) -> Result<Vec<(u64, RequestKind)>, Error> {
    let keys = list_all(store, &slot::requested_prefix(name)).await?;
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let values = store.get_many(&keys).await?;
    Ok(keys
        .iter()
        .zip(values)
        .filter_map(|(k, v)| {
            let kind = v.and_then(|v| Request::decode(v.value()).ok()).map_or(RequestKind::Backfill, |r| r.kind);
            Some((slot_of_key(k)?, kind))
        })
        .collect())
}

/// Runs the requested `slots` (ascending) of the job, one after another, under its overlap policy (other than
/// `allow`: the pass stops as soon as another slot of the job holds a live lease, since its holder, or a later
/// invocation, goes on); each one's key is deleted once its entry is final. Stops at a pause, a signal or a lost
/// lease. Returns each slot run (or found held) and its outcome.
///
/// A store that fails ends the pass with a warning (the slots left stay keyed for the next invocation): the
/// invocation's own slot is what its exit status says, and the store's failure is not "nothing ran".
pub(super) async fn run<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    slots: &[u64],
    now_ms: u64,
    paused: bool,
    interrupt: Pin<&mut impl Future<Output = ()>>,
) -> Vec<(String, Outcome)> {
    let mut ran = Vec::new();
    if let Err(e) = run_into(store, cfg, slots, now_ms, paused, interrupt, &mut ran).await {
        tracing::warn!(error = %e, "the requested slots' pass stopped: the store failed (the next invocation goes on)");
    }
    ran
}

async fn run_into<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    slots: &[u64],
    now_ms: u64,
    paused: bool,
    mut interrupt: Pin<&mut impl Future<Output = ()>>,
    ran: &mut Vec<(String, Outcome)>,
) -> Result<(), Error> {
    let limit = RetryLimit { max_attempts: cfg.retries.saturating_add(1) };
    for &slot_ms in slots {
        let keys = slot::Keys::new(&cfg.name, slot_ms);
        let Some((generation, entry)) = decode_entry(store.get(keys.entry()).await?, &keys)? else {
            // Pruned since (the history keeps requested entries, so it ran): nothing to run.
            forget(store, &keys).await;
            continue;
        };
        let lease_live = store.get(keys.lease()).await?.is_some();
        let slot::Plan::Run { .. } = slot::plan(Some(&entry), lease_live, limit, false, false) else {
            if !lease_live {
                forget(store, &keys).await;
            } else if cfg.overlap != Overlap::Allow {
                break;
            }
            continue;
        };
        // The pause is read again before each slot: one made while the pass runs stops it.
        if paused || super::fired(interrupt.as_mut()) || paused_now(store, &cfg.name).await {
            break;
        }
        // A stop request left by a replacement that found this slot running long ago is not for this run.
        let _ = store.delete(&slot::stop_key(&keys), Precondition::Any).await;
        // Claimed at the store's now, not the invocation's: the entry's start is when this run starts.
        let started_ms = super::millis(store.now().await?).max(now_ms);
        let claim = slot::Claim::new(
            keys.clone(),
            owner_token(),
            host_name(),
            started_ms,
            cfg.lease,
            Some((generation, entry)),
        );
        let sent = tokio::time::Instant::now();
        let Some(held) = claim_alone(store, cfg, &claim, keys.lease()).await? else { break };
        if claim.takes_over() {
            record::took_over(store, &held).await;
        }
        let outcome = run_held(store, cfg, held, sent, &cfg.schedule.format(slot_ms), interrupt.as_mut()).await;
        let stop = matches!(
            outcome,
            Outcome::Interrupted { .. }
                | Outcome::Stopped { .. }
                | Outcome::LeaseLost { .. }
                | Outcome::NotRecorded { .. }
        );
        if let Ok(Some((_, e))) = decode_entry(store.get(keys.entry()).await?, &keys)
            && (e.is_final() || e.attempts() >= limit.max_attempts && matches!(e, slot::Entry::Failed { .. }))
        {
            forget(store, &keys).await;
        }
        ran.push((cfg.schedule.format(slot_ms), outcome));
        if stop {
            break;
        }
    }
    Ok(())
}

/// Whether job `name`'s pause holds now (by the store's clock; a store that fails counts as paused: the pass
/// stops, the next invocation goes on).
async fn paused_now<S: Store>(store: &S, name: &str) -> bool {
    let (Ok(pause), Ok(now)) = (store.get(&slot::pause_key(name)).await, store.now().await) else { return true };
    pause.and_then(|v| slot::Pause::decode(v.value()).ok()).is_some_and(|p| p.holds_at(super::millis(now)))
}

/// Claims a requested slot or a triggered run: its lease, then (under a policy other than `allow`, when no other
/// slot or triggered run of the job holds a live lease: both leases are taken before either looks, so of two at
/// once neither is missed) its entry. `None`: another invocation got there first, or another one runs (the
/// lease is given back).
pub(super) async fn claim_alone<S: Store + Sync>(
    store: &S,
    cfg: &OnceConfig,
    claim: &slot::Claim,
    own_lease: &str,
) -> Result<Option<slot::Held>, Error> {
    let lease = match store.apply(claim.lease_write()).await {
        Ok(Some(g)) => g,
        Ok(None) => return Err(super::no_generation()),
        Err(e) if e.is_precondition_failed() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if cfg.overlap != Overlap::Allow {
        let others = others_live(store, &cfg.name, own_lease).await;
        if !matches!(others, Ok(false)) {
            let _ = store.apply(claim.lease_release(lease)).await;
            return others.map(|_| None).map_err(Error::from);
        }
    }
    match store.apply(claim.entry_write()).await {
        Ok(Some(entry)) => Ok(Some(claim.clone().acquired(lease, entry))),
        Ok(None) => Err(super::no_generation()),
        Err(e) => {
            let _ = store.apply(claim.lease_release(lease)).await;
            if e.is_precondition_failed() { Ok(None) } else { Err(e.into()) }
        }
    }
}

/// Whether a lease of job `name` other than `own_lease` is live: a slot's or a triggered run's.
pub(super) async fn others_live<S: Store>(store: &S, name: &str, own_lease: &str) -> Result<bool, idem_store::Error> {
    for prefix in [lease_prefix(name), slot::trigger_lease_prefix(name)] {
        if store.list(&prefix, None, 2).await?.items.iter().any(|i| i.key != own_lease) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Deletes a requested slot's key (best effort: a key left is judged again, and deleted, by the next pass).
async fn forget<S: Store>(store: &S, keys: &slot::Keys) {
    if let Err(e) = store.delete(&slot::request_key(keys), Precondition::Any).await {
        tracing::warn!(error = %e, slot = keys.slot_ms(), "cannot delete the requested slot's key");
    }
}
