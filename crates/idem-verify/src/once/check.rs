//! Checking the once workload against what docs/design/cron.md promises, per job:
//!
//! - **a run completed twice** (a slot, a triggered run, a backfilled slot: each keyed by its slot's time or
//!   trigger id): two executions that both reached their end. The design allows it in one case only: the
//!   holder of the first lost its lease after its command exited 0 and before its `done` write landed (killed
//!   or paused then, or the store unreachable then: "at-least-once, not exactly-once"), and then `status`
//!   counts the slot among those that ran more than once or were taken over. A second completion with no such
//!   fault around the first one's end is an anomaly; one with it that `status` does not count is a misreport;
//! - **two executions of one run at once**: never allowed (a killed holder's command dies with it, a paused
//!   one's is stopped by its watchdog before its lease can lapse, so a takeover never runs beside it);
//! - **runs of one job overlapping** under any policy but `allow`: `skip` and `buffer-*` wait for or give way
//!   to an earlier run, `cancel-other`/`terminate-other` start the new slot once the old one's lease is gone,
//!   and a triggered or requested run never runs beside another; the commands never run at once. Times are
//!   the commands' own (their last line bounds a killed one's life from below), so an overlap seen is real;
//! - **the status**: a slot or triggered run `done` has an execution that reached its end; one `paused`,
//!   `skipped` or `missed` never started; its `attempts` are at least the executions started (each start
//!   follows a claim that counted one); every slot that ran is listed (nothing is pruned in a run this short);
//!   the policy is the one given; a trigger acknowledged (exit 0) has run by the end (the drain's invocations
//!   run what is pending);
//! - **the list**: each job's last slot and its state as `status` says them, and not paused after the final
//!   resume;
//! - **exit statuses**: an invocation exits 0, 1, 3, 4, 6 or 75 (never 2, bad usage, which nothing here is,
//!   nor 5 without `--fail-if-held`, nor 130 with no signal sent) or is killed by the nemesis; a control
//!   command exits 0 or 75 (3 only before the job's first invocation).

use std::collections::BTreeMap;

use super::exec_slot::ExecLine;
use super::{Control, Invocation, Record};
use crate::history::{Clock, Fault, Micros};
use crate::report::Row;
use crate::tally::Tally;
use crate::{Anomaly, Options, Summary};

/// How long after its command's end a holder may still be recording it (the fenced `done` write, its retries
/// over a store blip, the release), when a store fault does not hold it longer: a kill or pause of the holder
/// then, or a store fault then, may cost it the lease before the write lands.
const SETTLE: Micros = 2_000_000;
/// How long before its command's end a pause of its holder may still let the command finish (the watchdog
/// stops it within 1.25 quiet limits of the holder's last renewal).
const BEFORE_END: Micros = 2_000_000;

/// Exit statuses an invocation may end with here (docs/guide/once.md "Exit statuses").
pub const INVOCATION_EXITS: [i32; 6] = [0, 1, 3, 4, 6, 75];

/// One execution of a run's command, from its lines in the executions log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Execution {
    /// The job.
    pub job: String,
    /// `slot TIME` or `trigger ID`.
    pub key: String,
    /// The `idem once` process that held it.
    pub runner: u32,
    /// The command's process id.
    pub pid: u32,
    /// `IDEM_ATTEMPT`.
    pub attempt: u64,
    /// When it started (run time, µs).
    pub start_us: Micros,
    /// Its last line (its end, or the last tick of one killed).
    pub last_us: Micros,
    /// Whether it reached its end.
    pub completed: bool,
}

/// The executions in the log at `log`, their times moved to the run's clock (`uptime0_us` is the run's 0).
pub fn executions(log: &std::path::Path, uptime0_us: u64) -> Vec<Execution> {
    let lines: Vec<ExecLine> =
        std::fs::read_to_string(log).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    from_lines(&lines, uptime0_us)
}

/// [`executions`] from parsed lines.
pub fn from_lines(lines: &[ExecLine], uptime0_us: u64) -> Vec<Execution> {
    let mut by_pid: BTreeMap<u32, Execution> = BTreeMap::new();
    for l in lines {
        let t = l.t_us.saturating_sub(uptime0_us);
        let e = by_pid.entry(l.pid).or_insert_with(|| Execution {
            job: l.job.clone(),
            key: l.run_key(),
            runner: l.runner,
            pid: l.pid,
            attempt: l.attempt,
            start_us: t,
            last_us: t,
            completed: false,
        });
        e.start_us = e.start_us.min(t);
        e.last_us = e.last_us.max(t);
        e.completed |= l.ev == "end";
    }
    let mut all: Vec<Execution> = by_pid.into_values().collect();
    all.sort_by_key(|e| e.start_us);
    all
}

/// Checks the run, writes its history, and sums it up.
pub fn summarize(opts: &Options, clock: &Clock, rec: &Record) -> Summary {
    let faults = clock.faults();
    let execs = executions(&rec.log, rec.uptime0_us);
    let t = check(rec, &execs, &faults, opts.backend.is_ha());
    let path = opts.out.join("history.jsonl");
    if let Err(e) = crate::history::write_jsonl(&path, &history(rec, &execs), &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", path.display());
    }
    let failure_page = t.anomalies.first().map(|a| page(opts, a, rec, &execs, &faults));
    let runs: std::collections::BTreeSet<(&str, &str)> =
        execs.iter().map(|e| (e.job.as_str(), e.key.as_str())).collect();
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: rec.invocations.len() + rec.controls.len(),
        unknown: 0,
        answers: BTreeMap::new(),
        faults: clock.fault_counts(),
        histories: runs.len(),
        anomalies: t.anomalies,
        notes: t.notes,
        setting: None,
        losses: t.losses,
        seconds: 0.0,
        history: path,
        failure_page,
    }
}

/// Every check on a run's record, its executions and the faults injected.
pub(crate) fn check(rec: &Record, execs: &[Execution], faults: &[Fault], ha: bool) -> Tally {
    let mut t = Tally::new(ha);
    for name in ["runs completed twice", "runs completed twice, counted by status", "exits outside the set"] {
        t.note(name, 0);
    }
    t.note("invocations", rec.invocations.len() as u64);
    t.note("executions", execs.len() as u64);
    t.note("executions completed", execs.iter().filter(|e| e.completed).count() as u64);
    for c in &rec.controls {
        t.note(&format!("{}s", c.what), 1);
    }
    let failover = faults.iter().any(|f| crate::HaFault::is_ha(&f.kind));
    for job in &rec.jobs {
        let mine: Vec<&Execution> = execs.iter().filter(|e| e.job == job.name).collect();
        let twice = check_runs(&mut t, &job.name, &mine, faults, failover);
        if job.policy != "allow" {
            check_overlap(&mut t, &job.name, &job.policy, &mine);
        }
        let status = rec.status.get(&job.name).unwrap_or(&serde_json::Value::Null);
        check_status(&mut t, job, status, &mine, twice);
        check_triggers(&mut t, &job.name, status, &rec.controls, &mine);
        check_list(&mut t, &job.name, status, &rec.list);
    }
    check_exits(&mut t, &rec.invocations, &rec.controls, faults);
    t
}

/// Per run of a job: never two executions at once; completed at most once, unless a fault that can cost the
/// first completion's holder its lease came between its end and its record. Returns how many runs completed
/// twice with that excuse (`status` must count them).
fn check_runs(t: &mut Tally, job: &str, mine: &[&Execution], faults: &[Fault], failover: bool) -> u64 {
    let mut runs: BTreeMap<&str, Vec<&Execution>> = BTreeMap::new();
    for e in mine {
        runs.entry(e.key.as_str()).or_default().push(e);
    }
    let mut excused = 0;
    for (key, list) in runs {
        let subject = format!("job {job} {key}");
        if let Some((a, b)) = overlapping(&list) {
            let detail = format!(
                "executions pid {} (held by {}, attempt {}) and pid {} (held by {}, attempt {}) ran at once",
                a.pid, a.runner, a.attempt, b.pid, b.runner, b.attempt
            );
            t.flag("ran twice at once", subject.clone(), detail, Some(b.start_us), Vec::new());
        }
        let done: Vec<&&Execution> = list.iter().filter(|e| e.completed).collect();
        if done.len() < 2 {
            continue;
        }
        t.note("runs completed twice", 1);
        let unexcused = done[..done.len() - 1].iter().find(|e| !faults.iter().any(|f| cuts_record(f, e, faults)));
        match unexcused {
            Some(e) => {
                if failover {
                    t.lose("executions repeated", 1);
                }
                let detail = format!(
                    "{} executions ran to their end; the one by pid {} (held by {}) ended at {:.2} s with no kill or \
                     pause of its holder nor store fault around its record",
                    done.len(),
                    e.pid,
                    e.runner,
                    e.last_us as f64 / 1e6
                );
                t.flag("ran to completion twice", subject, detail, done.last().map(|e| e.start_us), Vec::new());
            }
            None => excused += 1,
        }
    }
    excused
}

/// The first two executions of `list` (sorted by start) that ran at once.
fn overlapping<'a>(list: &[&'a Execution]) -> Option<(&'a Execution, &'a Execution)> {
    let mut sorted: Vec<&Execution> = list.to_vec();
    sorted.sort_by_key(|e| e.start_us);
    for (i, a) in sorted.iter().enumerate() {
        if let Some(b) = sorted[i + 1..].iter().find(|b| b.start_us < a.last_us) {
            return Some((a, b));
        }
    }
    None
}

/// Whether fault `f` can have cost completed execution `e`'s holder its lease before its `done` write
/// landed: a kill or pause of that holder, or a store fault, from [`BEFORE_END`] before the command's end until
/// it was settled ([`settled_by`]).
fn cuts_record(f: &Fault, e: &Execution, faults: &[Fault]) -> bool {
    let holder = f.target.ends_with(&format!("(pid {})", e.runner)) && matches!(f.kind.as_str(), "kill9" | "pause");
    let store = is_store_fault(f);
    (holder || store) && f.end_us + BEFORE_END >= e.last_us && f.start_us <= settled_by(e.last_us, faults)
}

fn is_store_fault(f: &Fault) -> bool {
    f.target.starts_with("store ") || f.target == "sqlite ledger" || crate::HaFault::is_ha(&f.kind)
}

/// When a command that ended at `end` was recorded at the latest: [`SETTLE`] later, or [`SETTLE`] after a store
/// fault that held the write ended (the write is retried for up to 60 s, past the lease).
fn settled_by(end: Micros, faults: &[Fault]) -> Micros {
    let mut by = end + SETTLE;
    let mut store: Vec<&Fault> = faults.iter().filter(|f| is_store_fault(f)).collect();
    store.sort_by_key(|f| f.start_us);
    for f in store {
        if f.start_us <= by && f.end_us >= end {
            by = by.max(f.end_us + SETTLE);
        }
    }
    by
}

/// Under a policy other than `allow`: no two executions of the job (of different runs) at once.
fn check_overlap(t: &mut Tally, job: &str, policy: &str, mine: &[&Execution]) {
    let mut sorted: Vec<&Execution> = mine.to_vec();
    sorted.sort_by_key(|e| e.start_us);
    for (i, a) in sorted.iter().enumerate() {
        if let Some(b) = sorted[i + 1..].iter().find(|b| b.key != a.key && b.start_us < a.last_us) {
            let detail = format!(
                "{} (pid {}, held by {}) ran {:.2}..{:.2} s and {} (pid {}, held by {}) started at {:.2} s",
                a.key,
                a.pid,
                a.runner,
                a.start_us as f64 / 1e6,
                a.last_us as f64 / 1e6,
                b.key,
                b.pid,
                b.runner,
                b.start_us as f64 / 1e6
            );
            t.flag(&format!("runs overlapped under {policy}"), format!("job {job}"), detail, Some(b.start_us), vec![]);
            return;
        }
    }
}

fn s<'a>(v: &'a serde_json::Value, key: &str) -> &'a str {
    v.get(key).and_then(serde_json::Value::as_str).unwrap_or("")
}

fn n(v: &serde_json::Value, key: &str) -> u64 {
    v.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

/// One slot (or triggered run) as `status` shows it, against its executions.
fn check_view(t: &mut Tally, job: &str, key: &str, view: &serde_json::Value, execs: &[&&Execution]) {
    let subject = format!("job {job} {key}");
    let state = s(view, "state");
    let started = execs.len() as u64;
    let completed = execs.iter().any(|e| e.completed);
    t.note(&format!("runs {state}"), 1);
    if state == "done" && !completed {
        let detail = if started == 0 {
            "status says done; its command never started".to_owned()
        } else {
            format!("status says done; none of its {started} executions ran to its end")
        };
        t.flag("done but never ran", subject.clone(), detail, None, Vec::new());
    }
    if matches!(state, "paused" | "skipped" | "missed") && started > 0 {
        let detail = format!("status says {state}; {started} executions of it started");
        t.flag(&format!("{state} but ran"), subject.clone(), detail, execs.first().map(|e| e.start_us), Vec::new());
    }
    if n(view, "attempts") < started {
        let detail = format!("status counts {} attempts; {started} executions started", n(view, "attempts"));
        t.flag("status misreports", subject, detail, None, Vec::new());
    }
}

/// The job's `status`: every slot against its executions, the counted sets, the policy.
fn check_status(t: &mut Tally, job: &super::JobPlan, status: &serde_json::Value, mine: &[&Execution], twice: u64) {
    let subject = format!("job {}", job.name);
    let Some(slots) = status.get("slots").and_then(serde_json::Value::as_array) else {
        t.flag("status misreports", subject, "idem once status --format json gave no slots".into(), None, vec![]);
        return;
    };
    let mut listed = std::collections::BTreeSet::new();
    for view in slots {
        let key = format!("slot {}", s(view, "slot"));
        let execs: Vec<&&Execution> = mine.iter().filter(|e| e.key == key).collect();
        check_view(t, &job.name, &key, view, &execs);
        listed.insert(key);
    }
    if slots.len() < 100
        && let Some(e) = mine.iter().find(|e| e.key.starts_with("slot ") && !listed.contains(&e.key))
    {
        let detail = format!("{} ran (pid {}) but status does not list it", e.key, e.pid);
        t.flag("status misreports", subject.clone(), detail, Some(e.start_us), Vec::new());
    }
    // Counted, not judged: a requested run two invocations both gave way to waits for the next one.
    t.note("requested runs pending at the end", n(status, "pending"));
    let counted = n(status, "ran_more_than_once") + n(status, "taken_over");
    t.note("runs completed twice, counted by status", twice.min(counted));
    if twice > counted {
        let detail = format!(
            "{twice} runs completed twice after a lost record; status counts {} ran more than once and {} taken over",
            n(status, "ran_more_than_once"),
            n(status, "taken_over")
        );
        t.flag("status misreports", subject.clone(), detail, None, Vec::new());
    }
    if s(status, "overlap") != job.policy {
        let detail = format!("status says overlap {:?}; every invocation gave {}", s(status, "overlap"), job.policy);
        t.flag("status misreports", subject, detail, None, Vec::new());
    }
}

/// The job's triggered runs: each as [`check_view`] does a slot, and each id acknowledged (a `trigger` that
/// exited 0) run by the end.
fn check_triggers(t: &mut Tally, job: &str, status: &serde_json::Value, controls: &[Control], mine: &[&Execution]) {
    let views: BTreeMap<String, &serde_json::Value> = status
        .get("triggers")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|pair| Some((pair.get(0)?.as_str()?.to_owned(), pair.get(1)?)))
        .collect();
    for (id, view) in &views {
        let key = format!("trigger {id}");
        let execs: Vec<&&Execution> = mine.iter().filter(|e| e.key == key).collect();
        check_view(t, job, &key, view, &execs);
    }
    let acked: std::collections::BTreeSet<&str> = controls
        .iter()
        .filter(|c| c.job == job && c.what == "trigger" && c.code == Some(0))
        .filter_map(|c| c.id.as_deref())
        .collect();
    t.note("triggers acknowledged", acked.len() as u64);
    for id in acked {
        let key = format!("trigger {id}");
        let ran = mine.iter().any(|e| e.key == key && e.completed);
        let state = views.get(id).map_or("absent", |v| s(v, "state"));
        if !ran {
            let detail = format!("trigger {id} was acknowledged; after the final invocations status says {state}");
            t.flag("trigger not run", format!("job {job} {key}"), detail, None, Vec::new());
        }
    }
}

/// The job's line of `idem once list`: its last slot and state as `status` says, not paused.
fn check_list(t: &mut Tally, job: &str, status: &serde_json::Value, list: &serde_json::Value) {
    let subject = format!("job {job}");
    let Some(line) = list.as_array().into_iter().flatten().find(|j| s(j, "name") == job) else {
        t.flag("list misreports", subject, "idem once list --format json does not show it".into(), None, vec![]);
        return;
    };
    let last = s(status, "last_slot");
    let state = status
        .get("slots")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .find(|v| s(v, "slot") == last)
        .map_or("none", |v| s(v, "state"));
    // `list` reads the entry alone (no lease): a crashed slot is `running` there.
    let state = if state == "crashed" { "running" } else { state };
    let paused = line.get("pause").and_then(|p| p.get("paused")).and_then(serde_json::Value::as_bool);
    let mut wrong = Vec::new();
    if s(line, "last_slot") != last || s(line, "last_state") != state {
        wrong.push(format!(
            "list says last slot {} {}, status {last} {state}",
            s(line, "last_slot"),
            s(line, "last_state")
        ));
    }
    if paused == Some(true) {
        wrong.push("list says paused after the final resume".into());
    }
    if !wrong.is_empty() {
        t.flag("list misreports", subject, wrong.join("; "), None, Vec::new());
    }
}

/// Every invocation's and control command's exit status within its documented set; an invocation killed only
/// by the nemesis.
fn check_exits(t: &mut Tally, invocations: &[Invocation], controls: &[Control], faults: &[Fault]) {
    for inv in invocations {
        match inv.code {
            Some(c) => {
                t.note(&format!("invocations exit {c}"), 1);
                if !INVOCATION_EXITS.contains(&c) {
                    t.note("exits outside the set", 1);
                    let detail = format!("exited {c}; idem once exits 0, 1, 3, 4, 6 or 75 here (see its log)");
                    t.flag("exit status outside its set", inv.label.clone(), detail, Some(inv.end_us), Vec::new());
                }
            }
            None => {
                t.note("invocations killed", 1);
                let killed = faults.iter().any(|f| f.kind == "kill9" && f.target == inv.label);
                if !killed {
                    let detail = "killed by a signal the nemesis did not send".to_owned();
                    t.flag("exit status outside its set", inv.label.clone(), detail, Some(inv.end_us), Vec::new());
                }
            }
        }
    }
    for c in controls {
        let first_ok = invocations
            .iter()
            .filter(|i| i.job == c.job && i.code == Some(0))
            .map(|i| i.end_us)
            .min()
            .unwrap_or(Micros::MAX);
        let ok = match c.code {
            Some(0 | 75) => true,
            Some(3) => c.start_us <= first_ok,
            _ => false,
        };
        if !ok {
            t.note("exits outside the set", 1);
            let detail = format!("exited {:?}; a control command exits 0 or 75 here: {}", c.code, c.out.trim());
            t.flag(
                "exit status outside its set",
                format!("idem once {} --name {}", c.what, c.job),
                detail,
                None,
                vec![],
            );
        }
    }
}

/// The history file's lines: invocations, control commands, executions, the final status.
fn history(rec: &Record, execs: &[Execution]) -> Vec<(Micros, serde_json::Value)> {
    let mut h: Vec<(Micros, serde_json::Value)> = Vec::new();
    h.push((0, serde_json::json!({ "jobs": rec.jobs })));
    for i in &rec.invocations {
        h.push((i.start_us, serde_json::json!({ "invocation": i })));
    }
    for c in &rec.controls {
        h.push((c.start_us, serde_json::json!({ "control": c })));
    }
    for e in execs {
        let line = serde_json::json!({ "execution": { "job": e.job, "run": e.key, "runner": e.runner, "pid": e.pid,
            "attempt": e.attempt, "start_us": e.start_us, "last_us": e.last_us, "completed": e.completed } });
        h.push((e.start_us, line));
    }
    let end = rec.invocations.iter().map(|i| i.end_us).max().unwrap_or(0);
    h.push((end, serde_json::json!({ "status": rec.status, "list": rec.list })));
    h
}

fn page(opts: &Options, a: &Anomaly, rec: &Record, execs: &[Execution], faults: &[Fault]) -> std::path::PathBuf {
    let mut rows = Vec::new();
    let shown =
        |e: &&Execution| a.subject == format!("job {} {}", e.job, e.key) || a.subject == format!("job {}", e.job);
    for e in execs.iter().filter(shown) {
        rows.push(Row {
            lane: format!("idem once pid {}", e.runner),
            label: format!("{} {} attempt {}{}", e.job, e.key, e.attempt, if e.completed { "" } else { " (cut)" }),
            start: e.start_us,
            end: Some(e.last_us),
            culprit: Some(e.start_us) == a.at_us,
        });
    }
    for i in rec.invocations.iter().filter(|i| a.subject == i.label) {
        rows.push(Row {
            lane: i.label.clone(),
            label: format!("exit {:?}", i.code),
            start: i.start_us,
            end: Some(i.end_us),
            culprit: true,
        });
    }
    crate::report::write_page(opts, a, rows, faults)
}

#[cfg(test)]
#[path = "check_tests.rs"]
mod tests;
