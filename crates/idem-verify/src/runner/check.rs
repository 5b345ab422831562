//! Checking the runner workload, per item of every batch:
//!
//! - it ends with a valid output (JSON naming the item) and `idem run --dry-run` lists nothing left to run
//!   (the ledger says done and the file has the recorded digest);
//! - it executed at most once plus once per attempt cut short: an execution whose runner was killed or paused
//!   after it started (a paused runner's lease lapses and another takes the item over). A store fault (an
//!   outage, a restart, a link dropped or slowed) excuses nothing: it strikes every runner alike, and the
//!   runners judge a holder gone by watching it for a lease after the store is back, so the holder takes its
//!   lease again first;
//! - no output of a fenced-out holder: the fencing token found at the final path never goes down (a holder
//!   taken over must not rename its output over its successor's), and the final file is the last holder's;
//! - every runner that was not killed exited 0 (none is replaced, store outages included), and no item was
//!   reported failed by any runner;
//! - on a shared SQLite ledger, in all: executions at most items + executions cut short by a kill or pause of
//!   their own runner (`sqlite_bound`): a pause costs the paused runner's items in flight (a real takeover),
//!   never the others' (their renewals wait for the paused runner's turn, they are not given up), and a
//!   locked ledger costs none;
//! - a failover (highly available backends) excuses nothing either: an item executed beyond its bound across it
//!   is an anomaly, counted besides as a loss (`executions repeated`: a claim or a done mark the old primary
//!   acknowledged and the promoted one lacks), as is an item the dry run lists again afterwards
//!   (`acknowledged writes missing`).

use std::collections::BTreeMap;

use super::Batch;
use super::exec_item::{ItemRun, Output};
use crate::history::{Clock, Fault, Micros};
use crate::report::Row;
use crate::tally::Tally;
use crate::{Anomaly, Options, Summary};

/// Checks every batch, writes the history, and sums it up.
pub fn summarize(opts: &Options, clock: &Clock, wall0: u64, batches: &[Batch]) -> Summary {
    let faults = clock.faults();
    let mut t = Tally::new(opts.backend.is_ha());
    let mut history: Vec<(Micros, serde_json::Value)> = Vec::new();
    let mut all_runs = Vec::new();
    let mut items = 0;
    let (mut sqlite_executions, mut sqlite_items, mut sqlite_own) = (0, 0, 0);
    // Shown even when nothing exited: the figure must be 0.
    t.note("runner exits", 0);
    t.note("items failed", 0);
    let failover = faults.iter().any(|f| crate::HaFault::is_ha(&f.kind));
    let shared_sqlite = opts.backend == crate::Backend::Sqlite;
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
        t.note("executions", runs.len() as u64);
        t.note("runner processes", b.exits.len() as u64);
        items += b.items.len();
        check_runners(&mut t, b, failover);
        let cut = |r: &ItemRun| faults.iter().any(|f| excuses(f, r, at(r), shared_sqlite, &faults));
        for id in &b.items {
            check_item(&mut t, b, id, &runs, &at, &cut, failover);
        }
        if shared_sqlite {
            // Only faults of the execution's own runner (`excuses` without the shared-ledger exemption).
            let own = |r: &ItemRun| faults.iter().any(|f| excuses(f, r, at(r), false, &faults));
            sqlite_executions += runs.len();
            sqlite_items += b.items.len();
            sqlite_own += runs.iter().filter(|r| own(r)).count();
        }
        all_runs.push((b.n, runs, wall0));
    }
    if shared_sqlite {
        let pauses = faults.iter().filter(|f| f.kind == "pause").count();
        let bound = sqlite_bound(sqlite_items, sqlite_own);
        t.note("executions over items", sqlite_executions.saturating_sub(sqlite_items) as u64);
        if sqlite_executions > bound {
            let detail = format!(
                "{sqlite_executions} executions for {sqlite_items} items under {pauses} pauses; the bound is \
                 {bound} (items + {sqlite_own} executions cut short by a kill or pause of their own runner; \
                 store faults and other runners' pauses excuse none)"
            );
            t.flag("work multiplied", "the shared SQLite ledger".into(), detail, None, Vec::new());
        }
    }
    let path = opts.out.join("history.jsonl");
    if let Err(e) = crate::history::write_jsonl(&path, &history, &faults) {
        eprintln!("idem-verify: cannot write {}: {e}", path.display());
    }
    let failure_page = t.anomalies.first().map(|a| page(opts, a, batches, &all_runs, &faults));
    let runs = t.notes.get("executions").copied().unwrap_or(0) as usize;
    Summary {
        workload: opts.workload,
        backend: opts.backend,
        seed: opts.seed,
        operations: runs,
        unknown: 0,
        answers: BTreeMap::new(),
        faults: clock.fault_counts(),
        histories: items,
        anomalies: t.anomalies,
        notes: t.notes,
        setting: None,
        losses: t.losses,
        seconds: 0.0,
        history: path,
        failure_page,
    }
}

/// A batch's runners: each exited 0 or was killed, reported no item failed, finished in time, and the dry run
/// afterwards lists nothing left to run.
fn check_runners(t: &mut Tally, b: &Batch, failover: bool) {
    for x in &b.exits {
        // Every exit but 0 is a finding: a store outage within the limit, a pause or a fellow runner's kill
        // must not end a runner (it is not replaced either, so the batch's other runners must finish).
        // `None` is a kill by the nemesis (or by the batch limit, reported below).
        if let Some(c) = x.code.filter(|c| *c != 0) {
            t.note("runner exits", 1);
            let detail = format!("exited {c} (see its log in batch-{})", b.n);
            t.flag("runner exited", x.label.clone(), detail, None, Vec::new());
        }
    }
    // Each runner's report: its command never fails, so an item reported failed (above all one that never
    // ran: a ledger write refused during a store outage) or given up for the store is a finding.
    for (report, item) in reports(b) {
        let status = item.get("status").and_then(|v| v.as_str()).unwrap_or_default();
        if matches!(status, "failed" | "poison" | "store_unavailable") {
            t.note("items failed", 1);
            let attempts = item.get("attempts").and_then(serde_json::Value::as_u64).unwrap_or(0);
            let id = item.get("id").and_then(|v| v.as_str()).unwrap_or_default();
            let error = item.get("last_error").and_then(|v| v.as_str()).unwrap_or_default();
            let detail = format!("{status} after {attempts} attempts ({error}) in {report}");
            t.flag("item failed", format!("batch {} item {id}", b.n), detail, None, Vec::new());
        }
    }
    if b.timed_out {
        let detail = format!("the runners had not finished within {:?}", super::batch_limit(b.items.len()));
        t.flag("not finished", format!("batch {}", b.n), detail, None, Vec::new());
    }
    if b.dry_run.1 != Some(0) || !b.dry_run.0.trim().is_empty() {
        if failover {
            // Items finished (every runner exited 0 or was killed) that the ledger no longer says done.
            let listed = b.dry_run.0.lines().filter(|l| !l.trim().is_empty()).count() as u64;
            t.lose("acknowledged writes missing", listed);
        }
        let detail = format!("idem run --dry-run afterwards (exit {:?}): {}", b.dry_run.1, b.dry_run.0.trim());
        t.flag("not done", format!("batch {}", b.n), detail, None, Vec::new());
    }
}

/// One item: executed at most once plus once per execution a fault cut short, ending with a valid output of
/// its last holder, whose fencing tokens at the final path never went down.
fn check_item(
    t: &mut Tally,
    b: &Batch,
    id: &str,
    runs: &[ItemRun],
    at: &dyn Fn(&ItemRun) -> Micros,
    cut: &dyn Fn(&ItemRun) -> bool,
    failover: bool,
) {
    let subject = format!("batch {} item {id}", b.n);
    let mine: Vec<&ItemRun> = runs.iter().filter(|r| r.id == id).collect();
    let cut_short = mine.iter().filter(|r| cut(r)).count();
    t.note("executions cut short by a fault", cut_short as u64);
    t.note(&format!("items executed {}x", mine.len()), 1);
    if mine.len() > 1 + cut_short {
        if failover {
            t.lose("executions repeated", (mine.len() - 1 - cut_short) as u64);
        }
        let detail = format!(
            "{} executions, {cut_short} of them cut short by a kill or pause of a runner (store faults excuse \
             none): the bound is {}",
            mine.len(),
            1 + cut_short
        );
        t.flag("executed too often", subject.clone(), detail, mine.last().map(|r| at(r)), Vec::new());
    }
    let output = std::fs::read(b.out.join(format!("{id}.json")))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Output>(&bytes).ok());
    let newest = mine.iter().map(|r| r.token).max();
    let wrong = match output {
        None => Some(("no valid output", "the final path holds no valid output".to_owned())),
        Some(o) if o.id != id => Some(("no valid output", format!("the output names item {}", o.id))),
        Some(o) if Some(o.token) != newest => Some((
            "output of a fenced-out holder",
            format!("the final output has fencing token {}, the item's last holder had {newest:?}", o.token),
        )),
        Some(_) => None,
    };
    if let Some((kind, detail)) = wrong {
        t.flag(kind, subject.clone(), detail, None, Vec::new());
    }
    let tokens: Vec<(u64, Micros)> = b.seen.iter().filter(|(i, _, _)| i == id).map(|(_, t, at)| (*t, *at)).collect();
    if let Some(w) = tokens.windows(2).find(|w| w[1].0 < w[0].0) {
        let detail = format!("the output of token {} replaced that of token {}, a newer holder", w[1].0, w[0].0);
        t.flag("output of a fenced-out holder", subject, detail, Some(w[1].1), Vec::new());
    }
}

/// Whether fault `f` can have cut short execution `r` (started at `start`, batch-relative): it came while the
/// command ran or was being settled ([`settled_by`]) and can cost its runner the lease: a kill or pause of that
/// runner, or, on a shared SQLite ledger, a pause of any runner (one stopped while holding the ledger's turn
/// stalls the others' renewals, as documented). A store fault never does: it strikes every runner alike.
fn excuses(f: &Fault, r: &ItemRun, start: Micros, shared_sqlite: bool, faults: &[Fault]) -> bool {
    let relevant = f.target.ends_with(&format!("(pid {})", r.runner)) || (shared_sqlite && f.kind == "pause");
    relevant && f.end_us >= start && f.start_us <= settled_by(r, start, faults)
}

/// When execution `r` (started at `start`) was settled at the latest: its command's `--ms` (the item id), then
/// 2 s for the rename and the done write, and, when a store fault overlapped that, 2 s after the store was back
/// (a finished item waits for the store to be recorded: a runner paused then holds a finished, unrecorded item
/// past its lease, the documented exception). This extends only the window in which a kill or pause of the
/// runner cuts the attempt short; a store fault itself still excuses nothing.
fn settled_by(r: &ItemRun, start: Micros, faults: &[Fault]) -> Micros {
    const SETTLE: Micros = 2_000_000;
    let mut end = start + r.id.parse::<u64>().unwrap_or(0) * 1000 + SETTLE;
    let mut store: Vec<&Fault> =
        faults.iter().filter(|f| f.target.starts_with("store ") || f.target == "sqlite ledger").collect();
    store.sort_by_key(|f| f.start_us);
    for f in store {
        if f.start_us <= end && f.end_us >= start {
            end = end.max(f.end_us + SETTLE);
        }
    }
    end
}

/// The most executions a run on a shared SQLite ledger may take: one per item, one more per execution cut
/// short by a kill or pause of its own runner.
fn sqlite_bound(items: usize, cut_by_own_runner: usize) -> usize {
    items + cut_by_own_runner
}

/// Every item line of every runner report of batch `b` (`report-*.json` beside its `out` directory), with the
/// report's file name. A report is written item by item, one JSON object a line, so a killed runner's partial
/// report still yields the items it finished.
fn reports(b: &Batch) -> Vec<(String, serde_json::Value)> {
    let Some(dir) = b.out.parent() else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("report-") && name.ends_with(".json")) {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for line in text.lines() {
            let line = line.trim_end_matches(',');
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                && v.get("status").is_some()
            {
                found.push((name.clone(), v));
            }
        }
    }
    found
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(kind: &str, target: &str, start_us: Micros, end_us: Micros) -> Fault {
        Fault { kind: kind.into(), target: target.into(), start_us, end_us, detail: String::new() }
    }

    fn run(runner: u32) -> ItemRun {
        // Item "2000": a 2 s command, settled within 2 s more.
        ItemRun { id: "2000".into(), token: 1, attempt: 1, runner, start_ms: 0 }
    }

    #[test]
    fn a_store_fault_excuses_no_execution() {
        let r = run(7);
        for (kind, target) in [
            ("store-outage", "store server"),
            ("store-outage", "sqlite ledger"),
            ("store-restart", "store server"),
            ("net-drop", "store link"),
            ("net-delay", "store link"),
        ] {
            for shared in [false, true] {
                assert!(!excuses(&fault(kind, target, 1_000_000, 3_000_000), &r, 0, shared, &[]), "{kind} {target}");
            }
        }
    }

    #[test]
    fn a_kill_or_pause_of_its_runner_excuses_an_execution_while_it_ran_or_settled() {
        let r = run(7);
        assert!(excuses(&fault("kill9", "idem run #1 (pid 7)", 1_000_000, 1_000_000), &r, 0, false, &[]));
        assert!(excuses(&fault("pause", "idem run #1 (pid 7)", 3_500_000, 6_000_000), &r, 0, false, &[]));
        // After the command and its settling: nothing to cut.
        assert!(!excuses(&fault("kill9", "idem run #1 (pid 7)", 4_500_000, 4_500_000), &r, 0, false, &[]));
        // Another runner's pause only on a shared SQLite ledger (it may hold the ledger's turn).
        let other = fault("pause", "idem run #2 (pid 8)", 1_000_000, 3_000_000);
        assert!(!excuses(&other, &r, 0, false, &[]));
        assert!(excuses(&other, &r, 0, true, &[]));
    }

    /// A planted loss: item 2000 of a batch on a Sentinel setup executed by two runners, 2 s and 12 s in, a
    /// failover between them (its claim lost with the old master), and item 2001 listed by the dry run
    /// afterwards (its done mark lost). Both are anomalies and counted losses.
    #[test]
    fn executions_repeated_and_done_marks_lost_across_a_failover_are_anomalies_and_counted_losses() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        let wall0 = 1_000_000;
        let runs = [
            ItemRun { id: "2000".into(), token: 1, attempt: 1, runner: 7, start_ms: wall0 + 2000 },
            ItemRun { id: "2000".into(), token: 2, attempt: 1, runner: 8, start_ms: wall0 + 12_000 },
            ItemRun { id: "2001".into(), token: 1, attempt: 1, runner: 7, start_ms: wall0 + 2000 },
        ];
        let log = dir.path().join("executions.jsonl");
        let lines: Vec<String> = runs.iter().map(|r| serde_json::to_string(r).unwrap()).collect();
        std::fs::write(&log, lines.join("\n") + "\n").unwrap();
        for (id, token, runner) in [("2000", 2, 8), ("2001", 1, 7)] {
            let o = Output { id: id.into(), token, runner };
            std::fs::write(out.join(format!("{id}.json")), serde_json::to_vec(&o).unwrap()).unwrap();
        }
        let batch = Batch {
            n: 0,
            items: vec!["2000".into(), "2001".into()],
            out,
            log,
            exits: Vec::new(),
            seen: Vec::new(),
            dry_run: ("2001\n".into(), Some(0)),
            timed_out: false,
        };
        let clock = Clock::new();
        clock.fault(fault("failover", "store primary", 6_000_000, 9_000_000));
        let opts = Options {
            backend: crate::Backend::RedisSentinel,
            workload: crate::Workload::Runner,
            seed: 1,
            duration: std::time::Duration::from_secs(1),
            faults: true,
            idem: "idem".into(),
            harness: "idem-verify".into(),
            out: dir.path().to_owned(),
            planted_bug: None,
            clients: 2,
            durable: false,
            lax: crate::Lax::One,
            ha_fault: None,
            failover_at: None,
            only_faults: Vec::new(),
        };
        let s = summarize(&opts, &clock, wall0, &[batch]);
        let kinds: Vec<&str> = s.anomalies.iter().map(|a| a.kind.as_str()).collect();
        assert_eq!(kinds, ["not done", "executed too often"], "{:#?}", s.anomalies);
        assert_eq!(s.losses.get("executions repeated"), Some(&1));
        assert_eq!(s.losses.get("acknowledged writes missing"), Some(&1));
        assert_eq!((s.notes.get("items executed 1x"), s.notes.get("items executed 2x")), (Some(&1), Some(&1)));
    }

    /// A store outage that holds a finished item's rename and done write keeps the attempt unsettled: a pause of
    /// its runner after the settling 2 s but before the store was back (plus 2 s) cuts it short, as the runner
    /// then holds a finished, unrecorded item past its lease (seed 424242017: outage 13.3..17.3 s, pause from
    /// 18.0 s, the item's command 12.9..15.0 s, reported as executed too often). The outage excuses nothing by
    /// itself, and a pause after the extended window still counts.
    #[test]
    fn a_store_fault_holding_the_done_write_extends_the_window_a_pause_cuts_short() {
        let r = run(7);
        let outage = fault("store-outage", "store server", 2_500_000, 6_000_000);
        let pause = fault("pause", "idem run #1 (pid 7)", 7_000_000, 12_000_000);
        assert!(!excuses(&pause, &r, 0, false, &[]), "outside the plain settling window");
        assert!(excuses(&pause, &r, 0, false, std::slice::from_ref(&outage)));
        assert!(!excuses(&outage, &r, 0, false, std::slice::from_ref(&outage)), "a store fault excuses nothing");
        let late = fault("pause", "idem run #1 (pid 7)", 8_500_000, 12_000_000);
        assert!(!excuses(&late, &r, 0, false, std::slice::from_ref(&outage)), "after the store was back and settled");
        let before = fault("store-outage", "store server", 4_500_000, 6_000_000);
        assert!(!excuses(&pause, &r, 0, false, std::slice::from_ref(&before)), "an outage after the settling");
    }

    #[test]
    fn the_sqlite_bound_counts_executions_cut_by_their_own_runner() {
        assert_eq!(sqlite_bound(24, 5), 29);
        let r = run(7);
        // Counted for the bound: faults of the execution's own runner only (no shared-ledger exemption).
        assert!(!excuses(&fault("pause", "idem run #2 (pid 8)", 1_000_000, 3_000_000), &r, 0, false, &[]));
        assert!(excuses(&fault("pause", "idem run #1 (pid 7)", 1_000_000, 3_000_000), &r, 0, false, &[]));
    }
}
