//! `idem run` with real processes and real files. Every command appends one line per execution to a log opened
//! with O_APPEND (`>>`), so executions are counted exactly.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::BIN;

/// One job in a temporary directory: items, a command script, the execution log.
struct Job {
    dir: tempfile::TempDir,
    store: Option<String>,
    namespace: Option<String>,
    /// The output template, relative to the job's directory.
    template: &'static str,
}

impl Job {
    /// A job whose items are `ids` (JSON Lines with an `id` field) and whose command is `script` (sh).
    fn new(ids: &[String], script: &str) -> Job {
        let dir = tempfile::tempdir().unwrap();
        let items: String = ids.iter().map(|id| format!("{{\"id\":\"{id}\",\"n\":{}}}\n", id.len())).collect();
        std::fs::write(dir.path().join("items.jsonl"), items).unwrap();
        // One log line per execution: the item and the runner's pid (the shell's parent).
        let script =
            format!("#!/bin/sh\necho \"$IDEM_ITEM_ID $PPID\" >> {}\n{script}\n", dir.path().join("log").display());
        let path = dir.path().join("work.sh");
        std::fs::write(&path, script).unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&path, perms).unwrap();
        Job { dir, store: None, namespace: None, template: "out/{id}.json" }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn output(&self) -> String {
        self.path(self.template).display().to_string()
    }

    fn command(&self, extra: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("run")
            .args(["--items", &self.path("items.jsonl").display().to_string()])
            .args(["--output", &self.output()])
            .args(["--id-field", "id", "--quiet"])
            .args(extra);
        if let Some(store) = &self.store {
            cmd.args(["--store", store]);
        }
        if let Some(ns) = &self.namespace {
            cmd.args(["--namespace", ns]);
        }
        cmd.arg("--").arg(self.path("work.sh")).arg("{id}").arg("{out}");
        cmd.current_dir(self.dir.path()).stdin(Stdio::null());
        cmd
    }

    /// Runs to completion: (exit code, stdout, stderr).
    fn run(&self, extra: &[&str]) -> (i32, String, String) {
        let out = self.command(extra).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Starts in the background, standard error to `name`.err.
    fn spawn(&self, extra: &[&str], name: &str) -> Child {
        let err = std::fs::File::create(self.path(&format!("{name}.err"))).unwrap();
        self.command(extra).stdout(Stdio::null()).stderr(err).spawn().unwrap()
    }

    fn stderr_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{name}.err"))).unwrap_or_default()
    }

    /// The execution log: (item id, runner pid) per execution.
    fn log(&self) -> Vec<(String, u32)> {
        std::fs::read_to_string(self.path("log"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (id, pid) = l.split_once(' ').unwrap();
                (id.to_owned(), pid.parse().unwrap())
            })
            .collect()
    }

    fn executions_per_item(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (id, _) in self.log() {
            *m.entry(id).or_default() += 1;
        }
        m
    }

    /// Every file under out/ (names only), the ledger directory excluded.
    fn out_files(&self) -> BTreeSet<String> {
        match std::fs::read_dir(self.path("out")) {
            Ok(rd) => {
                rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n != ".idem").collect()
            }
            Err(_) => BTreeSet::new(),
        }
    }

    fn report(&self, name: &str) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.path(name)).unwrap()).unwrap()
    }

    fn ledger_lock(&self) -> PathBuf {
        self.path("out/.idem/ledger.db.lock")
    }
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("item-{i:05}")).collect()
}

/// Writes a valid JSON output slowly enough that a kill can land in the middle.
const WRITE_JSON: &str = r#"printf '{"id": "%s", ' "$1" > "$2"; printf '"ok": true}' >> "$2""#;

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill -{sig} {pid}");
}

/// The runner's commands (each its own process group leader), from /proc: its children but the watchdog (awk,
/// or the shell named `idem-watchdog` around it).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    out.retain(|kid| {
        let comm = std::fs::read_to_string(format!("/proc/{kid}/comm")).unwrap_or_default();
        let cmdline = std::fs::read(format!("/proc/{kid}/cmdline")).unwrap_or_default();
        !comm.trim().ends_with("awk") && !String::from_utf8_lossy(&cmdline).contains("idem-watchdog")
    });
    out
}

/// Whether a process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
}

#[test]
fn commands_of_a_runner_killed_with_sigkill_die_with_it() {
    let ids = ids(3);
    // Each command starts a grandchild too: the whole process group must go.
    let job = Job::new(&ids, &format!("sleep 60 & echo $! >> {0}; echo $$ >> {0}; wait", "pids"));
    let mut runner = job.spawn(&["--jobs", "3", "--lease", "30s"], "killed");
    let pids = || -> Vec<u32> {
        std::fs::read_to_string(job.path("pids")).unwrap_or_default().lines().filter_map(|l| l.parse().ok()).collect()
    };
    wait_for("three commands with their children", Duration::from_secs(30), || pids().len() == 6);
    assert!(pids().iter().all(|&p| alive(p)));
    signal(runner.id(), "KILL");
    runner.wait().unwrap();
    wait_for("the commands of the killed runner to be gone", Duration::from_secs(10), || {
        pids().iter().all(|&p| !alive(p))
    });
}

/// True when no process holds the SQLite ledger's lock file.
fn lock_is_free(lock: &Path) -> bool {
    let Ok(f) = std::fs::OpenOptions::new().write(true).open(lock) else { return true };
    match f.try_lock() {
        Ok(()) => {
            f.unlock().unwrap();
            true
        }
        Err(_) => false,
    }
}

fn assert_outputs_valid(job: &Job, ids: &[String]) {
    let files = job.out_files();
    let expected: BTreeSet<String> = ids.iter().map(|id| format!("{id}.json")).collect();
    assert_eq!(files, expected, "exactly one output per item, no temporary files");
    for id in ids {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(job.path(&format!("out/{id}.json"))).unwrap())
            .unwrap_or_else(|e| panic!("{id}.json is not valid JSON: {e}"));
        assert_eq!(v["id"], id.as_str());
    }
}

/// A dry run with `--jobs 1` lists the items it would run in input order, as GNU parallel's `-j1` runs them,
/// though each item's first steps (its ledger read, its output's check) take as long as they take, and however
/// differently the items are judged: a truncated output is read and refused, a missing one is not (both judged in
/// tasks of their own), and a forgotten one (no entry, no output) is listed new with its chunk. (The runs' own
/// order is idem-runner's `run_outputs::jobs_1_runs_items_and_a_rerun_redoes_them_in_input_order`.)
#[test]
fn a_dry_run_with_jobs_1_lists_the_items_to_redo_in_input_order() {
    let ids = ids(300);
    let job = Job::new(&ids, WRITE_JSON);
    let (code, _, err) = job.run(&["--jobs", "4"]);
    assert_eq!(code, 0, "{err}");
    let (mut redo, mut forgotten) = (Vec::new(), Vec::new());
    for (i, id) in ids.iter().enumerate() {
        let out = job.path(&format!("out/{id}.json"));
        match i % 4 {
            0 => std::fs::write(&out, "{\"id\": ").unwrap(),
            1 => std::fs::remove_file(&out).unwrap(),
            2 => forgotten.push(id.as_str()),
            _ => continue,
        }
        redo.push(id.clone());
    }
    let output = job.output();
    let mut forget = vec!["runs", "forget", "--output", &output];
    forget.extend(&forgotten);
    let (code, _, err) = common::idem(&forget, &[]);
    assert_eq!(code, 0, "{err}");
    let (code, dry, err) = job.run(&["--dry-run", "--jobs", "1"]);
    assert_eq!(code, 0, "{err}");
    let listed: Vec<_> = dry.lines().map(|l| l.split('\t').next().unwrap().to_owned()).collect();
    assert_eq!(listed, redo, "the dry run's listing order");
    assert_eq!(dry.matches("\tnew\n").count(), forgotten.len(), "{dry}");
}

/// A dry run's new items wait for their turn in tasks, not in the loop that reads the items: a slow
/// `--verify` of an adoptable output before a new item must not hold back the judging of the items after it
/// (found by a break-it review: the reading loop waited at each new item, one `--verify` at a time).
#[test]
fn a_dry_run_judges_the_items_after_a_slow_one_meanwhile() {
    let ids = ids(12);
    let job = Job::new(&ids, WRITE_JSON);
    // Odd items have an output nobody recorded (adopted once `--verify` passes), even items nothing: new.
    std::fs::create_dir_all(job.path("out")).unwrap();
    for id in ids.iter().skip(1).step_by(2) {
        std::fs::write(job.path(&format!("out/{id}.json")), "{\"ok\": true}").unwrap();
    }
    let log = job.path("verify.log");
    let verify = format!("echo start >> {0}; sleep 1; echo end >> {0}", log.display());
    let (code, dry, err) = job.run(&["--dry-run", "--verify", &verify]);
    assert_eq!(code, 0, "{err}");
    let listed: Vec<_> = dry.lines().map(|l| l.split('\t').next().unwrap().to_owned()).collect();
    assert_eq!(listed, ids, "the listing's order");
    // How many verifications ran at once, at most: one at a time when the reading loop waited.
    let (mut running, mut most) = (0, 0);
    for line in std::fs::read_to_string(&log).unwrap().lines() {
        running += if line == "start" { 1 } else { -1 };
        most = most.max(running);
    }
    assert!(most >= 2, "the verifications ran one at a time:\n{dry}");
}

#[test]
fn runner_killed_mid_item_is_finished_by_the_next_run() {
    let ids = ids(200);
    // Each execution writes half its JSON, pauses, then the rest: a kill leaves truncated temporary files.
    let job = Job::new(&ids, r#"printf '{"id": "%s", ' "$1" > "$2"; sleep 0.2; printf '"ok": true}' >> "$2""#);
    let mut runner = job.spawn(&["--jobs", "8", "--lease", "2s"], "first");
    wait_for("40 executions", Duration::from_secs(60), || job.log().len() >= 40);
    // Freeze the runner so it records nothing more, kill its commands (as a crash of the machine would), then
    // the runner itself.
    signal(runner.id(), "STOP");
    let kids = children(runner.id());
    assert!(!kids.is_empty(), "no command was running at the kill");
    for kid in &kids {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{kid}")]).status();
    }
    signal(runner.id(), "KILL");
    runner.wait().unwrap();
    let first = job.log().len();
    let temps = job.out_files().iter().filter(|f| f.ends_with(".idem-tmp")).count();
    assert!(temps > 0, "the kill left no temporary file, so it tested nothing");

    // Once the 2 s leases lapse, a dry run calls the crashed runner's items abandoned: they run again.
    std::thread::sleep(Duration::from_millis(2500));
    let (code, dry, err) = job.run(&["--dry-run"]);
    assert_eq!(code, 0, "{err}");
    // Each killed command's item is abandoned (its attempt counted, no live lease), or, when the runner saw the
    // command die in the instant before it stopped, recorded failed by the kill. (Items claimed ahead of a free
    // slot hold only a lease, which lapsed with nothing counted: they are plain "new" again.)
    let abandoned = dry.matches("(no live lease): runs again").count();
    let recorded_killed = dry.matches("failed 1 time(s): signal 9").count();
    assert!(abandoned + recorded_killed >= kids.len(), "{} commands killed:\n{dry}", kids.len());
    assert!(abandoned > 0, "{dry}");
    assert!(!dry.contains("runs once its lease lapses"), "{dry}");

    let (code, status, _) = common::idem(&["runs", "status", "--output", &job.output()], &[]);
    assert_eq!(code, 0);
    let done_before: usize = status.split_whitespace().nth(2).unwrap().parse().unwrap();

    let (code, _, err) = job.run(&["--jobs", "8", "--lease", "2s", "--report", "rerun.json"]);
    assert_eq!(code, 0, "{err}");
    let report = job.report("rerun.json");
    assert_eq!(report["summary"]["executions"], (200 - done_before) as u64, "rerun ran exactly the unfinished items");
    assert_eq!(job.log().len(), first + 200 - done_before);
    assert_eq!(job.executions_per_item().len(), 200);
    assert_outputs_valid(&job, &ids);
}

fn overlapping_runners(job: &Job) {
    let a = job.spawn(&["--jobs", "4"], "a");
    let b = job.spawn(&["--jobs", "4"], "b");
    let (a_pid, b_pid) = (a.id(), b.id());
    for (mut child, name) in [(a, "a"), (b, "b")] {
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "runner {name}: {}", job.stderr_of(name));
    }
    let log = job.log();
    assert_eq!(log.len(), 500, "every item executed exactly once in total");
    assert!(job.executions_per_item().values().all(|&n| n == 1));
    let by_a = log.iter().filter(|(_, p)| *p == a_pid).count();
    let by_b = log.iter().filter(|(_, p)| *p == b_pid).count();
    eprintln!("runner a executed {by_a}, runner b {by_b}");
    assert_eq!(by_a + by_b, 500);
    assert!(by_a > 0 && by_b > 0, "the runners did not overlap: a {by_a}, b {by_b}");
}

const SLOWISH_JSON: &str = r#"sleep 0.02; printf '{"id": "%s", "ok": true}' "$1" > "$2""#;

#[test]
fn overlapping_runners_on_one_sqlite_ledger_execute_each_item_once() {
    let ids = ids(500);
    let job = Job::new(&ids, SLOWISH_JSON);
    overlapping_runners(&job);
    assert_outputs_valid(&job, &ids);
}

#[test]
fn slow_item_is_kept_by_heartbeats_and_not_taken_by_a_second_runner() {
    // Three times the lease; renewals every third of it have a whole lease of slack on a loaded machine.
    let job = Job::new(&["slow".to_owned()], &format!("sleep 6; {WRITE_JSON}"));
    let mut a = job.spawn(&["--lease", "2s"], "a");
    wait_for("the slow item to start", Duration::from_secs(30), || job.log().len() == 1);
    let mut b = job.spawn(&["--lease", "2s", "--report", "b.json"], "b");
    let (sa, sb) = (a.wait().unwrap(), b.wait().unwrap());
    assert_eq!(sa.code(), Some(0), "{}", job.stderr_of("a"));
    assert_eq!(sb.code(), Some(0), "{}", job.stderr_of("b"));
    assert_eq!(job.log().len(), 1, "the second runner took over a held item");
    assert_eq!(job.report("b.json")["items"][0]["status"], "skipped");
    assert_outputs_valid(&job, &["slow".to_owned()]);
}

/// The state letter of a process (`R`, `S`, `T` stopped, `Z`…) from /proc.
fn state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()).unwrap_or('?')
}

#[test]
fn paused_runner_loses_its_item_and_its_command_never_runs_beside_the_successor() {
    // Writes after 3 s, which is after the second runner took the item over (lease 1.5 s).
    let script = r#"sleep 3; printf '{"id": "%s", "by": %s}' "$1" "$PPID" > "$2""#;
    let job = Job::new(&["x".to_owned()], script);
    let mut a = job.spawn(&["--lease", "1500ms", "--report", "a.json"], "a");
    wait_for("the item to start", Duration::from_secs(30), || job.log().len() == 1);
    // Pause the runner at a moment it does not hold the SQLite file (it gives it up between heartbeats).
    loop {
        signal(a.id(), "STOP");
        if lock_is_free(&job.ledger_lock()) {
            break;
        }
        signal(a.id(), "CONT");
        std::thread::sleep(Duration::from_millis(30));
    }
    // The watchdog stops the paused runner's command (its heartbeats stopped) before its lease lapses, so it
    // never runs beside the successor's.
    let commands = children(a.id());
    assert_eq!(commands.len(), 1, "{commands:?}");
    wait_for("the paused runner's command to be stopped", Duration::from_secs(2), || state(commands[0]) == 'T');
    let mut b = job.spawn(&["--lease", "1500ms", "--report", "b.json"], "b");
    let sb = b.wait().unwrap();
    assert_eq!(sb.code(), Some(0), "{}", job.stderr_of("b"));
    assert_eq!(state(commands[0]), 'T', "the paused runner's command ran on beside its successor");
    assert!(!job.out_files().iter().any(|f| f.ends_with(".idem-tmp")), "it wrote: {:?}", job.out_files());
    signal(a.id(), "CONT");
    let sa = a.wait().unwrap();
    assert_eq!(sa.code(), Some(0), "{}", job.stderr_of("a"));
    let log = job.log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(log[0].1, a.id());
    assert_eq!(log[1].1, b.id());
    let out: serde_json::Value = serde_json::from_slice(&std::fs::read(job.path("out/x.json")).unwrap()).unwrap();
    assert_eq!(out["by"], b.id(), "the late result replaced the new holder's");
    let rb = job.report("b.json");
    assert_eq!(rb["items"][0]["status"], "done");
    assert_eq!(rb["items"][0]["attempts"], 2);
    assert_eq!(job.report("a.json")["items"][0]["status"], "skipped", "{}", job.stderr_of("a"));
    assert!(job.stderr_of("a").contains("lease lost"), "{}", job.stderr_of("a"));
    assert!(!alive(commands[0]), "the taken-over command was not killed");
    assert!(!job.out_files().iter().any(|f| f.ends_with(".idem-tmp")), "{:?}", job.out_files());
    let (_, status, _) = common::idem(&["runs", "status", "--output", &job.output()], &[]);
    assert!(status.contains(": 1 done, 0 running or abandoned, 0 failed, 0 poison"), "{status}");
    assert_outputs_valid(&job, &["x".to_owned()]);
}

/// `idem runs forget` says what it forgot (entries and outputs), and exits 3 naming the ids the job does not
/// know, touching no file for them, even one the template would place outside the job's directory. (What
/// forgetting does to the next run is idem-runner's
/// `run_poison::a_poison_item_is_skipped_with_on_poison_skip_and_runs_again_once_forgotten`.)
#[test]
fn runs_forget_says_what_it_forgot_and_touches_no_file_outside_the_job() {
    let job = Job::new(&ids(5), WRITE_JSON);
    let (code, _, err) = job.run(&[]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = common::idem(&["runs", "forget", "--output", &job.output(), "item-00001"], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("forgot 1 of 1"), "{out}");
    std::fs::write(job.path("important.json"), "{}").unwrap();
    let forget = ["runs", "forget", "--output", &job.output(), "item-00003", "../important", "item-00003"];
    let (code, out, err) = common::idem(&forget, &[]);
    assert_eq!(code, 3, "{out}{err}");
    assert_eq!(out, "forgot 1 of 2 items (entries and outputs); the next run executes them again\n");
    assert_eq!(
        err,
        format!(
            "idem: not found: id ../important in the ledger of --output {:?} (nothing done for it); check the id \
             (as the run's summary or --report gives it) and --output\n",
            job.output()
        )
    );
    assert!(!job.path("out/item-00003.json").exists());
    assert!(job.path("important.json").exists(), "forget deleted a file outside the job");
    let (code, out, err) = common::idem(&["runs", "forget", "--output", &job.output(), "nope", "item-00003"], &[]);
    assert_eq!((code, out.as_str()), (3, ""), "{err}");
    assert!(err.starts_with("idem: not found: ids nope, item-00003 in the ledger of --output"), "{err}");
}

/// The command the summary suggests between backticks after `start their count afresh with`, run by `sh` with
/// this build's binary for `idem`: what a user would paste.
fn run_suggested_forget(summary: &str) -> (i32, String) {
    let (_, tail) = summary.split_once("start their count afresh with `").expect(summary);
    let (command, _) = tail.split_once('`').unwrap();
    let command = command.strip_prefix("idem ").expect(command);
    let out = Command::new("sh").arg("-c").arg(format!("{BIN} {command}")).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `idem runs forget` that the summary suggests for items out of attempts, pasted into a shell, starts their
/// count afresh: `--retries 0` then gives each one more attempt. (How attempts are counted across runs is
/// idem-runner's `run_retries::raising_retries_gives_items_out_of_attempts_exactly_that_many_more`.)
#[test]
fn the_suggested_forget_pasted_into_a_shell_starts_the_count_afresh() {
    // Items 1..=6; the even ones fail on every attempt (never poison: another exit status each time).
    let ids: Vec<String> = (1..=6).map(|i| i.to_string()).collect();
    let script = format!(
        r#"if [ $(($1 % 2)) -eq 0 ]; then echo "failure number $IDEM_ATTEMPT" >&2; exit $((10 + IDEM_ATTEMPT)); fi
{WRITE_JSON}"#
    );
    let job = Job::new(&ids, &script);
    let (code, _, err) = job.run(&["--retries", "0"]);
    assert_eq!((code, job.log().len()), (1, 6), "{err}");
    let (code, out) = run_suggested_forget(&err);
    assert_eq!(
        (code, out.as_str()),
        (0, "forgot 3 of 3 items (entries and outputs); the next run executes them again\n")
    );
    let (code, _, err) = job.run(&["--retries", "0"]);
    assert_eq!((code, job.log().len()), (1, 9), "the forgotten items did not run again: {err}");
    assert!(err.contains("failed item 2 after 1 attempt: exit 11: failure number 1\n"), "{err}");
}

/// A dry run says why an item would run or not: an output at the final path that is not valid JSON is a partial
/// one, redone; a valid one without a ledger entry is adopted. (What the run then does is idem-runner's
/// `run_outputs::a_truncated_output_is_redone_and_a_valid_one_without_an_entry_is_adopted`.)
#[test]
fn a_dry_run_says_a_truncated_output_is_redone_and_a_valid_one_adopted() {
    let job = Job::new(&["a".to_owned(), "b".to_owned()], WRITE_JSON);
    std::fs::create_dir_all(job.path("out")).unwrap();
    std::fs::write(job.path("out/a.json"), r#"{"id": "a", "ok": tr"#).unwrap();
    std::fs::write(job.path("out/b.json"), r#"{"id": "b", "ok": true}"#).unwrap();
    let (code, dry, err) = job.run(&["--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(dry.contains("a\tpartial output at the final path (output is not valid JSON)"), "{dry}");
    assert!(dry.contains("b\tadopt: a verified output without a ledger entry"), "{dry}");
    assert!(job.log().is_empty(), "the dry run ran something");
}

#[test]
fn a_refused_run_leaves_no_ledger() {
    let job = Job::new(&ids(3), WRITE_JSON);
    let items = job.path("items.jsonl");
    let no_ledger = |job: &Job, why: &str| {
        assert!(!job.path("out").exists(), "{why}: a refused run created {:?}", job.path("out/.idem"));
        let (code, _, err) = common::idem(&["runs", "status", "--output", &job.output()], &[]);
        assert_eq!(code, 3, "{why}: {err}");
        assert!(err.contains("no ledger at"), "{why}: {err}");
    };
    for (content, extra, needle) in [
        ("{\"id\":\"a\"}\nnot json\n", vec![], "items.jsonl:2: "),
        ("{\"id\":\"a\"}\n{\"n\":1}\n", vec![], "items.jsonl:2: "),
        ("{\"id\":\"a\"}\n{\"id\":\"a\"}\n", vec![], "lines 1 and 2 both write"),
        (
            "{\"id\":\"a\"}\n",
            vec!["--report", "no/such/dir/r.json"],
            "--report no/such/dir/r.json: no directory no/such/dir",
        ),
    ] {
        std::fs::write(&items, content).unwrap();
        let (code, _, err) = job.run(&extra);
        assert_eq!(code, 2, "{content:?}: {err}");
        assert!(err.contains(needle), "{content:?}: {err}");
        no_ledger(&job, content);
    }
    std::fs::remove_file(&items).unwrap();
    let (code, _, err) = job.run(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot read items from"), "{err}");
    no_ledger(&job, "no items file");
    assert!(job.log().is_empty());
}

fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) => Some(url),
        Err(_) => {
            assert!(
                std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
                "{var} is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
            );
            eprintln!("skipped: {var} is unset");
            None
        }
    }
}

async fn cleanup(url: &str, ns: &str) {
    if url.starts_with("postgres") {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        client.batch_execute(&format!("DROP SCHEMA IF EXISTS {ns} CASCADE")).await.unwrap();
    } else {
        let mut conn = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{ns}:*")).query_async(&mut conn).await.unwrap();
        for chunk in keys.chunks(500) {
            let _: () = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await.unwrap();
        }
    }
}

async fn overlapping_on_backend(url: String) {
    let ids = ids(500);
    let mut job = Job::new(&ids, SLOWISH_JSON);
    let ns = format!("idem_run_{:012x}", rand::random::<u64>() >> 16);
    job.store = Some(url.clone());
    job.namespace = Some(ns.clone());
    tokio::task::block_in_place(|| overlapping_runners(&job));
    assert_outputs_valid(&job, &ids);
    cleanup(&url, &ns).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_runners_on_postgres_execute_each_item_once() {
    if let Some(url) = backend_url("IDEM_TEST_POSTGRES_URL") {
        overlapping_on_backend(url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_runners_on_redis_execute_each_item_once() {
    if let Some(url) = backend_url("IDEM_TEST_REDIS_URL") {
        overlapping_on_backend(url).await;
    }
}

#[test]
fn first_ctrl_c_drains_second_kills_and_releases_leases() {
    let ids = ids(20);
    let job = Job::new(&ids, &format!("sleep 1; {WRITE_JSON}"));
    // Ctrl-C once: the two running items finish and are recorded; nothing new starts.
    let mut runner = job.spawn(&["--jobs", "2", "--lease", "60s"], "first");
    wait_for("two items to start", Duration::from_secs(30), || job.log().len() == 2);
    signal(runner.id(), "INT");
    let status = runner.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{}", job.stderr_of("first"));
    assert_eq!(job.log().len(), 2, "an item started after Ctrl-C");
    assert_eq!(job.out_files().len(), 2, "{:?}", job.out_files());
    // Items claimed ahead while the two ran never started: their claims were given back, attempts unspent.
    let (_, status, _) = common::idem(&["runs", "status", "--output", &job.output()], &[]);
    assert!(status.contains(": 2 done, 0 running or abandoned, 0 failed, 0 poison"), "{status}");

    // Ctrl-C twice: the running commands are killed, their leases given back and their attempts too (with
    // --retries 0 a counted attempt would leave them failed for good).
    let mut runner = job.spawn(&["--jobs", "2", "--lease", "60s", "--retries", "0"], "second");
    wait_for("two more items to start", Duration::from_secs(30), || job.log().len() == 4);
    signal(runner.id(), "INT");
    std::thread::sleep(Duration::from_millis(100));
    signal(runner.id(), "INT");
    let status = runner.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{}", job.stderr_of("second"));
    assert_eq!(job.out_files().len(), 2, "a killed item left a file: {:?}", job.out_files());
    let (code, dry, err) = job.run(&["--dry-run", "--retries", "0"]);
    assert_eq!(code, 0, "{err}");
    for (killed, _) in &job.log()[2..4] {
        // Given back uncounted, and remembered as interrupted (its command may have written its final path).
        assert!(dry.contains(&format!("{killed}\tattempt 1 interrupted (")), "{killed} not given back: {dry}");
    }
    assert!(!dry.contains("abandoned") && !dry.contains("runs once its lease lapses"), "{dry}");

    // With the leases released, a rerun need not wait the 60 s lease out.
    let started = Instant::now();
    let (code, _, err) = job.run(&["--jobs", "4", "--lease", "60s", "--retries", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(started.elapsed() < Duration::from_secs(40), "the rerun waited for released leases");
    assert_eq!(job.log().len(), 2 + 2 + 18);
    assert_outputs_valid(&job, &ids);
}

/// A command that writes its final path itself, not only `{out}`: half of it, then (the first time only) a pause
/// in which the runner is stopped, then the rest, and a copy to `{out}` for the runner to verify and rename.
const WRITES_ITS_FINAL_PATH: &str = r#"printf 'first half\n' > "out/$1.txt"
if [ ! -e paused ]; then touch paused; sleep 60; fi
printf 'second half\n' >> "out/$1.txt"
cp "out/$1.txt" "$2""#;

/// How a test stops a runner, the lease it runs with, and the retries its rerun needs.
struct Stopping<F> {
    stop: F,
    lease: &'static str,
    /// The runner's exit status (`None`: killed by a signal).
    code: Option<i32>,
    /// `0` where the stop spends no attempt (an interruption), `1` where it does (a kill -9).
    retries: &'static str,
    /// How the dry run afterwards explains the item.
    dry: &'static str,
}

/// Stops a runner while the command above pauses, with its half-written file at the final path; the next run
/// must run the item again and end with the whole output, never adopt the half.
fn a_half_written_final_path_is_redone_after(how: Stopping<impl FnOnce(&Job, &mut Child)>) {
    let Stopping { stop, lease, code, retries, dry: reason } = how;
    let mut job = Job::new(&["a".to_owned()], WRITES_ITS_FINAL_PATH);
    job.template = "out/{id}.txt";
    std::fs::create_dir_all(job.path("out")).unwrap();
    let mut runner = job.spawn(&["--lease", lease], "first");
    wait_for("the command to pause", Duration::from_secs(30), || job.path("paused").exists());
    stop(&job, &mut runner);
    let status = runner.wait().unwrap();
    assert_eq!(status.code(), code, "{}", job.stderr_of("first"));
    let final_path = job.path("out/a.txt");
    assert_eq!(std::fs::read_to_string(&final_path).unwrap(), "first half\n", "nothing half-written to test with");
    // Once a killed runner's lease lapsed, the dry run and the rerun see the same.
    wait_for("the runner's lease to lapse", Duration::from_secs(30), || {
        let (_, dry, _) = job.run(&["--dry-run", "--retries", retries]);
        !dry.contains("runs once its lease lapses")
    });
    let (code, dry, err) = job.run(&["--dry-run", "--retries", retries]);
    assert_eq!(code, 0, "{err}");
    assert!(dry.starts_with(&format!("a\t{reason}")) && dry.trim_end().ends_with("runs again"), "{dry}");

    let (code, _, err) = job.run(&["--retries", retries, "--lease", lease, "--report", "r.json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(job.report("r.json")["items"][0]["status"], "done", "{err}");
    assert_eq!(job.log().len(), 2, "the item was not run again");
    assert_eq!(std::fs::read_to_string(&final_path).unwrap(), "first half\nsecond half\n");
    assert_eq!(job.out_files(), BTreeSet::from(["a.txt".to_owned()]), "a temporary file was left");
}

/// What a dry run says of an attempt given back after a second Ctrl-C or SIGTERM.
const INTERRUPTED: &str = "attempt 1 interrupted (";

#[test]
fn a_file_half_written_at_the_final_path_before_sigterm_is_redone_not_adopted() {
    let stop = |_: &Job, runner: &mut Child| signal(runner.id(), "TERM");
    a_half_written_final_path_is_redone_after(Stopping {
        stop,
        lease: "60s",
        code: Some(130),
        retries: "0",
        dry: INTERRUPTED,
    });
}

#[test]
fn a_file_half_written_at_the_final_path_before_sighup_is_redone_not_adopted() {
    // A closed terminal: the default action (exit 129) would leave the lease held and the attempt to look crashed.
    let stop = |_: &Job, runner: &mut Child| signal(runner.id(), "HUP");
    a_half_written_final_path_is_redone_after(Stopping {
        stop,
        lease: "60s",
        code: Some(130),
        retries: "0",
        dry: INTERRUPTED,
    });
}

#[test]
fn a_run_started_with_sighup_ignored_keeps_ignoring_it() {
    // As `nohup idem run …` starts it: the shell's `trap '' HUP` is inherited through exec.
    let job = Job::new(&["a".to_owned()], WRITES_ITS_FINAL_PATH);
    std::fs::create_dir_all(job.path("out")).unwrap();
    let inner = job.command(&["--lease", "60s"]);
    let err = std::fs::File::create(job.path("nohup.err")).unwrap();
    let mut runner = Command::new("sh")
        .args(["-c", "trap '' HUP; exec \"$0\" \"$@\""])
        .arg(BIN)
        .args(inner.get_args())
        .current_dir(job.dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap();
    wait_for("the command to pause", Duration::from_secs(30), || job.path("paused").exists());
    signal(runner.id(), "HUP");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        runner.try_wait().unwrap().is_none(),
        "SIGHUP stopped a run started under nohup: {}",
        job.stderr_of("nohup")
    );
    signal(runner.id(), "TERM");
    assert_eq!(runner.wait().unwrap().code(), Some(130), "{}", job.stderr_of("nohup"));
}

#[test]
fn a_file_half_written_at_the_final_path_before_a_second_ctrl_c_is_redone_not_adopted() {
    let twice = |job: &Job, runner: &mut Child| {
        signal(runner.id(), "INT");
        // Two signals sent at once may arrive as one: the second waits for the runner to take the first.
        wait_for("the first Ctrl-C to be taken", Duration::from_secs(10), || {
            job.stderr_of("first").contains("idem run: stopping")
        });
        signal(runner.id(), "INT");
    };
    a_half_written_final_path_is_redone_after(Stopping {
        stop: twice,
        lease: "60s",
        code: Some(130),
        retries: "0",
        dry: INTERRUPTED,
    });
}

#[test]
fn a_file_half_written_at_the_final_path_before_kill_9_is_redone_not_adopted() {
    // A kill counts the attempt (the item may be what killed the runner): one retry is needed.
    let stop = |_: &Job, runner: &mut Child| signal(runner.id(), "KILL");
    a_half_written_final_path_is_redone_after(Stopping {
        stop,
        lease: "1s",
        code: None,
        retries: "1",
        dry: "abandoned by ",
    });
}

#[test]
fn items_from_a_pipe_are_read_once_and_all_run() {
    let job = Job::new(&["a".to_owned()], WRITE_JSON);
    let mut child = Command::new(BIN)
        .args(["run", "--items", "/dev/stdin", "--output", &job.output(), "--"])
        .arg(job.path("work.sh"))
        .args(["{id}", "{out}"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"p1\np2\n\np3\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("3 items in "), "{err}");
    assert_eq!(job.executions_per_item(), BTreeMap::from([("p1".into(), 1), ("p2".into(), 1), ("p3".into(), 1)]));
}

#[test]
fn a_second_runner_waits_for_a_last_attempt_still_running_elsewhere() {
    // With --retries 0 the running attempt is the last one allowed: B must wait for A, not call it failed.
    let job = Job::new(&["last".to_owned()], &format!("sleep 3; {WRITE_JSON}"));
    let mut a = job.spawn(&["--retries", "0", "--lease", "2s"], "a");
    wait_for("the item to start", Duration::from_secs(30), || job.log().len() == 1);
    let mut b = job.spawn(&["--retries", "0", "--lease", "2s"], "b");
    let (sa, sb) = (a.wait().unwrap(), b.wait().unwrap());
    assert_eq!(sa.code(), Some(0), "{}", job.stderr_of("a"));
    assert_eq!(sb.code(), Some(0), "B reported the item failed while A ran it: {}", job.stderr_of("b"));
    assert_eq!(job.log().len(), 1);
}

#[test]
fn a_background_process_holding_stderr_does_not_hold_the_item() {
    // The command exits at once but leaves a child with its standard error open for 23 s.
    let job = Job::new(&["bg".to_owned()], &format!("sleep 23 & {WRITE_JSON}"));
    let started = std::time::Instant::now();
    let (code, _, err) = job.run(&["--timeout", "5s", "--lease", "2s"]);
    let elapsed = started.elapsed();
    let _ = Command::new("pkill").args(["-f", "sleep 23"]).status();
    assert_eq!(code, 0, "{err}");
    assert!(elapsed < Duration::from_secs(10), "the runner waited {elapsed:?} for the background process");
    assert_outputs_valid(&job, &["bg".to_owned()]);
    assert_eq!(job.log().len(), 1);
}

#[test]
fn items_claimed_ahead_keep_their_claim_while_slots_are_busy_for_longer_than_a_lease() {
    // One slot, commands longer than the lease, no retries: an item claimed while another runs must still be
    // its own, unspent, when its turn comes (its lease renewed while it waits), not failed without running.
    let ids = ids(3);
    let job = Job::new(&ids, &format!("sleep 1.5; {WRITE_JSON}"));
    let (code, _, err) = job.run(&["--jobs", "1", "--lease", "1s", "--retries", "0", "--report", "r.json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(job.log().len(), 3);
    assert!(job.executions_per_item().values().all(|&n| n == 1));
    let report = job.report("r.json");
    for item in report["items"].as_array().unwrap() {
        assert_eq!(item["attempts"], 1, "{item}");
    }
    assert_outputs_valid(&job, &ids);
}

#[test]
fn a_bare_program_name_is_looked_up_in_path_and_keeps_its_name() {
    // The lookup is done once per run; the command still sees itself under the name it was given (programs
    // such as busybox act on it).
    let job = Job::new(&["a".to_owned(), "b".to_owned()], WRITE_JSON);
    let run = |out: &str, report: &str, command: &[&str]| {
        let out = Command::new(BIN)
            .arg("run")
            .args(["--items", &job.path("items.jsonl").display().to_string()])
            .args(["--output", &job.path(out).display().to_string()])
            .args(["--report", &job.path(report).display().to_string()])
            .args(["--id-field", "id", "--quiet", "--retries", "0", "--"])
            .args(command)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) =
        run("named/{id}.txt", "named.json", &["sh", "-c", r#"tr '\0' ' ' < /proc/$$/cmdline > "$1""#, "sh", "{out}"]);
    assert_eq!(code, Some(0), "{err}");
    for id in ["a", "b"] {
        let argv = std::fs::read_to_string(job.path(&format!("named/{id}.txt"))).unwrap();
        assert!(argv.starts_with("sh -c "), "argv[0] changed: {argv:?}");
    }
    // A command that cannot start is the operator's typo: refused before anything runs (exit 2), instead of
    // failing the first items as poison for good.
    let (code, err) = run("missing/{id}.txt", "missing.json", &["idem-no-such-program-anywhere"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot start idem-no-such-program-anywhere: not found in PATH"), "{err}");
    let (code, err) = run("missing/{id}.txt", "missing.json", &["./no-such-script.sh"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot start ./no-such-script.sh: No such file or directory"), "{err}");
    assert!(!job.path("missing").exists(), "something ran");
}

#[test]
fn jobs_are_lowered_to_what_the_open_file_limit_allows_instead_of_failing_items() {
    // Past `ulimit -n`, spawns and output checks fail with EMFILE: before, this run stopped after 4 commands
    // with items called poison for the runner's own shortage. Now --jobs is lowered with a warning, and every
    // item runs exactly once.
    let ids = ids(60);
    let job = Job::new(&ids, &format!("sleep 0.05; {WRITE_JSON}"));
    let run = job.command(&["--jobs", "8"]);
    let mut args: Vec<String> = vec!["-c".into(), r#"ulimit -n 32 && exec "$0" "$@""#.into()];
    args.push(run.get_program().to_string_lossy().into_owned());
    args.extend(run.get_args().map(|a| a.to_string_lossy().into_owned()));
    let out = Command::new("sh").args(&args).current_dir(job.path("")).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("only enough file descriptors (ulimit -n 32)"), "{err}");
    assert_eq!(job.log().len(), 60, "{err}");
    assert_eq!(job.executions_per_item().len(), 60);
    assert_outputs_valid(&job, &ids);
}

#[test]
fn a_program_gone_from_where_it_was_found_is_looked_up_again() {
    // Found once per run; if that copy disappears, the next one on PATH runs, as with a shell (before the
    // fallback the items were called poison for good).
    let job = Job::new(&ids(6), &format!("sleep 0.2; {WRITE_JSON}"));
    for dir in ["b1", "b2"] {
        std::fs::create_dir_all(job.path(dir)).unwrap();
        std::fs::copy(job.path("work.sh"), job.path(&format!("{dir}/tool"))).unwrap();
    }
    let path = format!("{}:{}:{}", job.path("b1").display(), job.path("b2").display(), std::env::var("PATH").unwrap());
    let mut cmd = Command::new(BIN);
    cmd.arg("run")
        .args(["--items", &job.path("items.jsonl").display().to_string()])
        .args(["--output", &job.output(), "--id-field", "id", "--quiet", "--jobs", "1"])
        .args(["--", "tool", "{id}", "{out}"])
        .env("PATH", &path)
        .stdin(Stdio::null());
    let runner = cmd.stderr(Stdio::piped()).spawn().unwrap();
    wait_for("an item to run", Duration::from_secs(30), || !job.log().is_empty());
    std::fs::remove_file(job.path("b1/tool")).unwrap();
    assert!(job.log().len() < 6, "every item ran before the program was removed: the test tested nothing");
    let out = runner.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(job.log().len(), 6);
}

#[test]
fn a_large_output_keeps_its_lease_while_it_is_verified_and_fsynced() {
    // 400 MB digested and fsynced take longer than a 1 s lease here: without heartbeats during that step the
    // lease lapsed on every attempt and the item ended "failed" after running four times.
    //
    // The ledger lives on tmpfs. On one ext4 disk, the ledger's own commit (an fsync) waits in the journal
    // behind the output's 400 MB, so on a slow disk (CI's) no renewal can be accepted within 1 s whatever the
    // runner does, and the lease is rightly lost. That is the disk, not the heartbeat this test is about.
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipped: /dev/shm (tmpfs for the ledger) is missing");
        return;
    }
    let ledger = tempfile::tempdir_in(shm).unwrap();
    let job = Job::new(&["big".to_owned()], "head -c 400000000 /dev/zero > \"$2\"");
    let out = Command::new(BIN)
        .arg("run")
        .args(["--store", &format!("sqlite:{}", ledger.path().join("ledger.db").display())])
        .args(["--items", &job.path("items.jsonl").display().to_string()])
        .args(["--output", &job.path("out/{id}.bin").display().to_string()])
        .args(["--id-field", "id", "--quiet", "--lease", "1s", "--", &job.path("work.sh").display().to_string()])
        .args(["{id}", "{out}"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(job.log().len(), 1, "the item ran more than once");
    assert_eq!(std::fs::metadata(job.path("out/big.bin")).unwrap().len(), 400_000_000);
}

#[test]
fn runs_status_and_forget_of_a_job_that_never_ran_say_so_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("typo/{id}.json").display().to_string();
    for args in [vec!["runs", "status", "--output", &output], vec!["runs", "forget", "--output", &output, "7"]] {
        let (code, _, err) = common::idem(&args, &[]);
        assert_eq!(code, 3, "{err}");
        assert!(err.contains("no ledger at") && err.contains("nothing has run"), "{err}");
    }
    assert!(!dir.path().join("typo").exists(), "a ledger was created for a job that never ran");
}

/// The write end of a pipe whose reader is gone, as `idem run … 2>&1 | head -1` leaves it once head exited:
/// every write to it gets EPIPE.
fn closed_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// Standard output and standard error into a closed pipe end what is shown, never the command and never with
/// a panic (exit 101 before: `eprintln!` of the summary): a dry run lists nothing and exits 0; a real run does
/// every item (20 executions, 20 outputs, 0 duplicates) and exits 0; `runs status` and `--help` exit 0; the
/// next run, shown as usual, finds all 20 done and runs nothing.
#[test]
fn a_closed_pipe_on_stdout_and_stderr_ends_the_output_not_the_command() {
    let ids = ids(20);
    let job = Job::new(&ids, WRITE_JSON);
    let into_closed_pipe = |mut cmd: Command| {
        let pipe = closed_pipe();
        let out = cmd.stdout(pipe.try_clone().unwrap()).stderr(pipe).status().unwrap();
        out.code()
    };
    // Not --quiet: the progress lines go to the closed pipe too.
    let mut dry = job.command(&["--dry-run"]);
    dry.env("IDEM_LOG", "debug");
    assert_eq!(into_closed_pipe(dry), Some(0), "dry run");
    assert_eq!(job.log().len(), 0, "the dry run ran something");
    assert_eq!(into_closed_pipe(job.command(&["--jobs", "4"])), Some(0), "run");
    assert_eq!(job.log().len(), 20, "20 executions");
    assert!(job.executions_per_item().values().all(|&n| n == 1), "0 duplicates");
    assert_outputs_valid(&job, &ids);
    let mut status = Command::new(BIN);
    status.args(["runs", "status", "--output", &job.output()]);
    assert_eq!(into_closed_pipe(status), Some(0), "runs status");
    let mut help = Command::new(BIN);
    help.args(["run", "--help"]);
    assert_eq!(into_closed_pipe(help), Some(0), "run --help");
    let (code, _, err) = job.run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nothing to do: all 20 items already done"), "{err}");
    assert_eq!(job.log().len(), 20, "the rerun executed something");
}

/// Item ids are shown in natural order (numbers by value: 3, 20, 100), whatever the order of the items file,
/// of the commands' endings or of the ledger's keys (strings: `100` before `20`): in the summary, the report's
/// summary and `idem runs status`.
#[test]
fn item_ids_are_listed_in_natural_order() {
    let ids: Vec<String> = ["100", "20", "3"].map(String::from).to_vec();
    let job = Job::new(&ids, "echo 'record checksum mismatch' >&2; exit 2");
    let (code, _, err) = job.run(&["--on-poison", "skip", "--jobs", "3", "--report", "r.json"]);
    assert_eq!(code, 3, "{err}");
    let shown: Vec<&str> =
        err.lines().filter_map(|l| l.strip_prefix("poison item ")).filter_map(|l| l.split(':').next()).collect();
    assert_eq!(shown, ["3", "20", "100"], "{err}");
    let r = job.report("r.json");
    let reported: Vec<&str> =
        r["summary"]["poison"].as_array().unwrap().iter().map(|p| p["id"].as_str().unwrap()).collect();
    assert_eq!(reported, ["3", "20", "100"]);
    let (code, status, err) = common::idem(&["runs", "status", "--output", &job.output()], &[]);
    assert_eq!(code, 0, "{err}");
    let listed: Vec<&str> = status.lines().filter_map(|l| l.split_once('\t')).map(|(id, _)| id).collect();
    assert_eq!(listed, ["3", "20", "100"], "{status}");
}

/// A count of one is said in the singular: "1 item …; 1 command ran", then "nothing to do: 1 item already done".
#[test]
fn a_run_of_one_item_says_so_in_the_singular() {
    let job = Job::new(&["only".to_owned()], WRITE_JSON);
    let (code, _, err) = job.run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("1 item in ") && err.contains("; 1 command ran\n"), "{err}");
    let (code, _, err) = job.run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nothing to do: 1 item already done (0 adopted), ran 0 commands"), "{err}");
}
