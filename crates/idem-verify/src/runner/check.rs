//! Checking the runner workload, per item of every batch:
//!
//! - it ends with a valid output (JSON naming the item) and `idem run --dry-run` lists nothing left to run
//!   (the ledger says done and the file has the recorded digest);
//! - it executed at most once plus once per attempt cut short: an execution whose runner was killed or paused
//!   after it started (a paused runner's lease lapses and another takes the item over);
//! - no output of a fenced-out holder: the fencing token found at the final path never goes down (a holder
//!   taken over must not rename its output over its successor's), and the final file is the last holder's;
//! - every runner that was not killed exited 0.

use std::collections::BTreeMap;

use super::Batch;
use super::exec_item::{ItemRun, Output};
use crate::history::{Clock, Fault, Micros};
use crate::report::Row;
use crate::{Anomaly, Options, Summary};

/// Checks every batch, writes the history, and sums it up.
pub fn summarize(opts: &Options, clock: &Clock, wall0: u64, batches: &[Batch]) -> Summary {
    let faults = clock.faults();
    let mut anomalies = Vec::new();
    let mut notes: BTreeMap<String, u64> = BTreeMap::new();
    let mut history: Vec<(Micros, serde_json::Value)> = Vec::new();
    let mut all_runs = Vec::new();
    let mut items = 0;
    for b in batches {
        let runs: Vec<ItemRun> = std::fs::read_to_string(&b.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let at = |r: &ItemRun| r.start_ms.saturating_sub(wall0) * 1000;
        for r in &runs {
            history.push((at(r), serde_json::json!({ "batch": b.n, "execution": r })));
        }
        for (id, token, t) in &b.seen {
            history.push((*t, serde_json::json!({ "batch": b.n, "final_path": id, "token": token })));
        }
        *notes.entry("executions".into()).or_default() += runs.len() as u64;
        *notes.entry("runner processes".into()).or_default() += b.exits.len() as u64;
        items += b.items.len();
        let mut anomaly = |kind: &str, subject: String, detail: String, at_us: Option<Micros>| {
            anomalies.push(Anomaly { kind: kind.into(), subject, detail, at_us, ops: Vec::new() });
        };
        for x in &b.exits {
            // Exit 1 (items ended by a ledger that failed) and 2 (a ledger that cannot be opened) are documented:
            // allowed when the store was restarted or its link broken while the runner ran.
            let store_fault = faults
                .iter()
                .any(|f| !f.target.starts_with("idem run") && f.start_us <= x.end_us && f.end_us >= x.start_us);
            match x.code {
                Some(0) | None => {}
                Some(c @ (1 | 2)) if store_fault => {
                    *notes.entry(format!("runs ended by a ledger failure (exit {c})")).or_default() += 1
                }
                Some(c) => anomaly(
                    "runner failed",
                    x.label.clone(),
                    format!("exited {c} (see its log in batch-{})", b.n),
                    None,
                ),
            }
        }
        if b.timed_out {
            anomaly(
                "not finished",
                format!("batch {}", b.n),
                format!("the runners had not finished within {:?}", super::BATCH_LIMIT),
                None,
            );
        }
        if b.dry_run.1 != Some(0) || !b.dry_run.0.trim().is_empty() {
            anomaly(
                "not done",
                format!("batch {}", b.n),
                format!("idem run --dry-run afterwards (exit {:?}): {}", b.dry_run.1, b.dry_run.0.trim()),
                None,
            );
        }
        // Executions cut short: a fault that can cost their runner the lease came while they ran or were being
        // settled (the command's time, then 2 s for the rename and the done write): a kill or pause of their
        // runner; on a shared SQLite ledger a pause of any runner (one stopped while holding its turn stalls
        // the others' renewals, as documented); a store restart or link fault.
        let shared_sqlite = opts.backend == crate::Backend::Sqlite;
        let cut = |r: &ItemRun| {
            let end = at(r) + r.id.parse::<u64>().unwrap_or(0) * 1000 + 2_000_000;
            faults.iter().any(|f| {
                let relevant = f.target.ends_with(&format!("(pid {})", r.runner))
                    || (shared_sqlite && f.kind == "pause")
                    || !f.target.starts_with("idem run");
                relevant && f.end_us >= at(r) && f.start_us <= end
            })
        };
        for id in &b.items {
            let subject = format!("batch {} item {id}", b.n);
            let mine: Vec<&ItemRun> = runs.iter().filter(|r| &r.id == id).collect();
            let cut_short = mine.iter().filter(|r| cut(r)).count();
            *notes.entry("executions cut short by a fault".into()).or_default() += cut_short as u64;
            if mine.len() > 1 + cut_short {
                anomaly(
                    "executed too often",
                    subject.clone(),
                    format!(
                        "{} executions, {cut_short} of them cut short by a kill or pause: the bound is {}",
                        mine.len(),
                        1 + cut_short
                    ),
                    mine.last().map(|r| at(r)),
                );
            }
            let output = std::fs::read(b.out.join(format!("{id}.json")))
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Output>(&bytes).ok());
            let newest = mine.iter().map(|r| r.token).max();
            match output {
                None => {
                    anomaly("no valid output", subject.clone(), "the final path holds no valid output".into(), None)
                }
                Some(o) if o.id != *id => {
                    anomaly("no valid output", subject.clone(), format!("the output names item {}", o.id), None)
                }
                Some(o) if Some(o.token) != newest => anomaly(
                    "output of a fenced-out holder",
                    subject.clone(),
                    format!("the final output has fencing token {}, the item's last holder had {newest:?}", o.token),
                    None,
                ),
                Some(_) => {}
            }
            let tokens: Vec<(u64, Micros)> =
                b.seen.iter().filter(|(i, _, _)| i == id).map(|(_, t, at)| (*t, *at)).collect();
            if let Some(w) = tokens.windows(2).find(|w| w[1].0 < w[0].0) {
                anomaly(
                    "output of a fenced-out holder",
                    subject.clone(),
                    format!("the output of token {} replaced that of token {}, a newer holder", w[1].0, w[0].0),
                    Some(w[1].1),
                );
            }
        }
        all_runs.push((b.n, runs, wall0));
    }
    let path = opts.out.join("history.jsonl");
    if let Err(e) = crate::history::write_jsonl(&path, &history, &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", path.display());
    }
    let failure_page = anomalies.first().map(|a| page(opts, a, batches, &all_runs, &faults));
    let runs = notes.get("executions").copied().unwrap_or(0) as usize;
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: runs,
        unknown: 0,
        answers: BTreeMap::new(),
        faults: clock.fault_counts(),
        histories: items,
        anomalies,
        notes,
        seconds: 0.0,
        history: path,
        failure_page,
    }
}

fn page(
    opts: &Options,
    a: &Anomaly,
    batches: &[Batch],
    runs: &[(usize, Vec<ItemRun>, u64)],
    faults: &[Fault],
) -> std::path::PathBuf {
    let mut rows = Vec::new();
    for (b, (n, runs, wall0)) in batches.iter().zip(runs) {
        for r in runs.iter().filter(|r| a.subject == format!("batch {n} item {}", r.id)) {
            let start = r.start_ms.saturating_sub(*wall0) * 1000;
            let ms: u64 = r.id.parse().unwrap_or(0);
            rows.push(Row {
                lane: format!("pid {}", r.runner),
                label: format!("execution token {} attempt {}", r.token, r.attempt),
                start,
                end: Some(start + ms * 1000),
                culprit: false,
            });
        }
        for (id, token, at) in b.seen.iter().filter(|(id, _, _)| a.subject == format!("batch {} item {id}", b.n)) {
            rows.push(Row {
                lane: "final path".into(),
                label: format!("{id}.json now token {token}"),
                start: *at,
                end: Some(*at),
                culprit: Some(*at) == a.at_us,
            });
        }
    }
    crate::report::write_page(opts, a, rows, faults)
}
