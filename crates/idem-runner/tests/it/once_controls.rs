//! `idem once`'s overlap policies, pause and triggered runs, with real concurrent invocations (tasks on one
//! [`MemoryStore`] on the system clock) and a command that appends to a log, so executions are counted.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idem_runner::once::{self, OnceConfig, Outcome, Overlap, Schedule};
use idem_store::MemoryStore;

fn job(dir: &Path, every: Duration, overlap: Overlap, script: &str) -> OnceConfig {
    let script = format!("cd '{}' && {script}", dir.display());
    let mut cfg = OnceConfig::new("job", Schedule::every(every).unwrap(), vec!["sh".into(), "-c".into(), script]);
    cfg.lease = Duration::from_secs(1);
    cfg.overlap = overlap;
    cfg
}

fn log(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("log")).map(|s| s.lines().map(str::to_owned).collect()).unwrap_or_default()
}

/// Invocations of a 1 s job whose command takes 1.5 s, one every 250 ms for 6 s, each its own task (as cron
/// on several machines): returns their outcomes once all ended.
async fn invoke_for_six_seconds(store: &Arc<MemoryStore>, cfg: &OnceConfig) -> Vec<Outcome> {
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let (store, cfg) = (Arc::clone(store), cfg.clone());
        tasks.push(tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await }));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap().unwrap().outcome);
    }
    outcomes
}

/// The log's `start`/`end` lines never show two runs at once; returns how many ran.
fn runs_one_at_a_time(lines: &[String]) -> usize {
    let mut running = 0;
    let mut runs = 0;
    for line in lines {
        if line == "start" {
            running += 1;
            runs += 1;
            assert_eq!(running, 1, "two slots ran at once: {lines:?}");
        } else {
            running -= 1;
        }
    }
    runs
}

const SLOW: &str = "echo start >> log; sleep 1.5; echo end >> log";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skip_never_runs_two_slots_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let cfg = job(dir.path(), Duration::from_secs(1), Overlap::Skip, SLOW);
    let outcomes = invoke_for_six_seconds(&store, &cfg).await;
    let runs = runs_one_at_a_time(&log(dir.path()));
    assert!(runs >= 2, "{runs} runs: {outcomes:?}");
    assert!(outcomes.iter().any(|o| matches!(o, Outcome::EarlierRunning { .. })), "{outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn buffer_one_runs_the_next_slot_after_the_running_one_and_skips_a_third() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let cfg = job(dir.path(), Duration::from_secs(1), Overlap::BufferOne, SLOW);
    let outcomes = invoke_for_six_seconds(&store, &cfg).await;
    let runs = runs_one_at_a_time(&log(dir.path()));
    let succeeded = outcomes.iter().filter(|o| matches!(o, Outcome::Succeeded { .. })).count();
    assert_eq!(runs, succeeded, "every run started was recorded done: {outcomes:?}");
    // A buffered slot ran right after the one it waited for: runs follow each other with no gap for slots.
    assert!(runs >= 3, "{runs} runs: {outcomes:?}");
    assert!(outcomes.iter().any(|o| matches!(o, Outcome::Skipped { .. })), "a slot found one buffered: {outcomes:?}");
    let history = once::history(&*store, "job", 100).await.unwrap().unwrap();
    assert!(history.slots.iter().any(|s| s.state == "skipped"), "{}", history.render());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_slot_runs_while_paused_and_the_next_after_the_pause_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let cfg = job(dir.path(), Duration::from_secs(1), Overlap::Allow, "date +%s%3N >> log");
    // The job exists once invoked.
    once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    let first = log(dir.path()).len();
    let now = idem_store::system_time_to_millis(SystemTime::now());
    let until = now + 2500;
    let p = once::pause(&*store, "job", Some(until), Some("incident".into()), "ops@test").await.unwrap().unwrap();
    assert_eq!(p.by, "ops@test");
    let mut paused = 0;
    loop {
        let report = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
        if matches!(report.outcome, Outcome::Paused { .. }) {
            paused += 1;
        }
        if log(dir.path()).len() > first {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let started: Vec<u64> = log(dir.path())[first..].iter().map(|l| l.parse().unwrap()).collect();
    assert!(started.iter().all(|t| *t >= until), "a run started while paused: {started:?} < {until}");
    assert!(paused >= 3, "invocations during the pause found it paused: {paused}");
    let history = once::history(&*store, "job", 100).await.unwrap().unwrap();
    assert!(history.slots.iter().any(|s| s.state == "paused"), "{}", history.render());
    let view = history.pause.unwrap();
    assert!(!view.paused && view.by == "ops@test" && view.note.as_deref() == Some("incident"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_job_is_resumed_and_runs_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(366 * 86_400), Overlap::Allow, "echo ran >> log");
    assert!(once::pause(&store, "job", None, None, "a@b").await.unwrap().is_none(), "no such job yet");
    once::forget(&store, "job").await.unwrap();
    let mut daily = cfg.clone();
    daily.schedule = Schedule::every(Duration::from_secs(1)).unwrap();
    once::once(&store, &daily, std::future::pending()).await.unwrap();
    once::pause(&store, "job", None, None, "a@b").await.unwrap().unwrap();
    let before = log(dir.path()).len();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = once::once(&store, &daily, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Paused { recorded_now: true, .. }), "{}", r.render());
    assert_eq!(log(dir.path()).len(), before);
    assert!(once::resume(&store, "job", "c@d").await.unwrap().is_some());
    assert!(once::resume(&store, "job", "c@d").await.unwrap().is_none(), "resumed already");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = once::once(&store, &daily, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_retried_five_times_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(366 * 86_400), Overlap::Allow, "echo ran >> log");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(log(dir.path()).len(), 1, "the slot ran");
    for i in 0..5 {
        let t = once::trigger(&store, "job", Some("deploy-42"), "ops@test").await.unwrap().unwrap();
        assert_eq!(t.new, i == 0, "only the first request is new");
    }
    for _ in 0..3 {
        once::once(&store, &cfg, std::future::pending()).await.unwrap();
    }
    assert_eq!(log(dir.path()).len(), 2, "the slot once and the trigger once");
    let history = once::history(&store, "job", 10).await.unwrap().unwrap();
    assert_eq!(history.triggers.len(), 1);
    assert_eq!(history.triggers[0].1.state, "done");
    let jobs = once::list(&store).await.unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!((jobs[0].name.as_str(), jobs[0].last_state.as_str()), ("job", "done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_overlap_policy_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(366 * 86_400), Overlap::Allow, "true");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let other = OnceConfig { overlap: Overlap::BufferAll, ..cfg };
    let e = once::once(&store, &other, std::future::pending()).await.unwrap_err().to_string();
    assert!(e.contains("--overlap allow in this store, not buffer-all"), "{e}");
}

/// A slot's invocation under `cancel-other` / `terminate-other` while the earlier slot's command (a minute
/// long) runs in another invocation: the earlier command is stopped within a lease (SIGTERM it traps under
/// cancel-other, SIGKILL under terminate-other), recorded replaced, and the new slot runs after it, never beside.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_slot_replaces_the_running_one_within_a_lease() {
    for policy in [Overlap::CancelOther, Overlap::TerminateOther] {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(MemoryStore::new());
        let script = r#"echo "start $IDEM_SLOT" >> log; trap 'echo "term $IDEM_SLOT" >> log; exit 143' TERM;
            if [ ! -e first ]; then touch first; sleep 60 & wait; else echo "end $IDEM_SLOT" >> log; fi"#;
        let cfg = job(dir.path(), Duration::from_secs(1), policy, script);
        let first = {
            let (store, cfg) = (Arc::clone(&store), cfg.clone());
            tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await })
        };
        while !log(dir.path()).iter().any(|l| l.starts_with("start")) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The next slot's invocation, once the first slot's time has passed.
        let started = log(dir.path())[0].clone();
        let second = loop {
            let r = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
            if !matches!(r.outcome, Outcome::AlreadyDone { .. } | Outcome::Held { .. }) && r.slot != started[6..] {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let asked = std::time::Instant::now();
        let first = first.await.unwrap().unwrap();
        assert!(matches!(second.outcome, Outcome::Succeeded { .. }), "{policy:?}: {}", second.render());
        assert!(matches!(first.outcome, Outcome::Replaced { .. }), "{policy:?}: {}", first.render());
        assert!(asked.elapsed() < Duration::from_secs(3), "{policy:?}: stopped within a lease (and its grace)");
        let lines = log(dir.path());
        let trapped = lines.iter().any(|l| l.starts_with("term"));
        assert_eq!(trapped, policy == Overlap::CancelOther, "{policy:?}: SIGTERM under cancel-other only: {lines:?}");
        // The new slot started after the earlier one ended: its start line comes after the term (or the kill).
        let second_start = lines.iter().rposition(|l| l.starts_with("start")).unwrap();
        assert!(second_start > 0 && lines.last().unwrap().starts_with("end"), "{policy:?}: {lines:?}");
        let history = once::history(&*store, "job", 10).await.unwrap().unwrap();
        assert!(history.slots.iter().any(|s| s.state == "replaced"), "{}", history.render());
        assert_eq!(history.ran_more_than_once, 0);
    }
}

/// Three slots in a row under `cancel-other`, the first ignoring SIGTERM (so it ends a lease after it was asked,
/// killed): the second waits for it, the third asks both to stop; the second, replaced while it waited, is
/// recorded skipped and never starts; the third runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_replaced_while_it_waits_never_starts() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let script = r#"echo "start $IDEM_SLOT" >> log; [ -e first ] && exit 0; touch first; trap '' TERM; sleep 30"#;
    let cfg = job(dir.path(), Duration::from_secs(1), Overlap::CancelOther, script);
    let spawn = |cfg: &OnceConfig| {
        let (store, cfg) = (Arc::clone(&store), cfg.clone());
        tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await.unwrap() })
    };
    let first = spawn(&cfg);
    while log(dir.path()).is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The next slot's invocation, then the one after: each a second later.
    let started = log(dir.path())[0].replace("start ", "");
    let slot_of = |r: &once::Report| r.slot.clone();
    let mut later = Vec::new();
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        later.push(spawn(&cfg));
    }
    let first = first.await.unwrap();
    let (second, third) = (later.remove(0).await.unwrap(), later.remove(0).await.unwrap());
    assert!(matches!(first.outcome, Outcome::Replaced { attempt: 1, .. }), "{}", first.render());
    let replaced_before = |r: &once::Report| matches!(r.outcome, Outcome::Replaced { attempt: 0, .. });
    assert!(replaced_before(&second) || replaced_before(&third), "{}\n{}", second.render(), third.render());
    let starts = log(dir.path());
    assert_eq!(starts.len(), 2, "the first slot and the last one started, the middle one never: {starts:?}");
    assert!(starts[0].ends_with(&started) && slot_of(&first) == started);
}

/// A triggered run under `skip` never runs beside a slot: requested while the slot's 1.5 s command runs, the
/// invocations that find it meanwhile leave it, and one after runs it; its command is told its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_triggered_run_waits_for_the_running_slot_under_skip() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let script = r#"echo "start ${IDEM_TRIGGER_ID:-slot}" >> log; sleep 1.5; echo end >> log"#;
    let cfg = job(dir.path(), Duration::from_secs(366 * 86_400), Overlap::Skip, script);
    let running = {
        let (store, cfg) = (Arc::clone(&store), cfg.clone());
        tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await.unwrap() })
    };
    while log(dir.path()).is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    once::trigger(&*store, "job", Some("now-1"), "ops@test").await.unwrap().unwrap();
    let meanwhile = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert!(meanwhile.triggers.is_empty(), "not run beside the slot: {}", meanwhile.render());
    // Run after the slot ended: by the invocation that ran the slot, or the next one.
    let running = running.await.unwrap();
    let after = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert_eq!(running.triggers.len() + after.triggers.len(), 1, "{}\n{}", running.render(), after.render());
    let lines = log(dir.path());
    assert_eq!(lines, ["start slot", "end", "start now-1", "end"], "one at a time, the trigger told its id");
}

/// Under `skip`, a slot whose only invocation found the earlier slot still running is recorded skipped at
/// once, so when no later invocation in the slot starts it, the next slot's invocation does not record it
/// missed (Kubernetes and Temporal call it skipped; the missed count is what an alert watches).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_skipped_under_skip_is_recorded_skipped_not_missed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new());
    let cfg = job(dir.path(), Duration::from_secs(2), Overlap::Skip, "echo start >> log; sleep 2.5; echo end >> log");
    // Into a slot's first half, so the first run (2.5 s) reaches into the next slot.
    let now = idem_store::system_time_to_millis(SystemTime::now());
    let start = (now / 2000 + 1) * 2000 + 100;
    tokio::time::sleep(Duration::from_millis(start - now)).await;
    let first = {
        let (store, cfg) = (Arc::clone(&store), cfg.clone());
        tokio::spawn(async move { once::once(&*store, &cfg, std::future::pending()).await })
    };
    // The next slot, while the first still runs: its only invocation.
    let next = start - 100 + 2000;
    let now = idem_store::system_time_to_millis(SystemTime::now());
    tokio::time::sleep(Duration::from_millis((next + 100).saturating_sub(now))).await;
    let r = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::EarlierRunning { .. }), "{}", r.render());
    assert!(matches!(first.await.unwrap().unwrap().outcome, Outcome::Succeeded { .. }));
    // The slot after: it runs, and the one passed over stays skipped.
    let after = next + 2000;
    let now = idem_store::system_time_to_millis(SystemTime::now());
    tokio::time::sleep(Duration::from_millis((after + 100).saturating_sub(now))).await;
    let r = once::once(&*store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
    assert!(r.missed.is_empty(), "the skipped slot was recorded missed: {}", r.render());
    let history = once::history(&*store, "job", 100).await.unwrap().unwrap();
    let states: Vec<&str> = history.slots.iter().map(|s| s.state).collect();
    assert_eq!(states.iter().filter(|s| **s == "skipped").count(), 1, "{}", history.render());
    assert_eq!(states.iter().filter(|s| **s == "missed").count(), 0, "{}", history.render());
    assert_eq!(log(dir.path()).iter().filter(|l| *l == "start").count(), 2);
}

/// What a slot's command leaves running in its process group (a background child that ignores SIGTERM) is
/// killed when the command exits, before the slot is recorded and its lease given back: nothing of it runs
/// beside the next slot (under `skip`, or after a `cancel-other` replacement whose leader exited on SIGTERM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_command_left_running_in_its_group_dies_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    // In braces: `cd DIR && A & B` would run the cd in A's background subshell only.
    let script = "{ sh -c 'echo $$ > child.pid; trap \"\" TERM; exec sleep 30' & } ; \
                  while [ ! -s child.pid ]; do sleep 0.01; done; echo started >> log";
    let cfg = job(dir.path(), Duration::from_secs(3600), Overlap::Skip, script);
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
    let pid = std::fs::read_to_string(dir.path().join("child.pid")).unwrap().trim().to_owned();
    // Gone, or a zombie waiting for init to reap it: not running.
    let running = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| stat.rsplit(") ").next().is_some_and(|rest| !rest.starts_with('Z')))
    };
    let since = std::time::Instant::now();
    while running() {
        assert!(since.elapsed() < Duration::from_secs(5), "the background child {pid} outlived its slot");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A slot recorded paused is run by the next invocation in its time once the job is resumed (as `resume`
/// says, and as Kubernetes runs a suspended CronJob's missed schedule when it is resumed); the invocations in
/// between say the job is paused, and one after the slot's deadline says it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_recorded_paused_runs_once_resumed_within_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(4), Overlap::Skip, "echo ran >> log");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let now = idem_store::system_time_to_millis(SystemTime::now());
    tokio::time::sleep(Duration::from_millis((now / 4000 + 1) * 4000 + 100 - now)).await;
    once::pause(&store, "job", None, Some("maintenance".into()), "ops@test").await.unwrap().unwrap();
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Paused { recorded_now: true, holds: true, .. }), "{}", r.render());
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(r.render().contains("the job is paused by ops@test until resumed"), "{}", r.render());
    let before = log(dir.path()).len();
    once::resume(&store, "job", "ops@test").await.unwrap().unwrap();
    let r = once::once(&store, &cfg, std::future::pending()).await.unwrap();
    assert!(matches!(r.outcome, Outcome::Succeeded { .. }), "{}", r.render());
    assert_eq!(log(dir.path()).len(), before + 1);
}

/// The limits of the operator's controls, each refused with what to do instead, nothing changed: a pause
/// until more than 366 days away, a note over 1,000 bytes, a trigger id that does not start with a letter or
/// a digit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_trigger_limits_are_refused_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = MemoryStore::new();
    let cfg = job(dir.path(), Duration::from_secs(3600), Overlap::Allow, "true");
    once::once(&store, &cfg, std::future::pending()).await.unwrap();
    let now = idem_store::system_time_to_millis(SystemTime::now());
    let far = now + 400 * 86_400_000;
    let e = once::pause(&store, "job", Some(far), None, "a@b").await.unwrap_err().to_string();
    assert!(e.contains("more than 366 days away"), "{e}");
    let e = once::pause(&store, "job", None, Some("x".repeat(1001)), "a@b").await.unwrap_err().to_string();
    assert!(e.contains("--note is longer than 1000 bytes"), "{e}");
    assert!(once::pause_state(&store, "job").await.unwrap().is_none(), "nothing paused");
    for id in ["-x", ".x", ".."] {
        let e = once::trigger(&store, "job", Some(id), "a@b").await.unwrap_err().to_string();
        assert!(e.contains("starting with a letter or digit"), "{id}: {e}");
    }
}
