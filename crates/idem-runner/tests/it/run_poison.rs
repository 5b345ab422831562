//! `run` and poison items (the same error fingerprint twice): a new one halts the run (`--on-poison halt`) or
//! is passed by (`skip`); one found earlier is skipped without halting; it stays poison until forgotten. In this
//! process on a [`MemoryStore`] ([`super::run_harness`]).

use std::time::{Duration, Instant};

use idem_core::ledger::Entry;
use idem_runner::{OnPoison, RunStatus, Stop};

use super::run_harness::{EntryWrite, Job, WRITE_JSON, finished, ids, start, strs, within};

/// The item `bad` fails with a message whose numbers change each time (the fingerprint ignores them; a
/// transient-looking one would never turn poison); the others write their output.
fn poison_script() -> String {
    format!(
        r#"if [ "$1" = bad ]; then echo "reading db-$$ at $(date +%s%N): record checksum mismatch" >&2; exit 2; fi
{WRITE_JSON}"#
    )
}

/// `good` ids with `bad` after the first `before` of them.
fn with_bad(good: usize, before: usize) -> Vec<String> {
    let mut all = ids(good);
    all.insert(before, "bad".to_owned());
    all
}

/// An item that fails the same way twice turns poison, and (`--on-poison halt`, the default) nothing new
/// starts: with one job slot, items run in input order and the failing item keeps its slot for its retry, so
/// the items before it are done, it ran twice back to back, and the rest are not done. The report and the
/// summary name it. A rerun (here `--on-poison skip`, 4 slots) runs exactly the items not done: a poison item
/// stays poison until forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_item_halts_the_run_and_the_report_names_it() {
    let all = with_bad(20, 3);
    let mut job = Job::new(&strs(&all), &poison_script());
    // No pause before the retry: pauses are run_retries' subject.
    job.cfg.retry_delay = Duration::ZERO;
    let summary = job.run().await;
    assert_eq!(job.log(), ["item-00000", "item-00001", "item-00002", "bad", "bad"]);
    assert_eq!((summary.done, summary.not_done, summary.halted, summary.status()), (3, 17, true, RunStatus::Poison));
    assert_eq!(summary.poison.len(), 1);
    let said = summary.render();
    assert!(said.contains("poison item bad: exit 2: reading db-"), "{said}");
    let report = job.report();
    assert_eq!(report["summary"]["poison"][0]["id"], "bad");
    assert_eq!((report["summary"]["done"].as_u64(), report["summary"]["not_done"].as_u64()), (Some(3), Some(17)));
    let bad = job.reported("bad");
    assert_eq!((bad["status"].as_str(), bad["attempts"].as_u64()), (Some("poison"), Some(2)), "{bad}");
    assert!(matches!(job.entry("bad").await, Some(Entry::Failed { poison: true, attempts: 2, .. })));
    assert_eq!(job.out_files().len(), 3);
    job.cfg.jobs = 4;
    job.cfg.on_poison = OnPoison::Skip;
    let rerun = job.run().await;
    assert_eq!((rerun.done, rerun.skipped, rerun.executions, rerun.status()), (17, 3, 17, RunStatus::Poison));
    assert_eq!(job.log().len(), 5 + 17, "the rerun ran only the items not done");
    assert_eq!(job.executions()["bad"], 2);
}

/// With `--on-poison skip` a poison item is recorded and the others all finish. Forgetting it (`idem runs
/// forget`) makes it run again, and fail twice again; forgetting a done item removes its output too, so it is
/// redone rather than adopted; an id the job does not know touches no file, even one the template would place
/// outside the job's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_item_is_skipped_with_on_poison_skip_and_runs_again_once_forgotten() {
    let all = with_bad(20, 0);
    let mut job = Job::new(&strs(&all), &poison_script());
    job.cfg.jobs = 2;
    job.cfg.on_poison = OnPoison::Skip;
    job.cfg.retry_delay = Duration::ZERO;
    let summary = job.run().await;
    assert_eq!((summary.done, summary.halted, summary.status()), (20, false, RunStatus::Poison));
    let per = job.executions();
    assert_eq!((per["bad"], per.len(), job.log().len()), (2, 21, 22));
    assert_eq!(job.out_files().len(), 20);
    assert_eq!(job.report()["summary"]["poison"][0]["id"], "bad");
    std::fs::write(job.path("important.json"), "{}").unwrap();
    let forget = ["bad", "item-00003", "../important", "item-00003"].map(String::from);
    let unknown = idem_runner::forget(&job.store, &job.job(), Some(&job.cfg.output), &forget).await.unwrap();
    assert_eq!(unknown, ["../important"]);
    assert!(!job.path("out/item-00003.json").exists(), "the forgotten item's output is still there");
    assert!(job.path("important.json").exists(), "forget deleted a file outside the job");
    let rerun = job.run().await;
    assert_eq!((rerun.done, rerun.executions, rerun.status()), (1, 3, RunStatus::Poison));
    assert_eq!((job.log().len(), job.executions()["item-00003"], job.executions()["bad"]), (25, 2, 4));
}

/// A poison item found by an earlier run is a known fact, not a new failure: a rerun with the default
/// `--on-poison halt` skips it and does exactly the rest without halting, and still ends with the poison
/// status; with nothing left but it, nothing runs. Once its cause is fixed, forgetting it (as the summary
/// suggests) runs it once more and the job is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_skips_known_poison_items_and_does_the_rest() {
    let all = with_bad(49, 5);
    let mut job = Job::new(&strs(&all), &poison_script());
    job.cfg.retry_delay = Duration::ZERO;
    let first = job.run().await;
    assert_eq!((first.done, first.not_done, first.halted, first.status()), (5, 44, true, RunStatus::Poison));
    let said = first.render();
    assert!(
        said.contains(": 5 done now, 0 already done, 0 adopted, 0 failed, 1 poison, 44 not done; 7 commands ran\n")
    );
    assert!(said.contains("poison item bad: exit 2: reading db-"), "{said}");
    let forget = format!("`idem runs forget --output '{}' bad` retries them\n", job.cfg.output);
    assert!(said.contains(&forget), "{said}");
    assert!(
        said.contains(
            "the run halted when an item turned poison, leaving 44 items not done: run it again to do them (poison \
             items found earlier are skipped, not halted on), or add --on-poison skip to go on past new ones\n"
        ),
        "{said}"
    );
    job.cfg.jobs = 4;
    let rerun = job.run().await;
    assert_eq!((rerun.done, rerun.skipped, rerun.not_done, rerun.halted), (44, 5, 0, false));
    assert_eq!(rerun.status(), RunStatus::Poison);
    let said = rerun.render();
    assert!(
        said.contains(": 44 done now, 5 already done, 0 adopted, 0 failed, 1 poison, 0 not done; 44 commands ran\n")
    );
    assert!(said.contains(&forget) && !said.contains("halted"), "{said}");
    assert_eq!((job.log().len(), job.executions()["bad"]), (51, 2));
    let nothing_left = job.run().await;
    assert_eq!((nothing_left.executions, nothing_left.status()), (0, RunStatus::Poison));
    // The cause fixed: a command that no longer fails it.
    job.cfg.command[2] = job.cfg.command[2].replace(r#"[ "$1" = bad ]"#, "false");
    let unknown = idem_runner::forget(&job.store, &job.job(), Some(&job.cfg.output), &["bad".into()]).await.unwrap();
    assert!(unknown.is_empty());
    let fixed = job.run().await;
    assert_eq!((fixed.done, fixed.skipped, fixed.status()), (1, 49, RunStatus::AllDone));
    assert_eq!(job.log().len(), 52);
    assert_eq!(job.out_files().len(), 50);
}

/// `--timeout` kills an attempt that runs too long; its error is `timeout`, the same fingerprint each time, so
/// two timeouts in a row make the item poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_kills_the_attempt_with_a_timeout_fingerprint() {
    let mut job = Job::new(&["a"], "exec sleep 30");
    job.cfg.timeout = Some(Duration::from_millis(500));
    job.cfg.retry_delay = Duration::ZERO;
    let started = Instant::now();
    let summary = job.run().await;
    assert!(started.elapsed() < Duration::from_secs(20), "the attempts were not killed: {:?}", started.elapsed());
    assert_eq!((summary.executions, summary.status()), (2, RunStatus::Poison));
    assert_eq!(job.reported("a")["last_error"], "timeout");
    assert!(matches!(job.entry("a").await, Some(Entry::Failed { poison: true, attempts: 2, .. })));
}

/// An item whose command ran and whose `--check` then failed, and which is not retried because a poison item
/// halted the run meanwhile, is reported as its entry says: failed, 1 attempt, the check's error (it was
/// reported `not_started` with 0 attempts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_not_retried_after_a_halt_is_reported_failed_with_its_attempts() {
    // Every check fails (nothing makes effects/ID). p's command exits 0 twice, failing its check the same way:
    // poison, and the run halts. s's command ends once the test saw p turn poison.
    let mut job =
        Job::named("halt", &["p", "s"], r#"[ "$1" = p ] && exit 0; until [ -e release ]; do sleep 0.01; done"#);
    job.cfg.jobs = 2;
    job.cfg.check = Some(format!("test -e {}/effects/{{id}}", job.dir.path().display()));
    // s's failure would wait this long before its retry: the halt, set as p's poison is recorded, is seen first.
    job.cfg.retry_delay = Duration::from_millis(200);
    let run = start(job.store.clone(), job.cfg.clone(), Stop::new());
    let p = job.key("p");
    let poison = |w: &EntryWrite| w.key == p && matches!(w.entry, Entry::Failed { poison: true, .. });
    within("p to turn poison", job.store.write_of(poison)).await;
    std::fs::write(job.path("release"), "").unwrap();
    let summary = finished(run).await;
    let mut log = job.log();
    log.sort();
    assert_eq!(log, ["p", "p", "s"]);
    assert_eq!((summary.poison.len(), summary.not_done, summary.halted), (1, 1, true));
    assert!(summary.render().contains("1 poison, 1 not done"), "{}", summary.render());
    let s = job.reported("s");
    assert_eq!((s["status"].as_str(), s["attempts"].as_u64()), (Some("failed"), Some(1)), "{s}");
    assert_eq!(s["last_error"], "check exit 1 after the command exited 0", "{s}");
    let status = idem_runner::status(&job.store, "halt").await.unwrap();
    assert_eq!((status.done, status.running, status.failed, status.poison), (0, 0, 1, 1));
}
