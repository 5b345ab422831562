//! The sequential model of one key of the store, for the linearizability checker: its value, the generation of
//! that value, and what the generations of its next writes must exceed.
//!
//! Generations are store-wide: every write anywhere in the store takes the next number, so the generations one
//! key sees jump (3, 17, 18, 40...) and are never a per-key counter the model could predict. The model therefore
//! treats the generation a write returns as an *observed* value, constrained only by the contract: it is above
//! every generation this key had before (`floor`), and a later read, compare-and-swap or refusal of that value
//! must show exactly it. A write whose outcome is unknown (timeout, lost connection, 5xx) leaves a value whose
//! generation nobody saw: [`Gen::Above`] records only that it exceeds the floor at that point, and the first
//! operation that shows it pins it down. The cross-key half of the rule ("above every generation handed out
//! before the write started", for all keys) is checked separately, by [`check`](super::check::check).

use serde::{Deserialize, Serialize};

/// A precondition as sent: none, `If-None-Match: *`, `If-Match: *`, `If-Match: "g"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pre {
    /// No header.
    Any,
    /// `If-None-Match: *`: create only.
    Absent,
    /// `If-Match: *`: the key must exist.
    Present,
    /// `If-Match: "g"`: compare-and-swap on generation g.
    Gen(u64),
}

/// What a client asked for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Call {
    /// `GET /v1/kv/{key}`.
    Get,
    /// `PUT /v1/kv/{key}` of a decimal number, under a precondition.
    Put {
        /// The value written (unique in the run).
        value: i64,
        /// Its precondition.
        pre: Pre,
    },
    /// `DELETE /v1/kv/{key}` under a precondition.
    Delete {
        /// Its precondition.
        pre: Pre,
    },
    /// `POST /v1/kv/{key}/counter` `{"delta": d}`.
    Add {
        /// The delta.
        delta: i64,
    },
    /// Not a request: a point in time the checker inserts (see [`KeyState::time`]).
    Barrier {
        /// The instant, in µs since the start.
        at: u64,
    },
}

/// What the client got.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "ret", rename_all = "snake_case")]
pub enum Ret {
    /// 200 with the value and its generation (`ETag`).
    Value {
        /// The value read.
        value: i64,
        /// Its generation.
        generation: u64,
    },
    /// 404.
    NotFound,
    /// 200 or 201 to a PUT.
    Written {
        /// The new generation.
        generation: u64,
        /// 201: nothing live was there.
        created: bool,
    },
    /// 204 to a DELETE.
    Deleted,
    /// 412 with the current generation (`None`: absent).
    Refused {
        /// `current_generation` of the problem.
        current: Option<u64>,
    },
    /// 200 to a counter add.
    Added {
        /// The counter after the add.
        value: i64,
        /// The new generation.
        generation: u64,
    },
    /// No answer, a broken connection or a 5xx: the write may or may not have happened.
    Unknown {
        /// What happened, for the report.
        why: String,
    },
    /// The connection was refused: the request was never sent, so it had no effect (left out of the check).
    NotSent,
}

/// The generation of the value a key holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gen {
    /// Seen.
    Known(u64),
    /// Written by an operation whose outcome is unknown: some generation above this one.
    Above(u64),
}

/// The model's state for one key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct KeyState {
    /// The live value and its generation, or absent.
    pub value: Option<(i64, Gen)>,
    /// Every later write on this key gets a generation above this.
    pub floor: u64,
    /// The last [`Call::Barrier`] linearized: an operation of unknown outcome whose effect is known to have
    /// happened by an instant (its `bound`) takes effect only if linearized before the barrier at that instant;
    /// linearized after it, it had none.
    pub time: u64,
}

/// One operation with its result, as the checker applies it.
#[derive(Clone, Debug)]
pub struct Step {
    /// The request.
    pub call: Call,
    /// The answer.
    pub ret: Ret,
    /// For an unknown outcome: the instant by which it took effect or never will.
    pub bound: Option<u64>,
}

/// Whether `gen` can be generation `seen`, and the state that learns it.
fn learn(state: &KeyState, seen: Option<u64>) -> Option<KeyState> {
    match (state.value, seen) {
        (None, None) => Some(state.clone()),
        (Some((v, Gen::Known(g))), Some(s)) if g == s => {
            Some(KeyState { value: Some((v, Gen::Known(g))), ..state.clone() })
        }
        (Some((v, Gen::Above(x))), Some(s)) if s > x => {
            Some(KeyState { value: Some((v, Gen::Known(s))), floor: state.floor.max(s), time: state.time })
        }
        _ => None,
    }
}

/// Whether `pre` holds on a state whose generation is known (an `Above` generation holds a `Gen(g)` only once
/// learnt as g).
fn holds(pre: Pre, value: Option<(i64, Gen)>) -> bool {
    match (pre, value) {
        (Pre::Any, _) => true,
        (Pre::Absent, v) => v.is_none(),
        (Pre::Present, v) => v.is_some(),
        (Pre::Gen(g), Some((_, Gen::Known(c)))) => g == c,
        (Pre::Gen(_), _) => false,
    }
}

/// For an operation of unknown outcome with `If-Match: "g"` on a value of unseen generation: the state in which
/// the precondition held (the value's generation was g), when it could have.
fn assume_match(state: &KeyState, pre: Pre) -> KeyState {
    match (pre, state.value) {
        (Pre::Gen(g), Some((_, Gen::Above(_)))) => learn(state, Some(g)).unwrap_or_else(|| state.clone()),
        _ => state.clone(),
    }
}

/// The model's transition: whether `step` could happen in `state`, and the state after it.
///
/// An operation of unknown outcome is applied as if it took effect whenever it could: the alternative, that it
/// had no effect, is the checker placing it after every other operation (its answer is never compared).
pub fn apply(step: &Step, state: &KeyState) -> (bool, KeyState) {
    let no = (false, state.clone());
    if let Call::Barrier { at } = step.call {
        return (true, KeyState { time: at, ..state.clone() });
    }
    if matches!(step.ret, Ret::Unknown { .. }) && step.bound.is_some_and(|b| state.time >= b) {
        // Linearized after the instant by which it had taken effect or never would: it never did.
        return (true, state.clone());
    }
    match (&step.call, &step.ret) {
        (Call::Get, Ret::Value { value, generation }) => match state.value {
            Some((v, _)) if v == *value => learn(state, Some(*generation)).map_or(no, |s| (true, s)),
            _ => no,
        },
        (Call::Get, Ret::NotFound) => (state.value.is_none(), state.clone()),
        (Call::Get, Ret::Unknown { .. }) => (true, state.clone()),
        (Call::Put { pre, .. } | Call::Delete { pre }, Ret::Refused { current }) => match learn(state, *current) {
            Some(s) if !holds(*pre, s.value) => (true, s),
            _ => no,
        },
        (Call::Put { value, pre }, Ret::Written { generation, created }) => {
            let s = assume_match(state, *pre);
            let ok = holds(*pre, s.value) && *generation > s.floor && *created == s.value.is_none();
            if !ok {
                return no;
            }
            (true, KeyState { value: Some((*value, Gen::Known(*generation))), floor: *generation, time: s.time })
        }
        (Call::Put { value, pre }, Ret::Unknown { .. }) => {
            let s = assume_match(state, *pre);
            if !holds(*pre, s.value) {
                return (true, state.clone());
            }
            (true, KeyState { value: Some((*value, Gen::Above(s.floor))), floor: s.floor + 1, time: s.time })
        }
        (Call::Delete { pre }, Ret::Deleted) => {
            let s = assume_match(state, *pre);
            if !holds(*pre, s.value) {
                return no;
            }
            (true, KeyState { value: None, ..s })
        }
        (Call::Delete { pre }, Ret::Unknown { .. }) => {
            let s = assume_match(state, *pre);
            if !holds(*pre, s.value) {
                return (true, state.clone());
            }
            (true, KeyState { value: None, ..s })
        }
        (Call::Add { delta }, Ret::Added { value, generation }) => {
            let old = state.value.map_or(0, |(v, _)| v);
            let ok = old.checked_add(*delta) == Some(*value) && *generation > state.floor;
            if !ok {
                return no;
            }
            (true, KeyState { value: Some((*value, Gen::Known(*generation))), floor: *generation, time: state.time })
        }
        (Call::Add { delta }, Ret::Unknown { .. }) => {
            let old = state.value.map_or(0, |(v, _)| v);
            match old.checked_add(*delta) {
                Some(v) => (
                    true,
                    KeyState { value: Some((v, Gen::Above(state.floor))), floor: state.floor + 1, time: state.time },
                ),
                None => (true, state.clone()),
            }
        }
        _ => no,
    }
}

/// The model as the `todc-utils` checker takes it.
pub struct KeySpec;

impl todc_utils::Specification for KeySpec {
    type State = KeyState;
    type Operation = Step;

    fn init() -> KeyState {
        KeyState::default()
    }

    fn apply(op: &Step, state: &KeyState) -> (bool, KeyState) {
        apply(op, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(call: Call, ret: Ret) -> Step {
        Step { call, ret, bound: None }
    }

    #[test]
    fn a_write_must_take_a_generation_above_every_earlier_one_of_its_key() {
        let s = KeyState::default();
        let (ok, s) =
            apply(&step(Call::Put { value: 1, pre: Pre::Any }, Ret::Written { generation: 5, created: true }), &s);
        assert!(ok);
        let (ok, _) =
            apply(&step(Call::Put { value: 2, pre: Pre::Any }, Ret::Written { generation: 5, created: false }), &s);
        assert!(!ok, "a reused generation is refused");
        let (ok, s2) = apply(&step(Call::Delete { pre: Pre::Any }, Ret::Deleted), &s);
        assert!(ok);
        let (ok, _) =
            apply(&step(Call::Put { value: 3, pre: Pre::Any }, Ret::Written { generation: 4, created: true }), &s2);
        assert!(!ok, "a re-created key still gets a higher generation");
    }

    #[test]
    fn an_unknown_write_leaves_a_generation_the_next_read_pins_down() {
        let (_, s) = apply(
            &step(Call::Put { value: 1, pre: Pre::Any }, Ret::Written { generation: 5, created: true }),
            &KeyState::default(),
        );
        let (ok, s) =
            apply(&step(Call::Put { value: 2, pre: Pre::Gen(5) }, Ret::Unknown { why: "timeout".into() }), &s);
        assert!(ok);
        assert_eq!(s.value, Some((2, Gen::Above(5))));
        let (ok, _) = apply(&step(Call::Get, Ret::Value { value: 2, generation: 5 }), &s);
        assert!(!ok, "its generation is above 5");
        let (ok, s) = apply(&step(Call::Get, Ret::Value { value: 2, generation: 9 }), &s);
        assert!(ok);
        assert_eq!(s, KeyState { value: Some((2, Gen::Known(9))), floor: 9, time: 0 });
    }

    #[test]
    fn an_unknown_write_past_its_bound_had_no_effect() {
        let unknown = Step {
            call: Call::Put { value: 2, pre: Pre::Any },
            ret: Ret::Unknown { why: "killed".into() },
            bound: Some(100),
        };
        let (_, before) = apply(&unknown, &KeyState::default());
        assert_eq!(before.value, Some((2, Gen::Above(0))));
        let (_, passed) =
            apply(&step(Call::Barrier { at: 100 }, Ret::Unknown { why: String::new() }), &KeyState::default());
        let (ok, after) = apply(&unknown, &passed);
        assert!(ok);
        assert_eq!(after.value, None);
    }

    #[test]
    fn a_compare_and_swap_on_a_stale_generation_must_be_refused() {
        let (_, s) = apply(
            &step(Call::Put { value: 1, pre: Pre::Any }, Ret::Written { generation: 5, created: true }),
            &KeyState::default(),
        );
        let (ok, _) =
            apply(&step(Call::Put { value: 2, pre: Pre::Gen(4) }, Ret::Written { generation: 6, created: false }), &s);
        assert!(!ok, "a skipped precondition is caught");
        let (ok, _) = apply(&step(Call::Put { value: 2, pre: Pre::Gen(4) }, Ret::Refused { current: Some(5) }), &s);
        assert!(ok);
        let (ok, _) =
            apply(&step(Call::Put { value: 2, pre: Pre::Absent }, Ret::Written { generation: 6, created: false }), &s);
        assert!(!ok, "create-only over a live value is caught");
    }

    #[test]
    fn counter_adds_add() {
        let (ok, s) =
            apply(&step(Call::Add { delta: 3 }, Ret::Added { value: 3, generation: 2 }), &KeyState::default());
        assert!(ok);
        let (ok, _) = apply(&step(Call::Add { delta: 3 }, Ret::Added { value: 3, generation: 4 }), &s);
        assert!(!ok, "a lost add is caught");
    }
}
