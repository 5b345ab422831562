//! `idem once` through time on a clock the test moves ([`MemoryStore::with_manual_clock`]): slots, gaps,
//! deadlines, overlap and a clock that jumps ahead and back, each decided by setting the store's clock instead
//! of sleeping until it got there. The commands are real processes appending to a log, which is what is
//! counted. (These were process-level tests of the binary on a system clock; what only processes can show, a
//! kill -9, SIGSTOP and signals, stays there.)

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use idem_core::slot::{Job as JobRecord, job_key};
use idem_runner::once::{self, OnceConfig, Outcome, Overlap, Report, Schedule};
use idem_store::{ManualClock, MemoryStore, Precondition, Store as _, Ttl};

/// A job's scratch directory, its store and the store's clock.
struct Job {
    dir: tempfile::TempDir,
    store: MemoryStore,
    clock: ManualClock,
    /// A slot boundary of every period the tests use up to a minute, one to two minutes ahead of this machine's
    /// clock. Ahead: an invocation whose own clock has passed the store's next slot boundary waits for the
    /// store's clock to get there (a machine ahead of the store runs the slot its cron fired for), and this
    /// store's clock only moves when the test moves it. (The invocations warn that the clocks differ.)
    base: u64,
}

impl Job {
    fn new() -> Job {
        let now = u64::try_from(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis()).unwrap();
        let base = now - now % 60_000 + 120_000;
        let (store, clock) = MemoryStore::with_manual_clock(base);
        Job { dir: tempfile::tempdir().unwrap(), store, clock, base }
    }

    /// `name` every `every`, running the shell `script` in the scratch directory.
    fn cfg(&self, name: &str, every: Duration, script: &str) -> OnceConfig {
        let script = format!("cd '{}' && {script}", self.dir.path().display());
        OnceConfig::new(name, Schedule::every(every).unwrap(), vec!["sh".into(), "-c".into(), script])
    }

    /// Sets the store's clock `ms` after [`Job::base`].
    fn at(&self, ms: u64) {
        self.clock.set_ms(self.base + ms);
    }

    async fn invoke(&self, cfg: &OnceConfig) -> Report {
        once::once(&self.store, cfg, std::future::pending()).await.unwrap()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn lines(&self, file: &str) -> Vec<String> {
        lines(&self.path(file))
    }

    async fn history(&self, name: &str, limit: usize) -> once::History {
        once::history(&self.store, name, limit).await.unwrap().unwrap()
    }

    /// Writes the job record `record` of `name`, as an earlier invocation (or a machine on another clock)
    /// left it.
    async fn seed(&self, name: &str, record: &JobRecord) {
        self.store.put(&job_key(name), record.encode(), Precondition::Any, Ttl::Clear).await.unwrap();
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect()
}

/// An RFC 3339 time (`IDEM_SLOT`) in whole seconds since the Unix epoch.
fn secs(rfc3339: &str) -> u64 {
    u64::try_from(rfc3339.parse::<jiff::Timestamp>().unwrap().as_second()).unwrap()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what} did not happen within 20 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Three machines invoke a 2 s job together every 300 ms through 20 s (ten slots): every slot that began ran
/// exactly once, none was missed, and the store's history says the same: executions = slots = done slots, 0
/// ran more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_slot_runs_once_under_steady_invocations() {
    let job = Job::new();
    let mut cfg = job.cfg("steady", Duration::from_secs(2), "echo \"$IDEM_SLOT\" >> runs");
    cfg.lease = Duration::from_secs(2);
    let mut succeeded = 0;
    for step in 0..(20_000 / 300) {
        job.at(100 + step * 300);
        let invocations: Vec<_> = (0..3)
            .map(|_| {
                let (store, cfg) = (job.store.clone(), cfg.clone());
                tokio::spawn(async move { once::once(&store, &cfg, std::future::pending()).await.unwrap() })
            })
            .collect();
        for invocation in invocations {
            let report = invocation.await.unwrap();
            match &report.outcome {
                Outcome::Succeeded { attempt: 1 } => succeeded += 1,
                Outcome::AlreadyDone { .. } | Outcome::Held { .. } => {}
                other => panic!("step {step}: {other:?}\n{}", report.render()),
            }
        }
    }
    let runs = job.lines("runs");
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for slot in &runs {
        *seen.entry(slot).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "slots executed more than once: {twice:?}");
    // Invoked from 0.1 s to 19.9 s: the slots at 0, 2, …, 18 s.
    let slots: Vec<u64> = seen.keys().map(|s| secs(s) * 1000 - job.base).collect();
    assert_eq!(slots, (0..10).map(|k| k * 2000).collect::<Vec<_>>(), "10 slots began, each ran: {runs:?}");
    assert_eq!((runs.len(), succeeded), (10, 10));
    let history = job.history("steady", 100).await;
    assert!(history.slots.iter().all(|s| s.state == "done"), "{:?}", history.slots);
    assert_eq!((history.slots.len(), history.missed, history.ran_more_than_once), (10, 0, 0));
}

/// With no invocation for three slots, the next one runs only the current slot and records the three missed
/// (no invocation), every field that does not apply to a missed slot empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_without_an_invocation_are_recorded_missed() {
    let job = Job::new();
    let cfg = job.cfg("gaps", Duration::from_secs(1), "echo \"$IDEM_SLOT\" >> runs");
    job.at(100);
    assert_eq!(job.invoke(&cfg).await.outcome, Outcome::Succeeded { attempt: 1 });
    job.at(4100);
    let report = job.invoke(&cfg).await;
    assert_eq!(report.outcome, Outcome::Succeeded { attempt: 1 }, "{}", report.render());
    assert_eq!(report.missed.len(), 3, "{}", report.render());
    let runs = job.lines("runs");
    assert_eq!(runs.iter().map(|s| secs(s) * 1000 - job.base).collect::<Vec<_>>(), [0, 4000]);
    let history = job.history("gaps", 100).await;
    let states: Vec<&str> = history.slots.iter().map(|s| s.state).collect();
    assert_eq!(states, ["done", "missed", "missed", "missed", "done"]);
    for missed in &history.slots[1..4] {
        assert_eq!(missed.missed, Some("no_invocation"));
        let empty = (&missed.machine, &missed.started, missed.duration_ms, missed.exit, missed.signal, &missed.ending);
        assert_eq!(empty, (&None, &None, None, None, None, &None), "{missed:?}");
    }
    assert_eq!(history.missed, 3);
}

/// An invocation past `--starting-deadline` runs nothing and records the slot missed (exit 4, and so does
/// every invocation of that slot after it); the next slot, invoked in time, runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocation_past_the_deadline_records_the_slot_missed() {
    let job = Job::new();
    let mut cfg = job.cfg("late", Duration::from_secs(4), "echo \"$IDEM_SLOT\" >> runs");
    cfg.starting_deadline = Some(Duration::from_secs(1));
    job.at(1500);
    let report = job.invoke(&cfg).await;
    assert!(matches!(report.outcome, Outcome::Missed { recorded_now: true, .. }), "{}", report.render());
    assert_eq!(report.exit_code(false), 4);
    assert!(report.render().contains("recorded missed now (not started within --starting-deadline)"));
    job.at(3900);
    let again = job.invoke(&cfg).await;
    assert!(matches!(again.outcome, Outcome::Missed { recorded_now: false, .. }), "{}", again.render());
    assert_eq!(again.exit_code(false), 4);
    assert!(job.lines("runs").is_empty(), "nothing ran for the missed slot");
    job.at(4000 + 900);
    assert_eq!(job.invoke(&cfg).await.outcome, Outcome::Succeeded { attempt: 1 });
    assert_eq!(job.lines("runs").len(), 1);
    let history = job.history("late", 100).await;
    let slots: Vec<_> = history.slots.iter().map(|s| (s.state, s.missed)).collect();
    assert_eq!(slots, [("done", None), ("missed", Some("past_deadline"))]);
}

/// `--overlap skip` (`--no-overlap`): while an earlier slot's command still runs, an invocation in the next
/// slot does not start it (exit 5 with `--fail-if-held`); once the earlier run ended, the next invocation in
/// that slot runs it. A schedule other than the job's recorded one is refused and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_overlap_holds_the_next_slot_until_the_earlier_run_ends() {
    let job = Job::new();
    // The first run waits for the file `go`; the test makes it once the next slot's invocation was turned away.
    let script = "echo \"$IDEM_SLOT\" >> runs; [ \"$(wc -l < runs)\" -gt 1 ] || until [ -e go ]; do sleep 0.01; done";
    let mut cfg = job.cfg("overlap", Duration::from_secs(4), script);
    cfg.overlap = Overlap::Skip;
    cfg.lease = Duration::from_secs(30);
    job.at(100);
    let first = {
        let (store, cfg) = (job.store.clone(), cfg.clone());
        tokio::spawn(async move { once::once(&store, &cfg, std::future::pending()).await.unwrap() })
    };
    wait_for("the first slot's start", || job.lines("runs").len() == 1).await;
    job.at(4300);
    let held = job.invoke(&cfg).await;
    assert!(matches!(held.outcome, Outcome::EarlierRunning { .. }), "{}", held.render());
    assert_eq!(held.exit_code(true), 5);
    assert!(held.render().contains("still runs (--overlap skip)"), "{}", held.render());
    assert_eq!(job.lines("runs").len(), 1);
    std::fs::write(job.path("go"), "").unwrap();
    assert_eq!(first.await.unwrap().outcome, Outcome::Succeeded { attempt: 1 });
    assert_eq!(job.invoke(&cfg).await.outcome, Outcome::Succeeded { attempt: 1 });
    let runs = job.lines("runs");
    assert_eq!(secs(&runs[1]) - secs(&runs[0]), 4, "{runs:?}");
    let other = OnceConfig { schedule: Schedule::every(Duration::from_secs(3)).unwrap(), ..cfg };
    let refused = once::once(&job.store, &other, std::future::pending()).await.unwrap_err().to_string();
    assert!(refused.contains("job overlap is scheduled every 4s in this store, not every 3s"), "{refused}");
    assert_eq!(job.lines("runs").len(), 2, "the refused invocation ran nothing");
}

/// A failing command is retried by the next invocation until `--retries` run out: exit 1, 1, then 3 for the
/// last attempt and 3 without running for every invocation after it; the slot's view says why, the exit code a
/// number, the signal apart, the command's last output kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_slot_is_retried_until_its_retries_run_out() {
    let job = Job::new();
    let mut cfg =
        job.cfg("failing", Duration::from_secs(3600), "echo try >> log; echo \"boom $IDEM_ATTEMPT\" >&2; exit 3");
    cfg.retries = 2;
    job.at(100);
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(job.invoke(&cfg).await.exit_code(false));
    }
    assert_eq!(codes, [1, 1, 3, 3]);
    assert_eq!(job.lines("log").len(), 3, "ran after its retries ran out");
    let history = job.history("failing", 100).await;
    let slot = serde_json::to_value(&history.slots[0]).unwrap();
    assert_eq!((slot["state"].as_str(), slot["attempts"].as_u64()), (Some("failed"), Some(3)));
    assert_eq!(
        (&slot["exit"], &slot["signal"], &slot["ending"]),
        (&3.into(), &serde_json::Value::Null, &"exit 3".into())
    );
    assert_eq!(slot["output"], serde_json::json!(["boom 3"]));
}

/// `--retries` is the job's, as its schedule is: an invocation giving another than the one the job was first
/// invoked with is refused and runs nothing, else a slot's attempts would be judged against two limits and
/// "failed for good" would not be final on every machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_retries_is_refused_like_another_schedule() {
    let job = Job::new();
    let mut cfg = job.cfg("retries", Duration::from_secs(3600), "echo ran >> runs; exit 1");
    cfg.retries = 0;
    job.at(100);
    assert_eq!(job.invoke(&cfg).await.exit_code(false), 3, "--retries 0: failed for good at once");
    let more = OnceConfig { retries: 2, ..cfg.clone() };
    let refused = once::once(&job.store, &more, std::future::pending()).await.unwrap_err().to_string();
    assert!(refused.contains("job retries has --retries 0 in this store, not 2"), "{refused}");
    assert_eq!(job.invoke(&cfg).await.exit_code(false), 3);
    assert_eq!(job.lines("runs").len(), 1, "1 run: the refused invocation ran nothing");
}

/// The missed total is the job's whatever the history's limit (and counts missed entries pruned from it): a
/// job last seen 150 minutes ago (`--every 60s`) records 101 slots missed and counts 49 more, and the history
/// says 150 missed with limits 1, 5 and 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_missed_total_is_the_jobs_whatever_the_limit() {
    let job = Job::new();
    let cfg = job.cfg("gap", Duration::from_secs(60), "echo \"$IDEM_SLOT\" >> runs");
    let last = job.base - 150 * 60_000;
    job.seed("gap", &JobRecord { schedule: "every 60s".into(), last_slot_ms: last, ..JobRecord::default() }).await;
    job.at(100);
    let report = job.invoke(&cfg).await;
    assert_eq!(report.outcome, Outcome::Succeeded { attempt: 1 }, "{}", report.render());
    let text = report.render();
    assert!(
        text.contains("recorded 101 earlier slots missed") && text.contains("and 49 earlier ones counted"),
        "{text}"
    );
    for limit in [1, 5, 100] {
        let history = job.history("gap", limit).await;
        assert_eq!((history.missed, history.slots.len()), (150, limit), "limit {limit}");
    }
}

/// A slot whose entry may have been pruned never runs: the store holds a job record 200 minutes ahead of the
/// clock with its newest 100 slots done (as a machine 200 minutes ahead leaves it). Beyond the future
/// tolerance the job is taken back to this clock's slot, but that slot has no entry and 100 newer ones: its
/// claim is withdrawn. Five invocations: 0 runs, each exit 4 saying why; nothing written for the old slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_older_than_the_jobs_newest_never_runs() {
    use idem_core::slot::{self, Ending};
    let job = Job::new();
    let cfg = job.cfg("stale", Duration::from_secs(60), "echo \"$IDEM_SLOT\" >> runs");
    let newest = job.base + 200 * 60_000;
    let record =
        JobRecord { schedule: "every 60s".into(), last_slot_ms: newest, missed_unlisted: 99, ..Default::default() };
    job.seed("stale", &record).await;
    for slot in (101..=200).map(|i| job.base + i * 60_000) {
        let ending =
            Ending { exit: "exit 0".into(), code: Some(0), duration_ms: 1, finished_at_ms: slot, output: vec![] };
        let entry =
            slot::Entry::Done { attempts: 1, owner: "o".into(), host: "ahead".into(), started_at_ms: slot, ending };
        job.store
            .put(slot::Keys::new("stale", slot).entry(), entry.encode(), Precondition::Absent, Ttl::Clear)
            .await
            .unwrap();
    }
    job.at(100);
    for _ in 0..5 {
        let report = job.invoke(&cfg).await;
        assert_eq!(report.exit_code(false), 4, "{}", report.render());
        assert!(report.render().contains("not run: the job has already seen the later slot"), "{}", report.render());
    }
    assert!(job.lines("runs").is_empty(), "0 runs of a slot older than the job's newest");
    let history = job.history("stale", 1000).await;
    assert_eq!((history.slots.len(), history.ran_more_than_once), (100, 0), "nothing written for the old slot");
}

/// A machine whose clock ran 30 minutes (more than a history of 100 slots) ahead shares the store: it records
/// 100 slots missed ahead and runs its slot, whose pruning must not delete the entry of the slot that ran
/// before the jump. The right clock then takes the job back (deleting the missed entries ahead) and finds that
/// slot done: 2 runs for 2 slots, 0 ran more than once. (Before the prune kept it, the slot ran again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_that_ran_stays_done_after_a_clock_ran_more_than_a_history_ahead() {
    let job = Job::new();
    let cfg = job.cfg("jump", Duration::from_secs(10), "echo \"$IDEM_SLOT\" >> runs");
    job.at(100);
    assert_eq!(job.invoke(&cfg).await.outcome, Outcome::Succeeded { attempt: 1 });
    job.at(1_800_000 + 100);
    let ahead = job.invoke(&cfg).await;
    assert_eq!(ahead.outcome, Outcome::Succeeded { attempt: 1 }, "{}", ahead.render());
    assert!(ahead.render().contains("recorded 100 earlier slots missed"), "{}", ahead.render());
    job.at(200);
    let back = job.invoke(&cfg).await;
    assert!(matches!(back.outcome, Outcome::AlreadyDone { .. }), "{}", back.render());
    assert!(back.render().contains("is taken back to this clock's slot"), "{}", back.render());
    let runs = job.lines("runs");
    assert_eq!(runs.len(), 2, "2 runs, one per slot: {runs:?}");
    assert_eq!(secs(&runs[1]) - secs(&runs[0]), 1800, "{runs:?}");
    assert_eq!(job.history("jump", 100).await.ran_more_than_once, 0);
}
