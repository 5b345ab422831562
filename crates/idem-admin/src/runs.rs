//! `idem run`'s ledgers as the operator sees them: the jobs in the store (`--name`), a job's items by state,
//! one item's entry and lease, and the forget action for a failed or poison item (the next run retries it).
//!
//! Keys (`idem_core::ledger`): `run/{job}/job` (the job's last command), `run/{job}/item/{id}` (an item's
//! entry), `run/{job}/lease/{id}` (a live claim).

use idem_core::ledger::{Entry, Keys, entry_prefix};
use idem_runner::{JobRecord, LedgerStatus};
use idem_store::Store;
use serde::Serialize;

use crate::Error;
use crate::scan::{self, Step};

/// Most jobs the jobs page lists.
pub const JOBS_SHOWN: usize = 200;

/// A job as the jobs page lists it.
#[derive(Clone, Debug, Serialize)]
pub struct Job {
    /// Its `--name`.
    pub name: String,
    /// What its last run was (command, output template, host); `None` for a ledger written before it was kept.
    pub record: Option<JobRecord>,
}

/// The jobs with a ledger in the store, in name order (at most [`JOBS_SHOWN`]).
///
/// # Errors
/// [`Error::Store`], [`Error::Runner`].
pub async fn jobs<S: Store>(store: &S) -> Result<Vec<Job>, Error> {
    let names = job_names(store, "run/", JOBS_SHOWN).await?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let record = idem_runner::job_record(store, &name).await?;
        out.push(Job { name, record });
    }
    Ok(out)
}

/// The names under `root` (`run/`, `once/`): the segment after it, each once, jumping over each name's keys.
pub(crate) async fn job_names<S: Store>(store: &S, root: &str, limit: usize) -> Result<Vec<String>, Error> {
    let mut names = Vec::new();
    let mut cursor = None;
    loop {
        let page = scan::scan(store, root, cursor, limit - names.len(), |key, _| {
            let Some((name, _)) = key[root.len()..].split_once('/') else { return Ok(Step::Skip) };
            Ok(Step::Keep(name.to_owned()))
        })
        .await?;
        let last = page.rows.last().cloned();
        names.extend(page.rows);
        match (last, page.next_cursor) {
            (Some(name), Some(_)) if names.len() < limit => cursor = Some(scan::past(&format!("{root}{name}/"))),
            (None, Some(c)) => cursor = Some(scan::decode_cursor(&c)?),
            _ => break,
        }
    }
    names.dedup();
    Ok(names)
}

/// An item's state, as filters and pages name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemState {
    /// Finished; its output verified.
    Done,
    /// Claimed: running now, or left by a runner that died (its lease says which).
    Running,
    /// Given back by a stopped runner; runs again.
    Interrupted,
    /// Its last attempt failed; the next run retries it while attempts remain.
    Failed,
    /// Failed twice the same way: never retried until forgotten.
    Poison,
}

impl ItemState {
    /// Reads the names in URLs and JSON.
    ///
    /// # Errors
    /// [`Error::BadRequest`].
    pub fn parse(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "done" => ItemState::Done,
            "running" => ItemState::Running,
            "interrupted" => ItemState::Interrupted,
            "failed" => ItemState::Failed,
            "poison" => ItemState::Poison,
            _ => return Err(Error::BadRequest("state: done, running, interrupted, failed or poison".into())),
        })
    }

    fn of(entry: &Entry) -> Self {
        match entry {
            Entry::Done { .. } => ItemState::Done,
            Entry::Running { .. } => ItemState::Running,
            Entry::Interrupted { .. } => ItemState::Interrupted,
            Entry::Failed { poison: true, .. } => ItemState::Poison,
            Entry::Failed { .. } => ItemState::Failed,
        }
    }
}

/// One line of a job's items.
#[derive(Clone, Debug, Serialize)]
pub struct ItemRow {
    /// The item id.
    pub id: String,
    /// Its state.
    pub state: ItemState,
    /// Attempts counted so far.
    pub attempts: u32,
    /// The last error (failed, poison, or a running item's previous attempt).
    pub last_error: Option<String>,
    /// Who holds or held it (running, interrupted, done).
    pub owner: Option<String>,
}

/// One page of a job's items.
#[derive(Debug, Serialize)]
pub struct ItemPage {
    /// The items, in store key order.
    pub rows: Vec<ItemRow>,
    /// Pass as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

fn decode(key: &str, bytes: &[u8]) -> Result<Entry, Error> {
    Entry::decode(bytes).map_err(|e| Error::Unreadable { key: key.to_owned(), reason: e.to_string() })
}

fn check_job(job: &str) -> Result<(), Error> {
    if job.is_empty() || job.contains('/') {
        return Err(Error::BadRequest("job: a --name, without '/'".into()));
    }
    Ok(())
}

/// A page of `job`'s items in `state` (all without), at most `limit`, after `cursor`.
///
/// # Errors
/// [`Error::BadRequest`]; [`Error::Unreadable`]; [`Error::Store`].
pub async fn items<S: Store>(
    store: &S,
    job: &str,
    state: Option<ItemState>,
    cursor: Option<&str>,
    limit: usize,
) -> Result<ItemPage, Error> {
    check_job(job)?;
    let prefix = entry_prefix(job);
    let cursor = cursor.map(scan::decode_cursor).transpose()?;
    let page = scan::scan(store, &prefix, cursor, limit, |key, value| {
        let entry = decode(key, value.value())?;
        let s = ItemState::of(&entry);
        if state.is_some_and(|want| want != s) {
            return Ok(Step::Skip);
        }
        let owner = match &entry {
            Entry::Running { owner, .. } | Entry::Interrupted { owner, .. } | Entry::Done { owner, .. } => {
                Some(owner.clone())
            }
            Entry::Failed { .. } => None,
        };
        let last_error = entry.last_error().map(str::to_owned);
        let id = key[prefix.len()..].to_owned();
        Ok(Step::Keep(ItemRow { id, state: s, attempts: entry.attempts(), last_error, owner }))
    })
    .await?;
    Ok(ItemPage { rows: page.rows, next_cursor: page.next_cursor })
}

/// A live claim on an item.
#[derive(Clone, Debug, Serialize)]
pub struct LeaseView {
    /// The claimant's owner token.
    pub holder: String,
    /// The lease's generation: the holder's fencing token.
    pub generation: u64,
    /// When it lapses unless renewed (RFC 3339).
    pub expires_at: Option<String>,
}

/// Everything the store knows about one item: the data of its page and of `idem explain`.
#[derive(Clone, Debug, Serialize)]
pub struct ItemDetail {
    /// The job.
    pub job: String,
    /// The item id.
    pub id: String,
    /// Its state.
    pub state: ItemState,
    /// Its ledger entry as stored (attempts, error fingerprints, digests, times).
    pub entry: Entry,
    /// The entry's generation.
    pub generation: u64,
    /// The live lease, if one is held.
    pub lease: Option<LeaseView>,
}

/// Reads item `id` of `job`.
///
/// # Errors
/// [`Error::NotFound`]; [`Error::Unreadable`]; [`Error::Store`].
pub async fn item<S: Store>(store: &S, job: &str, id: &str) -> Result<ItemDetail, Error> {
    check_job(job)?;
    let keys = Keys::new(job, id);
    let value = store.get(keys.entry()).await?.ok_or_else(|| Error::NotFound(format!("job {job} has no item {id}")))?;
    let entry = decode(keys.entry(), value.value())?;
    let lease = store.get(keys.lease()).await?.map(|l| LeaseView {
        holder: String::from_utf8_lossy(l.value()).into_owned(),
        generation: l.generation().get(),
        expires_at: l.expires_at().map(|t| humantime::format_rfc3339_millis(t).to_string()),
    });
    Ok(ItemDetail {
        job: job.to_owned(),
        id: id.to_owned(),
        state: ItemState::of(&entry),
        entry,
        generation: value.generation().get(),
        lease,
    })
}

/// The counts of `job`'s ledger (`idem runs status`).
///
/// # Errors
/// [`Error::Runner`].
pub async fn status<S: Store>(store: &S, job: &str) -> Result<LedgerStatus, Error> {
    check_job(job)?;
    Ok(idem_runner::status(store, job).await?)
}

/// Forgets failed or poison item `id` of `job`, so the next run claims it as new (`idem runs forget` without
/// touching output files: the server may not be the machine that writes them). A done, running or interrupted
/// item is refused: forgetting one of those would run it again, which is `idem runs forget`'s decision.
///
/// # Errors
/// [`Error::NotFound`]; [`Error::Conflict`] for an item that is not failed or poison; [`Error::Store`].
pub async fn forget<S: Store>(store: &S, job: &str, id: &str, actor: &str) -> Result<(), Error> {
    let detail = item(store, job, id).await?;
    if !matches!(detail.state, ItemState::Failed | ItemState::Poison) {
        return Err(Error::Conflict(format!(
            "item {id} is {:?}, not failed or poison: use `idem runs forget` to run a finished item again",
            detail.state
        )));
    }
    idem_runner::forget(store, job, None, &[id.to_owned()]).await?;
    tracing::info!(actor, job, item = id, state = ?detail.state, "admin: item forgotten");
    Ok(())
}
