//! Steps 2 and 3 of the layer ([crate docs](crate#steps)): read the key's record (or the replay cache), judge it against this
//! request, and claim the key when it is free; every other verdict is answered here.

use std::time::{Duration, SystemTime};

use crate::body::Body;
use http::{Response, StatusCode};
use idem_core::record::{Claim, Held, Record, RecordKey, StoredResponse, Verdict, Watch, judge};
use idem_core::{Fingerprint, ProblemType};
use idem_store::{Error as StoreError, Generation, Jitter, RetryPolicy, Store, StoreExt, system_time_to_millis};
use tracing::{error, warn};

use crate::config::{Config, InFlight};
use crate::prepare::Keyed;
use crate::problem::{in_flight, outcome_resolved, outcome_unknown, problem, replay, store_unavailable};
use crate::route::OnFailure;

/// Step 3 from the replay cache: the answer a cached finished record gives, judged like one read from the store.
pub(crate) fn cached_answer(config: &Config, keyed: &Keyed) -> Option<Response<Body>> {
    let record = config.replay_cache.as_ref()?.get(keyed.record_key.as_str())?;
    finished_answer(judge(Some(record), &keyed.fingerprint), config, &keyed.record_key, false).ok()
}

/// Steps 2 and 3 of the layer: claim the key, or answer from the record that holds it.
pub(crate) async fn decide<St: Store>(
    store: &St,
    config: &Config,
    record_key: &RecordKey,
    fingerprint: &Fingerprint,
) -> Result<Held, Box<Response<Body>>> {
    let deadline = match config.in_flight {
        InFlight::Wait(bound) => Some(tokio::time::Instant::now() + bound),
        InFlight::Reject => None,
    };
    // A wait for an in-flight first attempt polls its record every 10 ms, doubling to 200 ms: the window
    // itself, since the deadline bounds the wait and the polls are reads.
    let polls = RetryPolicy::new()
        .with_base_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(200))
        .with_jitter(Jitter::None);
    let mut polled = 0;
    let mut lost_races = 0;
    // Whether this request waited for an in-flight first attempt (a replay after it counts as waited).
    let mut waited = false;
    // Step 2 as the contract states it: claim first, read only when the claim loses. Done when the replay
    // cache just missed, so the key is most likely new and the read would be wasted; without a cache a retry
    // is as likely as a new key, and a read costs every backend less than a refused write.
    let mut blind = config.replay_cache.is_some();
    loop {
        if std::mem::take(&mut blind) {
            match claim(store, config, record_key, fingerprint, None).await {
                Ok(lease) => return Ok(lease),
                Err(e) if e.is_precondition_failed() => continue,
                Err(e) => return Err(Box::new(unavailable(config, &e))),
            }
        }
        let token = config.replay_cache.as_ref().map(|c| c.token());
        let current = store.get(record_key.as_str()).await.map_err(|e| Box::new(unavailable(config, &e)))?;
        let record = match current.as_ref().map(|v| Record::decode(v.value())).transpose() {
            Ok(record) => record,
            Err(e) => {
                error!(key = record_key.as_str(), error = %e, "unreadable idempotency record");
                return Err(Box::new(problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ProblemType::IdempotencyRecordUnreadable,
                    "the stored record for this key cannot be read; an operator can delete it",
                )));
            }
        };
        if let (Some(cache), Some(token), Some(record), Some(current)) =
            (&config.replay_cache, token, &record, &current)
        {
            cache.insert(record_key.as_str(), record, current.expires_at(), token);
        }
        // The in-flight record as found, for the observation below (the verdict consumes the record).
        let in_flight_record = match (&record, &current) {
            (Some(r @ Record::InProgress { .. }), Some(current)) => Some((r.clone(), current.generation())),
            _ => None,
        };
        let answer = match finished_answer(judge(record, fingerprint), config, record_key, waited) {
            Ok(answer) => answer,
            Err(Verdict::InFlight) => {
                let Some((record, generation)) = in_flight_record else { continue };
                // Whether its holder is dead is judged by watching its generation
                // (`idem_core::record::Observations`): unchanged for a whole lease of this process's monotonic clock.
                let watch = observe(config, record_key, &record, generation);
                match watch {
                    Watch::Lapsed(lapsed) => {
                        match claim(store, config, record_key, fingerprint, Some(lapsed)).await {
                            Ok(lease) => {
                                forget(config, record_key);
                                crate::counters::count(crate::counters::Count::LapsedTakeovers);
                                warn!(
                                    key = record_key.as_str(),
                                    "took over an in-flight record whose holder renewed nothing for a whole lease"
                                );
                                return Ok(lease);
                            }
                            // Renewed, finished or released in the meantime: judge what is there now.
                            Err(e) if e.is_precondition_failed() => continue,
                            Err(e) => return Err(Box::new(unavailable(config, &e))),
                        }
                    }
                    // `Retry-After: 1` all the same: the holder most likely finishes soon, and the watch goes on
                    // across requests, so retries every second reach a dead holder's takeover after one lease.
                    Watch::Alive { .. } => {}
                }
                let pause = polls.pause_after(polled + 1);
                if let Some(deadline) = deadline
                    && tokio::time::Instant::now() + pause < deadline
                {
                    tokio::time::sleep(pause).await;
                    waited = true;
                    polled += 1;
                    continue;
                }
                in_flight()
            }
            Err(_claim) => {
                match claim(store, config, record_key, fingerprint, None).await {
                    Ok(lease) => return Ok(lease),
                    // Another request created the record between our read and our write: judge what won.
                    Err(e) if e.is_precondition_failed() && lost_races < 3 => {
                        lost_races += 1;
                        continue;
                    }
                    Err(e) if e.is_precondition_failed() => in_flight(),
                    Err(e) => unavailable(config, &e),
                }
            }
        };
        return Err(Box::new(answer));
    }
}

fn observe(config: &Config, key: &RecordKey, record: &Record, generation: Generation) -> Watch {
    let mut seen = config.observations.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    seen.observe(key, record, generation, config.lease, std::time::Instant::now())
}

/// The 503 for a store error. A store this process could not use also clears its watches of in-flight
/// records (`Observations::clear`): their holders could not renew their leases either, so each gets a whole
/// lease again from the first read answered after, as the runner's watches do. Without it a holder whose
/// outcome write was refused through a switchover was taken over, and its request executed a second time
/// (the checker's proxy workload on redis-sentinel, seed 424242101, `--ha-fault switchover`).
fn unavailable(config: &Config, e: &StoreError) -> Response<Body> {
    if e.is_unavailable() {
        config.observations.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    }
    store_unavailable(e)
}

fn forget(config: &Config, key: &RecordKey) {
    let mut seen = config.observations.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    seen.forget(key);
}

/// Creates the in-flight record if the key has none (the conditional create of step 2), or,
/// with `lapsed`, replaces a dead holder's record that still has that generation.
async fn claim<St: Store>(
    store: &St,
    config: &Config,
    record_key: &RecordKey,
    fingerprint: &Fingerprint,
    lapsed: Option<Generation>,
) -> Result<Held, StoreError> {
    let claim =
        Claim::new(record_key.clone(), *fingerprint, config.owner.clone(), now_ms(), config.lease, config.retention);
    let write = match lapsed {
        Some(generation) => claim.take_over(generation),
        None => claim.write(),
    };
    match store.apply(write).await? {
        Some(generation) => Ok(claim.acquired(generation)),
        None => Err(StoreError::unavailable("the claim returned no generation")),
    }
}

/// The answer for a key whose record is finished, or was used for another request (step 3);
/// [`Verdict::Claim`] and [`Verdict::InFlight`] come back as they are: they need the store.
fn finished_answer(
    verdict: Verdict,
    config: &Config,
    record_key: &RecordKey,
    waited: bool,
) -> Result<Response<Body>, Verdict> {
    let route = config.route_counters.as_deref();
    if let (Some(counters), Verdict::Replay(_) | Verdict::TooLarge { .. }) = (route, &verdict) {
        if waited { &counters.waited } else { &counters.replayed }.increment(1);
    }
    Ok(match verdict {
        Verdict::Claim | Verdict::InFlight => return Err(verdict),
        Verdict::Replay(stored) => {
            crate::counters::count(crate::counters::Count::Replays);
            replay(stored)
        }
        Verdict::Mismatch => {
            crate::counters::count(crate::counters::Count::Mismatches);
            if let Some(counters) = route {
                counters.mismatches.increment(1);
                // For a webhook the sender changed the event under the same id: worth an operator's look. The
                // bodies are never logged.
                warn!(key = record_key.as_str(), "a redelivery differs in its compared parts: 422");
            }
            if config.route.is_some() {
                // A route's key is a delivery id, which the sender may have sent in no Idempotency-Key header.
                problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    ProblemType::WebhookDeliveryReused,
                    "this delivery id was already delivered with a different body (in the parts the route \
                     compares): the sender changed the event under the same id",
                )
            } else {
                problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    ProblemType::IdempotencyKeyReused,
                    "this key was already used for a different request (method, path, query, content type or \
                     body differ); use a new key for a new request",
                )
            }
        }
        Verdict::TooLarge { status, .. } if config.on_failure == OnFailure::Release => {
            // A release route stores only 2xx, so this is a 2xx whose body was over the limit. A webhook sender
            // reads only the status, and would deliver a 409 again for days: it gets the status, no body.
            crate::counters::count(crate::counters::Count::Replays);
            replay(StoredResponse { status, headers: Vec::new(), body: bytes::Bytes::new() })
        }
        Verdict::TooLarge { status, limit } => {
            crate::counters::count(crate::counters::Count::Replays);
            problem(
                StatusCode::CONFLICT,
                ProblemType::ResponseNotStored,
                &format!(
                    "the request under this key was executed (status {status}) but its response body was over \
                     the {limit}-byte stored-body limit, so it cannot be replayed; it will not be executed again"
                ),
            )
        }
        Verdict::Unknown => outcome_unknown(),
        Verdict::Resolved { .. } if config.on_failure == OnFailure::Release => {
            // A webhook sender reads only the status, and would deliver a 409 again for days: the operator found
            // that the delivery took effect, so it is acknowledged.
            crate::counters::count(crate::counters::Count::Replays);
            replay(StoredResponse { status: 200, headers: Vec::new(), body: bytes::Bytes::new() })
        }
        Verdict::Resolved { note } => outcome_resolved(&note),
    })
}

pub(crate) fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}
