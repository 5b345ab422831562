//! `idem once`'s jobs as the operator sees them: every job with its schedule, last and next slot, and the
//! history of its recent slots, drawn as an SVG timeline; and the operator's actions on a job, [`pause`],
//! [`resume`] and [`trigger`] (`idem once pause|resume|trigger` do the same), each logged with who did it.

use idem_runner::once::{History, SlotView};
use idem_store::Store;
use serde::Serialize;

use crate::Error;

/// Most slots a job's page shows (the newest).
pub const SLOTS_SHOWN: usize = 60;

/// One cron job with its history.
#[derive(Clone, Debug, Serialize)]
pub struct CronJob {
    /// The job's history as `idem once status` shows it.
    pub history: History,
    /// The next slot after now (RFC 3339, in the schedule's zone), when the schedule can say.
    pub next_slot: Option<String>,
}

/// The names of the cron jobs in the store, in name order.
///
/// # Errors
/// [`Error::Store`].
pub async fn names<S: Store>(store: &S) -> Result<Vec<String>, Error> {
    crate::runs::job_names(store, "once/", crate::runs::JOBS_SHOWN).await
}

/// Job `name` and its newest [`SLOTS_SHOWN`] slots; `now_ms` (the store's clock) places the next slot.
///
/// # Errors
/// [`Error::NotFound`]; [`Error::Runner`].
pub async fn history<S: Store>(store: &S, name: &str, now_ms: u64) -> Result<CronJob, Error> {
    let history = idem_runner::once::history(store, name, SLOTS_SHOWN)
        .await?
        .ok_or_else(|| Error::NotFound(format!("no cron job {name}")))?;
    let next_slot = idem_runner::once::parse_canonical(&history.schedule)
        .ok()
        .and_then(|s| s.next_after(now_ms).ok().map(|ms| s.format(ms)));
    Ok(CronJob { history, next_slot })
}

/// One slot of job `name`, by its time as shown (`slot` of [`SlotView`]).
///
/// # Errors
/// [`Error::NotFound`] when the job or the slot is not in the kept history.
pub async fn slot<S: Store>(store: &S, name: &str, slot: &str) -> Result<SlotView, Error> {
    let job = history(store, name, 0).await?;
    job.history
        .slots
        .into_iter()
        .find(|s| s.slot == slot)
        .ok_or_else(|| Error::NotFound(format!("job {name} has no slot {slot} in its kept history")))
}

/// Pauses job `name` for `actor`: every invocation from now on records its slot paused and runs nothing.
/// `until`: when it ends by itself, RFC 3339 or a duration from now (`2h`); empty or `None`: until resumed.
///
/// # Errors
/// [`Error::NotFound`] for no such job; [`Error::BadRequest`] for an `until` that is neither, or not in the
/// future; [`Error::Store`].
pub async fn pause<S: Store>(
    store: &S,
    name: &str,
    until: Option<&str>,
    note: Option<&str>,
    actor: &str,
) -> Result<idem_runner::once::PauseView, Error> {
    let now_ms = idem_store::system_time_to_millis(store.now().await?);
    let until_ms = match until.map(str::trim).filter(|u| !u.is_empty()) {
        None => None,
        Some(u) => Some(
            idem_runner::once::parse_time("until", u, now_ms, false).map_err(|e| Error::BadRequest(e.to_string()))?,
        ),
    };
    let note = note.map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned);
    let paused = idem_runner::once::pause(store, name, until_ms, note, actor).await.map_err(|e| match e {
        idem_runner::Error::Config(why) => Error::BadRequest(why),
        other => other.into(),
    })?;
    let pause = paused.ok_or_else(|| Error::NotFound(format!("no cron job {name}")))?;
    tracing::info!(actor, job = name, until = ?pause.until_ms, "admin: cron job paused");
    Ok(idem_runner::once::PauseView::new(&pause, now_ms))
}

/// Resumes job `name` for `actor`; `false` when it was not paused.
///
/// # Errors
/// [`Error::NotFound`] for no such job; [`Error::Store`].
pub async fn resume<S: Store>(store: &S, name: &str, actor: &str) -> Result<bool, Error> {
    if store.get(&idem_core::slot::job_key(name)).await?.is_none() {
        return Err(Error::NotFound(format!("no cron job {name}")));
    }
    let resumed = idem_runner::once::resume(store, name, actor).await?.is_some();
    if resumed {
        tracing::info!(actor, job = name, "admin: cron job resumed");
    }
    Ok(resumed)
}

/// What [`trigger`] did: the request's id, and whether it is new (`false`: that id was requested before and
/// runs, or ran, once).
#[derive(Clone, Debug, Serialize)]
pub struct Triggered {
    /// The trigger's id.
    pub id: String,
    /// Requested now.
    pub new: bool,
    /// Its state in the store (`requested`, `running`, `done`…).
    pub state: String,
}

/// Requests a run of job `name` outside its schedule for `actor`, keyed by `id` (`None`: a new one): the job's
/// next invocation runs it once, however often the same id is requested.
///
/// # Errors
/// [`Error::NotFound`] for no such job; [`Error::BadRequest`] for an id that is not 1 to 100 letters, digits,
/// `.`, `_`, `-`; [`Error::Store`].
pub async fn trigger<S: Store>(store: &S, name: &str, id: Option<&str>, actor: &str) -> Result<Triggered, Error> {
    let id = id.map(str::trim).filter(|i| !i.is_empty());
    let t = idem_runner::once::trigger(store, name, id, actor)
        .await
        .map_err(|e| match e {
            idem_runner::Error::Config(why) => Error::BadRequest(why),
            other => other.into(),
        })?
        .ok_or_else(|| Error::NotFound(format!("no cron job {name}")))?;
    tracing::info!(actor, job = name, id = %t.id, new = t.new, "admin: cron job triggered");
    Ok(Triggered { id: t.id, new: t.new, state: t.state })
}

/// One bar of the timeline.
#[derive(Clone, Debug, Serialize)]
pub struct Bar {
    /// Left edge, in SVG user units.
    pub x: usize,
    /// The CSS class: the slot's state (`done`, `failed`, `missed`, `crashed`, `running`, `given_back`),
    /// with ` repeated` when it ran more than once and ` taken-over` after a takeover.
    pub class: String,
    /// The tooltip: slot time, state, machine, attempts.
    pub title: String,
}

/// Width of one bar plus its gap, in SVG user units.
pub const BAR_STEP: usize = 12;

/// The timeline's bars, oldest left, from a history (newest first).
pub fn timeline(history: &History) -> Vec<Bar> {
    history
        .slots
        .iter()
        .rev()
        .enumerate()
        .map(|(i, s)| {
            let mut class = s.state.to_owned();
            if s.attempts > 1 {
                class.push_str(" repeated");
            }
            let machine = s.machine.as_deref().unwrap_or("-");
            let title = format!("{} {} on {machine}, {} attempt(s)", s.slot, s.state, s.attempts);
            Bar { x: i * BAR_STEP, class, title }
        })
        .collect()
}
