//! The conformance report: each probe's verdict, as a table for people or JSON for CI.

use std::fmt::Write as _;

use serde::Serialize;

use super::http::Logged;
use super::target::{Caller, Planned, Target, shown};

/// A probe's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// The API behaves as the reference says.
    #[serde(rename = "PASS")]
    Pass,
    /// It does not: a duplicate executed, a key leaked, a malformed key was accepted. Exit status 1.
    #[serde(rename = "FAIL")]
    Fail,
    /// Allowed but against the guidance (a 503 pinned to a key), or the probe could not be made to bite.
    #[serde(rename = "WARN")]
    Warn,
    /// Not checked: the probe needs a flag, or only reports (a missing key without `--key-required`).
    #[serde(rename = "N/A")]
    NotApplicable,
}

impl Outcome {
    /// `PASS`, `FAIL`, `WARN` or `N/A`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Warn => "WARN",
            Outcome::NotApplicable => "N/A",
        }
    }
}

/// What a probe found: its result and the observation behind it.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// PASS, FAIL, WARN or N/A.
    pub outcome: Outcome,
    /// What was sent and seen, in a sentence or two.
    pub observed: String,
}

impl Verdict {
    /// A PASS.
    pub fn pass(observed: impl Into<String>) -> Self {
        Self { outcome: Outcome::Pass, observed: observed.into() }
    }

    /// A FAIL.
    pub fn fail(observed: impl Into<String>) -> Self {
        Self { outcome: Outcome::Fail, observed: observed.into() }
    }

    /// A WARN.
    pub fn warn(observed: impl Into<String>) -> Self {
        Self { outcome: Outcome::Warn, observed: observed.into() }
    }

    /// An N/A.
    pub fn not_applicable(observed: impl Into<String>) -> Self {
        Self { outcome: Outcome::NotApplicable, observed: observed.into() }
    }
}

/// One row of the report.
#[derive(Debug, Serialize)]
pub struct ProbeReport {
    /// The probe's name (`--only` takes it).
    pub probe: &'static str,
    /// What it checks, in a few words.
    pub title: &'static str,
    /// The section of draft-ietf-httpapi-idempotency-key-header (or Stripe's documented behaviour) it checks.
    pub spec: &'static str,
    /// What a conforming API answers.
    pub expected: String,
    /// What this one answered.
    pub observed: String,
    /// PASS, FAIL, WARN or N/A.
    pub result: Outcome,
    /// The requests the probe sent, with what each came to.
    pub requests: Vec<RequestReport>,
}

/// A request of the report: what was sent and what came back.
#[derive(Debug, Serialize)]
pub struct RequestReport {
    /// What it was for.
    pub note: &'static str,
    /// The method.
    pub method: String,
    /// The URL.
    pub url: String,
    /// Its `Idempotency-Key` field lines.
    pub idempotency_key: Vec<String>,
    /// Whose credential went with it.
    pub caller: Caller,
    /// `main` (the body given) or `other` (the payload-mismatch body).
    pub body: &'static str,
    /// What came back; absent when it was not sent (the probe stopped before it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<Logged>,
    /// Why no answer came, when it was sent and none came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RequestReport {
    /// `planned` with what it came to (`None`: not sent).
    pub fn new(planned: &Planned, logged: Option<Result<Logged, String>>) -> Self {
        let (answer, error) = match logged {
            Some(Ok(answer)) => (Some(answer), None),
            Some(Err(error)) => (None, Some(error)),
            None => (None, None),
        };
        Self {
            note: planned.note,
            method: planned.method.to_string(),
            url: shown(&planned.url),
            idempotency_key: planned.key_texts(),
            caller: planned.caller,
            body: if planned.variant { "other" } else { "main" },
            answer,
            error,
        }
    }
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The method and URL under test.
    pub target: String,
    /// The prefix of every key sent.
    pub key_prefix: String,
    /// Requests sent, and how many got an answer.
    pub requests_sent: usize,
    /// Requests that got an answer.
    pub requests_answered: usize,
    /// One entry per probe run, in order.
    pub probes: Vec<ProbeReport>,
    /// How many probes ended with each result.
    pub counts: Counts,
    /// The exit status: 0 when no probe failed, else 1.
    pub exit_status: i32,
}

/// Results counted.
#[derive(Debug, Default, Serialize)]
pub struct Counts {
    /// PASS.
    pub pass: usize,
    /// FAIL.
    pub fail: usize,
    /// WARN.
    pub warn: usize,
    /// N/A.
    #[serde(rename = "n/a")]
    pub not_applicable: usize,
}

impl Report {
    /// The report of `probes` for `target`, counted, with its exit status.
    pub fn new(target: &Target, sent: (usize, usize), probes: Vec<ProbeReport>) -> Self {
        let mut counts = Counts::default();
        for probe in &probes {
            *match probe.result {
                Outcome::Pass => &mut counts.pass,
                Outcome::Fail => &mut counts.fail,
                Outcome::Warn => &mut counts.warn,
                Outcome::NotApplicable => &mut counts.not_applicable,
            } += 1;
        }
        let exit_status = i32::from(counts.fail > 0);
        Self {
            target: format!("{} {}", target.method, shown(&target.url)),
            key_prefix: format!("{}-", target.run),
            requests_sent: sent.0,
            requests_answered: sent.1,
            probes,
            counts,
            exit_status,
        }
    }

    /// The table: one row per probe, the long columns wrapped, then a summary line.
    pub fn table(&self) -> String {
        const WIDTHS: [usize; 5] = [12, 6, 30, 50, 18];
        let mut out = String::new();
        let header = ["PROBE", "RESULT", "EXPECTED", "OBSERVED", "SPEC"].map(|h| vec![h.to_owned()]);
        write_row(&mut out, &WIDTHS, &header);
        for probe in &self.probes {
            let cells = [
                vec![probe.probe.to_owned()],
                vec![probe.result.label().to_owned()],
                wrap(&probe.expected, WIDTHS[2]),
                wrap(&probe.observed, WIDTHS[3]),
                wrap(probe.spec, WIDTHS[4]),
            ];
            write_row(&mut out, &WIDTHS, &cells);
        }
        let c = &self.counts;
        let _ = writeln!(
            out,
            "{} PASS, {} FAIL, {} WARN, {} N/A; {} sent, keys {}*",
            c.pass,
            c.fail,
            c.warn,
            c.not_applicable,
            crate::error::count(self.requests_sent, "request", "requests"),
            self.key_prefix
        );
        out
    }
}

/// Writes one row whose cells may span several lines.
fn write_row(out: &mut String, widths: &[usize; 5], cells: &[Vec<String>; 5]) {
    let lines = cells.iter().map(Vec::len).max().unwrap_or(1);
    for line in 0..lines {
        let mut text = String::new();
        for (column, (cell, width)) in cells.iter().zip(widths).enumerate() {
            let part = cell.get(line).map_or("", String::as_str);
            if column + 1 == cells.len() {
                text.push_str(part);
            } else {
                let _ = write!(text, "{part:<width$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
}

/// `text` in lines of at most `width` characters, broken between words (a longer word gets a line of its own).
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}
