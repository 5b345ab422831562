//! `idem once status`: a job's recent slots as the store has them; `idem once forget`: drop a job's records.

use idem_core::slot::{
    self, HISTORY, Job, MissedReason, behind_key, interrupted_key, job_key, lease_prefix, repeats_key, slot_of_key,
    slot_prefix, takeovers_key,
};
use idem_store::{Precondition, Store};
use serde::Serialize;

use super::control::{PauseView, pause_state};
use super::record::list_all;
use super::schedule::{Schedule, format_in, human_secs, parse_canonical};
use crate::error::Error;
use crate::shown::{count, printable};

/// A job's recorded history.
#[derive(Clone, Debug, Serialize)]
pub struct History {
    /// The job's name.
    pub name: String,
    /// Its schedule, as recorded by its first invocation.
    pub schedule: String,
    /// The latest slot any invocation has seen (RFC 3339).
    pub last_slot: String,
    /// Its recent slots, newest first.
    pub slots: Vec<SlotView>,
    /// Slots recorded missed among `slots`, plus those that passed unseen in gaps too long to record one by one.
    pub missed: u64,
    /// `missed` is a lower bound: a gap of a cron schedule had more slots than are counted (1,000,000).
    pub missed_at_least: bool,
    /// Slots whose holder (or waiter) vanished (killed, cut off) and that no invocation took over since:
    /// `running` or `waiting` in the store with their lease lapsed, among every entry kept (such entries are
    /// never pruned).
    pub crashed: u64,
    /// Slots an invocation found older than the job's newest slot, so never claimed: a clock behind the one
    /// that moved the job record, or a claim whose slot's entry may have been pruned meanwhile.
    pub behind: u64,
    /// Slots whose command ran to a successful end more than once (a holder whose lease was taken over after
    /// its command exited 0): must stay 0.
    pub ran_more_than_once: u64,
    /// Slots where an attempt was taken over from a holder that vanished after its claim (killed, or cut off
    /// from the store for a whole lease): that holder's command may have run too, even to its end, so these
    /// slots may have run more than once (at-least-once; not known).
    pub taken_over: u64,
    /// Attempts whose command a signal to their invocation (SIGINT, SIGTERM) stopped after it started: each
    /// counted toward `--retries`, as Kubernetes counts a Job's killed pods among its failed ones.
    pub interrupted: u64,
    /// The overlap policy (`--overlap`) the job is recorded with.
    pub overlap: String,
    /// The job's last pause (`idem once pause`), if it was ever paused; `paused` says whether it holds now.
    pub pause: Option<PauseView>,
    /// Runs requested outside the schedule (`idem once trigger`), newest first, by id.
    pub triggers: Vec<(String, SlotView)>,
    /// When the job's newest successful run ended (RFC 3339, UTC, by the store's clock): the job record's,
    /// which outlives the kept history, else the newest done slot's among those kept.
    pub last_success: Option<String>,
    /// Runs requested and not run yet: slots a backfill or a catch-up requested, and triggered runs.
    pub pending: u64,
}

/// One slot as `status` shows it. In JSON every key is present: what does not apply is `null`.
#[derive(Clone, Debug, Serialize)]
pub struct SlotView {
    /// The slot's scheduled time (RFC 3339, in the schedule's time zone).
    pub slot: String,
    /// `done`, `failed` (its last attempt failed, or was stopped by a signal to its invocation: `ending` is
    /// then `interrupted`), `running`, `crashed` (running or waiting, but its holder's lease lapsed), `given_back` (its
    /// last claim never started the command: not counted), `waiting` (for an earlier slot, under a
    /// `buffer-*` overlap policy; `started` is when it began to wait), `paused` (the job was paused when an
    /// invocation came; `machine` is who paused it, `ending` the note), `skipped` (under the overlap policy),
    /// `requested` (a triggered run not run yet; `machine` is who asked) or `missed`.
    pub state: &'static str,
    /// Where its latest attempt ran (host name).
    pub machine: Option<String>,
    /// Attempts counted.
    pub attempts: u32,
    /// Of them, the attempts a signal to their invocation stopped after the command started (each counted
    /// toward `--retries`, as a failure).
    pub interrupted: u32,
    /// When its latest attempt started (RFC 3339, UTC, by the store's clock).
    pub started: Option<String>,
    /// How long the attempt that ended last ran, in milliseconds.
    pub duration_ms: Option<u64>,
    /// The exit code of the attempt that ended last, when it exited (`null` when killed by a signal, timed
    /// out or never started).
    pub exit: Option<i32>,
    /// The signal number that killed that attempt's command, when one did.
    pub signal: Option<i32>,
    /// How that attempt ended, in words: `exit 0`, `exit 3`, `signal 9`, `timeout`, `cannot start …`.
    pub ending: Option<String>,
    /// Why it was missed: `no_invocation`, `not_started`, `past_deadline`.
    pub missed: Option<&'static str>,
    /// The last lines of that attempt's output.
    pub output: Vec<String>,
}

/// The history of job `name`: its newest `limit` slots (at most [`HISTORY`] are kept), newest first. `None`
/// when the store has no record of the job.
///
/// # Errors
/// [`Error::Store`] when the store fails; [`Error::Entry`] for a record that cannot be decoded.
pub async fn history<S: Store>(store: &S, name: &str, limit: usize) -> Result<Option<History>, Error> {
    let key = job_key(name);
    let Some(job) = store.get(&key).await? else { return Ok(None) };
    let job = Job::decode(job.value()).map_err(|source| Error::Entry { key, source })?;
    let schedule = parse_canonical(&job.schedule).ok();
    let format = |ms: u64| schedule.as_ref().map_or_else(|| format_in(ms, None), |s: &Schedule| s.format(ms));
    // Every kept entry is read, not only the `limit` shown: the missed total is the job's, whatever the limit.
    let keys = list_all(store, &slot_prefix(name)).await?;
    let values = store.get_many(&keys).await?;
    let live: std::collections::HashSet<u64> =
        list_all(store, &lease_prefix(name)).await?.iter().filter_map(|k| slot_of_key(k)).collect();
    let interrupted_set = match store.get(&interrupted_key(name)).await? {
        Some(v) => idem_store::backend::decode_set(v.value()).unwrap_or_default(),
        None => Default::default(),
    };
    let interrupted = interrupted_set.len() as u64;
    // Members are `SLOT_MS-ATTEMPT` (idem_core's slot::Keys::interrupted): counted per slot for its row.
    let mut interrupted_in = std::collections::HashMap::<u64, u32>::new();
    for member in &interrupted_set {
        if let Some(slot_ms) = member.split_once('-').and_then(|(slot, _)| slot.parse().ok()) {
            *interrupted_in.entry(slot_ms).or_default() += 1;
        }
    }
    let mut slots = Vec::new();
    let mut missed = job.missed_unlisted;
    let mut crashed = 0u64;
    for (key, value) in keys.iter().zip(values).rev() {
        let Some(value) = value else { continue };
        let entry = slot::Entry::decode(value.value()).map_err(|source| Error::Entry { key: key.clone(), source })?;
        let slot_ms = slot_of_key(key).unwrap_or(0);
        if matches!(entry, slot::Entry::Missed { .. }) {
            missed += 1;
        }
        if matches!(entry, slot::Entry::Running { .. } | slot::Entry::Waiting { .. }) && !live.contains(&slot_ms) {
            crashed += 1;
        }
        if slots.len() < limit.min(HISTORY) {
            let mut v = view(format(slot_ms), &entry, live.contains(&slot_ms));
            v.interrupted = interrupted_in.get(&slot_ms).copied().unwrap_or(0);
            slots.push(v);
        }
    }
    let count = async |key: String| -> Result<u64, Error> {
        Ok(match store.get(&key).await? {
            Some(v) => idem_store::backend::decode_set(v.value()).map(|s| s.len() as u64).unwrap_or(0),
            None => 0,
        })
    };
    let now_ms = super::millis(store.now().await?);
    let pause = pause_state(store, name).await?.map(|p| PauseView::new(&p, now_ms));
    let mut triggers = Vec::new();
    let trigger_keys = list_all(store, &slot::trigger_prefix(name)).await?;
    let trigger_live: std::collections::HashSet<String> = list_all(store, &slot::trigger_lease_prefix(name))
        .await?
        .into_iter()
        .filter_map(|k| k.rsplit('/').next().map(str::to_owned))
        .collect();
    for (key, value) in trigger_keys.iter().zip(store.get_many(&trigger_keys).await?).rev() {
        let Some(value) = value else { continue };
        let entry = slot::Entry::decode(value.value()).map_err(|source| Error::Entry { key: key.clone(), source })?;
        let id = key.rsplit('/').next().unwrap_or_default().to_owned();
        let v = view(id.clone(), &entry, trigger_live.contains(&id));
        triggers.push((id, v));
    }
    let pending = list_all(store, &slot::requested_prefix(name)).await?.len() as u64
        + triggers.iter().filter(|(_, v)| v.state == "requested").count() as u64;
    let last_success = job.last_success_ms.map(|t| format_in(t, None)).or_else(|| newest_done(&slots));
    let repeats = count(repeats_key(name)).await?;
    let taken_over = count(takeovers_key(name)).await?;
    let behind = count(behind_key(name)).await?;
    Ok(Some(History {
        name: name.to_owned(),
        schedule: job.schedule.clone(),
        last_slot: format(job.last_slot_ms),
        slots,
        missed,
        missed_at_least: job.missed_capped,
        crashed,
        behind,
        ran_more_than_once: repeats,
        taken_over,
        interrupted,
        overlap: job.overlap.clone().unwrap_or_else(|| slot::Overlap::Allow.name().to_owned()),
        pause,
        triggers,
        last_success,
        pending,
    }))
}

/// When the newest done slot among `slots` ended (its start plus its duration), RFC 3339 UTC.
fn newest_done(slots: &[SlotView]) -> Option<String> {
    slots
        .iter()
        .filter(|s| s.state == "done")
        .filter_map(|s| {
            let started: jiff::Timestamp = s.started.as_deref()?.parse().ok()?;
            let ms = u64::try_from(started.as_millisecond()).ok()?;
            Some(ms.saturating_add(s.duration_ms.unwrap_or(0)))
        })
        .max()
        .map(|ms| format_in(ms, None))
}

fn view(slot: String, entry: &slot::Entry, lease_live: bool) -> SlotView {
    let utc = |ms: u64| Some(format_in(ms, None));
    let ending = entry.last_ending();
    let mut v = SlotView {
        slot,
        state: "missed",
        machine: None,
        attempts: entry.attempts(),
        interrupted: 0,
        started: None,
        duration_ms: ending.map(|e| e.duration_ms),
        exit: ending.and_then(|e| e.code),
        signal: ending.and_then(|e| e.exit.strip_prefix("signal ")?.parse().ok()),
        ending: ending.map(|e| e.exit.clone()),
        missed: None,
        output: ending.map(|e| e.output.clone()).unwrap_or_default(),
    };
    match entry {
        slot::Entry::Running { host, started_at_ms, .. } => {
            v.state = if lease_live { "running" } else { "crashed" };
            (v.machine, v.started) = (Some(host.clone()), utc(*started_at_ms));
        }
        slot::Entry::Failed { host, started_at_ms, ending, .. } => {
            // Failed, however its last attempt ended: one stopped by a signal counts as a failure (its ending
            // says `interrupted`), and a slot whose every attempt was used is failed for good, not pending. One
            // stopped for a later slot (`cancel-other`, `terminate-other`) is said as such.
            v.state = if ending.exit.starts_with(slot::REPLACED_EXIT) { "replaced" } else { "failed" };
            (v.machine, v.started) = (Some(host.clone()), utc(*started_at_ms));
        }
        slot::Entry::Done { host, started_at_ms, .. } => {
            v.state = "done";
            (v.machine, v.started) = (Some(host.clone()), utc(*started_at_ms));
        }
        slot::Entry::Interrupted { host, .. } => {
            v.state = if lease_live { "running" } else { "given_back" };
            v.machine = Some(host.clone());
        }
        slot::Entry::Waiting { host, since_ms, .. } => {
            // A waiter whose lease lapsed vanished (killed while it waited): crashed, as a holder that did.
            v.state = if lease_live { "waiting" } else { "crashed" };
            (v.machine, v.started) = (Some(host.clone()), utc(*since_ms));
        }
        slot::Entry::Requested { by, at_ms } => {
            v.state = "requested";
            (v.machine, v.started) = (Some(by.clone()), utc(*at_ms));
        }
        slot::Entry::Paused { by, note, .. } => {
            v.state = "paused";
            v.machine = Some(by.clone());
            v.ending = note.clone();
        }
        slot::Entry::Skipped { policy, earlier_ms, .. } => {
            v.state = "skipped";
            let after = if *earlier_ms == slot::TRIGGERED_AHEAD {
                "a triggered run".into()
            } else {
                format_in(*earlier_ms, None)
            };
            v.ending = Some(format!("{policy}: after {after}"));
        }
        slot::Entry::Missed { reason, .. } => {
            v.missed = Some(match reason {
                MissedReason::NoInvocation => "no_invocation",
                MissedReason::NotStarted => "not_started",
                MissedReason::PastDeadline { .. } => "past_deadline",
            });
        }
    }
    v
}

impl History {
    /// The history as a table for people: a head line, one line per slot, and the last lines of output of
    /// the newest slot that has any.
    pub fn render(&self) -> String {
        let schedule = parse_canonical(&self.schedule).map_or_else(|_| self.schedule.clone(), |s| s.describe());
        let mut out = format!(
            "job {}: {}; last slot seen {}; {}{} missed; {} ran more than once; {} taken over from a vanished \
             holder (may have run more than once); {} interrupted; {} crashed; {} skipped behind\n",
            self.name,
            schedule,
            self.last_slot,
            if self.missed_at_least { "at least " } else { "" },
            self.missed,
            count(self.ran_more_than_once, "slot", "slots"),
            count(self.taken_over, "slot", "slots"),
            count(self.interrupted, "attempt", "attempts"),
            self.crashed,
            count(self.behind, "slot", "slots")
        );
        out.push_str(&format!("overlap {}", self.overlap));
        out.push_str(&format!("; last success {}", self.last_success.as_deref().unwrap_or("never")));
        if self.pending > 0 {
            out.push_str(&format!("; {} pending", count(self.pending, "requested run", "requested runs")));
        }
        if let Some(p) = &self.pause {
            out.push_str(&format!("; {}", p.describe()));
        }
        out.push('\n');
        out.push_str(&format!(
            "{:<26} {:<11} {:<16} {:>8}  {:<20} {:>9}  {}\n",
            "SLOT", "STATE", "MACHINE", "ATTEMPTS", "STARTED", "DURATION", "EXIT"
        ));
        for s in &self.slots {
            let duration = s.duration_ms.map_or_else(String::new, human_millis);
            let mut exit = match (&s.ending, s.missed) {
                (_, Some(why)) => why.to_owned(),
                (Some(e), None) => e.clone(),
                (None, None) => String::new(),
            };
            if s.interrupted > 0 {
                exit.push_str(&format!(
                    " ({} of {} interrupted)",
                    s.interrupted,
                    count(s.attempts, "attempt", "attempts")
                ));
            }
            out.push_str(&format!(
                "{:<26} {:<11} {:<16} {:>8}  {:<20} {:>9}  {}\n",
                s.slot,
                s.state,
                s.machine.as_deref().unwrap_or("-"),
                s.attempts,
                s.started.as_deref().unwrap_or("-"),
                duration,
                exit
            ));
        }
        for (id, t) in &self.triggers {
            out.push_str(&format!(
                "trigger {:<18} {:<11} {:<16} {:>8}  {:<20} {:>9}  {}\n",
                printable(id),
                t.state,
                t.machine.as_deref().unwrap_or("-"),
                t.attempts,
                t.started.as_deref().unwrap_or("-"),
                t.duration_ms.map_or_else(String::new, human_millis),
                t.ending.as_deref().unwrap_or_default()
            ));
        }
        if let Some(s) = self.slots.iter().find(|s| !s.output.is_empty()) {
            out.push_str(&format!("last output of {} ({} line(s)):\n", s.slot, s.output.len()));
            for line in &s.output {
                out.push_str(&format!("  {}\n", printable(line)));
            }
        }
        out
    }
}

/// A duration for people: tenths of seconds under a minute (`2.5s`), else whole units (`1h2m5s`).
fn human_millis(ms: u64) -> String {
    if ms < 60_000 { format!("{:.1}s", ms as f64 / 1000.0) } else { human_secs(ms / 1000) }
}

/// Deletes every record of job `name` (job record, slot entries, the sets of slots run more than once, taken
/// over and interrupted attempts), so its next invocation starts afresh, with whatever schedule it gives.
/// Refused while a slot or a triggered run of it runs. Returns how many records were deleted (0: the store had
/// none).
///
/// # Errors
/// [`Error::Config`] while a slot or a triggered run runs (a live lease), also one that started while the
/// records were being deleted (its claim came after the first look: it runs with some of its records gone, and
/// "forgot" would be untrue); [`Error::Store`] when the store fails.
pub async fn forget<S: Store>(store: &S, name: &str) -> Result<usize, Error> {
    if let Some(what) = running_now(store, name).await? {
        return Err(Error::Config(format!(
            "job {name}: {what} runs now under a live lease; forget it once it has ended"
        )));
    }
    let mut keys = list_all(store, &slot_prefix(name)).await?;
    keys.extend(list_all(store, &slot::trigger_prefix(name)).await?);
    keys.extend(list_all(store, &slot::requested_prefix(name)).await?);
    keys.extend(list_all(store, &slot::stop_prefix(name)).await?);
    keys.push(slot::pause_key(name));
    keys.push(job_key(name));
    keys.push(repeats_key(name));
    keys.push(takeovers_key(name));
    keys.push(interrupted_key(name));
    keys.push(behind_key(name));
    let mut deleted = 0;
    for key in keys {
        if store.delete(&key, Precondition::Any).await?.is_some() {
            deleted += 1;
        }
    }
    if let Some(what) = running_now(store, name).await? {
        return Err(Error::Config(format!(
            "job {name}: {what} started while the job was being forgotten ({deleted} record(s) deleted) and runs now \
             under a live lease; forget it again once it has ended"
        )));
    }
    Ok(deleted)
}

/// What of job `name` runs now under a live lease (`the slot T`, `a triggered run`), if anything does.
async fn running_now<S: Store>(store: &S, name: &str) -> Result<Option<String>, Error> {
    if let Some(key) = list_all(store, &lease_prefix(name)).await?.first() {
        return Ok(Some(
            slot_of_key(key).map_or_else(|| "a slot".to_owned(), |ms| format!("the slot {}", format_in(ms, None))),
        ));
    }
    Ok((!list_all(store, &slot::trigger_lease_prefix(name)).await?.is_empty()).then(|| "a triggered run".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot claimed while forget deletes the job's records (here: its lease written just before the first
    /// delete) is said, not "forgot"; a triggered run's lease refuses forget like a slot's.
    #[tokio::test]
    async fn a_slot_that_starts_during_forget_is_said_and_a_triggered_run_refuses_it() {
        use idem_store::testing::{FaultyStore, OpKind};
        use idem_store::{MemoryStore, Ttl};
        let inner = MemoryStore::new();
        inner.put(&job_key("j"), "{}".into(), Precondition::Any, Ttl::Keep).await.expect("job record");
        let (claimer, mut claimed) = (inner.clone(), false);
        let store = FaultyStore::new(inner.clone(), move |op| {
            if op.kind == OpKind::Delete && !std::mem::replace(&mut claimed, true) {
                let lease = format!("{}1700000000000", lease_prefix("j"));
                futures_util::FutureExt::now_or_never(claimer.put(&lease, "h".into(), Precondition::Any, Ttl::Keep))
                    .expect("a memory store answers at once")
                    .expect("lease");
            }
            None
        });
        let err = forget(&store, "j").await.expect_err("a slot started meanwhile").to_string();
        assert!(err.contains("started while the job was being forgotten"), "{err}");
        assert!(err.contains("forget it again once it has ended"), "{err}");

        let other = MemoryStore::new();
        let lease = format!("{}t1", slot::trigger_lease_prefix("k"));
        other.put(&lease, "h".into(), Precondition::Any, Ttl::Keep).await.expect("trigger lease");
        let err = forget(&other, "k").await.expect_err("a triggered run runs").to_string();
        assert!(err.contains("a triggered run runs now under a live lease"), "{err}");
    }

    #[test]
    fn output_lines_are_shown_without_control_characters() {
        assert_eq!(printable("\u{1b}[31mred\u{1b}[0m\tend"), "\\u{1b}[31mred\\u{1b}[0m\\u{9}end");
        assert_eq!(printable("plain é"), "plain é");
    }
}
