//! The idempotency record and its state machine: claim a key, renew its lease while the request runs, then
//! store the outcome or release the key; a retry is judged against the record it finds.
//!
//! ```text
//!            claim (create if absent, TTL = kept)
//!   absent ───────────────────────────────────────▶ InProgress ──renew (fenced, TTL = kept)──┐
//!     ▲                                              │  │  ▲ └──────────────────────────────────┘
//!     │ release (fenced)                             │  │  │ take over (fenced on the generation seen
//!     └──────────────────────────────────────────────┘  │  └─ unchanged for a whole lease; same fingerprint)
//!                                complete (fenced, TTL = retention)
//!                InProgress ──────────────────────────▶ Completed | TooLarge | Unknown ──retention──▶ absent
//! ```
//!
//! An in-flight record stays in the store while its holder may still be working (its store TTL, "kept", is
//! the retention, not the lease): a record that vanished when its lease lapsed would let a request with
//! *another* body claim the key as new and execute, although the first request may have executed already.
//! Whether the holder is dead is judged by whoever finds the record in flight: by [`Observations`], when it
//! has seen the record's generation unchanged for a whole lease on its own monotonic clock (the holder renews
//! it every third of a lease, each renewal a new generation). Only then may a request with the *same*
//! fingerprint take it over ([`Claim::take_over`], conditional on that generation); another fingerprint is
//! refused like every other reuse of a key. Every later write is conditional on the generation the holder
//! last wrote — its fencing token — so a holder that was taken over cannot renew, complete or release the new
//! holder's record.

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, Ttl, Versioned, Write, WriteOp};
use serde::{Deserialize, Serialize};

use crate::{Error, Fingerprint, IdempotencyKey, Scope};

mod observe;

pub use observe::{Observations, Watch};

/// The store key of a record: `PREFIX` + `SCOPE/KEY` (the default prefix is `idempotency/`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordKey(String);

impl RecordKey {
    /// The key for `key` owned by `scope`, under `prefix`.
    pub fn new(prefix: &str, scope: &Scope, key: &IdempotencyKey) -> Self {
        // Not `format!`: its machinery cost a request about 1,000 instructions more than the concatenation.
        Self([prefix, scope.as_str(), "/", key.as_str()].concat())
    }

    /// The store key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A completed response as stored and replayed: status, the allow-listed headers and the byte-exact body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Allow-listed header names (lowercase) and values, in the order the response had them.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

/// What happened to an executed request, as the record keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream answered and the answer was small enough to keep.
    Response(StoredResponse),
    /// The upstream answered with a body over the stored-body limit: never re-executed, never replayed.
    TooLarge {
        /// The status the first caller received.
        status: u16,
        /// Body bytes seen before giving up on storing it (at least `limit + 1`).
        size: u64,
        /// The stored-body limit, in bytes.
        limit: u64,
    },
    /// The request was sent but no complete answer came back (connection reset, timeout): it may or may not
    /// have taken effect, so it is neither replayed nor re-executed.
    Unknown {
        /// Why the outcome is unknown, for operators (never the other caller's data).
        reason: String,
    },
    /// An unknown outcome an operator resolved: they found that the request took effect, so a retry is told so
    /// (409 `outcome-resolved`) and never executes it. (One that did not take effect is released instead.)
    Resolved {
        /// Why the outcome had been unknown.
        reason: String,
        /// Who resolved it (the admin guard's actor: a client certificate's subject or "token").
        by: String,
        /// What they found, in their words (shown to operators and to the retrying caller).
        note: String,
        /// When, in milliseconds since the Unix epoch.
        resolved_at_ms: u64,
    },
}

/// One idempotency record: in flight under a lease, or finished with an [`Outcome`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A request is executing; its holder renews the lease while it runs.
    InProgress {
        /// The fingerprint of the executing request.
        fingerprint: Fingerprint,
        /// The holder's owner id (unique per process start).
        owner: String,
        /// When it was claimed, in milliseconds since the Unix epoch (informational).
        started_at_ms: u64,
        /// The holder's lease length in milliseconds: an observer judges the holder dead once it has seen the
        /// record's generation unchanged for this long (0 in records of older versions: the observer's own).
        lease_ms: u64,
    },
    /// The request finished.
    Finished {
        /// The fingerprint of the request that executed.
        fingerprint: Fingerprint,
        /// Its outcome.
        outcome: Outcome,
        /// When it finished, in milliseconds since the Unix epoch.
        finished_at_ms: u64,
    },
}

/// Room for a usual head: state, field names, 64-digit fingerprint, numbers and a few short headers.
const HEAD_ROOM: usize = 256;

/// The JSON head of an encoded record; the body bytes follow it raw. Its strings are borrowed from the record
/// when encoding (a copy of each header was a fifth of [`Record::encode`]'s instructions) and owned when decoded.
#[derive(Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
enum Head<'a> {
    InProgress {
        fingerprint: String,
        owner: Cow<'a, str>,
        started_at_ms: u64,
        #[serde(default)]
        lease_ms: u64,
    },
    Completed {
        fingerprint: String,
        status: u16,
        headers: Cow<'a, [(String, String)]>,
        finished_at_ms: u64,
    },
    TooLarge {
        fingerprint: String,
        status: u16,
        size: u64,
        limit: u64,
        finished_at_ms: u64,
    },
    Unknown {
        fingerprint: String,
        reason: Cow<'a, str>,
        finished_at_ms: u64,
    },
    Resolved {
        fingerprint: String,
        reason: Cow<'a, str>,
        by: Cow<'a, str>,
        note: Cow<'a, str>,
        resolved_at_ms: u64,
        finished_at_ms: u64,
    },
}

impl Record {
    /// The fingerprint of the request this record belongs to.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InProgress { fingerprint, .. } | Record::Finished { fingerprint, .. } => fingerprint,
        }
    }

    /// This record resolved by an operator (`by`, with `note`, at `now_ms`): the same record with its unknown
    /// outcome [`Outcome::Resolved`]; `None` when its outcome is not unknown (a record in flight, one with a
    /// response, or one resolved already has nothing to resolve).
    pub fn resolved(&self, by: &str, note: &str, now_ms: u64) -> Option<Record> {
        let Record::Finished { fingerprint, outcome: Outcome::Unknown { reason }, finished_at_ms } = self else {
            return None;
        };
        let outcome = Outcome::Resolved {
            reason: reason.clone(),
            by: by.to_owned(),
            note: note.to_owned(),
            resolved_at_ms: now_ms,
        };
        Some(Record::Finished { fingerprint: *fingerprint, outcome, finished_at_ms: *finished_at_ms })
    }

    /// Encodes as stored: a 4-byte big-endian length, a JSON head, then the response body raw (so a binary
    /// body is neither re-encoded nor inflated).
    pub fn encode(&self) -> Bytes {
        let (head, body) = match self {
            Record::InProgress { fingerprint, owner, started_at_ms, lease_ms } => (
                Head::InProgress {
                    fingerprint: fingerprint.to_hex(),
                    owner: Cow::Borrowed(owner),
                    started_at_ms: *started_at_ms,
                    lease_ms: *lease_ms,
                },
                None,
            ),
            Record::Finished { fingerprint, outcome, finished_at_ms } => {
                let fingerprint = fingerprint.to_hex();
                let finished_at_ms = *finished_at_ms;
                match outcome {
                    Outcome::Response(r) => (
                        Head::Completed {
                            fingerprint,
                            status: r.status,
                            headers: Cow::Borrowed(&r.headers),
                            finished_at_ms,
                        },
                        Some(&r.body),
                    ),
                    Outcome::TooLarge { status, size, limit } => (
                        Head::TooLarge { fingerprint, status: *status, size: *size, limit: *limit, finished_at_ms },
                        None,
                    ),
                    Outcome::Unknown { reason } => {
                        (Head::Unknown { fingerprint, reason: Cow::Borrowed(reason), finished_at_ms }, None)
                    }
                    Outcome::Resolved { reason, by, note, resolved_at_ms } => (
                        Head::Resolved {
                            fingerprint,
                            reason: Cow::Borrowed(reason),
                            by: Cow::Borrowed(by),
                            note: Cow::Borrowed(note),
                            resolved_at_ms: *resolved_at_ms,
                            finished_at_ms,
                        },
                        None,
                    ),
                }
            }
        };
        // The head goes into a buffer sized for a usual one (a `to_vec` grew its buffer several times), then
        // into one exactly as long as the record: `Bytes` keeps a vector's whole capacity, and a record may
        // live in memory for its whole retention.
        let mut json = Vec::with_capacity(HEAD_ROOM);
        // Serialising plain strings and integers cannot fail; if it did, the head would be empty, as before.
        if serde_json::to_writer(&mut json, &head).is_err() {
            json.clear();
        }
        let mut out = Vec::with_capacity(4 + json.len() + body.map_or(0, Bytes::len));
        out.extend_from_slice(&(json.len() as u32).to_be_bytes());
        out.extend_from_slice(&json);
        if let Some(body) = body {
            out.extend_from_slice(body);
        }
        Bytes::from(out)
    }

    /// Decodes what [`Record::encode`] wrote; the body shares `bytes`' allocation.
    ///
    /// # Errors
    /// [`Error::RecordCorrupt`] when the bytes are not a record.
    pub fn decode(bytes: &Bytes) -> Result<Self, Error> {
        let corrupt = |reason: String| Error::RecordCorrupt { reason };
        let len_bytes: [u8; 4] = bytes
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| corrupt("shorter than its length prefix".into()))?;
        let head_len = u32::from_be_bytes(len_bytes) as usize;
        let head_end = 4usize.checked_add(head_len).filter(|end| *end <= bytes.len());
        let head_end = head_end.ok_or_else(|| corrupt("head longer than the record".into()))?;
        let head: Head = serde_json::from_slice(&bytes[4..head_end]).map_err(|e| corrupt(e.to_string()))?;
        let body = bytes.slice(head_end..);
        Ok(match head {
            Head::InProgress { fingerprint, owner, started_at_ms, lease_ms } => {
                let owner = owner.into_owned();
                Record::InProgress { fingerprint: Fingerprint::from_hex(&fingerprint)?, owner, started_at_ms, lease_ms }
            }
            Head::Completed { fingerprint, status, headers, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::Response(StoredResponse { status, headers: headers.into_owned(), body }),
                finished_at_ms,
            },
            Head::TooLarge { fingerprint, status, size, limit, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::TooLarge { status, size, limit },
                finished_at_ms,
            },
            Head::Unknown { fingerprint, reason, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::Unknown { reason: reason.into_owned() },
                finished_at_ms,
            },
            Head::Resolved { fingerprint, reason, by, note, resolved_at_ms, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::Resolved {
                    reason: reason.into_owned(),
                    by: by.into_owned(),
                    note: note.into_owned(),
                    resolved_at_ms,
                },
                finished_at_ms,
            },
        })
    }
}

/// What to do with a request, given the record its key already has (draft §2.6, status codes from §2.7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No live record: claim the key and execute.
    Claim,
    /// Finished with a stored response: replay it.
    Replay(StoredResponse),
    /// Another request with the same fingerprint is executing: 409 (draft §2.6, "concurrent request").
    InFlight,
    /// The key was used for a different request: 422 (draft §2.6), also while that request is in flight.
    Mismatch,
    /// Finished, but the response was over the stored-body limit.
    TooLarge {
        /// The first caller's status.
        status: u16,
        /// The stored-body limit, in bytes.
        limit: u64,
    },
    /// Finished with an unknown outcome.
    Unknown,
    /// An unknown outcome an operator resolved as taken effect: 409, never executed again.
    Resolved {
        /// What the operator found.
        note: String,
    },
}

/// Judges a request with fingerprint `fingerprint` against the live record of its key (`None`: absent or
/// expired).
pub fn judge(record: Option<Record>, fingerprint: &Fingerprint) -> Verdict {
    let Some(record) = record else {
        return Verdict::Claim;
    };
    if record.fingerprint() != fingerprint {
        return Verdict::Mismatch;
    }
    match record {
        Record::InProgress { .. } => Verdict::InFlight,
        Record::Finished { outcome, .. } => match outcome {
            Outcome::Response(response) => Verdict::Replay(response),
            Outcome::TooLarge { status, limit, .. } => Verdict::TooLarge { status, limit },
            Outcome::Unknown { .. } => Verdict::Unknown,
            Outcome::Resolved { note, .. } => Verdict::Resolved { note },
        },
    }
}

/// A claim about to be made: [`Claim::write`] is the conditional create (or [`Claim::take_over`] the
/// conditional replacement of a dead holder's record); once the store accepted it, [`Claim::acquired`] turns
/// it into the [`Held`] its generation fences.
#[derive(Clone, Debug)]
pub struct Claim {
    key: RecordKey,
    fingerprint: Fingerprint,
    owner: String,
    started_at_ms: u64,
    length: Duration,
    kept: Duration,
}

impl Claim {
    /// Prepares to claim `key` for a request with `fingerprint`, by `owner`, at `now_ms` (milliseconds since
    /// the Unix epoch), with a lease of `length` (renewed every third of it). `kept` is the in-flight record's
    /// store TTL, set again by every renewal: how long a dead holder's record keeps its key from being reused
    /// for another request (the layer uses the retention; at least `length`).
    pub fn new(
        key: RecordKey,
        fingerprint: Fingerprint,
        owner: impl Into<String>,
        now_ms: u64,
        length: Duration,
        kept: Duration,
    ) -> Self {
        Self { key, fingerprint, owner: owner.into(), started_at_ms: now_ms, length, kept: kept.max(length) }
    }

    /// Create the in-progress record if the key has no live record, kept for `kept`.
    pub fn write(&self) -> Write {
        Write {
            key: self.key.0.clone(),
            op: WriteOp::Put { value: self.in_progress().encode(), ttl: Ttl::After(self.kept) },
            precondition: Precondition::Absent,
        }
    }

    /// Replace a dead holder's in-progress record, only if it still has `lapsed`, the generation an observer
    /// saw unchanged for a whole lease ([`Watch::Lapsed`]). Only for a request with the same fingerprint as
    /// that record ([`judge`] says [`Verdict::InFlight`]): another request under the key is refused (422),
    /// dead holder or not, since the first request may have executed.
    pub fn take_over(&self, lapsed: Generation) -> Write {
        Write {
            key: self.key.0.clone(),
            op: WriteOp::Put { value: self.in_progress().encode(), ttl: Ttl::After(self.kept) },
            precondition: Precondition::Generation(lapsed),
        }
    }

    /// The lease held after the store accepted [`Claim::write`] and gave it `generation`.
    pub fn acquired(self, generation: Generation) -> Held {
        Held { claim: self, generation }
    }

    fn in_progress(&self) -> Record {
        Record::InProgress {
            fingerprint: self.fingerprint,
            owner: self.owner.clone(),
            started_at_ms: self.started_at_ms,
            lease_ms: u64::try_from(self.length.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// A held lease on a record. Its generation is the fencing token: every write it produces is conditional on it.
#[derive(Clone, Debug)]
pub struct Held {
    claim: Claim,
    generation: Generation,
}

/// Kept by [`idem_store::LeaseKeeper`] while the request executes.
impl Renewable for Held {
    fn length(&self) -> Duration {
        Held::length(self)
    }

    /// Show the holder alive: a new generation of the same record (its TTL set to `kept` again), only if still
    /// held. Observers judge the holder dead when the generation stays the same for a whole lease.
    fn renewal(&self) -> Write {
        Write {
            key: self.claim.key.0.clone(),
            op: WriteOp::Put { value: self.claim.in_progress().encode(), ttl: Ttl::After(self.claim.kept) },
            precondition: Precondition::Generation(self.generation),
        }
    }

    fn renewed(&mut self, generation: Generation) {
        self.generation = generation;
    }

    /// Whether `current` is this holder's own in-progress record (same owner, claim time and fingerprint),
    /// e.g. after a renewal whose answer was lost landed in the store: then its generation is this holder's to
    /// adopt. A record another holder claimed is never "mine", so adopting cannot defeat the fence.
    fn is_mine(&self, current: &Versioned) -> bool {
        Record::decode(current.value()).is_ok_and(|record| self.owns(&record))
    }
}

impl Held {
    /// The fencing token: the generation of the holder's last accepted write.
    pub fn fencing_token(&self) -> Generation {
        self.generation
    }

    /// The record's store key.
    pub fn key(&self) -> &RecordKey {
        &self.claim.key
    }

    /// The lease length.
    pub fn length(&self) -> Duration {
        self.claim.length
    }

    /// The fingerprint of the request the lease was claimed for.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.claim.fingerprint
    }

    /// Whether `record` is the in-progress record this holder's claim wrote.
    fn owns(&self, record: &Record) -> bool {
        matches!(record, Record::InProgress { fingerprint, owner, started_at_ms, .. }
            if *fingerprint == self.claim.fingerprint && *owner == self.claim.owner
                && *started_at_ms == self.claim.started_at_ms)
    }

    /// Store the outcome for `retention`, only if the lease is still held.
    pub fn complete(&self, outcome: Outcome, now_ms: u64, retention: Duration) -> Write {
        self.finish(outcome, now_ms, retention, Precondition::Generation(self.generation))
    }

    /// After [`Held::complete`] failed its fence because the record is gone (deleted through the record
    /// endpoint, or kept for less than the holder ran): store the outcome only if the key is still free, so the
    /// work done is not lost and a new holder is never overwritten.
    pub fn complete_lapsed(&self, outcome: Outcome, now_ms: u64, retention: Duration) -> Write {
        self.finish(outcome, now_ms, retention, Precondition::Absent)
    }

    /// Give the key up (the request was never executed, or the upstream asked to be retried), only if held.
    pub fn release(&self) -> Write {
        Write {
            key: self.claim.key.0.clone(),
            op: WriteOp::Delete,
            precondition: Precondition::Generation(self.generation),
        }
    }

    fn finish(&self, outcome: Outcome, now_ms: u64, retention: Duration, precondition: Precondition) -> Write {
        let record = Record::Finished { fingerprint: self.claim.fingerprint, outcome, finished_at_ms: now_ms };
        Write {
            key: self.claim.key.0.clone(),
            op: WriteOp::Put { value: record.encode(), ttl: Ttl::After(retention) },
            precondition,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::RequestParts;

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_request(&RequestParts::new("POST", "/o", None, None, body.as_bytes()))
    }

    fn key() -> RecordKey {
        RecordKey::new("idempotency/", &Scope::from_credential(None), &IdempotencyKey::new("k").unwrap())
    }

    #[test]
    fn records_round_trip_with_binary_bodies() {
        let body = Bytes::from(vec![0u8, 255, 10, 13, b'{']);
        let records = [
            Record::InProgress { fingerprint: fp("a"), owner: "o-1".into(), started_at_ms: 7, lease_ms: 1000 },
            Record::Finished {
                fingerprint: fp("a"),
                outcome: Outcome::Response(StoredResponse {
                    status: 201,
                    headers: vec![("location".into(), "/o/1".into())],
                    body,
                }),
                finished_at_ms: 9,
            },
            Record::Finished {
                fingerprint: fp("a"),
                outcome: Outcome::TooLarge { status: 200, size: 11, limit: 10 },
                finished_at_ms: 1,
            },
            Record::Finished {
                fingerprint: fp("a"),
                outcome: Outcome::Unknown { reason: "reset".into() },
                finished_at_ms: 1,
            },
        ];
        for record in records {
            assert_eq!(Record::decode(&record.encode()).unwrap(), record);
        }
        assert!(Record::decode(&Bytes::from_static(b"\0\0\0\x09{}")).is_err());
        assert!(Record::decode(&Bytes::from_static(b"xx")).is_err());
        assert!(Record::decode(&Bytes::from_static(b"\0\0\0\x02{}")).is_err());
    }

    /// The stored form is fixed (records outlive the version that wrote them): the head's length, the JSON
    /// head with fields in this order, the body raw; and a record with long strings is written whole.
    #[test]
    fn the_stored_form_is_the_heads_length_the_json_head_and_the_body() {
        let fingerprint = fp("a");
        let long = "v".repeat(5000);
        let record = Record::Finished {
            fingerprint,
            outcome: Outcome::Response(StoredResponse {
                status: 201,
                headers: vec![("location".into(), "/o/\"1".into()), ("x-long".into(), long.clone())],
                body: Bytes::from_static(b"{\"id\":1}"),
            }),
            finished_at_ms: 9,
        };
        let head = format!(
            r#"{{"state":"completed","fingerprint":"{}","status":201,"headers":[["location","/o/\"1"],["x-long","{long}"]],"finished_at_ms":9}}"#,
            fingerprint.to_hex()
        );
        let mut expected = (head.len() as u32).to_be_bytes().to_vec();
        expected.extend_from_slice(head.as_bytes());
        expected.extend_from_slice(b"{\"id\":1}");
        let encoded = record.encode();
        assert_eq!(encoded, Bytes::from(expected));
        // Exactly as long as it is: a record kept in memory holds no spare capacity (a head longer than the
        // room first given to it once left the vector at twice the body's size).
        let record = Record::Finished {
            fingerprint,
            outcome: Outcome::Response(StoredResponse {
                status: 200,
                headers: vec![("x-long".into(), long.clone())],
                body: Bytes::from(vec![b'x'; 1 << 20]),
            }),
            finished_at_ms: 9,
        };
        for encoded in [encoded, record.encode()] {
            let whole = encoded.try_into_mut().expect("the only reference");
            assert_eq!(whole.capacity(), whole.len());
        }
        let running = Record::InProgress { fingerprint, owner: "o-é".into(), started_at_ms: 7, lease_ms: 1000 };
        let head = format!(
            r#"{{"state":"in_progress","fingerprint":"{}","owner":"o-é","started_at_ms":7,"lease_ms":1000}}"#,
            fingerprint.to_hex()
        );
        assert_eq!(&running.encode()[4..], head.as_bytes());
    }

    #[test]
    fn verdicts() {
        let a = fp("a");
        assert_eq!(judge(None, &a), Verdict::Claim);
        let running = Record::InProgress { fingerprint: a, owner: "o".into(), started_at_ms: 0, lease_ms: 0 };
        assert_eq!(judge(Some(running.clone()), &a), Verdict::InFlight);
        assert_eq!(judge(Some(running), &fp("b")), Verdict::Mismatch);
        let response = StoredResponse { status: 500, headers: vec![], body: Bytes::from_static(b"x") };
        let done = Record::Finished { fingerprint: a, outcome: Outcome::Response(response.clone()), finished_at_ms: 0 };
        assert_eq!(judge(Some(done.clone()), &a), Verdict::Replay(response));
        assert_eq!(judge(Some(done), &fp("b")), Verdict::Mismatch);
        let big = Record::Finished {
            fingerprint: a,
            outcome: Outcome::TooLarge { status: 200, size: 9, limit: 8 },
            finished_at_ms: 0,
        };
        assert_eq!(judge(Some(big), &a), Verdict::TooLarge { status: 200, limit: 8 });
        let unknown =
            Record::Finished { fingerprint: a, outcome: Outcome::Unknown { reason: String::new() }, finished_at_ms: 0 };
        assert_eq!(judge(Some(unknown.clone()), &a), Verdict::Unknown);
        let resolved = unknown.resolved("ops@example", "the charge went through", 7).unwrap();
        assert_eq!(judge(Some(resolved.clone()), &a), Verdict::Resolved { note: "the charge went through".into() });
        assert_eq!(judge(Some(resolved), &fp("b")), Verdict::Mismatch);
    }

    /// Only an unknown outcome can be resolved; the resolved record keeps the reason, the fingerprint and when
    /// it finished, and survives the stored form.
    #[test]
    fn only_an_unknown_outcome_is_resolved_and_it_round_trips() {
        let a = fp("a");
        let unknown = Record::Finished {
            fingerprint: a,
            outcome: Outcome::Unknown { reason: "upstream reset".into() },
            finished_at_ms: 5,
        };
        let resolved = unknown.resolved("CN=alice", "<b>seen</b> in the ledger", 9).unwrap();
        assert_eq!(
            resolved,
            Record::Finished {
                fingerprint: a,
                outcome: Outcome::Resolved {
                    reason: "upstream reset".into(),
                    by: "CN=alice".into(),
                    note: "<b>seen</b> in the ledger".into(),
                    resolved_at_ms: 9,
                },
                finished_at_ms: 5,
            }
        );
        assert_eq!(Record::decode(&resolved.encode()).unwrap(), resolved);
        assert_eq!(resolved.resolved("x", "again", 10), None, "resolved once");
        let running = Record::InProgress { fingerprint: a, owner: "o".into(), started_at_ms: 0, lease_ms: 0 };
        assert_eq!(running.resolved("x", "", 1), None);
        let response = StoredResponse { status: 200, headers: vec![], body: Bytes::new() };
        let done = Record::Finished { fingerprint: a, outcome: Outcome::Response(response), finished_at_ms: 0 };
        assert_eq!(done.resolved("x", "", 1), None);
    }

    #[test]
    fn every_transition_after_the_claim_is_fenced() {
        let kept = Duration::from_secs(86_400);
        let claim = Claim::new(key(), fp("a"), "owner-1", 1_000, Duration::from_secs(10), kept);
        let create = claim.write();
        assert_eq!(create.precondition, Precondition::Absent);
        // Kept past the lease: a lapsed lease must not free the key for another request.
        assert!(matches!(create.op, WriteOp::Put { ttl: Ttl::After(d), .. } if d == kept));
        let take_over = claim.take_over(Generation::new(4));
        assert_eq!(take_over.precondition, Precondition::Generation(Generation::new(4)));
        assert_eq!(take_over.op, create.op);
        let mut lease = claim.acquired(Generation::new(5));
        assert_eq!(lease.renewal().precondition, Precondition::Generation(Generation::new(5)));
        assert!(matches!(lease.renewal().op, WriteOp::Put { ttl: Ttl::After(d), .. } if d == kept));
        assert!(lease.owns(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-1".into(),
            started_at_ms: 1_000,
            lease_ms: 10_000,
        }));
        assert!(!lease.owns(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-2".into(),
            started_at_ms: 1_000,
            lease_ms: 10_000,
        }));
        assert!(!lease.owns(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-1".into(),
            started_at_ms: 1_001,
            lease_ms: 10_000,
        }));
        lease.renewed(Generation::new(9));
        assert_eq!(lease.fencing_token(), Generation::new(9));
        let outcome = Outcome::Unknown { reason: "x".into() };
        let done = lease.complete(outcome.clone(), 2_000, Duration::from_secs(86_400));
        assert_eq!(done.precondition, Precondition::Generation(Generation::new(9)));
        let WriteOp::Put { value, ttl } = &done.op else { panic!("complete must put") };
        assert_eq!(*ttl, Ttl::After(Duration::from_secs(86_400)));
        assert_eq!(
            Record::decode(value).unwrap(),
            Record::Finished { fingerprint: fp("a"), outcome: outcome.clone(), finished_at_ms: 2_000 }
        );
        assert_eq!(lease.complete_lapsed(outcome, 2_000, Duration::from_secs(1)).precondition, Precondition::Absent);
        let release = lease.release();
        assert_eq!((release.op, release.precondition), (WriteOp::Delete, Precondition::Generation(Generation::new(9))));
    }

    #[test]
    fn a_holder_is_dead_only_once_its_generation_was_seen_unchanged_for_a_whole_lease() {
        let lease = Duration::from_secs(1);
        let record = Record::InProgress { fingerprint: fp("a"), owner: "o".into(), started_at_ms: 0, lease_ms: 1000 };
        let mut seen = Observations::new(8);
        let t0 = Instant::now();
        let g = Generation::new(5);
        // A first sighting says nothing about how long the generation has stood: a whole lease to go.
        assert_eq!(seen.observe(&key(), &record, g, lease, t0), Watch::Alive { again_in: lease });
        let half = Duration::from_millis(500);
        assert_eq!(seen.observe(&key(), &record, g, lease, t0 + half), Watch::Alive { again_in: half });
        // A renewal (a new generation) starts the watch again.
        let g2 = Generation::new(9);
        assert_eq!(seen.observe(&key(), &record, g2, lease, t0 + half), Watch::Alive { again_in: lease });
        assert_eq!(seen.observe(&key(), &record, g2, lease, t0 + lease), Watch::Alive { again_in: half });
        assert_eq!(seen.observe(&key(), &record, g2, lease, t0 + lease + half), Watch::Lapsed(g2));
        // The record's own lease counts, not the observer's.
        let long = Record::InProgress { fingerprint: fp("a"), owner: "o".into(), started_at_ms: 0, lease_ms: 3000 };
        let mut other = Observations::new(8);
        assert!(
            matches!(other.observe(&key(), &long, g, lease, t0), Watch::Alive { again_in } if again_in == Duration::from_secs(3))
        );
        assert!(matches!(other.observe(&key(), &long, g, lease, t0 + Duration::from_secs(2)), Watch::Alive { .. }));
        assert_eq!(other.observe(&key(), &long, g, lease, t0 + Duration::from_secs(3)), Watch::Lapsed(g));
        // Forgotten, the watch starts over.
        seen.forget(&key());
        assert_eq!(seen.observe(&key(), &record, g2, lease, t0 + lease * 5), Watch::Alive { again_in: lease });
    }

    #[test]
    fn a_full_memory_forgets_and_so_only_delays() {
        let lease = Duration::from_secs(1);
        let record = Record::InProgress { fingerprint: fp("a"), owner: "o".into(), started_at_ms: 0, lease_ms: 1000 };
        let mut seen = Observations::new(2);
        let t0 = Instant::now();
        let keys: Vec<RecordKey> = (0..3)
            .map(|i| {
                RecordKey::new("p/", &Scope::from_credential(None), &IdempotencyKey::new(format!("k{i}")).unwrap())
            })
            .collect();
        seen.observe(&keys[0], &record, Generation::new(1), lease, t0);
        seen.observe(&keys[1], &record, Generation::new(2), lease, t0);
        seen.observe(&keys[2], &record, Generation::new(3), lease, t0);
        assert!(seen.len() <= 2);
        // Whatever was dropped is watched from scratch: never judged dead early.
        for (i, k) in keys.iter().enumerate() {
            let w = seen.observe(k, &record, Generation::new(i as u64 + 1), lease, t0 + Duration::from_millis(999));
            assert!(matches!(w, Watch::Alive { .. }), "{i}: {w:?}");
        }
    }

    #[test]
    fn a_watch_counts_from_the_first_answer_to_the_send_of_the_confirming_read() {
        let lease = Duration::from_secs(1);
        let quarter = lease / 4;
        let t0 = Instant::now();
        let g = Generation::new(5);
        let mut seen = Observations::new(8);
        assert_eq!(seen.watch("k", g, lease, t0, t0), Watch::Alive { again_in: lease });
        for n in 1..4 {
            assert!(matches!(seen.watch("k", g, lease, t0 + quarter * n, t0 + quarter * n), Watch::Alive { .. }));
        }
        assert_eq!(seen.watch("k", g, lease, t0 + lease, t0 + lease), Watch::Lapsed(g));
        // A read sent a quarter lease after the last answer but answered two leases later (queued behind a locked
        // store) counts only up to its send.
        let mut late = Observations::new(8);
        late.watch("k", g, lease, t0, t0);
        assert_eq!(late.watch("k", g, lease, t0 + quarter, t0 + lease * 2), Watch::Alive { again_in: lease - quarter });
    }

    #[test]
    fn only_a_larger_generation_is_a_sign_of_life() {
        let lease = Duration::from_secs(1);
        let step = Duration::from_millis(300);
        let t0 = Instant::now();
        let mut seen = Observations::new(8);
        seen.watch("k", Generation::new(9), lease, t0, t0);
        // The lease key went (the store's TTL): only the entry's smaller generation is left. Not a renewal.
        assert!(matches!(seen.watch("k", Generation::new(4), lease, t0 + step, t0 + step), Watch::Alive { .. }));
        assert!(matches!(
            seen.watch("k", Generation::new(4), lease, t0 + step * 2, t0 + step * 2),
            Watch::Alive { .. }
        ));
        assert!(matches!(
            seen.watch("k", Generation::new(4), lease, t0 + step * 3, t0 + step * 3),
            Watch::Alive { .. }
        ));
        let t1 = t0 + lease;
        assert_eq!(seen.watch("k", Generation::new(4), lease, t1, t1), Watch::Lapsed(Generation::new(4)));
        // A renewal (larger) starts it again.
        assert_eq!(seen.watch("k", Generation::new(12), lease, t1, t1), Watch::Alive { again_in: lease });
    }

    #[test]
    fn a_gap_between_reads_or_a_clear_restarts_every_watch() {
        let lease = Duration::from_secs(3);
        let t0 = Instant::now();
        let g = Generation::new(5);
        let mut seen = Observations::new(8);
        seen.watch("a", g, lease, t0, t0);
        seen.watch("b", g, lease, t0, t0);
        // Two seconds without a read of "a" (over half the lease): this observer was not looking.
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(seen.watch("a", g, lease, t1, t1), Watch::Alive { again_in: lease });
        let second = Duration::from_secs(1);
        assert_eq!(seen.watch("a", g, lease, t1 + second, t1 + second), Watch::Alive { again_in: second * 2 });
        assert_eq!(seen.watch("a", g, lease, t1 + second * 2, t1 + second * 2), Watch::Alive { again_in: second });
        assert_eq!(seen.watch("a", g, lease, t1 + lease, t1 + lease), Watch::Lapsed(g));
        seen.clear();
        assert!(seen.is_empty());
        assert_eq!(seen.watch("b", g, lease, t1, t1), Watch::Alive { again_in: lease });
    }
}
