//! Steps 4 to 6 of docs/DESIGN.md: the inner call under the claimed lease (kept renewed while it runs and
//! the stored part of the response is read), bounded by the execution timeout, and the outcome written,
//! fenced by the lease's generation (or the key released, per the outcome policy).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use crate::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use idem_core::{Lease, Outcome, Record, StoredResponse};
use idem_store::{Error as StoreError, LeaseKeeper, Lost, Renewable, Store};
use tower::{BoxError, Service};
use tracing::{error, info, warn};

use crate::config::{Config, UnknownOutcome};
use crate::decide::now_ms;
use crate::problem::{outcome_unknown_broken, outcome_unknown_now};
use idem_store::StoreExt;

/// How long a caller waits for its outcome to be stored before it is answered anyway.
const ANSWER_WAIT: Duration = Duration::from_secs(3);

/// How long a failing outcome write is retried in the background.
const STORE_RETRY_FOR: Duration = Duration::from_secs(600);

/// Bytes kept free in a stored record for its JSON head (status, headers, fingerprint).
const RECORD_HEAD_ROOM: usize = 64 * 1024;

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

/// Steps 4 to 6: execute once under the lease and record the outcome, fenced by the lease's generation.
pub(crate) async fn execute<S, St, ResBody>(
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
    let mut keeper = LeaseHolder { store: Arc::clone(&store), lease };
    // Renewals run beside the call; a renewal in flight when it ends is left to land or not (`adopt`).
    let mut renewals = LeaseKeeper::new(&*store, keeper.lease.length(), tokio::time::Instant::now());
    // One deadline for the call and the part of the body that is stored: an upstream that stalls mid-body must
    // not keep the key in flight (and its lease renewed) forever.
    let deadline = tokio::time::Instant::now() + config.execution_timeout;
    let response = keeper.during(&mut renewals, tokio::time::timeout_at(deadline, inner.call(request))).await;
    // Wherever the lease ends below (released, or its outcome written), a renewal still in flight is dropped
    // first, not awaited: unpolled, it could hold what the store gave it (PostgreSQL's per-key lock) while the
    // final write on the same key waits for it; if it landed, `adopt` recognises our own record.
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
            return Ok(response.map(Body::new));
        }
        Some(UpstreamFailure::OutcomeUnknown { reason }) => {
            drop(renewals);
            keeper.unknown(&config, &reason).await;
            return Ok(response.map(Body::new));
        }
        None => {}
    }
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        // The upstream asked to be retried later: it did not do the work (docs/DESIGN.md step 5).
        drop(renewals);
        keeper.release().await;
        return Ok(response.map(Body::new));
    }
    let (parts, body) = response.into_parts();
    // A record must fit the store's value limit, or its completion write would fail and the key would free
    // up when the lease lapses, letting a retry execute again: keep room for the record's head.
    let limit = config.max_stored_body.min(store.limits().max_value_bytes().saturating_sub(RECORD_HEAD_ROOM));
    let read = keeper.during(&mut renewals, tokio::time::timeout_at(deadline, read_prefix(body, limit))).await;
    drop(renewals);
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
            Ok(outcome_unknown_broken(config.unknown_outcome == UnknownOutcome::Release))
        }
    }
}

/// The layer's side of a claimed record: the lease (renewed by an [`idem_store::LeaseKeeper`] while the call
/// runs) and the fenced writes that end it.
struct LeaseHolder<St> {
    store: Arc<St>,
    lease: Lease,
}

impl<St: Store> LeaseHolder<St> {
    /// Runs `work` while the lease is kept. A loss (taken over, or lapsed while the store did not answer) is
    /// logged and counted; the work goes on, and the final write fails its fence unless the record is still
    /// ours.
    async fn during<F: Future>(&mut self, keeper: &mut LeaseKeeper<'_, St>, work: F) -> F::Output {
        let key = self.lease.key().as_str().to_owned();
        keeper
            .during(&mut self.lease, work, |lost| {
                crate::counters::count(crate::counters::Count::LeasesLost);
                let why = match lost {
                    Lost::Refused => "another holder took the key over",
                    Lost::Lapsed => "no renewal was accepted for a whole lease",
                };
                warn!(key, why, "lease lost while the request was running");
            })
            .await
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
                self.lease.advanced(current.generation());
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
        let mut backoff = Duration::from_millis(50);
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
        crate::counters::count(crate::counters::Count::Takeovers);
        warn!(key, error = %e, "completion refused by the fence: another holder took the key over");
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

fn humantime_secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}
