//! `run` and an item's output file: when a command's result counts (written to `{out}`, with the fields and
//! the verification asked for), when an output found in place is adopted or redone, what a rerun of done items
//! does, and in which order one job slot takes the items. In this process on a [`MemoryStore`]
//! ([`super::run_harness`]); what only processes can show stays in the `idem` binary's tests.

use std::collections::BTreeSet;

use idem_core::ledger::Entry;
use idem_runner::{Error, RunStatus, Stop};
use idem_store::Store;

use super::run_harness::{Job, WRITE_JSON, ids, line, start, strs};

/// Asserts that `out/` holds exactly one output per id, each valid JSON naming its item, and no temporary file.
fn assert_outputs_valid(job: &Job, ids: &[&str]) {
    let expected: BTreeSet<String> = ids.iter().map(|id| format!("{id}.json")).collect();
    assert_eq!(job.out_files(), expected, "exactly one output per item, no temporary files");
    for id in ids {
        let out = std::fs::read(job.path(&format!("out/{id}.json"))).unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{id}.json is not valid JSON: {e}"));
        assert_eq!(v["id"], *id);
    }
}

/// A second run of a job whose items are all done, with their outputs as recorded, runs no command: every item
/// is skipped, and the summary says "nothing to do" once instead of the counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_of_finished_items_executes_nothing_and_says_so() {
    let ids = ids(300);
    let mut job = Job::new(&strs(&ids), WRITE_JSON);
    job.cfg.jobs = 8;
    let first = job.run().await;
    assert_eq!((first.done, first.executions, first.status()), (300, 300, RunStatus::AllDone));
    assert!(job.executions().values().all(|&n| n == 1), "an item ran twice");
    let again = job.run().await;
    assert_eq!((again.skipped, again.executions, again.status()), (300, 0, RunStatus::AllDone));
    assert_eq!(job.log().len(), 300, "the second run executed something");
    let said = again.render();
    assert!(said.contains("nothing to do: all 300 items already done") && said.contains("ran 0 commands"), "{said}");
    assert!(!said.contains("items in"), "said once, not twice: {said}");
    let report = job.report();
    assert_eq!((report["summary"]["skipped"].as_u64(), report["summary"]["executions"].as_u64()), (Some(300), Some(0)));
    assert_outputs_valid(&job, &strs(&ids));
}

/// With one job slot (`--jobs 1`) items run in input order, as GNU parallel's `-j1` does, though each item's
/// first steps (its ledger read, its output's check) take as long as they take: items queue for a claim in
/// their turn. So do the items a rerun redoes, however differently they are judged: a truncated output (read and
/// refused), a missing one (not read), a forgotten item (no entry, no output: new).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_1_runs_items_and_a_rerun_redoes_them_in_input_order() {
    let ids = ids(300);
    let job = Job::new(&strs(&ids), WRITE_JSON);
    let first = job.run().await;
    assert_eq!(first.status(), RunStatus::AllDone);
    assert_eq!(job.log(), ids, "the first run's order");
    let (mut redo, mut forgotten) = (Vec::new(), Vec::new());
    for (i, id) in ids.iter().enumerate() {
        let out = job.path(&format!("out/{id}.json"));
        match i % 4 {
            0 => std::fs::write(&out, "{\"id\": ").unwrap(),
            1 => std::fs::remove_file(&out).unwrap(),
            2 => forgotten.push(id.clone()),
            _ => continue,
        }
        redo.push(id.clone());
    }
    let unknown = idem_runner::forget(&job.store, &job.job(), Some(&job.cfg.output), &forgotten).await.unwrap();
    assert!(unknown.is_empty(), "{unknown:?}");
    std::fs::remove_file(job.path("log")).unwrap();
    let rerun = job.run().await;
    assert_eq!((rerun.done, rerun.skipped, rerun.status()), (225, 75, RunStatus::AllDone));
    assert_eq!(job.log(), redo, "the rerun's order");
}

/// An output at the final path that is not valid JSON (a partial write) is redone; a valid one without a ledger
/// entry (a lost ledger, a run killed between rename and record) is adopted without running: recorded done,
/// owner `adopted`. A done output damaged later is redone too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_output_is_redone_and_a_valid_one_without_an_entry_is_adopted() {
    let job = Job::new(&["a", "b"], WRITE_JSON);
    std::fs::create_dir_all(job.path("out")).unwrap();
    std::fs::write(job.path("out/a.json"), r#"{"id": "a", "ok": tr"#).unwrap();
    std::fs::write(job.path("out/b.json"), r#"{"id": "b", "ok": true}"#).unwrap();
    let summary = job.run().await;
    assert_eq!((summary.done, summary.adopted, summary.status()), (1, 1, RunStatus::AllDone));
    assert_eq!(job.log(), ["a"], "only the truncated output's item ran");
    assert_eq!((job.status_of("a"), job.status_of("b")), ("done".into(), "adopted".into()));
    assert!(matches!(job.entry("b").await, Some(Entry::Done { ref owner, attempts: 0, .. }) if owner == "adopted"));
    assert_outputs_valid(&job, &["a", "b"]);
    std::fs::write(job.path("out/a.json"), "{").unwrap();
    let rerun = job.run().await;
    assert_eq!((rerun.done, rerun.skipped, rerun.status()), (1, 1, RunStatus::AllDone));
    assert_eq!(job.log(), ["a", "a"]);
    assert_outputs_valid(&job, &["a", "b"]);
}

/// Two items of a file with one output path would overwrite each other: the run is refused before anything
/// runs, naming both lines, and nothing is written to the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_items_with_one_output_path_are_refused_before_anything_runs() {
    let job = Job::new(&["a", "b", "a"], WRITE_JSON);
    let refused = start(job.store.clone(), job.cfg.clone(), Stop::new()).await.unwrap();
    let Err(e @ Error::DuplicateOutput { first: 1, second: 3, .. }) = refused else {
        panic!("not refused as a duplicate output: {refused:?}");
    };
    assert!(e.to_string().contains("lines 1 and 3 both write"), "{e}");
    assert!(job.log().is_empty(), "something ran");
    assert!(job.store.inner.list("run/", None, 10).await.unwrap().items.is_empty(), "the ledger was written");
}

/// A command that exits 0 without writing `{out}` has not done its item: the attempt fails with an error that
/// says where the result goes, and no file is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_0_without_output_is_a_failure() {
    let mut job = Job::new(&["a"], "exit 0");
    job.cfg.retries = 0;
    let summary = job.run().await;
    assert_eq!((summary.failed, summary.executions, summary.status()), (1, 1, RunStatus::Failed));
    let error = "verify: no output: the command must write its result to {out} (also in $IDEM_OUTPUT), the \
                 temporary path; its standard output is discarded";
    assert_eq!((job.status_of("a"), job.reported("a")["last_error"].clone()), ("failed".into(), error.into()));
    let said = summary.render();
    assert!(said.contains("failed item a after 1 attempt: verify: no output: the command must write"), "{said}");
    assert!(matches!(job.entry("a").await, Some(Entry::Failed { attempts: 1, poison: false, .. })));
    assert!(job.out_files().is_empty(), "{:?}", job.out_files());
}

/// A JSON output without a field of `--expect-fields` does not count: the attempt fails naming the field, the
/// output is not moved into place, and the ledger counts the item failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_missing_an_expected_field_is_a_failure() {
    let mut job = Job::new(&["a"], r#"echo '{"other": 1}' > "$2""#);
    job.cfg.retries = 0;
    job.cfg.expect_fields = vec!["id".into(), "ok".into()];
    let summary = job.run().await;
    assert_eq!((summary.failed, summary.executions, summary.status()), (1, 1, RunStatus::Failed));
    assert_eq!(
        job.reported("a")["last_error"],
        "verify: output lacks field \"id\": write the field, or leave it out of --expect-fields"
    );
    assert!(job.out_files().is_empty(), "{:?}", job.out_files());
    let status = idem_runner::status(&job.store, &job.job()).await.unwrap();
    assert_eq!((status.done, status.running, status.failed, status.poison), (0, 0, 1, 0));
}

/// `--verify` decides whether an output counts: its exit status, with `{out}` and `$IDEM_OUTPUT` naming the
/// file; an output it refuses fails the attempt with its exit and standard error, and is not moved into place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verify_command_decides_whether_an_output_counts() {
    let script = r#"if [ "$1" = good ]; then echo '{"ok": true}' > "$2"; else echo '{"ok": false}' > "$2"; fi"#;
    let mut job = Job::new(&["good", "bad"], script);
    job.cfg.retries = 0;
    job.cfg.verify = Some(r#"grep -q '"ok": true' {out} || { echo "not ok in $IDEM_OUTPUT" >&2; exit 4; }"#.into());
    let summary = job.run().await;
    assert_eq!((summary.done, summary.failed, summary.executions), (1, 1, 2));
    assert_eq!((job.status_of("good"), job.status_of("bad")), ("done".into(), "failed".into()));
    let error = job.reported("bad")["last_error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("verify exit 4: not ok in "), "{error}");
    assert_eq!(job.out_files(), BTreeSet::from(["good.json".to_owned()]));
}

/// `{out}` reaches `--verify` quoted: an item id with shell syntax in it is never run as code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_gets_the_output_path_quoted_so_item_text_never_runs_as_code() {
    let id = "x;touch${IFS}PWNED;y";
    let mut job = Job::new(&[id], WRITE_JSON);
    job.cfg.verify = Some("test -s {out}".into());
    let summary = job.run().await;
    assert_eq!((summary.done, summary.status()), (1, RunStatus::AllDone));
    assert!(!job.path("PWNED").exists(), "item text ran as shell code");
    assert_eq!(job.log(), [id]);
}

/// An output that cannot be renamed into place (a directory is at its final path) fails the attempt, and its
/// temporary file goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rename_leaves_no_temporary_file() {
    let mut job = Job::new(&["d"], WRITE_JSON);
    job.cfg.retries = 0;
    std::fs::create_dir_all(job.path("out/d.json/inside")).unwrap();
    let summary = job.run().await;
    assert_eq!((summary.failed, summary.status()), (1, RunStatus::Failed));
    let error = job.reported("d")["last_error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("cannot rename the output into place"), "{error}");
    assert_eq!(job.out_files(), BTreeSet::from(["d.json".to_owned()]), "a temporary file was left");
}

/// The command gets its item on standard input and in its environment: `IDEM_ITEM_ID`, `IDEM_OUTPUT` (the
/// temporary path), `IDEM_IDEMPOTENCY_KEY` (`run:ID:HASH`, the hash of the item's text, as `idem key` derives
/// it) and `IDEM_FENCING_TOKEN`, the generation of the ledger write that counted this attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_sees_its_item_key_and_fencing_token() {
    let script = r#"input=$(cat); printf '{"id": "%s", "stdin": %s, "key": "%s", "token": %s}' "$IDEM_ITEM_ID" "$input" "$IDEM_IDEMPOTENCY_KEY" "$IDEM_FENCING_TOKEN" > "$IDEM_OUTPUT""#;
    let job = Job::new(&["k1"], script);
    let summary = job.run().await;
    assert_eq!(summary.status(), RunStatus::AllDone);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(job.path("out/k1.json")).unwrap()).unwrap();
    assert_eq!(v["stdin"], serde_json::json!({"id": "k1"}));
    let raw = line("k1");
    let key = idem_core::derive_key("run", "k1", raw.trim().as_bytes()).unwrap();
    assert_eq!(v["key"], key.as_str());
    let counted = job.store.history(&job.key("k1")).into_iter().find(|w| matches!(w.entry, Entry::Running { .. }));
    let token = counted.expect("the attempt's count").generation;
    assert_eq!(v["token"].as_u64(), Some(token.get()), "the fencing token is not the count's generation");
}
