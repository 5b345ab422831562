//! `idem once`, counted exactly: processes standing in for machines invoke one job on one store, SQLite (one
//! file shared by the processes of this machine), PostgreSQL and Redis (the machine's servers, each test in a
//! schema or key prefix of its own; what is killed or paused here is an `idem once` process, never a server).
//! Each command logs every execution to a file, which is what is counted.
//!
//! What the schedule decides through time (gaps, deadlines, overlap, retries, a clock that jumps) is tested in
//! the runner crate on a clock its tests move (`crates/idem-runner/tests/it/once_clock.rs`); what stays here
//! needs processes or a server: kill -9, SIGSTOP, signals, several machines at once, exit statuses and the
//! command line.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;
use std::os::unix::fs::FileTypeExt as _;

use crate::common::BIN;

/// One store the invocations share, with a scratch directory for logs.
struct Backend {
    url: String,
    namespace: String,
    dir: tempfile::TempDir,
}

impl Backend {
    fn sqlite() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("once.db").display());
        Some(Self { url, namespace: "idem".into(), dir })
    }

    fn server(var: &str) -> Option<Self> {
        let Ok(url) = std::env::var(var) else {
            assert!(
                std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
                "{var} is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
            );
            eprintln!("skipped: {var} is unset");
            return None;
        };
        let namespace = format!("idem_once_{:012x}", rand::random::<u64>() >> 16);
        Some(Self { url, namespace, dir: tempfile::tempdir().unwrap() })
    }

    fn postgres() -> Option<Self> {
        Self::server("IDEM_TEST_POSTGRES_URL")
    }

    fn redis() -> Option<Self> {
        Self::server("IDEM_TEST_REDIS_URL")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `idem once --name NAME ARGS -- sh -c SCRIPT` on this store; the script runs in the scratch directory.
    fn once(&self, name: &str, args: &[&str], script: &str) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["once", "--store", &self.url, "--namespace", &self.namespace, "--name", name])
            .args(args)
            .args(["--", "sh", "-c", script])
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    }

    /// Runs one invocation to its end: (exit status, standard error).
    fn run(&self, name: &str, args: &[&str], script: &str) -> (i32, String) {
        let out = self.once(name, args, script).output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// `idem once status --format json`.
    fn status(&self, name: &str) -> Value {
        self.status_limited(name, 100)
    }

    /// `idem once status --format json --limit LIMIT`.
    fn status_limited(&self, name: &str, limit: usize) -> Value {
        let out = self.status_as(name, &["--format", "json", "--limit", &limit.to_string()]);
        assert!(out.status.success(), "status: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `idem once status ARGS` as it ran.
    fn status_as(&self, name: &str, args: &[&str]) -> std::process::Output {
        Command::new(BIN)
            .args(["once", "status", "--store", &self.url, "--namespace", &self.namespace, "--name", name])
            .args(args)
            .output()
            .unwrap()
    }

    fn lines(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.path(file)).unwrap_or_default().lines().map(str::to_owned).collect()
    }

    async fn cleanup(&self) {
        if !self.url.starts_with("sqlite:") {
            crate::shared_backends::cleanup(&self.url, &self.namespace).await;
        }
    }
}

/// A period whose boundary (once a year) no test straddles: every invocation of a test is in one slot.
const ONE_SLOT: &str = "366d";

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(sig: &str, target: &str) {
    let ok = Command::new("kill").args([sig, "--", target]).status().unwrap().success();
    assert!(ok, "kill {sig} {target}");
}

fn slots(status: &Value) -> &Vec<Value> {
    status["slots"].as_array().unwrap()
}

/// Three invocations started together for one slot run the command once; the other two are told it is held
/// (or done) and exit 0.
async fn three_together_run_once(b: Backend) {
    let script = "echo \"$IDEM_SLOT $IDEM_ATTEMPT\" >> runs; sleep 1";
    let children: Vec<Child> =
        (0..3).map(|_| b.once("together", &["--every", ONE_SLOT], script).spawn().unwrap()).collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(b.lines("runs").len(), 1, "three invocations of one slot ran it {:?}", b.lines("runs"));
    let (code, stderr) = b.run("together", &["--every", ONE_SLOT], script);
    assert_eq!(code, 0);
    assert!(stderr.contains("done already, on "), "{stderr}");
    let status = b.status("together");
    assert_eq!(slots(&status).len(), 1);
    assert_eq!(slots(&status)[0]["state"], "done");
    assert_eq!(slots(&status)[0]["attempts"], 1);
    assert_eq!(status["ran_more_than_once"], 0);
    b.cleanup().await;
}

/// kill -9 of the holder mid-command: its command dies with it (the watchdog), the next invocation after the
/// lease runs the slot once more, and the slot ends done after two attempts.
async fn a_killed_holder_is_taken_over_after_its_lease(b: Backend) {
    let script = "echo start >> log; sleep 3; echo end >> log";
    let args = ["--every", ONE_SLOT, "--lease", "2s"];
    let mut holder = b.once("killed", &args, script).spawn().unwrap();
    wait_for("the first start", Duration::from_secs(20), || b.lines("log").len() == 1);
    holder.kill().unwrap();
    holder.wait().unwrap();
    let killed_at = Instant::now();
    let mut held = 0;
    loop {
        let (code, stderr) = b.run("killed", &args, script);
        assert_eq!(code, 0, "{stderr}");
        if stderr.contains(": done (attempt 2)") {
            break;
        }
        assert!(stderr.contains("under a live lease; not run here"), "{stderr}");
        held += 1;
        assert!(killed_at.elapsed() < Duration::from_secs(20), "never taken over");
        std::thread::sleep(Duration::from_millis(300));
    }
    eprintln!("{}: {held} invocation(s) found the killed holder's lease live", b.url);
    let log = b.lines("log");
    assert_eq!(log.iter().filter(|l| *l == "start").count(), 2, "{log:?}");
    assert_eq!(log.iter().filter(|l| *l == "end").count(), 1, "the killed holder's command went on: {log:?}");
    let status = b.status("killed");
    assert_eq!((slots(&status)[0]["state"].as_str(), slots(&status)[0]["attempts"].as_u64()), (Some("done"), Some(2)));
    assert_eq!(status["ran_more_than_once"], 0);
    assert_eq!(status["taken_over"], 1, "the takeover of a started attempt is counted: {status}");
    b.cleanup().await;
}

/// The holder killed right after its command exited 0, before its done write: nothing recorded the success,
/// so the first invocation after the lease runs the slot again (at-least-once there); `status` counts the
/// slot in `taken_over` (it may have run twice: 1) while `ran_more_than_once` (known twice) stays 0.
async fn a_holder_killed_after_its_command_succeeded_counts_as_taken_over(b: Backend) {
    let script = "echo ran >> log; [ \"$(wc -l < log)\" -gt 1 ] || kill -9 $PPID";
    let args = ["--every", ONE_SLOT, "--lease", "1s"];
    let (code, _) = b.run("vanished", &args, script);
    assert_eq!(code, -1, "the holder was killed by its own command");
    let killed_at = Instant::now();
    loop {
        let (code, stderr) = b.run("vanished", &args, script);
        assert_eq!(code, 0, "{stderr}");
        if stderr.contains(": done (attempt 2)") {
            break;
        }
        assert!(stderr.contains("under a live lease; not run here"), "{stderr}");
        assert!(killed_at.elapsed() < Duration::from_secs(20), "never taken over");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(b.lines("log"), ["ran", "ran"], "2 runs: the killed holder's and its successor's");
    let status = b.status("vanished");
    assert_eq!((slots(&status)[0]["state"].as_str(), slots(&status)[0]["attempts"].as_u64()), (Some("done"), Some(2)));
    assert_eq!((status["taken_over"].as_u64(), status["ran_more_than_once"].as_u64()), (Some(1), Some(0)), "{status}");
    b.cleanup().await;
}

/// SIGSTOP of the holder's machine (the invocation and its command) past its lease: a second machine takes
/// the slot over and runs it; the resumed holder's lease is refused, its command killed, its outcome never
/// recorded (exit 6). Not on SQLite: one machine's processes take turns holding the file, and a process
/// stopped during its turn stalls the others until it resumes (docs/DESIGN.md, "Sharing a ledger").
async fn a_paused_holder_is_fenced_out(b: Backend) {
    let script = "echo \"start $$\" >> log; sleep 2; echo end >> log";
    let args = ["--every", ONE_SLOT, "--lease", "1s"];
    let holder = b.once("paused", &args, script).spawn().unwrap();
    wait_for("the first start", Duration::from_secs(20), || b.lines("log").len() == 1);
    let group = b.lines("log")[0].trim_start_matches("start ").to_owned();
    signal("-STOP", &format!("-{group}"));
    signal("-STOP", &holder.id().to_string());
    std::thread::sleep(Duration::from_millis(2000));
    let (code, stderr) = b.run("paused", &args, script);
    assert_eq!((code, stderr.contains(": done (attempt 2)")), (0, true), "{stderr}");
    // The invocation wakes first (it kills its command's group, stopped or not); the command's group is
    // woken after, if anything of it is left.
    signal("-CONT", &holder.id().to_string());
    let out = holder.wait_with_output().unwrap();
    let _ = Command::new("kill").args(["-CONT", "--", &format!("-{group}")]).stderr(Stdio::null()).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    assert!(stderr.contains("its outcome is not recorded"), "{stderr}");
    assert!(stderr.contains("paused"), "the message names a pause as a cause, not only the store: {stderr}");
    std::thread::sleep(Duration::from_millis(500));
    let log = b.lines("log");
    assert_eq!(log.iter().filter(|l| *l == "end").count(), 1, "the fenced-out command ran on: {log:?}");
    let status = b.status("paused");
    assert_eq!((slots(&status)[0]["state"].as_str(), slots(&status)[0]["attempts"].as_u64()), (Some("done"), Some(2)));
    assert_eq!(status["ran_more_than_once"], 0);
    b.cleanup().await;
}

/// SIGSTOP of the invocation alone (its command not): the watchdog stops the command before the lease can
/// lapse, so it never runs beside the command of the invocation that takes the slot over; the resumed
/// invocation finds the slot taken over, kills its command (which never ends) and exits 6, and `status` counts
/// no slot run more than once. Before, the command ran on to exit 0 during the takeover, and the slot ran twice.
async fn a_paused_invocations_command_is_stopped_before_a_takeover(b: Backend) {
    let script = "echo start >> log; sleep 2; echo end >> log";
    let args = ["--every", ONE_SLOT, "--lease", "1s"];
    let holder = b.once("refused", &args, script).spawn().unwrap();
    wait_for("the first start", Duration::from_secs(20), || b.lines("log").len() == 1);
    signal("-STOP", &holder.id().to_string());
    // Past the lease and past the command's own 2 s: a command left running would have ended by now.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(b.lines("log"), ["start"], "the paused invocation's command ran on");
    let (code, stderr) = b.run("refused", &args, script);
    assert_eq!((code, stderr.contains(": done (attempt 2)")), (0, true), "{stderr}");
    signal("-CONT", &holder.id().to_string());
    let out = holder.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    std::thread::sleep(Duration::from_millis(500));
    let log = b.lines("log");
    assert_eq!(log.iter().filter(|l| *l == "start").count(), 2, "{log:?}");
    assert_eq!(log.iter().filter(|l| *l == "end").count(), 1, "the taken-over command ran to its end: {log:?}");
    let status = b.status("refused");
    assert_eq!(slots(&status)[0]["attempts"], 2);
    assert_eq!(status["ran_more_than_once"], 0, "{status}");
    b.cleanup().await;
}

/// SIGTERM (and SIGHUP, a closed terminal) to the invocation after its command started kills the command, and
/// the attempt counts toward --retries (exit 130; `status` counts it interrupted): with --retries 1, six
/// invocations each stopped mid-command (as `timeout 1 idem once …` stops them; the second by SIGHUP, which
/// killed idem with 129 and left the slot to look crashed before) start the command twice, attempts 1 and 2; the slot is
/// then failed for good (`status`: state failed, 2 of 2 attempts interrupted), and the other four exit 3
/// without starting it.
async fn a_signal_counts_the_attempt(b: Backend) {
    let args = ["--every", ONE_SLOT, "--retries", "1"];
    let script = "echo \"$IDEM_ATTEMPT\" >> runs; sleep 5";
    for round in 1..=2 {
        let child = b.once("signalled", &args, script).spawn().unwrap();
        wait_for("the command's start", Duration::from_secs(20), || b.lines("runs").len() == round);
        signal(if round == 1 { "-TERM" } else { "-HUP" }, &child.id().to_string());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(130), "{stderr}");
        assert!(
            stderr.contains(&format!("interrupted: attempt {round} killed; it counts toward --retries")),
            "{stderr}"
        );
    }
    for _ in 3..=6 {
        let (code, stderr) = b.run("signalled", &args, script);
        assert_eq!(code, 3, "{stderr}");
        assert!(stderr.contains("failed for good: 2 attempts, the last interrupted by a signal"), "{stderr}");
    }
    assert_eq!(b.lines("runs"), ["1", "2"], "6 invocations, 2 starts");
    let status = b.status("signalled");
    assert_eq!((status["interrupted"].as_u64(), status["taken_over"].as_u64()), (Some(2), Some(0)), "{status}");
    // Failed for good, not `interrupted` (as if pending): both attempts interrupted, counted per slot too.
    let slot = &slots(&status)[0];
    assert_eq!(
        (slot["state"].as_str(), slot["attempts"].as_u64(), slot["interrupted"].as_u64(), slot["ending"].as_str()),
        (Some("failed"), Some(2), Some(2), Some("interrupted")),
        "{slot}"
    );
    let text = String::from_utf8_lossy(&b.status_as("signalled", &[]).stdout).into_owned();
    assert!(text.contains("failed") && text.contains("interrupted (2 of 2 attempts interrupted)"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_after_success_on_sqlite() {
    a_holder_killed_after_its_command_succeeded_counts_as_taken_over(Backend::sqlite().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_on_sqlite() {
    a_signal_counts_the_attempt(Backend::sqlite().unwrap()).await;
}

/// `--quiet` says nothing on success nor when the slot is done or held, and reports a change of state once:
/// the attempt that fails for good and the invocation that records a slot missed say so; the invocations
/// after them are silent (their exit status still says it).
#[test]
fn quiet_reports_a_change_of_state_once() {
    let b = Backend::sqlite().unwrap();
    let ok = ["--every", ONE_SLOT, "--quiet"];
    assert_eq!(b.run("q-ok", &ok, "echo ran >> runs"), (0, String::new()), "silent on success");
    assert_eq!(b.run("q-ok", &ok, "echo ran >> runs"), (0, String::new()), "silent when done already");
    assert_eq!(b.lines("runs").len(), 1);
    let failing = ["--every", ONE_SLOT, "--quiet", "--retries", "0"];
    let (code, stderr) = b.run("q-fail", &failing, "exit 3");
    assert_eq!(code, 3);
    assert!(stderr.contains("failed for good"), "the failure is reported once: {stderr}");
    assert_eq!(b.run("q-fail", &failing, "exit 3"), (3, String::new()), "then silent");
    // A slot past its deadline: the 366-day slot began months ago, far more than 1 s.
    let late = ["--every", ONE_SLOT, "--quiet", "--starting-deadline", "1s"];
    let (code, stderr) = b.run("q-late", &late, "echo ran >> runs");
    assert_eq!(code, 4);
    assert!(stderr.contains("recorded missed now"), "the miss is reported once: {stderr}");
    assert_eq!(b.run("q-late", &late, "echo ran >> runs"), (4, String::new()), "then silent");
    assert_eq!(b.lines("runs").len(), 1);
}

/// --quiet with earlier slots recorded missed by a run that succeeded: the missed slots are said, the routine
/// "done" beside them is not (it was printed too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_says_the_missed_slots_recorded_but_not_a_routine_done() {
    let b = Backend::sqlite().unwrap();
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as u64;
    seed_job(&b, "q-gap", now - now % 60_000 - 3 * 60_000, 0).await;
    let (code, stderr) = b.run("q-gap", &["--every", "60s", "--quiet"], "echo ran >> runs");
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("earlier slots missed (") || stderr.contains("1 earlier slot missed ("), "{stderr}");
    assert!(!stderr.contains("done (attempt 1)"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert_eq!(b.lines("runs").len(), 1);
}

/// Usage refused before anything runs (exit 2, one line, no store created): `--store memory:` (it keeps
/// nothing, so every invocation would run), `--tz` with `--every`, an `--every` that is not a duration.
#[test]
fn usage_errors_are_refused_in_one_line() {
    let b = Backend::sqlite().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["once", "--name", "u"])
            .args(args)
            .args(["--", "sh", "-c", "echo ran >> runs"])
            .current_dir(b.dir.path())
            .env("XDG_STATE_HOME", b.dir.path())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (args, says) in [
        (&["--every", "60s", "--store", "memory:"][..], "--store memory: keeps nothing"),
        (&["--every", "60s", "--store", "memory"][..], "--store memory: keeps nothing"),
        (&["--every", "60s", "--tz", "Europe/Berlin"][..], "--tz applies to --cron only"),
        (&["--every", "2x"][..], "--every \"2x\": not a duration; give whole seconds with a unit"),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(!stderr.contains("months"), "{args:?}: {stderr}");
    }
    assert!(b.lines("runs").is_empty(), "nothing ran");
    assert!(!b.path("idem").exists(), "no store created");
}

/// Writes a job record for `name` (`--every 60s`) whose newest slot is `last_ms`, with no entry for it.
async fn seed_job(b: &Backend, name: &str, last_ms: u64, unlisted: u64) {
    use idem_core::slot::{Job, job_key};
    use idem_store::{Precondition, Store as _, Ttl};
    let store = idem_sqlite::SharedSqlite::open(&b.path("once.db"), idem_store::Limits::default()).await.unwrap();
    let job = Job { schedule: "every 60s".into(), last_slot_ms: last_ms, missed_unlisted: unlisted, ..Job::default() };
    store.put(&job_key(name), job.encode(), Precondition::Absent, Ttl::Clear).await.unwrap();
    store.close().await;
}

/// `status` for people: an hourly job's schedule is `every 1h`; a `sqlite:` file that does not exist is not
/// created (exit 3, nothing written).
#[test]
fn status_shows_the_schedule_as_given_and_creates_no_store() {
    let b = Backend::sqlite().unwrap();
    let (code, stderr) = b.run("hourly", &["--every", "1h"], "true");
    assert_eq!(code, 0, "{stderr}");
    let out = b.status_as("hourly", &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("job hourly: every 1h; "), "{text}");
    let typo = b.path("typo.db");
    let out = Command::new(BIN)
        .args(["once", "status", "--store", &format!("sqlite:{}", typo.display()), "--name", "hourly"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no store at"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!typo.exists(), "status created the file it was pointed at");
}

/// Thirty jobs start together on one SQLite file, each holding its slot for 12 s under a 10 s lease (a renewal
/// every 3.3 s each, taking turns on the file): every renewal gets its turn, so all 30 commands run to their
/// end and are recorded done (30 runs, 30 exits 0, 0 lost leases). The lease was 3 s: thirty debug-build
/// processes starting at once beside three other tests starved some of CPU past it in CI (a lapse, reported
/// as it should be), which says nothing about the turns on the file.
#[test]
fn thirty_jobs_on_one_sqlite_file_keep_their_leases() {
    let b = Backend::sqlite().unwrap();
    let children: Vec<(usize, Child)> = (0..30)
        .map(|i| {
            let name = format!("j{i}");
            let child = b
                .once(&name, &["--every", ONE_SLOT, "--lease", "10s"], "sleep 12; echo \"$IDEM_NAME\" >> runs")
                .spawn()
                .unwrap();
            (i, child)
        })
        .collect();
    let mut failed = Vec::new();
    for (i, child) in children {
        let out = child.wait_with_output().unwrap();
        if out.status.code() != Some(0) {
            failed.push(format!("j{i}: {:?} {}", out.status.code(), String::from_utf8_lossy(&out.stderr)));
        }
    }
    assert!(failed.is_empty(), "{} of 30 failed: {failed:#?}", failed.len());
    let mut runs = b.lines("runs");
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), 30, "30 jobs, 30 runs");
    assert_eq!(b.lines("runs").len(), 30, "0 repeated");
}

/// Durations out of range are refused before the store is opened: exit 2, the store file never created.
#[test]
fn durations_out_of_range_are_refused_before_the_store_is_opened() {
    let b = Backend::sqlite().unwrap();
    for (args, says) in [
        (&["--timeout", "18446744073709551615s"][..], "--timeout must be more than 0s and at most 366 days"),
        (&["--lease", "400days"][..], "--lease must be from 1s to 365 days"),
        (&["--starting-deadline", "18446744073709551615s"][..], "--starting-deadline must be more than 0s"),
    ] {
        let mut all = vec!["--every", "60s"];
        all.extend_from_slice(args);
        let (code, stderr) = b.run("bounds", &all, "echo ran >> runs");
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let (code, stderr) = b.run("bounds", &["--every", "0s"], "echo ran >> runs");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--every 0s:"), "{stderr}");
    assert!(!b.path("once.db").exists(), "nothing written");
    assert!(b.lines("runs").is_empty());
}

/// Sleeps until this machine's clock is `from_ms`..`from_ms + 300` into a slot of `period_ms` (the stores'
/// clocks are this machine's: the servers are local).
fn wait_until_into_slot(period_ms: u64, from_ms: u64) {
    loop {
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as u64;
        let into = now % period_ms;
        if (from_ms..from_ms + 300).contains(&into) {
            return;
        }
        std::thread::sleep(Duration::from_millis(((from_ms + period_ms - into) % period_ms).max(1)));
    }
}

/// `idem once backfill` over five hourly slots before the job's first, then three invocations at once (as cron
/// on three machines) with `--metrics-file`: 6 distinct slots run (the current one and the five), 0 twice; the
/// metrics say done and 0 run more than once; the same backfill again requests nothing.
async fn a_backfill_runs_each_slot_once_under_concurrent_invocations(b: Backend) {
    let script = "echo \"$IDEM_SLOT\" >> runs; sleep 0.1";
    let args = ["--every", "1h", "--metrics-file", "bf.prom"];
    assert_eq!(b.run("bf", &args, script).0, 0);
    let hour = 3_600_000;
    let newest = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as u64 / hour * hour;
    let at = |ms: u64| humantime::format_rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(ms)).to_string();
    let backfill = |from: &str, to: &str| {
        Command::new(BIN)
            .args(["once", "backfill", "--store", &b.url, "--namespace", &b.namespace, "--name", "bf"])
            .args(["--from", from, "--to", to])
            .output()
            .unwrap()
    };
    let (from, to) = (at(newest - 5 * hour), at(newest - hour));
    let out = backfill(&from, &to);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && text.starts_with("job bf: requested 5 slots ("), "{text}{out:?}");
    let children: Vec<Child> = (0..3).map(|_| b.once("bf", &args, script).spawn().unwrap()).collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let mut runs = b.lines("runs");
    assert_eq!(runs.len(), 6, "6 distinct slots written, each once: {runs:?}");
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), 6, "0 duplicates: {:?}", b.lines("runs"));
    let metrics = std::fs::read_to_string(b.path("bf.prom")).unwrap();
    for line in [
        "idem_once_slots_run_more_than_once{once_job=\"bf\"} 0",
        "idem_once_last_slot_state{once_job=\"bf\",state=\"done\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} not in\n{metrics}");
    }
    let again = String::from_utf8_lossy(&backfill(&from, &to).stdout).into_owned();
    assert!(again.contains("no slot requested") && again.contains("not requested: 5 slots done"), "{again}");
    // Refusals: a bad time is exit 2 in one line, a job the store does not have exit 3.
    let out = backfill("yesterday-ish", &to);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!((out.status.code(), err.lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("--from \"yesterday-ish\": give an RFC 3339 time"), "{err}");
    let out = Command::new(BIN)
        .args(["once", "backfill", "--store", &b.url, "--namespace", &b.namespace, "--name", "nope"])
        .args(["--from", &from, "--to", &to])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    b.cleanup().await;
}

/// `--overlap cancel-other`: a process runs a slot whose command would take a minute; the next slot's
/// invocation, another process, has it stopped within a lease (SIGTERM, which the command traps and logs),
/// recorded replaced (exit 0 for the stopped one), then runs its own slot after it, never beside it.
async fn cancel_other_stops_the_running_slot_on_another_process(b: Backend) {
    let script = r#"echo "start $IDEM_SLOT" >> runs; trap 'echo "term $IDEM_SLOT" >> runs; exit 143' TERM;
        if [ ! -e first ]; then touch first; sleep 60 & wait; else echo "end $IDEM_SLOT" >> runs; fi"#;
    let args = ["--every", "2s", "--lease", "1s", "--overlap", "cancel-other"];
    let first = b.once("replace", &args, script).spawn().unwrap();
    wait_for("the first slot's start", Duration::from_secs(20), || !b.lines("runs").is_empty());
    let slot = b.lines("runs")[0].replace("start ", "");
    // Invoked until the next slot comes: its invocation asks the first to stop, waits, and runs.
    let asked = loop {
        let at = Instant::now();
        let (code, stderr) = b.run("replace", &args, script);
        assert_eq!(code, 0, "{stderr}");
        if !stderr.contains(&format!("replace {slot}:")) {
            break at;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = first.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replaced by the slot "), "{stderr}");
    assert!(asked.elapsed() < Duration::from_secs(10), "stopped within a lease, run after it");
    let runs = b.lines("runs");
    assert_eq!(runs.len(), 4, "start, term, start, end: {runs:?}");
    assert!(runs[0].starts_with("start") && runs[1] == format!("term {slot}"), "{runs:?}");
    assert!(runs[2].starts_with("start") && runs[3].starts_with("end"), "the new slot after the old: {runs:?}");
    let status = b.status("replace");
    assert!(slots(&status).iter().any(|s| s["state"] == "replaced"), "{status}");
    assert_eq!(status["ran_more_than_once"], 0);
    b.cleanup().await;
}

macro_rules! on_server_backends {
    ($($scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let Some(b) = super::Backend::postgres() else { return };
                    super::$scenario(b).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis() {
                    let Some(b) = super::Backend::redis() else { return };
                    super::$scenario(b).await;
                }
            }
        )*
    };
}

macro_rules! on_every_backend {
    ($($scenario:ident),* $(,)?) => {
        $(
            mod $scenario {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$scenario(super::Backend::sqlite().unwrap()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let Some(b) = super::Backend::postgres() else { return };
                    super::$scenario(b).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis() {
                    let Some(b) = super::Backend::redis() else { return };
                    super::$scenario(b).await;
                }
            }
        )*
    };
}

on_every_backend!(
    three_together_run_once,
    a_killed_holder_is_taken_over_after_its_lease,
    a_backfill_runs_each_slot_once_under_concurrent_invocations,
    cancel_other_stops_the_running_slot_on_another_process,
);

on_server_backends!(a_paused_holder_is_fenced_out, a_paused_invocations_command_is_stopped_before_a_takeover);

/// `status` and `forget` on PostgreSQL with a namespace nothing ran in create no schema: exit 3 naming the
/// job, the store and the namespace; afterwards the schema still does not exist (0 schemas created).
#[tokio::test(flavor = "multi_thread")]
async fn status_and_forget_create_no_postgres_schema() {
    let Some(b) = Backend::postgres() else { return };
    for sub in ["status", "forget"] {
        let out = Command::new(BIN)
            .args(["once", sub, "--store", &b.url, "--namespace", &b.namespace, "--name", "nightly"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{sub}: {stderr}");
        assert!(
            stderr.contains("no job nightly in ") && stderr.contains(&format!("(namespace {})", b.namespace)),
            "{stderr}"
        );
    }
    let (client, conn) = tokio_postgres::connect(&b.url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let schemas =
        client.query("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1", &[&b.namespace]).await.unwrap().len();
    assert_eq!(schemas, 0, "status or forget created schema {}", b.namespace);
    b.cleanup().await;
}

/// `status` into a pipe closed early (`| head`) exits 0 without a panic, and into a full device exits 1 with
/// one line (both were "failed printing to stdout", exit 101).
#[test]
fn status_into_a_closed_pipe_or_a_full_device_does_not_panic() {
    let b = Backend::sqlite().unwrap();
    for i in 0..3 {
        let (code, stderr) = b.run(&format!("j{i}"), &["--every", "1h"], "seq 1 2000");
        assert_eq!(code, 0, "{stderr}");
    }
    let mut child = Command::new(BIN)
        .args(["once", "status", "--store", &b.url, "--name", "j0", "--format", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the reading end before idem writes: its write gets EPIPE.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out =
        Command::new(BIN).args(["once", "status", "--store", &b.url, "--name", "j0"]).stdout(full).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write to standard output") && !stderr.contains("panicked"), "{stderr}");
}

/// A named `sqlite:` store in a directory that does not exist is refused (exit 2, naming the directory) and
/// the directory is not created; nothing ran (0 executions).
#[test]
fn a_named_sqlite_store_in_a_missing_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nonexistent");
    let ran = dir.path().join("ran");
    let out = Command::new(BIN)
        .args(["once", "--store", &format!("sqlite:{}", missing.join("x.db").display())])
        .args(["--name", "j", "--every", "1h", "--", "touch", ran.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("directory {} does not exist", missing.display())), "{stderr}");
    assert!(!missing.exists(), "the directory was created");
    assert!(!ran.exists(), "the command ran");
}

/// A store that is down or unreachable (nothing listens on its port: connection refused) is a temporary
/// failure, exit 75 at once with nothing run, for an invocation and for `status`, on PostgreSQL and Redis; a
/// URL that names no store and a refused login stay exit 2 (bad usage), so a cron monitor tells an outage from
/// a typo (both were exit 2).
#[test]
fn an_unreachable_store_is_exit_75_and_a_bad_url_or_login_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let invoke = |url: &str| {
        let out = Command::new(BIN)
            .args(["once", "--store", url, "--name", "j", "--every", "1h", "--", "touch", ran.to_str().unwrap()])
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // A server that accepts and closes every connection at once (a proxy in front of a store that is down,
    // a failover in progress): the client sees the connection closed during the handshake, not a refusal.
    let closing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closing.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in closing.incoming() {
            drop(conn);
        }
    });
    let closing_pg = format!("postgres://postgres@127.0.0.1:{port}/test?sslmode=disable");
    let closing_redis = format!("redis://127.0.0.1:{port}");
    for url in ["postgres://postgres@127.0.0.1:1/test", "redis://127.0.0.1:1", &closing_pg, &closing_redis] {
        let (code, stderr) = invoke(url);
        assert_eq!(code, Some(75), "{url}: {stderr}");
        assert!(stderr.contains("the store is unavailable") && stderr.contains("nothing ran"), "{url}: {stderr}");
        let out = Command::new(BIN).args(["once", "status", "--store", url, "--name", "j"]).output().unwrap();
        assert_eq!(out.status.code(), Some(75), "status {url}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let (code, stderr) = invoke("postgress://127.0.0.1:5432/test");
    assert_eq!(code, Some(2), "{stderr}");
    if let Ok(pg) = std::env::var("IDEM_TEST_POSTGRES_URL") {
        // The role does not exist: the server answers, and refuses the login.
        let refused = pg.replacen("postgres@", "idem_no_such_role@", 1);
        assert_ne!(refused, pg, "IDEM_TEST_POSTGRES_URL names no user postgres: {pg}");
        let (code, stderr) = invoke(&refused);
        assert_eq!(code, Some(2), "{stderr}");
    }
    assert!(!ran.exists(), "the command ran");
}

/// `idem serve` keeps its SQLite file to itself: an invocation on the same file says so and exits 75 within a
/// few seconds, nothing run, instead of waiting for a turn that never comes (it waited for ever).
#[test]
fn an_invocation_on_a_sqlite_file_idem_serve_keeps_exits_75_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let server = crate::common::Server::sqlite(&db);
    let started = Instant::now();
    let out = Command::new(BIN)
        .args(["once", "--store", &format!("sqlite:{}", db.display()), "--name", "j", "--every", "1h", "--"])
        .args(["touch", dir.path().join("ran").to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(stderr.contains("kept open by another process (exclusive "), "{stderr}");
    assert!(stderr.contains("nothing ran"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30), "waited {:?}", started.elapsed());
    assert!(!dir.path().join("ran").exists(), "the command ran");
    drop(server);
}

/// `--metrics-file` is written when the store is unavailable (exit 75, its other series kept), never replaces
/// what is not a regular file (a FIFO here; `/dev/null` as root was replaced by a text file), and replaces a
/// symbolic link's target, not the link.
#[test]
fn the_metrics_file_says_75_when_the_store_is_down_and_replaces_only_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let invoke = |store: &str, metrics: &std::path::Path| {
        Command::new(BIN)
            .args(["once", "--store", store, "--name", "j", "--every", "1h", "--metrics-file"])
            .arg(metrics)
            .args(["--", "true"])
            .output()
            .unwrap()
    };
    let prom = dir.path().join("j.prom");
    let sqlite = format!("sqlite:{}", dir.path().join("once.db").display());
    assert_eq!(invoke(&sqlite, &prom).status.code(), Some(0));
    assert_eq!(invoke("redis://127.0.0.1:1", &prom).status.code(), Some(75));
    let text = std::fs::read_to_string(&prom).unwrap();
    assert!(text.contains("idem_once_last_invocation_exit_code{once_job=\"j\"} 75\n"), "{text}");
    assert!(text.contains("idem_once_last_success_timestamp_seconds{once_job=\"j\"}"), "kept: {text}");
    assert_eq!(text.matches("# TYPE idem_once_last_invocation_exit_code gauge").count(), 1, "{text}");
    let fifo = dir.path().join("fifo.prom");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert_eq!(invoke(&sqlite, &fifo).status.code(), Some(0));
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    let link = dir.path().join("link.prom");
    std::os::unix::fs::symlink(&prom, &link).unwrap();
    assert_eq!(invoke(&sqlite, &link).status.code(), Some(0));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert!(std::fs::read_to_string(&prom).unwrap().contains("exit_code{once_job=\"j\"} 0\n"));
}

/// SIGINT while the store does not answer the connect (a listener that never accepts past its backlog) stops
/// the invocation as one before the claim: exit 130 with a line saying nothing ran, not the default action
/// (killed by the signal, no line).
#[test]
fn a_signal_while_connecting_to_a_silent_store_is_exit_130_and_nothing_ran() {
    let dir = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let child = Command::new(BIN)
        .args(["once", "--store", &url, "--name", "j", "--every", "1h", "--", "touch", "ran"])
        .current_dir(dir.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    signal("-INT", &child.id().to_string());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("idem once: j: interrupted while connecting to the store: nothing ran"), "{stderr}");
    assert!(!dir.path().join("ran").exists(), "the command ran");
}

/// A schedule other than the recorded one is refused naming both as given (`every 1h`), not as the record
/// keeps them (`every 3600s`).
#[test]
fn another_schedule_is_refused_in_the_words_it_was_given() {
    let b = Backend::sqlite().unwrap();
    let (code, stderr) = b.run("hourly", &["--every", "1h"], "true");
    assert_eq!(code, 0, "{stderr}");
    let (code, stderr) = b.run("hourly", &["--every", "90m"], "echo ran >> runs");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("job hourly is scheduled every 1h in this store, not every 1h30m"), "{stderr}");
    assert!(!stderr.contains("3600s"), "{stderr}");
    assert_eq!(b.lines("runs").len(), 0, "the refused invocation ran nothing");
}

/// SIGINT to an invocation waiting at a slot boundary for the store's clock (its machine 4.5 s ahead of
/// Redis's, fired 0.2 s after the boundary by its clock, so 4.3 s of wait) stops it there, at once: exit 130,
/// 0 runs, nothing claimed. Before, the wait went on to its end (3.3 s after the signal) and only then stopped.
/// Skipped without `faketime` or Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_the_wait_at_a_boundary_stops_before_the_claim() {
    if !faketime_installed() {
        return;
    }
    let Some(b) = Backend::redis() else { return };
    // 5.7 s into a 10 s slot by the store's clock: 0.2 s after the next boundary by a clock 4.5 s ahead.
    wait_until_into_slot(10_000, 5_700);
    // libfaketime preloaded into idem itself, not the `faketime` wrapper (a parent that would take the signal).
    let Some(lib) = libfaketime() else { return };
    let child = Command::new(BIN)
        .args(["once", "--store", &b.url, "--namespace", &b.namespace, "--name", "wait"])
        .args(["--every", "10s", "--", "sh", "-c", "echo ran >> runs"])
        .env("LD_PRELOAD", lib)
        .env("FAKETIME", "+4.5s")
        .current_dir(b.dir.path())
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    signal("-INT", &child.id().to_string());
    let signalled = Instant::now();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted before the claim: nothing ran"), "{stderr}");
    // Not a speed claim: the wait had 3.3 s left, and a stop that waits it out takes all of them.
    assert!(signalled.elapsed() < Duration::from_millis(2500), "stopped {:?} after the signal", signalled.elapsed());
    assert!(b.lines("runs").is_empty(), "0 runs: {stderr}");
    b.cleanup().await;
}

/// An outcome write whose answer never came (Redis frozen 12 s from just before the command ends, longer than
/// the client's timeout) but that landed when the server resumed is this invocation's, not a takeover's: the
/// retry, refused by its fence, finds its own value in the entry. Exit 0, `done`, and 0 slots ran more than once
/// (before: exit 6 "taken over by another invocation" and `ran_more_than_once` 1, with no other invocation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_write_that_landed_after_its_timeout_is_not_taken_for_a_takeover() {
    let Some(redis) = idem_testkit::Redis::start() else { return };
    let url = format!("rediss://localhost:{}?cacert={}", redis.port, redis.pki.ca.display());
    let b = Backend { url, namespace: "idem".into(), dir: tempfile::tempdir().unwrap() };
    let child = b.once("landed", &["--every", ONE_SLOT], "echo ran >> runs; sleep 2").spawn().unwrap();
    wait_for("the command's start", Duration::from_secs(20), || b.lines("runs").len() == 1);
    std::thread::sleep(Duration::from_millis(1500));
    redis.freeze();
    std::thread::sleep(Duration::from_secs(12));
    redis.thaw();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let status = b.status("landed");
    assert_eq!(status["ran_more_than_once"], 0, "{status}");
    assert_eq!(slots(&status)[0]["state"], "done", "{status}");
    assert_eq!(b.lines("runs").len(), 1);
}

/// SIGINT while a read before the claim waits for a store that stopped answering (Redis frozen during the wait
/// at a slot boundary, so the read of the store's clock after it hangs) stops the invocation at once: exit 130,
/// nothing ran, named by the slot its clock was invoked in. Before, it waited out the client's timeout and
/// exited 75 about 10 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_while_a_read_waits_for_a_frozen_store_is_exit_130_at_once() {
    if !faketime_installed() {
        return;
    }
    let Some(lib) = libfaketime() else { return };
    let Some(redis) = idem_testkit::Redis::start() else { return };
    let url = format!("rediss://localhost:{}?cacert={}", redis.port, redis.pki.ca.display());
    let b = Backend { url, namespace: "idem".into(), dir: tempfile::tempdir().unwrap() };
    // 5.7 s into a 10 s slot: a clock 4.5 s ahead waits 4.3 s for the store's clock to reach the boundary.
    wait_until_into_slot(10_000, 5_700);
    let child = b
        .once("frozen", &["--every", "10s"], "echo ran >> runs")
        .env("LD_PRELOAD", lib)
        .env("FAKETIME", "+4.5s")
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    redis.freeze();
    // Past the end of the wait: the read of the store's clock after it is unanswered.
    std::thread::sleep(Duration::from_millis(3500));
    signal("-INT", &child.id().to_string());
    let signalled = Instant::now();
    let out = child.wait_with_output().unwrap();
    let waited = signalled.elapsed();
    redis.thaw();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted before the claim: nothing ran"), "{stderr}");
    // Not a speed claim: the client's timeout had seconds left, and a stop that waits it out takes them all.
    assert!(waited < Duration::from_millis(2500), "stopped {waited:?} after the signal: {stderr}");
    assert!(b.lines("runs").is_empty(), "{stderr}");
}

/// Whether `faketime` (libfaketime) runs here. Without it the clock tests skip with a printed reason, unless
/// `IDEM_TEST_REQUIRE_BACKENDS` is set (CI installs it): then a missing `faketime` fails them.
fn faketime_installed() -> bool {
    if Command::new("faketime").args(["-f", "+0s", "true"]).status().is_ok_and(|s| s.success()) {
        return true;
    }
    assert!(std::env::var_os("IDEM_TEST_REQUIRE_BACKENDS").is_none(), "faketime is not installed");
    eprintln!("skipped: faketime is not installed");
    false
}

/// The libfaketime library the `faketime` wrapper preloads, for a test that must signal the process whose clock
/// it moves. Found where Debian and a local build put it; missing: as [`faketime_installed`].
fn libfaketime() -> Option<PathBuf> {
    let candidates = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib", "/usr/lib"];
    let found = candidates.iter().map(|d| PathBuf::from(d).join("faketime/libfaketime.so.1")).find(|p| p.exists());
    if found.is_none() {
        assert!(std::env::var_os("IDEM_TEST_REQUIRE_BACKENDS").is_none(), "libfaketime.so.1 is not installed");
        eprintln!("skipped: libfaketime.so.1 is not installed");
    }
    found
}
