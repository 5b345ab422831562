//! The client half of exactly-once: derive one `Idempotency-Key` per logical write before the first attempt,
//! resend the identical bytes under it after an unknown outcome, and stop on a conflict.
//!
//! ```
//! use idem_client::derive_key;
//!
//! // A crashed and restarted process rebuilds the same key from the same write...
//! let a = derive_key("invoices", "42", br#"{"amount": 1200, "customer": "c-7"}"#)?;
//! let b = derive_key("invoices", "42", br#"{"customer":"c-7","amount":1200}"#)?;
//! assert_eq!(a, b);
//! // ...and a changed payload is another write, with another key.
//! assert_ne!(a, derive_key("invoices", "42", br#"{"amount": 1300, "customer": "c-7"}"#)?);
//! # Ok::<(), idem_client::Error>(())
//! ```
//!
//! Sending it (against `idem serve --upstream` or any server that honours the header):
//!
//! ```no_run
//! use idem_client::{Client, WriteRequest, derive_key};
//! use reqwest::Method;
//!
//! # async fn demo() -> Result<(), idem_client::Error> {
//! let payload = serde_json::json!({ "customer": "c-7", "amount": 1200 });
//! // The same prefix, id and payload give the same key in any process, so a restarted job resends it.
//! let key = derive_key("invoices", "42", &serde_json::to_vec(&payload)?)?;
//! let request = WriteRequest::json(Method::POST, "http://127.0.0.1:8180/invoices", key, &payload)?;
//! let response = Client::new().send(&request).await?;
//! println!("{} after {} attempt(s), replayed: {}", response.status(), response.attempts(), response.replayed());
//! # Ok(())
//! # }
//! ```
//!
//! Success is a 2xx answer. [`Client::send`] retries transport errors and timeouts, `409` with `Retry-After` (the first request is still
//! in flight), `429` and `5xx` answers that were not stored (no `Idempotent-Replayed`), honouring
//! `Retry-After` and otherwise backing off with full jitter, for at most [`RetryPolicy::max_attempts`]
//! attempts (a `Retry-After` is honoured up to 10 s, [`Client::max_retry_after`]). It stops at once with a typed
//! [`Error`] on `422` (the key was used for another payload), on a `409` that is not the in-flight answer, on
//! other `4xx`, on `3xx` (only 307/308 are followed), on a stored `5xx`, and on idem's `outcome-unknown`
//! answer, and on a TLS failure ([`Error::Tls`]: the server's certificate refused, or no TLS there).
//! HTTPS uses rustls on the ring provider with the platform's trust store; [`TlsConfig`] trusts a private CA
//! instead (curl's `--cacert`) and presents a client certificate. [`KvClient`] offers the KV API of `idem serve`: reads, conditional writes, the read-modify-write
//! loop on ETags, and the atomic set and counter operations, each with an optional dedupe id so a resent change applies once.

mod error;
mod kv;
mod send;
mod tls;

pub use error::Error;
pub use idem_core::{IdempotencyKey, derive_key};
pub use idem_store::{CounterOutcome, Generation, Precondition, RetryPolicy, SetChange, SetOutcome};
pub use kv::KvClient;
pub use send::{Client, Response, WriteRequest};
pub use tls::{TlsConfig, client_builder, install_crypto_provider, tls_failure};
