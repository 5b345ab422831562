//! idem's logic without I/O: idempotency keys, scopes and request fingerprints, and three state machines,
//! each in its own module with the same shape ([`Claim`](record::Claim) → [`Held`](record::Held) → fenced
//! writes):
//!
//! - [`record`]: the idempotency record of `draft-ietf-httpapi-idempotency-key-header` (the tower layer, the
//!   proxy);
//! - [`ledger`]: the work ledger of `idem run` (one entry and one lease per work item);
//! - [`slot`]: the slots of `idem once` (each scheduled run of a cron job happens once).
//!
//! ```
//! use idem_core::record::{Claim, Outcome, RecordKey, StoredResponse, Verdict, judge};
//! use idem_core::{Fingerprint, IdempotencyKey, RequestParts, Scope};
//! use idem_store::{MemoryStore, Store, StoreExt};
//! use std::time::Duration;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let key = IdempotencyKey::from_field_lines([&b"\"order-42\""[..]])?.expect("one field line");
//! let request = RequestParts::new("POST", "/orders", None, Some("application/json"), br#"{"amount":1}"#);
//! let fingerprint = Fingerprint::of_request(&request);
//! let record_key = RecordKey::new("idempotency/", &Scope::from_credential(Some(b"Bearer alice")), &key);
//!
//! // A free key is claimed with a create-if-absent; the generation the store gives it fences every later write.
//! let claim = Claim::new(record_key.clone(), fingerprint, "owner-1", 1_000, Duration::from_secs(10), Duration::from_secs(3600));
//! let generation = store.apply(claim.write()).await?.expect("a put has a generation");
//! let held = claim.acquired(generation);
//!
//! // ...execute the request, then store its answer, only if the lease is still held.
//! let answer = StoredResponse { status: 201, headers: vec![], body: "created".into() };
//! store.apply(held.complete(Outcome::Response(answer.clone()), 2_000, Duration::from_secs(3600))).await?;
//!
//! // A retry with the same request is a replay.
//! let record = store.get(record_key.as_str()).await?.map(|v| idem_core::record::Record::decode(v.value())).transpose()?;
//! assert_eq!(judge(record, &fingerprint), Verdict::Replay(answer));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! Nothing here reads the clock, the network or the environment: time comes in as an argument, and every
//! transition comes out as a [`Write`] — a conditional store write that a caller (the tower layer, the runner,
//! a test) performs. Each [`Write`] after the claim is conditional on the generation of the value it replaces,
//! which makes the generation the *fencing token*: a holder whose lease lapsed and was taken over finds its
//! write refused. Each `Held` is kept alive by an [`idem_store::LeaseKeeper`] through
//! [`idem_store::Renewable`].
//!
//! Keys and fingerprints:
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
pub mod ledger;
mod planted;
mod problem;
pub mod record;
mod redact;
pub mod slot;

pub use error::Error;
pub use fingerprint::{Fingerprint, RequestParts, Scope};
pub use idem_store::{Write, WriteOp};
pub use key::{IdempotencyKey, MAX_KEY_LEN, canonical_payload, derive_key};
pub use planted::{planted, unconditional as planted_unconditional};
pub use problem::ProblemType;
pub use redact::redact_url;
