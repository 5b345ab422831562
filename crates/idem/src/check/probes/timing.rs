//! Probes about timing: concurrent duplicates, and a duplicate sent while the first request is still running.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::check::http::{Answer, Exchange, Seen, indistinct, refused_first};
use crate::check::report::Verdict;
use crate::check::target::{Planned, Target};

/// How long after the first request the in-flight duplicate goes out. The `--slow-url` must take longer
/// (a second or more leaves room on a busy machine).
pub const IN_FLIGHT_DELAY: Duration = Duration::from_millis(250);

/// `--concurrency` identical requests under one key.
pub fn plan_concurrent(target: &Target) -> Vec<Planned> {
    let mut plan: Vec<Planned> =
        (0..target.concurrency).map(|_| target.keyed("one of the requests sent at once", "concurrent")).collect();
    plan.push(target.control("concurrent"));
    plan
}

/// Concurrent duplicates (draft §2.6: one execution; §2.7: 409 for a request that arrives while the first is
/// processed): exactly one outcome among the answers that are not 409, every 409 with `Retry-After`.
pub async fn concurrent(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let answers = ex.send_at_once(0..ex.last()).await;
    let total = answers.len();
    let mut failures = Vec::new();
    // Outcomes told apart by status and Location (the resource), or the body when there is no Location.
    let mut outcomes: BTreeMap<(u16, String), (usize, Seen)> = BTreeMap::new();
    let (mut conflicts, mut without_retry_after, mut replayed) = (0, 0, 0);
    for answer in answers {
        let seen = match answer {
            Ok(seen) => seen,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        if seen.status.as_u16() == 409 {
            conflicts += 1;
            if seen.field("retry-after").is_none() {
                without_retry_after += 1;
            }
            continue;
        }
        replayed += usize::from(seen.replayed());
        let identity =
            seen.location().map_or_else(|| format!("{} {:?}", seen.body_len, seen.body_digest), str::to_owned);
        outcomes.entry((seen.status.as_u16(), identity)).or_insert((0, seen)).0 += 1;
    }
    if !failures.is_empty() {
        return Ok(Verdict::fail(format!("{} of {total} got no answer: {}", failures.len(), failures[0])));
    }

    let outcomes: Vec<(usize, Seen)> = outcomes.into_values().collect();
    match outcomes.as_slice() {
        [] => Ok(Verdict::fail(format!("all {total} answered 409: none executed"))),
        [(count, seen)] => {
            if !seen.status.is_success() {
                return Err(refused_first(seen));
            }
            // More than one unmarked answer: each may be an execution, unless executions answer differently.
            if count.saturating_sub(replayed) > 1 && !ex.executions_differ(ex.last(), seen).await? {
                return Ok(indistinct(&format!(
                    "{total} at once, {count} × {} ({}), {conflicts} × 409",
                    seen.brief(),
                    crate::error::count(replayed, "marked replay", "marked replays")
                )));
            }
            let observed = format!(
                "{total} at once, one outcome: {}; {count} × that answer ({}), {conflicts} × 409",
                seen.brief(),
                crate::error::count(replayed, "marked replay", "marked replays")
            );
            Ok(if without_retry_after > 0 {
                Verdict::warn(format!("{observed}; {without_retry_after} 409 without Retry-After"))
            } else {
                Verdict::pass(observed)
            })
        }
        many => {
            let shown: Vec<String> =
                many.iter().take(3).map(|(count, seen)| format!("{} ({count}×)", seen.brief())).collect();
            let more = if many.len() > 3 { format!(" and {} more", many.len() - 3) } else { String::new() };
            Ok(Verdict::fail(format!(
                "{total} at once, {} distinct outcomes: {}{more}; {conflicts} × 409",
                many.len(),
                shown.join(", ")
            )))
        }
    }
}

/// The slow request, then the same while it runs.
pub fn plan_in_flight(target: &Target) -> Result<Vec<Planned>, String> {
    let Some(url) = &target.slow_url else {
        return Err("not probed: give --slow-url (a URL of the API that answers the request slowly)".into());
    };
    let at = |note| Planned { url: url.clone(), ..target.keyed(note, "in-flight") };
    let control = Planned { url: url.clone(), ..target.control("in-flight") };
    Ok(vec![at("first, to --slow-url"), at("the same while the first runs"), control])
}

/// In flight (draft §2.7: "409 Conflict" for a retry while the original is processed): the duplicate gets 409
/// with `Retry-After`, or waits and gets the first answer. It must not execute.
pub async fn in_flight(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let first_task = ex.spawn(0);
    tokio::time::sleep(IN_FLIGHT_DELAY).await;
    if first_task.is_finished() {
        let first: Answer = first_task.await.unwrap_or_else(|e| Err(e.to_string()));
        ex.record(0, &first);
        let first = first.map_err(|e| ex.unanswered(0, &e))?;
        return Ok(Verdict::warn(format!(
            "the --slow-url answered ({}) within {} ms, before the duplicate went out: give a slower URL",
            first.brief(),
            IN_FLIGHT_DELAY.as_millis()
        )));
    }
    let duplicate = ex.send(1).await;
    let first: Answer = first_task.await.unwrap_or_else(|e| Err(e.to_string()));
    ex.record(0, &first);
    let first = first.map_err(|e| ex.unanswered(0, &e))?;
    let duplicate = duplicate?;
    // On a busy machine the duplicate can reach the API first; then the roles swap, and the "first" request
    // is the one that must get 409 or the stored answer.
    let (first, duplicate) = if first.status.as_u16() == 409 && duplicate.status.is_success() {
        (duplicate, first)
    } else {
        (first, duplicate)
    };
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    if !duplicate.replayed() && duplicate.same_answer(&first) && !ex.executions_differ(ex.last(), &first).await? {
        return Ok(indistinct(&format!("the duplicate got the same answer as the first: {}", duplicate.brief())));
    }
    Ok(match duplicate.status.as_u16() {
        409 => match duplicate.field("retry-after") {
            Some(after) => Verdict::pass(format!(
                "the duplicate got {} with Retry-After: {after}; the first got {}",
                duplicate.brief(),
                first.brief()
            )),
            None => Verdict::warn(format!("the duplicate got {} without Retry-After", duplicate.brief())),
        },
        _ if duplicate.is_answer_of(&first) => {
            Verdict::pass(format!("the duplicate waited and got the first answer: {}", duplicate.brief()))
        }
        _ if duplicate.status.is_success() => Verdict::fail(format!(
            "the duplicate executed too: {} while the first got {}",
            duplicate.brief(),
            first.brief()
        )),
        _ => Verdict::fail(format!("the duplicate got {}, the first {}", duplicate.brief(), first.brief())),
    })
}
