use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, header};
use idem_store::Store;
use tower::Layer;

use crate::cache::ReplayCache;
use crate::config::{Config, InFlight, KeyPolicy, UnknownOutcome};
use crate::route::{OnFailure, RouteCounters, RoutePolicy};
use crate::service::Idempotency;

/// Response headers replayed by default (with a replay, [step 3](crate#steps)), the representation and caching headers among
/// them without which a replayed body would be misread (`Content-Encoding`: a gzip body replayed without it is
/// garbage). `Set-Cookie` is never replayed, even if listed; `Content-Type` and `Content-Encoding` always are.
pub const DEFAULT_REPLAY_HEADERS: [HeaderName; 11] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_DISPOSITION,
    header::LOCATION,
    header::ETAG,
    header::LINK,
    header::CONTENT_LOCATION,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::VARY,
];

/// The store key prefix of records unless [`IdempotencyLayer::record_prefix`] says otherwise.
pub const DEFAULT_RECORD_PREFIX: &str = "idempotency/";

/// In-flight records of other holders watched at once, at most (about 150 bytes each); past it the oldest
/// observations are dropped, which only delays a takeover.
const OBSERVED_RECORDS: usize = 100_000;

/// Applies Idempotency-Key handling to a service; records live in a [`Store`] under `idempotency/SCOPE/KEY`.
///
/// Defaults: POST and PATCH, key optional, retention 24 h, lease 10 s (renewed every third of it while the
/// call runs), in-flight retries get 409, [`DEFAULT_REPLAY_HEADERS`], stored bodies up to 1 MiB, request bodies
/// up to 16 MiB, scope from `Authorization`, unknown outcomes kept.
pub struct IdempotencyLayer<St> {
    store: Arc<St>,
    config: Config,
    routes: Vec<RoutePolicy>,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`.
    pub fn new(store: St) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// A layer over a store already shared with other parts of the program.
    pub fn from_shared(store: Arc<St>) -> Self {
        let owner = format!("{}-{:016x}", std::process::id(), rand::random::<u64>());
        Self {
            store,
            config: Config {
                methods: vec![Method::POST, Method::PATCH],
                key_policy: KeyPolicy::Optional,
                retention: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(10),
                in_flight: InFlight::Reject,
                replay_headers: DEFAULT_REPLAY_HEADERS.to_vec(),
                max_stored_body: 1 << 20,
                max_request_body: 16 << 20,
                credential_headers: vec![header::AUTHORIZATION, HeaderName::from_static("x-api-key")],
                record_prefix: DEFAULT_RECORD_PREFIX.to_owned(),
                owner,
                unknown_outcome: UnknownOutcome::Keep,
                execution_timeout: Duration::from_secs(120),
                tracker: tokio_util::task::TaskTracker::new(),
                replay_cache: None,
                observations: Arc::new(std::sync::Mutex::new(idem_core::record::Observations::new(OBSERVED_RECORDS))),
                on_failure: OnFailure::Store,
                route: None,
                route_counters: None,
            },
            routes: Vec::new(),
        }
    }

    /// The methods covered (others pass through). Default POST and PATCH.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether covered requests must carry a key.
    pub fn key_policy(mut self, policy: KeyPolicy) -> Self {
        self.config.key_policy = policy;
        self
    }

    /// How long a finished record is kept (and replayed), from completion; the key is free again after it.
    /// Clamped to the store's TTL range, 1 s ..= 365 d.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention.clamp(idem_store::MIN_TTL, idem_store::MAX_TTL);
        self
    }

    /// The lease length: how long a claim survives its holder's death. Renewed every third of it while the
    /// call runs; at least 1 s (the store's minimum TTL), rounded up to it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// What a retry gets while the first request is executing.
    pub fn in_flight(mut self, policy: InFlight) -> Self {
        self.config.in_flight = policy;
        self
    }

    /// The response headers stored and replayed; `Set-Cookie` is always dropped from the list, and
    /// `Content-Type` and `Content-Encoding` always added (the stored body cannot be read without them).
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let mut list: Vec<HeaderName> = headers.into_iter().filter(|h| h != header::SET_COOKIE).collect();
        for required in [header::CONTENT_ENCODING, header::CONTENT_TYPE] {
            if !list.contains(&required) {
                list.insert(0, required);
            }
        }
        self.config.replay_headers = list;
        self
    }

    /// The largest response body stored, in bytes. A larger response reaches its first caller but is never
    /// replayed nor re-executed: retries get a problem+json naming this limit. Default 1 MiB; never more than
    /// the store's value limit minus 64 KiB for the record's head.
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.config.max_stored_body = bytes;
        self
    }

    /// The largest request body accepted on a keyed request, in bytes (it is buffered to fingerprint it);
    /// larger ones get 413. Default 16 MiB. Wrap the service in a [`DrainLayer`](crate::DrainLayer) built
    /// from [`request_body_limit`](Self::request_body_limit) so that a client that writes its whole body
    /// before reading gets that 413 rather than a reset connection.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest request body accepted on a keyed request, in bytes (see
    /// [`max_request_body`](Self::max_request_body)).
    pub fn request_body_limit(&self) -> usize {
        self.config.max_request_body
    }

    /// The headers whose values scope keys to a caller (all present ones, in this order, are hashed together).
    /// Default `Authorization` and `X-Api-Key`. Requests with none of them share the `anonymous` scope, so an
    /// API that authenticates some other way (a session cookie) must name its credential here, or callers
    /// could replay each other's responses.
    pub fn credential_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.credential_headers = headers.into_iter().collect();
        self
    }

    /// The store key prefix of records. Default `idempotency/`.
    pub fn record_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.record_prefix = prefix.into();
        self
    }

    /// The store key prefix this layer keeps its records under (set by [`IdempotencyLayer::record_prefix`]):
    /// give it to whatever else reads the records, such as the admin look-up
    /// (`idem_server::ServerConfig::with_record_prefix`), so both name the same keys.
    pub fn record_key_prefix(&self) -> &str {
        &self.config.record_prefix
    }

    /// The longest a covered request may take, from the call to the end of the part of the response that is
    /// stored; after it the outcome is unknown (504). Default 120 s.
    pub fn execution_timeout(mut self, timeout: Duration) -> Self {
        self.config.execution_timeout = timeout;
        self
    }

    /// Waits for every detached execution and outcome write of services made by this layer (and its clones) to
    /// finish. It does not stop new ones: one started while it waits is not waited for. Call it on shutdown
    /// after the server stopped accepting requests, so an execution whose client hung up is still recorded
    /// (else a retry after restart would run it again).
    pub async fn drain(&self) {
        self.config.tracker.close();
        self.config.tracker.wait().await;
    }

    /// Keeps finished records in memory, up to `max_bytes` bytes of stored responses (bodies, allow-listed
    /// headers and about 512 bytes per entry), so a replay is answered without reading the store; 0 (the
    /// default) turns it off. Records that are retried stay, one-off ones are evicted first.
    ///
    /// Use it only with a store no other process writes records to, such as the embedded SQLite store (its
    /// lock file makes it exclusive to one process): a record deleted by another process would go on being
    /// replayed from here until it expires. Anything in this process that deletes or overwrites a record
    /// without going through the layer must call [`IdempotencyLayer::invalidate`] for it. Expiry is checked on
    /// every hit against the store's expiry time, read with this machine's clock.
    pub fn replay_cache(mut self, max_bytes: u64) -> Self {
        self.config.replay_cache = (max_bytes > 0).then(|| Arc::new(ReplayCache::new(max_bytes)));
        self
    }

    /// Drops the record stored under `record_key` (`{record prefix}{scope}/{key}`, as the store holds it) from
    /// the replay cache. Call it for every write to the store that does not go through this layer (an
    /// operator's delete, say), after or while it happens; without a replay cache it does nothing.
    pub fn invalidate(&self, record_key: &str) {
        if let Some(cache) = &self.config.replay_cache {
            cache.invalidate(record_key);
        }
    }

    /// Adds a route: requests whose normalised path is the route's path or below it are keyed, checked and
    /// decided by its policy (the longest matching path wins), with every other setting of this layer. Its
    /// records live under `{record prefix}route/{name}/`. Paths no route covers keep the layer's own
    /// `Idempotency-Key` handling.
    pub fn route(mut self, policy: RoutePolicy) -> Self {
        self.routes.push(policy);
        self
    }

    /// What to do when the outcome of a sent request is unknown.
    pub fn unknown_outcome(mut self, policy: UnknownOutcome) -> Self {
        self.config.unknown_outcome = policy;
        self
    }
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        Self { store: Arc::clone(&self.store), config: self.config.clone(), routes: self.routes.clone() }
    }
}

impl<S, St: Store> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        // One configuration per route, made once: the clones share the tracker, the replay cache and the
        // observations of in-flight records (Arcs), so shutdown drains every route's executions.
        let mut routes: Vec<(Arc<RoutePolicy>, Arc<Config>)> = self
            .routes
            .iter()
            .map(|policy| {
                let policy = Arc::new(policy.clone());
                let mut config = self.config.clone();
                config.record_prefix = format!("{}route/{}/", self.config.record_prefix, policy.name);
                config.on_failure = policy.on_failure;
                if let Some(in_flight) = policy.in_flight {
                    config.in_flight = in_flight;
                }
                if let Some(retention) = policy.retention {
                    config.retention = retention;
                }
                if let Some(unknown) = policy.unknown_outcome {
                    config.unknown_outcome = unknown;
                }
                config.route = Some(Arc::clone(&policy));
                config.route_counters = Some(Arc::new(RouteCounters::new(&policy.name)));
                (policy, Arc::new(config))
            })
            .collect();
        // Longest path first: the first route that covers a path is the most specific one.
        routes.sort_by_key(|(policy, _)| std::cmp::Reverse(policy.path.len()));
        Idempotency::new(inner, Arc::clone(&self.store), Arc::new(self.config.clone()), routes.into())
    }
}
