//! `run` for jobs without output files: `--check` says whether an item's effect is there, `IDEM_KEY` names
//! the item for a sink that dedupes, the report and the summary say what was done where, and placeholders can
//! be escaped. In this process on a [`MemoryStore`] ([`super::run_harness`]). A check runs in the runner's
//! directory, which is this test process's: the tests give it absolute paths.

use std::collections::BTreeMap;

use idem_core::ledger::Entry;
use idem_runner::{Error, RunStatus, Stop};
use idem_store::{Precondition, Store, Ttl};

use super::run_harness::{Job, line, start};

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// A check that says done (exit 0) before an item's command counts the item done without running it; after
/// the command, a check that still says not done fails the attempt though the command exited 0. `--check`
/// defines done-ness only for a job without `--output`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_that_reports_done_skips_the_command_and_one_failing_after_it_fails_the_item() {
    let mut job = Job::named("chk", &["1", "2", "3", "4", "5"], r#"touch "done/$1""#);
    job.cfg.check = Some(format!("test -e {}/done/{{id}}", job.dir.path().display()));
    // Items 2 and 4 have their effect already (a row inserted by hand, a runner that died before recording).
    std::fs::create_dir(job.path("done")).unwrap();
    for id in ["2", "4"] {
        std::fs::write(job.path(&format!("done/{id}")), "").unwrap();
    }
    let summary = job.run().await;
    assert_eq!((summary.done, summary.skipped, summary.executions), (3, 2, 3), "{}", summary.render());
    assert_eq!(summary.status(), RunStatus::AllDone);
    assert_eq!(sorted(job.log()), ["1", "3", "5"], "the check said done for 2 and 4: their command must not run");
    assert_eq!((job.status_of("2"), job.reported("2")["attempts"].as_u64()), ("checked".into(), Some(0)));
    let rerun = job.run().await;
    assert_eq!((rerun.executions, rerun.skipped, job.log().len()), (0, 5, 3), "a rerun executed something");
    // Another job whose command exits 0 for item 6 without making its effect: the attempt fails.
    job.cfg.name = Some("chk2".into());
    job.cfg.retries = 0;
    job.cfg.command[2] = job.cfg.command[2].replace(r#"touch "done/$1""#, r#"[ "$1" = 6 ] || touch "done/$1""#);
    job.write_items(&["1", "6"]);
    let lying = job.run().await;
    assert_eq!((lying.skipped, lying.failed, lying.status()), (1, 1, RunStatus::Failed));
    assert_eq!(&job.log()[3..], ["6"], "item 1 was done per its check; 6 ran once");
    assert_eq!(job.status_of("6"), "failed");
    assert_eq!(job.reported("6")["last_error"], "check exit 1 after the command exited 0");
    // With an output file, done is the output's digest: --check is refused before anything runs.
    let mut with_output = job.cfg.clone();
    with_output.output = job.path("o/{id}").display().to_string();
    let refused = start(job.store.clone(), with_output, Stop::new()).await.unwrap();
    let Err(Error::Config(why)) = refused else { panic!("not refused: {refused:?}") };
    assert!(why.contains("--check says whether an item's effect is there"), "{why}");
}

/// A check that fails itself (its program missing: exit 127; `grep` on a file that is not there: exit 2) is
/// not "the effect is absent": the command never runs, and the item fails with the check's ending (poison once
/// the same ending repeats). Before, such a check read as "absent": 5 items ran 6 commands, and ran again on
/// every retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_that_fails_itself_runs_no_command() {
    let ids = ["1", "2", "3", "4", "5"];
    for (name, check) in
        [("missing", "no-such-check-program {id}"), ("unreadable", "grep -q {id} /nonexistent/done.txt")]
    {
        let mut job = Job::named(name, &ids, "");
        job.cfg.check = Some(check.into());
        job.cfg.retry_delay = std::time::Duration::ZERO;
        job.cfg.on_poison = idem_runner::OnPoison::Skip;
        let summary = job.run().await;
        assert_ne!(summary.status(), RunStatus::AllDone, "{name}");
        assert_eq!((summary.executions, job.log()), (0, Vec::<String>::new()), "{name}: a command ran");
        for id in ids {
            let item = job.reported(id);
            assert!(matches!(item["status"].as_str(), Some("failed" | "poison")), "{name}: {item}");
            let error = item["last_error"].as_str().unwrap_or_default();
            assert!(error.starts_with("check exit ") && error.contains("before the command"), "{name}: {item}");
        }
    }
}

/// Two named jobs over the same items never send one `IDEM_IDEMPOTENCY_KEY` (behind one idempotency proxy the
/// second job's requests would be answered with the first's replays): for a named job it is its `IDEM_KEY`,
/// `NAME:ID:HASH`. `--key-prefix` still sets it; an unnamed job keeps `run:ID:HASH`, as `idem key` derives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotency_key_of_a_named_job_is_its_item_key() {
    let script = r#"echo "$IDEM_IDEMPOTENCY_KEY $IDEM_KEY" >> keys; [ -z "$IDEM_OUTPUT" ] || echo x > "$IDEM_OUTPUT""#;
    let job = Job::named("mail", &["1", "2", "3"], script);
    let keys_of = |cfg: idem_runner::RunConfig| {
        let job = &job;
        async move {
            let summary = job.run_with(cfg, Stop::new()).await;
            assert_eq!(summary.status(), RunStatus::AllDone, "{}", summary.render());
            let logged = std::fs::read_to_string(job.path("keys")).unwrap();
            let lines: Vec<(String, String)> =
                logged.lines().map(|l| l.split_once(' ').unwrap()).map(|(a, b)| (a.into(), b.into())).collect();
            lines[lines.len() - 3..].to_vec()
        }
    };
    let mail = keys_of(job.cfg.clone()).await;
    let mut sms_cfg = job.cfg.clone();
    sms_cfg.name = Some("sms".into());
    let sms = keys_of(sms_cfg).await;
    for (idempotency, key) in mail.iter().chain(&sms) {
        assert_eq!(idempotency, key, "a named job's IDEM_IDEMPOTENCY_KEY is its IDEM_KEY");
    }
    let mut all: Vec<&String> = mail.iter().chain(&sms).map(|(i, _)| i).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 6, "two jobs shared an idempotency key: {mail:?} {sms:?}");
    let two = idem_core::derive_key("mail", "2", line("2").trim().as_bytes()).unwrap();
    assert!(mail.iter().any(|(i, _)| i == two.as_str()), "{two} is not among {mail:?}");
    assert!(sms.iter().all(|(i, _)| i.starts_with("sms:")));
    let mut fax = job.cfg.clone();
    fax.name = Some("fax".into());
    fax.key_prefix = Some("legacy".into());
    let fax = keys_of(fax).await;
    assert!(fax.iter().all(|(i, k)| i.starts_with("legacy:") && k.starts_with("fax:")), "{fax:?}");
    let mut unnamed = job.cfg.clone();
    unnamed.name = None;
    unnamed.output = job.path("out/{id}").display().to_string();
    let unnamed = keys_of(unnamed).await;
    let two = idem_core::derive_key("run", "2", line("2").trim().as_bytes()).unwrap();
    assert!(unnamed.iter().any(|(i, _)| i == two.as_str()), "{two} is not among {unnamed:?}");
}

/// The report and the summary of a job without outputs whose ledger another host shares. The report names the
/// job, the host and the (empty) output template; an item whose effect `--check` found is `checked` with 0
/// attempts and no sha256 (not "done, attempt 1, the SHA-256 of nothing"), and no item shows a sha256. Items
/// another host recorded done are not run here: the first summary line counts them, so its counts add up to
/// the items, and the line about them does not suggest `--require-local-output` (refused without an output).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_and_summaries_of_a_job_without_outputs_add_up() {
    let mut job = Job::named("mail", &["1", "2", "3"], r#"touch "done/$1""#);
    job.cfg.check = Some(format!("test -e {}/done/{{id}}", job.dir.path().display()));
    std::fs::create_dir(job.path("done")).unwrap();
    std::fs::write(job.path("done/3"), "").unwrap();
    let summary = job.run().await;
    assert_eq!((summary.done, summary.skipped, summary.status()), (2, 1, RunStatus::AllDone));
    assert_eq!(sorted(job.log()), ["1", "2"]);
    let Some(Entry::Done { owner, .. }) = job.entry("1").await else { panic!("1 is not done") };
    // The host part of the owner token (HOST-PID-RANDOM) that recorded it.
    let host = owner.rsplitn(3, '-').nth(2).unwrap().to_owned();
    let report = job.report();
    assert_eq!(
        (report["job"].as_str(), report["host"].as_str(), report["output"].as_str()),
        (Some("mail"), Some(host.as_str()), Some(""))
    );
    let three = job.reported("3");
    assert_eq!((three["status"].as_str(), three["attempts"].as_u64()), (Some("checked"), Some(0)), "{three}");
    assert!(three["sha256"].is_null(), "{three}");
    let one = job.reported("1");
    assert_eq!((one["status"].as_str(), one["attempts"].as_u64()), (Some("done"), Some(1)), "{one}");
    assert!(one["sha256"].is_null(), "no output, no digest: {one}");
    // Make these entries host-a's, as if that host had run them on the shared ledger.
    for id in ["1", "2", "3"] {
        let Some(Entry::Done { attempts, sha256, size, finished_at_ms, duration_ms, item_sha256, .. }) =
            job.entry(id).await
        else {
            panic!()
        };
        let owner = "host-a-4242-0badcafe".to_owned();
        let theirs = Entry::Done { attempts, sha256, size, owner, finished_at_ms, duration_ms, item_sha256 };
        job.store.inner.put(&job.key(id), theirs.encode(), Precondition::Any, Ttl::Keep).await.unwrap();
    }
    job.write_items(&["1", "2", "4"]);
    let here = job.run().await;
    assert_eq!((here.done, here.done_elsewhere, here.status()), (1, 2, RunStatus::AllDone));
    assert_eq!(here.elsewhere, BTreeMap::from([("host-a".to_owned(), 2)]));
    let said = here.render();
    assert!(
        said.contains("3 items in")
            && said.contains("1 done now, 0 already done, 0 adopted, 2 done elsewhere, 0 failed"),
        "{said}"
    );
    assert!(said.contains("2 done elsewhere (host-a: 2): recorded done by another host; not run here"), "{said}");
    assert!(!said.contains("--require-local-output"), "suggests a flag refused for this job: {said}");
    assert_eq!(sorted(job.log()), ["1", "2", "4"]);
    let two = job.reported("2");
    assert_eq!((two["status"].as_str(), two["host"].as_str()), (Some("done_elsewhere"), Some("host-a")), "{two}");
    let status = idem_runner::status(&job.store, "mail").await.unwrap();
    assert_eq!((status.done, status.failed), (4, 0));
    assert_eq!(status.done_by_host, BTreeMap::from([("host-a".to_owned(), 3), (host, 1)]));
}

/// A literal `{}` or `{id}` is passed by doubling its braces (`{{}}`, `{{id}}`; before, `{{}}` was refused and
/// `{{id}}` became `{1}`), in the command and in `--check`; an awk program `{print}` is refused with a message
/// that names the escape, and `{{print}}` runs it; `{print $1}` needs none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doubled_braces_pass_a_literal_placeholder() {
    let job = Job::named("lit", &["1", "2"], "");
    let dir = job.dir.path().display().to_string();
    let command = |script: &str, args: &[&str]| {
        let mut cfg = job.cfg.clone();
        cfg.command = ["sh", "-c", script, "sh"].iter().chain(args).map(|a| (*a).to_owned()).collect();
        cfg
    };
    let lines = |file: &str| {
        sorted(std::fs::read_to_string(job.path(file)).unwrap_or_default().lines().map(str::to_owned).collect())
    };
    let echo = format!(r#"echo "$1|$2" >> {dir}/literal"#);
    let literal = job.run_with(command(&echo, &["{{}} {{id}} {{item}}", "{id}"]), Stop::new()).await;
    assert_eq!(literal.status(), RunStatus::AllDone);
    assert_eq!(lines("literal"), ["{} {id} {item}|1", "{} {id} {item}|2"]);
    // --check gets the escape too: `test {id} != '{{id}}'` is true for every item, so both count as done.
    let mut check = command("exit 9", &[]);
    check.name = Some("chk".into());
    check.check = Some("test {id} != '{{id}}'".into());
    let checked = job.run_with(check, Stop::new()).await;
    assert_eq!((checked.skipped, checked.executions, checked.status()), (2, 0, RunStatus::AllDone));
    // awk: `{print}` looks like a placeholder; the refusal says how to write it.
    let awk = |program: &str| format!(r#"echo "$1 x" | awk '{program}' >> {dir}/awk"#);
    let mut refused = command(&awk("{print}"), &["{id}"]);
    refused.name = Some("awk1".into());
    let refused = start(job.store.clone(), refused, Stop::new()).await.unwrap();
    let Err(Error::Config(why)) = refused else { panic!("not refused: {refused:?}") };
    assert!(why.contains("unknown placeholder {print} in the command"), "{why}");
    assert!(why.contains("double its braces: {{print}}"), "{why}");
    assert!(lines("awk").is_empty(), "a refused run executed something");
    for (name, program) in [("awk2", "{{print}}"), ("awk3", "{print $1}")] {
        let mut cfg = command(&awk(program), &["{id}"]);
        cfg.name = Some(name.into());
        assert_eq!(job.run_with(cfg, Stop::new()).await.status(), RunStatus::AllDone, "{program}");
    }
    assert_eq!(lines("awk"), ["1", "1 x", "2", "2 x"]);
}
