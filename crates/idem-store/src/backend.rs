//! For backend authors: what a [`Store`](crate::Store) implementation needs and its users do not. A set is
//! stored as a JSON array of distinct strings in ascending order, a counter as decimal ASCII; these pure
//! functions apply [`Store::set_change`](crate::Store::set_change) and
//! [`Store::counter_add`](crate::Store::counter_add) to a value read in the backend's own transaction, for the
//! backends that apply them in Rust (the in-memory, SQLite and PostgreSQL stores). Key, value and TTL limits
//! are checked with [`Limits`](crate::Limits)'s `check_*` methods, and every backend proves itself with the
//! `conformance` suite (cargo feature `conformance`).

use std::collections::BTreeSet;

use bytes::Bytes;

use crate::{Error, SetChange};

/// Decodes a set value: a JSON array of strings, its `[` the first byte.
///
/// # Errors
/// [`Error::WrongType`] when the bytes are not such an array (leading whitespace included: Redis's script
/// takes a value for an array by its first byte, and every backend must agree on what is a set).
pub fn decode_set(value: &[u8]) -> Result<BTreeSet<String>, Error> {
    if value.first() != Some(&b'[') {
        return Err(Error::WrongType { expected: "set" });
    }
    serde_json::from_slice::<Vec<String>>(value)
        .map(|v| v.into_iter().collect())
        .map_err(|_| Error::WrongType { expected: "set" })
}

/// Encodes a set as a JSON array of strings in ascending order.
pub fn encode_set(set: &BTreeSet<String>) -> Bytes {
    // Serialising a set of strings cannot fail; the empty array is a safe fallback that the caller never sees.
    serde_json::to_vec(set).map(Bytes::from).unwrap_or_else(|_| Bytes::from_static(b"[]"))
}

/// What a set change does to a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetApplied {
    /// The new value; `None` when the set is now empty and the key is to be deleted.
    pub value: Option<Bytes>,
    /// False when nothing changed, so nothing needs to be written.
    pub changed: bool,
    /// Members after the change.
    pub members: usize,
    /// New members.
    pub added: usize,
    /// Removed members.
    pub removed: usize,
}

/// Applies `change` to the current value (`None` = absent).
///
/// # Errors
/// [`Error::WrongType`] when the current value is not a set.
pub fn apply_set(current: Option<&[u8]>, change: &SetChange) -> Result<SetApplied, Error> {
    let mut set = match current {
        Some(v) => decode_set(v)?,
        None => BTreeSet::new(),
    };
    let added = change.add.iter().filter(|m| set.insert((*m).clone())).count();
    let removed = change.remove.iter().filter(|m| set.remove(m.as_str())).count();
    let changed = added > 0 || removed > 0;
    let value = if set.is_empty() { None } else { Some(encode_set(&set)) };
    Ok(SetApplied { value, changed, members: set.len(), added, removed })
}

/// What a counter add does to a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterApplied {
    /// The new value.
    pub value: i64,
}

impl CounterApplied {
    /// The value's stored form: decimal ASCII.
    pub fn encode(&self) -> Bytes {
        Bytes::from(self.value.to_string())
    }
}

/// Adds `delta` to the current value (`None` = absent, counts as 0).
///
/// # Errors
/// [`Error::WrongType`] when the value is not an `i64` in its canonical decimal form (`-12`, never ` 12`, `+12`
/// or `012`); [`Error::CounterOverflow`].
pub fn apply_counter(current: Option<&[u8]>, delta: i64) -> Result<CounterApplied, Error> {
    let now = match current {
        // Only the form a counter is stored in (decimal, a '-' for negatives, no '+', spaces or leading zeros):
        // what Redis's HINCRBY takes, so a value PUT by hand is a counter on every backend or on none.
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<i64>().ok().filter(|n| n.to_string() == s))
            .ok_or(Error::WrongType { expected: "counter" })?,
        None => 0,
    };
    let value = now.checked_add(delta).ok_or(Error::CounterOverflow)?;
    Ok(CounterApplied { value })
}
