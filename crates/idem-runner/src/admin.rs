//! `idem runs status` and `idem runs forget`: reading and trimming a job's ledger.

use idem_core::ledger::{self, Entry, entry_prefix};
use idem_store::{Precondition, Store, Ttl};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// A job's ledger in numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerStatus {
    /// Entries done.
    pub done: u64,
    /// [`LedgerStatus::done`] by the host that recorded them (`adopted` for outputs found in place without
    /// running, whose host is not recorded).
    pub done_by_host: std::collections::BTreeMap<String, u64>,
    /// Entries claimed (running now, or left by a runner that died; its lease says which).
    pub running: u64,
    /// Entries whose last attempt was interrupted (a second Ctrl-C or SIGTERM) and not counted: they run again.
    pub interrupted: u64,
    /// Entries whose last attempt failed (excluding poison).
    pub failed: u64,
    /// Poison entries.
    pub poison: u64,
    /// Failed and poison items with their last error: the first [`LedgerStatus::PROBLEMS_SHOWN`] by their ids
    /// in natural order ([`natural_cmp`](crate::natural_cmp): `3`, `20`, `100`).
    pub problems: Vec<(String, String)>,
}

impl LedgerStatus {
    /// How many failed and poison items [`LedgerStatus::problems`] names at most.
    pub const PROBLEMS_SHOWN: usize = 50;
}

/// What a job's last run was: kept at `run/{job}/job` (outside its entries' prefix), so that a rerun under
/// the same name with another output template or command says so, and `idem runs forget --name` knows which
/// outputs to remove.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    /// The output template (empty: the job writes no output file).
    pub output: String,
    /// The command and its arguments, as given (placeholders not substituted).
    pub command: Vec<String>,
    /// The host that ran it ([`note_job`] sets it; empty in records written before hosts were kept).
    #[serde(default)]
    pub host: String,
    /// The output template made absolute on that host (empty without `--output`, and in records written
    /// before it was kept): with the host, which files the job writes ([`claim_outputs`]).
    #[serde(default)]
    pub output_path: String,
}

/// The key naming the job that writes the outputs of `output_path` (an absolute template) on `host`.
fn outputs_key(host: &str, output_path: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{host}\0{output_path}").as_bytes());
    format!("run-outputs/{}", hex::encode(&digest[..8]))
}

/// Claims the files of `record` (its `output_path` on this host) for named job `job`: `Some(other)` when
/// another job whose last run wrote the same files on this host still has them (its record names the same
/// absolute template and host), so this job would adopt that job's outputs as its own and overwrite them (and
/// the other would then run them all again); `None` when they are free, or were another job's that has since
/// moved to other files (the claim is then this job's). Unless `dry_run`, the claim is written. Jobs on other
/// hosts, or in other directories with the same relative template, write other files and never meet here.
///
/// # Errors
/// [`Error::Store`].
pub async fn claim_outputs<S: Store>(
    store: &S,
    job: &str,
    output_path: &str,
    dry_run: bool,
) -> Result<Option<String>, Error> {
    if output_path.is_empty() {
        return Ok(None);
    }
    let host = crate::supervise::host_name();
    let key = outputs_key(&host, output_path);
    if let Some(v) = store.get(&key).await? {
        let owner = String::from_utf8_lossy(v.value()).into_owned();
        if owner == job {
            return Ok(None);
        }
        if let Ok(Some(theirs)) = job_record(store, &owner).await
            && theirs.host == host
            && theirs.output_path == output_path
        {
            return Ok(Some(owner));
        }
    }
    if !dry_run {
        store.put(&key, bytes::Bytes::from(job.to_owned()), Precondition::Any, Ttl::Clear).await?;
    }
    Ok(None)
}

fn job_key(job: &str) -> String {
    format!("run/{job}/job")
}

/// The record of `job`'s last run, if one was written (jobs run before records were kept have none).
///
/// # Errors
/// [`Error::Store`]; [`Error::Config`] for a record that is not one.
pub async fn job_record<S: Store>(store: &S, job: &str) -> Result<Option<JobRecord>, Error> {
    let Some(v) = store.get(&job_key(job)).await? else { return Ok(None) };
    serde_json::from_slice(v.value())
        .map(Some)
        .map_err(|e| Error::Config(format!("the ledger's record of job {job} is unreadable: {e}")))
}

/// True when the ledger knows `job`: a record of one of its runs, or an entry (jobs run before records were
/// kept have entries only). `idem runs status|forget` answer "no such job" otherwise, rather than zeros.
///
/// # Errors
/// [`Error::Store`].
pub async fn job_exists<S: Store>(store: &S, job: &str) -> Result<bool, Error> {
    if store.get(&job_key(job)).await?.is_some() {
        return Ok(true);
    }
    Ok(!store.list(&entry_prefix(job), None, 1).await?.items.is_empty())
}

/// Compares `record` with the record of `job`'s last run and, unless `dry_run`, writes it as the new one.
/// Returns what changed, one sentence each (none for a first run, or a job run before records were kept): a
/// job whose output template or command changed under one name keeps its done items done, which the operator
/// may not expect.
///
/// # Errors
/// [`Error::Store`].
pub async fn note_job<S: Store>(store: &S, job: &str, record: &JobRecord, dry_run: bool) -> Result<Vec<String>, Error> {
    let mut changes = Vec::new();
    let record = &JobRecord { host: crate::supervise::host_name(), ..record.clone() };
    // An unreadable record is replaced: it only serves these warnings. One written by another host is not
    // compared: runners on several machines may differ in paths (each its own disk) by design, and alternating
    // runs would warn every time.
    if let Ok(Some(last)) = job_record(store, job).await
        && (last.host.is_empty() || last.host == record.host)
    {
        let shown = |o: &str| if o.is_empty() { "none".to_owned() } else { format!("{o:?}") };
        if last.output.is_empty() && !record.output.is_empty() {
            // Done without an output is no longer done: each is judged by a file that is not there.
            changes.push(format!(
                "job {job}: --output {:?} was added since its last run, which had none; items done then have no \
                 output there and run again (give this job another --name to keep them apart)",
                record.output
            ));
        } else if last.output != record.output {
            changes.push(format!(
                "job {job}: the output template changed since its last run ({} then, {} now); its done items \
                 are judged by the outputs at the new paths",
                shown(&last.output),
                shown(&record.output)
            ));
        }
        if last.command != record.command {
            // "Stay done" only holds when the outputs they are judged by did not move.
            let then = if last.output == record.output {
                "items done then stay done (`idem runs forget` to redo them)"
            } else {
                "items done then stay done only where their output is at the new paths; the others run again, \
                 with the new command"
            };
            changes.push(format!(
                "job {job}: the command changed since its last run ({:?} then, {:?} now); {then}",
                last.command.join(" "),
                record.command.join(" ")
            ));
        }
        if changes.is_empty() {
            return Ok(changes);
        }
    }
    if !dry_run {
        let value = serde_json::to_vec(record).unwrap_or_default();
        store.put(&job_key(job), value.into(), Precondition::Any, Ttl::Clear).await?;
    }
    Ok(changes)
}

/// Reads every entry of `job` (see [`RunConfig::job`](crate::RunConfig::job)).
///
/// # Errors
/// [`Error::Store`]; [`Error::Entry`] for an unreadable entry.
pub async fn status<S: Store>(store: &S, job: &str) -> Result<LedgerStatus, Error> {
    let prefix = entry_prefix(job);
    let mut out = LedgerStatus::default();
    let mut cursor: Option<String> = None;
    loop {
        let page = store.list(&prefix, cursor.as_deref(), 1000).await?;
        for item in &page.items {
            let Some(v) = store.get(&item.key).await? else { continue };
            let entry = Entry::decode(v.value()).map_err(|source| Error::Entry { key: item.key.clone(), source })?;
            let id = item.key[prefix.len()..].to_owned();
            match &entry {
                Entry::Done { owner, .. } => {
                    out.done += 1;
                    let host = crate::supervise::owner_host(owner).unwrap_or(owner.as_str());
                    *out.done_by_host.entry(host.to_owned()).or_default() += 1;
                }
                Entry::Running { .. } => out.running += 1,
                Entry::Interrupted { .. } => out.interrupted += 1,
                Entry::Failed { poison, last_error, .. } => {
                    if *poison {
                        out.poison += 1;
                    } else {
                        out.failed += 1;
                    }
                    let kind = if *poison { "poison" } else { "failed" };
                    out.problems.push((id, format!("{kind}: {last_error}")));
                    // The store lists keys as strings (`100` before `20`): the first in natural order are kept,
                    // trimmed now and then so a ledger of a million failures never sits in memory.
                    if out.problems.len() >= 2 * LedgerStatus::PROBLEMS_SHOWN {
                        keep_first_problems(&mut out.problems);
                    }
                }
            }
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    keep_first_problems(&mut out.problems);
    Ok(out)
}

/// Sorts `problems` by id in natural order and keeps the first [`LedgerStatus::PROBLEMS_SHOWN`].
fn keep_first_problems(problems: &mut Vec<(String, String)>) {
    problems.sort_by(|a, b| crate::shown::natural_cmp(&a.0, &b.0));
    problems.truncate(LedgerStatus::PROBLEMS_SHOWN);
}

/// Makes `ids` of `job` run again: deletes their ledger entries and leases, and (when the job writes outputs
/// to `output_template`) the outputs of those that had an entry (a valid output without an entry would otherwise be adopted rather
/// than redone); an id without an entry touches no file. Returns the ids that had no entry, in the order given
/// (each id once).
///
/// # Errors
/// [`Error::Store`]; [`Error::Io`] when an output exists but cannot be removed.
pub async fn forget<S: Store>(
    store: &S,
    job: &str,
    output_template: Option<&str>,
    ids: &[String],
) -> Result<Vec<String>, Error> {
    let mut unknown = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for id in ids.iter().filter(|id| seen.insert(id.as_str())) {
        let keys = ledger::Keys::new(job, id);
        let known = store.delete(keys.entry(), Precondition::Any).await?.is_some();
        store.delete(keys.lease(), Precondition::Any).await?;
        if !known {
            // Not an item of this job: its "output path" is only the template filled with arbitrary text
            // (`../important`), so nothing on disk is touched.
            unknown.push(id.clone());
            continue;
        }
        let Some(output_template) = output_template.filter(|t| !t.is_empty()) else { continue };
        let output = std::path::PathBuf::from(output_template.replace("{id}", id));
        match tokio::fs::remove_file(&output).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { what: "cannot remove output", path: output, source }),
        }
    }
    Ok(unknown)
}
