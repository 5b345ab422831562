//! `idem run --name`, commands without an output file (`IDEM_KEY`), and items done on another host (issue 27).
//! Every command appends one line per execution to a log opened with O_APPEND (`>>`), so executions are counted
//! exactly.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::{self, BIN};

/// Lines of a log (none when it does not exist).
fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).map(|s| s.lines().map(str::to_owned).collect()).unwrap_or_default()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Runs `idem` in `dir` with `args`: (exit code, stdout, stderr).
fn idem_in(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).current_dir(dir).stdin(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Plain-line items `1`..=`n` in `dir/items.txt`.
fn items(dir: &Path, n: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let text: String = (1..=n).map(|i| format!("{i}\n")).collect();
    std::fs::write(dir.join("items.txt"), text).unwrap();
}

/// A command that logs the item to `log` and writes `text` to its output.
fn writing(log: &Path, text: &str) -> String {
    format!("echo \"$1\" >> {}; echo {text} > \"$2\"", log.display())
}

/// `idem run` in `dir` over its items.txt with `--output out/{id}.txt` (relative, as on several machines) and
/// the shell command `script` ($1 the id, $2 the output).
fn run_writing(dir: &Path, store: &str, extra: &[&str], script: &str) -> (i32, String, String) {
    let mut args = vec!["run", "--items", "items.txt", "--output", "out/{id}.txt", "--store", store, "--quiet"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script, "sh", "{id}", "{out}"]);
    idem_in(dir, &args, &[])
}

#[test]
fn two_jobs_with_one_output_template_on_one_ledger_keep_apart_by_name() {
    let root = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", root.path().join("ledger.db").display());
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    items(&a, 5);
    items(&b, 5);
    let (log_a, log_b) = (root.path().join("a.log"), root.path().join("b.log"));
    // Two unrelated jobs, both writing out/{id}.txt relative to their own directory, on one ledger.
    for _ in 0..2 {
        let (code, _, err) = run_writing(&a, &store, &["--name", "job-a"], &writing(&log_a, "A"));
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = run_writing(&b, &store, &["--name", "job-b"], &writing(&log_b, "B"));
        assert_eq!(code, 0, "{err}");
    }
    // Each did its 5 items once (in the order their commands finished); each rerun did nothing (and did not redo
    // the other's).
    assert_eq!(sorted(lines(&log_a)), ["1", "2", "3", "4", "5"]);
    assert_eq!(sorted(lines(&log_b)), ["1", "2", "3", "4", "5"]);
    for (dir, text) in [(&a, "A"), (&b, "B")] {
        for i in 1..=5 {
            assert_eq!(std::fs::read_to_string(dir.join(format!("out/{i}.txt"))).unwrap(), format!("{text}\n"));
        }
    }
    for name in ["job-a", "job-b"] {
        let (code, status, err) = common::idem(&["runs", "status", "--name", name, "--store", &store], &[]);
        assert_eq!(code, 0, "{err}");
        assert!(status.starts_with(&format!("job {name}: 5 done, 0 running or abandoned")), "{status}");
    }
    // Forgetting by name with the job's --output removes that output and redoes only that item. (Run where the
    // job ran: its template is relative.)
    let forget = ["runs", "forget", "--name", "job-a", "--output", "out/{id}.txt", "--store", &store, "3"];
    let (code, out, err) = idem_in(&a, &forget, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!a.join("out/3.txt").exists(), "forget left the output of job-a's item 3");
    assert!(b.join("out/3.txt").exists(), "forget of job-a removed job-b's output");
    let (code, _, err) = run_writing(&a, &store, &["--name", "job-a"], &writing(&log_a, "A"));
    assert_eq!(code, 0, "{err}");
    assert_eq!((lines(&log_a).len(), lines(&log_a).last().unwrap().as_str()), (6, "3"));
    let (code, _, err) = run_writing(&b, &store, &["--name", "job-b"], &writing(&log_b, "B"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log_b).len(), 5, "job-b ran again");
}

#[test]
fn a_ledger_made_without_a_name_is_still_recognised_and_a_changed_job_says_so() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 3);
    let log = dir.path().join("log");
    let ledger = dir.path().join("out/.idem/ledger.db");
    let default_ledger = |extra: &[&str], script: &str| {
        let mut args = vec!["run", "--items", "items.txt", "--output", "out/{id}.txt", "--quiet"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", script, "sh", "{id}", "{out}"]);
        idem_in(dir.path(), &args, &[])
    };
    let (code, _, err) = default_ledger(&[], &writing(&log, "x"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log).len(), 3);
    // Make it the ledger a version before names wrote: entries only, no record of the job.
    let sql = "DELETE FROM kv WHERE key LIKE 'run/%/job'";
    let deleted = Command::new("sqlite3").arg(&ledger).arg(format!("{sql}; SELECT changes();")).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&deleted.stdout).trim(), "1", "{deleted:?}");
    // Rerun without --name: recognised, nothing runs, nothing is said about a change.
    let (code, _, err) = default_ledger(&[], &writing(&log, "x"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log).len(), 3, "an existing ledger was not recognised: {err}");
    assert!(!err.contains("changed since its last run"), "{err}");
    let (code, status, err) = idem_in(dir.path(), &["runs", "status", "--output", "out/{id}.txt"], &[]);
    assert_eq!(code, 0, "{err}");
    let job = status.split(':').next().unwrap().strip_prefix("job ").unwrap().to_owned();
    assert_eq!(job.len(), 12, "the default name is 12 hex digits: {status}");
    assert!(status.contains(": 3 done,"), "{status}");
    // The default name is the output template's hash: given as --name, it is the same job.
    let (code, _, err) = default_ledger(&["--name", &job], &writing(&log, "x"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log).len(), 3, "--name {job} is not the unnamed job: {err}");
    // The same name with another command: the run says so (and its items stay done).
    let (code, _, err) = default_ledger(&["--name", &job], &writing(&log, "y"));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&format!("job {job}: the command changed since its last run")), "{err}");
    assert_eq!(lines(&log).len(), 3);
    // Another output template under one name: said too (its items are new to it, so they run).
    let mut args = vec!["run", "--name", &job, "--items", "items.txt", "--output", "out2/{id}.txt", "--quiet"];
    let script = writing(&log, "y");
    let store = format!("sqlite:{}", ledger.display());
    args.extend_from_slice(&["--store", &store, "--", "sh", "-c", &script, "sh", "{id}", "{out}"]);
    let (code, _, err) = idem_in(dir.path(), &args, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(
            "job {job}: the output template changed since its last run (\"out/{{id}}.txt\" then, \"out2/{{id}}.txt\" now)"
        )),
        "{err}"
    );
    // A name that cannot be a ledger key is refused before anything runs.
    let (code, _, err) = default_ledger(&["--name", "a/b"], &writing(&log, "x"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--name \"a/b\": use 1 to 100 ASCII letters, digits, '.', '_' and '-'"), "{err}");
}

/// Waits up to `secs` for `ready`.
fn wait_for(what: &str, secs: u64, mut ready: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !ready() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The side-effect-only job of the kill -9 test: every execution appends its IDEM_KEY to `log` (a sink that
/// does not dedupe), then creates `sink/$IDEM_KEY` with noclobber (a sink that dedupes on the key: only the
/// first creation succeeds) and appends the key to `effects` when it did; no output file.
fn side_effect_args<'a>(script: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["run", "--name", "mail", "--items", "items.txt", "--quiet", "--jobs", "4", "--lease", "2s"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script, "sh", "{key}"]);
    args
}

#[test]
fn side_effect_items_without_output_survive_kill_9_once_at_a_deduping_sink() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 200);
    std::fs::create_dir(dir.path().join("sink")).unwrap();
    let (log, effects) = (dir.path().join("log"), dir.path().join("effects"));
    // {key} and IDEM_KEY are one key; the pause keeps four commands in flight when the kill comes.
    let script = format!(
        "[ \"$1\" = \"$IDEM_KEY\" ] || exit 9; echo \"$IDEM_KEY\" >> {log}; \
         if (set -C; : > \"sink/$IDEM_KEY\") 2>/dev/null; then echo \"$IDEM_KEY\" >> {effects}; fi; sleep 0.02",
        log = log.display(),
        effects = effects.display()
    );
    let mut runner = Command::new(BIN)
        .args(side_effect_args(&script, &[]))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("60 executions", 120, || lines(&log).len() >= 60);
    runner.kill().unwrap(); // SIGKILL: no chance to record or release anything
    runner.wait().unwrap();
    let at_kill = lines(&log).len();
    assert!(at_kill < 200, "the run finished before the kill ({at_kill} executions)");
    // In flight at the kill: the items the ledger says are running (claimed, not recorded: commands running,
    // finished but not yet recorded, or claimed ahead of a slot).
    let sql = "SELECT count(*) FROM kv WHERE key LIKE 'run/mail/item/%' AND CAST(value AS TEXT) LIKE '%\"state\":\"running\"%'";
    let counted = Command::new("sqlite3").arg(dir.path().join(".idem/ledger.db")).arg(sql).output().unwrap();
    let in_flight: usize = String::from_utf8_lossy(&counted.stdout).trim().parse().unwrap();
    assert!(in_flight <= 200, "{counted:?}");
    // The rerun finishes the rest; items whose runner died in flight run again, with the same key.
    let (code, _, err) = idem_in(dir.path(), &side_effect_args(&script, &[]), &[]);
    assert_eq!(code, 0, "{err}");
    let executed = lines(&log);
    let keys: std::collections::BTreeSet<&String> = executed.iter().collect();
    assert_eq!(keys.len(), 200, "every item ran: {} distinct keys", keys.len());
    // At most the items in flight at the kill ran twice.
    assert!(executed.len() <= 200 + in_flight, "{} executions for 200 items, {in_flight} in flight", executed.len());
    let effected = lines(&effects);
    let unique: std::collections::BTreeSet<&String> = effected.iter().collect();
    let present = std::fs::read_dir(dir.path().join("sink")).unwrap().count();
    assert_eq!((present, unique.len()), (200, effected.len()), "200 present, 0 duplicates at the deduping sink");
    // The log of effects is written after the effect: a command killed with its runner between the two (the
    // watchdog kills them) made its effect but not its line, and its rerun finds the effect made. So up to the
    // items in flight at the kill may lack a line, never more (CI met one, 2026-12-06).
    assert!(effected.len() + in_flight >= 200, "{} effect lines, {in_flight} in flight", effected.len());
    // The third run executes nothing: recorded done is done, no file is looked at.
    let (code, _, err) = idem_in(dir.path(), &side_effect_args(&script, &[]), &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nothing to do: all 200 items already done"), "{err}");
    assert_eq!(lines(&log).len(), executed.len(), "the third run executed something");
    // The key's shape: NAME:ID:HASH, HASH as `idem key` derives it from the item's text.
    let (code, derived, err) = common::idem(&["key", "--prefix", "mail", "--id", "7", "--data", "7"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(keys.contains(&derived.trim().to_owned()), "{derived} is not among the keys used");
    assert!(derived.starts_with("mail:7:") && derived.trim().len() == "mail:7:".len() + 16, "{derived}");
}

#[test]
fn without_output_a_name_is_needed_and_out_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 2);
    let run = |args: &[&str]| {
        let mut all = vec!["run", "--items", "items.txt", "--quiet"];
        all.extend_from_slice(args);
        idem_in(dir.path(), &all, &[])
    };
    let (code, _, err) = run(&["--", "true"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("without --output, give the job a --name"), "{err}");
    let (code, _, err) = run(&["--name", "n", "--", "cp", "items.txt", "{out}"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("{out} in the command needs --output"), "{err}");
    assert!(!dir.path().join(".idem").exists(), "a refused run left a ledger");
    // A command that fails without output is failed, not "no output" poison on success.
    let (code, _, err) = run(&["--name", "n", "--", "true"]);
    assert_eq!(code, 0, "{err}");
    let (code, status, err) = idem_in(dir.path(), &["runs", "status", "--name", "n"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(status.starts_with("job n: 2 done,"), "{status}");
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

async fn drop_namespace(url: &str, ns: &str) {
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

/// Two machines (two directories, IDEM_HOST host-a and host-b) run one named job writing `out/{id}.txt` to
/// their own disks, sharing the ledger at `url`: 40 items, 40 executions.
fn two_hosts_share_one_ledger(url: &str, ns: &str) {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    items(&a, 40);
    items(&b, 40);
    // host-a is stopped after the first 20 items (a file of its first 20 lines).
    let first: String = (1..=20).map(|i| format!("{i}\n")).collect();
    std::fs::write(a.join("first.txt"), first).unwrap();
    let log = root.path().join("log");
    let run = |dir: &Path, host: &str, items: &str, extra: &[&str]| {
        let script = format!("echo \"$1 {host}\" >> {}; echo {host} > \"$2\"", log.display());
        let mut args = vec!["run", "--name", "shared", "--items", items, "--output", "out/{id}.txt", "--store", url];
        args.extend_from_slice(&["--namespace", ns, "--jobs", "2"]);
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", &script, "sh", "{id}", "{out}"]);
        idem_in(dir, &args, &[("IDEM_HOST", host)])
    };
    let (code, _, err) = run(&a, "host-a", "first.txt", &[]);
    assert_eq!(code, 0, "{err}");
    // host-b: the 20 host-a did are done elsewhere, not run again for want of their outputs on its disk.
    let report = root.path().join("b.json");
    let (code, _, err) = run(&b, "host-b", "items.txt", &["--report", &report.display().to_string()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("20 done now, 0 already done, 0 adopted"), "{err}");
    assert!(err.contains("20 done elsewhere (host-a: 20)"), "{err}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(json["summary"]["done_elsewhere"], serde_json::json!({"host-a": 20}));
    let elsewhere: Vec<&serde_json::Value> =
        json["items"].as_array().unwrap().iter().filter(|i| i["status"] == "done_elsewhere").collect();
    assert_eq!(elsewhere.len(), 20);
    assert!(elsewhere.iter().all(|i| i["host"] == "host-a"), "{elsewhere:?}");
    // host-a, all 40: its own 20 checked on its disk, host-b's 20 done elsewhere.
    let (code, _, err) = run(&a, "host-a", "items.txt", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nothing to do: all 40 items already done"), "{err}");
    assert!(err.contains("20 done elsewhere (host-b: 20)"), "{err}");
    let executed = lines(&log);
    let ids: std::collections::BTreeSet<&str> = executed.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!((executed.len(), ids.len()), (40, 40), "40 items, 40 executions: {executed:?}");
    // An output missing on the host that recorded it is still run again, there.
    std::fs::remove_file(a.join("out/5.txt")).unwrap();
    let (code, _, err) = run(&a, "host-a", "items.txt", &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log).len(), 41, "{err}");
    assert_eq!(lines(&log).last().unwrap(), "5 host-a");
    // Status shows who recorded what.
    let (code, status, err) =
        common::idem(&["runs", "status", "--name", "shared", "--store", url, "--namespace", ns], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(status.contains("\ndone on host-a: 20\ndone on host-b: 20\n"), "{status}");
    // Each machine its own copy: --require-local-output runs host-a's 20 on host-b.
    let (code, _, err) = run(&b, "host-b", "items.txt", &["--require-local-output"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log).len(), 61, "{err}");
    assert_eq!(
        std::fs::read_dir(b.join("out"))
            .unwrap()
            .filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
            .count(),
        40
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_on_postgres_run_40_items_40_times() {
    if let Some(url) = backend_url("IDEM_TEST_POSTGRES_URL") {
        let ns = format!("idem_named_{:012x}", rand::random::<u64>() >> 16);
        tokio::task::block_in_place(|| two_hosts_share_one_ledger(&url, &ns));
        drop_namespace(&url, &ns).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_on_redis_run_40_items_40_times() {
    if let Some(url) = backend_url("IDEM_TEST_REDIS_URL") {
        let ns = format!("idem_named_{:012x}", rand::random::<u64>() >> 16);
        tokio::task::block_in_place(|| two_hosts_share_one_ledger(&url, &ns));
        drop_namespace(&url, &ns).await;
    }
}

/// `idem runs forget --name J ID` without --output deletes no file: the job's recorded template, resolved against
/// another directory, names someone else's file. It says so, and names the --output that would delete outputs.
#[test]
fn forget_by_name_without_output_deletes_no_file() {
    let root = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", root.path().join("ledger.db").display());
    let (job_dir, elsewhere) = (root.path().join("job"), root.path().join("elsewhere"));
    items(&job_dir, 3);
    let log = root.path().join("log");
    let (code, _, err) = run_writing(&job_dir, &store, &["--name", "rep"], &writing(&log, "R"));
    assert_eq!(code, 0, "{err}");
    // Someone's file where the recorded template points from another directory.
    std::fs::create_dir_all(elsewhere.join("out")).unwrap();
    std::fs::write(elsewhere.join("out/2.txt"), "precious\n").unwrap();
    let (code, out, err) = idem_in(&elsewhere, &["runs", "forget", "--name", "rep", "--store", &store, "2"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(std::fs::read_to_string(elsewhere.join("out/2.txt")).unwrap(), "precious\n", "forget deleted a file");
    assert!(job_dir.join("out/2.txt").exists(), "forget without --output deleted the job's output");
    assert!(out.contains("forgot 1 of 1 item (ledger entries only; no output deleted"), "{out}");
    assert!(out.contains("--output \"out/{id}.txt\""), "{out}");
    // Not "the next run executes them again" beside "adopts": with its output kept, it is adopted, not run.
    assert!(out.contains("the next run adopts each output it finds in place"), "{out}");
    assert!(!out.contains("executes them again"), "contradictory: {out}");
    // A job without outputs says just that.
    let (code, _, err) = idem_in(
        &job_dir,
        &["run", "--name", "mail", "--items", "items.txt", "--store", &store, "--quiet", "--", "true"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = idem_in(&elsewhere, &["runs", "forget", "--name", "mail", "--store", &store, "1"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("(ledger entries; the job writes no outputs)"), "{out}");
}

/// `idem runs status|forget` for a job, store or namespace nothing ran with: one line, exit 3 (as `idem once
/// status`), and no store made for it (no SQLite file, no PostgreSQL schema).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_status_and_forget_of_an_unknown_job_exit_3_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 2);
    let d = dir.path();
    let expect_3 = |args: &[&str], needle: &str| {
        let (code, out, err) = idem_in(d, args, &[]);
        assert_eq!(code, 3, "{args:?}: {out}{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: not one line: {err}");
    };
    // No ledger in the current directory, and a named SQLite file that does not exist: neither is created.
    for sub in [&["runs", "status", "--name", "nosuch"][..], &["runs", "forget", "--name", "nosuch", "1"]] {
        expect_3(sub, "no ledger at ./.idem/ledger.db: nothing has run with job nosuch");
    }
    assert!(!d.join(".idem").exists(), "status or forget created the default ledger");
    let typo = format!("sqlite:{}", d.join("typo.db").display());
    expect_3(&["runs", "status", "--name", "nosuch", "--store", &typo], "no ledger at");
    assert!(!d.join("typo.db").exists(), "status created the SQLite file it was given");
    // A ledger that exists, with another job in it.
    let (code, _, err) = idem_in(d, &["run", "--name", "real", "--items", "items.txt", "--quiet", "--", "true"], &[]);
    assert_eq!(code, 0, "{err}");
    expect_3(&["runs", "status", "--name", "nosuch"], "no job nosuch in sqlite:./.idem/ledger.db");
    expect_3(&["runs", "forget", "--name", "nosuch", "1"], "no job nosuch in");
    expect_3(&["runs", "status", "--output", "o/{id}"], "no ledger at o/.idem/ledger.db");
    let (code, status, err) = idem_in(d, &["runs", "status", "--name", "real"], &[]);
    assert_eq!((code, status.starts_with("job real: 2 done")), (0, true), "{status}{err}");
    // A PostgreSQL namespace nothing ran in: not created.
    let Some(url) = backend_url("IDEM_TEST_POSTGRES_URL") else { return };
    let ns = format!("runs_unknown_{}", std::process::id());
    drop_namespace(&url, &ns).await;
    tokio::task::block_in_place(|| {
        expect_3(
            &["runs", "status", "--name", "real", "--store", &url, "--namespace", &ns],
            "(namespace runs_unknown_",
        );
    });
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let rows = client.query("SELECT 1 FROM information_schema.schemata WHERE schema_name = $1", &[&ns]).await.unwrap();
    assert_eq!(rows.len(), 0, "status created the schema {ns}");
}

/// A placeholder the runner does not know (`{ky}`, `{}`, `{item}` in --check) is refused before anything runs
/// (exit 2, one line listing the valid ones), rather than reaching the command literally.
#[test]
fn unknown_placeholders_are_refused_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 2);
    let log = dir.path().join("log").display().to_string();
    let script = format!("echo \"$1\" >> {log}");
    for (extra, needle) in [
        (
            vec!["--", "sh", "-c", &script, "sh", "{ky}"],
            "unknown placeholder {ky} in the command; the command takes {id}, {out}, {key}, {item}",
        ),
        (
            vec!["--", "sh", "-c", &script, "sh", "{}"],
            "unknown placeholder {} in the command (GNU parallel's {} is {item} or {id} here)",
        ),
        (
            vec!["--check", "grep -q {item} done.txt", "--", "sh", "-c", &script, "sh", "{id}"],
            "unknown placeholder {item} in --check; --check takes {id}, {key}",
        ),
    ] {
        let mut args = vec!["run", "--name", "p", "--items", "items.txt", "--quiet"];
        args.extend_from_slice(&extra);
        let (code, _, err) = idem_in(dir.path(), &args, &[]);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    assert!(lines(Path::new(&log)).is_empty(), "a refused run executed something");
    assert!(!dir.path().join(".idem").exists(), "a refused run left a ledger");
    // The shell's ${VAR} and braces that are no placeholder pass.
    let script = format!("v=x; echo \"${{v}}$1\" | awk '{{print $1}}' >> {log}");
    let (code, _, err) = idem_in(
        dir.path(),
        &["run", "--name", "p", "--items", "items.txt", "--quiet", "--", "sh", "-c", &script, "sh", "{id}"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(sorted(lines(Path::new(&log))), ["x1", "x2"]);
}

/// Messages that misled: a template "changed" each time two hosts with their own paths alternate on one ledger;
/// --require-local-output accepted without --output (it did nothing); adopted items listed as done on a host
/// named "adopted"; adding --output to a job that had none said its done items stay done (they run again).
#[test]
fn shared_ledger_messages_say_what_happens() {
    let root = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", root.path().join("ledger.db").display());
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    items(&a, 2);
    items(&b, 2);
    let run = |dir: &Path, host: &str, output: &str| {
        let args = [
            "run",
            "--name",
            "j",
            "--items",
            "items.txt",
            "--output",
            output,
            "--store",
            &store,
            "--quiet",
            "--",
            "sh",
            "-c",
            "echo x > \"$1\"",
            "sh",
            "{out}",
        ];
        idem_in(dir, &args, &[("IDEM_HOST", host)])
    };
    // Two hosts, each with its own path: no warning however they alternate.
    for _ in 0..2 {
        for (dir, host, output) in [(&a, "host-a", "out-a/{id}"), (&b, "host-b", "out-b/{id}")] {
            let (code, _, err) = run(dir, host, output);
            assert_eq!(code, 0, "{err}");
            assert!(!err.contains("changed since its last run"), "{host}: {err}");
        }
    }
    // One host whose template changed: said.
    let (code, _, err) = run(&b, "host-b", "out-c/{id}");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("job j: the output template changed since its last run"), "{err}");
    // An output found in place is adopted; status does not call "adopted" a host.
    std::fs::create_dir_all(a.join("out-d")).unwrap();
    std::fs::write(a.join("out-d/1"), "x\n").unwrap();
    let args = [
        "run",
        "--name",
        "k",
        "--items",
        "items.txt",
        "--output",
        "out-d/{id}",
        "--store",
        &store,
        "--quiet",
        "--",
        "sh",
        "-c",
        "echo x > \"$1\"",
        "sh",
        "{out}",
    ];
    let (code, _, err) = idem_in(&a, &args, &[("IDEM_HOST", "host-a")]);
    assert_eq!(code, 0, "{err}");
    let (code, status, err) = idem_in(&a, &["runs", "status", "--name", "k", "--store", &store], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(status.contains("adopted (found in place; no host recorded): 1\n"), "{status}");
    assert!(!status.contains("done on adopted"), "{status}");
    // --require-local-output needs --output.
    let (code, _, err) = idem_in(
        &a,
        &["run", "--name", "m", "--items", "items.txt", "--store", &store, "--require-local-output", "--", "true"],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--require-local-output judges done items by their output files: it needs --output"), "{err}");
    // A job without outputs that gets one: its done items run again, as said.
    let (code, _, err) =
        idem_in(&a, &["run", "--name", "m", "--items", "items.txt", "--store", &store, "--quiet", "--", "true"], &[]);
    assert_eq!(code, 0, "{err}");
    let args = [
        "run",
        "--name",
        "m",
        "--items",
        "items.txt",
        "--output",
        "out-m/{id}",
        "--store",
        &store,
        "--quiet",
        "--",
        "sh",
        "-c",
        "echo x > \"$1\"",
        "sh",
        "{out}",
    ];
    let (code, _, err) = idem_in(&a, &args, &[]);
    assert_eq!(code, 0, "{err}");
    let said = "--output \"out-m/{id}\" was added since its last run, which had none; items done then have no \
                output there and run again";
    assert!(err.contains(said), "{err}");
    assert!(err.contains("2 done now"), "{err}");
}

/// `idem runs status` of a job without outputs whose ledger two hosts share counts the items each host recorded
/// done, as text and as JSON (`--format json`). (The runs' reports and summaries are idem-runner's
/// `run_checks::reports_and_summaries_of_a_job_without_outputs_add_up`.)
#[test]
fn runs_status_of_a_job_without_outputs_on_two_hosts_counts_each_hosts_items() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let run = |host: &str, ids: &str| {
        std::fs::write(dir.path().join("items.txt"), ids).unwrap();
        let args = ["run", "--name", "mail", "--items", "items.txt", "--store", &store, "--quiet", "--", "true"];
        let (code, _, err) = idem_in(dir.path(), &args, &[("IDEM_HOST", host)]);
        assert_eq!(code, 0, "{host}: {err}");
    };
    // host-b finds 1 and 2 done on host-a, and runs 4.
    run("host-a", "1\n2\n3\n");
    run("host-b", "1\n2\n4\n");
    let (code, text, err) = idem_in(dir.path(), &["runs", "status", "--name", "mail", "--store", &store], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(text.starts_with("job mail: 4 done, 0 running or abandoned, 0 failed, 0 poison, 0 interrupted"), "{text}");
    let (code, out, err) =
        idem_in(dir.path(), &["runs", "status", "--name", "mail", "--store", &store, "--format", "json"], &[]);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (status["job"].as_str(), status["done"].as_u64(), status["failed"].as_u64()),
        (Some("mail"), Some(4), Some(0)),
        "{status}"
    );
    assert_eq!(status["done_by_host"]["host-a"].as_u64(), Some(3), "{status}");
    assert_eq!(status["done_by_host"]["host-b"].as_u64(), Some(1), "{status}");
}

/// Two named jobs writing one set of files (one directory, one template, one host, one ledger): the second is
/// refused (exit 2, naming the first; 0 executions, 0 adopted, the first's outputs untouched) instead of
/// adopting the first's 5 outputs as its own (before: "5 adopted, 0 ran"); with another --output it runs its 5;
/// the first's rerun runs nothing. (In another directory the same template is other files:
/// two_jobs_with_one_output_template_on_one_ledger_keep_apart_by_name.)
#[test]
fn a_named_job_writing_another_named_jobs_outputs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 5);
    let store = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let (code, _, err) = run_writing(dir.path(), &store, &["--name", "job-a"], &writing(&log_a, "A"));
    assert_eq!(code, 0, "{err}");
    for output in ["out/{id}.txt", "./out/{id}.txt"] {
        let args = [
            "run",
            "--name",
            "job-b",
            "--items",
            "items.txt",
            "--output",
            output,
            "--store",
            &store,
            "--quiet",
            "--",
            "sh",
            "-c",
            &writing(&log_b, "B"),
            "sh",
            "{id}",
            "{out}",
        ];
        let (code, _, err) = idem_in(dir.path(), &args, &[]);
        assert_eq!(code, 2, "{output}: {err}");
        assert!(err.contains("job job-b writes the outputs of job job-a on this host"), "{err}");
        assert!(err.contains("nothing ran"), "{err}");
    }
    assert!(lines(&log_b).is_empty(), "job-b ran");
    assert_eq!(std::fs::read_to_string(dir.path().join("out/1.txt")).unwrap(), "A\n");
    let (code, _, err) = idem_in(dir.path(), &["runs", "status", "--name", "job-b", "--store", &store], &[]);
    assert_eq!(code, 3, "the refused job left a record: {err}");
    let args = [
        "run",
        "--name",
        "job-b",
        "--items",
        "items.txt",
        "--output",
        "out-b/{id}.txt",
        "--store",
        &store,
        "--quiet",
        "--",
        "sh",
        "-c",
        &writing(&log_b, "B"),
        "sh",
        "{id}",
        "{out}",
    ];
    let (code, _, err) = idem_in(dir.path(), &args, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log_b).len(), 5);
    let (code, _, err) = run_writing(dir.path(), &store, &["--name", "job-a"], &writing(&log_a, "A"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(lines(&log_a).len(), 5, "job-a ran again");
}

/// A named job's --output added with the default ledger: that ledger is next to the outputs, so a new one is
/// started and the 3 items run again, which the run now says (naming the directory's ledger and the --store
/// that goes on with it; before, nothing was said). On a fixed --store, an output template and a command both
/// changed no longer say "items done then stay done" (they run again where their output is not at the new
/// paths).
#[test]
fn a_moved_ledger_or_output_is_said_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    items(dir.path(), 3);
    let log = dir.path().join("log");
    let plain = ["run", "--name", "mail", "--items", "items.txt", "--quiet", "--", "sh", "-c"];
    let script = format!("echo \"$1\" >> {}", log.display());
    let mut args = plain.to_vec();
    args.extend_from_slice(&[&script, "sh", "{id}"]);
    let (code, _, err) = idem_in(dir.path(), &args, &[]);
    assert_eq!(code, 0, "{err}");
    let with_output = format!("echo \"$1\" >> {}; echo x > \"$2\"", log.display());
    let args = [
        "run",
        "--name",
        "mail",
        "--items",
        "items.txt",
        "--output",
        "out/{id}",
        "--quiet",
        "--",
        "sh",
        "-c",
        &with_output,
        "sh",
        "{id}",
        "{out}",
    ];
    let (code, _, err) = idem_in(dir.path(), &args, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("job mail: a new ledger at out/.idem/ledger.db"), "{err}");
    assert!(err.contains("give --store sqlite:./.idem/ledger.db to go on with it"), "{err}");
    assert_eq!(lines(&log).len(), 6, "3 items, run again in the new ledger");
    // A fixed store: output and command changed together.
    let store = format!("sqlite:{}", dir.path().join("l.db").display());
    for (output, text) in [("o1/{id}", "A"), ("o2/{id}", "B")] {
        let args = [
            "run",
            "--name",
            "pair",
            "--items",
            "items.txt",
            "--output",
            output,
            "--store",
            &store,
            "--quiet",
            "--",
            "sh",
            "-c",
            &writing(&log, text),
            "sh",
            "{id}",
            "{out}",
        ];
        let (code, _, err) = idem_in(dir.path(), &args, &[]);
        assert_eq!(code, 0, "{err}");
        if text == "B" {
            assert!(err.contains("the output template changed since its last run"), "{err}");
            assert!(err.contains("items done then stay done only where their output is at the new paths"), "{err}");
            assert!(!err.contains("items done then stay done (`idem runs forget`"), "{err}");
        }
    }
}
