//! What operators do to a job between its invocations, each a store operation any machine (or a web page) can
//! make: [`pause`] and [`resume`] it, [`trigger`] a run outside its schedule (run by the job's next
//! invocation, on whatever machine, under its own key), and [`list`] every job.

use idem_core::slot::{self, Job, Pause, job_key, pause_key};
use idem_store::{Precondition, Store, StoreExt, Ttl};
use serde::Serialize;

use super::record::list_all;
use super::schedule::{format_in, parse_canonical};
use super::{check_name, millis};
use crate::error::Error;
use crate::shown::printable;

/// The longest `--note` a pause keeps, in bytes (it is shown on every invocation's line and on the page).
const MAX_NOTE: usize = 1000;
/// The farthest `--until` a pause takes: 366 days, as every other duration of `idem once`.
const MAX_PAUSE_MS: u64 = 366 * 24 * 3600 * 1000;

/// Who is asking, as pauses and triggers record it: `user@host` (`$USER`, else `$LOGNAME`, else the account
/// name of the process's user id in `/etc/passwd` (cron and systemd often set neither), else `uidN`; the host
/// as the history names it, `IDEM_HOST` when set).
pub fn who() -> String {
    let set = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let user = set("USER").or_else(|| set("LOGNAME")).unwrap_or_else(account_name);
    format!("{user}@{}", crate::supervise::host_name())
}

/// The name `/etc/passwd` gives the process's real user id, else `uidN`.
fn account_name() -> String {
    let uid = rustix::process::getuid().as_raw().to_string();
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| {
            passwd.lines().find_map(|line| {
                let mut fields = line.split(':');
                let name = fields.next()?;
                (fields.nth(1)? == uid).then(|| name.to_owned())
            })
        })
        .unwrap_or_else(|| format!("uid{uid}"))
}

/// Pauses job `name` (checked: [`check_name`]) until `until_ms` (milliseconds since the Unix epoch, by the
/// store's clock; `None`: until [`resume`]d), saying `note`, asked by `who` (`user@host`). From now on every
/// invocation records its slot `paused` and runs nothing; a slot already running goes on. A pause replaces
/// the one before. `Ok(None)` when the store has no such job.
///
/// # Errors
/// [`Error::Config`] for a bad name, an `until_ms` not after the store's now or more than 366 days after it,
/// or a note over 1,000 bytes; [`Error::Store`] when the store fails.
pub async fn pause<S: Store>(
    store: &S,
    name: &str,
    until_ms: Option<u64>,
    note: Option<String>,
    who: &str,
) -> Result<Option<Pause>, Error> {
    check_name(name)?;
    if store.get(&job_key(name)).await?.is_none() {
        return Ok(None);
    }
    if note.as_ref().is_some_and(|n| n.len() > MAX_NOTE) {
        return Err(Error::Config(format!("--note is longer than {MAX_NOTE} bytes: nothing paused")));
    }
    let now_ms = millis(store.now().await?);
    if let Some(until) = until_ms.filter(|u| u.saturating_sub(now_ms) > MAX_PAUSE_MS) {
        return Err(Error::Config(format!(
            "--until {} is more than 366 days away: pause without --until (until resumed) instead; nothing paused",
            format_in(until, None)
        )));
    }
    if let Some(until) = until_ms.filter(|u| *u <= now_ms) {
        return Err(Error::Config(format!(
            "--until {} is not after now ({}, the store's clock): nothing paused",
            format_in(until, None),
            format_in(now_ms, None)
        )));
    }
    let pause = Pause { by: who.to_owned(), note, since_ms: now_ms, until_ms, resumed_by: None };
    store.put(&pause_key(name), pause.encode(), Precondition::Any, Ttl::Clear).await?;
    Ok(Some(pause))
}

/// Resumes job `name`: its pause ends now (the record stays, so `status` says when the last pause was).
/// `Ok(None)` when the job is not paused (never was, its `--until` passed, or it was resumed).
///
/// # Errors
/// [`Error::Config`] for a bad name; [`Error::Store`] when the store fails (or the pause changed meanwhile, a
/// precondition failure: try again); [`Error::Entry`] for a pause record that cannot be decoded.
pub async fn resume<S: Store>(store: &S, name: &str, who: &str) -> Result<Option<Pause>, Error> {
    check_name(name)?;
    let key = pause_key(name);
    let Some(v) = store.get(&key).await? else { return Ok(None) };
    let pause = Pause::decode(v.value()).map_err(|source| Error::Entry { key: key.clone(), source })?;
    let now_ms = millis(store.now().await?);
    if !pause.holds_at(now_ms) {
        return Ok(None);
    }
    let resumed = pause.resumed(who, now_ms);
    store.put(&key, resumed.encode(), Precondition::Generation(v.generation()), Ttl::Clear).await?;
    Ok(Some(resumed))
}

/// The job's last pause record, holding or not (`None`: never paused).
///
/// # Errors
/// [`Error::Store`] when the store fails; [`Error::Entry`] for a record that cannot be decoded.
pub async fn pause_state<S: Store>(store: &S, name: &str) -> Result<Option<Pause>, Error> {
    let key = pause_key(name);
    match store.get(&key).await? {
        Some(v) => Ok(Some(Pause::decode(v.value()).map_err(|source| Error::Entry { key, source })?)),
        None => Ok(None),
    }
}

/// What [`trigger`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Triggered {
    /// The trigger's id.
    pub id: String,
    /// `true`: requested now; `false`: a request with this id was there already (it runs, or ran, once).
    pub new: bool,
    /// The trigger's state in the store (`requested`, `running`, `done`, `failed`…, as `status` says it).
    pub state: String,
}

/// Requests a run of job `name` outside its schedule, keyed by `id` (`None`: a new id is made; give one to
/// make a retried request one run): a create-only write, so a request made again with the same id changes
/// nothing. The job's next invocation, on any machine, claims and runs it under a lease as it does a slot,
/// after its own slot, whether the job is paused or not (an operator asked for it). `Ok(None)` when the store
/// has no such job.
///
/// # Errors
/// [`Error::Config`] for a bad name or id; [`Error::Store`] when the store fails.
pub async fn trigger<S: Store>(store: &S, name: &str, id: Option<&str>, who: &str) -> Result<Option<Triggered>, Error> {
    check_name(name)?;
    let id = id.map_or_else(|| format!("t{:016x}", rand::random::<u64>()), str::to_owned);
    if !slot::is_trigger_id(&id) {
        return Err(Error::Config(format!(
            "--id {id:?}: give 1 to 100 ASCII letters, digits, '.', '_', '-', starting with a letter or digit"
        )));
    }
    if store.get(&job_key(name)).await?.is_none() {
        return Ok(None);
    }
    let now_ms = millis(store.now().await?);
    let keys = slot::Keys::trigger(name, &id, now_ms);
    let new = match store
        .apply(idem_core::planted_unconditional("once-trigger-overwrite", slot::requested(&keys, who, now_ms)))
        .await
    {
        Ok(_) => true,
        Err(e) if e.is_precondition_failed() => false,
        Err(e) => return Err(e.into()),
    };
    let state = match store.get(keys.entry()).await? {
        Some(v) => {
            slot::Entry::decode(v.value()).map_or_else(|_| "unreadable".to_owned(), |e| state_name(&e).to_owned())
        }
        None => "gone".to_owned(),
    };
    Ok(Some(Triggered { id, new, state }))
}

/// One job as [`list`] shows it.
#[derive(Clone, Debug, Serialize)]
pub struct JobView {
    /// The job's name.
    pub name: String,
    /// Its schedule, in words (`every 1h`, `cron '0 3 * * *' (UTC)`).
    pub schedule: String,
    /// Its overlap policy.
    pub overlap: String,
    /// The newest slot any invocation has seen (RFC 3339).
    pub last_slot: String,
    /// That slot's state (`done`, `failed`, `running`, `paused`, `missed`…; `none` when it has no entry).
    pub last_state: String,
    /// The next slot after the store's now (RFC 3339).
    pub next_slot: Option<String>,
    /// Its pause, if it was ever paused (`paused` says whether it holds now).
    pub pause: Option<PauseView>,
    /// When its newest successful run ended (RFC 3339, UTC, by the store's clock), as the job record keeps it.
    pub last_success: Option<String>,
    /// Runs requested and not run yet (slots a backfill or a catch-up requested, and triggered runs): the next
    /// invocations run them.
    pub pending: u64,
}

/// Every job in the store, by name: one listing of the `once/` keys (which also counts each job's pending
/// requested slots), then per job its record and one `get_many` of its pause, its newest slot's entry and
/// lease, and its triggers.
///
/// # Errors
/// [`Error::Store`] when the store fails; [`Error::Entry`] for a record that cannot be decoded.
pub async fn list<S: Store>(store: &S) -> Result<Vec<JobView>, Error> {
    let keys = list_all(store, "once/").await?;
    // Requested slots are pending while their key exists; a trigger's key stays after it ran, so triggers are
    // read with the job's record and counted while `requested`.
    let mut pending = std::collections::HashMap::<&str, u64>::new();
    let mut triggers = std::collections::HashMap::<&str, Vec<String>>::new();
    for key in &keys {
        if let Some((name, rest)) = key.strip_prefix("once/").and_then(|k| k.split_once('/')) {
            if rest.starts_with("requested/") {
                *pending.entry(name).or_default() += 1;
            } else if rest.starts_with("trigger/") {
                triggers.entry(name).or_default().push(key.clone());
            }
        }
    }
    let names: Vec<String> = keys
        .iter()
        .filter_map(|k| Some(k.strip_prefix("once/")?.strip_suffix("/job")?.to_owned()))
        .filter(|n| !n.contains('/'))
        .collect();
    let now_ms = millis(store.now().await?);
    let mut jobs = Vec::with_capacity(names.len());
    for name in names {
        let key = job_key(&name);
        let Some(v) = store.get(&key).await? else { continue };
        let job = Job::decode(v.value()).map_err(|source| Error::Entry { key: key.clone(), source })?;
        let newest = slot::Keys::new(&name, job.last_slot_ms);
        let mut wanted = vec![pause_key(&name), newest.entry().to_owned(), newest.lease().to_owned()];
        wanted.extend(triggers.get(name.as_str()).into_iter().flatten().cloned());
        let read = store.get_many(&wanted).await?;
        let requested_triggers = read
            .iter()
            .skip(3)
            .flatten()
            .filter(|v| matches!(slot::Entry::decode(v.value()), Ok(slot::Entry::Requested { .. })))
            .count() as u64;
        let pause = match read.first().and_then(Option::as_ref) {
            Some(p) => Some(Pause::decode(p.value()).map_err(|source| Error::Entry { key: pause_key(&name), source })?),
            None => None,
        };
        let lease_live = read.get(2).is_some_and(Option::is_some);
        let last_state = match read.get(1).and_then(Option::as_ref).map(|e| slot::Entry::decode(e.value())) {
            // As `status` says it: a holder (or waiter) whose lease lapsed vanished.
            Some(Ok(slot::Entry::Running { .. } | slot::Entry::Waiting { .. })) if !lease_live => "crashed".to_owned(),
            Some(Ok(e)) => state_name(&e).to_owned(),
            Some(Err(_)) => "unreadable".to_owned(),
            None => "none".to_owned(),
        };
        let schedule = parse_canonical(&job.schedule).ok();
        jobs.push(JobView {
            schedule: schedule.as_ref().map_or_else(|| job.schedule.clone(), super::Schedule::describe),
            overlap: job.overlap.clone().unwrap_or_else(|| slot::Overlap::Allow.name().to_owned()),
            last_slot: schedule
                .as_ref()
                .map_or_else(|| format_in(job.last_slot_ms, None), |s| s.format(job.last_slot_ms)),
            last_state,
            next_slot: schedule.as_ref().and_then(|s| s.next_after(now_ms).ok().map(|n| s.format(n))),
            pause: pause.map(|p| PauseView::new(&p, now_ms)),
            last_success: job.last_success_ms.map(|t| format_in(t, None)),
            pending: pending.get(name.as_str()).copied().unwrap_or(0) + requested_triggers,
            name,
        });
    }
    Ok(jobs)
}

/// The state's name as `status` and `list` say it (without the lease: `running` may be `crashed`).
pub(super) fn state_name(entry: &slot::Entry) -> &'static str {
    match entry {
        slot::Entry::Running { .. } => "running",
        slot::Entry::Failed { .. } => "failed",
        slot::Entry::Interrupted { .. } => "given_back",
        slot::Entry::Done { .. } => "done",
        slot::Entry::Waiting { .. } => "waiting",
        slot::Entry::Requested { .. } => "requested",
        slot::Entry::Paused { .. } => "paused",
        slot::Entry::Skipped { .. } => "skipped",
        slot::Entry::Missed { .. } => "missed",
    }
}

/// The table `idem once list` prints: each column as wide as its widest cell (as `kubectl get` aligns), so a
/// long schedule or name never pushes the columns after it out of line.
pub fn render_list(jobs: &[JobView]) -> String {
    let header =
        ["JOB", "SCHEDULE", "OVERLAP", "LAST SLOT", "STATE", "NEXT SLOT", "PENDING", "PAUSED"].map(str::to_owned);
    let mut rows = vec![header];
    for j in jobs {
        let paused = match &j.pause {
            Some(p) if p.paused => format!("by {} until {}", p.by, p.until.as_deref().unwrap_or("resumed")),
            _ => "no".to_owned(),
        };
        rows.push([
            j.name.clone(),
            j.schedule.clone(),
            j.overlap.clone(),
            j.last_slot.clone(),
            j.last_state.clone(),
            j.next_slot.clone().unwrap_or_else(|| "-".to_owned()),
            j.pending.to_string(),
            paused,
        ]);
    }
    let mut widths = [0; 8];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row.iter().zip(widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// A job's pause as `status` and `list` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PauseView {
    /// Whether it holds now (by the store's clock).
    pub paused: bool,
    /// Who paused the job (`user@host`).
    pub by: String,
    /// Why.
    pub note: Option<String>,
    /// Since when (RFC 3339, UTC).
    pub since: String,
    /// Until when (RFC 3339, UTC); `null`: until resumed.
    pub until: Option<String>,
    /// Who resumed it, if someone did.
    pub resumed_by: Option<String>,
}

impl PauseView {
    /// The view of `pause` at `now_ms` (the store's clock).
    pub fn new(pause: &slot::Pause, now_ms: u64) -> Self {
        Self {
            paused: pause.holds_at(now_ms),
            by: pause.by.clone(),
            note: pause.note.clone(),
            since: format_in(pause.since_ms, None),
            until: pause.until_ms.map(|u| format_in(u, None)),
            resumed_by: pause.resumed_by.clone(),
        }
    }

    /// In words: `paused by ops@db1 until 2026-01-01T00:00:00Z (disk full)`, `not paused (last …)`.
    pub fn describe(&self) -> String {
        let until = self.until.as_ref().map_or_else(|| " until resumed".to_owned(), |u| format!(" until {u}"));
        let note = self.note.as_ref().map_or_else(String::new, |n| format!(" ({})", printable(n)));
        let resumed = self.resumed_by.as_ref().map_or_else(String::new, |r| format!(", resumed by {r}"));
        if self.paused {
            format!("paused by {} since {}{until}{note}", self.by, self.since)
        } else {
            format!("not paused (last paused by {} from {}{until}{note}{resumed})", self.by, self.since)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every column starts at one place on every line, however long a schedule or a name is.
    #[test]
    fn the_list_stays_aligned_with_a_long_schedule() {
        let job = |name: &str, schedule: &str| JobView {
            name: name.to_owned(),
            schedule: schedule.to_owned(),
            overlap: "allow".to_owned(),
            last_slot: "2026-12-05T22:00:00Z".to_owned(),
            last_state: "done".to_owned(),
            next_slot: None,
            pause: None,
            last_success: None,
            pending: 0,
        };
        let table = render_list(&[
            job("a-much-longer-job-name", "cron '*/5 9-17 * JAN,FEB,MAR MON-FRI' tz America/Argentina/Buenos_Aires"),
            job("short", "every 1h"),
        ]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        let at = |line: &str, cell: &str| line.find(cell).expect(cell);
        assert_eq!(at(lines[1], "allow"), at(lines[0], "OVERLAP"), "{table}");
        assert_eq!(at(lines[2], "allow"), at(lines[0], "OVERLAP"), "{table}");
        assert_eq!(at(lines[2], "done"), at(lines[0], "STATE"), "{table}");
    }
}
