use bytes::Bytes;
use idem_store::{CounterOutcome, Generation, Precondition, RetryPolicy, SetChange, SetOutcome};
use reqwest::header::{ETAG, IF_MATCH, IF_NONE_MATCH};
use reqwest::{Method, StatusCode};

use crate::Error;
use crate::send::{detail_of, problem_type_of};

/// A client for the KV API of `idem serve` (`/v1/kv`), at `base` (`http://127.0.0.1:8080`).
#[derive(Clone, Debug)]
pub struct KvClient {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

const KEY_SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

impl KvClient {
    /// A client for the server at `base`. Build `http` from [`client_builder`](crate::client_builder) (or
    /// install a rustls crypto provider first): reqwest is built without one, and panics without it.
    pub fn new(http: reqwest::Client, base: impl Into<String>) -> Self {
        Self { http, base: base.into().trim_end_matches('/').to_owned(), token: None }
    }

    /// Presents `token` as `Authorization: Bearer` (RFC 6750 §2.1).
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    fn request(&self, method: Method, key: &str, suffix: &str) -> reqwest::RequestBuilder {
        // Every byte but unreserved ones escaped, `.` included, so no key becomes a dot-segment.
        let path = percent_encoding::utf8_percent_encode(key, KEY_SET);
        let builder = self.http.request(method, format!("{}/v1/kv/{path}{suffix}", self.base));
        match &self.token {
            Some(t) => builder.bearer_auth(t),
            None => builder,
        }
    }

    /// Reads `key`: its value and generation, `None` when absent.
    ///
    /// # Errors
    /// [`Error::Transport`]; [`Error::Status`] for an answer other than 200 or 404.
    pub async fn get(&self, key: &str) -> Result<Option<(Bytes, Generation)>, Error> {
        let response = self.request(Method::GET, key, "").send().await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let response = ok_or_status(response, key).await?;
        let generation = generation_of(response.headers()).ok_or_else(|| no_etag(key, response.status()))?;
        Ok(Some((response.bytes().await?, generation)))
    }

    /// Writes `value` under `key` if `precondition` holds; returns the new generation.
    ///
    /// # Errors
    /// [`Error::PreconditionFailed`] with the current generation on 412; [`Error::Transport`];
    /// [`Error::Status`] for other refusals (413, 400, …).
    pub async fn put(
        &self,
        key: &str,
        value: impl Into<Bytes>,
        precondition: Precondition,
    ) -> Result<Generation, Error> {
        let builder = with_precondition(self.request(Method::PUT, key, ""), precondition);
        let response = ok_or_status(builder.body(value.into()).send().await?, key).await?;
        generation_of(response.headers()).ok_or_else(|| no_etag(key, response.status()))
    }

    /// Deletes `key` if `precondition` holds.
    ///
    /// # Errors
    /// As [`KvClient::put`].
    pub async fn delete(&self, key: &str, precondition: Precondition) -> Result<(), Error> {
        let builder = with_precondition(self.request(Method::DELETE, key, ""), precondition);
        ok_or_status(builder.send().await?, key).await.map(|_| ())
    }

    /// Read-modify-write: reads `key`, calls `f` with its value (`None` when absent), writes the result
    /// conditional on the generation read (`If-Match`, or `If-None-Match: *` when absent), and on 412 re-reads
    /// and calls `f` again, backing off with full jitter, for at most `policy`'s attempts. `f` returning
    /// `None` leaves the value as it is. Returns the generation written (or read, when `f` changed nothing;
    /// `None` when the key is absent and stays so) and the attempts used.
    ///
    /// # Errors
    /// [`Error::AttemptsExhausted`] naming the attempts when every one lost its race; errors of `f`;
    /// [`Error::Transport`] / [`Error::Status`].
    pub async fn update<F>(&self, key: &str, policy: &RetryPolicy, mut f: F) -> Result<(Option<Generation>, u32), Error>
    where
        F: FnMut(Option<&[u8]>) -> Result<Option<Bytes>, Error>,
    {
        let max = policy.max_attempts().max(1);
        for attempt in 1..=max {
            tokio::time::sleep(policy.backoff(attempt)).await;
            let current = self.get(key).await?;
            let Some(next) = f(current.as_ref().map(|(v, _)| v.as_ref()))? else {
                return Ok((current.map(|(_, g)| g), attempt));
            };
            let precondition = current.map_or(Precondition::Absent, |(_, g)| Precondition::Generation(g));
            match self.put(key, next, precondition).await {
                Ok(generation) => return Ok((Some(generation), attempt)),
                Err(Error::PreconditionFailed { .. }) => {
                    tracing::debug!(key, attempt, "lost a compare-and-swap race; re-reading");
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::AttemptsExhausted { attempts: max, last: format!("412 on {key}: every attempt lost its race") })
    }

    /// Applies `change` (members to add and to remove) to the set under `key` in one atomic step on the server.
    /// With [`SetChange::dedupe_id`], a repeat of the same change under that id changes nothing and returns the
    /// first application's outcome with [`SetOutcome::applied`] false: a client that lost the answer can send it
    /// again.
    ///
    /// # Errors
    /// [`Error::Transport`]; [`Error::DedupeIdReused`] when the dedupe id was used for another change under this
    /// key; [`Error::Status`]: 409 (`wrong-type`) when the value is not a set, 422 (`invalid-argument`) for a
    /// member or id that is empty, over 255 bytes or holds a NUL.
    pub async fn set_change(&self, key: &str, change: &SetChange) -> Result<SetOutcome, Error> {
        let response = ok_or_status(self.request(Method::POST, key, "/set").json(change).send().await?, key).await?;
        Ok(serde_json::from_slice(&response.bytes().await?)?)
    }

    /// Adds `delta` to the counter under `key` in one atomic step; a repeated `dedupe_id` changes nothing and
    /// returns the first application's result (`applied: false`).
    ///
    /// # Errors
    /// [`Error::Transport`]; [`Error::DedupeIdReused`] when `dedupe_id` was used for another change under this
    /// key; [`Error::Status`]: 409 (`wrong-type`) when the value is not a counter, 409 (`counter-overflow`) when
    /// the sum would leave the signed 64-bit range, 422 (`invalid-argument`) for an id that is empty, over 255
    /// bytes or holds a NUL.
    pub async fn counter_add(&self, key: &str, delta: i64, dedupe_id: Option<&str>) -> Result<CounterOutcome, Error> {
        let body = serde_json::json!({ "delta": delta, "dedupe_id": dedupe_id });
        let response = ok_or_status(self.request(Method::POST, key, "/counter").json(&body).send().await?, key).await?;
        Ok(serde_json::from_slice(&response.bytes().await?)?)
    }
}

/// A success without an ETag: whatever answered is not idem's KV API, which names every value's generation.
fn no_etag(key: &str, status: StatusCode) -> Error {
    Error::Status {
        status: status.as_u16(),
        replayed: false,
        detail: format!("the answer for {key} has no ETag (generation): is this idem's KV API?"),
    }
}

fn with_precondition(builder: reqwest::RequestBuilder, precondition: Precondition) -> reqwest::RequestBuilder {
    match precondition {
        Precondition::Any => builder,
        Precondition::Absent => builder.header(IF_NONE_MATCH, "*"),
        Precondition::Present => builder.header(IF_MATCH, "*"),
        Precondition::Generation(g) => builder.header(IF_MATCH, format!("\"{g}\"")),
    }
}

fn generation_of(headers: &reqwest::header::HeaderMap) -> Option<Generation> {
    headers.get(ETAG)?.to_str().ok()?.trim_matches('"').parse().ok().map(Generation::new)
}

async fn ok_or_status(response: reqwest::Response, key: &str) -> Result<reqwest::Response, Error> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    if status == StatusCode::PRECONDITION_FAILED {
        let current = generation_of(response.headers());
        return Err(Error::PreconditionFailed { key: key.to_owned(), current });
    }
    let body = response.bytes().await.unwrap_or_default();
    if status == StatusCode::UNPROCESSABLE_ENTITY
        && problem_type_of(&body).as_deref() == Some(idem_core::ProblemType::DedupeIdReused.uri())
    {
        return Err(Error::DedupeIdReused { key: key.to_owned(), detail: detail_of(&body) });
    }
    Err(Error::Status { status: status.as_u16(), replayed: false, detail: detail_of(&body) })
}
