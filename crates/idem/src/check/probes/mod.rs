//! The probes of `idem check`, each naming what it checks, what a conforming API answers, the requests it
//! sends (planned before anything is sent) and how it judges the answers.

mod basic;
mod errors;
mod malformed;
mod scope;
mod timing;

use super::http::Exchange;
use super::report::Verdict;
use super::target::{Planned, Target};

/// One probe; `--only` takes their names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    /// A request without a key: passed through or 400 (judged with --key-required).
    MissingKey,
    /// The same key and body twice: the first answer again.
    Replay,
    /// N identical requests at once: one outcome.
    Concurrent,
    /// The same key with another body: 422.
    Mismatch,
    /// The same key on another method or URL: never the first answer.
    OtherTarget,
    /// Malformed keys: 400.
    Malformed,
    /// Another credential with the same key executes on its own; Set-Cookie never replayed.
    Scope,
    /// A duplicate while the first runs (--slow-url): 409 + Retry-After or the stored answer.
    InFlight,
    /// An error answer (--error-url): a 503 or 429 is not pinned to the key.
    Errors,
    /// After the stated retention (--retention-probe) the key executes again.
    Expiry,
}

/// Every probe, in the order they run.
pub const ALL: [Probe; 10] = [
    Probe::MissingKey,
    Probe::Replay,
    Probe::Concurrent,
    Probe::Mismatch,
    Probe::OtherTarget,
    Probe::Malformed,
    Probe::Scope,
    Probe::InFlight,
    Probe::Errors,
    Probe::Expiry,
];

impl Probe {
    /// The name `--only` takes and the report shows.
    pub fn name(self) -> &'static str {
        match self {
            Probe::MissingKey => "missing-key",
            Probe::Replay => "replay",
            Probe::Concurrent => "concurrent",
            Probe::Mismatch => "mismatch",
            Probe::OtherTarget => "other-target",
            Probe::Malformed => "malformed",
            Probe::Scope => "scope",
            Probe::InFlight => "in-flight",
            Probe::Errors => "errors",
            Probe::Expiry => "expiry",
        }
    }

    /// What it checks, in a few words.
    pub fn title(self) -> &'static str {
        match self {
            Probe::MissingKey => "missing key on a covered method",
            Probe::Replay => "replay fidelity",
            Probe::Concurrent => "concurrent duplicates",
            Probe::Mismatch => "the same key with another payload",
            Probe::OtherTarget => "the same key on another method or path",
            Probe::Malformed => "malformed keys",
            Probe::Scope => "per-credential scope and Set-Cookie",
            Probe::InFlight => "a duplicate while the first is running",
            Probe::Errors => "error answers pinned to the key",
            Probe::Expiry => "expiry after the stated retention",
        }
    }

    /// The section of draft-ietf-httpapi-idempotency-key-header (or Stripe's documented behaviour, or the RFC)
    /// the probe checks.
    pub fn spec(self) -> &'static str {
        match self {
            Probe::MissingKey => "draft §2.7",
            Probe::Replay => "draft §2.6",
            Probe::Concurrent => "draft §2.6, §2.7",
            Probe::Mismatch => "draft §2.2, §2.7; Stripe",
            Probe::OtherTarget => "draft §2.4",
            Probe::Malformed => "draft §2.1; Stripe",
            Probe::Scope => "draft Security Considerations",
            Probe::InFlight => "draft §2.7",
            Probe::Errors => "draft §2.6; RFC 9110 §15.6.4; RFC 6585 §4",
            Probe::Expiry => "draft §2.3",
        }
    }

    /// What a conforming API answers.
    pub fn expected(self, target: &Target) -> String {
        match self {
            Probe::MissingKey if target.key_required => "400 Bad Request".into(),
            Probe::MissingKey => "reported only (400 with --key-required)".into(),
            Probe::Replay => "the first answer again: status, body bytes, Location, Content-Type".into(),
            Probe::Concurrent => {
                format!("{} at once: one outcome, the rest 409 + Retry-After or that answer", target.concurrency)
            }
            Probe::Mismatch => "422 (or Stripe's 400), never the first answer".into(),
            Probe::OtherTarget => "never the first answer (422, or executed on its own)".into(),
            Probe::Malformed => {
                "400 for each: empty, 256 characters (Stripe allows 255), a control character, two field lines".into()
            }
            Probe::Scope => "the second credential executes on its own; Set-Cookie never replayed".into(),
            Probe::InFlight => "409 + Retry-After, or a wait that ends in the first answer".into(),
            Probe::Errors => "a 503 or 429 not pinned to the key (other errors reported)".into(),
            Probe::Expiry => "the key executes again after the stated retention".into(),
        }
    }

    /// The requests the probe sends, in order; `Err` says why it sends none (a flag it needs is absent), and
    /// the probe is N/A.
    pub fn plan(self, target: &Target) -> Result<Vec<Planned>, String> {
        match self {
            Probe::MissingKey => Ok(vec![target.unkeyed("without a key")]),
            Probe::Replay => Ok(basic::plan_replay(target)),
            Probe::Concurrent => Ok(timing::plan_concurrent(target)),
            Probe::Mismatch => Ok(basic::plan_mismatch(target)),
            Probe::OtherTarget => Ok(basic::plan_other_target(target)),
            Probe::Malformed => Ok(malformed::plan(target)),
            Probe::Scope => Ok(scope::plan(target)),
            Probe::InFlight => timing::plan_in_flight(target),
            Probe::Errors => errors::plan_errors(target),
            Probe::Expiry => errors::plan_expiry(target),
        }
    }

    /// Sends the planned requests through `ex` and judges the answers.
    pub async fn run(self, ex: &mut Exchange<'_>) -> Verdict {
        let judged = match self {
            Probe::MissingKey => basic::missing_key(ex).await,
            Probe::Replay => basic::replay(ex).await,
            Probe::Concurrent => timing::concurrent(ex).await,
            Probe::Mismatch => basic::mismatch(ex).await,
            Probe::OtherTarget => basic::other_target(ex).await,
            Probe::Malformed => malformed::run(ex).await,
            Probe::Scope => scope::run(ex).await,
            Probe::InFlight => timing::in_flight(ex).await,
            Probe::Errors => errors::errors(ex).await,
            Probe::Expiry => errors::expiry(ex).await,
        };
        // A request without an answer, or a first request refused, ends a probe early with its verdict.
        judged.unwrap_or_else(|early| early)
    }
}
