//! `idem once` against a store that fails or is slow at chosen moments ([`FaultyStore`] over a
//! [`MemoryStore`] on the system clock), counted by the lines the command appends to a file.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use idem_runner::once::{OnceConfig, Outcome, Schedule, once};
use idem_store::MemoryStore;
use idem_store::testing::{Fault, FaultyStore, OpKind};

/// A job whose one slot (a 366-day period) no test straddles, appending a line to `runs` per execution.
fn job(dir: &Path, lease: Duration, script: &str) -> OnceConfig {
    let schedule = Schedule::every(Duration::from_secs(366 * 86_400)).unwrap();
    let script = format!("cd '{}' && {script}", dir.display());
    let mut cfg = OnceConfig::new("job", schedule, vec!["sh".into(), "-c".into(), script]);
    cfg.lease = lease;
    cfg
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|s| s.lines().count()).unwrap_or(0)
}

/// The store is down from the holder's first renewal until well after its lease lapsed, across the
/// command's end: the outcome write is fenced on the claim, so it is tried again after the lapse and lands
/// once the store is back (nobody took the slot over). The slot is done; a later invocation runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_write_is_retried_after_the_lease_lapsed() {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let down_since: Arc<OnceLock<Instant>> = Arc::default();
    let down = Arc::clone(&down_since);
    let flag = started.clone();
    // Down for 4.5 s from the first operation after the command started (its first renewal, 1 s after the
    // claim): the 3 s lease lapses about 2 s before the store is back.
    let store = FaultyStore::new(MemoryStore::new(), move |_| {
        if !flag.exists() {
            return None;
        }
        let since = down.get_or_init(Instant::now);
        (since.elapsed() < Duration::from_millis(4500)).then_some(Fault::Fail)
    });
    let cfg = job(dir.path(), Duration::from_secs(3), "touch started; sleep 1.5; echo ran >> runs");
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(report.outcome, Outcome::Succeeded { attempt: 1 }, "{}", report.render());
    assert!(down_since.get().is_some_and(|t| t.elapsed() >= Duration::from_millis(4500)), "the store was down");
    let again = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(again.outcome, Outcome::AlreadyDone { attempts: 1, .. }), "{}", again.render());
    assert_eq!(lines(&dir.path().join("runs")), 1, "1 run, 0 repeated");
}

/// A claim whose entry write is answered only after its lease lapsed (the invocation was paused or slow
/// between claim and start) never starts the command: the fence before it renews the lease and is refused.
/// The attempt is given back, so the next invocation runs the slot: 1 run in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_lease_lapsed_before_the_start_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut delayed = false;
    let store = FaultyStore::new(MemoryStore::new(), move |op| {
        let entry_claim = op.kind == OpKind::Put && op.key.contains("/slot/") && !delayed;
        entry_claim.then(|| {
            delayed = true;
            Fault::Delay(Duration::from_millis(2500))
        })
    });
    let cfg = job(dir.path(), Duration::from_secs(1), "echo ran >> runs");
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    let Outcome::LeaseLost { attempt: 1, why, succeeded: false } = &report.outcome else {
        panic!("{}", report.render())
    };
    assert!(why.ends_with("the command was not started"), "{why}");
    assert_eq!(lines(&dir.path().join("runs")), 0, "not started after the lease lapsed");
    let again = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(again.outcome, Outcome::Succeeded { attempt: 1 }, "{}", again.render());
    assert_eq!(lines(&dir.path().join("runs")), 1);
}

/// Sleeps until the system clock is `from_ms`..`from_ms + 300` into a slot of `period_ms`.
fn wait_until_into_slot(period_ms: u64, from_ms: u64) {
    loop {
        let into = now_ms() % period_ms;
        if (from_ms..from_ms + 300).contains(&into) {
            return;
        }
        std::thread::sleep(Duration::from_millis(((from_ms + period_ms - into) % period_ms).max(1)));
    }
}

fn now_ms() -> u64 {
    u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// This machine's clock is 1.5 s ahead of the store's and cron fires the invocation just after a slot
/// boundary by this clock (the store's clock is still 1.3 s before it): within `SKEW_TOLERANCE` (5 s), the
/// invocation waits for the store's clock to reach the boundary and runs that slot, in time for a
/// `--starting-deadline` of 5 s, instead of finding the slot before (or recording it missed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_ahead_of_the_store_runs_the_slot_its_cron_fired_for() {
    assert_eq!(idem_runner::once::SKEW_TOLERANCE, Duration::from_secs(5));
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::with_clock_offset(-1500);
    let mut cfg = job(dir.path(), Duration::from_secs(3), "echo \"$IDEM_SLOT\" >> runs");
    cfg.schedule = Schedule::every(Duration::from_secs(10)).unwrap();
    cfg.starting_deadline = Some(Duration::from_secs(5));
    for _ in 0..2 {
        wait_until_into_slot(10_000, 200);
        let fired = now_ms();
        let boundary = fired - fired % 10_000;
        let report = once(&store, &cfg, std::future::pending()).await.unwrap();
        assert!(matches!(report.outcome, Outcome::Succeeded { attempt: 1 }), "{}", report.render());
        assert_eq!(report.slot, cfg.schedule.format(boundary), "the slot cron fired for, not the one before");
        assert!(now_ms() >= fired + 1000, "it waited for the store's clock to reach the boundary");
    }
    assert_eq!(lines(&dir.path().join("runs")), 2, "2 slots, 2 runs, 0 missed");
}

/// A machine further ahead than `SKEW_TOLERANCE` does not wait: its slot is the store's (the one before the
/// boundary its cron fired at), as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_further_ahead_than_the_tolerance_takes_the_stores_slot() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::with_clock_offset(-7000);
    let mut cfg = job(dir.path(), Duration::from_secs(3), "echo \"$IDEM_SLOT\" >> runs");
    cfg.schedule = Schedule::every(Duration::from_secs(10)).unwrap();
    wait_until_into_slot(10_000, 200);
    let fired = now_ms();
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(report.slot, cfg.schedule.format(fired - fired % 10_000 - 10_000), "{}", report.render());
    assert!(now_ms() < fired + 4000, "it did not wait");
}

/// The invocation pauses between its read of the slot (no entry) and its claim, while the slot runs elsewhere
/// and a hundred more after it, so the history prune deleted the slot's `done` entry: the claim's create-only
/// write then succeeds, as if the slot had never run. Re-checked once made, the claim finds `HISTORY` newer
/// entries, withdraws, and the slot is reported behind: 0 runs, no entry and no lease left for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_paused_past_the_history_does_not_run_a_pruned_slot() {
    use idem_core::{Ending, HISTORY, Job, SlotEntry, SlotKeys, job_key};
    use idem_store::{Precondition, Store as _, Ttl};

    let dir = tempfile::tempdir().unwrap();
    let paused: Arc<tokio::sync::Notify> = Arc::default();
    let pausing = Arc::clone(&paused);
    let mut delayed = false;
    let store = FaultyStore::new(MemoryStore::new(), move |op| {
        let lease_claim = op.kind == OpKind::Put && op.key.contains("/lease/") && !delayed;
        lease_claim.then(|| {
            delayed = true;
            pausing.notify_one();
            Fault::Delay(Duration::from_millis(1500))
        })
    });
    let cfg = job(dir.path(), Duration::from_secs(3), "echo ran >> runs");
    let period = 366 * 86_400_000;
    let slot = now_ms() - now_ms() % period;
    // What the other machines leave while this invocation is paused: the job moved on by HISTORY + 1 slots,
    // each done, and the paused invocation's slot, done too, pruned.
    let elsewhere = {
        let inner = store.inner().clone();
        tokio::spawn(async move {
            paused.notified().await;
            let newest = slot + period * (HISTORY as u64 + 1);
            let job = format!(r#"{{"schedule":"every {}s","last_slot_ms":{newest}}}"#, period / 1000);
            let job = Job::decode(job.as_bytes()).unwrap();
            inner.put(&job_key("job"), job.encode(), Precondition::Any, Ttl::Clear).await.unwrap();
            for i in 1..=HISTORY as u64 + 1 {
                let ending =
                    Ending { exit: "exit 0".into(), code: Some(0), duration_ms: 1, finished_at_ms: 1, output: vec![] };
                let done =
                    SlotEntry::Done { attempts: 1, owner: "o".into(), host: "h".into(), started_at_ms: 1, ending };
                let key = SlotKeys::new("job", slot + period * i);
                inner.put(key.entry(), done.encode(), Precondition::Absent, Ttl::Clear).await.unwrap();
            }
        })
    };
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    elsewhere.await.unwrap();
    assert!(matches!(report.outcome, Outcome::Behind { .. }), "{}", report.render());
    assert_eq!(lines(&dir.path().join("runs")), 0, "the pruned slot did not run again");
    let keys = SlotKeys::new("job", slot);
    assert!(store.inner().get(keys.entry()).await.unwrap().is_none(), "the claim's entry withdrawn");
    assert!(store.inner().get(keys.lease()).await.unwrap().is_none(), "its lease released");
}

/// A signal that came before the command started starts nothing and counts nothing (exit 130): before the
/// claim, nothing is written; after it, the claim is given back. Either way the next invocation runs the slot
/// as attempt 1: 1 run in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_before_the_start_runs_nothing_and_counts_nothing() {
    use std::task::Poll;
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(3), "echo \"$IDEM_ATTEMPT\" >> runs");
    let report = once(&store, &cfg, std::future::ready(())).await.unwrap();
    assert!(report.render().ends_with(": interrupted before the claim: nothing ran"), "{}", report.render());
    assert_eq!(report.exit_code(false), 130);
    // Seen at the second look, after the claim: the claim is given back.
    let mut looks = 0;
    let after_claim = std::future::poll_fn(move |_| {
        looks += 1;
        if looks >= 2 { Poll::Ready(()) } else { Poll::Pending }
    });
    let report = once(&store, &cfg, after_claim).await.unwrap();
    let text = report.render();
    assert!(text.contains(": interrupted before the command started: nothing ran; attempt 1 given back"), "{text}");
    assert_eq!(report.exit_code(false), 130);
    assert_eq!(lines(&dir.path().join("runs")), 0, "nothing started");
    let again = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(again.outcome, Outcome::Succeeded { attempt: 1 }, "{}", again.render());
    assert_eq!(lines(&dir.path().join("runs")), 1);
}
