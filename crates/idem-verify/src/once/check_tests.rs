//! Planted histories: each check of [`super`] reports what it is for, and passes a history it must accept.

use serde_json::json;

use super::*;
use crate::once::{Control, Invocation, JobPlan, Record};

const S1: &str = "2026-12-05T18:00:02Z";
const S2: &str = "2026-12-05T18:00:04Z";

fn exec(key: &str, runner: u32, pid: u32, attempt: u64, secs: (f64, f64), completed: bool) -> Execution {
    Execution {
        job: "j0".into(),
        key: key.into(),
        runner,
        pid,
        attempt,
        start_us: (secs.0 * 1e6) as Micros,
        last_us: (secs.1 * 1e6) as Micros,
        completed,
    }
}

fn slot(s: &str) -> String {
    format!("slot {s}")
}

fn view(s: &str, state: &str, attempts: u64) -> serde_json::Value {
    json!({ "slot": s, "state": state, "attempts": attempts })
}

/// One job under `policy`: status with `slots` (newest first) and `counted` runs taken over, the list agreeing.
fn record(policy: &str, slots: Vec<serde_json::Value>, counted: u64) -> Record {
    let last = slots.first().map_or("", |v| v["slot"].as_str().unwrap_or("")).to_owned();
    let state = slots.first().map_or("none", |v| v["state"].as_str().unwrap_or("none")).to_owned();
    let status = json!({ "slots": slots, "last_slot": last, "ran_more_than_once": 0, "taken_over": counted,
        "overlap": policy, "triggers": [] });
    Record {
        jobs: vec![JobPlan {
            name: "j0".into(),
            policy: policy.into(),
            catchup: None,
            jitter: None,
            skew_s: vec![0; 3],
        }],
        status: [("j0".to_owned(), status)].into_iter().collect(),
        list: json!([{ "name": "j0", "last_slot": last, "last_state": state, "pause": { "paused": false } }]),
        ..Record::default()
    }
}

fn kinds(t: &Tally) -> Vec<String> {
    t.anomalies.iter().map(|a| a.kind.clone()).collect()
}

fn fault(kind: &str, target: &str, start_s: f64, end_s: f64) -> Fault {
    Fault {
        kind: kind.into(),
        target: target.into(),
        start_us: (start_s * 1e6) as Micros,
        end_us: (end_s * 1e6) as Micros,
        detail: String::new(),
    }
}

#[test]
fn a_clean_history_passes() {
    let rec = record("skip", vec![view(S2, "done", 1), view(S1, "done", 2)], 1);
    let execs = [
        exec(&slot(S1), 10, 100, 1, (1.0, 1.5), false),
        exec(&slot(S1), 11, 101, 2, (3.0, 4.0), true),
        exec(&slot(S2), 12, 102, 1, (4.1, 5.0), true),
    ];
    let t = check(&rec, &execs, &[], false);
    assert!(t.anomalies.is_empty(), "{:?}", t.anomalies);
}

#[test]
fn executions_are_read_from_their_lines() {
    let line = |ev: &str, pid: u32, t_us: u64| ExecLine {
        ev: ev.into(),
        job: "j0".into(),
        slot: S1.into(),
        trigger: None,
        attempt: 1,
        token: 5,
        runner: 9,
        pid,
        t_us,
    };
    let lines = [line("start", 1, 1_000_000), line("tick", 1, 1_100_000), line("start", 2, 1_050_000)];
    let mut with_end = lines.to_vec();
    with_end.push(line("end", 1, 1_200_000));
    let execs = from_lines(&with_end, 1_000_000);
    assert_eq!(execs.len(), 2);
    assert_eq!((execs[0].pid, execs[0].start_us, execs[0].last_us, execs[0].completed), (1, 0, 200_000, true));
    assert_eq!((execs[1].pid, execs[1].completed), (2, false));
    assert_eq!(execs[0].key, slot(S1));
}

#[test]
fn a_run_completed_twice_without_a_fault_is_reported() {
    let rec = record("allow", vec![view(S1, "done", 2)], 1);
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true), exec(&slot(S1), 11, 101, 2, (5.0, 6.0), true)];
    let t = check(&rec, &execs, &[], false);
    assert_eq!(kinds(&t), ["ran to completion twice"]);
    // A store fault far from the first end excuses nothing either.
    let far = fault("store-outage", "store server", 10.0, 12.0);
    assert_eq!(kinds(&check(&rec, &execs, &[far], false)), ["ran to completion twice"]);
}

#[test]
fn a_holder_killed_after_its_command_ended_excuses_a_second_completion_that_status_counts() {
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true), exec(&slot(S1), 11, 101, 2, (5.0, 6.0), true)];
    let kill = fault("kill9", "idem once j0 #0 (pid 10)", 2.1, 2.1);
    let rec = record("allow", vec![view(S1, "done", 2)], 1);
    assert!(check(&rec, &execs, std::slice::from_ref(&kill), false).anomalies.is_empty());
    // Not counted among the slots taken over or run more than once: status misreports it.
    let rec = record("allow", vec![view(S1, "done", 2)], 0);
    assert_eq!(kinds(&check(&rec, &execs, std::slice::from_ref(&kill), false)), ["status misreports"]);
    // Another holder's kill excuses nothing.
    let other = fault("kill9", "idem once j0 #1 (pid 12)", 2.1, 2.1);
    let rec = record("allow", vec![view(S1, "done", 2)], 1);
    assert_eq!(kinds(&check(&rec, &execs, &[other], false)), ["ran to completion twice"]);
}

#[test]
fn two_executions_of_one_run_at_once_are_reported_whatever_the_faults() {
    let rec = record("allow", vec![view(S1, "done", 2)], 1);
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), false), exec(&slot(S1), 11, 101, 2, (1.9, 3.0), true)];
    let pause = fault("pause", "idem once j0 #0 (pid 10)", 0.5, 6.0);
    assert_eq!(kinds(&check(&rec, &execs, &[pause], false)), ["ran twice at once"]);
}

#[test]
fn runs_overlapping_are_reported_under_every_policy_but_allow() {
    let slots = vec![view(S2, "done", 1), view(S1, "done", 1)];
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 3.0), true), exec(&slot(S2), 11, 101, 1, (2.5, 4.0), true)];
    for policy in ["skip", "buffer-one", "buffer-all", "cancel-other", "terminate-other"] {
        let t = check(&record(policy, slots.clone(), 0), &execs, &[], false);
        assert_eq!(kinds(&t), [format!("runs overlapped under {policy}")]);
    }
    assert!(check(&record("allow", slots.clone(), 0), &execs, &[], false).anomalies.is_empty());
    // One that ended (its last line) before the next started is no overlap.
    let apart = [exec(&slot(S1), 10, 100, 1, (1.0, 2.5), true), exec(&slot(S2), 11, 101, 1, (2.5, 4.0), true)];
    assert!(check(&record("skip", slots, 0), &apart, &[], false).anomalies.is_empty());
}

#[test]
fn a_done_slot_whose_command_never_started_or_never_ended_is_reported() {
    let rec = record("allow", vec![view(S2, "done", 1), view(S1, "done", 1)], 0);
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true)];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["done but never ran"]);
    let cut = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true), exec(&slot(S2), 11, 101, 1, (3.0, 3.5), false)];
    assert_eq!(kinds(&check(&rec, &cut, &[], false)), ["done but never ran"]);
}

#[test]
fn a_slot_recorded_paused_skipped_or_missed_that_ran_is_reported() {
    for state in ["paused", "skipped", "missed"] {
        let rec = record("allow", vec![view(S2, "done", 1), view(S1, state, 0)], 0);
        let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 1.2), false), exec(&slot(S2), 11, 101, 1, (3.0, 4.0), true)];
        let t = check(&rec, &execs, &[], false);
        assert!(kinds(&t).contains(&format!("{state} but ran")), "{state}: {:?}", kinds(&t));
    }
}

#[test]
fn status_misreports_are_reported() {
    // Fewer attempts than executions started.
    let rec = record("allow", vec![view(S1, "done", 1)], 1);
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 1.2), false), exec(&slot(S1), 11, 101, 2, (3.0, 4.0), true)];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["status misreports"]);
    // A slot that ran and that status does not list.
    let rec = record("allow", vec![view(S2, "done", 1)], 0);
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true), exec(&slot(S2), 11, 101, 1, (3.0, 4.0), true)];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["status misreports"]);
    // Another policy than the one given.
    let mut rec = record("allow", vec![view(S2, "done", 1)], 0);
    rec.jobs[0].policy = "skip".into();
    let execs = [exec(&slot(S2), 11, 101, 1, (3.0, 4.0), true)];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["status misreports"]);
}

#[test]
fn a_list_that_disagrees_with_status_is_reported() {
    let execs = [exec(&slot(S2), 11, 101, 1, (3.0, 4.0), true)];
    let mut rec = record("allow", vec![view(S2, "done", 1)], 0);
    rec.list = json!([{ "name": "j0", "last_slot": S1, "last_state": "done", "pause": { "paused": false } }]);
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["list misreports"]);
    rec.list = json!([{ "name": "j0", "last_slot": S2, "last_state": "done", "pause": { "paused": true } }]);
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["list misreports"]);
    rec.list = json!([]);
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["list misreports"]);
}

fn trigger(id: &str, code: Option<i32>) -> Control {
    Control {
        job: "j0".into(),
        what: "trigger".into(),
        id: Some(id.into()),
        start_us: 5_000_000,
        end_us: 5_100_000,
        code,
        out: String::new(),
    }
}

#[test]
fn triggers_run_once_and_every_acknowledged_one_runs() {
    let mut rec = record("allow", vec![view(S1, "done", 1)], 0);
    rec.controls = vec![trigger("tr-1", Some(0)), trigger("tr-1", Some(0)), trigger("tr-2", Some(0))];
    rec.status.get_mut("j0").unwrap()["triggers"] =
        json!([["tr-1", view("2026-12-05T18:00:05Z", "done", 2)], ["tr-2", view("x", "requested", 0)]]);
    let base = exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true);
    let tr = |pid, secs, completed| exec("trigger tr-1", 12, pid, 1, secs, completed);
    let execs = [base.clone(), tr(103, (6.0, 7.0), true), tr(104, (9.0, 10.0), true)];
    let t = check(&rec, &execs, &[], false);
    assert_eq!(kinds(&t), ["ran to completion twice", "trigger not run"]);
}

fn invocation(code: Option<i32>) -> Invocation {
    Invocation {
        job: "j0".into(),
        label: "idem once j0 #1 (pid 42)".into(),
        pid: 42,
        skew_s: 0,
        start_us: 1_000_000,
        end_us: 2_000_000,
        code,
        drain: false,
    }
}

#[test]
fn exit_statuses_outside_their_documented_set_are_reported() {
    let execs = [exec(&slot(S1), 10, 100, 1, (1.0, 2.0), true)];
    for (code, bad) in [(Some(0), false), (Some(75), false), (Some(6), false), (Some(2), true), (Some(5), true)] {
        let mut rec = record("allow", vec![view(S1, "done", 1)], 0);
        rec.invocations = vec![invocation(code)];
        assert_eq!(!check(&rec, &execs, &[], false).anomalies.is_empty(), bad, "exit {code:?}");
    }
    // Killed: only by the nemesis.
    let mut rec = record("allow", vec![view(S1, "done", 1)], 0);
    rec.invocations = vec![invocation(None)];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["exit status outside its set"]);
    let kill = fault("kill9", "idem once j0 #1 (pid 42)", 1.5, 1.5);
    assert!(check(&rec, &execs, &[kill], false).anomalies.is_empty());
    // A control command: 0 or 75; 3 before the job existed only.
    rec.invocations = vec![invocation(Some(0))];
    rec.controls = vec![Control { what: "pause".into(), id: None, code: Some(2), ..trigger("x", None) }];
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["exit status outside its set"]);
    rec.controls = vec![Control { what: "pause".into(), id: None, start_us: 0, ..trigger("x", Some(3)) }];
    assert!(check(&rec, &execs, &[], false).anomalies.is_empty());
    rec.controls[0].start_us = 3_000_000;
    assert_eq!(kinds(&check(&rec, &execs, &[], false)), ["exit status outside its set"]);
}
