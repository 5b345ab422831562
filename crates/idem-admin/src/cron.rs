//! `idem once`'s jobs as the operator sees them: every job with its schedule, last and next slot, and the
//! history of its recent slots, drawn as an SVG timeline.
//!
//! Pause, resume and trigger are the cron jobs' actions still to come: they belong beside [`history`] here,
//! as functions of the store, with their forms on the job page and their endpoints beside
//! `/v1/admin/items/forget`.

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
