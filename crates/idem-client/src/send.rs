use std::time::Duration;

use bytes::Bytes;
use idem_core::IdempotencyKey;
use idem_store::RetryPolicy;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde::Serialize;

use crate::Error;

/// One logical write: method, URL, key and the body bytes, fixed once so every attempt sends the same bytes.
#[derive(Clone, Debug)]
pub struct WriteRequest {
    method: Method,
    url: reqwest::Url,
    key: IdempotencyKey,
    /// `None` for a write without a body: neither `Content-Type` nor a body is sent.
    content_type: Option<HeaderValue>,
    body: Bytes,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl WriteRequest {
    /// A write of `payload` serialised as JSON (once, here).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a URL that does not parse; [`Error::Json`] when `payload` does not serialise.
    pub fn json<T: Serialize + ?Sized>(
        method: Method,
        url: &str,
        key: IdempotencyKey,
        payload: &T,
    ) -> Result<Self, Error> {
        let body = serde_json::to_vec(payload)?;
        Self::bytes(method, url, key, HeaderValue::from_static("application/json"), body)
    }

    /// A write of `body` with the given content type.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a URL that does not parse.
    pub fn bytes(
        method: Method,
        url: &str,
        key: IdempotencyKey,
        content_type: HeaderValue,
        body: impl Into<Bytes>,
    ) -> Result<Self, Error> {
        let url =
            reqwest::Url::parse(url).map_err(|e| Error::InvalidRequest { reason: format!("URL {url:?}: {e}") })?;
        Ok(Self { method, url, key, content_type: Some(content_type), body: body.into(), headers: Vec::new() })
    }

    /// A write without a body (a `DELETE`, a `POST` whose URL says it all): no `Content-Type` is sent.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a URL that does not parse.
    pub fn empty(method: Method, url: &str, key: IdempotencyKey) -> Result<Self, Error> {
        let url =
            reqwest::Url::parse(url).map_err(|e| Error::InvalidRequest { reason: format!("URL {url:?}: {e}") })?;
        Ok(Self { method, url, key, content_type: None, body: Bytes::new(), headers: Vec::new() })
    }

    /// Adds a header sent on every attempt (e.g. `Authorization`).
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// The key every attempt carries.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

/// The final successful answer to a write.
#[derive(Clone, Debug)]
pub struct Response {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    replayed: bool,
    attempts: u32,
}

impl Response {
    /// The HTTP status (2xx; others are [`Error`]s).
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The response body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Whether the server replayed a stored answer (`Idempotent-Replayed: true`): the write had already
    /// executed on an earlier attempt (or by an earlier process) whose answer was lost.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// How many attempts it took (1 = the first one succeeded).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

/// Sends [`WriteRequest`]s, retrying what is safe to retry. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    policy: RetryPolicy,
    max_wait: Duration,
    read_back: bool,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

/// What one attempt came to.
enum Attempt {
    Done(Response),
    Retry { reason: String, wait: Option<Duration> },
    Stop(Error),
}

impl Client {
    /// A client with a 30 s per-attempt timeout and 8 attempts, backing off from 100 ms up to 10 s with full
    /// jitter.
    pub fn new() -> Self {
        Self::with_timeout(Duration::from_secs(30))
    }

    /// As [`Client::new`] with another per-attempt timeout. Redirects are followed only when they keep the
    /// method and body (307, 308; at most 5): a 301/302/303 would turn the write into a GET of something else.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self::with_tls(timeout, &crate::TlsConfig::new()).unwrap_or_else(|_| Self::with_http(reqwest::Client::new()))
    }

    /// As [`Client::with_timeout`], trusting and presenting what `tls` says.
    ///
    /// # Errors
    /// [`Error::TlsFiles`] when the HTTP client cannot be built with `tls` (a key that does not fit rustls).
    pub fn with_tls(timeout: Duration, tls: &crate::TlsConfig) -> Result<Self, Error> {
        let redirects = reqwest::redirect::Policy::custom(|attempt| {
            let keeps_body = matches!(attempt.status().as_u16(), 307 | 308);
            if keeps_body && attempt.previous().len() < 5 { attempt.follow() } else { attempt.stop() }
        });
        let http = tls.apply(crate::client_builder()).timeout(timeout).redirect(redirects).build().map_err(|e| {
            Error::TlsFiles { reason: format!("cannot build the HTTP client: {}", idem_store::error_chain(&e)) }
        })?;
        Ok(Self::with_http(http))
    }

    /// A client over a configured `reqwest::Client` (timeouts, TLS, proxies, redirects are its business; prefer
    /// following only 307/308, as [`Client::with_timeout`] does).
    pub fn with_http(http: reqwest::Client) -> Self {
        let policy = RetryPolicy::new()
            .with_max_attempts(8)
            .with_base_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(10));
        Self { http, policy, max_wait: Duration::from_secs(10), read_back: false }
    }

    /// How many attempts and how long to back off between them.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The longest a server's `Retry-After` is waited (default 10 s); longer requests are cut to this.
    pub fn max_retry_after(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// After a replayed `201` with `Location`, GET that location and fail with [`Error::ReadBackGone`] when it
    /// answers 404 or 410 (a key can outlive the object it created).
    pub fn read_back(mut self, enabled: bool) -> Self {
        self.read_back = enabled;
        self
    }

    /// Sends `request` until a final answer, resending the same bytes under the same key.
    ///
    /// # Errors
    /// [`Error::KeyReused`] (422), [`Error::Conflict`] (409 not in flight), [`Error::OutcomeUnknown`],
    /// [`Error::Status`] (other 4xx, stored 5xx) at once; [`Error::AttemptsExhausted`] naming the attempt
    /// count when every attempt was retryable; [`Error::ReadBackGone`] with [`Client::read_back`].
    pub async fn send(&self, request: &WriteRequest) -> Result<Response, Error> {
        let mut last = String::new();
        let max = self.policy.max_attempts().max(1);
        let mut wait = None;
        for attempt in 1..=max {
            let backoff = self.policy.backoff(attempt);
            // A server's Retry-After is honoured up to the policy's longest delay: an answer of "a day" must
            // not park a job for a day (the attempt bound then decides).
            let pause: Duration = wait.map_or(backoff, |w: Duration| w.min(self.max_wait).max(backoff));
            tokio::time::sleep(pause).await;
            match self.attempt(request, attempt).await {
                Attempt::Done(response) => return self.check_read_back(request, response).await,
                Attempt::Stop(e) => return Err(e),
                Attempt::Retry { reason, wait: w } => {
                    tracing::debug!(key = request.key.as_str(), attempt, %reason, "retrying");
                    last = reason;
                    wait = w;
                }
            }
        }
        Err(Error::AttemptsExhausted { attempts: max, last })
    }

    async fn attempt(&self, request: &WriteRequest, attempt: u32) -> Attempt {
        let mut builder = self
            .http
            .request(request.method.clone(), request.url.clone())
            .header("idempotency-key", request.key.to_field_value());
        if let Some(content_type) = &request.content_type {
            builder = builder.header(CONTENT_TYPE, content_type.clone()).body(request.body.clone());
        }
        for (name, value) in &request.headers {
            builder = builder.header(name, value);
        }
        let response = match builder.send().await {
            Ok(r) => r,
            // A request that cannot be built, or a redirect loop, will not get better by resending it.
            Err(e) if e.is_builder() || e.is_redirect() => {
                return Attempt::Stop(Error::InvalidRequest { reason: idem_store::error_chain(&e) });
            }
            Err(e) => {
                // A refused certificate (or no TLS at the other end) fails the same way every time, and the
                // request was never sent: stop, naming the cause.
                if let Some(reason) = crate::tls_failure(&e) {
                    return Attempt::Stop(Error::Tls { reason });
                }
                // Connection refused, reset, timed out: the outcome may be unknown, and the key makes the
                // resend safe.
                return Attempt::Retry { reason: idem_store::error_chain(&e), wait: None };
            }
        };
        let status = response.status();
        let headers = response.headers().clone();
        let replayed = headers.get("idempotent-replayed").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let retry_after_given = headers.contains_key(RETRY_AFTER);
        let retry_after = headers.get(RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(parse_retry_after);
        let body = match response.bytes().await {
            Ok(b) => b,
            Err(e) => {
                return Attempt::Retry {
                    reason: format!("reading the answer: {}", idem_store::error_chain(&e)),
                    wait: None,
                };
            }
        };
        let detail = detail_of(&body);
        let problem_type = problem_type_of(&body);
        if status.is_success() {
            return Attempt::Done(Response { status, headers, body, replayed, attempts: attempt });
        }
        match status.as_u16() {
            422 => Attempt::Stop(Error::KeyReused { detail }),
            409 if retry_after_given
                && problem_type.as_deref() != Some(idem_core::ProblemType::ResponseNotStored.uri()) =>
            {
                Attempt::Retry { reason: format!("409 in flight: {detail}"), wait: retry_after }
            }
            409 => Attempt::Stop(Error::Conflict { detail }),
            429 => Attempt::Retry { reason: format!("429: {detail}"), wait: retry_after },
            s @ (502 | 504) if problem_type.as_deref() == Some(idem_core::ProblemType::OutcomeUnknown.uri()) => {
                Attempt::Stop(Error::OutcomeUnknown { status: s, detail })
            }
            s if s >= 500 && !replayed => {
                Attempt::Retry { reason: format!("{s} (not stored): {detail}"), wait: retry_after }
            }
            s => Attempt::Stop(Error::Status { status: s, replayed, detail }),
        }
    }

    async fn check_read_back(&self, request: &WriteRequest, response: Response) -> Result<Response, Error> {
        if !(self.read_back && response.replayed && response.status == StatusCode::CREATED) {
            return Ok(response);
        }
        let Some(location) = response.headers.get(LOCATION).and_then(|v| v.to_str().ok()) else {
            return Ok(response);
        };
        let target = request
            .url
            .join(location)
            .map_err(|e| Error::InvalidRequest { reason: format!("Location {location:?}: {e}") })?;
        let mut builder = self.http.get(target.clone());
        // Credentials go to the write's own origin only.
        if target.origin() == request.url.origin() {
            for (name, value) in &request.headers {
                builder = builder.header(name, value);
            }
        }
        let status = match builder.send().await {
            Ok(answer) => answer.status(),
            Err(e) => {
                // The write itself succeeded; not being able to look is not evidence the object is gone.
                tracing::warn!(location = %target, error = %idem_store::error_chain(&e), "read-back failed; not checked");
                return Ok(response);
            }
        };
        if status == StatusCode::NOT_FOUND || status == StatusCode::GONE {
            return Err(Error::ReadBackGone { location: target.to_string(), status: status.as_u16() });
        }
        Ok(response)
    }
}

/// `Retry-After` (RFC 9110 §10.2.3): delay-seconds, or an HTTP-date; fractional seconds are accepted too.
fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(86_400.0)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// The `detail` of a problem+json body, else the body's first 200 characters.
pub(crate) fn detail_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect::<String>().trim().to_owned())
}

pub(crate) fn problem_type_of(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body).ok()?.get("type")?.as_str().map(str::to_owned)
}
