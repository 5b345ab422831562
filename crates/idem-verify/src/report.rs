//! The failure page: a small self-contained HTML file (inline SVG, no script, no external file) showing the
//! operations of the offending key or item on a time line, one row each, so overlaps are visible, with the
//! operation no order fits in red and the faults as shaded bands.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::history::{Fault, Micros};
use crate::kv::KvOp;
use crate::kv::model::Ret;
use crate::{Anomaly, Options};

/// One bar of the time line.
#[derive(Clone, Debug)]
pub struct Row {
    /// Who (client, runner).
    pub lane: String,
    /// What, with its answer.
    pub label: String,
    /// From (µs since the start).
    pub start: Micros,
    /// To; `None`: no answer came (drawn dashed to the right edge).
    pub end: Option<Micros>,
    /// The operation the anomaly names.
    pub culprit: bool,
}

/// How many rows a page shows at most (the last ones before the anomaly).
const MAX_ROWS: usize = 48;

/// Characters of a row's label on the time line (about 7 px each in 12 px monospace: within `left`).
const LABEL_CHARS: usize = 64;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Writes `failure.html` in `opts.out` for `anomaly` with `rows`; returns its path.
pub fn write_page(opts: &Options, anomaly: &Anomaly, rows: Vec<Row>, faults: &[Fault]) -> PathBuf {
    let path = opts.out.join("failure.html");
    let html = page(opts, anomaly, rows, faults);
    if let Err(e) = std::fs::write(&path, html) {
        eprintln!("idem-verify: cannot write {}: {e}", path.display());
    }
    path
}

fn page(opts: &Options, anomaly: &Anomaly, mut rows: Vec<Row>, faults: &[Fault]) -> String {
    rows.sort_by_key(|r| r.start);
    if rows.len() > MAX_ROWS {
        let cut = rows.len() - MAX_ROWS;
        // Keep the culprit's neighbourhood: the rows up to it, and a few after.
        let at = rows.iter().position(|r| r.culprit).unwrap_or(rows.len() - 1);
        let from = (at + 8).min(rows.len()).saturating_sub(MAX_ROWS).min(cut);
        rows = rows.into_iter().skip(from).take(MAX_ROWS).collect();
    }
    let t0 = rows.iter().map(|r| r.start).min().unwrap_or(0);
    let t1 = rows.iter().map(|r| r.end.unwrap_or(r.start)).chain(rows.iter().map(|r| r.start)).max().unwrap_or(t0) + 1;
    let t1 = t1.max(t0 + 1000);
    let (left, width, row_h) = (480.0, 860.0, 22.0);
    let x = |t: Micros| left + (t.saturating_sub(t0).min(t1 - t0)) as f64 / (t1 - t0) as f64 * width;
    let height = rows.len() as f64 * row_h + 60.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="monospace" font-size="12">"#,
        left + width + 20.0
    );
    for f in faults.iter().filter(|f| f.end_us >= t0 && f.start_us <= t1) {
        let (a, b) = (x(f.start_us.max(t0)), x(f.end_us.min(t1)));
        let _ = write!(
            svg,
            r##"<rect x="{a:.1}" y="20" width="{:.1}" height="{:.1}" fill="#f4e3a1" opacity="0.7"/><text x="{a:.1}" y="14" fill="#8a6d00">{} {}</text>"##,
            (b - a).max(2.0),
            height - 40.0,
            escape(&f.kind),
            escape(&f.target)
        );
    }
    for (i, r) in rows.iter().enumerate() {
        let y = 30.0 + i as f64 * row_h;
        let colour = if r.culprit {
            "#d62728"
        } else if r.end.is_none() {
            "#999999"
        } else {
            "#1f77b4"
        };
        let (a, b) = (x(r.start), r.end.map_or(left + width, x));
        let dash = if r.end.is_none() { r#" stroke-dasharray="4 3""# } else { "" };
        let _ = write!(
            svg,
            r#"<text x="4" y="{:.1}" fill="{colour}">{}</text>"#,
            y + 4.0,
            escape(&format!("{:<10} {}", r.lane, r.label).chars().take(LABEL_CHARS).collect::<String>())
        );
        let _ = write!(
            svg,
            r#"<line x1="{a:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="8"{dash}><title>{}</title></line>"#,
            b.max(a + 2.0),
            escape(&format!("{} {}: {}", r.lane, r.label, span(r)))
        );
    }
    let axis_y = height - 14.0;
    for k in 0..=4 {
        let t = t0 + (t1 - t0) * k / 4;
        let _ =
            write!(svg, r##"<text x="{:.1}" y="{axis_y:.1}" fill="#555">{:.3} s</text>"##, x(t) - 20.0, t as f64 / 1e6);
    }
    svg.push_str("</svg>");
    let mut table = String::new();
    for r in &rows {
        let _ = write!(
            table,
            "<tr{}><td>{}</td><td>{}</td><td>{}</td></tr>",
            if r.culprit { r#" class="culprit""# } else { "" },
            escape(&r.lane),
            escape(&r.label),
            span(r)
        );
    }
    format!(
        r#"<!doctype html><html><head><meta charset="utf-8"><title>idem-verify: {kind} on {subject}</title>
<style>body{{font-family:sans-serif;margin:16px}} td{{font-family:monospace;padding:0 8px}} .culprit{{color:#d62728;font-weight:bold}}</style></head>
<body><h1>{kind}: {subject}</h1>
<p>{detail}</p>
<p>workload {workload:?}, backend {backend:?}, seed <b>{seed}</b> (rerun: <code>scripts/verify.sh --workload {wl} --backend {be} --seed {seed}{planted}</code>); history: <code>{history}</code></p>
<p>Each bar is one operation from its invocation to its answer; bars that overlap were concurrent and may take effect in either order. Grey dashed: no answer (unknown outcome). Red: the operation whose answer no order of what came before fits. Shaded: faults.</p>
{svg}
<table>{table}</table></body></html>
"#,
        kind = escape(&anomaly.kind),
        subject = escape(&anomaly.subject),
        detail = escape(&anomaly.detail),
        workload = opts.workload,
        backend = opts.backend,
        wl = format!("{:?}", opts.workload).to_lowercase(),
        be = opts.backend.name(),
        seed = opts.seed,
        // A planted bug is part of what reproduces the run.
        planted = rerun_flags(opts),
        history = escape(&opts.out.join("history.jsonl").display().to_string()),
    )
}

/// The idem-verify flags after `--` that reproduce the run besides backend, workload and seed: a planted bug,
/// and on a highly available backend the replication setting, the items and the failover's instant.
fn rerun_flags(opts: &Options) -> String {
    let mut flags = Vec::new();
    if let Some(b) = &opts.planted_bug {
        flags.push(format!("--planted-bug {}", escape(b)));
    }
    if opts.backend.is_ha() {
        if !opts.durable {
            flags.push(format!("--no-durable {}", if opts.lax == crate::Lax::One { "one" } else { "none" }));
        }
        if let Some(f) = opts.ha_fault {
            flags.push(format!("--ha-fault {}", f.name()));
        }
        flags.push(format!("--duration {}s --clients {}", opts.duration.as_secs(), opts.clients));
        if let Some(at) = opts.failover_at {
            flags.push(format!("--failover-at {}ms", at.as_millis()));
        }
    }
    if flags.is_empty() { String::new() } else { format!(" -- {}", flags.join(" ")) }
}

fn span(r: &Row) -> String {
    match r.end {
        Some(end) => format!("{:.3}..{:.3} s", r.start as f64 / 1e6, end as f64 / 1e6),
        None => format!("{:.3} s.. (no answer)", r.start as f64 / 1e6),
    }
}

/// The failure page of a KV anomaly: the operations on its key.
pub fn kv_page(opts: &Options, anomaly: &Anomaly, ops: &[KvOp], faults: &[Fault]) -> PathBuf {
    let end = anomaly.at_us.unwrap_or(Micros::MAX);
    let rows = ops
        .iter()
        .filter(|op| op.key == anomaly.subject || anomaly.ops.contains(&op.id))
        .filter(|op| op.invoke_us <= end)
        .map(|op| Row {
            lane: if op.client == u32::MAX { "final".into() } else { format!("client {}", op.client) },
            label: format!("#{} {} {}", op.id, describe_call(&op.call), describe_ret(&op.ret)),
            start: op.invoke_us,
            end: op.complete_us,
            culprit: anomaly.ops.contains(&op.id),
        })
        .collect();
    write_page(opts, anomaly, rows, faults)
}

fn describe_call(call: &crate::kv::model::Call) -> String {
    use crate::kv::model::{Call, Pre};
    let pre = |p: &Pre| match p {
        Pre::Any => String::new(),
        Pre::Absent => " if-none-match *".into(),
        Pre::Present => " if-match *".into(),
        Pre::Gen(g) => format!(" if-match {g}"),
    };
    match call {
        Call::Get => "get".into(),
        Call::Put { value, pre: p } => format!("put {value}{}", pre(p)),
        Call::Delete { pre: p } => format!("delete{}", pre(p)),
        Call::Add { delta } => format!("add {delta}"),
        Call::Barrier { at } => format!("barrier at {at} us"),
    }
}

fn describe_ret(ret: &Ret) -> String {
    match ret {
        Ret::Value { value, generation } => format!("-> {value} @{generation}"),
        Ret::NotFound => "-> 404".into(),
        Ret::Written { generation, created } => format!("-> {} @{generation}", if *created { 201 } else { 200 }),
        Ret::Deleted => "-> 204".into(),
        Ret::Refused { current } => format!("-> 412 (current {})", current.map_or("absent".into(), |g| g.to_string())),
        Ret::Added { value, generation } => format!("-> {value} @{generation}"),
        Ret::Unknown { why } => format!("-> ? ({why})"),
        Ret::NotSent => "-> not sent".into(),
    }
}
