//! The ledger as the engine uses it: every read and write rides out a store outage.
//!
//! A store that is unreachable for a while (restarted, failed over, a SQLite file locked or a disk full:
//! [`StoreError::is_unavailable`]) is not the items' fault. An operation that gets such an answer is tried
//! again with jittered exponential backoff until the store answers, so while it is out nothing new is claimed
//! (the claim waits), running commands go on while their leases last (the keeper retries its renewals), and a
//! finished item whose output is in place is recorded once the store is back (the done write is fenced on the
//! claim's entry generation, not on the lease, so it lands if nobody took the item over meanwhile). Only an
//! outage longer than `--store-outage-limit` ([`Outage`](super::outage::Outage)) ends the run; the items it did not finish are then
//! not done, never failed.
//!
//! A write retried after an unavailable answer may have landed the first time (the answer, not the write, was
//! lost); its retry is then refused by its own precondition. [`apply`] recognises that case by reading the key
//! back: every ledger write puts a value unique to its writer (the owner token, timestamps) or deletes.
//!
//! A holder whose lease lapsed (the store was out, or the runner paused, for longer than a lease) takes it
//! again with [`regain`] if nobody took the item over, instead of discarding an attempt that may have finished.

use std::time::Duration;

use idem_core::ledger::Held;
use idem_store::{
    Error as StoreError, Generation, Jitter, LeaseKeeper, Renewable, RetryPolicy, Store, StoreExt, Versioned, Write,
    WriteOp,
};
use tokio::time::Instant;

use super::ctx::Ctx;

/// The pause before try `n + 1` (0-based) of an operation the store did not take: 50 ms doubling up to 2 s,
/// each drawn between half and all of it (equal jitter), so the runner's many waiting operations do not come
/// back at the store in one burst.
fn backoff(n: u32) -> Duration {
    RetryPolicy::new()
        .with_base_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(2))
        .with_jitter(Jitter::Equal)
        .pause_after(n.saturating_add(1))
}

use super::outage::humanize;

/// Whose operation waits, which says when an operator's stop ends the wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Waiting {
    /// An item whose command has not started in this attempt (judging, claiming, giving a claim back): the
    /// first Ctrl-C ends the wait, as it ends every wait for new work.
    Unstarted,
    /// An attempt whose command started (its lease, its done, failed or interrupted write): only the second
    /// Ctrl-C (or SIGTERM) ends the wait, as it ends the command.
    Started,
}

impl Waiting {
    fn stop_level(self) -> u8 {
        match self {
            Waiting::Unstarted => 1,
            Waiting::Started => 2,
        }
    }
}

/// Runs `op` until the store takes it: again after each unavailable answer, with backoff, until the outage
/// outlasts the limit or the operator's stop ends the wait ([`Waiting`]). Any other answer is returned as it
/// is. `Err(_)` with [`StoreError::is_unavailable`] means the wait was given up. `tries` counts the tries that
/// got an unavailable answer.
async fn patient<S, T, F, Fut>(
    ctx: &Ctx<S>,
    waiting: Waiting,
    write: bool,
    tries: &mut u32,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let began = Instant::now();
    loop {
        let sent = Instant::now();
        // An operation the store holds without answering (a write to a SQLite file another connection keeps
        // locked waits for the lock; a server stopped with SIGSTOP) is unanswered once it has waited a whole
        // --store-outage-limit: the limit applies to it as to a refusal. It may still land after it was given up
        // (its answer lost, as with any unavailable answer); every write here is fenced, so nothing depends on it.
        // Once an outage outlasted the limit the run ends: an operation in flight then (or sent since) is given
        // up at once, as the limit applies to it too; an answer already there is still taken.
        let answer = tokio::select! {
            biased;
            answer = tokio::time::timeout_at(ctx.outage.deadline(sent), op()) => match answer {
                Ok(answer) => answer,
                Err(_) => Err(StoreError::unavailable(format!(
                    "no answer within --store-outage-limit {}",
                    humanize(ctx.outage.limit)
                ))),
            },
            () = ctx.outage.until_exceeded() => Err(StoreError::unavailable(format!(
                "the store has been unavailable for longer than --store-outage-limit {}",
                humanize(ctx.outage.limit)
            ))),
        };
        match answer {
            Err(e) if e.is_unavailable() => {
                if !ctx.outage.unavailable(&e, sent, write) || ctx.stop.level() >= waiting.stop_level() {
                    return Err(e);
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff(*tries)) => {}
                    () = ctx.stop.reached(waiting.stop_level()) => return Err(e),
                }
                *tries = tries.saturating_add(1);
            }
            other => {
                // Not served for a while (an outage ended, or an operation waited longer than a renewal
                // period: a locked SQLite file blocks rather than fails): no holder could renew either, so
                // every watch starts again and each holder gets a lease to take its lease again.
                // A refused precondition is the store's answer too: it takes operations again.
                let answered = match &other {
                    Ok(_) => true,
                    Err(e) => e.is_precondition_failed(),
                };
                let ended = answered && ctx.outage.answered(write);
                if ended || began.elapsed() > ctx.cfg.lease / 3 {
                    ctx.unwatch_all();
                }
                return other;
            }
        }
    }
}

/// Reads `key`, riding out an outage.
pub(super) async fn get<S: Store>(ctx: &Ctx<S>, waiting: Waiting, key: &str) -> Result<Option<Versioned>, StoreError> {
    patient(ctx, waiting, false, &mut 0, || ctx.store.get(key)).await
}

/// Applies `write`, riding out an outage. A retry refused by its precondition where the key now holds exactly
/// the value `write` puts (or is absent, for a delete) is the earlier try that landed unanswered: its
/// generation is returned as if it had been answered.
pub(super) async fn apply<S: Store>(
    ctx: &Ctx<S>,
    waiting: Waiting,
    write: Write,
) -> Result<Option<Generation>, StoreError> {
    apply_sent(ctx, waiting, write).await.map(|(generation, _)| generation)
}

/// [`apply`], also saying when the try the store took was sent, for a lease's keeper to count the lease from:
/// the last try when it was answered, the first when an earlier one landed unanswered (which one is not known).
pub(super) async fn apply_sent<S: Store>(
    ctx: &Ctx<S>,
    waiting: Waiting,
    write: Write,
) -> Result<(Option<Generation>, Instant), StoreError> {
    let first = Instant::now();
    let mut last = first;
    let mut tries = 0;
    let tried = patient(ctx, waiting, true, &mut tries, || {
        last = Instant::now();
        ctx.store.apply(write.clone())
    })
    .await;
    let refused = match tried {
        Ok(generation) => return Ok((generation, last)),
        Err(e) => e,
    };
    // Only a write tried before may have landed: the first try's refusal stands.
    let Some(current) = refused.current_generation().filter(|_| tries > 0) else { return Err(refused) };
    match &write.op {
        WriteOp::Delete if current.is_none() => Ok((None, first)),
        WriteOp::Put { value, .. } if current.is_some() => match get(ctx, waiting, &write.key).await? {
            Some(v) if v.value() == value => Ok((Some(v.generation()), first)),
            _ => Err(refused),
        },
        _ => Err(refused),
    }
}

/// How [`regain`] ended.
pub(super) enum Regained {
    /// The lease is this holder's again, set by a write sent at this instant; nobody took the item over.
    Held(Instant),
    /// Another holder has the lease, or claimed the item over: the attempt is no longer ours.
    TakenOver,
    /// The store stayed unavailable past the limit, or the operator stopped the run.
    GaveUp,
}

/// After a lease was lost (no renewal accepted for a whole lease, or a renewal refused): takes it again if
/// nobody took the item over. Its own lease still under the key (the store kept it, or a renewal whose answer
/// was lost landed) is renewed, conditional on its generation; an absent one is created again, and counts
/// only if the item's entry still has the claim's generation, which [`Held::reassert`] then moves on (see
/// [`Held::retake`]).
pub(super) async fn regain<S: Store>(ctx: &Ctx<S>, held: &mut Held) -> Regained {
    let waiting = Waiting::Started;
    let lease_key = held.keys().lease().to_owned();
    let mut waited = Duration::ZERO;
    loop {
        let current = match get(ctx, waiting, &lease_key).await {
            Ok(current) => current,
            Err(e) => {
                tracing::debug!(key = %lease_key, error = %e, "the lease could not be read: giving up");
                return Regained::GaveUp;
            }
        };
        match current {
            Some(v) if held.is_mine(&v) => {
                held.renewed(v.generation());
                match apply_sent(ctx, waiting, held.renewal()).await {
                    Ok((Some(g), sent)) => {
                        held.renewed(g);
                        return Regained::Held(sent);
                    }
                    // It lapsed or changed between the read and the renewal: read again.
                    Err(e) if e.is_precondition_failed() => {}
                    other => {
                        tracing::debug!(key = %lease_key, ?other, "the lease could not be renewed: giving up");
                        return Regained::GaveUp;
                    }
                }
            }
            Some(v) => {
                // Another runner holds the lease. The attempt is taken over only once that runner's count moved the
                // entry past this holder's: a claim made on a stale view (its count is then refused and its lease
                // given back at once) or one made as this lease lapsed and still waiting for a slot holds the lease
                // without having taken anything. So wait for the entry to move (taken over) or the lease to go
                // (take it again), for at most a lease; an attempt not yet counted has nothing to wait for.
                let Some(token) = held.fencing_token() else { return Regained::TakenOver };
                if waited >= held.length() {
                    tracing::debug!(key = %lease_key, generation = %v.generation(), "another holder's lease stayed: taken over");
                    return Regained::TakenOver;
                }
                match get(ctx, waiting, held.keys().entry()).await {
                    Ok(Some(entry)) if entry.generation() == token => {
                        let pause = (held.length() / 10).clamp(Duration::from_millis(10), Duration::from_millis(100));
                        tokio::time::sleep(pause).await;
                        waited += pause;
                    }
                    Ok(_) => {
                        tracing::debug!(key = %lease_key, "another holder counted its attempt: taken over");
                        return Regained::TakenOver;
                    }
                    Err(_) => return Regained::GaveUp,
                }
            }
            None => match apply_sent(ctx, waiting, held.retake()).await {
                Ok((Some(g), sent)) => {
                    held.renewed(g);
                    // Not counted yet: the count is fenced on the entry as judged, nothing to move on.
                    let Some(reassert) = held.reassert() else { return Regained::Held(sent) };
                    return match apply(ctx, waiting, reassert).await {
                        Ok(Some(entry)) => {
                            held.reasserted(entry);
                            Regained::Held(sent)
                        }
                        Err(e) if e.is_precondition_failed() => {
                            tracing::debug!(key = %lease_key, error = %e, "the entry moved on since the count: taken over");
                            let _ = apply(ctx, waiting, held.release()).await;
                            Regained::TakenOver
                        }
                        other => {
                            tracing::debug!(key = %lease_key, ?other, "the entry could not be written again: giving up");
                            Regained::GaveUp
                        }
                    };
                }
                // Someone created it first: read whose it is.
                Err(e) if e.is_precondition_failed() => {}
                other => {
                    tracing::debug!(key = %lease_key, ?other, "the lease could not be taken again: giving up");
                    return Regained::GaveUp;
                }
            },
        }
    }
}

/// After a lease was lost: the answer of a renewal still in flight first (a late acceptance means nobody took
/// over: the keeper keeps the lease, `keeping_late_answers`), then [`regain`]. True when the lease is this
/// holder's again, and `heartbeat` keeps it from there.
pub(super) async fn recover<S: Store>(ctx: &Ctx<S>, held: &mut Held, heartbeat: &mut LeaseKeeper<'_, S>) -> bool {
    // This runner's own renewals were not served (or it was paused): other holders' were not either.
    ctx.unwatch_all();
    // Settled with no loss recorded is not enough: after a fence whose renewal the store did not answer well,
    // the keeper records no loss, yet the lease may have run out by the clock (someone may hold the item now).
    // Only a lease set less than its length ago is still ours without a look at the store.
    if await_renewal(ctx, held, heartbeat).await && heartbeat.sent().elapsed() < heartbeat.length() {
        return true;
    }
    match regain(ctx, held).await {
        Regained::Held(sent) => {
            heartbeat.restart(sent);
            true
        }
        Regained::TakenOver | Regained::GaveUp => false,
    }
}

/// Waits for the keeper's renewal in flight ([`LeaseKeeper::await_renewal`]), but not past the outage limit: a
/// renewal the store holds unanswered (a locked SQLite file, a server stopped with SIGSTOP) would otherwise
/// hold the run's end for the store's own timeout. A renewal unanswered for a whole limit since it was sent is
/// an outage that outlasted it, as for any operation ([`patient`]): while commands run, the keeper's renewals
/// may be the only operations the store is sent, and the outage must count from them, not from the client's
/// own response timeout failing one. False when the lease is lost or the wait was given up.
pub(super) async fn await_renewal<S: Store>(ctx: &Ctx<S>, held: &mut Held, heartbeat: &mut LeaseKeeper<'_, S>) -> bool {
    let sent = heartbeat.renewal_sent().unwrap_or_else(Instant::now);
    let renewed = tokio::select! {
        renewed = heartbeat.await_renewal(held) => renewed,
        () = ctx.outage.until_exceeded() => false,
        () = tokio::time::sleep_until(ctx.outage.deadline(sent)) => return unanswered(ctx, sent),
    };
    // Renewals the store did not take count from when the first was sent: one failed by the client's own
    // response timeout (10 s for Redis) reported only as its answer came would start the outage that much
    // late, and the run ended up to twice the limit into it (a freeze with --lease 3s and a 10 s limit: 20.6 s).
    if let Some(since) = heartbeat.unavailable_since() {
        let e = StoreError::unavailable("a lease renewal was not taken");
        ctx.outage.unavailable(&e, since, true);
    } else if renewed {
        ctx.outage.renewal_answered(heartbeat.sent());
    }
    renewed
}

/// A lease write sent at `sent` had no answer within the outage limit: reported as an unavailable write (the
/// outage began no later than `sent`, so it outlasted the limit). Always false: the wait is given up.
fn unanswered<S>(ctx: &Ctx<S>, sent: Instant) -> bool {
    let e = StoreError::unavailable(format!(
        "a lease renewal had no answer within --store-outage-limit {}",
        humanize(ctx.outage.limit)
    ));
    ctx.outage.unavailable(&e, sent, true);
    false
}

/// The fence before a step that needs the lease (starting a command, renaming an output into place), riding
/// out an outage: a renewal the store did not take is tried again while the lease lasts, and a lease lost
/// meanwhile is taken again if nobody took the item over ([`regain`]). False when the item is no longer ours
/// (or the wait was given up): the caller discards the attempt.
pub(super) async fn fence<S: Store>(ctx: &Ctx<S>, held: &mut Held, heartbeat: &mut LeaseKeeper<'_, S>) -> bool {
    let mut tries = 0u32;
    loop {
        // The renewal in flight first, bounded from when it was sent; then the fence's own renewal, from now.
        if !await_renewal(ctx, held, heartbeat).await && ctx.outage.exceeded() {
            return false;
        }
        let sent = Instant::now();
        let fenced = tokio::select! {
            fenced = heartbeat.fence(held) => fenced,
            () = ctx.outage.until_exceeded() => return false,
            () = tokio::time::sleep_until(ctx.outage.deadline(sent)) => return unanswered(ctx, sent),
        };
        if fenced {
            return true;
        }
        if heartbeat.lost().is_none() && heartbeat.sent().elapsed() < heartbeat.length() {
            // The renewal failed (the store did not answer well) while the lease is still ours: try again.
            if ctx.stop.level() >= 2 || ctx.outage.exceeded() {
                return false;
            }
            tokio::time::sleep(backoff(tries).min(heartbeat.length() / 10)).await;
            tries = tries.saturating_add(1);
            continue;
        }
        return recover(ctx, held, heartbeat).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_two_seconds_with_jitter_below_each_step() {
        let windows = [50, 100, 200, 400, 800, 1600, 2000, 2000, 2000, 2000, 2000, 2000];
        for (n, ms) in windows.into_iter().enumerate() {
            let full = Duration::from_millis(ms);
            let got = backoff(n as u32);
            assert!(got >= full / 2 && got <= full, "try {n}: {got:?} outside {:?}..={full:?}", full / 2);
        }
    }
}
