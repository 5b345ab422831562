//! A property test over the slot state machine of `idem once` (`slot::Claim` → `HeldSlot`), kept by
//! `idem_store::LeaseKeeper`: three invocations of one slot follow an adversarial schedule (who acts, whether
//! it comes past the starting deadline, how its command ends, when time jumps, which store operation fails or
//! lands with its answer lost) on a manual clock (paused tokio time; the store's TTLs and `now` run on it).
//! Invocations of later slots move the job record's newest slot past it (recording it missed if nothing was
//! written for it) and the history prune deletes its finished entry, as they do in `idem once`.
//!
//! What must hold after every step, whatever the schedule:
//! - at most one invocation believes it holds the slot's lease;
//! - a done or missed slot never changes again, and no command starts once the slot is done, missed or
//!   failed for good;
//! - the slot is recorded done at most once;
//! - commands started never exceed the attempts allowed plus the attempts given back by an interruption,
//!   even after its entry was pruned (a slot older than the job's newest is never claimed).

use std::time::Duration;

use idem_core::ledger::RetryLimit;
use idem_core::slot::{self, Ending, Job, MissedReason, job_key, missed, prune};
use idem_store::testing::{Fault, FaultyStore};
use idem_store::{LeaseKeeper, MemoryStore, Precondition, Store, StoreExt, Ttl, system_time_to_millis};
use proptest::prelude::*;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(3);
const INVOCATIONS: usize = 3;
const LIMIT: RetryLimit = RetryLimit { max_attempts: 3 };

#[derive(Clone, Debug)]
enum Step {
    /// Invocation `0` comes (past the starting deadline when `1`): judges the slot, records it missed, or
    /// claims it and starts the command.
    Come(usize, bool),
    /// Invocation `0` renews its lease if a third of it has passed.
    Fence(usize),
    /// Invocation `0`'s command ends, exit 0 when `1`: the fenced outcome write, then the release.
    End(usize, bool),
    /// Invocation `0` is stopped by a signal: the attempt is given back, then the lease.
    Interrupt(usize),
    /// The clock moves on; every invocation is paused meanwhile.
    Advance(Duration),
    /// An invocation of a later slot comes: if the job record's newest slot is still this one, the slot is
    /// recorded missed if nothing was written for it (create-only), then the newest slot moves past it.
    Newer,
    /// The history prune: the slot's entry is deleted if finished, once the job record moved past the slot
    /// (a hundred newer slots were claimed).
    Prune,
}

fn step() -> impl Strategy<Value = Step> {
    let who = 0..INVOCATIONS;
    prop_oneof![
        3 => (who.clone(), prop::bool::weighted(0.2)).prop_map(|(i, late)| Step::Come(i, late)),
        2 => who.clone().prop_map(Step::Fence),
        3 => (who.clone(), any::<bool>()).prop_map(|(i, ok)| Step::End(i, ok)),
        1 => who.prop_map(Step::Interrupt),
        3 => prop_oneof![
            Just(Duration::from_millis(100)),
            Just(LEASE / 3),
            Just(LEASE - Duration::from_millis(1)),
            Just(LEASE),
            Just(LEASE * 2),
        ]
        .prop_map(Step::Advance),
        1 => Just(Step::Newer),
        1 => Just(Step::Prune),
    ]
}

fn faults() -> impl Strategy<Value = Vec<Option<Fault>>> {
    prop::collection::vec(
        prop_oneof![6 => Just(None), 1 => Just(Some(Fault::Fail)), 1 => Just(Some(Fault::LoseAnswer))],
        0..200,
    )
}

#[allow(clippy::large_enum_variant)]
enum Invocation<'a> {
    Idle,
    Running { held: idem_core::slot::Held, keeper: LeaseKeeper<'a, FaultyStore<MemoryStore>> },
}

fn ending(ok: bool) -> Ending {
    let exit = if ok { "exit 0" } else { "exit 1" };
    Ending { exit: exit.into(), code: Some(i32::from(!ok)), duration_ms: 1, finished_at_ms: 0, output: Vec::new() }
}

async fn schedule(steps: Vec<Step>, faults: Vec<Option<Fault>>) -> Result<(), TestCaseError> {
    let store =
        FaultyStore::new(MemoryStore::with_tokio_clock(), move |op| faults.get(op.index as usize).copied().flatten());
    let keys = slot::Keys::new("job", 1_700_000_000_000);
    let job = |last_slot_ms| {
        Job { schedule: "every 60s".into(), last_slot_ms, missed_unlisted: 0, ..Job::default() }.encode()
    };
    store.inner().put(&job_key("job"), job(keys.slot_ms()), Precondition::Absent, Ttl::Clear).await.unwrap();
    let mut invocations: Vec<Invocation<'_>> = (0..INVOCATIONS).map(|_| Invocation::Idle).collect();
    let (mut started, mut interrupted, mut done_writes) = (0u32, 0u32, 0u32);
    let mut final_entry: Option<slot::Entry> = None;
    let mut counted_interruption = None;
    for step in steps {
        match step {
            Step::Come(i, late) if matches!(invocations[i], Invocation::Idle) => {
                let Ok(now) = store.now().await else { continue };
                let now_ms = system_time_to_millis(now);
                // The job record and the entry in one read, as an invocation reads them.
                let Ok(read) = store.get_many(&[job_key("job"), keys.entry().to_owned()]).await else { continue };
                let [job_read, entry]: [_; 2] = read.try_into().unwrap();
                let newest = Job::decode(job_read.unwrap().value()).unwrap().last_slot_ms;
                let Ok(lease) = store.get(keys.lease()).await else { continue };
                let prev = entry.map(|v| (v.generation(), slot::Entry::decode(v.value()).unwrap()));
                let behind = newest > keys.slot_ms();
                match slot::plan(prev.as_ref().map(|(_, e)| e), lease.is_some(), LIMIT, late, behind) {
                    slot::Plan::RecordMissed => {
                        let reason = MissedReason::PastDeadline { came_at_ms: now_ms };
                        let _ = store.apply(missed(&keys, reason, now_ms)).await;
                    }
                    slot::Plan::Run { .. } => {
                        let claim = slot::Claim::new(keys.clone(), format!("inv-{i}"), "host", now_ms, LEASE, prev);
                        let sent = Instant::now();
                        let Ok(Some(lease_g)) = store.apply(claim.lease_write()).await else { continue };
                        match store.apply(claim.entry_write()).await {
                            Ok(Some(entry_g)) => {
                                started += 1;
                                let held = claim.acquired(lease_g, entry_g);
                                invocations[i] =
                                    Invocation::Running { held, keeper: LeaseKeeper::new(&store, LEASE, sent) };
                            }
                            _ => {
                                let _ = store.apply(claim.lease_release(lease_g)).await;
                            }
                        }
                    }
                    slot::Plan::Done
                    | slot::Plan::Missed
                    | slot::Plan::Paused
                    | slot::Plan::Skipped
                    | slot::Plan::FailedForGood
                    | slot::Plan::Held
                    | slot::Plan::Behind => {}
                }
            }
            Step::Fence(i) => {
                if let Invocation::Running { held, keeper } = &mut invocations[i] {
                    keeper.fence(held).await;
                }
            }
            Step::End(i, ok) => {
                if let Invocation::Running { held, keeper } = &mut invocations[i] {
                    keeper.await_renewal(held).await;
                    let write = if ok { held.done(ending(true)) } else { held.failed(ending(false), LIMIT).0 };
                    if matches!(store.apply(write).await, Ok(Some(_))) && ok {
                        done_writes += 1;
                    }
                    let _ = store.apply(held.release()).await;
                    invocations[i] = Invocation::Idle;
                }
            }
            Step::Interrupt(i) => {
                if let Invocation::Running { held, keeper } = &mut invocations[i] {
                    keeper.await_renewal(held).await;
                    // Counted below from what the store holds: a write whose answer was lost landed all the same.
                    let _ = store.apply(held.interrupted(0)).await;
                    let _ = store.apply(held.release()).await;
                    invocations[i] = Invocation::Idle;
                }
            }
            Step::Advance(d) => tokio::time::advance(d).await,
            Step::Newer => {
                // Only the move off this slot records it; later moves start from the newer slot.
                let Ok(Some(record)) = store.get(&job_key("job")).await else { continue };
                if Job::decode(record.value()).unwrap().last_slot_ms > keys.slot_ms() {
                    continue;
                }
                let Ok(now) = store.now().await else { continue };
                let reason = MissedReason::NotStarted;
                match store.apply(missed(&keys, reason, system_time_to_millis(now))).await {
                    Ok(_) => {}
                    Err(e) if e.is_precondition_failed() => {}
                    Err(_) => continue,
                }
                let _ = store.put(&job_key("job"), job(keys.slot_ms() + 60_000), Precondition::Any, Ttl::Clear).await;
            }
            Step::Prune => {
                // Pruned only after a hundred newer slots were claimed, so after the job record moved past it.
                let Ok(Some(record)) = store.get(&job_key("job")).await else { continue };
                if Job::decode(record.value()).unwrap().last_slot_ms <= keys.slot_ms() {
                    continue;
                }
                let Ok(Some(v)) = store.get(keys.entry()).await else { continue };
                let listed = [(keys.entry().to_owned(), v.generation(), slot::Entry::decode(v.value()).unwrap())];
                for write in prune(&listed, 0) {
                    let _ = store.apply(write).await;
                }
            }
            Step::Come(..) => {}
        }
        let current = store.inner().get(keys.entry()).await.unwrap();
        if let Some(v) = &current
            && matches!(slot::Entry::decode(v.value()).unwrap(), slot::Entry::Interrupted { .. })
            && counted_interruption != Some(v.generation())
        {
            // An attempt given back: it does not count against the attempts allowed.
            interrupted += 1;
            counted_interruption = Some(v.generation());
        }
        let entry = current.map(|v| slot::Entry::decode(v.value()).unwrap());
        if let Some(first) = &final_entry {
            // Pruned (gone) is the only change a done or missed entry may see.
            prop_assert!(entry.is_none() || entry.as_ref() == Some(first), "a done or missed slot changed: {entry:?}");
        } else if let Some(e) = entry.filter(slot::Entry::is_final) {
            final_entry = Some(e);
        }
        prop_assert!(done_writes <= 1, "the slot was recorded done twice");
        prop_assert!(
            started <= LIMIT.max_attempts + interrupted,
            "{started} commands for {} attempts",
            LIMIT.max_attempts
        );
        let beliefs = invocations.iter().filter_map(|inv| match inv {
            Invocation::Running { keeper, held } if keeper.lost().is_none() => Some((keeper.sent(), held.length())),
            _ => None,
        });
        prop_assert!(
            beliefs.filter(|(sent, length)| sent.elapsed() < *length).count() <= 1,
            "two invocations believe they hold the slot"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_slot_runs_once_at_a_time_and_is_done_once(steps in prop::collection::vec(step(), 1..60), faults in faults()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        runtime.block_on(schedule(steps, faults))?;
    }
}
