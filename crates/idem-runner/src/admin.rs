//! `idem runs status` and `idem runs forget`: reading and trimming a job's ledger.

use idem_core::{Entry, ItemKeys, entry_prefix};
use idem_store::{Precondition, Store};

use crate::Error;

/// A job's ledger in numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerStatus {
    /// Entries done.
    pub done: u64,
    /// Entries claimed (running now, or left by a runner that died; its lease says which).
    pub running: u64,
    /// Entries whose last attempt was interrupted (a second Ctrl-C or SIGTERM) and not counted: they run again.
    pub interrupted: u64,
    /// Entries whose last attempt failed (excluding poison).
    pub failed: u64,
    /// Poison entries.
    pub poison: u64,
    /// Failed and poison items with their last error (at most 50).
    pub problems: Vec<(String, String)>,
}

/// Reads every entry of `job` (see [`job_id`](crate::job_id)).
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
                Entry::Done { .. } => out.done += 1,
                Entry::Running { .. } => out.running += 1,
                Entry::Interrupted { .. } => out.interrupted += 1,
                Entry::Failed { poison, last_error, .. } => {
                    if *poison {
                        out.poison += 1;
                    } else {
                        out.failed += 1;
                    }
                    if out.problems.len() < 50 {
                        let kind = if *poison { "poison" } else { "failed" };
                        out.problems.push((id, format!("{kind}: {last_error}")));
                    }
                }
            }
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    Ok(out)
}

/// Makes `ids` of the job writing `output_template` run again: deletes their ledger entries and leases, and
/// the outputs of those that had an entry (a valid output without an entry would otherwise be adopted rather
/// than redone); an id without an entry touches no file. Returns the ids that had no entry, in the order given
/// (each id once).
///
/// # Errors
/// [`Error::Store`]; [`Error::Io`] when an output exists but cannot be removed.
pub async fn forget<S: Store>(store: &S, output_template: &str, ids: &[String]) -> Result<Vec<String>, Error> {
    let job = crate::job_id(output_template);
    let mut unknown = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for id in ids.iter().filter(|id| seen.insert(id.as_str())) {
        let keys = ItemKeys::new(&job, id);
        let known = store.delete(keys.entry(), Precondition::Any).await?.is_some();
        store.delete(keys.lease(), Precondition::Any).await?;
        if !known {
            // Not an item of this job: its "output path" is only the template filled with arbitrary text
            // (`../important`), so nothing on disk is touched.
            unknown.push(id.clone());
            continue;
        }
        let output = std::path::PathBuf::from(output_template.replace("{id}", id));
        match tokio::fs::remove_file(&output).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { what: "cannot remove output", path: output, source }),
        }
    }
    Ok(unknown)
}
