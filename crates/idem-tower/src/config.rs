//! The layer's settings: the policy enums its builder takes and the [`Config`] every service it makes
//! shares (read by each step of a request: prepare, decide, execute).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};

use crate::cache::ReplayCache;
use crate::route::{OnFailure, RouteCounters, RoutePolicy};

/// Whether a covered request must carry a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KeyPolicy {
    /// Requests without `Idempotency-Key` pass through unprotected (the default).
    #[default]
    Optional,
    /// Requests without `Idempotency-Key` get 400 (draft §2.7).
    Required,
}

/// What a retry gets while the first request under its key is still executing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// 409 Conflict with `Retry-After` at once (draft §2.6; the default).
    Reject,
    /// Wait up to this long for the first request to finish and replay its response; 409 after that.
    Wait(Duration),
}

/// What to do when a request was sent but its outcome is unknown (reset or timeout after sending).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum UnknownOutcome {
    /// Store "unknown" and answer 502 to this and every retry, so nothing runs twice (the default).
    #[default]
    Keep,
    /// Release the key so a retry executes again: only for upstreams that dedupe on the forwarded key.
    Release,
}

#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) key_policy: KeyPolicy,
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) max_stored_body: usize,
    pub(crate) max_request_body: usize,
    pub(crate) credential_headers: Vec<HeaderName>,
    pub(crate) record_prefix: String,
    pub(crate) owner: String,
    pub(crate) unknown_outcome: UnknownOutcome,
    pub(crate) execution_timeout: Duration,
    /// Every detached task (executions, outcome writes), so shutdown can wait for them.
    pub(crate) tracker: tokio_util::task::TaskTracker,
    pub(crate) replay_cache: Option<Arc<ReplayCache>>,
    /// The in-flight records this process found, watched for a dead holder (shared by every service the
    /// layer makes).
    pub(crate) observations: Arc<std::sync::Mutex<idem_core::record::Observations>>,
    /// What a non-2xx answer does to the key ([`OnFailure::Store`] outside routes).
    pub(crate) on_failure: OnFailure,
    /// The route this configuration serves, if any (key sources, ignores, signature check).
    pub(crate) route: Option<Arc<RoutePolicy>>,
    /// The route's own counters (`idem_route_*_total{route}`).
    pub(crate) route_counters: Option<Arc<RouteCounters>>,
}
