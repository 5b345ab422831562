//! The idempotency record and its state machine (docs/DESIGN.md, Idempotency-Key steps 2 to 6).
//!
//! ```text
//!            claim (create if absent, TTL = lease)
//!   absent ───────────────────────────────────────▶ InProgress ──renew (fenced, TTL = lease)──┐
//!     ▲                                              │   ▲ └───────────────────────────────────┘
//!     │ lease lapses (store expiry) / release        │   │
//!     └──────────────────────────────────────────────┘   │
//!                                complete (fenced, TTL = retention)
//!                InProgress ──────────────────────────▶ Completed | TooLarge | Unknown ──retention──▶ absent
//! ```
//!
//! The lease is the record's own store TTL, so whether it lapsed is decided by the store's clock alone: a
//! lapsed record reads as absent and the next claim (a create-if-absent) takes it over. Every later write is
//! conditional on the generation the holder last wrote — its fencing token — so a holder that was taken over
//! cannot renew, complete or release the new holder's record.

use std::time::Duration;

use bytes::Bytes;
use idem_store::{Generation, Precondition, Renewable, Ttl, Versioned, Write, WriteOp};
use serde::{Deserialize, Serialize};

use crate::{Error, Fingerprint, IdempotencyKey, Scope};

/// The store key of a record: `PREFIX` + `SCOPE/KEY` (the default prefix is `idempotency/`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordKey(String);

impl RecordKey {
    /// The key for `key` owned by `scope`, under `prefix`.
    pub fn new(prefix: &str, scope: &Scope, key: &IdempotencyKey) -> Self {
        Self(format!("{prefix}{scope}/{key}"))
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
        /// When it was claimed, in milliseconds since the Unix epoch (informational: expiry is the store's).
        started_at_ms: u64,
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

/// The JSON head of an encoded record; the body bytes follow it raw.
#[derive(Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
enum Head {
    InProgress { fingerprint: String, owner: String, started_at_ms: u64 },
    Completed { fingerprint: String, status: u16, headers: Vec<(String, String)>, finished_at_ms: u64 },
    TooLarge { fingerprint: String, status: u16, size: u64, limit: u64, finished_at_ms: u64 },
    Unknown { fingerprint: String, reason: String, finished_at_ms: u64 },
}

impl Record {
    /// The fingerprint of the request this record belongs to.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InProgress { fingerprint, .. } | Record::Finished { fingerprint, .. } => fingerprint,
        }
    }

    /// Encodes as stored: a 4-byte big-endian length, a JSON head, then the response body raw (so a binary
    /// body is neither re-encoded nor inflated).
    pub fn encode(&self) -> Bytes {
        let (head, body) = match self {
            Record::InProgress { fingerprint, owner, started_at_ms } => (
                Head::InProgress {
                    fingerprint: fingerprint.to_hex(),
                    owner: owner.clone(),
                    started_at_ms: *started_at_ms,
                },
                None,
            ),
            Record::Finished { fingerprint, outcome, finished_at_ms } => {
                let fingerprint = fingerprint.to_hex();
                let finished_at_ms = *finished_at_ms;
                match outcome {
                    Outcome::Response(r) => (
                        Head::Completed { fingerprint, status: r.status, headers: r.headers.clone(), finished_at_ms },
                        Some(&r.body),
                    ),
                    Outcome::TooLarge { status, size, limit } => (
                        Head::TooLarge { fingerprint, status: *status, size: *size, limit: *limit, finished_at_ms },
                        None,
                    ),
                    Outcome::Unknown { reason } => {
                        (Head::Unknown { fingerprint, reason: reason.clone(), finished_at_ms }, None)
                    }
                }
            }
        };
        // Serialising plain strings and integers cannot fail.
        let head = serde_json::to_vec(&head).unwrap_or_default();
        let mut out = Vec::with_capacity(4 + head.len() + body.map_or(0, Bytes::len));
        out.extend_from_slice(&(head.len() as u32).to_be_bytes());
        out.extend_from_slice(&head);
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
            Head::InProgress { fingerprint, owner, started_at_ms } => {
                Record::InProgress { fingerprint: Fingerprint::from_hex(&fingerprint)?, owner, started_at_ms }
            }
            Head::Completed { fingerprint, status, headers, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::Response(StoredResponse { status, headers, body }),
                finished_at_ms,
            },
            Head::TooLarge { fingerprint, status, size, limit, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::TooLarge { status, size, limit },
                finished_at_ms,
            },
            Head::Unknown { fingerprint, reason, finished_at_ms } => Record::Finished {
                fingerprint: Fingerprint::from_hex(&fingerprint)?,
                outcome: Outcome::Unknown { reason },
                finished_at_ms,
            },
        })
    }
}

/// What to do with a request, given the record its key already has (draft §2.6 and docs/DESIGN.md step 3).
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
        },
    }
}

/// A claim about to be made: [`Claim::write`] is the conditional create; once the store accepted it,
/// [`Claim::acquired`] turns it into the [`Lease`] its generation fences.
#[derive(Clone, Debug)]
pub struct Claim {
    key: RecordKey,
    fingerprint: Fingerprint,
    owner: String,
    started_at_ms: u64,
    length: Duration,
}

impl Claim {
    /// Prepares to claim `key` for a request with `fingerprint`, by `owner`, at `now_ms` (milliseconds since
    /// the Unix epoch), with a lease of `length` (at least the store's minimum TTL, 1 s by default).
    pub fn new(
        key: RecordKey,
        fingerprint: Fingerprint,
        owner: impl Into<String>,
        now_ms: u64,
        length: Duration,
    ) -> Self {
        Self { key, fingerprint, owner: owner.into(), started_at_ms: now_ms, length }
    }

    /// Create the in-progress record if the key has no live record, expiring after the lease length.
    pub fn write(&self) -> Write {
        Write {
            key: self.key.0.clone(),
            op: WriteOp::Put { value: self.in_progress().encode(), ttl: Ttl::After(self.length) },
            precondition: Precondition::Absent,
        }
    }

    /// The lease held after the store accepted [`Claim::write`] and gave it `generation`.
    pub fn acquired(self, generation: Generation) -> Lease {
        Lease { claim: self, generation }
    }

    fn in_progress(&self) -> Record {
        Record::InProgress {
            fingerprint: self.fingerprint,
            owner: self.owner.clone(),
            started_at_ms: self.started_at_ms,
        }
    }
}

/// A held lease on a record. Its generation is the fencing token: every write it produces is conditional on it.
#[derive(Clone, Debug)]
pub struct Lease {
    claim: Claim,
    generation: Generation,
}

/// Kept by [`idem_store::LeaseKeeper`] while the request executes.
impl Renewable for Lease {
    fn length(&self) -> Duration {
        self.claim.length
    }

    /// Extend the lease by its length from now (the store's now), only if still held.
    fn renewal(&self) -> Write {
        Write {
            key: self.claim.key.0.clone(),
            op: WriteOp::Put { value: self.claim.in_progress().encode(), ttl: Ttl::After(self.claim.length) },
            precondition: Precondition::Generation(self.generation),
        }
    }

    fn renewed(&mut self, generation: Generation) {
        self.advanced(generation);
    }

    fn is_mine(&self, current: &Versioned) -> bool {
        Record::decode(current.value()).is_ok_and(|record| Lease::is_mine(self, &record))
    }
}

impl Lease {
    /// The fencing token: the generation of the holder's last accepted write.
    pub fn generation(&self) -> Generation {
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

    /// Whether `record` is this lease's own in-progress record (same owner, claim time and fingerprint), e.g.
    /// after a renewal whose answer was lost landed in the store: then its generation is this lease's to adopt.
    /// A record another holder claimed is never "mine", so adopting cannot defeat the fence.
    pub fn is_mine(&self, record: &Record) -> bool {
        matches!(record, Record::InProgress { fingerprint, owner, started_at_ms }
            if *fingerprint == self.claim.fingerprint && *owner == self.claim.owner
                && *started_at_ms == self.claim.started_at_ms)
    }

    /// Record that a write of this lease was accepted with `generation` (the new fencing token).
    pub fn advanced(&mut self, generation: Generation) {
        self.generation = generation;
    }

    /// Store the outcome for `retention`, only if the lease is still held.
    pub fn complete(&self, outcome: Outcome, now_ms: u64, retention: Duration) -> Write {
        self.finish(outcome, now_ms, retention, Precondition::Generation(self.generation))
    }

    /// After [`Lease::complete`] failed its fence because the record lapsed and nobody took it over: store the
    /// outcome only if the key is still free, so the work done is not lost and a new holder is never overwritten.
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
            Record::InProgress { fingerprint: fp("a"), owner: "o-1".into(), started_at_ms: 7 },
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

    #[test]
    fn verdicts() {
        let a = fp("a");
        assert_eq!(judge(None, &a), Verdict::Claim);
        let running = Record::InProgress { fingerprint: a, owner: "o".into(), started_at_ms: 0 };
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
        assert_eq!(judge(Some(unknown), &a), Verdict::Unknown);
    }

    #[test]
    fn every_transition_after_the_claim_is_fenced() {
        let claim = Claim::new(key(), fp("a"), "owner-1", 1_000, Duration::from_secs(10));
        let create = claim.write();
        assert_eq!(create.precondition, Precondition::Absent);
        assert!(matches!(create.op, WriteOp::Put { ttl: Ttl::After(d), .. } if d == Duration::from_secs(10)));
        let mut lease = claim.acquired(Generation::new(5));
        assert_eq!(lease.renewal().precondition, Precondition::Generation(Generation::new(5)));
        assert!(lease.is_mine(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-1".into(),
            started_at_ms: 1_000
        }));
        assert!(!lease.is_mine(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-2".into(),
            started_at_ms: 1_000
        }));
        assert!(!lease.is_mine(&Record::InProgress {
            fingerprint: fp("a"),
            owner: "owner-1".into(),
            started_at_ms: 1_001
        }));
        lease.advanced(Generation::new(9));
        assert_eq!(lease.generation(), Generation::new(9));
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
}
