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
//!
//! A failover (highly available backends) costs no lease: their runs use a lease longer than the switch, so a
//! key executed again across it (its claim or its outcome lost with the old primary) is an anomaly, counted
//! besides as a loss (`executions repeated`); a replay that changed is counted as `acknowledged writes
//! missing`.

use std::collections::{BTreeMap, HashMap};

use super::upstream::Execution;
use super::{Attempt, answers, body_for};
use crate::history::{Clock, Fault, Micros};
use crate::report::Row;
use crate::tally::Tally;
use crate::{Anomaly, Options, Summary};

/// Whether `f` can make a proxy lose a lease: anything but a fault on the upstream link or a failover (whose
/// runs hold keys under a lease longer than the switch, [`super::HA_LEASE`]).
fn costs_a_lease(f: &Fault) -> bool {
    f.target != "upstream link" && !crate::HaFault::is_ha(&f.kind)
}

/// The failover that came between two executions of a key starting at `prev` and `next`, if any.
fn failover_between(faults: &[Fault], prev: Micros, next: Micros) -> Option<&Fault> {
    faults.iter().find(|f| crate::HaFault::is_ha(&f.kind) && f.start_us <= next && prev <= f.end_us)
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
    let mut t = Tally::new(opts.backend.is_ha());
    t.note("executions", executions.len() as u64);
    t.note("keys executed", execs_of.len() as u64);
    for execs in execs_of.values() {
        t.note(&format!("keys executed {}x", execs.len()), 1);
    }
    t.note("503 answers", attempts.iter().filter(|a| a.status == Some(503)).count() as u64);
    let mut keys: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
    for a in &attempts {
        keys.entry(a.key.as_str()).or_default().push(a);
    }
    for (key, tries) in &keys {
        let execs = execs_of.get(key).cloned().unwrap_or_default();
        let k = Key { name: key, execs: &execs, by_exec: &by_exec, faults: &faults };
        let tries = k.check_answers(&mut t, tries);
        k.check_executions(&mut t, &tries);
    }
    let history = opts.out.join("history.jsonl");
    let mut timed: Vec<(Micros, serde_json::Value)> =
        attempts.iter().map(|a| (a.invoke_us, serde_json::to_value(a).unwrap_or_default())).collect();
    timed.extend(executions.iter().map(|e| (e.start_us, serde_json::json!({ "execution": e }))));
    if let Err(e) = crate::history::write_jsonl(&history, &timed, &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", history.display());
    }
    let failure_page = t.anomalies.first().map(|a| page(opts, a, &attempts, executions, &faults));
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: attempts.len(),
        unknown: attempts.iter().filter(|a| a.status.is_none()).count(),
        answers: answers(&attempts),
        faults: clock.fault_counts(),
        histories: keys.len(),
        anomalies: t.anomalies,
        notes: t.notes,
        setting: None,
        losses: t.losses,
        seconds: 0.0,
        history,
        failure_page,
    }
}

/// One key's history: its executions (by start) and what the checks of its attempts look up.
struct Key<'a> {
    name: &'a str,
    execs: &'a [&'a Execution],
    by_exec: &'a HashMap<u64, &'a Execution>,
    faults: &'a [Fault],
}

impl Key<'_> {
    fn flag(&self, t: &mut Tally, kind: &str, detail: String, a: Option<&Attempt>) {
        let ops = a.map(|a| vec![a.id]).unwrap_or_default();
        t.flag(kind, self.name.to_owned(), detail, a.and_then(|a| a.complete_us), ops);
    }

    /// Reused-key probes refused, and every other answer from an execution of this key; returns the attempts
    /// that are not probes.
    fn check_answers<'t>(&self, t: &mut Tally, tries: &[&'t Attempt]) -> Vec<&'t Attempt> {
        for e in self.execs.iter().filter(|e| e.reused) {
            let detail =
                format!("execution {} ran a reused-key probe's body: the key was claimed by another request", e.exec);
            self.flag(t, "reused key executed", detail, None);
        }
        for a in tries.iter().filter(|a| a.reused) {
            match (a.status, a.problem.as_deref()) {
                (Some(422), Some(p)) if p.ends_with("idempotency-key-reused") => t.note("reused-key probes refused", 1),
                (None, _) | (Some(500..=599), _) => t.note("reused-key probes unanswered", 1),
                (status, problem) => self.flag(
                    t,
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
                (Some(200..=299), Some(e)) => match self.by_exec.get(&e) {
                    Some(x) if x.key == self.name => {}
                    Some(x) => self.flag(
                        t,
                        "answer from another key",
                        format!("attempt #{} got execution {e} of {}", a.id, x.key),
                        Some(a),
                    ),
                    None => self.flag(
                        t,
                        "answer from no execution",
                        format!("attempt #{} got execution {e}, which the upstream never logged", a.id),
                        Some(a),
                    ),
                },
                (Some(200..=299), None) => self.flag(
                    t,
                    "answer from no execution",
                    format!("attempt #{} got a 2xx naming no execution", a.id),
                    Some(a),
                ),
                (Some(s @ 400..=500), _)
                    if !(s == 409 && a.problem.as_deref().is_some_and(|p| p.ends_with("request-in-flight"))) =>
                {
                    let detail = format!("attempt #{} got {s} {:?}", a.id, a.problem);
                    self.flag(t, &format!("answered {s}"), detail, Some(a));
                }
                (Some(502 | 504), _) if a.problem.as_deref().is_some_and(|p| p.ends_with("outcome-unknown")) => {
                    t.note("outcome-unknown answers", 1);
                }
                _ => {}
            }
        }
        tries
    }

    /// Replays that agree, executions again only across a fault that costs a lease, and a stored outcome no
    /// older than the newest execution no fault touched.
    fn check_executions(&self, t: &mut Tally, tries: &[&Attempt]) {
        let faults = self.faults;
        let replays: Vec<&Attempt> = tries.iter().copied().filter(|a| a.replayed && a.exec.is_some()).collect();
        t.note("replays", replays.len() as u64);
        if let Some(first) = replays.first()
            && let Some(other) = replays.iter().find(|a| a.exec != first.exec)
        {
            if failover_between(faults, first.invoke_us, other.invoke_us).is_some() {
                t.lose("acknowledged writes missing", 1);
            }
            let detail = format!(
                "attempt #{} replayed execution {:?}, attempt #{} later replayed {:?}",
                first.id, first.exec, other.id, other.exec
            );
            self.flag(t, "replays changed", detail, Some(other));
        }
        for pair in self.execs.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            let cause =
                faults.iter().find(|f| costs_a_lease(f) && f.start_us <= next.start_us && f.end_us >= prev.start_us);
            match (cause, failover_between(faults, prev.start_us, next.start_us)) {
                (Some(f), _) => t.note(&format!("re-executions after {}", f.kind), 1),
                (None, Some(f)) => {
                    t.lose("executions repeated", 1);
                    let detail = format!(
                        "executions {} and {} of one key across the failover ({}): the old primary's claim or \
                         outcome did not reach the promoted one",
                        prev.exec, next.exec, f.detail
                    );
                    self.flag(t, "executed twice", detail, None);
                }
                (None, None) => {
                    let detail = format!(
                        "executions {} and {} of one key, with no fault between them that could cost a lease",
                        prev.exec, next.exec
                    );
                    self.flag(t, "executed twice", detail, None);
                }
            }
        }
        // The newest execution that no fault touched must be what the record holds.
        let untouched = self.execs.iter().rev().find(|e| !touched(e, faults));
        if let (Some(stored), Some(newest)) =
            (replays.last().and_then(|a| a.exec).and_then(|e| self.by_exec.get(&e)), untouched)
            && stored.start_us < newest.start_us
        {
            let detail = format!(
                "the record replays execution {}, older than execution {}, which no fault interrupted: a holder that had lost its lease overwrote its successor's outcome",
                stored.exec, newest.exec
            );
            self.flag(t, "stale outcome stored", detail, replays.last().copied());
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backend, Workload};

    fn opts(backend: Backend, out: &std::path::Path) -> Options {
        Options {
            backend,
            workload: Workload::Proxy,
            seed: 1,
            duration: std::time::Duration::from_secs(1),
            faults: true,
            idem: "idem".into(),
            harness: "idem-verify".into(),
            out: out.to_owned(),
            planted_bug: None,
            clients: 1,
            durable: false,
            lax: crate::Lax::One,
            ha_fault: None,
            failover_at: None,
            only_faults: Vec::new(),
        }
    }

    fn answered(id: u64, key: &str, at: Micros, exec: u64, replayed: bool) -> Attempt {
        Attempt {
            id,
            client: 0,
            key: key.into(),
            proxy: 0,
            invoke_us: at,
            complete_us: Some(at + 10),
            status: Some(201),
            replayed,
            exec: Some(exec),
            problem: None,
            reused: false,
        }
    }

    /// A planted loss: key `k` answered from execution 1, the failover, then executed again (its record lost
    /// with the old primary). An anomaly, and a counted loss; the same history without the failover between
    /// the executions is an anomaly too, but no loss of the failover.
    #[test]
    fn an_execution_repeated_across_a_failover_is_an_anomaly_and_a_counted_loss() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Clock::new();
        clock.fault(Fault {
            kind: "failover".into(),
            target: "store primary".into(),
            start_us: 5_000_000,
            end_us: 8_000_000,
            detail: "planted".into(),
        });
        let attempts = vec![answered(1, "k", 1_000_000, 1, false), answered(2, "k", 9_000_000, 2, false)];
        let executions = vec![
            Execution { exec: 1, key: "k".into(), start_us: 1_000_100, reused: false },
            Execution { exec: 2, key: "k".into(), start_us: 9_000_100, reused: false },
        ];
        let s = summarize(&opts(Backend::RedisSentinel, dir.path()), &clock, attempts.clone(), &executions);
        assert_eq!(s.anomalies.len(), 1, "{:#?}", s.anomalies);
        assert_eq!(s.anomalies[0].kind, "executed twice");
        assert_eq!(s.losses.get("executions repeated"), Some(&1));
        assert_eq!(s.losses.get("acknowledged writes missing"), Some(&0));
        assert_eq!(s.notes.get("keys executed 2x"), Some(&1));

        // The executions both after the failover: no loss of it, still an anomaly.
        let clock = Clock::new();
        clock.fault(Fault {
            kind: "failover".into(),
            target: "store primary".into(),
            start_us: 100,
            end_us: 200,
            detail: "planted".into(),
        });
        let s = summarize(&opts(Backend::RedisSentinel, dir.path()), &clock, attempts, &executions);
        assert_eq!(s.anomalies.len(), 1, "{:#?}", s.anomalies);
        assert_eq!(s.losses.get("executions repeated"), Some(&0));
    }

    /// The durable case: one execution replayed after the failover is no anomaly and no loss.
    #[test]
    fn a_replay_across_a_failover_is_no_loss() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Clock::new();
        clock.fault(Fault {
            kind: "failover".into(),
            target: "store primary".into(),
            start_us: 5_000_000,
            end_us: 8_000_000,
            detail: "planted".into(),
        });
        let attempts = vec![answered(1, "k", 1_000_000, 1, false), answered(2, "k", 9_000_000, 1, true)];
        let executions = vec![Execution { exec: 1, key: "k".into(), start_us: 1_000_100, reused: false }];
        let s = summarize(&opts(Backend::PostgresHa, dir.path()), &clock, attempts, &executions);
        assert!(s.anomalies.is_empty(), "{:#?}", s.anomalies);
        assert_eq!(s.losses.values().sum::<u64>(), 0);
        assert_eq!(s.notes.get("keys executed 1x"), Some(&1));
    }
}
