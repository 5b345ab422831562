//! What a key keeps: whether an error answer is pinned to it, and whether it is released after the stated
//! retention.

use crate::check::http::{Exchange, Seen, indistinct, refused_first};
use crate::check::report::Verdict;
use crate::check::target::{Planned, Target};

use super::basic::marked;

/// The request to `--error-url` twice under one key.
pub fn plan_errors(target: &Target) -> Result<Vec<Planned>, String> {
    let Some(url) = &target.error_url else {
        return Err("not probed: give --error-url (a URL of the API that answers the request with a 5xx or 429)".into());
    };
    let at = |note| Planned { url: url.clone(), ..target.keyed(note, "errors") };
    let control = Planned { url: url.clone(), ..target.control("errors") };
    Ok(vec![at("first, to --error-url"), at("retry: same key and body"), control])
}

/// Whether the retry got the first answer back: marked as a replay, or the same status and body bytes.
fn pinned(first: &Seen, retry: &Seen) -> bool {
    retry.replayed() || (retry.status == first.status && retry.same_body(first))
}

/// Error answers. The draft (§2.6) has a duplicate answered with the earlier result, "success or an error", so
/// a stored 500 is reported, not judged. A 503 (RFC 9110 §15.6.4: the server is unable to handle the request
/// now) or a 429 (RFC 6585 §4) says the work was not done: pinned to the key, every retry gets it until the
/// key expires, so that is a WARN.
pub async fn errors(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let first = ex.send(0).await?;
    let status = first.status.as_u16();
    if !(first.status.is_server_error() || status == 429) {
        return Ok(Verdict::not_applicable(format!(
            "the --error-url answered {}, not a 5xx or 429: nothing to judge",
            first.brief()
        )));
    }
    let retry = ex.send(1).await?;
    // An unmarked identical error may be a second execution failing the same way: pinned only if another
    // execution's answer differs.
    if !retry.replayed() && pinned(&first, &retry) && !ex.executions_differ(ex.last(), &first).await? {
        return Ok(indistinct(&format!("{} twice with identical bodies, no replay marker", first.brief())));
    }
    let how = if retry.replayed() {
        "the retry got it replayed (Idempotent-Replayed: true)".to_owned()
    } else {
        format!("the retry got {} with the same body, no replay marker", retry.status_text())
    };
    Ok(match (pinned(&first, &retry), status) {
        (true, 503 | 429) => Verdict::warn(format!(
            "{} pinned to the key: {how}; it says the work was not done, so every retry until expiry gets it",
            first.status_text()
        )),
        (true, _) => Verdict::pass(format!("{} stored and {how}", first.status_text())),
        (false, _) => Verdict::pass(format!(
            "{} not pinned: the retry executed again ({}, body {})",
            first.status_text(),
            retry.status_text(),
            retry.excerpt()
        )),
    })
}

/// The request, then the same after the stated retention.
pub fn plan_expiry(target: &Target) -> Result<Vec<Planned>, String> {
    if target.retention.is_none() {
        return Err("not probed: give --retention-probe DURATION (the retention the API states)".into());
    }
    Ok(vec![
        target.keyed("first", "expiry"),
        target.keyed("the same after --retention-probe", "expiry"),
        target.control("expiry"),
    ])
}

/// Expiry (draft §2.3: a key is kept for a stated time, then may be used again): after `--retention-probe`
/// the request executes again instead of being replayed.
pub async fn expiry(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let wait = ex.target().retention.unwrap_or_default();
    let first = ex.send(0).await?;
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    tokio::time::sleep(wait).await;
    let later = ex.send(1).await?;
    let after = humantime::format_duration(wait);
    if !later.replayed() && later.same_answer(&first) && !ex.executions_differ(ex.last(), &first).await? {
        return Ok(indistinct(&format!("after {after} the same answer as the first: {}", later.brief())));
    }
    Ok(if later.is_answer_of(&first) {
        Verdict::fail(format!("still the first answer after {after}: {}{}", later.brief(), marked(&later)))
    } else if later.status.is_success() {
        Verdict::pass(format!("executed again after {after}: {} (first: {})", later.brief(), first.brief()))
    } else {
        Verdict::fail(format!("after {after}: {}, neither executed nor the first answer", later.brief()))
    })
}
