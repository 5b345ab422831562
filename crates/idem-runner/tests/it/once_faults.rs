//! `idem once` against a store that fails or is slow at chosen moments ([`FaultyStore`] over a
//! [`MemoryStore`] on the system clock), counted by the lines the command appends to a file.

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
    let text = report.render();
    assert!(text.contains("this machine's clock is 7.0 s ahead of the store's"), "warned with the skew: {text}");
}

/// The invocation pauses between its read of the slot (no entry) and its claim, while the slot runs elsewhere
/// and a hundred more after it, so the history prune deleted the slot's `done` entry: the claim's create-only
/// write then succeeds, as if the slot had never run. Re-checked once made, the claim finds `HISTORY` newer
/// entries, withdraws, and the slot is reported behind: 0 runs, no entry and no lease left for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_paused_past_the_history_does_not_run_a_pruned_slot() {
    use idem_core::slot::{self, Ending, HISTORY, Job, job_key};
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
                    slot::Entry::Done { attempts: 1, owner: "o".into(), host: "h".into(), started_at_ms: 1, ending };
                let key = slot::Keys::new("job", slot + period * i);
                inner.put(key.entry(), done.encode(), Precondition::Absent, Ttl::Clear).await.unwrap();
            }
        })
    };
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    elsewhere.await.unwrap();
    assert!(matches!(report.outcome, Outcome::Behind { .. }), "{}", report.render());
    assert_eq!(lines(&dir.path().join("runs")), 0, "the pruned slot did not run again");
    let keys = slot::Keys::new("job", slot);
    assert!(store.inner().get(keys.entry()).await.unwrap().is_none(), "the claim's entry withdrawn");
    assert!(store.inner().get(keys.lease()).await.unwrap().is_none(), "its lease released");
}

/// Writes what another invocation would have left: the job record `job` (JSON) and `entries` (slot, entry).
async fn seed(store: &MemoryStore, job: &str, entries: &[(u64, idem_core::slot::Entry)]) {
    use idem_store::{Precondition, Store as _, Ttl};
    let record = idem_core::slot::Job::decode(job.as_bytes()).unwrap();
    store.put(&idem_core::slot::job_key("job"), record.encode(), Precondition::Any, Ttl::Clear).await.unwrap();
    for (slot, entry) in entries {
        let key = idem_core::slot::Keys::new("job", *slot);
        store.put(key.entry(), entry.encode(), Precondition::Any, Ttl::Clear).await.unwrap();
    }
}

fn done_entry(at_ms: u64) -> idem_core::slot::Entry {
    let ending = idem_core::slot::Ending {
        exit: "exit 0".into(),
        code: Some(0),
        duration_ms: 1,
        finished_at_ms: at_ms,
        output: vec![],
    };
    idem_core::slot::Entry::Done { attempts: 1, owner: "o".into(), host: "ahead".into(), started_at_ms: at_ms, ending }
}

/// A machine whose clock jumped 200 minutes forward shared the store (a SQLite file on its own clock): it ran
/// the slot 200 minutes ahead and recorded the 100 slots before it missed, before they happened. An invocation
/// with the right clock finds the job's newest slot more than `FUTURE_TOLERANCE` ahead of its clock: it warns
/// with the skew, takes the mark back to its own slot (deleting the missed entries recorded ahead of it,
/// keeping the slot that ran) and runs its slot, instead of exiting 4 (behind) until real time catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_from_a_clock_far_ahead_does_not_stop_the_job() {
    use idem_core::slot::{self, MissedReason};
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), Duration::from_secs(3), "echo ran >> runs");
    cfg.schedule = Schedule::every(Duration::from_secs(60)).unwrap();
    let slot = now_ms() - now_ms() % 60_000;
    let ahead = slot + 200 * 60_000;
    let mut entries: Vec<(u64, slot::Entry)> = (100..200)
        .map(|i| (slot + i * 60_000, slot::Entry::Missed { reason: MissedReason::NoInvocation, recorded_at_ms: ahead }))
        .collect();
    entries.push((ahead, done_entry(ahead)));
    seed(&store, &format!(r#"{{"schedule":"every 60s","last_slot_ms":{ahead},"missed_unlisted":99}}"#), &entries).await;
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(report.outcome, Outcome::Succeeded { attempt: 1 }), "{}", report.render());
    assert!(report.render().contains("is 3h20m ahead of this clock's slot"), "{}", report.render());
    let again = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(again.outcome, Outcome::AlreadyDone { attempts: 1, .. }), "{}", again.render());
    assert_eq!(lines(&dir.path().join("runs")), 1, "1 run, 0 repeated");
    let history = idem_runner::once::history(&store, "job", 100).await.unwrap().unwrap();
    let states: Vec<&str> = history.slots.iter().map(|s| s.state).collect();
    assert_eq!(states, ["done", "done"], "the slot that ran ahead kept, the missed ones recorded ahead gone");
}

/// A slot older than the job's newest (a clock behind, within `FUTURE_TOLERANCE_MS`) never runs, and
/// `status` counts it skipped behind: two invocations of one such slot, 1 counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_skipped_behind_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), Duration::from_secs(3), "echo ran >> runs");
    cfg.schedule = Schedule::every(Duration::from_secs(10)).unwrap();
    wait_until_into_slot(10_000, 200);
    let next = now_ms() - now_ms() % 10_000 + 10_000;
    seed(&store, &format!(r#"{{"schedule":"every 10s","last_slot_ms":{next}}}"#), &[]).await;
    for _ in 0..2 {
        let report = once(&store, &cfg, std::future::pending()).await.unwrap();
        assert!(matches!(report.outcome, Outcome::Behind { .. }), "{}", report.render());
    }
    let history = idem_runner::once::history(&store, "job", 100).await.unwrap().unwrap();
    let json = serde_json::to_value(&history).unwrap();
    assert_eq!(json["behind"], 1, "{json}");
    assert!(history.render().contains("1 slot skipped behind"), "{}", history.render());
    assert_eq!(lines(&dir.path().join("runs")), 0);
}

/// A slot whose holder crashed and that no invocation took over before its time passed is counted in the
/// summary (`crashed`), not only in its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_slot_is_counted_in_the_summary() {
    let store = MemoryStore::new();
    let crashed = idem_core::slot::Entry::Running {
        owner: "o".into(),
        host: "gone".into(),
        attempt: 1,
        started_at_ms: 60_000,
        last: None,
    };
    seed(
        &store,
        r#"{"schedule":"every 60s","last_slot_ms":120000}"#,
        &[(60_000, crashed), (120_000, done_entry(120_000))],
    )
    .await;
    let history = idem_runner::once::history(&store, "job", 1).await.unwrap().unwrap();
    let json = serde_json::to_value(&history).unwrap();
    assert_eq!(json["crashed"], 1, "whatever --limit: {json}");
    assert!(history.render().contains("1 crashed"), "{}", history.render());
}

/// A gap of a cron schedule too long to count (every minute for three years: over a million slots) is said to
/// be at least the count, not the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_missed_count_says_at_least() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), Duration::from_secs(3), "echo ran >> runs");
    cfg.schedule = Schedule::cron("* * * * *", "UTC").unwrap();
    let long_ago = now_ms() - now_ms() % 60_000 - 3 * 366 * 86_400_000;
    seed(&store, &format!(r#"{{"schedule":"{}","last_slot_ms":{long_ago}}}"#, cfg.schedule.canonical()), &[]).await;
    let report = once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(report.outcome, Outcome::Succeeded { attempt: 1 }), "{}", report.render());
    assert!(report.render().contains("and at least 1000000 earlier ones counted"), "{}", report.render());
    let history = idem_runner::once::history(&store, "job", 1).await.unwrap().unwrap();
    assert!(history.render().contains("at least 1000101 missed"), "{}", history.render());
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
    // Seen once the claim's lease is in the store (not by counting looks: how often the invocation looks
    // before its claim is its own business): the claim is given back.
    let watched = store.clone();
    let after_claim = std::future::poll_fn(move |cx| {
        use futures_util::FutureExt;
        use idem_store::Store;
        let prefix = idem_core::slot::lease_prefix("job");
        let page = watched.list(&prefix, None, 10).now_or_never().expect("the memory store answers at once");
        if page.unwrap().items.is_empty() {
            // Looked at again at the invocation's next look (it polls this future, it is not woken).
            cx.waker().wake_by_ref();
            Poll::Pending
        } else {
            Poll::Ready(())
        }
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
