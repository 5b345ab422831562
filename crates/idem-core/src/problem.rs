//! The kinds of problem idem answers with, defined once for the KV server, the Idempotency-Key layer, the
//! proxy and the clients. Each is an RFC 9457 problem type (§3.1.1): a stable URI that clients branch on,
//! `urn:idem:problem:<slug>`, with a fixed title (§3.1.3). The HTTP status goes with each answer, since a few
//! kinds are sent with more than one (an unknown outcome is 502 or 504).

macro_rules! problem_types {
    ($($(#[$doc:meta])* $variant:ident = $slug:literal, $title:literal;)*) => {
        /// A kind of problem (RFC 9457 §3.1.1 `type`); see the module documentation.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemType {
            $($(#[$doc])* $variant,)*
        }

        impl ProblemType {
            /// Every kind, in the order defined.
            pub const ALL: &'static [ProblemType] = &[$(ProblemType::$variant,)*];

            /// The last part of the type URI, e.g. `outcome-unknown`.
            pub const fn slug(self) -> &'static str {
                match self {
                    $(ProblemType::$variant => $slug,)*
                }
            }

            /// The type URI, e.g. `urn:idem:problem:outcome-unknown` (RFC 9457 §3.1.1).
            pub const fn uri(self) -> &'static str {
                match self {
                    $(ProblemType::$variant => concat!("urn:idem:problem:", $slug),)*
                }
            }

            /// The title, the same for every occurrence (RFC 9457 §3.1.3).
            pub const fn title(self) -> &'static str {
                match self {
                    $(ProblemType::$variant => $title,)*
                }
            }
        }
    };
}

problem_types! {
    /// 404: no route matches the request's path.
    UnknownRoute = "unknown-route", "Unknown route";
    /// 405: the route does not take this method (RFC 9110 §15.5.6).
    MethodNotAllowed = "method-not-allowed", "Method not allowed";
    /// 404: no live value under the key.
    NotFound = "not-found", "Key not found";
    /// 401: the bearer token is missing or wrong (RFC 6750 §3).
    Unauthorized = "unauthorized", "Unauthorized";
    /// 400: the key is empty, over 1024 bytes, or holds a NUL.
    InvalidKey = "invalid-key", "Invalid key";
    /// 400: the key's percent-encoding is malformed or not UTF-8.
    InvalidPercentEncoding = "invalid-percent-encoding", "Invalid percent-encoding";
    /// 400: `If-Match` / `If-None-Match` is not a precondition idem accepts.
    InvalidPrecondition = "invalid-precondition", "Invalid precondition header";
    /// 400: a query parameter is unknown or malformed.
    InvalidQuery = "invalid-query", "Invalid query";
    /// 400: the TTL is out of range or malformed.
    InvalidTtl = "invalid-ttl", "Invalid TTL";
    /// 400 or 422: the request body is not what the operation takes.
    InvalidBody = "invalid-body", "Invalid body";
    /// 422: a set or counter argument is out of range.
    InvalidArgument = "invalid-argument", "Invalid argument";
    /// 400: the idempotency record path does not name a record.
    InvalidRecordPath = "invalid-record-path", "Invalid record path";
    /// 400: the proxy cannot forward the request target.
    InvalidTarget = "invalid-target", "Invalid request target";
    /// 413: the value exceeds `--max-value-bytes`.
    ValueTooLarge = "value-too-large", "Value too large";
    /// 412: the precondition does not hold (RFC 9110 §13.1).
    PreconditionFailed = "precondition-failed", "Precondition failed";
    /// 422: a dedupe id was used before with another payload.
    DedupeIdReused = "dedupe-id-reused", "Dedupe id reused";
    /// 409: the stored value is not of the type the operation needs (a set, a counter).
    WrongType = "wrong-type", "Wrong type";
    /// 409: the counter would leave the signed 64-bit range.
    CounterOverflow = "counter-overflow", "Counter overflow";
    /// 409: a read-modify-write gave up after its retries.
    UpdateExhausted = "update-exhausted", "Update exhausted";
    /// 503: the store cannot be reached now; retry later.
    StoreUnavailable = "store-unavailable", "Store unavailable";
    /// 500: the store failed.
    StoreFailed = "store-failed", "Store failed";
    /// 400: plain HTTP sent to a TLS listener.
    TlsRequired = "tls-required", "TLS required";
    /// 400: the Idempotency-Key field is malformed (draft §2.1) or repeated.
    IdempotencyKeyInvalid = "idempotency-key-invalid", "Idempotency-Key invalid";
    /// 400: the key is required and missing (draft §2.7).
    IdempotencyKeyMissing = "idempotency-key-missing", "Idempotency-Key required";
    /// 422: the key was used with another request (draft §2.7).
    IdempotencyKeyReused = "idempotency-key-reused", "Idempotency-Key reused";
    /// 500: the stored record under the key cannot be read.
    IdempotencyRecordUnreadable = "idempotency-record-unreadable", "Idempotency record unreadable";
    /// 409: a request with the key is still executing (draft §2.7).
    RequestInFlight = "request-in-flight", "Request in flight";
    /// 413: the request body exceeds `--max-request-body`.
    RequestTooLarge = "request-too-large", "Request body too large";
    /// 431: the request's header fields are over the limits (RFC 6585 §5): `idem serve` takes nginx's
    /// limits, 8 KiB for one field line and 32 KiB for them all.
    HeaderFieldsTooLarge = "header-fields-too-large", "Request header fields too large";
    /// 400: the request body could not be read to its end.
    RequestBodyUnreadable = "request-body-unreadable", "Request body unreadable";
    /// 409: the request under the key was executed, but its response was over the stored-body limit, so it
    /// cannot be replayed and is not executed again.
    ResponseNotStored = "response-not-stored", "Response not stored";
    /// 502 or 504: the request was sent but no complete answer came back; it may or may not have taken effect.
    OutcomeUnknown = "outcome-unknown", "Outcome unknown";
    /// 409: the request's outcome had been unknown, and an operator found that it took effect; it is not
    /// executed again (the detail carries their note).
    OutcomeResolved = "outcome-resolved", "Outcome resolved by an operator";
    /// 502: the upstream could not be reached; the request was not sent.
    UpstreamUnreachable = "upstream-unreachable", "Upstream unreachable";
    /// 401: a webhook route's signature is missing, malformed, wrong or stale; nothing was claimed or forwarded.
    WebhookSignatureInvalid = "webhook-signature-invalid", "Webhook signature invalid";
    /// 400: a request on a keyed route carries none of the route's key sources.
    WebhookKeyMissing = "webhook-key-missing", "Webhook delivery id missing";
    /// 422: a webhook route's delivery id came again with a different body (in the parts the route compares):
    /// the sender changed the event under the same id. A route's [`IdempotencyKeyReused`](Self::IdempotencyKeyReused).
    WebhookDeliveryReused = "webhook-delivery-reused", "Webhook delivery id reused with a different body";
    /// 500: an internal error of idem.
    Internal = "internal", "Internal error";
}

impl ProblemType {
    /// The kind whose [`uri`](Self::uri) is `uri`, if idem defines one.
    pub fn from_uri(uri: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| t.uri() == uri)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_distinct_and_uris_round_trip() {
        let mut slugs: Vec<&str> = ProblemType::ALL.iter().map(|t| t.slug()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), ProblemType::ALL.len());
        for t in ProblemType::ALL {
            assert_eq!(ProblemType::from_uri(t.uri()), Some(*t));
            assert_eq!(t.uri(), format!("urn:idem:problem:{}", t.slug()));
        }
        assert_eq!(ProblemType::from_uri("urn:idem:problem:nope"), None);
    }
}
