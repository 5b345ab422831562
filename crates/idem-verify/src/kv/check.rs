//! Checking a KV history: per key, linearizability against [`model`](super::model) with the Wing–Gong
//! algorithm and Lowe's memoisation (`todc-utils`, the algorithm of porcupine and Knossos); across keys, the
//! store-wide generation rule.

use std::collections::{BTreeMap, HashMap};

use todc_utils::{Action, History, WGLChecker};

use super::KvOp;
use super::model::{Call, KeySpec, Ret, Step};
use crate::Anomaly;
use crate::history::Micros;

/// Whether the operations of one key, as they stood at `cutoff` (operations invoked later left out, those
/// completing later taken as of unknown outcome), are linearizable.
fn linearizable(ops: &[&KvOp], cutoff: Micros) -> bool {
    // (time, calls before responses at the same instant: overlapping is the permissive reading, process, action)
    let mut events: Vec<(Micros, u8, usize, Action<Step>)> = Vec::new();
    let mut barriers = std::collections::BTreeSet::new();
    for op in ops.iter().filter(|op| op.invoke_us <= cutoff && op.ret != Ret::NotSent) {
        // An answer after the cutoff is not known yet: the operation is pending, of unknown outcome.
        let (ret, bound, end) = match (&op.ret, op.complete_us) {
            // Took effect by its bound or never: pending until just after the barrier at the bound.
            (Ret::Unknown { .. }, _) => match op.bound_us.filter(|b| *b <= cutoff) {
                Some(b) => (op.ret.clone(), Some(b), Some(b + 1)),
                None => (op.ret.clone(), None, None),
            },
            (_, Some(done)) if done <= cutoff => (op.ret.clone(), None, Some(done)),
            _ => (Ret::Unknown { why: "pending".into() }, None, None),
        };
        // A read with no answer changes nothing: leave it out.
        if op.call == Call::Get && matches!(ret, Ret::Unknown { .. }) {
            continue;
        }
        barriers.extend(bound);
        let process = events.len();
        let step = Step { call: op.call.clone(), ret, bound };
        events.push((op.invoke_us, 0, process, Action::Call(step.clone())));
        events.push((end.unwrap_or(Micros::MAX), 1, process, Action::Response(step)));
    }
    for at in barriers {
        let process = events.len();
        let step = Step { call: Call::Barrier { at }, ret: Ret::NotSent, bound: None };
        events.push((at, 0, process, Action::Call(step.clone())));
        events.push((at, 1, process, Action::Response(step)));
    }
    if events.is_empty() {
        return true;
    }
    events.sort_by_key(|(at, order, process, _)| (*at, *order, *process));
    let actions = events.into_iter().map(|(_, _, process, action)| (process, action)).collect();
    WGLChecker::<KeySpec>::is_linearizable(History::from_actions(actions))
}

/// Checks every key; one anomaly per key that is not linearizable, naming the first operation whose answer
/// no order fits, and one per breach of the store-wide generation rule.
pub fn check(ops: &[KvOp]) -> (usize, Vec<Anomaly>) {
    let mut by_key: BTreeMap<&str, Vec<&KvOp>> = BTreeMap::new();
    for op in ops {
        by_key.entry(op.key.as_str()).or_default().push(op);
    }
    let mut anomalies = Vec::new();
    for (key, ops) in &by_key {
        let owned: Vec<KvOp> = ops.iter().map(|op| (*op).clone()).collect();
        let verdict = within_budget(move || {
            let ops: Vec<&KvOp> = owned.iter().collect();
            if linearizable(&ops, Micros::MAX) { None } else { Some(first_unfit(&ops).map(|op| op.id)) }
        });
        let culprit = match verdict {
            Some(None) => continue,
            Some(Some(id)) => ops.iter().copied().find(|op| Some(op.id) == id),
            None => {
                anomalies.push(Anomaly {
                    kind: "check inconclusive".into(),
                    subject: (*key).to_owned(),
                    detail: format!(
                        "the linearizability check of {} operations did not end within {CHECK_BUDGET:?}",
                        ops.len()
                    ),
                    at_us: None,
                    ops: Vec::new(),
                });
                continue;
            }
        };
        let detail = match culprit {
            Some(op) => format!(
                "no linearization fits the answer of op #{} ({:?} -> {:?}, client {}, {}..{} us) together with what came before",
                op.id,
                op.call,
                op.ret,
                op.client,
                op.invoke_us,
                op.complete_us.unwrap_or(0)
            ),
            None => "no linearization fits the whole history".to_owned(),
        };
        anomalies.push(Anomaly {
            kind: "not linearizable".into(),
            subject: (*key).to_owned(),
            detail,
            at_us: culprit.and_then(|op| op.complete_us),
            ops: culprit.map(|op| vec![op.id]).unwrap_or_default(),
        });
    }
    anomalies.extend(generation_rule(ops));
    (by_key.len(), anomalies)
}

/// How long one key's check may take. A history no order fits makes the search try every order the overlaps
/// allow; past this the key is reported as not checked (an anomaly: a run never passes unchecked).
const CHECK_BUDGET: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs `check` on a thread of its own for at most [`CHECK_BUDGET`]; `None` when it took longer (the thread
/// is left to finish, or to end with the process).
fn within_budget<T: Send + 'static>(check: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(check());
    });
    rx.recv_timeout(CHECK_BUDGET).ok()
}

/// The operation whose completion first makes the key's history non-linearizable (linearizability is
/// prefix-closed, so a binary search over completion instants finds it).
fn first_unfit<'a>(ops: &[&'a KvOp]) -> Option<&'a KvOp> {
    let mut done: Vec<&KvOp> = ops
        .iter()
        .copied()
        .filter(|op| op.complete_us.is_some() && !matches!(op.ret, Ret::Unknown { .. } | Ret::NotSent))
        .collect();
    done.sort_by_key(|op| op.complete_us);
    let (mut lo, mut hi) = (0usize, done.len());
    // Invariant: the prefix up to done[hi] (if any) fails; up to done[lo - 1] passes.
    while lo < hi {
        let mid = (lo + hi) / 2;
        if linearizable(ops, done[mid].complete_us.unwrap_or(0)) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    done.get(lo).copied()
}

/// The store-wide rule: acknowledged writes never share a generation, and a write's generation is above every
/// generation any client saw before the write was sent (for any key).
fn generation_rule(ops: &[KvOp]) -> Vec<Anomaly> {
    let written = |op: &KvOp| match op.ret {
        Ret::Written { generation, .. } | Ret::Added { generation, .. } => Some(generation),
        _ => None,
    };
    let seen = |op: &KvOp| match op.ret {
        Ret::Written { generation, .. } | Ret::Added { generation, .. } | Ret::Value { generation, .. } => {
            Some(generation)
        }
        Ret::Refused { current } => current,
        _ => None,
    };
    let mut anomalies = Vec::new();
    let mut owners: HashMap<u64, &KvOp> = HashMap::new();
    for op in ops {
        if let Some(g) = written(op)
            && let Some(first) = owners.insert(g, op)
        {
            anomalies.push(Anomaly {
                kind: "generation reused".into(),
                subject: op.key.clone(),
                detail: format!(
                    "ops #{} ({}) and #{} ({}) were both given generation {g}",
                    first.id, first.key, op.id, op.key
                ),
                at_us: op.complete_us,
                ops: vec![first.id, op.id],
            });
        }
    }
    let mut observed: Vec<(Micros, u64, &KvOp)> =
        ops.iter().filter_map(|op| Some((op.complete_us?, seen(op)?, op))).collect();
    observed.sort_by_key(|(at, _, _)| *at);
    let mut writes: Vec<&KvOp> = ops.iter().filter(|op| written(op).is_some()).collect();
    writes.sort_by_key(|op| op.invoke_us);
    let (mut next, mut max): (usize, Option<(u64, &KvOp)>) = (0, None);
    for w in writes {
        while next < observed.len() && observed[next].0 < w.invoke_us {
            let (_, g, op) = observed[next];
            if max.is_none_or(|(m, _)| g > m) {
                max = Some((g, op));
            }
            next += 1;
        }
        let g = written(w).unwrap_or(0);
        if let Some((m, before)) = max
            && g <= m
        {
            anomalies.push(Anomaly {
                kind: "generation went back".into(),
                subject: w.key.clone(),
                detail: format!(
                    "op #{} on {} was sent after op #{} on {} saw generation {m}, yet got generation {g}",
                    w.id, w.key, before.id, before.key
                ),
                at_us: w.complete_us,
                ops: vec![before.id, w.id],
            });
        }
    }
    anomalies
}
