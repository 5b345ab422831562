//! `idem run` consuming real brokers: RabbitMQ (`IDEM_TEST_AMQP_URL`, e.g.
//! `amqp://guest:guest@127.0.0.1:5672/%2f`) and NATS JetStream (`IDEM_TEST_NATS_URL`, e.g.
//! `nats://127.0.0.1:4222`). Each test makes its own queue or stream with a unique name and deletes it; the
//! tests skip with a printed reason when the variable is unset, and fail instead under
//! `IDEM_TEST_REQUIRE_BACKENDS`.
//!
//! Every command appends `ID PID` to a log (O_APPEND) when it starts, so executions are counted exactly, and
//! who ran them.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod amqp;
mod nats;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::BIN;

/// The broker URL in `var`, or `None` (printed) when unset; unset under `IDEM_TEST_REQUIRE_BACKENDS` fails.
pub fn broker_url(var: &str) -> Option<String> {
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

/// A unique name for this test's queue or stream.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}{:012x}", rand::random::<u64>() >> 16)
}

/// One job's directory: the command script, its execution log and the outputs (`out/{id}.json`, ledger
/// `out/.idem/ledger.db`, shared by every consumer of the job).
pub struct QueueJob {
    pub dir: tempfile::TempDir,
    /// `--items`.
    pub items: String,
}

/// Writes `{"id": …}` slowly enough for a kill to land mid-item when asked: `SLEEP` seconds.
pub const WRITE_JSON: &str = r#"sleep "${SLEEP:-0}"; printf '{"id": "%s"}' "$1" > "$2""#;

impl QueueJob {
    pub fn new(items: String, script: &str) -> QueueJob {
        let dir = tempfile::tempdir().unwrap();
        let script =
            format!("#!/bin/sh\necho \"$IDEM_ITEM_ID $PPID\" >> {}\n{script}\n", dir.path().join("log").display());
        let path = dir.path().join("work.sh");
        std::fs::write(&path, script).unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&path, perms).unwrap();
        QueueJob { dir, items }
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    pub fn command(&self, extra: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--items", &self.items, "--quiet"])
            .args(["--output", &self.path("out/{id}.json").display().to_string()])
            .args(extra)
            .arg("--")
            .arg(self.path("work.sh"))
            .args(["{id}", "{out}"])
            .stdin(Stdio::null());
        cmd
    }

    /// Runs one consumer to its end: (exit status, stderr).
    pub fn run(&self, extra: &[&str]) -> (i32, String) {
        let out = self.command(extra).output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// Starts a consumer in the background, its standard error to `name`.err.
    pub fn spawn(&self, extra: &[&str], envs: &[(&str, &str)], name: &str) -> Child {
        let err = std::fs::File::create(self.path(&format!("{name}.err"))).unwrap();
        let mut cmd = self.command(extra);
        cmd.envs(envs.iter().copied());
        cmd.stdout(Stdio::null()).stderr(err).spawn().unwrap()
    }

    pub fn stderr_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{name}.err"))).unwrap_or_default()
    }

    /// (id, consumer pid) per execution.
    pub fn log(&self) -> Vec<(String, u32)> {
        std::fs::read_to_string(self.path("log"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (id, pid) = l.split_once(' ').unwrap();
                (id.to_owned(), pid.parse().unwrap())
            })
            .collect()
    }

    pub fn executions_per_item(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (id, _) in self.log() {
            *m.entry(id).or_default() += 1;
        }
        m
    }

    /// Asserts that each of `ids` has a valid output naming it, and that nothing else is there.
    pub fn assert_outputs_valid(&self, ids: &[String]) {
        for id in ids {
            let bytes = std::fs::read(self.path(&format!("out/{id}.json"))).unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("output of {id} is not valid JSON ({e}): {bytes:?}"));
            assert_eq!(v["id"], id.as_str());
        }
        let files =
            std::fs::read_dir(self.path("out")).unwrap().filter(|e| e.as_ref().unwrap().file_name() != ".idem").count();
        assert_eq!(files, ids.len(), "outputs (temporary files included)");
    }
}

/// Waits until `cond` holds, polling every 50 ms; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for a consumer to exit within `timeout` (killed and failed otherwise): its exit status.
pub fn exit_within(child: &mut Child, timeout: Duration, name: &str, job: &QueueJob) -> i32 {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} did not exit within {timeout:?}:\n{}", job.stderr_of(name));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `n` ids, `job-00000` up.
pub fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("job-{i:05}")).collect()
}

/// The ids in `ids` published twice: every fifth, in a fixed order (a duplicate published right after its
/// original for every other one, at the end for the rest, so some arrive while their first copy runs).
pub fn with_duplicates(ids: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(ids.len() * 5 / 4);
    let mut late = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        out.push(id.clone());
        if i % 4 == 0 {
            if i % 8 == 0 { out.push(id.clone()) } else { late.push(id.clone()) }
        }
    }
    out.extend(late);
    out
}

/// Sends `sig` (`INT`, `TERM`) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().unwrap().success());
}

/// A consumer running as a service gets Ctrl-C after its first two items started: those two finish and are
/// acknowledged, nothing else starts, the messages it took ahead go back (exit 130); a second consumer with
/// `--until-empty` then does the other 18, none of them twice.
pub fn ctrl_c_finishes_running_items_and_hands_the_rest_back(job: &QueueJob, after_stop: impl FnOnce()) {
    let mut consumer = job.spawn(&["--jobs", "2", "--lease", "30s"], &[("SLEEP", "1")], "service");
    wait_for("two items to start", Duration::from_secs(30), || job.log().len() == 2);
    signal(consumer.id(), "INT");
    let code = exit_within(&mut consumer, Duration::from_secs(30), "service", job);
    let err = job.stderr_of("service");
    assert_eq!(code, 130, "{err}");
    assert!(err.contains(": 2 done now, 0 already done"), "{err}");
    assert_eq!(job.log().len(), 2, "an item started after Ctrl-C: {err}");
    after_stop();
    let mut rest = job.spawn(&["--until-empty", "--jobs", "4"], &[], "rest");
    let code = exit_within(&mut rest, Duration::from_secs(120), "rest", job);
    let err = job.stderr_of("rest");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(": 18 done now, 0 already done"), "{err}");
    let runs = job.executions_per_item();
    assert_eq!((runs.len(), runs.values().all(|&n| n == 1)), (20, true), "{runs:?}");
    job.assert_outputs_valid(&ids(20));
}

#[test]
fn an_amqp_url_at_a_nats_server_says_it_is_no_amqp_broker() {
    let Some(nats) = broker_url("IDEM_TEST_NATS_URL") else { return };
    let host_port = nats.split_once("://").unwrap().1.trim_end_matches('/');
    let job = QueueJob::new(format!("amqp://guest:guest@{host_port}/%2f?queue=q"), WRITE_JSON);
    let (code, err) = job.run(&["--until-empty"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("the server at {host_port} did not answer as an AMQP 0-9-1 broker")), "{err}");
    assert!(!err.contains("Parsing Error") && !err.contains("ERROR"), "{err}");
}

#[test]
fn a_nats_url_at_a_server_that_never_answers_says_so_after_5_s() {
    // Accepts connections (the kernel's backlog) and never says a word.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let job = QueueJob::new(format!("nats://127.0.0.1:{port}?stream=S&consumer=C"), WRITE_JSON);
    let (code, err) = job.run(&["--until-empty"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("no NATS server answered at 127.0.0.1:{port} within 5 s")), "{err}");
    drop(listener);
}
