//! The layer's counters (`idem_idempotency_*_total`), each looked up in the metrics recorder once and kept:
//! the `counter!` macro builds and hashes the key in the registry on every call, which is a measurable share
//! of a replay. The handles are taken at first use, so an embedding
//! application installs its recorder before serving (as with any `metrics` handle).

use std::sync::OnceLock;

/// One of the layer's counters.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Count {
    Claims,
    Replays,
    Conflicts,
    Mismatches,
    Releases,
    Takeovers,
    LeasesLost,
    UnknownOutcomes,
    LapsedTakeovers,
    Panics,
    ReleasedFailures,
    SignatureRefusals,
}

/// Name and help of each counter, in the order of [`Count`].
const COUNTERS: [(&str, &str); 12] = [
    ("idem_idempotency_claims_total", "Keys claimed: requests executed under a new record."),
    ("idem_idempotency_replays_total", "Retries answered from a stored record (incl. response-not-stored)."),
    ("idem_idempotency_conflicts_total", "Retries answered 409 because the first request was still in flight."),
    ("idem_idempotency_mismatches_total", "Keys reused for a different request, answered 422."),
    ("idem_idempotency_releases_total", "Keys released after 429/503 or a request never sent."),
    (
        "idem_idempotency_takeovers_total",
        "Completions refused by the fence: another holder (after this one's lease lapsed) or an operator's \
         delete replaced the record.",
    ),
    ("idem_idempotency_leases_lost_total", "Lease renewals refused by the fence while a request ran."),
    ("idem_idempotency_unknown_outcomes_total", "Requests sent whose outcome is unknown (reset, timeout)."),
    (
        "idem_idempotency_lapsed_takeovers_total",
        "In-flight records taken over by a retry after their generation stood unchanged for a whole lease.",
    ),
    ("idem_idempotency_panics_total", "Panics of the inner service, recorded as unknown outcomes and answered 500."),
    (
        "idem_idempotency_released_failures_total",
        "Non-2xx answers on routes with on_failure = release: passed on, key released so a redelivery executes.",
    ),
    (
        "idem_idempotency_signature_refusals_total",
        "Requests on a route with a signature check answered 401: nothing claimed, stored or forwarded.",
    ),
];

/// Adds one to `which`.
pub(crate) fn count(which: Count) {
    static HANDLES: [OnceLock<metrics::Counter>; COUNTERS.len()] = [const { OnceLock::new() }; COUNTERS.len()];
    let index = which as usize;
    HANDLES[index].get_or_init(|| metrics::counter!(COUNTERS[index].0)).increment(1);
}

/// Describes the layer's counters and registers them at zero, so dashboards and alerts find every series
/// before its first event.
pub(crate) fn register() {
    for (name, help) in COUNTERS {
        metrics::describe_counter!(name, help);
        metrics::counter!(name).increment(0);
    }
}
