//! The recorded history: every operation a client invoked, with its invocation and completion instants and its
//! result, and every fault the harness injected, on one clock (microseconds since the run started).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Microseconds since the start of the run, on the harness's monotonic clock.
pub type Micros = u64;

/// A fault the harness injected, with when it began and ended.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fault {
    /// What was done (`kill9`, `pause`, `store-restart`, `net-drop`, `net-delay`, `disk-full`).
    pub kind: String,
    /// What it was done to (`idem serve`, `idem run #3`, `store link`, `upstream link`, ...).
    pub target: String,
    /// When it began.
    pub start_us: Micros,
    /// When it ended (the process restarted or resumed, the link healed, the space freed).
    pub end_us: Micros,
    /// Numbers that say how hard (delay in ms, pause length), for the record.
    pub detail: String,
}

/// One line of the history file: an operation of a workload, or a fault.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line<Op> {
    /// A client's operation.
    Op(Op),
    /// A fault.
    Fault(Fault),
}

/// The shared recorder: the run's clock and the faults so far (operations are kept by each workload).
#[derive(Clone, Debug)]
pub struct Clock {
    start: Instant,
    faults: Arc<Mutex<Vec<Fault>>>,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock starting now.
    pub fn new() -> Self {
        Self { start: Instant::now(), faults: Arc::default() }
    }

    /// Microseconds since the start.
    pub fn now(&self) -> Micros {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The instant `us` microseconds after the start.
    pub fn instant(&self, us: Micros) -> Instant {
        self.start + Duration::from_micros(us)
    }

    /// Records a fault that has ended.
    pub fn fault(&self, fault: Fault) {
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).push(fault);
    }

    /// The faults recorded so far, in the order they ended.
    pub fn faults(&self) -> Vec<Fault> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many faults of each kind were injected.
    pub fn fault_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for f in self.faults() {
            *counts.entry(f.kind).or_default() += 1;
        }
        counts
    }
}

/// Whether any fault overlaps `[from, to]` (faults that ended before `from` or began after `to` do not).
pub fn any_fault_during(faults: &[Fault], from: Micros, to: Micros) -> bool {
    faults.iter().any(|f| f.start_us <= to && f.end_us >= from)
}

/// Writes the operations and faults as JSON lines, in order of time (an operation at its invocation, a fault at
/// its start).
///
/// # Errors
/// When the file cannot be written.
pub fn write_jsonl<Op: Serialize>(path: &Path, ops: &[(Micros, Op)], faults: &[Fault]) -> std::io::Result<()> {
    let mut lines: Vec<(Micros, String)> = Vec::with_capacity(ops.len() + faults.len());
    for (at, op) in ops {
        lines.push((*at, serde_json::to_string(&Line::<&Op>::Op(op)).map_err(std::io::Error::other)?));
    }
    for f in faults {
        lines.push((f.start_us, serde_json::to_string(&Line::<()>::Fault(f.clone())).map_err(std::io::Error::other)?));
    }
    lines.sort_by_key(|(at, _)| *at);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (_, line) in lines {
        writeln!(out, "{line}")?;
    }
    out.flush()
}
