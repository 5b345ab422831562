//! Steps 4 to 6 of the layer ([crate docs](crate#steps)): the inner call under the claimed lease (kept renewed while it runs and
//! the stored part of the response is read), bounded by the execution timeout, and the outcome written,
//! fenced by the lease's generation (or the key released, per the outcome policy).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use crate::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use idem_core::ProblemType;
use idem_core::record::{Held, Outcome, Record, StoredResponse};
use idem_store::{Error as StoreError, Jitter, LeaseKeeper, Lost, Renewable, RetryPolicy, Store};
use tower::{BoxError, Service};
use tracing::{error, info, warn};

use crate::config::{Config, UnknownOutcome};
use crate::decide::now_ms;
use crate::problem::{hint, outcome_unknown_broken, outcome_unknown_now, problem, rehint};
use crate::route::OnFailure;
use idem_store::StoreExt;

/// How long a caller waits for its outcome to be stored before it is answered anyway.
const ANSWER_WAIT: Duration = Duration::from_secs(3);

/// How long a failing outcome write is retried in the background.
const STORE_RETRY_FOR: Duration = Duration::from_secs(600);

/// Bytes kept free in a stored record for its JSON head (status, headers, fingerprint).
const RECORD_HEAD_ROOM: usize = 64 * 1024;

/// Marks a response of the inner service that did not come from a completed execution, so the layer applies
/// its outcome policy ([step 5](crate#steps)). Insert it into the response's extensions (the reverse proxy does).
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

/// Steps 4 to 6: execute once under the lease and record the outcome, fenced by the lease's generation.
pub(crate) async fn execute<S, St, ResBody>(
    mut inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    request: Request<Body>,
    lease: Held,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    let mut keeper = LeaseHolder { store: Arc::clone(&store), lease, set: tokio::time::Instant::now() };
    // Renewals run beside the call; a renewal in flight when it ends is left to land or not (`adopt`).
    let mut renewals = LeaseKeeper::new(&*store, keeper.lease.length(), tokio::time::Instant::now());
    // One deadline for the call and the part of the body that is stored: an upstream that stalls mid-body must
    // not keep the key in flight (and its lease renewed) forever.
    let deadline = tokio::time::Instant::now() + config.execution_timeout;
    // A panic in the inner service (in `call` or in its future) is an outcome like an error: the request may
    // have taken effect, so the record is resolved by the unknown-outcome policy rather than left in flight for a
    // retry to take over and execute again (step 5).
    let call = std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request)));
    let response = match call {
        Ok(call) => {
            let call = AssertUnwindSafe(tokio::time::timeout_at(deadline, call)).catch_unwind();
            keeper.during(&mut renewals, call).await
        }
        Err(panic) => Err(panic),
    };
    // Wherever the lease ends below (released, or its outcome written), a renewal still in flight is dropped
    // first, not awaited: unpolled, it could hold what the store gave it (PostgreSQL's per-key lock) while the
    // final write on the same key waits for it; if it landed, `adopt` recognises our own record.
    let response = match response {
        Err(panic) => {
            drop(renewals);
            let message = panic_message(&*panic);
            return Ok(panicked(keeper, &config, message).await);
        }
        Ok(response) => response,
    };
    let response = match response {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            drop(renewals);
            keeper.unknown(&config, "the inner service failed").await;
            return Err(e);
        }
        Err(_) => {
            drop(renewals);
            let limit = humantime_secs(config.execution_timeout);
            keeper.unknown(&config, &format!("no response within {limit}")).await;
            let released = config.unknown_outcome == UnknownOutcome::Release;
            return Ok(outcome_unknown_now(StatusCode::GATEWAY_TIMEOUT, &limit, released));
        }
    };
    match response.extensions().get::<UpstreamFailure>().cloned() {
        Some(UpstreamFailure::NotSent) => {
            drop(renewals);
            keeper.release().await;
            let mut response = response.map(Body::new);
            hint(&mut response, true);
            return Ok(response);
        }
        Some(UpstreamFailure::OutcomeUnknown { reason }) => {
            drop(renewals);
            keeper.unknown(&config, &reason).await;
            let mut response = response.map(Body::new);
            hint(&mut response, config.unknown_outcome == UnknownOutcome::Release);
            return Ok(response);
        }
        None => {}
    }
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        // The upstream asked to be retried later: it did not do the work (step 5).
        drop(renewals);
        keeper.release().await;
        let mut response = response.map(Body::new);
        hint(&mut response, true);
        return Ok(response);
    }
    if config.on_failure == OnFailure::Release && !status.is_success() {
        // A webhook route: the sender delivers again on any non-2xx, and that delivery must execute, so only a
        // 2xx is ever stored ([`OnFailure::Release`]).
        drop(renewals);
        crate::counters::count(crate::counters::Count::ReleasedFailures);
        if let Some(counters) = &config.route_counters {
            counters.released.increment(1);
        }
        info!(key = keeper.lease.key().as_str(), status = status.as_u16(), "released after a non-2xx answer");
        keeper.release().await;
        let mut response = response.map(Body::new);
        hint(&mut response, true);
        return Ok(response);
    }
    Ok(store_answer(keeper, renewals, &config, &*store, response, deadline).await)
}

/// Step 6 for an answer that is stored: reads its body up to the stored-body limit within `deadline` (the lease
/// kept meanwhile by `renewals`), writes the outcome, and gives the caller the whole answer (a body that broke
/// off: the unknown-outcome answer).
async fn store_answer<St, ResBody>(
    mut keeper: LeaseHolder<St>,
    mut renewals: LeaseKeeper<'_, St>,
    config: &Arc<Config>,
    store: &St,
    response: Response<ResBody>,
    deadline: tokio::time::Instant,
) -> Response<Body>
where
    St: Store,
    ResBody: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
{
    let status = response.status();
    let (parts, body) = response.into_parts();
    // A record must fit the store's value limit, or its completion write would fail and the key would free
    // up when the lease lapses, letting a retry execute again: keep room for the record's head.
    let limit = config.max_stored_body.min(store.limits().max_value_bytes().saturating_sub(RECORD_HEAD_ROOM));
    let read = AssertUnwindSafe(tokio::time::timeout_at(deadline, read_prefix(body, limit))).catch_unwind();
    let read = keeper.during(&mut renewals, read).await;
    drop(renewals);
    let read = match read {
        Ok(read) => read,
        Err(panic) => {
            let message = panic_message(&*panic);
            return panicked(keeper, config, message).await;
        }
    };
    let read = read.unwrap_or_else(|_| {
        Prefix::Broken(format!("the response body did not end within {}", humantime_secs(config.execution_timeout)))
    });
    match read {
        Prefix::Complete(bytes, trailers) => {
            let headers = stored_headers(&parts.headers, &config.replay_headers);
            let stored = StoredResponse { status: status.as_u16(), headers, body: bytes.clone() };
            keeper.finish(config, Outcome::Response(stored)).await;
            // The first caller gets the trailers too (a replay has the stored part only: status, allow-listed
            // headers, body).
            let body = match trailers {
                Some(trailers) => Body::new(WithTrailers { data: Some(bytes), trailers: Some(trailers) }),
                None => Body::from(bytes),
            };
            let mut response = Response::from_parts(parts, body);
            if !status.is_success() {
                // Stored: a retry would only replay it.
                hint(&mut response, false);
            }
            response
        }
        Prefix::Over { prefix, rest } => {
            let outcome = Outcome::TooLarge { status: status.as_u16(), size: prefix.len() as u64, limit: limit as u64 };
            keeper.finish(config, outcome).await;
            let mut response = Response::from_parts(parts, Body::new(Prefixed { prefix: Some(prefix), rest }));
            if !status.is_success() {
                hint(&mut response, false);
            }
            response
        }
        Prefix::Broken(reason) => {
            keeper.unknown(config, &format!("the response body broke off: {reason}")).await;
            outcome_unknown_broken(config.unknown_outcome == UnknownOutcome::Release)
        }
    }
}

/// A panic's message (a `&str` or `String` payload), for the log.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// After the inner service panicked (calling it, awaiting its answer or reading its body): logged and
/// counted (`idem_idempotency_panics_total`), the record resolved as an unknown outcome (stored, or released under
/// [`UnknownOutcome::Release`]), and the caller answered 500 problem+json.
async fn panicked<St: Store>(keeper: LeaseHolder<St>, config: &Arc<Config>, message: String) -> Response<Body> {
    crate::counters::count(crate::counters::Count::Panics);
    error!(key = keeper.lease.key().as_str(), panic = %message, "the inner service panicked");
    keeper.unknown(config, "the inner service panicked").await;
    let released = config.unknown_outcome == UnknownOutcome::Release;
    let answer = problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        ProblemType::Internal,
        &format!(
            "the service failed while handling this request, which may or may not have taken effect; {}",
            if released {
                "the key was released, so a retry under it executes again"
            } else {
                "it will not be executed again under this key"
            }
        ),
    );
    rehint(answer, released)
}

/// The layer's side of a claimed record: the lease (renewed by an [`idem_store::LeaseKeeper`] while the call
/// runs) and the fenced writes that end it.
struct LeaseHolder<St> {
    store: Arc<St>,
    lease: Held,
    /// When the write that last set the lease (the claim or an accepted renewal) was sent.
    set: tokio::time::Instant,
}

impl<St: Store> LeaseHolder<St> {
    /// Runs `work` while the lease is kept. A loss (taken over, or lapsed while the store did not answer) is
    /// logged and counted; the work goes on, and the final write fails its fence unless the record is still
    /// ours.
    async fn during<F: Future>(&mut self, keeper: &mut LeaseKeeper<'_, St>, work: F) -> F::Output {
        let key = self.lease.key().as_str().to_owned();
        let out = keeper
            .during(&mut self.lease, work, |lost| {
                crate::counters::count(crate::counters::Count::LeasesLost);
                let why = match lost {
                    Lost::Refused => "another holder took the key over",
                    Lost::Lapsed => "no renewal was accepted for a whole lease",
                };
                warn!(key, why, "lease lost while the request was running");
            })
            .await;
        self.set = keeper.sent();
        out
    }

    /// While the completion write is being retried: keep showing this holder alive with a renewal whenever a
    /// third of a lease has passed since the lease was last set, so no observer judges it dead and takes the
    /// key over while its outcome is on its way ([`Observations`](idem_core::record::Observations)). A refused renewal is left
    /// to the next completion attempt, whose fence then says what happened.
    async fn keep_alive(&mut self) {
        if self.set.elapsed() < self.lease.length() / 3 {
            return;
        }
        let sent = tokio::time::Instant::now();
        if let Ok(Some(generation)) = self.store.apply(Renewable::renewal(&self.lease)).await {
            self.lease.renewed(generation);
            self.set = sent;
        }
    }

    async fn unknown(mut self, config: &Arc<Config>, reason: &str) {
        crate::counters::count(crate::counters::Count::UnknownOutcomes);
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
        match self.store.get(self.lease.key().as_str()).await {
            Ok(Some(current)) if Renewable::is_mine(&self.lease, &current) => {
                self.lease.renewed(current.generation());
                true
            }
            _ => false,
        }
    }

    async fn release(&mut self) {
        let mut adopted = false;
        loop {
            match self.store.apply(self.lease.release()).await {
                Ok(_) => crate::counters::count(crate::counters::Count::Releases),
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
        // Doubling from 50 ms to 500 ms, the window itself: short, since once the store is back every moment
        // before this write lands is a moment in which a lapsed lease lets a retry take the key over.
        let retries = RetryPolicy::new()
            .with_base_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_millis(500))
            .with_jitter(Jitter::None);
        let mut failures = 0;
        let mut adopted = false;
        let token = config.replay_cache.as_ref().map(|c| c.token());
        loop {
            let sent = SystemTime::now();
            let mut complete = self.lease.complete(outcome.clone(), now, config.retention);
            if idem_core::planted("proxy-completion") {
                // The planted bug "proxy-completion": the completion written without its fence.
                complete.precondition = idem_store::Precondition::Any;
            }
            match self.store.apply(complete).await {
                Ok(_) => return self.remember(config, token, outcome, now, sent),
                Err(e) if e.current_generation() == Some(None) => {
                    // Our lease lapsed and nobody claimed the key since: keep the result, unless someone
                    // claims it first (then the create fails and their record stands).
                    let sent = SystemTime::now();
                    match self.store.apply(self.lease.complete_lapsed(outcome.clone(), now, config.retention)).await {
                        Ok(_) => {
                            info!(key, "stored the outcome after the lease had lapsed");
                            self.remember(config, token, outcome, now, sent);
                        }
                        Err(e) if e.is_precondition_failed() => self.fenced(&key, &e),
                        Err(e) if started.elapsed() < STORE_RETRY_FOR => {
                            warn!(key, error = %e, "storing the outcome after the lease lapsed failed; retrying");
                            failures += 1;
                            tokio::time::sleep(retries.pause_after(failures)).await;
                            continue;
                        }
                        Err(e) => error!(key, error = %e, "could not store the outcome; the key is free again"),
                    }
                    return;
                }
                Err(e) if e.is_precondition_failed() && !adopted && self.adopt(&e).await => adopted = true,
                Err(e) if e.is_precondition_failed() => return self.fenced(&key, &e),
                Err(e) if e.is_invalid_input() => {
                    error!(
                        key,
                        error = %e,
                        "the store refuses this outcome; a retry takes the key over once its lease lapses"
                    );
                    return;
                }
                Err(e) if started.elapsed() < STORE_RETRY_FOR => {
                    warn!(key, error = %e, "storing the outcome failed; retrying");
                    failures += 1;
                    tokio::time::sleep(retries.pause_after(failures)).await;
                    self.keep_alive().await;
                }
                Err(e) => {
                    error!(
                        key,
                        error = %e,
                        "could not store the outcome; a retry takes the key over once its lease lapses"
                    );
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
        crate::counters::count(crate::counters::Count::Takeovers);
        warn!(key, error = %e, "completion refused by the fence: another holder took the key over");
    }
}

enum Prefix<B> {
    /// The whole body, and its trailer fields if it had any.
    Complete(Bytes, Option<HeaderMap>),
    Over {
        prefix: Bytes,
        rest: B,
    },
    Broken(String),
}

/// Reads `body` until its end or until it passes `limit` bytes.
async fn read_prefix<B>(mut body: B, limit: usize) -> Prefix<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut buf = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        match body.frame().await {
            // Exact-sized when the buffer grew well past the body (it doubles): the stored response may stay
            // in the replay cache, which counts the body's length.
            None if buf.capacity() > buf.len() + buf.len() / 4 + 64 => {
                return Prefix::Complete(Bytes::copy_from_slice(&buf), trailers);
            }
            None => return Prefix::Complete(buf.freeze(), trailers),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Prefix::Over { prefix: buf.freeze(), rest: body };
                    }
                }
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                    }
                }
            },
            Some(Err(e)) => return Prefix::Broken(e.into().to_string()),
        }
    }
}

/// A body read whole, given back with its trailer fields. Not `http_body_util::Full::with_trailers`: that
/// reports an exact size, so hyper sends `Content-Length` over HTTP/1.1 and drops the trailers; with no size
/// hint hyper chunks the body and sends them.
struct WithTrailers {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Some(data) = self.data.take().filter(|d| !d.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.trailers.is_none() && self.data.as_ref().is_none_or(Bytes::is_empty)
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

fn humantime_secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}
