//! What a workload's check counts as it goes: the anomalies, the notes (counts shown in the summary) and, on
//! the highly available backends, the losses a failover caused.

use std::collections::BTreeMap;

use crate::Anomaly;

/// The findings of one check, shared by its parts.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) anomalies: Vec<Anomaly>,
    pub(crate) notes: BTreeMap<String, u64>,
    pub(crate) losses: BTreeMap<String, u64>,
}

impl Tally {
    /// Empty; on a highly available backend with both loss figures at 0, because they must be shown as 0 with
    /// the durable setting, not left out.
    pub(crate) fn new(ha: bool) -> Self {
        let mut t = Self::default();
        if ha {
            t.losses.insert("executions repeated".into(), 0);
            t.losses.insert("acknowledged writes missing".into(), 0);
        }
        t
    }

    /// Adds `n` to the note `name` (creating it at `n`, so `note(name, 0)` makes a figure shown as 0).
    pub(crate) fn note(&mut self, name: &str, n: u64) {
        *self.notes.entry(name.to_owned()).or_default() += n;
    }

    /// Adds `n` to the loss `name`.
    pub(crate) fn lose(&mut self, name: &str, n: u64) {
        *self.losses.entry(name.to_owned()).or_default() += n;
    }

    /// Records an anomaly.
    pub(crate) fn flag(&mut self, kind: &str, subject: String, detail: String, at_us: Option<u64>, ops: Vec<u64>) {
        self.anomalies.push(Anomaly { kind: kind.into(), subject, detail, at_us, ops });
    }
}
