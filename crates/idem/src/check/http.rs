//! Sending planned requests and reading their answers: [`Sender`] (one reqwest client for the run, the
//! clients' TLS settings), [`Seen`] (an answer and what the probes ask of it) and [`Exchange`] (one probe's
//! requests, each sent at most once, and the log the JSON report shows).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use sha2::{Digest, Sha256};

use super::report::Verdict;
use super::target::{Planned, Target, excerpt, shown};

/// Sends planned requests. Cheap to clone: the client and the target are shared.
#[derive(Clone)]
pub struct Sender {
    http: reqwest::Client,
    target: Arc<Target>,
    sent: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
}

/// How much of a body is kept: answers are compared by length and SHA-256 of the whole body, so a body of any
/// length (or one that never ends, until `--timeout`) costs at most this much memory.
pub const BODY_KEPT: usize = 1 << 20;

/// An answer: the status, header fields, the body's first [`BODY_KEPT`] bytes, its length and digest.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The status.
    pub status: StatusCode,
    /// The header fields.
    pub headers: HeaderMap,
    /// The body's first [`BODY_KEPT`] bytes (all of it when shorter).
    pub body: Bytes,
    /// The whole body's length in bytes.
    pub body_len: u64,
    /// SHA-256 of the whole body: what answers are compared by.
    pub body_digest: [u8; 32],
}

/// What one request came to: an answer, or why none came (one line).
pub type Answer = Result<Seen, String>;

impl Sender {
    /// A sender over `http` (built with the clients' TLS settings) for `target`.
    pub fn new(http: reqwest::Client, target: Arc<Target>) -> Self {
        Self { http, target, sent: Arc::default(), answered: Arc::default() }
    }

    /// The target request and the flags.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Requests sent so far, and how many of them got an answer.
    pub fn counts(&self) -> (usize, usize) {
        (self.sent.load(Ordering::SeqCst), self.answered.load(Ordering::SeqCst))
    }

    /// Sends `planned` once (no retry: a retry is what the probes test) and reads the whole answer.
    pub async fn send(&self, planned: &Planned) -> Answer {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let result = async {
            let mut response = self.target.build(&self.http, planned).send().await?;
            let status = response.status();
            let headers = response.headers().clone();
            let (mut kept, mut body_len, mut digest) = (Vec::new(), 0u64, Sha256::new());
            while let Some(chunk) = response.chunk().await? {
                body_len += chunk.len() as u64;
                digest.update(&chunk);
                let room = BODY_KEPT.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..room.min(chunk.len())]);
            }
            let body_digest = digest.finalize().into();
            Ok::<_, reqwest::Error>(Seen { status, headers, body: Bytes::from(kept), body_len, body_digest })
        }
        .await;
        match result {
            Ok(seen) => {
                self.answered.fetch_add(1, Ordering::SeqCst);
                Ok(seen)
            }
            Err(e) => Err(failure(&e)),
        }
    }
}

/// A transport failure on one line: the TLS refusal in words, else the error and its causes.
fn failure(e: &reqwest::Error) -> String {
    if let Some(tls) = idem_client::tls_failure(e) {
        return tls;
    }
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "failed"
    };
    format!("{kind}: {}", idem_store::error_chain(e))
}

impl Seen {
    /// `201 Created`.
    pub fn status_text(&self) -> String {
        let status = self.status;
        format!("{} {}", status.as_u16(), status.canonical_reason().unwrap_or("(no reason phrase)"))
    }

    /// The first value of a field, as text.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The `Location` field.
    pub fn location(&self) -> Option<&str> {
        self.field("location")
    }

    /// Whether the answer says it is a replay (`Idempotent-Replayed: true`, as Stripe and idem send it).
    pub fn replayed(&self) -> bool {
        self.field("idempotent-replayed").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    /// The `type` of an RFC 9457 problem body.
    pub fn problem_type(&self) -> Option<String> {
        if !self.field("content-type").is_some_and(|t| t.contains("problem+json")) {
            return None;
        }
        let problem: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        problem.get("type")?.as_str().map(str::to_owned)
    }

    /// The `Set-Cookie` field lines.
    pub fn set_cookies(&self) -> Vec<&str> {
        self.headers.get_all("set-cookie").iter().filter_map(|v| v.to_str().ok()).collect()
    }

    /// The status with what tells answers apart: `201 Created, Location /orders/4`, or a problem's type.
    pub fn brief(&self) -> String {
        let mut text = self.status_text();
        if let Some(location) = self.location() {
            text.push_str(&format!(", Location {location}"));
        }
        if let Some(problem) = self.problem_type() {
            text.push_str(&format!(" ({problem})"));
        }
        text
    }

    /// The body as short text for an observation.
    pub fn excerpt(&self) -> String {
        excerpt(&self.body, 48)
    }

    /// Whether `self` is the same answer as `other`: status, `Location` and body bytes.
    pub fn same_answer(&self, other: &Seen) -> bool {
        self.status == other.status && self.location() == other.location() && self.same_body(other)
    }

    /// Whether the bodies are the same bytes: the same length and SHA-256.
    pub fn same_body(&self, other: &Seen) -> bool {
        self.body_len == other.body_len && self.body_digest == other.body_digest
    }

    /// The body's size for an observation, saying when it was longer than what is kept.
    pub fn size(&self) -> String {
        if self.body_len > BODY_KEPT as u64 {
            format!("{} bytes, over the 1 MiB kept: compared by length and SHA-256", self.body_len)
        } else {
            format!("{} bytes", self.body_len)
        }
    }

    /// Whether `self` is `first` given back: marked as a replay, or the same answer.
    pub fn is_answer_of(&self, first: &Seen) -> bool {
        self.replayed() || self.same_answer(first)
    }
}

/// One probe's requests: sends each planned request by its index and logs what came back.
pub struct Exchange<'a> {
    sender: &'a Sender,
    plan: &'a [Planned],
    /// Per planned request, in order: its answer's status (or failure), `None` while unsent.
    pub log: Vec<Option<Result<Logged, String>>>,
}

/// What the report keeps of an answer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Logged {
    /// The status code.
    pub status: u16,
    /// Whether it was marked as a replay.
    pub replayed: bool,
    /// Its `Location`, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
}

impl<'a> Exchange<'a> {
    /// An exchange over `plan` (nothing sent yet).
    pub fn new(sender: &'a Sender, plan: &'a [Planned]) -> Self {
        Self { sender, plan, log: vec![None; plan.len()] }
    }

    /// The target request and the flags.
    pub fn target(&self) -> &Target {
        self.sender.target()
    }

    /// Notes what request `i` came to.
    pub fn record(&mut self, i: usize, answer: &Answer) {
        self.log[i] = Some(match answer {
            Ok(seen) => Ok(Logged {
                status: seen.status.as_u16(),
                replayed: seen.replayed(),
                location: seen.location().map(str::to_owned),
            }),
            Err(e) => Err(e.clone()),
        });
    }

    /// Sends request `i` and waits for its answer; a transport failure becomes the probe's FAIL.
    ///
    /// # Errors
    /// The failing [`Verdict`] naming the request and the failure.
    pub async fn send(&mut self, i: usize) -> Result<Seen, Verdict> {
        let answer = self.sender.send(&self.plan[i]).await;
        self.record(i, &answer);
        answer.map_err(|e| self.unanswered(i, &e))
    }

    /// Starts request `i` on its own task (to send others while it runs); [`Exchange::record`] its answer.
    pub fn spawn(&self, i: usize) -> tokio::task::JoinHandle<Answer> {
        let (sender, planned) = (self.sender.clone(), self.plan[i].clone());
        tokio::spawn(async move { sender.send(&planned).await })
    }

    /// Sends the requests `range` at once (each on its own task, released together) and logs their answers.
    pub async fn send_at_once(&mut self, range: std::ops::Range<usize>) -> Vec<Answer> {
        let barrier = Arc::new(tokio::sync::Barrier::new(range.len()));
        let tasks: Vec<_> = range
            .clone()
            .map(|i| {
                let (sender, planned, barrier) = (self.sender.clone(), self.plan[i].clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    sender.send(&planned).await
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(tasks.len());
        for (i, task) in range.zip(tasks) {
            let answer = task.await.unwrap_or_else(|e| Err(format!("the sending task failed: {e}")));
            self.record(i, &answer);
            answers.push(answer);
        }
        answers
    }

    /// The FAIL for request `i` that got no answer.
    pub fn unanswered(&self, i: usize, failure: &str) -> Verdict {
        let planned = &self.plan[i];
        Verdict::fail(format!("{} {} ({}) got no answer: {failure}", planned.method, shown(&planned.url), planned.note))
    }

    /// Request `i` as planned.
    pub fn planned(&self, i: usize) -> &Planned {
        &self.plan[i]
    }

    /// Whether two executions' answers can be told apart: sends the control request `i` (another key, the same
    /// body: a second execution) and compares its answer with `first`. A probe sends it only when its judgement
    /// rests on an unmarked answer equal to `first`, which an API whose answers never differ gives every time.
    ///
    /// # Errors
    /// The failing [`Verdict`] when the control request got no answer.
    pub async fn executions_differ(&mut self, i: usize, first: &Seen) -> Result<bool, Verdict> {
        let control = self.send(i).await?;
        Ok(!control.same_answer(first))
    }

    /// The last request of the plan: the control request of the probes that have one.
    pub fn last(&self) -> usize {
        self.plan.len() - 1
    }
}

/// The WARN for a probe that cannot judge: `seen`, then why nothing can be concluded from it.
pub fn indistinct(seen: &str) -> Verdict {
    Verdict::warn(format!(
        "{seen}; a second execution under another key got the same: answers of two separate executions are \
         identical: cannot tell a replay from a re-execution; make the API echo something per execution, e.g. an id"
    ))
}

/// The FAIL for a probe whose first request was refused: nothing about keys can be judged from it.
pub fn refused_first(seen: &Seen) -> Verdict {
    Verdict::fail(format!(
        "the first request got {} ({}): the probes need a request the API accepts (check the URL, --method, the \
         body and the credential)",
        seen.brief(),
        seen.excerpt()
    ))
}
