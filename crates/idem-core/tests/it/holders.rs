//! A property test over the two lease state machines, the idempotency record (`Claim` → `Held`) and the work
//! ledger (`ledger::Claim` → `Held`), each kept by `idem_store::LeaseKeeper`: three holders of one key follow an
//! adversarial schedule (who acts, when time jumps, which store operation fails or lands with its answer
//! lost) on a manual clock (paused tokio time; the store's TTLs run on it too).
//!
//! What must hold after every step, whatever the schedule:
//! - at most one holder believes it holds the lease at any instant (its last answered write was sent less than
//!   a lease ago and its keeper has not lost it);
//! - record: once the key has a finished record, it never changes, and every replay is of exactly it;
//! - ledger: the item is done only with the digest of the output in place ("done implies the digest"). (That a
//!   done item with its output in place is not run again is the runner's judgement, tested in idem-runner.)
//! - ledger: a runner whose lease lapsed while it was paused (time jumps past it) and that resumes does not
//!   discard its attempt unless someone took the item over: when its fence finds the lease lost and every store
//!   operation was answered, the item's entry has another generation or another holder's lease is live. (Its
//!   fence takes the lease again: `Held::retake`, then `Held::reassert`, which moves the fencing token on so a
//!   successor that read the entry before cannot claim over it.)
//! - ledger: a runner whose lease lapsed only during a store outage (`Step::Outage`) and that fences within a
//!   lease after the store came back keeps its item, every operation of its fence answered: the others claim
//!   over a running entry only after watching it for a lease (`Observations::watch`, started again after the
//!   outage), as the runner's claim gate does. Without the gate, `Outage(2 leases), Start(j), Fence(i)` fails.

use std::time::Duration;

use bytes::Bytes;
use idem_core::ledger::{self, Entry, Plan, RetryLimit, plan};
use idem_core::record::{Claim, Held, Observations, Outcome, Record, RecordKey, StoredResponse, Verdict, Watch, judge};
use idem_core::{Fingerprint, IdempotencyKey, Scope};
use idem_store::testing::{Fault, FaultyStore};
use idem_store::{LeaseKeeper, MemoryStore, Store, StoreExt};
use proptest::prelude::*;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(3);
const HOLDERS: usize = 3;

/// One step of the schedule.
#[derive(Clone, Debug)]
enum Step {
    /// Holder `0` looks at the key: claims it and starts executing if it may, or sees a replay.
    Start(usize),
    /// Holder `0` renews its lease if a third of it has passed (the fence before a step that needs it).
    Fence(usize),
    /// Holder `0` finishes its execution: the fenced final write (record), or fence + rename + done (ledger).
    Finish(usize),
    /// Holder `0` gives the key back without having executed (the request never reached the upstream).
    Release(usize),
    /// The clock moves on: every holder is paused meanwhile.
    Advance(Duration),
    /// The store is out while the clock moves on: no holder is served, and each knows it (the runner starts
    /// every watch again once the store answers: `Observations::clear`).
    Outage(Duration),
}

fn step() -> impl Strategy<Value = Step> {
    let holder = 0..HOLDERS;
    prop_oneof![
        3 => holder.clone().prop_map(Step::Start),
        3 => holder.clone().prop_map(Step::Fence),
        3 => holder.clone().prop_map(Step::Finish),
        1 => holder.prop_map(Step::Release),
        3 => prop_oneof![
            Just(Duration::from_millis(100)),
            Just(LEASE / 3),
            Just(LEASE - Duration::from_millis(1)),
            Just(LEASE),
            Just(LEASE * 2),
        ]
        .prop_map(Step::Advance),
        2 => prop_oneof![Just(LEASE + Duration::from_millis(1)), Just(LEASE * 2)].prop_map(Step::Outage),
    ]
}

/// Per store operation, in order: answered normally, failed before it happened, or applied with its answer lost.
fn faults() -> impl Strategy<Value = Vec<Option<Fault>>> {
    prop::collection::vec(
        prop_oneof![6 => Just(None), 1 => Just(Some(Fault::Fail)), 1 => Just(Some(Fault::LoseAnswer))],
        0..200,
    )
}

fn store_with(faults: Vec<Option<Fault>>) -> FaultyStore<MemoryStore> {
    FaultyStore::new(MemoryStore::with_tokio_clock(), move |op| faults.get(op.index as usize).copied().flatten())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap()
}

fn now_ms() -> u64 {
    1_700_000_000_000
}

/// Whether the holders that believe they hold the lease are at most one.
fn exclusive(beliefs: impl Iterator<Item = Option<Instant>>) -> bool {
    beliefs.flatten().filter(|sent| sent.elapsed() < LEASE).count() <= 1
}

// ---- the idempotency record ----

// Test state, one per holder: boxing would only obscure it.
#[allow(clippy::large_enum_variant)]
enum Requester<'a> {
    Idle,
    /// Claimed and executing; `run` numbers the execution (its response body says which).
    Executing {
        lease: Held,
        keeper: LeaseKeeper<'a, FaultyStore<MemoryStore>>,
        run: u32,
    },
    Answered,
}

async fn record_schedule(steps: Vec<Step>, faults: Vec<Option<Fault>>) -> Result<(), TestCaseError> {
    let store = store_with(faults);
    let key = RecordKey::new("idem/", &Scope::from_credential(None), &IdempotencyKey::new("k-1").unwrap());
    let fingerprint = Fingerprint::from_hex(&"ab".repeat(32)).unwrap();
    let mut holders: Vec<Requester<'_>> = (0..HOLDERS).map(|_| Requester::Idle).collect();
    let mut runs = 0u32;
    let mut finished: Option<Record> = None;
    for step in steps {
        match step {
            Step::Start(i) if matches!(holders[i], Requester::Idle) => {
                let Ok(current) = store.get(key.as_str()).await else { continue };
                let record = current.map(|v| Record::decode(v.value()).unwrap());
                match judge(record, &fingerprint) {
                    Verdict::Claim => {
                        let claim = Claim::new(key.clone(), fingerprint, format!("holder-{i}"), now_ms(), LEASE, LEASE);
                        let sent = Instant::now();
                        // A claim whose answer is lost is no claim for its holder (answered 503); the record
                        // it left lapses.
                        if let Ok(Some(generation)) = store.apply(claim.write()).await {
                            runs += 1;
                            let keeper = LeaseKeeper::new(&store, LEASE, sent);
                            holders[i] = Requester::Executing { lease: claim.acquired(generation), keeper, run: runs };
                        }
                    }
                    Verdict::Replay(response) => {
                        let Some(Record::Finished { outcome: Outcome::Response(stored), .. }) = &finished else {
                            return Err(TestCaseError::fail("a replay before any finished record"));
                        };
                        prop_assert_eq!(&response, stored, "a replay of another answer");
                        holders[i] = Requester::Answered;
                    }
                    Verdict::InFlight => {}
                    other => return Err(TestCaseError::fail(format!("unexpected verdict {other:?}"))),
                }
            }
            Step::Fence(i) => {
                if let Requester::Executing { lease, keeper, .. } = &mut holders[i] {
                    keeper.fence(lease).await;
                }
            }
            Step::Finish(i) => {
                if let Requester::Executing { lease, run, .. } = &mut holders[i] {
                    let body = Bytes::from(format!("execution {run}"));
                    let outcome = Outcome::Response(StoredResponse { status: 201, headers: Vec::new(), body });
                    // The layer's final write: fenced on the token; absent (lapsed, unclaimed) → create-only.
                    let written = match store.apply(lease.complete(outcome.clone(), now_ms(), LEASE * 1000)).await {
                        Err(e) if e.current_generation() == Some(None) => {
                            store.apply(lease.complete_lapsed(outcome, now_ms(), LEASE * 1000)).await
                        }
                        other => other,
                    };
                    // A store error leaves it executing (the layer retries in the background); anything
                    // else ends it: stored, or refused by the fence.
                    if !matches!(&written, Err(e) if !e.is_precondition_failed()) {
                        holders[i] = Requester::Answered;
                    }
                }
            }
            Step::Release(i) => {
                if let Requester::Executing { lease, .. } = &holders[i] {
                    let _ = store.apply(lease.release()).await;
                    holders[i] = Requester::Idle;
                }
            }
            Step::Advance(d) | Step::Outage(d) => tokio::time::advance(d).await,
            Step::Start(_) => {}
        }
        // What is really in the store, faults aside.
        let current = store.inner().get(key.as_str()).await.unwrap();
        if let Some(record) = current.map(|v| Record::decode(v.value()).unwrap()) {
            if matches!(record, Record::Finished { .. }) {
                match &finished {
                    Some(first) => prop_assert_eq!(first, &record, "a finished record changed"),
                    None => finished = Some(record),
                }
            }
        } else {
            prop_assert!(finished.is_none(), "a finished record disappeared within its retention");
        }
        let beliefs = holders.iter().map(|h| match h {
            Requester::Executing { keeper, .. } if keeper.lost().is_none() => Some(keeper.sent()),
            _ => None,
        });
        prop_assert!(exclusive(beliefs), "two holders believe they hold the record's lease");
    }
    Ok(())
}

// ---- the work ledger ----

#[allow(clippy::large_enum_variant)]
enum Runner<'a> {
    Idle,
    Running { held: idem_core::ledger::Held, keeper: LeaseKeeper<'a, FaultyStore<MemoryStore>>, run: u32 },
}

fn digest(content: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(content.as_bytes()))
}

async fn ledger_schedule(steps: Vec<Step>, faults: Vec<Option<Fault>>) -> Result<(), TestCaseError> {
    let store = store_with(faults);
    let keys = ledger::Keys::new("job", "item-1");
    let limit = RetryLimit { max_attempts: 1_000 };
    let mut holders: Vec<Runner<'_>> = (0..HOLDERS).map(|_| Runner::Idle).collect();
    // The output file at its final path (renamed into place whole).
    let mut output: Option<String> = None;
    let mut executions = 0u32;
    // Each runner's watches of the item while another runner's attempt is running (the runner's claim gate).
    let mut watches: Vec<Observations> = (0..HOLDERS).map(|_| Observations::new(8)).collect();
    // A holder whose lease lapsed during an outage keeps the item if it fences before this instant: a lease
    // after the store came back.
    let mut protected_until: Vec<Option<Instant>> = vec![None; HOLDERS];
    for step in steps {
        match step {
            Step::Start(i) if matches!(holders[i], Runner::Idle) => {
                let sent = Instant::now();
                let Ok(current) = store.get(keys.entry()).await else { continue };
                let entry_generation = current.as_ref().map(|v| v.generation());
                let prev = current.map(|v| (v.generation(), Entry::decode(v.value()).unwrap()));
                if matches!(prev, Some((_, Entry::Running { .. }))) {
                    // The runner's claim gate (idem-runner `judge.rs`, `holder_gone`): claimed over only once the
                    // lease key is gone and nothing newer was seen for a whole lease of watching.
                    let Ok(lease) = store.get(keys.lease()).await else { continue };
                    let observed =
                        [lease.as_ref().map(|v| v.generation()), entry_generation].into_iter().flatten().max();
                    let watch = watches[i].watch(
                        keys.lease(),
                        observed.unwrap(),
                        LEASE,
                        sent.into_std(),
                        Instant::now().into_std(),
                    );
                    if lease.is_some() || !matches!(watch, Watch::Lapsed(_)) {
                        continue;
                    }
                }
                match plan(prev.as_ref().map(|(_, e)| e), limit) {
                    Plan::CheckDone { ref sha256, .. } if output.as_deref().map(digest).as_ref() == Some(sha256) => {
                        continue;
                    }
                    Plan::New | Plan::Retry { .. } | Plan::CheckDone { .. } => {}
                    other => return Err(TestCaseError::fail(format!("unexpected plan {other:?}"))),
                }
                let claim = ledger::Claim::new(keys.clone(), format!("runner-{i}"), now_ms(), LEASE, prev);
                let sent = Instant::now();
                let Ok(Some(lease_generation)) = store.apply(claim.lease_write()).await else { continue };
                match store.apply(claim.entry_write()).await {
                    Ok(Some(entry_generation)) => {
                        // The command starts only after the fence (the claim is fresh: no write needed).
                        executions += 1;
                        let keeper = LeaseKeeper::new(&store, LEASE, sent).keeping_late_answers();
                        let held = claim.acquired(lease_generation, entry_generation);
                        holders[i] = Runner::Running { held, keeper, run: executions };
                    }
                    _ => {
                        let _ = store.apply(claim.lease_release(lease_generation)).await;
                    }
                }
            }
            Step::Fence(i) => {
                if let Runner::Running { held, keeper, .. } = &mut holders[i] {
                    let faults = store.injected();
                    let kept = fence(&store, held, keeper).await;
                    if protected_until[i].is_some_and(|until| Instant::now() < until) && store.injected() == faults {
                        prop_assert!(kept, "runner {i} lost its item to a claim within a lease after an outage");
                    }
                    if kept {
                        protected_until[i] = None;
                    }
                }
            }
            Step::Finish(i) => {
                if let Runner::Running { held, keeper, run } = &mut holders[i] {
                    protected_until[i] = None;
                    // The runner's finish after exit 0: fence (a lost lease taken again if nobody took the item over), rename
                    // into place, then the done write fenced on the token.
                    let faults = store.injected();
                    if fence(&store, held, keeper).await {
                        let content = format!("output of execution {run}");
                        output = Some(content.clone());
                        let _ = store.apply(held.done(&digest(&content), content.len() as u64, now_ms(), 1)).await;
                        let _ = store.apply(held.release()).await;
                    } else if store.injected() == faults {
                        // Discarded with every store operation answered: someone must have taken the item over
                        // (claimed its entry, or holds a live lease).
                        let entry = store.inner().get(keys.entry()).await.unwrap();
                        let lease = store.inner().get(keys.lease()).await.unwrap();
                        let ours = entry.map(|v| v.generation()) == held.fencing_token()
                            && lease.is_none_or(|v| v.value().as_ref() == format!("runner-{i}").as_bytes());
                        prop_assert!(!ours, "runner {i} discarded an attempt nobody took over");
                    }
                    holders[i] = Runner::Idle;
                }
            }
            Step::Release(i) => {
                if let Runner::Running { held, keeper, .. } = &mut holders[i] {
                    protected_until[i] = None;
                    keeper.await_renewal(held).await;
                    let _ = store.apply(held.interrupted(now_ms())).await;
                    let _ = store.apply(held.release()).await;
                    holders[i] = Runner::Idle;
                }
            }
            Step::Advance(d) => tokio::time::advance(d).await,
            Step::Outage(d) => {
                let began = Instant::now();
                tokio::time::advance(d).await;
                let back = Instant::now();
                for w in &mut watches {
                    w.clear();
                }
                for (h, until) in holders.iter().zip(&mut protected_until) {
                    if let Runner::Running { keeper, .. } = h
                        && keeper.lost().is_none()
                        && keeper.sent() + LEASE > began
                    {
                        *until = Some(back + LEASE);
                    }
                }
            }
            Step::Start(_) => {}
        }
        let entry = store.inner().get(keys.entry()).await.unwrap().map(|v| Entry::decode(v.value()).unwrap());
        if let Some(Entry::Done { sha256, .. }) = entry {
            prop_assert_eq!(output.as_deref().map(digest), Some(sha256), "done without its output in place");
        }
        let beliefs = holders.iter().map(|h| match h {
            Runner::Running { keeper, .. } if keeper.lost().is_none() => Some(keeper.sent()),
            _ => None,
        });
        prop_assert!(exclusive(beliefs), "two runners believe they hold the item's lease");
    }
    Ok(())
}

/// The runner's fence (idem-runner `engine/ledger.rs`, `fence` and `regain`), one try per store operation: the
/// keeper's fence; after a loss, the lease taken again if nobody took the item over: its own lease still there
/// renewed, an absent one created again (`Held::retake`) and the entry written again as it is, conditional on the
/// fencing token (`Held::reassert`). True when the lease is held.
async fn fence(
    store: &FaultyStore<MemoryStore>,
    held: &mut idem_core::ledger::Held,
    keeper: &mut LeaseKeeper<'_, FaultyStore<MemoryStore>>,
) -> bool {
    use idem_store::Renewable as _;
    // The runner's `recover`: a keeper whose renewal was answered holds the lease only while it was set less than a lease ago (a
    // fence whose renewal failed unanswered records no loss, though the lease may have run out meanwhile).
    if keeper.fence(held).await || (keeper.await_renewal(held).await && keeper.sent().elapsed() < LEASE) {
        return true;
    }
    let Ok(current) = store.get(held.keys().lease()).await else { return false };
    let sent = Instant::now();
    let regained = match current {
        Some(v) if held.is_mine(&v) => {
            held.renewed(v.generation());
            match store.apply(held.renewal()).await {
                Ok(Some(g)) => {
                    held.renewed(g);
                    true
                }
                _ => false,
            }
        }
        Some(_) => false,
        None => match store.apply(held.retake()).await {
            Ok(Some(g)) => {
                held.renewed(g);
                // Counted at the claim here (`acquired`): the entry is moved on too.
                let reassert = held.reassert().expect("the model counts at the claim");
                match store.apply(reassert).await {
                    Ok(Some(entry)) => {
                        held.reasserted(entry);
                        true
                    }
                    refused => {
                        if matches!(&refused, Err(e) if e.is_precondition_failed()) {
                            let _ = store.apply(held.release()).await;
                        }
                        false
                    }
                }
            }
            _ => false,
        },
    };
    if regained {
        keeper.restart(sent);
    }
    regained
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_record_is_finished_once_and_replayed_as_stored(steps in prop::collection::vec(step(), 1..60), faults in faults()) {
        runtime().block_on(record_schedule(steps, faults))?;
    }

    #[test]
    fn a_done_item_has_its_output_in_place_and_one_holder_at_a_time(steps in prop::collection::vec(step(), 1..60), faults in faults()) {
        runtime().block_on(ledger_schedule(steps, faults))?;
    }
}

/// The schedule the claim gate exists for: a holder's lease lapses during an outage, another runner looks at
/// the item as soon as the store is back, then the holder fences. Without the gate the other runner claims the
/// lapsed lease first and the holder loses an attempt nobody needed to take over.
#[test]
fn a_holder_back_from_an_outage_keeps_its_item() {
    let steps = vec![Step::Start(0), Step::Outage(LEASE * 2), Step::Start(1), Step::Fence(0)];
    runtime().block_on(ledger_schedule(steps, Vec::new())).unwrap();
}
