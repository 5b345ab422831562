use idem_core::ProblemType;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{
    Claim, Fingerprint, IdempotencyKey, Lease, Outcome, Record, RecordKey, RequestParts, Scope, StoredResponse,
    Verdict, Write, WriteOp, judge,
};
use idem_store::{Error as StoreError, Generation, Store, system_time_to_millis};
use tower::Service;
use tracing::{error, info, warn};

use crate::config::{Config, InFlight, KeyPolicy, UnknownOutcome};
use crate::future::ResponseFuture;
use crate::problem::problem;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a caller waits for its outcome to be stored before it is answered anyway.
const ANSWER_WAIT: Duration = Duration::from_secs(3);

/// How long a failing outcome write is retried in the background.
const STORE_RETRY_FOR: Duration = Duration::from_secs(600);

/// Bytes kept free in a stored record for its JSON head (status, headers, fingerprint).
const RECORD_HEAD_ROOM: usize = 64 * 1024;

static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Marks a response of the inner service that did not come from a completed execution, so the layer applies
/// docs/DESIGN.md step 5. Insert it into the response's extensions (the reverse proxy does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// The request never left (connection refused, DNS failure): the key is released and a retry executes.
    NotSent,
    /// The request was sent but no complete answer came back (reset, timeout): stored as unknown, answered 502.
    OutcomeUnknown {
        /// For operators' logs and the record; never shown to another caller.
        reason: String,
    },
}

/// The whole body of a request the layer forwards, in the request's extensions, so that a service below can
/// send the request again: the reverse proxy does when the upstream provably never read it (a `Bytes` clone
/// shares the buffer; nothing is copied).
#[derive(Clone, Debug)]
pub struct BufferedBody(pub Bytes);

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) produces around `S`.
pub struct Idempotency<S, St> {
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, store: Arc<St>, config: Arc<Config>) -> Self {
        register_metrics();
        Self { inner, store, config }
    }
}

/// Describes the layer's counters and registers them at zero, so dashboards and alerts find every series
/// before its first event.
fn register_metrics() {
    const COUNTERS: [(&str, &str); 8] = [
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
    ];
    for (name, help) in COUNTERS {
        metrics::describe_counter!(name, help);
        metrics::counter!(name).increment(0);
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), store: Arc::clone(&self.store), config: Arc::clone(&self.config) }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    St: Store,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service is the one poll_ready was called on; keep a fresh clone in its place (tower's
        // usual idiom) and move the ready one into the future.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.methods.contains(request.method()) {
            let call = inner.call(request.map(Body::new));
            return ResponseFuture::new(async move { call.await.map(|r| r.map(Body::new)) });
        }
        let (store, config) = (Arc::clone(&self.store), Arc::clone(&self.config));
        ResponseFuture::new(async move {
            // Nothing here touches the store: a client that hangs up now leaves nothing behind.
            let keyed = match prepare(&config, request).await {
                Prepared::PassThrough(request) => return inner.call(request).await.map(|r| r.map(Body::new)),
                Prepared::Answer(response) => return Ok(response),
                Prepared::Keyed(keyed) => keyed,
            };
            if let Some(answer) = cached_answer(&config, &keyed) {
                return Ok(answer);
            }
            // Detached from the client connection from here on: a client that hangs up while the key is being
            // claimed, or while its request executes, drops this future but not the task, so no claim is left
            // without its execution and completion (docs/DESIGN.md step 4).
            let task = config.tracker.spawn(handle(inner, store, Arc::clone(&config), keyed));
            match task.await {
                Ok(answer) => answer,
                Err(_) => Ok(problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ProblemType::Internal,
                    "the request's task ended without an answer",
                )),
            }
        })
    }
}

/// A covered request, read and judged as far as possible without the store.
enum Prepared {
    /// No key, and none required.
    PassThrough(Request<Body>),
    /// Refused before any store access (missing, malformed key; body too large or unreadable).
    Answer(Response<Body>),
    /// Carries a valid key: its body read, its fingerprint and record key computed.
    Keyed(Keyed),
}

struct Keyed {
    parts: http::request::Parts,
    body: Bytes,
    fingerprint: Fingerprint,
    record_key: RecordKey,
}

/// Step 1 of docs/DESIGN.md: the key, the scope, the body and the fingerprint.
async fn prepare<ReqBody>(config: &Config, request: Request<ReqBody>) -> Prepared
where
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
{
    let lines = request.headers().get_all(&IDEMPOTENCY_KEY).iter().map(HeaderValue::as_bytes);
    let key = match IdempotencyKey::from_field_lines(lines) {
        Ok(Some(key)) => key,
        Ok(None) if config.key_policy == KeyPolicy::Optional => {
            return Prepared::PassThrough(request.map(Body::new));
        }
        Ok(None) => {
            return Prepared::Answer(problem(
                StatusCode::BAD_REQUEST,
                ProblemType::IdempotencyKeyMissing,
                &format!("{} requests to this endpoint must carry an Idempotency-Key header", request.method()),
            ));
        }
        Err(e) => {
            return Prepared::Answer(problem(
                StatusCode::BAD_REQUEST,
                ProblemType::IdempotencyKeyInvalid,
                &e.to_string(),
            ));
        }
    };
    let scope = scope_of(request.headers(), &config.credential_headers);
    let (mut parts, body) = request.into_parts();
    let body = match read_request_body(&parts.headers, body, config.max_request_body).await {
        Ok(body) => body,
        Err(refusal) => return Prepared::Answer(refusal),
    };
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let fingerprint = Fingerprint::of_request(&RequestParts::new(
        parts.method.as_str(),
        parts.uri.path(),
        parts.uri.query(),
        content_type,
        &body,
    ));
    let record_key = RecordKey::new(&config.record_prefix, &scope, &key);
    // The body is already here: an `Expect: 100-continue` passed on would make the inner service wait for a
    // go-ahead nobody sends.
    parts.headers.remove(header::EXPECT);
    Prepared::Keyed(Keyed { parts, body, fingerprint, record_key })
}

/// Step 3 from the replay cache: the answer a cached finished record gives, judged like one read from the store.
fn cached_answer(config: &Config, keyed: &Keyed) -> Option<Response<Body>> {
    let record = config.replay_cache.as_ref()?.get(keyed.record_key.as_str())?;
    finished_answer(judge(Some(record), &keyed.fingerprint)).ok()
}

async fn handle<S, St, ResBody>(
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    keyed: Keyed,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    let Keyed { mut parts, body, fingerprint, record_key } = keyed;
    parts.extensions.insert(BufferedBody(body.clone()));
    let lease = match decide(&*store, &config, &record_key, &fingerprint).await {
        Ok(lease) => lease,
        Err(answer) => return Ok(*answer),
    };
    metrics::counter!("idem_idempotency_claims_total").increment(1);
    let request = Request::from_parts(parts, Body::from(body));
    execute(inner, store, config, request, lease).await
}

/// The scope of a request: a hash of every configured credential header it carries (name and value).
fn scope_of(headers: &HeaderMap, credential_headers: &[HeaderName]) -> Scope {
    let mut credential = Vec::new();
    for name in credential_headers {
        for value in headers.get_all(name) {
            credential.extend_from_slice(name.as_str().as_bytes());
            credential.push(0);
            credential.extend_from_slice(value.as_bytes());
            credential.push(0);
        }
    }
    if credential.is_empty() { Scope::from_credential(None) } else { Scope::from_credential(Some(&credential)) }
}

async fn read_request_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<Bytes, Response<Body>>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::RequestTooLarge,
            &format!("a request with an Idempotency-Key may carry at most {limit} bytes of body"),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(problem(
            StatusCode::BAD_REQUEST,
            ProblemType::RequestBodyUnreadable,
            &format!("the request body could not be read: {e}"),
        )),
    }
}

/// Steps 2 and 3 of docs/DESIGN.md: claim the key, or answer from the record that holds it.
async fn decide<St: Store>(
    store: &St,
    config: &Config,
    record_key: &RecordKey,
    fingerprint: &Fingerprint,
) -> Result<Lease, Box<Response<Body>>> {
    let deadline = match config.in_flight {
        InFlight::Wait(bound) => Some(tokio::time::Instant::now() + bound),
        InFlight::Reject => None,
    };
    let mut pause = Duration::from_millis(10);
    let mut lost_races = 0;
    // docs/DESIGN.md step 2 as written: claim first, read only when the claim loses. Done when the replay
    // cache just missed, so the key is most likely new and the read would be wasted; without a cache a retry
    // is as likely as a new key, and a read costs every backend less than a refused write.
    let mut blind = config.replay_cache.is_some();
    loop {
        if std::mem::take(&mut blind) {
            match claim(store, config, record_key, fingerprint).await {
                Ok(lease) => return Ok(lease),
                Err(e) if e.is_precondition_failed() => continue,
                Err(e) => return Err(Box::new(store_unavailable(&e))),
            }
        }
        let token = config.replay_cache.as_ref().map(|c| c.token());
        let current = store.get(record_key.as_str()).await.map_err(|e| Box::new(store_unavailable(&e)))?;
        let record = match current.as_ref().map(|v| Record::decode(v.value())).transpose() {
            Ok(record) => record,
            Err(e) => {
                error!(key = record_key.as_str(), error = %e, "unreadable idempotency record");
                return Err(Box::new(problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ProblemType::IdempotencyRecordUnreadable,
                    "the stored record for this key cannot be read; an operator can delete it",
                )));
            }
        };
        if let (Some(cache), Some(token), Some(record), Some(current)) =
            (&config.replay_cache, token, &record, &current)
        {
            cache.insert(record_key.as_str(), record, current.expires_at(), token);
        }
        let answer = match finished_answer(judge(record, fingerprint)) {
            Ok(answer) => answer,
            Err(Verdict::InFlight) => {
                if let Some(deadline) = deadline
                    && tokio::time::Instant::now() + pause < deadline
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                    continue;
                }
                in_flight()
            }
            Err(_claim) => {
                match claim(store, config, record_key, fingerprint).await {
                    Ok(lease) => return Ok(lease),
                    // Another request created the record between our read and our write: judge what won.
                    Err(e) if e.is_precondition_failed() && lost_races < 3 => {
                        lost_races += 1;
                        continue;
                    }
                    Err(e) if e.is_precondition_failed() => in_flight(),
                    Err(e) => store_unavailable(&e),
                }
            }
        };
        return Err(Box::new(answer));
    }
}

/// Creates the in-flight record if the key has none (the conditional create of docs/DESIGN.md step 2).
async fn claim<St: Store>(
    store: &St,
    config: &Config,
    record_key: &RecordKey,
    fingerprint: &Fingerprint,
) -> Result<Lease, StoreError> {
    let claim = Claim::new(record_key.clone(), *fingerprint, config.owner.clone(), now_ms(), config.lease);
    match apply(store, claim.write()).await? {
        Some(generation) => Ok(claim.acquired(generation)),
        None => Err(StoreError::unavailable("the claim returned no generation")),
    }
}

/// The answer for a key whose record is finished, or was used for another request (docs/DESIGN.md step 3);
/// [`Verdict::Claim`] and [`Verdict::InFlight`] come back as they are: they need the store.
fn finished_answer(verdict: Verdict) -> Result<Response<Body>, Verdict> {
    Ok(match verdict {
        Verdict::Claim | Verdict::InFlight => return Err(verdict),
        Verdict::Replay(stored) => {
            metrics::counter!("idem_idempotency_replays_total").increment(1);
            replay(stored)
        }
        Verdict::Mismatch => {
            metrics::counter!("idem_idempotency_mismatches_total").increment(1);
            problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemType::IdempotencyKeyReused,
                "this key was already used for a different request (method, path, query, content type or body \
                 differ); use a new key for a new request",
            )
        }
        Verdict::TooLarge { status, limit } => {
            metrics::counter!("idem_idempotency_replays_total").increment(1);
            problem(
                StatusCode::CONFLICT,
                ProblemType::ResponseNotStored,
                &format!(
                    "the request under this key was executed (status {status}) but its response body was over \
                     the {limit}-byte stored-body limit, so it cannot be replayed; it will not be executed again"
                ),
            )
        }
        Verdict::Unknown => outcome_unknown(),
    })
}

/// Steps 4 to 6: execute once under the lease and record the outcome, fenced by the lease's generation.
async fn execute<S, St, ResBody>(
    mut inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    request: Request<Body>,
    lease: Lease,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    let mut keeper = LeaseKeeper { store: Arc::clone(&store), lease, held: true };
    // One deadline for the call and the part of the body that is stored: an upstream that stalls mid-body must
    // not keep the key in flight (and its lease renewed) forever.
    let deadline = tokio::time::Instant::now() + config.execution_timeout;
    let response = match keeper.during(tokio::time::timeout_at(deadline, inner.call(request))).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            keeper.unknown(&config, "the inner service failed").await;
            return Err(e);
        }
        Err(_) => {
            let limit = humantime_secs(config.execution_timeout);
            keeper.unknown(&config, &format!("no response within {limit}")).await;
            return Ok(outcome_unknown_now(StatusCode::GATEWAY_TIMEOUT, &limit));
        }
    };
    match response.extensions().get::<UpstreamFailure>().cloned() {
        Some(UpstreamFailure::NotSent) => {
            keeper.release().await;
            return Ok(response.map(Body::new));
        }
        Some(UpstreamFailure::OutcomeUnknown { reason }) => {
            keeper.unknown(&config, &reason).await;
            return Ok(response.map(Body::new));
        }
        None => {}
    }
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        // The upstream asked to be retried later: it did not do the work (docs/DESIGN.md step 5).
        keeper.release().await;
        return Ok(response.map(Body::new));
    }
    let (parts, body) = response.into_parts();
    // A record must fit the store's value limit, or its completion write would fail and the key would free
    // up when the lease lapses, letting a retry execute again: keep room for the record's head.
    let limit = config.max_stored_body.min(store.limits().max_value_bytes().saturating_sub(RECORD_HEAD_ROOM));
    let read = keeper.during(tokio::time::timeout_at(deadline, read_prefix(body, limit))).await;
    let read = read.unwrap_or_else(|_| {
        Prefix::Broken(format!("the response body did not end within {}", humantime_secs(config.execution_timeout)))
    });
    match read {
        Prefix::Complete(bytes) => {
            let headers = stored_headers(&parts.headers, &config.replay_headers);
            let stored = StoredResponse { status: status.as_u16(), headers, body: bytes.clone() };
            keeper.finish(&config, Outcome::Response(stored)).await;
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }
        Prefix::Over { prefix, rest } => {
            let outcome = Outcome::TooLarge { status: status.as_u16(), size: prefix.len() as u64, limit: limit as u64 };
            keeper.finish(&config, outcome).await;
            Ok(Response::from_parts(parts, Body::new(Prefixed { prefix: Some(prefix), rest })))
        }
        Prefix::Broken(reason) => {
            keeper.unknown(&config, &format!("the response body broke off: {reason}")).await;
            Ok(outcome_unknown())
        }
    }
}

type WriteFuture<'a> = dyn Future<Output = Result<Option<Generation>, StoreError>> + Send + 'a;

/// Holds a lease while work runs: renews it every third of its length and performs the fenced final write.
struct LeaseKeeper<St> {
    store: Arc<St>,
    lease: Lease,
    held: bool,
}

impl<St: Store> LeaseKeeper<St> {
    async fn during<F: Future>(&mut self, work: F) -> F::Output {
        tokio::pin!(work);
        let store = Arc::clone(&self.store);
        let store = &*store;
        let period = self.lease.length() / 3;
        let mut next = tokio::time::Instant::now() + period;
        // The renewal runs beside the work, not instead of it: a slow store must not stall reading the
        // response (and a stalled renewal is exactly when the work must go on).
        let mut renewal: Option<Pin<Box<WriteFuture<'_>>>> = None;
        loop {
            tokio::select! {
                biased;
                // A renewal cut off here may still land in the store and move the token past what we know;
                // `adopt` recognises our own record then.
                out = &mut work => return out,
                result = async { match renewal.as_mut() { Some(r) => r.await, None => std::future::pending().await } }, if renewal.is_some() => {
                    renewal = None;
                    self.renewed(result);
                }
                () = tokio::time::sleep_until(next), if self.held && renewal.is_none() => {
                    next = tokio::time::Instant::now() + period;
                    renewal = Some(Box::pin(apply(store, self.lease.renew())));
                }
            }
        }
    }

    fn renewed(&mut self, result: Result<Option<Generation>, StoreError>) {
        match result {
            Ok(Some(generation)) => self.lease.advanced(generation),
            Ok(None) => {}
            Err(e) if e.is_precondition_failed() => {
                // Taken over (or lapsed): from here on every write of ours fails its fence.
                self.held = false;
                metrics::counter!("idem_idempotency_leases_lost_total").increment(1);
                warn!(key = self.lease.key().as_str(), "lease lost while the request was running");
            }
            Err(e) => warn!(key = self.lease.key().as_str(), error = %e, "lease renewal failed; will retry"),
        }
    }

    async fn unknown(mut self, config: &Arc<Config>, reason: &str) {
        metrics::counter!("idem_idempotency_unknown_outcomes_total").increment(1);
        match config.unknown_outcome {
            UnknownOutcome::Release => self.release().await,
            UnknownOutcome::Keep => self.finish(config, Outcome::Unknown { reason: reason.to_owned() }).await,
        }
    }

    /// After a fence failure: if the live record is still our own claim (a renewal we stopped waiting for
    /// landed), take its generation and say so; if another holder's or absent, no.
    async fn adopt(&mut self, e: &StoreError) -> bool {
        if !matches!(e.current_generation(), Some(Some(_))) {
            return false;
        }
        let Ok(Some(current)) = self.store.get(self.lease.key().as_str()).await else {
            return false;
        };
        match Record::decode(current.value()) {
            Ok(record) if self.lease.is_mine(&record) => {
                self.lease.advanced(current.generation());
                true
            }
            _ => false,
        }
    }

    async fn release(&mut self) {
        let mut adopted = false;
        loop {
            match apply(&*self.store, self.lease.release()).await {
                Ok(_) => metrics::counter!("idem_idempotency_releases_total").increment(1),
                Err(e) if e.is_precondition_failed() && !adopted && self.adopt(&e).await => {
                    adopted = true;
                    continue;
                }
                Err(e) if e.is_precondition_failed() => {}
                // The lease lapses on its own; until then retries get 409.
                Err(e) => warn!(key = self.lease.key().as_str(), error = %e, "release failed; the lease will lapse"),
            }
            return;
        }
    }

    /// Stores the outcome, fenced. The caller is answered once it is stored, or after [`ANSWER_WAIT`] if the
    /// store is failing: the writes go on in the background (up to [`STORE_RETRY_FOR`]), since a result that
    /// is never recorded frees the key when the lease lapses, and a retry would then execute again.
    async fn finish(self, config: &Arc<Config>, outcome: Outcome) {
        let config_for_task = Arc::clone(config);
        let task = config.tracker.spawn(async move { self.store_outcome(&config_for_task, outcome).await });
        if tokio::time::timeout(ANSWER_WAIT, task).await.is_err() {
            warn!("the outcome is not stored yet; answering now and retrying the write in the background");
        }
    }

    async fn store_outcome(mut self, config: &Config, outcome: Outcome) {
        let key = self.lease.key().as_str().to_owned();
        let now = now_ms();
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(50);
        let mut adopted = false;
        let token = config.replay_cache.as_ref().map(|c| c.token());
        loop {
            let sent = SystemTime::now();
            match apply(&*self.store, self.lease.complete(outcome.clone(), now, config.retention)).await {
                Ok(_) => return self.remember(config, token, outcome, now, sent),
                Err(e) if e.current_generation() == Some(None) => {
                    // Our lease lapsed and nobody claimed the key since: keep the result, unless someone
                    // claims it first (then the create fails and their record stands).
                    let sent = SystemTime::now();
                    match apply(&*self.store, self.lease.complete_lapsed(outcome.clone(), now, config.retention)).await
                    {
                        Ok(_) => {
                            info!(key, "stored the outcome after the lease had lapsed");
                            self.remember(config, token, outcome, now, sent);
                        }
                        Err(e) if e.is_precondition_failed() => self.fenced(&key, &e),
                        Err(e) if started.elapsed() < STORE_RETRY_FOR => {
                            warn!(key, error = %e, "storing the outcome after the lease lapsed failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_millis(500));
                            continue;
                        }
                        Err(e) => error!(key, error = %e, "could not store the outcome; the key is free again"),
                    }
                    return;
                }
                Err(e) if e.is_precondition_failed() && !adopted && self.adopt(&e).await => adopted = true,
                Err(e) if e.is_precondition_failed() => return self.fenced(&key, &e),
                Err(e) if e.is_invalid_input() => {
                    error!(key, error = %e, "the store refuses this outcome; the key frees when its lease lapses");
                    return;
                }
                Err(e) if started.elapsed() < STORE_RETRY_FOR => {
                    warn!(key, error = %e, "storing the outcome failed; retrying");
                    tokio::time::sleep(backoff).await;
                    // Short: once the store is back, every moment before this write lands is a moment in which a
                    // lapsed lease lets a retry execute again.
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    error!(key, error = %e, "could not store the outcome; the key frees when its lease lapses");
                    return;
                }
            }
        }
    }

    /// After the outcome is stored: keep it for replays, expiring no later than the stored copy (the store
    /// starts the retention when the write arrives, after `sent`).
    fn remember(&self, config: &Config, token: Option<u64>, outcome: Outcome, now_ms: u64, sent: SystemTime) {
        if let (Some(cache), Some(token)) = (&config.replay_cache, token) {
            let record = Record::Finished { fingerprint: *self.lease.fingerprint(), outcome, finished_at_ms: now_ms };
            cache.insert(self.lease.key().as_str(), &record, Some(sent + config.retention), token);
        }
    }

    fn fenced(&self, key: &str, e: &StoreError) {
        metrics::counter!("idem_idempotency_takeovers_total").increment(1);
        warn!(key, error = %e, "completion refused by the fence: another holder took the key over");
    }
}

async fn apply<St: Store>(store: &St, write: Write) -> Result<Option<Generation>, StoreError> {
    match write.op {
        WriteOp::Put { value, ttl } => {
            store.put(&write.key, value, write.precondition, ttl).await.map(|w| Some(w.generation()))
        }
        WriteOp::Delete => store.delete(&write.key, write.precondition).await.map(|_| None),
    }
}

enum Prefix<B> {
    Complete(Bytes),
    Over { prefix: Bytes, rest: B },
    Broken(String),
}

/// Reads `body` until its end or until it passes `limit` bytes.
async fn read_prefix<B>(mut body: B, limit: usize) -> Prefix<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            // Exact-sized when the buffer grew well past the body (it doubles): the stored response may stay
            // in the replay cache, which counts the body's length.
            None if buf.capacity() > buf.len() + buf.len() / 4 + 64 => {
                return Prefix::Complete(Bytes::copy_from_slice(&buf));
            }
            None => return Prefix::Complete(buf.freeze()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Prefix::Over { prefix: buf.freeze(), rest: body };
                    }
                }
            }
            Some(Err(e)) => return Prefix::Broken(e.into().to_string()),
        }
    }
}

/// A response body whose first bytes were already read.
struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: B,
}

impl<B> http_body::Body for Prefixed<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}

fn stored_headers(headers: &HeaderMap, allowed: &[HeaderName]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in allowed {
        for value in headers.get_all(name) {
            // Values that are not visible ASCII (rare, obs-text) are not stored rather than stored altered.
            if let Ok(text) = value.to_str() {
                out.push((name.as_str().to_owned(), text.to_owned()));
            }
        }
    }
    out
}

fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            response.headers_mut().append(name, value);
        }
    }
    response.headers_mut().insert(REPLAYED.clone(), HeaderValue::from_static("true"));
    response
}

fn in_flight() -> Response<Body> {
    metrics::counter!("idem_idempotency_conflicts_total").increment(1);
    let mut response = problem(
        StatusCode::CONFLICT,
        ProblemType::RequestInFlight,
        "a request with this key is still being processed; retry after the time Retry-After gives",
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn humantime_secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// The first caller's answer when its own request's outcome became unknown here (timeout).
fn outcome_unknown_now(status: StatusCode, limit: &str) -> Response<Body> {
    problem(
        status,
        ProblemType::OutcomeUnknown,
        &format!(
            "no complete answer within {limit}; the request may or may not have taken effect, and it will not be \
             executed again under this key"
        ),
    )
}

fn outcome_unknown() -> Response<Body> {
    problem(
        StatusCode::BAD_GATEWAY,
        ProblemType::OutcomeUnknown,
        "the request under this key was sent upstream but no complete answer came back, so it may or may not \
         have taken effect; it will not be executed again under this key. Check the effect, then use a new key \
         or ask an operator to delete the record",
    )
}

fn store_unavailable(e: &StoreError) -> Response<Body> {
    warn!(error = %e, "idempotency store unavailable");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        ProblemType::StoreUnavailable,
        "the idempotency store cannot be reached; nothing was executed, retry later",
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}
