//! Checking the proxy workload against the upstream's execution log:
//!
//! - a reused-key probe (the key with another body) never executes: it is refused (422) whatever state the
//!   record is in, also after its holder lost its lease;
//! - every 2xx a client saw names an execution of its own key that the log holds exactly once;
//! - every replay of a key names the same execution (a finished record never changes);
//! - a key executes again only when a fault that can cost a holder its lease (a kill -9 or pause of a proxy, a
//!   store restart or link fault, a full disk) came between the two executions: the documented exception
//!   ("if the proxy itself dies mid-request ... a retry executes again"); these are counted;
//! - the stored outcome (the replays) is never older than an execution of the key that no fault interrupted:
//!   a holder that lost its lease must not overwrite its successor's record.
//!
//! Answers of unknown outcome (502/504 `outcome-unknown`) are counted; idem never executes their key again.

use std::collections::{BTreeMap, HashMap};

use super::upstream::Execution;
use super::{Attempt, answers, body_for};
use crate::history::{Clock, Fault, Micros};
use crate::report::Row;
use crate::{Anomaly, Options, Summary};

/// Whether `f` can make a proxy lose a lease: anything but a fault on the upstream link.
fn costs_a_lease(f: &Fault) -> bool {
    f.target != "upstream link"
}

/// Whether a fault that can cost a lease came while `e` ran or was being completed (its upstream time, then 3 s).
/// A kill or pause of a proxy that ended within 100 ms of the execution's start did not touch it: a stopped or
/// dead proxy forwards nothing, so the execution came through after it (or through the other proxy).
fn touched(e: &Execution, faults: &[Fault]) -> bool {
    let end = e.start_us + delay_of(&e.key) + 3_000_000;
    faults.iter().any(|f| {
        let grace = if f.target.starts_with("idem serve") { 100_000 } else { 0 };
        costs_a_lease(f) && f.start_us <= end && f.end_us > e.start_us + grace
    })
}

fn delay_of(key: &str) -> Micros {
    let body = body_for(key);
    let ms: u64 = body.trim_matches(|c: char| !c.is_ascii_digit()).parse().unwrap_or(0);
    ms * 1000
}

/// Checks, writes the history, and sums it up.
pub fn summarize(opts: &Options, clock: &Clock, mut attempts: Vec<Attempt>, executions: &[Execution]) -> Summary {
    attempts.sort_by_key(|a| a.invoke_us);
    let faults = clock.faults();
    let by_exec: HashMap<u64, &Execution> = executions.iter().map(|e| (e.exec, e)).collect();
    let mut execs_of: BTreeMap<&str, Vec<&Execution>> = BTreeMap::new();
    for e in executions {
        execs_of.entry(e.key.as_str()).or_default().push(e);
    }
    for execs in execs_of.values_mut() {
        execs.sort_by_key(|e| e.start_us);
    }
    let mut anomalies = Vec::new();
    let mut notes: BTreeMap<String, u64> = BTreeMap::new();
    let mut note = |k: &str, n: u64| *notes.entry(k.to_owned()).or_default() += n;
    note("executions", executions.len() as u64);
    note("keys executed", execs_of.len() as u64);
    let mut keys: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
    for a in &attempts {
        keys.entry(a.key.as_str()).or_default().push(a);
    }
    for (key, tries) in &keys {
        let execs = execs_of.get(key).cloned().unwrap_or_default();
        let mut anomaly = |kind: &str, detail: String, a: Option<&Attempt>| {
            anomalies.push(Anomaly {
                kind: kind.into(),
                subject: (*key).to_owned(),
                detail,
                at_us: a.and_then(|a| a.complete_us),
                ops: a.map(|a| vec![a.id]).unwrap_or_default(),
            });
        };
        for e in execs.iter().filter(|e| e.reused) {
            anomaly(
                "reused key executed",
                format!("execution {} ran a reused-key probe's body: the key was claimed by another request", e.exec),
                None,
            );
        }
        for a in tries.iter().filter(|a| a.reused) {
            match (a.status, a.problem.as_deref()) {
                (Some(422), Some(p)) if p.ends_with("idempotency-key-reused") => note("reused-key probes refused", 1),
                (None, _) | (Some(500..=599), _) => note("reused-key probes unanswered", 1),
                (status, problem) => anomaly(
                    "reused key accepted",
                    format!(
                        "attempt #{} sent the key with another body after it was answered, and got {status:?} {problem:?} (exec {:?}) instead of 422",
                        a.id, a.exec
                    ),
                    Some(a),
                ),
            }
        }
        let tries: Vec<&Attempt> = tries.iter().copied().filter(|a| !a.reused).collect();
        for a in &tries {
            match (a.status, a.exec) {
                (Some(200..=299), Some(e)) => match by_exec.get(&e) {
                    Some(x) if x.key == *key => {}
                    Some(x) => anomaly(
                        "answer from another key",
                        format!("attempt #{} got execution {e} of {}", a.id, x.key),
                        Some(a),
                    ),
                    None => anomaly(
                        "answer from no execution",
                        format!("attempt #{} got execution {e}, which the upstream never logged", a.id),
                        Some(a),
                    ),
                },
                (Some(200..=299), None) => anomaly(
                    "answer from no execution",
                    format!("attempt #{} got a 2xx naming no execution", a.id),
                    Some(a),
                ),
                (Some(s @ 400..=500), _)
                    if !(s == 409 && a.problem.as_deref().is_some_and(|p| p.ends_with("request-in-flight"))) =>
                {
                    anomaly(&format!("answered {s}"), format!("attempt #{} got {s} {:?}", a.id, a.problem), Some(a));
                }
                (Some(502 | 504), _) if a.problem.as_deref().is_some_and(|p| p.ends_with("outcome-unknown")) => {
                    note("outcome-unknown answers", 1);
                }
                _ => {}
            }
        }
        let replays: Vec<&Attempt> = tries.iter().copied().filter(|a| a.replayed && a.exec.is_some()).collect();
        note("replays", replays.len() as u64);
        if let Some(first) = replays.first()
            && let Some(other) = replays.iter().find(|a| a.exec != first.exec)
        {
            anomaly(
                "replays changed",
                format!(
                    "attempt #{} replayed execution {:?}, attempt #{} later replayed {:?}",
                    first.id, first.exec, other.id, other.exec
                ),
                Some(other),
            );
        }
        for pair in execs.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            let cause =
                faults.iter().find(|f| costs_a_lease(f) && f.start_us <= next.start_us && f.end_us >= prev.start_us);
            match cause {
                Some(f) => note(&format!("re-executions after {}", f.kind), 1),
                None => anomaly(
                    "executed twice",
                    format!(
                        "executions {} and {} of one key, with no fault between them that could cost a lease",
                        prev.exec, next.exec
                    ),
                    None,
                ),
            }
        }
        // The newest execution that no fault touched must be what the record holds.
        let untouched = execs.iter().rev().find(|e| !touched(e, &faults));
        if let (Some(stored), Some(newest)) =
            (replays.last().and_then(|a| a.exec).and_then(|e| by_exec.get(&e)), untouched)
            && stored.start_us < newest.start_us
        {
            anomaly(
                "stale outcome stored",
                format!(
                    "the record replays execution {}, older than execution {}, which no fault interrupted: a holder that had lost its lease overwrote its successor's outcome",
                    stored.exec, newest.exec
                ),
                replays.last().copied(),
            );
        }
    }
    let history = opts.out.join("history.jsonl");
    let mut timed: Vec<(Micros, serde_json::Value)> =
        attempts.iter().map(|a| (a.invoke_us, serde_json::to_value(a).unwrap_or_default())).collect();
    timed.extend(executions.iter().map(|e| (e.start_us, serde_json::json!({ "execution": e }))));
    if let Err(e) = crate::history::write_jsonl(&history, &timed, &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", history.display());
    }
    let failure_page = anomalies.first().map(|a| page(opts, a, &attempts, executions, &faults));
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: attempts.len(),
        unknown: attempts.iter().filter(|a| a.status.is_none()).count(),
        answers: answers(&attempts),
        faults: clock.fault_counts(),
        histories: keys.len(),
        anomalies,
        notes,
        seconds: 0.0,
        history,
        failure_page,
    }
}

fn page(
    opts: &Options,
    a: &Anomaly,
    attempts: &[Attempt],
    executions: &[Execution],
    faults: &[Fault],
) -> std::path::PathBuf {
    let mut rows: Vec<Row> = attempts
        .iter()
        .filter(|t| t.key == a.subject)
        .map(|t| Row {
            lane: if t.client == u32::MAX { "final".into() } else { format!("client {}", t.client) },
            label: format!(
                "#{} proxy {} -> {}{}{}",
                t.id,
                t.proxy,
                t.status.map_or("no answer".into(), |s| s.to_string()),
                t.exec.map_or(String::new(), |e| format!(" exec {e}")),
                if t.replayed { " (replay)" } else { "" }
            ),
            start: t.invoke_us,
            end: t.complete_us,
            culprit: a.ops.contains(&t.id),
        })
        .collect();
    rows.extend(executions.iter().filter(|e| e.key == a.subject).map(|e| Row {
        lane: "upstream".into(),
        label: format!("execution {}", e.exec),
        start: e.start_us,
        end: Some(e.start_us + delay_of(&e.key)),
        culprit: false,
    }));
    crate::report::write_page(opts, a, rows, faults)
}
