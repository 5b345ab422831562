//! Sequential probes: a missing key, replay fidelity, the same key with another payload, and the same key on
//! another method or URL.

use crate::check::http::{Exchange, Seen, indistinct, refused_first};
use crate::check::report::Verdict;
use crate::check::target::{Planned, Target};

/// The verdict, or the one a probe ends with early (no answer, a refused first request).
type Judged = Result<Verdict, Verdict>;

/// Missing key (draft §2.7: "SHOULD reply with an HTTP 400" where the key is required). Only judged with
/// `--key-required`: an API may make the key optional.
pub async fn missing_key(ex: &mut Exchange<'_>) -> Judged {
    let seen = ex.send(0).await?;
    let what = if seen.status.is_success() {
        format!("{}: passed through, executed without a key", seen.brief())
    } else if seen.status.as_u16() == 400 {
        format!("{}: the API requires a key", seen.brief())
    } else {
        seen.brief()
    };
    Ok(match (ex.target().key_required, seen.status.as_u16()) {
        (false, _) => Verdict::not_applicable(what),
        (true, 400) => Verdict::pass(what),
        (true, _) => Verdict::fail(format!("{what}, not 400")),
    })
}

/// The same key and body twice.
pub fn plan_replay(target: &Target) -> Vec<Planned> {
    vec![target.keyed("first", "replay"), target.keyed("retry: same key and body", "replay"), target.control("replay")]
}

/// Replay fidelity (draft §2.6, "duplicate request": respond with the result of the previously completed
/// operation): the retry gets the same status, body bytes, `Location` and `Content-Type`. A replay marker
/// (`Idempotent-Replayed: true`) is reported, not required; without one, an identical retry passes only when a
/// second execution under another key answers differently (else it may have executed again: WARN).
pub async fn replay(ex: &mut Exchange<'_>) -> Judged {
    let first = ex.send(0).await?;
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    let retry = ex.send(1).await?;
    let differences = differences(&first, &retry);
    let marker = if retry.replayed() { "marked Idempotent-Replayed: true" } else { "no replay marker" };
    Ok(if differences.is_empty() {
        if !retry.replayed() && !ex.executions_differ(ex.last(), &first).await? {
            return Ok(indistinct(&format!(
                "{} twice with identical bodies ({}), no replay marker",
                first.brief(),
                first.size()
            )));
        }
        let location = first.location().map(|l| format!(", Location {l}")).unwrap_or_default();
        Verdict::pass(format!(
            "{} twice; body ({}){location} and Content-Type identical; {marker}",
            first.status_text(),
            first.size()
        ))
    } else {
        Verdict::fail(format!("the retry got another answer: {}; {marker}", differences.join("; ")))
    })
}

/// How `retry` differs from `first` in what a replay must keep.
fn differences(first: &Seen, retry: &Seen) -> Vec<String> {
    let mut differences = Vec::new();
    if first.status != retry.status {
        differences.push(format!("status {} then {}", first.status_text(), retry.status_text()));
    }
    for field in ["location", "content-type"] {
        let (a, b) = (first.field(field), retry.field(field));
        if a != b {
            let name = if field == "location" { "Location" } else { "Content-Type" };
            differences.push(format!("{name} {} then {}", a.unwrap_or("(none)"), b.unwrap_or("(none)")));
        }
    }
    if !first.same_body(retry) {
        let long = first.body_len.max(retry.body_len) > crate::check::http::BODY_KEPT as u64;
        let sizes = if long { format!(" ({} then {})", first.size(), retry.size()) } else { String::new() };
        differences.push(format!("body {} then {}{sizes}", first.excerpt(), retry.excerpt()));
    }
    differences
}

/// The same key, first with the body, then with another.
pub fn plan_mismatch(target: &Target) -> Vec<Planned> {
    let other = Planned { variant: true, ..target.keyed("same key, another body", "mismatch") };
    vec![target.keyed("first", "mismatch"), other, target.control("mismatch")]
}

/// Payload mismatch (draft §2.2: a key is not reused with another payload; §2.7: 422; Stripe answers 400).
pub async fn mismatch(ex: &mut Exchange<'_>) -> Judged {
    let first = ex.send(0).await?;
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    let other = ex.send(1).await?;
    let status = other.status.as_u16();
    if !matches!(status, 400 | 422)
        && !other.replayed()
        && other.same_answer(&first)
        && !ex.executions_differ(ex.last(), &first).await?
    {
        return Ok(indistinct(&format!("the other body got the same answer as the first: {}", other.brief())));
    }
    Ok(match status {
        422 => Verdict::pass(other.brief()),
        400 => Verdict::pass(format!("{} (Stripe's answer)", other.brief())),
        _ if other.is_answer_of(&first) => {
            Verdict::fail(format!("the other body got the first answer back: {}{}", other.brief(), marked(&other)))
        }
        _ if other.status.is_success() => {
            Verdict::fail(format!("the other body executed under the same key: {}", other.brief()))
        }
        _ => Verdict::warn(format!("{}: neither 422 nor 400", other.brief())),
    })
}

/// `, marked Idempotent-Replayed` when it is.
pub fn marked(seen: &Seen) -> &'static str {
    if seen.replayed() { ", marked Idempotent-Replayed: true" } else { "" }
}

/// The same key and body on another method, and on `--other-url` when given.
pub fn plan_other_target(target: &Target) -> Vec<Planned> {
    let mut plan = vec![
        target.keyed("first", "other-target"),
        Planned { method: target.other_method(), ..target.keyed("same key and body, another method", "other-target") },
    ];
    if let Some(url) = &target.other_url {
        plan.push(Planned { url: url.clone(), ..target.keyed("same key and body, --other-url", "other-target") });
    }
    plan.push(target.control("other-target"));
    plan
}

/// The same key on another method or path (draft §2.4: the fingerprint covers the request, so another
/// request under the key is not the one stored): never the first answer.
pub async fn other_target(ex: &mut Exchange<'_>) -> Judged {
    let first = ex.send(0).await?;
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    let mut seen = Vec::new();
    let (mut replayed, mut unmarked) = (Vec::new(), 0);
    for i in 1..ex.last() {
        let answer = ex.send(i).await?;
        let planned = ex.planned(i);
        let what = format!("{} {}: {}", planned.method, planned.url.path(), answer.brief());
        if answer.is_answer_of(&first) {
            replayed.push(format!("{what}{}", marked(&answer)));
            unmarked += usize::from(!answer.replayed());
        }
        seen.push(what);
    }
    // Only unmarked equal answers: they may be executions of their own, if no execution's answer differs.
    if unmarked == replayed.len() && unmarked > 0 && !ex.executions_differ(ex.last(), &first).await? {
        return Ok(indistinct(&format!("the same answer as the first: {}", replayed.join("; "))));
    }
    if !replayed.is_empty() {
        return Ok(Verdict::fail(format!("got the first answer back: {}", replayed.join("; "))));
    }
    let mut observed = seen.join("; ");
    if ex.target().other_url.is_none() {
        observed.push_str("; another path not probed (--other-url)");
    }
    Ok(Verdict::pass(observed))
}
