//! Bounded, cursor-paged scans of a store prefix: the one way every list page reads the store.
//!
//! A page reads at most [`SCAN_BUDGET`] keys, whatever the filter: a filter that matches one record in a
//! million answers with the matches found so far and a cursor to go on from, instead of reading the whole
//! store while the operator waits. The cursor is opaque to the page (hex of the last store key read); the
//! store sees only "keys after this one" ([`Store::list`]), never an offset, so a page costs the same at the
//! millionth record as at the first and a record written meanwhile is neither skipped nor shown twice.

use idem_store::{Store, Versioned};

use crate::Error;

/// Most keys one page reads from the store (list and values), matching or not.
pub const SCAN_BUDGET: usize = 2_000;

/// Keys listed per store round trip.
const BATCH: usize = 500;

/// One page of a filtered scan.
#[derive(Debug)]
pub struct Scanned<T> {
    /// The matches, in store key order.
    pub rows: Vec<T>,
    /// Where the next page starts (opaque, [`encode_cursor`]); `None` when the prefix is exhausted.
    pub next_cursor: Option<String>,
    /// How many keys this page read.
    pub scanned: usize,
}

/// Makes a store key into the opaque cursor the pages carry (lowercase hex, so it is safe in a URL).
pub fn encode_cursor(key: &str) -> String {
    hex::encode(key.as_bytes())
}

/// Reads a cursor [`encode_cursor`] made.
///
/// # Errors
/// [`Error::BadRequest`] for anything else.
pub fn decode_cursor(cursor: &str) -> Result<String, Error> {
    hex::decode(cursor)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| Error::BadRequest("cursor: not one this server handed out".into()))
}

/// What the scan does with one key.
pub enum Step<T> {
    /// Show it.
    Keep(T),
    /// Not a match.
    Skip,
    /// Not a match, and neither is anything up to and including this key: the scan goes on after it (how a
    /// listing of jobs jumps over a job's million items).
    JumpPast(String),
}

/// Scans the keys under `prefix` after `cursor` (a decoded one), calling `judge` with each live key and value,
/// until `limit` are kept, the prefix is exhausted, or [`SCAN_BUDGET`] keys were read.
///
/// # Errors
/// [`Error::Store`]; what `judge` returns.
pub async fn scan<S, T, F>(
    store: &S,
    prefix: &str,
    cursor: Option<String>,
    limit: usize,
    mut judge: F,
) -> Result<Scanned<T>, Error>
where
    S: Store,
    F: FnMut(&str, &Versioned) -> Result<Step<T>, Error>,
{
    let mut cursor = cursor;
    let mut rows = Vec::new();
    let mut scanned = 0;
    loop {
        let want = BATCH.min(SCAN_BUDGET - scanned).max(1);
        let page = store.list(prefix, cursor.as_deref(), want).await?;
        let keys: Vec<String> = page.items.into_iter().map(|i| i.key).collect();
        let values = store.get_many(&keys).await?;
        let mut jumped = false;
        for (key, value) in keys.into_iter().zip(values) {
            scanned += 1;
            let step = match &value {
                Some(v) => judge(&key, v)?,
                // Expired or deleted between the listing and the read.
                None => Step::Skip,
            };
            cursor = Some(key);
            match step {
                Step::Keep(row) => rows.push(row),
                Step::Skip => {}
                Step::JumpPast(past) => {
                    cursor = Some(past);
                    jumped = true;
                    break;
                }
            }
            if rows.len() == limit {
                return Ok(Scanned { rows, next_cursor: cursor.as_deref().map(encode_cursor), scanned });
            }
        }
        if page.next_cursor.is_none() && !jumped {
            return Ok(Scanned { rows, next_cursor: None, scanned });
        }
        if scanned >= SCAN_BUDGET {
            return Ok(Scanned { rows, next_cursor: cursor.as_deref().map(encode_cursor), scanned });
        }
    }
}

/// A cursor past every key that starts with `prefix_with_slash` (`run/a/` gives `run/a0`): `0` is the byte
/// after `/`, so every key under `run/a/` sorts before it and every key of another name (`run/a0/…`,
/// `run/b/…`) after it; no key is exactly `run/a0`, since every key has a segment after the name.
pub fn past(prefix_with_slash: &str) -> String {
    let base = prefix_with_slash.strip_suffix('/').unwrap_or(prefix_with_slash);
    format!("{base}0")
}
