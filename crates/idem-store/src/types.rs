use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::Error;

/// The version of a value: assigned by the store at every successful write, strictly increasing across the whole
/// store and never reused, also after a delete and re-create. It is the ABA guard and the fencing token.
///
/// Over HTTP it travels as a strong ETag, `"42"` (RFC 9110 §8.8.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(u64);

impl Generation {
    /// Wraps a raw generation number.
    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for Generation {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Generation)
    }
}

/// The condition a write needs to hold, checked atomically with the write (compare-and-swap).
///
/// An expired value counts as absent. Over HTTP (RFC 9110 §13.1): none, `If-None-Match: *`, `If-Match: *`,
/// `If-Match: "g"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precondition {
    /// Unconditional.
    Any,
    /// Only when no live value exists (create).
    Absent,
    /// Only when a live value exists (replace).
    Present,
    /// Only when the live value has exactly this generation.
    Generation(Generation),
}

impl Precondition {
    /// Checks the condition against the live value's generation (`None` = absent or expired).
    ///
    /// # Errors
    /// [`Error::PreconditionFailed`] carrying `current`.
    pub fn check(self, current: Option<Generation>) -> Result<(), Error> {
        let holds = match self {
            Precondition::Any => true,
            Precondition::Absent => current.is_none(),
            Precondition::Present => current.is_some(),
            Precondition::Generation(g) => current == Some(g),
        };
        if holds { Ok(()) } else { Err(Error::PreconditionFailed { current }) }
    }
}

/// What a write does to the value's expiry. Always explicit, so a read-modify-write never drops an expiry by
/// accident.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ttl {
    /// Keep the current live value's expiry (none when creating).
    Keep,
    /// Remove any expiry: the value lives until deleted.
    Clear,
    /// Expire this long after the write, judged by the store's clock. 1 s ..= 365 days.
    After(Duration),
}

impl Ttl {
    /// The expiry a write with this TTL gives, in milliseconds since the Unix epoch.
    ///
    /// `now_ms` is the store's clock; `current_ms` the live value's expiry.
    pub fn expiry_millis(self, now_ms: u64, current_ms: Option<u64>) -> Option<u64> {
        match self {
            Ttl::Keep => current_ms,
            Ttl::Clear => None,
            Ttl::After(d) => Some(now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))),
        }
    }
}

/// Milliseconds since the Unix epoch for a time (0 before the epoch).
pub fn system_time_to_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// The time `ms` milliseconds after the Unix epoch.
pub fn millis_to_system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// A live value with its generation and expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    value: Bytes,
    generation: Generation,
    expires_at: Option<SystemTime>,
}

impl Versioned {
    /// Assembles a value read from a backend.
    pub fn new(value: Bytes, generation: Generation, expires_at: Option<SystemTime>) -> Self {
        Self { value, generation, expires_at }
    }

    /// The value's bytes.
    pub fn value(&self) -> &Bytes {
        &self.value
    }

    /// Consumes it, returning the bytes.
    pub fn into_value(self) -> Bytes {
        self.value
    }

    /// The generation of the write that produced it.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// When it expires (store clock), `None` when it never does.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }
}

/// The result of a successful put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    generation: Generation,
    created: bool,
}

impl Written {
    /// Assembles a put result.
    pub fn new(generation: Generation, created: bool) -> Self {
        Self { generation, created }
    }

    /// The new value's generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// True when no live value existed before (HTTP 201), false when one was replaced (200).
    pub fn created(&self) -> bool {
        self.created
    }
}

/// One key of a listing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ListItem {
    /// The key.
    pub key: String,
    /// Its value's generation.
    pub generation: Generation,
    /// Its expiry, milliseconds since the Unix epoch, if any.
    pub expires_at_ms: Option<u64>,
}

/// One page of a prefix listing, keys in ascending byte order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    /// The keys of this page.
    pub items: Vec<ListItem>,
    /// Pass as `cursor` to get the next page; `None` on the last page.
    pub next_cursor: Option<String>,
}

impl Page {
    /// Builds a page from up to `limit + 1` items fetched in key order: the extra item only says that another
    /// page follows, whose cursor is the last key kept.
    pub fn from_fetched(mut items: Vec<ListItem>, limit: usize) -> Self {
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|i| i.key.clone())
        } else {
            None
        };
        Self { items, next_cursor }
    }
}

/// An atomic change to a set: members to add and members to remove, applied in one step, optionally under a
/// dedupe id.
///
/// A set is stored as a JSON array of distinct strings in ascending order; a set left empty is deleted.
/// Over HTTP it is the body of `POST /v1/kv/{key}/set`: `{"add":[…],"remove":[…],"dedupe_id":"…"}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetChange {
    /// Members to add (each 1..=255 bytes).
    #[serde(default)]
    pub add: Vec<String>,
    /// Members to remove.
    #[serde(default)]
    pub remove: Vec<String>,
    /// With an id (1..=255 bytes, no NUL), a repeat of the same change under it within
    /// [`Limits::dedupe_retention`](crate::Limits::dedupe_retention) changes nothing and returns the first
    /// outcome with `applied: false`; another change under it is [`Error::DedupeIdReused`]. Ids are scoped to
    /// the key, and set changes and counter adds keep separate ids.
    #[serde(default)]
    pub dedupe_id: Option<String>,
}

impl SetChange {
    /// The fingerprint a dedupe record keeps of this change: SHA-256 (64 lowercase hex digits) over its
    /// canonical form, `add` and `remove` each sorted and de-duplicated, so a retry that lists the same members
    /// in another order or twice is the same payload. The dedupe id itself is not part of it.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        fn canonical(v: &[String]) -> std::collections::BTreeSet<&str> {
            v.iter().map(String::as_str).collect()
        }
        // A JSON array of two arrays of strings: unambiguous, so two different canonical changes never share an
        // input to the hash (a string cannot end early inside JSON).
        let form = serde_json::json!([canonical(&self.add), canonical(&self.remove)]).to_string();
        Sha256::digest(form.as_bytes()).iter().fold(String::with_capacity(64), |mut out, b| {
            use std::fmt::Write;
            // Writing to a String cannot fail.
            let _ = write!(out, "{b:02x}");
            out
        })
    }
}

/// The result of a set change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetOutcome {
    /// The set's generation after the change; `None` when the set is now absent (empty). For a repeated dedupe
    /// id: as the first application left it.
    pub generation: Option<Generation>,
    /// Number of members after the change (for a repeated dedupe id: after the first application).
    pub members: usize,
    /// How many of `add` were new (for a repeated dedupe id: at the first application).
    pub added: usize,
    /// How many of `remove` were present (for a repeated dedupe id: at the first application).
    pub removed: usize,
    /// False when the dedupe id had been seen with the same change, so nothing changed. True otherwise, also
    /// for a change that found nothing to alter.
    pub applied: bool,
}

/// The result of a counter add.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterOutcome {
    /// The counter's value after the add (for a repeated dedupe id: after the first application).
    pub value: i64,
    /// The generation written by the add (for a repeated dedupe id: the one the first application wrote).
    pub generation: Generation,
    /// False when the dedupe id had been seen with the same delta, so nothing changed.
    pub applied: bool,
}

#[cfg(test)]
mod tests {
    use super::SetChange;

    fn change(add: &[&str], remove: &[&str], id: Option<&str>) -> SetChange {
        SetChange {
            add: add.iter().map(|m| (*m).to_owned()).collect(),
            remove: remove.iter().map(|m| (*m).to_owned()).collect(),
            dedupe_id: id.map(str::to_owned),
        }
    }

    #[test]
    fn set_fingerprint_is_the_canonical_form() {
        let f = change(&["b", "a"], &["x"], Some("id-1")).fingerprint();
        assert_eq!(f.len(), 64);
        assert!(f.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        // Order, repeats and the id itself change nothing.
        assert_eq!(change(&["a", "b", "a"], &["x", "x"], Some("id-2")).fingerprint(), f);
        assert_eq!(change(&["a", "b"], &["x"], None).fingerprint(), f);
        // Which side a member is on, and every member, does.
        for other in [
            change(&["a", "b"], &[], None),
            change(&["a", "b", "x"], &[], None),
            change(&["x"], &["a", "b"], None),
            change(&["a"], &["b", "x"], None),
            change(&["a", "b"], &["y"], None),
            change(&["a,b"], &["x"], None),
        ] {
            assert_ne!(other.fingerprint(), f, "{other:?}");
        }
    }
}
