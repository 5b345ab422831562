//! The job record's settings every invocation must agree on ([`agree`]), and the last success it keeps
//! ([`note_success`]).

use std::time::Duration;

use idem_core::slot::{Job, job_key};
use idem_store::{Precondition, Store, Ttl};

use super::OnceConfig;
use crate::error::Error;

/// How often [`note_success`]'s compare-and-swap is tried: the record also moves with every slot, and a
/// lost race is read and tried again; after these it gives up (best effort).
const NOTE_TRIES: usize = 4;

/// Refuses `cfg` when a setting differs from the job record `job`'s: the schedule, `--retries`,
/// `--overlap`, `--jitter`, `--catchup-window`. A setting the record does not keep yet (written by an older
/// version: `retries` and `overlap` are `None`) is taken from this invocation by the caller.
///
/// # Errors
/// [`Error::Config`] naming the setting, both values and how to change it (`idem once forget`).
pub(super) fn agree(cfg: &OnceConfig, job: &Job) -> Result<(), Error> {
    let differs = |what: &str, recorded: String, given: String, why: &str| {
        Error::Config(format!(
            "job {} has {what} {recorded} in this store, not {given}: every invocation of a job must give the same \
             {what} ({why}); to change it, `idem once forget --name {}` (its history goes) or use another --name",
            cfg.name, cfg.name
        ))
    };
    if job.schedule != cfg.schedule.canonical() {
        // Both said as people give them (`every 1h`, not the record's `every 3600s`).
        let recorded =
            super::schedule::parse_canonical(&job.schedule).map_or_else(|_| job.schedule.clone(), |s| s.describe());
        return Err(Error::Config(format!(
            "job {} is scheduled {recorded} in this store, not {}: every invocation of a job must give the same \
             schedule (else one run would have two keys); to change it, `idem once forget --name {}` (its history \
             goes) or use another --name",
            cfg.name,
            cfg.schedule.describe(),
            cfg.name
        )));
    }
    if let Some(r) = job.retries.filter(|r| *r != cfg.retries) {
        let why = "else a slot's attempts would be judged against two limits, and one machine would retry a slot \
                   another found failed for good";
        return Err(differs("--retries", r.to_string(), cfg.retries.to_string(), why));
    }
    if let Some(o) = job.overlap.as_deref().filter(|o| *o != cfg.overlap.name()) {
        let why = "else one machine would wait for a slot another skips";
        return Err(differs("--overlap", o.to_owned(), cfg.overlap.name().to_owned(), why));
    }
    if job.jitter_ms != millis(cfg.jitter) {
        let why = "else machines would start one slot at different times";
        return Err(differs("--jitter", shown(job.jitter_ms), shown(millis(cfg.jitter)), why));
    }
    if job.catchup_window_ms != millis(cfg.catchup_window) {
        let why = "else one machine would record missed the slots another runs late";
        return Err(differs("--catchup-window", shown(job.catchup_window_ms), shown(millis(cfg.catchup_window)), why));
    }
    Ok(())
}

/// A duration setting as the job record keeps it: milliseconds, 0 for none.
pub(super) fn millis(d: Option<Duration>) -> u64 {
    d.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn shown(ms: u64) -> String {
    if ms == 0 { "none".into() } else { humantime::format_duration(Duration::from_millis(ms)).to_string() }
}

/// Moves the job record's `last_success_ms` to `at_ms` (when a run of job `name` that succeeded ended, by
/// the store's clock) unless it is later already. Best effort: a store failing or a record that keeps moving
/// leaves it as it was, with a warning.
pub(super) async fn note_success<S: Store>(store: &S, name: &str, at_ms: u64) {
    let key = job_key(name);
    for _ in 0..NOTE_TRIES {
        let read = match store.get(&key).await {
            Ok(Some(v)) => v,
            Ok(None) => return,
            Err(e) => return tracing::warn!(error = %e, "cannot note the job's last success"),
        };
        let Ok(job) = Job::decode(read.value()) else { return };
        if job.last_success_ms.is_some_and(|t| t >= at_ms) {
            return;
        }
        let next = Job { last_success_ms: Some(at_ms), ..job };
        match store.put(&key, next.encode(), Precondition::Generation(read.generation()), Ttl::Clear).await {
            Ok(_) => return,
            Err(e) if e.is_precondition_failed() => {}
            Err(e) => return tracing::warn!(error = %e, "cannot note the job's last success"),
        }
    }
}
