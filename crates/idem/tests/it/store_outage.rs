//! `idem run` rides out an outage of its ledger store: a private `redis-server` with `appendfsync always`
//! killed with SIGKILL and started again on the same directory, a private PostgreSQL stopped and started
//! again. Nothing is failed that never ran, nothing runs twice, every output is in place; an outage longer
//! than `--store-outage-limit` ends the run with exit status 75 and the unfinished items not done, and a rerun
//! finishes them, still running nothing twice. Every command appends one line per execution to a log opened
//! with O_APPEND, so executions are counted exactly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_testkit::{Postgres, Redis};

use crate::common::BIN;

/// The job: `n` items (1..=n), each a 0.2 s command writing its id as its output and one line to
/// `executions.log`.
fn job(n: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let items: String = (1..=n).map(|i| format!("{i}\n")).collect();
    std::fs::write(dir.path().join("items.txt"), items).unwrap();
    std::fs::write(dir.path().join("work.sh"), "sleep 0.2; echo \"$1\" > \"$2\"; echo \"$1\" >> executions.log\n")
        .unwrap();
    dir
}

/// [`job`] with a slower command: it logs its start to `started.log`, sleeps `secs` (a decimal, as `sleep`
/// takes it), then writes its output and its line in `executions.log`.
fn slow_job(n: usize, secs: &str) -> tempfile::TempDir {
    let dir = job(n);
    let script =
        format!("echo \"$1\" >> started.log; sleep {secs}; echo \"$1\" > \"$2\"; echo \"$1\" >> executions.log\n");
    std::fs::write(dir.path().join("work.sh"), script).unwrap();
    dir
}

/// `idem run` of the job on `store` with `--jobs 4`, standard error to `name`.err.
fn runner(dir: &Path, store: &str, extra: &[&str], name: &str) -> Child {
    let extra: Vec<&str> = ["--jobs", "4"].into_iter().chain(extra.iter().copied()).collect();
    runner_with(dir, store, &extra, name)
}

/// `idem run` of the job on `store` with the options `extra`, standard error to `name`.err.
fn runner_with(dir: &Path, store: &str, extra: &[&str], name: &str) -> Child {
    let err = std::fs::File::create(dir.join(format!("{name}.err"))).unwrap();
    Command::new(BIN)
        .current_dir(dir)
        .args(["run", "--items", "items.txt", "--output", "out/{id}.json", "--quiet"])
        .args(["--report", &format!("{name}.json"), "--store", store])
        .args(extra)
        .args(["--", "sh", "work.sh", "{id}", "{out}"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap()
}

/// Executions so far, per item id.
fn executions(dir: &Path) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in std::fs::read_to_string(dir.join("executions.log")).unwrap_or_default().lines() {
        *counts.entry(line.to_owned()).or_insert(0) += 1;
    }
    counts
}

fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < within, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for the runner to exit (at most `within`); its exit code and standard error.
fn finish(dir: &Path, mut child: Child, name: &str, within: Duration) -> (i32, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            let err = std::fs::read_to_string(dir.join(format!("{name}.err"))).unwrap_or_default();
            panic!("the runner did not end within {within:?}:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code().unwrap_or(-1), std::fs::read_to_string(dir.join(format!("{name}.err"))).unwrap())
}

/// The items of a `--report` file by status.
fn statuses(dir: &Path, name: &str) -> BTreeMap<String, usize> {
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.json"))).unwrap()).unwrap();
    let mut by = BTreeMap::new();
    for item in report["items"].as_array().unwrap() {
        *by.entry(item["status"].as_str().unwrap().to_owned()).or_insert(0) += 1;
    }
    by
}

/// Every item of 1..=n executed exactly once, and its output in place.
fn each_once_and_in_place(dir: &Path, n: usize, err: &str) {
    let counts = executions(dir);
    let twice: Vec<_> = counts.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "items executed more than once: {twice:?}\n{err}");
    assert_eq!(counts.len(), n, "items executed: {}\n{err}", counts.len());
    for i in 1..=n {
        let out = std::fs::read_to_string(dir.join(format!("out/{i}.json"))).unwrap_or_default();
        assert_eq!(out, format!("{i}\n"), "output of item {i}");
    }
}

/// The scenario: 60 items, 4 jobs; after 15 executions the store goes `down`, 3 s later it comes
/// `up` again. The run ends with exit status 0, every item done, none executed twice, none failed.
fn an_outage_of_3s_is_ridden_out(store: &str, down: impl FnOnce(), up: impl FnOnce()) {
    const N: usize = 60;
    let dir = job(N);
    let child = runner(dir.path(), store, &[], "run");
    wait_for("15 executions", Duration::from_secs(60), || executions(dir.path()).values().sum::<usize>() >= 15);
    down();
    let at_kill = executions(dir.path()).values().sum::<usize>();
    std::thread::sleep(Duration::from_secs(3));
    up();
    let (code, err) = finish(dir.path(), child, "run", Duration::from_secs(120));
    let statuses = statuses(dir.path(), "run");
    eprintln!("{at_kill} executions when the store went down; report: {statuses:?}\n{err}");
    assert_eq!(code, 0, "{err}");
    assert_eq!(statuses.get("done"), Some(&N), "{statuses:?}");
    assert!(
        err.contains("the ledger store is unavailable"),
        "the outage went unnoticed: the test proved nothing\n{err}"
    );
    each_once_and_in_place(dir.path(), N, &err);
}

/// The throw-away Redis, durable (`appendonly yes`, `appendfsync always`), as a `rediss://` URL.
fn redis_url(redis: &Redis) -> String {
    format!("rediss://localhost:{}?cacert={}", redis.port, redis.pki.ca.display())
}

#[test]
fn a_redis_killed_and_restarted_3s_later_fails_nothing_and_runs_nothing_twice() {
    let Some(redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let redis = std::sync::Mutex::new(redis);
    an_outage_of_3s_is_ridden_out(&url, || redis.lock().unwrap().kill(), || redis.lock().unwrap().start_again());
}

#[test]
fn a_postgres_stopped_for_3s_fails_nothing_and_runs_nothing_twice() {
    let Some(pg) = Postgres::start() else { return };
    let url = pg.url("127.0.0.1", "");
    let pg = std::sync::Mutex::new(pg);
    an_outage_of_3s_is_ridden_out(&url, || pg.lock().unwrap().stop(), || pg.lock().unwrap().start_again());
}

#[test]
fn an_outage_longer_than_the_limit_ends_the_run_with_75_and_a_rerun_finishes_without_duplicates() {
    const N: usize = 60;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = job(N);
    let child = runner(dir.path(), &url, &["--store-outage-limit", "2s"], "first");
    wait_for("15 executions", Duration::from_secs(60), || executions(dir.path()).values().sum::<usize>() >= 15);
    redis.kill();
    let started = Instant::now();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    let took = started.elapsed();
    let first = statuses(dir.path(), "first");
    eprintln!("first run ended {took:?} after the kill; report: {first:?}\n{err}");
    assert_eq!(code, 75, "{err}");
    assert!(took >= Duration::from_secs(2), "it gave up before the limit: {took:?}");
    assert_eq!(first.get("failed"), None, "an item failed for the outage: {first:?}");
    assert!(first.get("store_unavailable").is_some_and(|n| *n > 0), "{first:?}");
    assert_eq!(first.values().sum::<usize>(), N, "every item has a line in the report: {first:?}");
    assert!(err.contains("longer than --store-outage-limit"), "{err}");
    let ran = executions(dir.path());
    assert!(ran.values().all(|c| *c == 1), "executed twice in the first run: {ran:?}");
    redis.start_again();
    let (code, err) = finish(dir.path(), runner(dir.path(), &url, &[], "second"), "second", Duration::from_secs(120));
    eprintln!("second run: {:?}\n{err}", statuses(dir.path(), "second"));
    assert_eq!(code, 0, "{err}");
    each_once_and_in_place(dir.path(), N, &err);
}

/// A Redis stopped with SIGSTOP (a frozen machine: connections stay open, nothing answers) for longer than
/// `--store-outage-limit` 2 s: the run ends with exit status 75 about the limit into the freeze (within 8 s),
/// nothing failed for it; before, operations and lease renewals held unanswered kept it for the client's own
/// timeout (about 13 s). Thawed, a rerun with `--retries 0` finishes every item, none executed twice.
#[test]
fn a_redis_frozen_longer_than_the_limit_ends_the_run_about_the_limit_into_the_freeze() {
    frozen_redis_ends_the_run_near_the_limit(12, &[], Duration::from_millis(800), 2, 8);
}

/// As above with `--lease 3s` and the freeze later in the pair's commands: every item ahead is claimed, so
/// the lease keeper's renewals are all the store is sent. Such an outage counted only from the Redis client's
/// own 10 s response timeout failing one (the run ended 12.6 s into the freeze); a renewal unanswered for the
/// limit now counts as any operation does.
#[test]
fn a_redis_frozen_while_only_lease_renewals_are_sent_ends_the_run_near_the_limit() {
    frozen_redis_ends_the_run_near_the_limit(20, &["--lease", "3s"], Duration::from_millis(1500), 2, 8);
}

/// As above with a 10 s limit, as long as the Redis client's own response timeout: renewals failed by that
/// timeout were counted as an outage only from their answer, not from when they were sent, and the run ended
/// 20.6 s into the freeze (twice the limit); now within 4 s after the limit.
#[test]
fn a_redis_frozen_with_a_limit_as_long_as_the_clients_timeout_ends_the_run_near_the_limit() {
    frozen_redis_ends_the_run_near_the_limit(20, &["--lease", "3s"], Duration::from_millis(1500), 10, 14);
}

/// As above with a 15 s limit, longer than the client's timeout: an operation tried again after that timeout
/// waited a whole limit (or the client's timeout) of its own, not the rest of the outage's, and the run ended
/// 20.6 s into the freeze; now within 4 s after the limit.
#[test]
fn a_redis_frozen_with_a_limit_past_the_clients_timeout_ends_the_run_near_the_limit() {
    frozen_redis_ends_the_run_near_the_limit(20, &["--lease", "3s"], Duration::from_millis(1500), 15, 19);
}

/// `n` items of 2 s with `--jobs 2` and a limit of `limit` seconds, `extra` flags; Redis frozen `into` after
/// the fourth start. The run must end within `within` seconds of the freeze.
fn frozen_redis_ends_the_run_near_the_limit(n: usize, extra: &[&str], into: Duration, limit: u64, within: u64) {
    let Some(redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = slow_job(n, "2");
    let limit_flag = format!("{limit}s");
    let flags: Vec<&str> = ["--jobs", "2", "--store-outage-limit", &limit_flag].iter().chain(extra).copied().collect();
    let child = runner_with(dir.path(), &url, &flags, "first");
    // Frozen in the middle of the second pair of commands: they exit 0 during the freeze.
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    wait_for("4 commands started", Duration::from_secs(60), || started().lines().count() >= 4);
    std::thread::sleep(into);
    redis.freeze();
    let frozen = Instant::now();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    let took = frozen.elapsed();
    redis.thaw();
    let first = statuses(dir.path(), "first");
    eprintln!("first run ended {took:?} into the freeze; report: {first:?}\n{err}");
    assert_eq!(code, 75, "{err}");
    assert!(
        took < Duration::from_secs(within),
        "the run ended {took:?} into the freeze, with a limit of {limit} s\n{err}"
    );
    assert_eq!(first.get("failed"), None, "an item failed for the freeze: {first:?}");
    // No retries: the commands that exited 0 during the freeze were noted, not discarded (a discarded one would
    // be a crashed attempt: failed).
    let rerun = runner(dir.path(), &url, &["--retries", "0"], "second");
    let (code, err) = finish(dir.path(), rerun, "second", Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    each_once_and_in_place(dir.path(), n, &err);
}

/// A runner started while its store is down waits for it, as one that met the outage later would: the store
/// (killed before the run) comes up 2 s after the run started; the run ends with exit status 0 and every item
/// executed once. Before, the run exited 2 at once with "cannot open store …: Connection refused".
#[test]
fn a_run_started_while_redis_is_down_waits_for_it_and_runs_every_item_once() {
    const N: usize = 20;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    redis.kill();
    let dir = job(N);
    let mut child = runner(dir.path(), &url, &[], "run");
    std::thread::sleep(Duration::from_secs(2));
    assert!(child.try_wait().unwrap().is_none(), "the run ended while the store was down");
    assert_eq!(executions(dir.path()).values().sum::<usize>(), 0, "an item ran with no ledger");
    redis.start_again();
    let (code, err) = finish(dir.path(), child, "run", Duration::from_secs(120));
    let statuses = statuses(dir.path(), "run");
    eprintln!("report: {statuses:?}\n{err}");
    assert_eq!(code, 0, "{err}");
    assert_eq!(statuses.get("done"), Some(&N), "{statuses:?}");
    assert!(
        err.contains("the ledger store is unavailable"),
        "the outage went unnoticed: the test proved nothing\n{err}"
    );
    each_once_and_in_place(dir.path(), N, &err);
}

/// A store down at the start for longer than `--store-outage-limit` ends the run with exit status 75 once the
/// limit has passed, with nothing run; a rerun once the store is back runs every item once.
#[test]
fn a_run_started_while_redis_is_down_longer_than_the_limit_exits_75_and_runs_nothing() {
    const N: usize = 10;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    redis.kill();
    let dir = job(N);
    let started = Instant::now();
    let child = runner(dir.path(), &url, &["--store-outage-limit", "1s"], "first");
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    let took = started.elapsed();
    eprintln!("first run ended after {took:?}\n{err}");
    assert_eq!(code, 75, "{err}");
    assert!(took >= Duration::from_secs(1), "it gave up before the limit: {took:?}");
    assert!(err.contains("longer than --store-outage-limit"), "{err}");
    assert_eq!(executions(dir.path()).values().sum::<usize>(), 0, "an item ran with no ledger");
    redis.start_again();
    let (code, err) = finish(dir.path(), runner(dir.path(), &url, &[], "second"), "second", Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    each_once_and_in_place(dir.path(), N, &err);
}

/// A URL that can never work (a Redis port that speaks TLS named with the plain `redis://` scheme: the server
/// resets the connection) is refused at once with exit status 2, not waited for as an outage.
#[test]
fn a_run_on_a_tls_port_named_redis_plain_exits_2_at_once() {
    let Some(redis) = Redis::start_with(true) else { return };
    let dir = job(1);
    let url = format!("redis://localhost:{}", redis.port);
    let child = runner(dir.path(), &url, &["--store-outage-limit", "1m"], "run");
    let (code, err) = finish(dir.path(), child, "run", Duration::from_secs(30));
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("trying again"), "{err}");
}

/// Two runners share one SQLite ledger (`--lease 1s`); mid-run the ledger is locked for 3 s (an exclusive
/// transaction another connection holds, as a backup or a stray `sqlite3` shell would), longer than a lease.
/// Every lease lapses by the ledger's clock meanwhile; once it is unlocked each holder takes its own lease
/// again, and neither runner claims over the other before it could: every item starts exactly once. Before
/// (a lapsed lease claimed by whoever reached the ledger first), 1 to 4 of the 8 items ran twice.
#[test]
fn a_sqlite_ledger_locked_longer_than_the_lease_starts_nothing_twice_across_two_runners() {
    const N: usize = 8;
    let dir = slow_job(N, "2");
    let db = dir.path().join("ledger.db");
    let store = format!("sqlite:{}", db.display());
    let extra = ["--lease", "1s"];
    let a = runner(dir.path(), &store, &extra, "a");
    let b = runner(dir.path(), &store, &extra, "b");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    wait_for("4 commands started", Duration::from_secs(60), || started().lines().count() >= 4);
    std::thread::sleep(Duration::from_millis(300));
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
        std::thread::sleep(Duration::from_secs(3));
        conn.execute_batch("COMMIT").unwrap();
    }
    let (code_a, err_a) = finish(dir.path(), a, "a", Duration::from_secs(120));
    let (code_b, err_b) = finish(dir.path(), b, "b", Duration::from_secs(120));
    let err = format!("a:\n{err_a}\nb:\n{err_b}");
    assert_eq!((code_a, code_b), (0, 0), "{err}");
    let mut starts = BTreeMap::new();
    for id in started().lines() {
        *starts.entry(id.to_owned()).or_insert(0) += 1;
    }
    let twice: Vec<_> = starts.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "items started more than once: {twice:?}\n{err}");
    assert_eq!(starts.len(), N, "items started: {starts:?}\n{err}");
    each_once_and_in_place(dir.path(), N, &err);
}

/// The items of a `--report` file by id: (status, attempts).
fn report_items(dir: &Path, name: &str) -> BTreeMap<String, (String, u64)> {
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.json"))).unwrap()).unwrap();
    let mut items = BTreeMap::new();
    for item in report["items"].as_array().unwrap() {
        let status = item["status"].as_str().unwrap().to_owned();
        items.insert(item["id"].as_str().unwrap().to_owned(), (status, item["attempts"].as_u64().unwrap_or(0)));
    }
    items
}

/// Items claimed ahead of a free slot when the store goes away for longer than the limit never started, and
/// the claim cannot be given back while the store is down: they must spend no attempt. With `--retries 0` the
/// rerun ran them; before (the attempt counted with the claim), it reported them "failed after 1 attempt:
/// crashed" though they never ran.
#[test]
fn claims_ahead_given_up_in_an_outage_past_the_limit_spend_no_attempt() {
    const N: usize = 8;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = slow_job(N, "3");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    let extra = ["--jobs", "2", "--retries", "0", "--lease", "1s", "--store-outage-limit", "1s"];
    let child = runner_with(dir.path(), &url, &extra, "first");
    wait_for("2 commands started", Duration::from_secs(60), || started().lines().count() >= 2);
    // The two claims ahead of the next free slots are made at once; give them time to land.
    std::thread::sleep(Duration::from_millis(500));
    redis.kill();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    assert_eq!(code, 75, "{err}");
    let first: std::collections::BTreeSet<String> = started().lines().map(str::to_owned).collect();
    assert!(first.len() < N, "every item started before the outage: the test proved nothing\n{err}");
    redis.start_again();
    let second = runner_with(dir.path(), &url, &extra, "second");
    let (_, err) = finish(dir.path(), second, "second", Duration::from_secs(120));
    let second = report_items(dir.path(), "second");
    for i in 1..=N {
        let id = i.to_string();
        if first.contains(&id) {
            continue;
        }
        assert_eq!(
            second.get(&id).map(|(status, _)| status.as_str()),
            Some("done"),
            "item {id} never started in the first run, yet the rerun (--retries 0) did not run it: {second:?}\n{err}"
        );
    }
    let ran = executions(dir.path());
    assert!(ran.values().all(|c| *c == 1), "executed twice: {ran:?}\n{err}");
}

/// A count sent to a Redis stopped with SIGSTOP lands when it continues, after the run gave up on its answer
/// (exit 75): the entry then counts an attempt whose command never started. Here with `--jobs 1`: item 2 is
/// claimed ahead while item 1 runs, the store freezes, item 1 exits and item 2's count (its lease fresh, so no
/// fence renewal goes first) is the write left unanswered past the limit. The rerun with `--retries 0` must
/// run item 2, not report it "failed after 1 attempt: crashed" as it did before the holder noted the count.
#[test]
fn a_count_that_lands_after_the_run_gave_up_on_it_spends_no_attempt() {
    const N: usize = 3;
    let Some(redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = slow_job(N, "1");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    let extra = ["--jobs", "1", "--lease", "6s", "--store-outage-limit", "2s"];
    let child = runner_with(dir.path(), &url, &extra, "first");
    wait_for("item 1 started", Duration::from_secs(60), || !started().is_empty());
    // Item 2's claim ahead lands at once; item 1 exits 1 s after its start, during the freeze.
    std::thread::sleep(Duration::from_millis(300));
    redis.freeze();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    redis.thaw();
    assert_eq!(code, 75, "{err}");
    assert_eq!(started().lines().count(), 1, "more than item 1 started: the test proved nothing\n{err}");
    // The queued count (and item 1's done write) are taken as the server continues.
    std::thread::sleep(Duration::from_millis(300));
    let rerun: Vec<&str> = ["--jobs", "1", "--lease", "6s", "--retries", "0"].to_vec();
    let (code, err) =
        finish(dir.path(), runner_with(dir.path(), &url, &rerun, "second"), "second", Duration::from_secs(120));
    let second = report_items(dir.path(), "second");
    eprintln!("second run: {second:?}\n{err}");
    assert_eq!(code, 0, "{second:?}\n{err}");
    each_once_and_in_place(dir.path(), N, &err);
}

/// Commands that finish while the store is out past the limit: their outputs are verified but cannot be put in
/// place behind the fence (the lease cannot be renewed) nor recorded. They stay at their temporary paths with a
/// note of their digest, and the rerun records them done without running them again (`--retries 0`: a crash
/// would fail them). Before, they were discarded: the rerun executed all four a second time.
#[test]
fn commands_finished_in_an_outage_past_the_limit_are_recorded_by_the_rerun_not_run_again() {
    const N: usize = 4;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = slow_job(N, "2.5");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    // The commands end after a third of the lease, so the fence before the rename must renew it, and before
    // four fifths, so no command is stopped for want of a renewal.
    let extra = ["--retries", "0", "--lease", "6s", "--store-outage-limit", "1s"];
    let child = runner(dir.path(), &url, &extra, "first");
    wait_for("4 commands started", Duration::from_secs(60), || started().lines().count() >= N);
    redis.kill();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    assert_eq!(code, 75, "{err}");
    let finished = executions(dir.path()).len();
    eprintln!("first run: {finished} commands finished\n{err}");
    assert_eq!(finished, N, "the commands did not finish during the outage: the test proved nothing\n{err}");
    assert!(!dir.path().join("out/1.json").exists(), "an output was put in place without the fence\n{err}");
    redis.start_again();
    let (code, err) =
        finish(dir.path(), runner(dir.path(), &url, &extra, "second"), "second", Duration::from_secs(120));
    let second = report_items(dir.path(), "second");
    eprintln!("second run: {second:?}\n{err}");
    assert_eq!(code, 0, "{second:?}\n{err}");
    each_once_and_in_place(dir.path(), N, &err);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(".json"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files or notes left behind: {leftovers:?}");
}

/// A rerun that finds an attempt's note but nothing it can vouch for (the noted output deleted, changed, the
/// note garbled) with no attempts left fails the item saying so, not "crashed", and removes the note and the
/// temporary file (before, both stayed until a later claim, and the error said the command crashed though it
/// exited 0); with an attempt more, those items run once again and the untouched one is recorded from its note.
#[test]
fn a_note_whose_output_is_gone_or_changed_fails_the_item_saying_so_and_leaves_nothing() {
    const N: usize = 4;
    let Some(mut redis) = Redis::start_with(true) else { return };
    let url = redis_url(&redis);
    let dir = slow_job(N, "2.5");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    let extra = ["--retries", "0", "--lease", "6s", "--store-outage-limit", "1s"];
    let child = runner(dir.path(), &url, &extra, "first");
    wait_for("4 commands started", Duration::from_secs(60), || started().lines().count() >= N);
    redis.kill();
    let (code, err) = finish(dir.path(), child, "first", Duration::from_secs(60));
    assert_eq!(code, 75, "{err}");
    assert_eq!(executions(dir.path()).len(), N, "the commands did not finish in the outage: nothing to test\n{err}");
    redis.start_again();
    let out = dir.path().join("out");
    let named = |id: &str, suffix: &str| -> PathBuf {
        let prefix = format!(".{id}.json.");
        let found = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with(&prefix) && name.ends_with(suffix)
        });
        found.unwrap_or_else(|| panic!("no {suffix} for item {id}"))
    };
    std::fs::remove_file(named("1", ".idem-tmp")).unwrap();
    std::fs::write(named("2", ".idem-unrecorded"), "garbage\n").unwrap();
    let changed = named("3", ".idem-tmp");
    std::fs::write(&changed, "3 changed\n").unwrap();

    let (code, err) =
        finish(dir.path(), runner(dir.path(), &url, &extra, "second"), "second", Duration::from_secs(120));
    assert_eq!(code, 1, "{err}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("second.json")).unwrap()).unwrap();
    let items = report["items"].as_array().unwrap();
    let of = |id: &str| items.iter().find(|i| i["id"] == id).unwrap_or_else(|| panic!("{id} not in {report}"));
    for (id, why) in [("1", "the output it noted is gone"), ("2", "its note does not hold a digest"), ("3", "changed")]
    {
        let error = of(id)["last_error"].as_str().unwrap_or_default().to_owned();
        assert_eq!(of(id)["status"], "failed", "{id}: {report}");
        assert!(error.contains("exited 0 but was left unrecorded") && error.contains(why), "{id}: {error}");
    }
    assert_eq!(of("4")["status"], "adopted", "{report}");
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.ends_with(".json"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files or notes left behind: {leftovers:?}");

    let more = ["--retries", "1", "--lease", "6s"];
    let (code, err) = finish(dir.path(), runner(dir.path(), &url, &more, "third"), "third", Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    let ran = executions(dir.path());
    let twice: BTreeMap<String, usize> =
        [("1", 2), ("2", 2), ("3", 2), ("4", 1)].map(|(i, n)| (i.to_owned(), n)).into();
    assert_eq!(ran, twice, "{err}");
}

/// `--store-outage-limit` applies to a SQLite ledger another connection keeps locked (a backup, a stray
/// `sqlite3` shell): its reads still succeed (WAL) while every write waits out the busy timeout and is then
/// refused. Locked for 25 s with a limit of 2 s, the run ends with exit status 75 about the limit into the lock
/// (within 8 s); before, reads kept resetting the outage and the run waited for the lock however long it lasted,
/// and then operations and renewals held by the lock (and a connection opened on a runtime thread, which stalled
/// the runner's other tasks for SQLite's 10 s busy timeout) kept it 10 s or more, up to the unlock. The commands
/// that exited 0 meanwhile are noted, not discarded: a rerun after the lock is gone with `--retries 0` (a
/// discarded one would be a crashed attempt: failed) finishes every item, none executed twice.
#[test]
fn a_sqlite_ledger_locked_longer_than_the_limit_ends_the_run_with_75() {
    const N: usize = 6;
    let dir = slow_job(N, "2");
    let db = dir.path().join("ledger.db");
    let store = format!("sqlite:{}", db.display());
    let extra = ["--jobs", "2", "--store-outage-limit", "2s"];
    let mut child = runner_with(dir.path(), &store, &extra, "first");
    let started = || std::fs::read_to_string(dir.path().join("started.log")).unwrap_or_default();
    // Locked in the middle of the second pair of commands: they exit 0 during the lock.
    wait_for("4 commands started", Duration::from_secs(60), || started().lines().count() >= 4);
    std::thread::sleep(Duration::from_millis(800));
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let locked = Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if locked.elapsed() > Duration::from_secs(25) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let ended = locked.elapsed();
    conn.execute_batch("COMMIT").unwrap();
    drop(conn);
    let err = std::fs::read_to_string(dir.path().join("first.err")).unwrap();
    if code.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    eprintln!("the first run ended {:?} after the lock: {code:?}\n{err}", locked.elapsed());
    assert_eq!(code, Some(75), "the run did not give up while the ledger stayed locked\n{err}");
    assert!(err.contains("longer than --store-outage-limit"), "{err}");
    assert!(ended < Duration::from_secs(8), "the run ended {ended:?} into the lock, with a limit of 2 s\n{err}");
    let rerun = runner(dir.path(), &store, &["--retries", "0"], "second");
    let (code, err) = finish(dir.path(), rerun, "second", Duration::from_secs(120));
    assert_eq!(code, 0, "{err}");
    each_once_and_in_place(dir.path(), N, &err);
}

/// Sentinels that name no master (the master and its one replica down: flagged down, nobody to promote) are
/// an outage, as a failover in progress is, not a bad URL: `idem once` exits 75 with nothing run, `idem run`
/// waits for the store up to `--store-outage-limit` and exits 75, `idem serve` answers 503. All three exited 2
/// ("Master with given name not found") before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_naming_no_master_are_an_outage_for_once_run_and_serve() {
    let Some(mut set) = idem_testkit::RedisSentinel::start_with_replicas(1) else { return };
    let url = set.url("");
    let replica = set.replica_ports[0];
    set.kill(replica);
    set.kill_primary();
    let dir = job(3);
    let ran = dir.path().join("ran");
    let once = || {
        let out = Command::new(BIN)
            .args(["once", "--store", &url, "--name", "j", "--every", "1h", "--", "touch", ran.to_str().unwrap()])
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // Until the Sentinels flag the master down they name it and the connection is refused; either way 75.
    wait_for("the Sentinels to name no master", Duration::from_secs(30), || {
        let (code, stderr) = once();
        assert_eq!(code, Some(75), "{stderr}");
        assert!(stderr.contains("nothing ran"), "{stderr}");
        // Said as the master being away, with its address, not as a name not found (which reads as a typo).
        stderr.contains("the Sentinels monitor master \"idem\" at 127.0.0.1:")
            && stderr.contains("does not answer as a master")
    });
    assert!(!ran.exists(), "the command ran");
    let started = Instant::now();
    let (code, err) = finish(
        dir.path(),
        runner(dir.path(), &url, &["--store-outage-limit", "2s"], "run"),
        "run",
        Duration::from_secs(60),
    );
    assert_eq!(code, 75, "{err}");
    assert!(started.elapsed() >= Duration::from_secs(2), "gave up before the limit: {err}");
    assert_eq!(executions(dir.path()).len(), 0, "{err}");
    let s = crate::common::Server::start(&["--listen", "127.0.0.1:0", "--store", &url], &[]);
    let r = crate::common::client().put(format!("{}/v1/kv/k", s.url)).body("v").send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
    // The process serves (liveness) while the store is away (readiness).
    let health = crate::common::client().get(format!("{}/healthz", s.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let ready = crate::common::client().get(format!("{}/readyz", s.url)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
}
