//! Malformed keys: an empty one, 256 characters, a control character, two field lines. Each must be refused
//! with 400 and never executed.

use reqwest::header::HeaderValue;

use crate::check::http::Exchange;
use crate::check::report::Verdict;
use crate::check::target::{Planned, Target};

/// What each request of the plan is, in the order sent (also the observation's words).
const CASES: [&str; 4] = ["empty", "256 characters", "a tab", "two field lines"];

/// The four malformed keys. Every one but the empty key starts with the run prefix.
pub fn plan(target: &Target) -> Vec<Planned> {
    let with = |note: &'static str, keys: Vec<HeaderValue>| Planned { keys, ..target.unkeyed(note) };
    let mut long = target.key("malformed-");
    // 256 characters between the quotes: one past Stripe's (and idem's) 255.
    while long.len() < 256 {
        long.push('x');
    }
    // A tab is the one control character a field value may carry (RFC 9110 §5.5), so it reaches the API; an
    // sf-string may not hold it (RFC 9651 §3.3.3).
    let tab = HeaderValue::from_str(&format!("\"{}\tx\"", target.key("malformed-tab")))
        .unwrap_or(HeaderValue::from_static("\"idem-check\tx\""));
    vec![
        with("empty key", vec![HeaderValue::from_static("")]),
        with("256-character key", vec![Target::field(&long)]),
        with("key with a tab (control character)", vec![tab]),
        with(
            "two Idempotency-Key field lines",
            vec![Target::field(&target.key("malformed-a")), Target::field(&target.key("malformed-b"))],
        ),
    ]
}

/// Malformed keys (draft §2.1: the field is an sf-string, one per request; Stripe: at most 255 characters):
/// 400 each. An accepted one (2xx) fails the probe; another refusal is a WARN.
pub async fn run(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let mut seen = Vec::new();
    let (mut executed, mut other) = (0, 0);
    for (i, case) in CASES.iter().enumerate() {
        let answer = ex.send(i).await?;
        let status = answer.status.as_u16();
        if answer.status.is_success() {
            executed += 1;
        } else if status != 400 {
            other += 1;
        }
        seen.push(format!("{case} → {}", answer.status_text()));
    }
    let observed = seen.join("; ");
    Ok(if executed > 0 {
        Verdict::fail(format!("{observed}: {executed} of {} accepted", CASES.len()))
    } else if other > 0 {
        Verdict::warn(format!("{observed}: refused, but not with 400"))
    } else {
        Verdict::pass(observed)
    })
}
