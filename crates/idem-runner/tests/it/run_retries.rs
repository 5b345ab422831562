//! `run`'s retries: how many attempts an item gets (`--retries`, counted across runs), the pause before each
//! (`--retry-delay`, doubling), and which failures never make an item poison (transient ones). In this process
//! on a [`MemoryStore`] ([`super::run_harness`]): an outage's length and a delay across runs on tokio's paused
//! clock (the commands being instant), the doubling in real time (see its test).

use std::time::Duration;

use idem_core::ledger::Entry;
use idem_runner::{RunStatus, Stop};
use idem_store::MemoryStore;

use super::run_harness::{EntryWrite, Job, WRITE_JSON, finished, start, strs, within};

/// Raising `--retries` gives each item out of attempts exactly that many more: attempts are counted across
/// runs and the limit is the current run's. The summary names each with its last error and says which
/// `--retries` gives every one of them another; lowering the limit resets nothing; forgetting the items starts
/// their count afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_retries_gives_items_out_of_attempts_exactly_that_many_more() {
    // Items 1..=50; the multiples of 11 fail with another exit status on every attempt (never poison).
    let ids: Vec<String> = (1..=50).map(|i| i.to_string()).collect();
    let script = format!(
        r#"if [ $(($1 % 11)) -eq 0 ]; then echo "failure number $IDEM_ATTEMPT" >&2; exit $((10 + IDEM_ATTEMPT)); fi
{WRITE_JSON}"#
    );
    let mut job = Job::new(&strs(&ids), &script);
    job.cfg.jobs = 4;
    // No pause between attempts: the pauses are retries_wait_retry_delay_doubling's subject.
    job.cfg.retry_delay = Duration::ZERO;
    let failing = ["11", "22", "33", "44"];
    let attempts_of = |job: &Job| failing.map(|id| job.executions()[id]);
    // The default --retries 3 allows 4 attempts in all.
    let first = job.run().await;
    assert_eq!((first.done, first.failed, first.status()), (46, 4, RunStatus::Failed));
    assert_eq!((job.log().len(), attempts_of(&job)), (46 + 4 * 4, [4; 4]));
    let said = first.render();
    assert!(said.contains(": 46 done now, 0 already done, 0 adopted, 4 failed, 0 poison, 0 not done; 62 commands ran"));
    assert!(said.contains("failed item 11 after 4 attempts: exit 14: failure number 4\n"), "{said}");
    let hint = format!(
        "4 items out of attempts (--retries 3 allows 4 in all, counted across runs): rerun with --retries 4 to give \
         each one more, or start their count afresh with `idem runs forget --output '{}' 11 22 33 44`\n",
        job.cfg.output
    );
    assert!(said.contains(&hint), "{said}");
    // The same limit again: nothing runs, and the summary says the same.
    let again = job.run().await;
    assert_eq!((again.executions, job.log().len()), (0, 62));
    assert!(again.render().contains(&hint), "{}", again.render());
    // --retries 6 allows 7 in all: exactly 3 more each.
    job.cfg.retries = 6;
    let raised = job.run().await;
    assert_eq!((raised.executions, attempts_of(&job)), (12, [7; 4]));
    let said = raised.render();
    assert!(said.contains(": 0 done now, 46 already done, 0 adopted, 4 failed, 0 poison, 0 not done; 12 commands ran"));
    assert!(said.contains("failed item 44 after 7 attempts: exit 17: failure number 7\n"), "{said}");
    assert!(said.contains("(--retries 6 allows 7 in all, counted across runs): rerun with --retries 7 to"), "{said}");
    // Lowering the limit resets nothing: still 7 used, and --retries 7 is still the value that gives more.
    job.cfg.retries = 1;
    let lowered = job.run().await;
    assert_eq!((lowered.executions, lowered.failed), (0, 4));
    let said = lowered.render();
    assert!(said.contains("(--retries 1 allows 2 in all, counted across runs): rerun with --retries 7 to"), "{said}");
    // Forgotten, their count starts afresh: --retries 0 then gives one attempt each.
    let forget = failing.map(String::from);
    assert!(idem_runner::forget(&job.store, &job.job(), Some(&job.cfg.output), &forget).await.unwrap().is_empty());
    job.cfg.retries = 0;
    let afresh = job.run().await;
    assert_eq!((afresh.executions, afresh.failed, afresh.skipped), (4, 4, 46));
    assert_eq!(attempts_of(&job), [8; 4]);
    assert!(afresh.render().contains("failed item 33 after 1 attempt: exit 11: failure number 1\n"));
}

/// The wall-clock milliseconds between the end of attempt `failed` and the claim of the next, from the ledger's
/// own stamps.
fn pause_after(history: &[Entry], failed: u32) -> u64 {
    let ended = history.iter().find_map(|e| match e {
        Entry::Failed { attempts, finished_at_ms, .. } if *attempts == failed => Some(*finished_at_ms),
        _ => None,
    });
    let next = history.iter().find_map(|e| match e {
        Entry::Running { attempt, started_at_ms, .. } if *attempt == failed + 1 => Some(*started_at_ms),
        _ => None,
    });
    next.unwrap() - ended.unwrap()
}

/// A retried item waits `--retry-delay` before its next attempt, doubled for each later one (drawn up to half
/// again as long, never under it), so a sink down for a moment is not met again within milliseconds. Real
/// time: on a paused clock the runner's wall-clock floor on a retry (`finished_at_ms`, which a paused clock
/// does not move) adds another delay to each pause, and an undoubled pause would pass for a doubled one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_wait_retry_delay_doubling() {
    // Fails its first 2 attempts (two different errors, so never poison), then succeeds.
    let script = r#"case $IDEM_ATTEMPT in
1) echo 'connection refused' >&2; exit 1;;
2) echo 'service unavailable' >&2; exit 1;;
esac"#;
    let mut job = Job::named("flaky", &["a"], script);
    job.cfg.retry_delay = Duration::from_millis(300);
    let summary = job.run().await;
    assert_eq!((summary.done, summary.executions, summary.status()), (1, 3, RunStatus::AllDone));
    assert_eq!((job.status_of("a"), job.reported("a")["attempts"].as_u64()), ("done".into(), Some(3)));
    let history = job.history("a");
    // Milliseconds on both sides, each rounded down: 1 ms of slack.
    let (first, second) = (pause_after(&history, 1), pause_after(&history, 2));
    assert!(first + 1 >= 300, "retried {first} ms after the first failure, under --retry-delay 300ms");
    assert!(second + 1 >= 600, "retried {second} ms after the second failure, under twice the delay");
}

/// A sink down for less than `--retry-delay` (the default 1 s) never makes an item poison, though it fails
/// each attempt the same way: the retry comes after the sink is back. On tokio's paused clock, the sink is down
/// for exactly 300 ms after the first failure.
#[tokio::test(start_paused = true)]
async fn a_brief_outage_shorter_than_the_retry_delay_is_not_poison() {
    let script = "[ -e down ] && { echo 'sink: not yet' >&2; exit 1; }; exit 0";
    let job = Job::named_on(MemoryStore::with_tokio_clock(), "outage", &["a"], script);
    std::fs::write(job.path("down"), "").unwrap();
    let run = start(job.store.clone(), job.cfg.clone(), Stop::new());
    let key = job.key("a");
    let failed = within("the first failure", job.store.write_of(|w| w.key == key && is_failed(w))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::remove_file(job.path("down")).unwrap();
    let back = tokio::time::Instant::now();
    let summary = finished(run).await;
    assert_eq!(
        (summary.done, summary.executions, summary.status()),
        (1, 2, RunStatus::AllDone),
        "{}",
        summary.render()
    );
    let retry = job.store.history(&key).into_iter().find(|w| matches!(w.entry, Entry::Running { attempt: 2, .. }));
    let retry = retry.expect("the retry's claim");
    assert!(retry.at >= back, "retried before the sink was back");
    assert!(retry.at - failed.at >= Duration::from_secs(1), "retried under --retry-delay after the failure");
}

fn is_failed(w: &EntryWrite) -> bool {
    matches!(w.entry, Entry::Failed { .. })
}

/// Two attempts that meet the same error are at least `--retry-delay` apart also across runs: a run stopped
/// (Ctrl-C) during the pause after the first failure, then run again at once, waits out the rest of the delay
/// before the second attempt (before, it ran at once and the item turned poison within milliseconds of the
/// first failure). On tokio's paused clock, a delay of a minute.
#[tokio::test(start_paused = true)]
async fn a_rerun_waits_out_the_retry_delay_of_a_failure_before_retrying() {
    let mut job = Job::named_on(MemoryStore::with_tokio_clock(), "spaced", &["a"], "echo boom >&2; exit 1");
    job.cfg.retry_delay = Duration::from_secs(60);
    let stop = Stop::new();
    let run = start(job.store.clone(), job.cfg.clone(), stop.clone());
    let key = job.key("a");
    let failed = within("the first failure", job.store.write_of(|w| w.key == key && is_failed(w))).await;
    // The run is in its pause before the retry (the clock has not moved since the failure): Ctrl-C.
    stop.request();
    let first = finished(run).await;
    assert_eq!((first.executions, first.not_done, first.status()), (1, 1, RunStatus::Interrupted));
    let rerun = job.run().await;
    assert_eq!((rerun.executions, rerun.status()), (1, RunStatus::Poison), "the same error twice is still poison");
    let history = job.store.history(&key);
    let retry = history.iter().find(|w| matches!(w.entry, Entry::Running { attempt: 2, .. })).unwrap();
    // The rerun waited the delay less the wall-clock time since the failure (the ledger's stamps, which a
    // paused clock does not move), on tokio's clock.
    let waited = retry.at - failed.at;
    let wall = pause_after(&history.iter().map(|w| w.entry.clone()).collect::<Vec<_>>(), 1);
    assert!(
        waited + Duration::from_millis(wall + 1) >= Duration::from_secs(60),
        "retried {waited:?} (tokio) and {wall} ms (wall) after the first failure, under --retry-delay 1m"
    );
}

/// A transient failure (curl's "Connection refused", or exit 75, EX_TEMPFAIL) met again does not make an item
/// poison: it spends retries and never counts as the same error twice. Five items whose first two attempts
/// meet a sink that is down: with `--retries 3`, 15 executions and 5 done at attempt 3; with `--retries 1` out
/// of attempts (failed, not poison), and a rerun with `--retries 3` finishes them. A non-transient error twice
/// is still poison (run_poison).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_error_met_again_is_not_poison() {
    let refused = "echo 'curl: (7) Failed to connect to 127.0.0.1 port 9 after 0 ms: Connection refused' >&2; exit 7";
    let tempfail = "echo 'sink says: later' >&2; exit 75";
    let ids = ["1", "2", "3", "4", "5"];
    for (name, fail) in [("refused", refused), ("tempfail", tempfail)] {
        // Per item, its executions counted in the log: the first two fail.
        let script = format!(r#"n=$(grep -cx "$1" log); [ "$n" -le 2 ] && {{ {fail}; }}; exit 0"#);
        let mut job = Job::named(name, &ids, &script);
        job.cfg.retry_delay = Duration::ZERO;
        if name == "tempfail" {
            job.cfg.retries = 1;
            let out_of_attempts = job.run().await;
            assert_eq!(out_of_attempts.status(), RunStatus::Failed, "{name}: out of attempts, not poison");
            assert_eq!((out_of_attempts.failed, out_of_attempts.poison.len(), job.log().len()), (5, 0, 10));
            job.cfg.retries = 3;
            let rerun = job.run().await;
            assert_eq!((rerun.done, rerun.status(), job.log().len()), (5, RunStatus::AllDone, 15), "{name}");
            continue;
        }
        let summary = job.run().await;
        assert_eq!((summary.done, summary.poison.len(), summary.status()), (5, 0, RunStatus::AllDone), "{name}");
        assert_eq!(job.log().len(), 15, "{name}: 5 items, 3 executions each");
        for id in ids {
            assert_eq!(job.reported(id)["attempts"], 3, "{name}: {}", job.reported(id));
        }
    }
}
