//! Per-credential scope: the same key under a second credential executes on its own and never gets the first
//! caller's answer; a replay never carries the first answer's `Set-Cookie`.

use crate::check::http::{Exchange, Seen, refused_first};
use crate::check::report::Verdict;
use crate::check::target::{Caller, Planned, Target};

use super::basic::marked;

/// The first caller twice (the second a replay), then the second caller with the same key when
/// `--second-credential` names one.
pub fn plan(target: &Target) -> Vec<Planned> {
    let mut plan = vec![target.keyed("first caller", "scope"), target.keyed("first caller again: a replay", "scope")];
    if target.second_credential.is_some() {
        plan.push(Planned { caller: Caller::Second, ..target.keyed("second caller, same key and body", "scope") });
    }
    plan
}

/// Scope (the draft's Security Considerations: keys are scoped to the client; a replay must not hand one
/// caller's answer, or its cookies, to another). Without `--second-credential` only the `Set-Cookie` part runs:
/// N/A unless a cookie was replayed.
pub async fn run(ex: &mut Exchange<'_>) -> Result<Verdict, Verdict> {
    let first = ex.send(0).await?;
    if !first.status.is_success() {
        return Err(refused_first(&first));
    }
    let again = ex.send(1).await?;
    let mut failures = Vec::new();
    let cookies = first.set_cookies();
    let cookie_note = if cookies.is_empty() {
        "the answer sets no cookie".to_owned()
    } else if let Some(cookie) = replayed_cookie(&first, &again) {
        failures.push(format!("the replay to the first caller carried the first answer's Set-Cookie {cookie:?}"));
        String::new()
    } else {
        "Set-Cookie not replayed".to_owned()
    };
    let second = if ex.log.len() > 2 {
        let second = ex.send(2).await?;
        if let Some(cookie) = replayed_cookie(&first, &second) {
            failures.push(format!("the second caller got the first answer's Set-Cookie {cookie:?}"));
        }
        Some(second)
    } else {
        None
    };
    let scope_note = match &second {
        None => None,
        Some(second) if second.replayed() => {
            failures.push(format!(
                "the second caller got the first caller's answer: {}{}",
                second.brief(),
                marked(second)
            ));
            None
        }
        Some(second) if second.status.is_success() && second.same_answer(&first) => Some(Err(format!(
            "the second caller got the same answer as the first ({}, no replay marker): shared, or an API whose \
             answers do not differ",
            second.brief()
        ))),
        Some(second) if second.status.is_success() => {
            Some(Ok(format!("the second caller executed on its own: {}", second.brief())))
        }
        Some(second) if matches!(second.status.as_u16(), 401 | 403) => {
            Some(Err(format!("the second credential was refused ({}); give one the API accepts", second.brief())))
        }
        Some(second) => {
            failures.push(format!(
                "the second caller's request was refused under the first caller's key: {}",
                second.brief()
            ));
            None
        }
    };
    if !failures.is_empty() {
        return Ok(Verdict::fail(failures.join("; ")));
    }
    let first_part = format!("first caller {}, its retry {}", first.brief(), replay_word(&again, &first));
    Ok(match scope_note {
        None => {
            Verdict::not_applicable(format!("{first_part}; {cookie_note}; scope not probed (give --second-credential)"))
        }
        Some(Ok(note)) => Verdict::pass(format!("{first_part}; {note}; {cookie_note}")),
        Some(Err(note)) => Verdict::warn(format!("{first_part}; {note}; {cookie_note}")),
    })
}

/// A `Set-Cookie` of `first` that `later` carries again, when `later` is `first` given back.
fn replayed_cookie<'s>(first: &Seen, later: &'s Seen) -> Option<&'s str> {
    if !later.is_answer_of(first) {
        return None;
    }
    let cookies = first.set_cookies();
    later.set_cookies().into_iter().find(|c| cookies.contains(c))
}

/// How the first caller's retry came back.
fn replay_word(again: &Seen, first: &Seen) -> &'static str {
    if again.replayed() {
        "replayed"
    } else if again.same_answer(first) {
        "answered the same"
    } else {
        "answered differently"
    }
}
