//! `idem once`'s backfill, catch-up window and jitter, with real concurrent invocations (tasks on one
//! [`MemoryStore`] on the system clock) and a command that appends to a log, so executions are counted.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idem_runner::once::{self, OnceConfig, Outcome, Schedule};
use idem_store::MemoryStore;

const HOUR: Duration = Duration::from_secs(3600);

fn job(dir: &Path, every: Duration, script: &str) -> OnceConfig {
    let script = format!("cd '{}' && {script}", dir.display());
    let mut cfg = OnceConfig::new("job", Schedule::every(every).unwrap(), vec!["sh".into(), "-c".into(), script]);
    cfg.lease = Duration::from_secs(2);
    cfg
}

fn log(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("log")).map(|s| s.lines().map(str::to_owned).collect()).unwrap_or_default()
}

/// How many times each slot's command ran to its end (`end SLOT` lines).
fn ends(dir: &Path) -> BTreeMap<String, usize> {
    let mut ends = BTreeMap::new();
    for line in log(dir) {
        if let Some(slot) = line.strip_prefix("end ") {
            *ends.entry(slot.to_owned()).or_default() += 1;
        }
    }
    ends
}

fn now_ms() -> u64 {
    idem_store::system_time_to_millis(SystemTime::now())
}

/// Resolves once the log holds `n` ends (the invocation is then killed, as kill -9 of cron's shell would leave
/// it: its running command is stopped, its attempt counted).
async fn after_ends(dir: &Path, n: usize) {
    while ends(dir).values().sum::<usize>() < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const LOGGED: &str = r#"echo "start $IDEM_SLOT" >> log; sleep 0.02; echo "end $IDEM_SLOT" >> log"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backfill_of_100_slots_stopped_halfway_and_resumed_runs_each_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let cfg = job(dir.path(), HOUR, LOGGED);
    let first = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(first.outcome, Outcome::Succeeded { .. }), "{}", first.render());
    let current = ends(dir.path());
    let hour = 3_600_000;
    let newest = now_ms() / hour * hour;
    let b = once::backfill(&*store, "job", newest - 100 * hour, newest - hour, "ops@test").await.unwrap().unwrap();
    assert_eq!(b.requested.len(), 100, "{b:?}");
    assert!(b.not_requested.is_empty() && b.clamped_to.is_none(), "{b:?}");
    // Stopped once 50 ran to their end: the one running then is killed (its attempt counts, and is retried).
    let stopped = once::once(&*store, &cfg, after_ends(dir.path(), 51)).await.unwrap();
    let halfway: usize = ends(dir.path()).values().sum();
    assert!((51..100).contains(&halfway), "{halfway} ran before the stop: {}", stopped.render());
    // The slot in flight at the stop (the last started): its command may have written its end before it was
    // killed, and then its rerun writes another (at-least-once for the command a stop interrupts, docs/design/
    // cron.md; CI on a loaded machine met it). Every other slot ends exactly once.
    let in_flight = log(dir.path()).iter().rev().find_map(|l| l.strip_prefix("start ").map(str::to_owned));
    // Resumed by three invocations at once (as cron on three machines).
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (store, cfg) = (Arc::clone(&store), cfg.clone());
        tasks.push(tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let ends = ends(dir.path());
    let backfilled: Vec<_> = ends.iter().filter(|(slot, _)| !current.contains_key(*slot)).collect();
    assert_eq!(backfilled.len(), 100, "100 distinct slots written, 100 present");
    let twice = |slot: &str| in_flight.as_deref() == Some(slot) && ends[slot] == 2;
    let repeated: Vec<_> = backfilled.iter().filter(|(slot, n)| **n != 1 && !twice(slot)).collect();
    assert!(repeated.is_empty(), "0 duplicates but the slot in flight at the stop ({in_flight:?}): {repeated:?}");
    let extra = usize::from(in_flight.as_deref().is_some_and(twice));
    assert_eq!(ends.values().sum::<usize>(), 101 + extra, "the current slot and the 100 backfilled, each once");
    // A backfill made again requests nothing: every slot is done (or pruned from the history: may have run).
    let again = once::backfill(&*store, "job", newest - 100 * hour, newest - hour, "ops@test").await.unwrap().unwrap();
    assert!(again.requested.is_empty(), "{again:?}");
    assert!(again.not_requested.iter().all(|(_, why)| *why == "done" || why.starts_with("older than")), "{again:?}");
    once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(log(dir.path()).iter().filter(|l| l.starts_with("end ")).count(), 101 + extra, "nothing ran again");
    let history = once::history(&*store, "job", 100).await.unwrap().unwrap();
    assert_eq!(history.ran_more_than_once, 0, "{}", history.render());
}

/// 120 backfilled slots overflow the history (100 kept): the prune deletes the oldest done entries, and a
/// backfill made again over the range must not take their absence for slots never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_made_again_over_slots_pruned_from_the_history_runs_none_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), HOUR, r#"echo "end $IDEM_SLOT" >> log"#);
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let hour = 3_600_000;
    let newest = now_ms() / hour * hour;
    let range = (newest - 120 * hour, newest - hour);
    assert_eq!(once::backfill(&store, "job", range.0, range.1, "a@b").await.unwrap().unwrap().requested.len(), 120);
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(ends(dir.path()).len(), 121, "each slot once");
    let again = once::backfill(&store, "job", range.0, range.1, "a@b").await.unwrap().unwrap();
    assert!(again.requested.is_empty(), "{again:?}");
    let pruned = again.not_requested.iter().filter(|(_, why)| why.starts_with("older than")).count();
    assert!(pruned > 0, "the history pruned some: {again:?}");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(log(dir.path()).len(), 121, "nothing ran again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_is_refused_or_clamped_as_it_says() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(1), "true");
    assert!(once::backfill(&store, "job", 0, 1, "a@b").await.unwrap().is_none(), "no such job");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let now = now_ms();
    let e = once::backfill(&store, "job", now, now - 1000, "a@b").await.unwrap_err().to_string();
    assert!(e.contains("is after --to"), "{e}");
    let e = once::backfill(&store, "job", now - 20_000_000, now - 1000, "a@b").await.unwrap_err().to_string();
    assert!(e.contains("more than 10000 slots"), "{e}");
    let b = once::backfill(&store, "job", now - 3000, now + 60_000, "a@b").await.unwrap().unwrap();
    assert!(b.clamped_to.is_some(), "{b:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_an_outage_missed_within_the_catchup_window_run_in_order_before_the_current_one() {
    for window in [None, Some(Duration::from_secs(30))] {
        let dir = tempfile::tempdir().unwrap();
        let store = MemoryStore::new();
        let mut cfg = job(dir.path(), Duration::from_secs(1), r#"echo "end $IDEM_SLOT" >> log"#);
        cfg.catchup_window = window;
        once::once(&store, &cfg, std::future::pending()).await.unwrap();
        // No invocation for three slots and more: the outage is the test's input, not a wait for a condition.
        tokio::time::sleep(Duration::from_millis(3300)).await;
        let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
        let ran: Vec<String> = log(dir.path()).into_iter().map(|l| l.replace("end ", "")).collect();
        if window.is_none() {
            assert!(r.missed.len() >= 2 && r.requested.is_empty(), "{}", r.render());
            assert_eq!(ran.len(), 2, "the first slot and the current one: {ran:?}");
            continue;
        }
        assert!(r.missed.is_empty() && r.requested.len() >= 2, "{}", r.render());
        assert_eq!(r.requested_runs.len(), r.requested.len(), "{}", r.render());
        assert!(r.requested_runs.iter().all(|(_, o)| matches!(o, Outcome::Succeeded { .. })), "{}", r.render());
        let mut sorted = ran.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(ran, sorted, "in slot order, each once (the current slot last)");
        assert_eq!(ran.len(), r.requested.len() + 2, "{ran:?}");
        assert_eq!(ran.last().unwrap(), &r.slot, "the current slot ran after the ones caught up");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_starts_at_its_jitter_offset_which_every_machine_computes_alike() {
    let every = Duration::from_secs(2);
    let schedule = Schedule::every(every).unwrap();
    let jitter = Duration::from_millis(1500);
    let offsets: Vec<u64> = (0..50).map(|i| schedule.jitter_offset("job", i * 2000, jitter).unwrap()).collect();
    assert!(offsets.iter().all(|o| *o < 1500), "{offsets:?}");
    assert!(offsets.iter().collect::<std::collections::BTreeSet<_>>().len() > 30, "spread: {offsets:?}");
    let again: Vec<u64> = (0..50).map(|i| schedule.jitter_offset("job", i * 2000, jitter).unwrap()).collect();
    assert_eq!(offsets, again, "the same name and slot, the same offset");
    // Never past the next slot, whatever the jitter.
    assert!((0..50).all(|i| schedule.jitter_offset("x", i * 2000, HOUR).unwrap() < 2000));

    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), every, "date +%s%3N >> log");
    cfg.jitter = Some(jitter);
    // Invoked right after a slot's time, as cron invokes it: without the jitter it would start at once.
    while now_ms() % 2000 > 30 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
    let started: u64 = log(dir.path())[0].parse().unwrap();
    let slot = started / 2000 * 2000;
    let offset = schedule.jitter_offset("job", slot, jitter).unwrap();
    assert!(started >= slot + offset, "started {started} before its slot {slot} + offset {offset}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_file_text_names_the_job_state_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), HOUR, "true");
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let history = once::history(&store, "job", 100).await.unwrap().unwrap();
    let text = once::prometheus(&history, r.exit_code(false), now_ms());
    for line in [
        "idem_once_last_slot_state{once_job=\"job\",state=\"done\"} 1",
        "idem_once_last_slot_state{once_job=\"job\",state=\"failed\"} 0",
        "idem_once_slots_run_more_than_once{once_job=\"job\"} 0",
        "idem_once_paused{once_job=\"job\"} 0",
        "idem_once_last_invocation_exit_code{once_job=\"job\"} 0",
        "# TYPE idem_once_last_success_timestamp_seconds gauge",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
    }
    let success: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("idem_once_last_success_timestamp_seconds{once_job=\"job\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!((success * 1000.0 - now_ms() as f64).abs() < 60_000.0, "{success}");
}

/// The invocation came in time for its slot: the catch-up runs it ran first (2 s of them) do not make its own
/// slot miss a 1.5 s `--starting-deadline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catching_up_does_not_make_the_own_slot_miss_its_starting_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), Duration::from_secs(1), r#"echo "$IDEM_SLOT" >> log; sleep 0.7"#);
    cfg.catchup_window = Some(Duration::from_secs(30));
    cfg.starting_deadline = Some(Duration::from_millis(1500));
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3300)).await;
    // Right after a slot's time, so the invocation is in time for it.
    while now_ms() % 1000 > 100 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(r.requested_runs.len() >= 2, "{}", r.render());
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
}

/// A signal during a catch-up run stops the invocation (its own slot not started), with a trigger pending too:
/// every look after it sees the signal (it used to poll a finished future: a panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_a_catch_up_run_stops_the_invocation() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), Duration::from_secs(1), r#"echo "end $IDEM_SLOT" >> log; sleep 0.3"#);
    cfg.catchup_window = Some(Duration::from_secs(30));
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    once::trigger(&store, "job", Some("t1"), "ops@test").await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(3300)).await;
    let r = once::once(&store, &cfg, after_ends(dir.path(), 3)).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Stopped { .. }), "{}", r.render());
    assert_eq!(r.exit_code(false), once::EXIT_INTERRUPTED, "{}", r.render());
    assert!(r.triggers.is_empty(), "{}", r.render());
}

/// The job record keeps when the newest success ended, so `status`, `list` and the metrics still say it when
/// the history holds no done slot any more (a hundred failures since); and requested slots not run yet are
/// counted as pending until they ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_success_outlives_the_history_and_pending_runs_are_counted() {
    use idem_store::{Precondition, Store};
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), HOUR, r#"echo "end $IDEM_SLOT" >> log"#);
    let before = now_ms();
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    // The done slot's entry goes, as a prune after a hundred failures would take it.
    let page = store.list("once/job/slot/", None, 100).await.unwrap();
    assert_eq!(page.items.len(), 1);
    for item in page.items {
        store.delete(&item.key, Precondition::Any).await.unwrap();
    }
    let history = once::history(&store, "job", 100).await.unwrap().unwrap();
    let success = history.last_success.clone().expect("kept in the job record");
    let at: jiff::Timestamp = success.parse().unwrap();
    assert!(at.as_millisecond() as u64 >= before / 1000 * 1000, "{success} (shown to the second)");
    let text = once::prometheus(&history, 0, now_ms());
    assert!(text.contains("idem_once_last_success_timestamp_seconds{once_job=\"job\"}"), "{text}");
    assert!(history.render().contains(&format!("last success {success}")), "{}", history.render());
    // Three slots requested: pending until an invocation ran them.
    let hour = 3_600_000;
    let newest = now_ms() / hour * hour;
    let b = once::backfill(&store, "job", newest - 3 * hour, newest - hour, "a@b").await.unwrap().unwrap();
    assert_eq!(b.requested.len(), 3, "{b:?}");
    let history = once::history(&store, "job", 100).await.unwrap().unwrap();
    assert_eq!(history.pending, 3);
    assert!(once::prometheus(&history, 0, now_ms()).contains("idem_once_pending_runs{once_job=\"job\"} 3"));
    assert_eq!(once::list(&store).await.unwrap()[0].pending, 3);
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(ends(dir.path()).len(), 4);
    assert_eq!(once::history(&store, "job", 100).await.unwrap().unwrap().pending, 0);
    assert_eq!(once::list(&store).await.unwrap()[0].pending, 0);
}

/// `--jitter` and `--catchup-window` are kept in the job record like the schedule: an invocation that gives
/// another value (or none) is refused, as two machines would otherwise start or catch up one slot differently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_jitter_or_catchup_window_than_the_job_records_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let mut cfg = job(dir.path(), HOUR, "true");
    cfg.jitter = Some(Duration::from_millis(1));
    cfg.catchup_window = Some(Duration::from_secs(7200));
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let mut other = cfg.clone();
    other.jitter = None;
    let e = once::once(&store, &other, std::future::pending()).await.unwrap_err().to_string();
    assert!(e.contains("has --jitter 1ms in this store, not none"), "{e}");
    let mut other = cfg.clone();
    other.catchup_window = Some(Duration::from_secs(60));
    let e = once::once(&store, &other, std::future::pending()).await.unwrap_err().to_string();
    assert!(e.contains("has --catchup-window 2h in this store, not 1m"), "{e}");
    assert!(once::once(&store, &cfg, std::future::pending()).await.is_ok(), "the same settings run");
}
