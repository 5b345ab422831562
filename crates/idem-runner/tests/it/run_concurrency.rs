//! Two `run`s of one job at once on one ledger (two runners started by hand, or by cron, on one machine): each
//! item is executed exactly once between them, counted from the commands' own log: N distinct items, N
//! executions, 0 duplicates, 0 lost. On a [`MemoryStore`] and on the SQLite store `idem run` keeps by default
//! (here one store in this process; two processes sharing its file take turns with it, which only the `idem`
//! binary's tests can show).

use std::collections::BTreeMap;

use idem_runner::{RunConfig, RunStatus, Stop, Summary};
use idem_store::Store;

use super::run_harness::{Job, finished, ids, start, strs};

/// A moment of work per item, so the two runners' claims interleave; each execution also logs which runner
/// ran it (`$3`).
const SLOWISH_JSON: &str = r#"echo "$1 $3" >> by; sleep 0.02; printf '{"id": "%s", "ok": true}' "$1" > "$2""#;

/// Runner `who`'s configuration of the job: 4 job slots, its name passed to the command as `$3`.
fn runner(job: &Job, who: &str) -> RunConfig {
    let mut cfg = job.cfg.clone();
    cfg.jobs = 4;
    cfg.command.push(who.to_owned());
    cfg.report = Some(job.path(&format!("{who}.json")));
    cfg
}

/// Runs runners `a` and `b` of `job` at once on `store`; asserts each item ran exactly once between them, both
/// ran some, and every output is in place.
async fn overlapping_runners<S: Store + Clone>(job: &Job, store: S, n: usize) {
    let a = start(store.clone(), runner(job, "a"), Stop::new());
    let b = start(store, runner(job, "b"), Stop::new());
    let (a, b): (Summary, Summary) = (finished(a).await, finished(b).await);
    for (who, summary) in [("a", &a), ("b", &b)] {
        assert_eq!(summary.status(), RunStatus::AllDone, "runner {who}: {}", summary.render());
    }
    let log = job.log();
    let per = job.executions();
    let (distinct, duplicated) = (per.len(), per.values().filter(|&&n| n > 1).count());
    assert_eq!((distinct, log.len(), duplicated), (n, n, 0), "N distinct items, N executions, 0 duplicates");
    assert_eq!(a.executions + b.executions, n as u64);
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for line in std::fs::read_to_string(job.path("by")).unwrap().lines() {
        *by.entry(line.split_once(' ').unwrap().1.to_owned()).or_default() += 1;
    }
    eprintln!("runner a executed {:?}, runner b {:?}", by.get("a"), by.get("b"));
    let ran = |s: &Summary| Some(s.executions as usize).filter(|&n| n > 0);
    assert_eq!((by.get("a").copied(), by.get("b").copied()), (ran(&a), ran(&b)), "each runner's count is its own");
    assert!(
        a.executions > 0 && b.executions > 0,
        "the runners did not overlap: a {}, b {}",
        a.executions,
        b.executions
    );
    assert_eq!(job.out_files().len(), n, "0 lost: one output per item");
}

/// Two runners of 500 items at once on one [`MemoryStore`]: every item executed once in all, by one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_runners_on_one_memory_ledger_execute_each_item_once() {
    let ids = ids(500);
    let job = Job::new(&strs(&ids), SLOWISH_JSON);
    overlapping_runners(&job, job.store.clone(), 500).await;
}

/// The same on one SQLite ledger (WAL, one writer thread), whose conditional writes are the fencing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_runners_on_one_sqlite_ledger_execute_each_item_once() {
    let ids = ids(500);
    let job = Job::new(&strs(&ids), SLOWISH_JSON);
    let sqlite = idem_sqlite::SqliteStore::open(job.path("ledger.db"), idem_store::Limits::default()).unwrap();
    overlapping_runners(&job, sqlite.clone(), 500).await;
    sqlite.close().await;
}
