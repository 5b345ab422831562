//! [`Idempotency`], the service the layer makes: a covered request goes through the [steps](crate#steps)
//! in order, each in its own module: [`prepare`](crate::prepare) (key, scope, body, fingerprint, no store),
//! [`decide`](crate::decide) (read, judge, claim) and [`execute`](crate::execute) (the call under a kept
//! lease, the fenced final write); the refusals they answer with are in [`problem`](crate::problem).

use std::sync::Arc;
use std::task::{Context, Poll};

use crate::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use idem_core::ProblemType;
use idem_store::Store;
use tower::{BoxError, Service};

use crate::config::Config;
use crate::counters::{Count, count};
use crate::decide::{cached_answer, decide};
use crate::execute::execute;
use crate::future::ResponseFuture;
use crate::prepare::{BufferedBody, Keyed, Prepared, prepare};
use crate::problem::problem;
use crate::route::{RoutePolicy, normalise_path};

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) produces around `S`.
pub struct Idempotency<S, St> {
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    /// Each route's policy and configuration, the longest path first.
    routes: Arc<[(Arc<RoutePolicy>, Arc<Config>)]>,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(
        inner: S,
        store: Arc<St>,
        config: Arc<Config>,
        routes: Arc<[(Arc<RoutePolicy>, Arc<Config>)]>,
    ) -> Self {
        crate::counters::register();
        Self { inner, store, config, routes }
    }

    /// The configuration for a request's path: its route's, else the layer's own.
    fn config_for(&self, path: &str) -> &Arc<Config> {
        if self.routes.is_empty() {
            return &self.config;
        }
        let normal = normalise_path(path);
        self.routes.iter().find(|(policy, _)| policy.covers(&normal)).map_or(&self.config, |(_, config)| config)
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            routes: Arc::clone(&self.routes),
        }
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
        let config = Arc::clone(self.config_for(request.uri().path()));
        // A signed route checks every method: its upstream handler may answer any (a Django view, Express's
        // `app.all`), and an unsigned PUT must not reach it (review finding). Only deliveries are keyed.
        let signed = config.route.as_ref().is_some_and(|r| r.verifier.is_some());
        if !signed && !covers_method(&config.methods, request.method()) {
            let call = inner.call(request.map(Body::new));
            return ResponseFuture::new(async move { call.await.map(|r| r.map(Body::new)) });
        }
        let store = Arc::clone(&self.store);
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
            // without its execution and completion (step 4).
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
    count(Count::Claims);
    if let Some(counters) = &config.route_counters {
        counters.executions.increment(1);
    }
    let request = Request::from_parts(parts, Body::from(body));
    execute(inner, store, config, request, lease).await
}

/// Whether `method` is one of `methods`, ignoring ASCII case. Method names are case-sensitive (RFC 9110 §9.1),
/// but common upstream frameworks (Werkzeug, some routers) upper-case them: a `post` passed through uncovered
/// would reach a POST handler with no key, no signature check and no record (break-it review).
pub(crate) fn covers_method(methods: &[http::Method], method: &http::Method) -> bool {
    methods.contains(method) || methods.iter().any(|m| m.as_str().eq_ignore_ascii_case(method.as_str()))
}
