//! idem's logic without I/O: idempotency keys, scopes, request fingerprints and the record state machine of
//! `draft-ietf-httpapi-idempotency-key-header`, and the state machines of `idem run`'s work ledger and `idem once`'s
//! slots.
//!
//! Nothing here reads the clock, the network or the environment: time comes in as an argument, and every
//! transition of a record comes out as a [`Write`] — a conditional store write that a caller (the tower layer,
//! a test) performs. Each [`Write`] after the claim is conditional on the generation of the record it replaces,
//! which makes the generation the *fencing token*: a holder whose lease lapsed and was taken over finds its
//! write refused.
//!
//! ```
//! use idem_core::{Fingerprint, IdempotencyKey, RequestParts, Scope, derive_key};
//!
//! let key = IdempotencyKey::from_field_lines([&b"\"order-42\""[..]])?.expect("one field line");
//! assert_eq!(key.as_str(), "order-42");
//!
//! let scope = Scope::from_credential(Some(b"Bearer alice"));
//! let a = Fingerprint::of_request(&RequestParts::new("POST", "/orders", None, Some("application/json"), br#"{"a":1,"b":2}"#));
//! let b = Fingerprint::of_request(&RequestParts::new("POST", "/orders", None, Some("application/json"), br#"{ "b": 2, "a": 1 }"#));
//! assert_eq!(a, b);
//! assert_ne!(scope, Scope::from_credential(Some(b"Bearer bob")));
//!
//! let derived = derive_key("orders", "42", br#"{"amount": 100}"#)?;
//! assert!(derived.as_str().starts_with("orders:42:"));
//! # Ok::<(), idem_core::Error>(())
//! ```

mod error;
mod fingerprint;
mod key;
mod ledger;
mod planted;
mod problem;
mod record;
mod redact;
mod slot;

pub use error::Error;
pub use fingerprint::{Fingerprint, RequestParts, Scope};
pub use idem_store::{Write, WriteOp};
pub use key::{IdempotencyKey, MAX_KEY_LEN, canonical_payload, derive_key};
pub use ledger::{
    Entry, FailureVerdict, Held, ItemClaim, ItemKeys, Plan, RetryLimit, adopt, entry_prefix, error_fingerprint, plan,
    record_noted,
};
pub use planted::planted;
pub use problem::ProblemType;
pub use record::{Claim, Lease, Observations, Outcome, Record, RecordKey, StoredResponse, Verdict, Watch, judge};
pub use redact::redact_url;
pub use slot::{
    Ending, FUTURE_TOLERANCE_MS, HISTORY, HeldSlot, INTERRUPTED_EXIT, Job, MissedReason, SlotClaim, SlotEntry,
    SlotFailure, SlotKeys, SlotPlan, behind_key, interrupted_key, is_kept_ahead, job_key, lease_prefix, missed,
    plan as plan_slot, prune, repeats_key, slot_of_key, slot_prefix, takeovers_key,
};
