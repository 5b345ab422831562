//! `idem once`'s subcommands on a job's records: status, pause, resume, trigger, list, forget.

use idem_runner::once;

use super::{Format, OnceCommand, StoreArgs, runner_error};
use crate::error::Error;
use crate::ledger::{Ledger, on_ledger};

/// Runs a subcommand; returns the exit status.
pub(super) async fn run(command: OnceCommand) -> Result<i32, Error> {
    match command {
        OnceCommand::Status { name, store, format, limit } => status(&name, &store, format, limit).await,
        OnceCommand::Forget { name, store } => forget(&name, &store).await,
        OnceCommand::Pause { name, store, until, note } => pause(&name, &store, until, note).await,
        OnceCommand::Resume { name, store } => resume(&name, &store).await,
        OnceCommand::Trigger { name, store, id } => trigger(&name, &store, id).await,
        OnceCommand::List { store, format } => list(&store, format).await,
        OnceCommand::Backfill { name, store, from, to } => backfill(&name, &store, &from, &to).await,
    }
}

/// Writes `--metrics-file` (best effort: a failure is a warning, the exit status stays the invocation's).
pub(super) async fn write_metrics(ledger: &Ledger, name: &str, code: i32, path: &std::path::Path) {
    let result = on_ledger!(ledger, s => once::history(s, name, idem_core::slot::HISTORY).await);
    let now_ms = idem_store::system_time_to_millis(std::time::SystemTime::now());
    let text = match result {
        Ok(Some(history)) => once::prometheus(&history, code, now_ms),
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %idem_store::error_chain(&e), "--metrics-file: the job's state could not be read");
            return write_invocation_only(name, code, path);
        }
    };
    write_file(&text, path);
}

/// Writes `--metrics-file` for an invocation that could not read the job's state (the store unavailable):
/// the file's other series stay as they were, its exit code and time are this invocation's
/// ([`once::invocation_only`]).
pub(super) fn write_invocation_only(name: &str, code: i32, path: &std::path::Path) {
    let previous = std::fs::read_to_string(path).ok();
    let now_ms = idem_store::system_time_to_millis(std::time::SystemTime::now());
    write_file(&once::invocation_only(previous.as_deref(), name, code, now_ms), path);
}

fn write_file(text: &str, path: &std::path::Path) {
    use std::io::Write as _;
    // Only a regular file (or none) is replaced: a device (`/dev/null`, as root), a directory or a FIFO named
    // by mistake is left as it is. A symbolic link is followed: its target is replaced, the link stays.
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    if let Ok(meta) = std::fs::metadata(&target)
        && !meta.is_file()
    {
        tracing::warn!(path = %path.display(), "--metrics-file not written: not a regular file");
        return;
    }
    // A file beside it (new: never one already there, nor a link placed there), then renamed over it: the
    // collector never reads half a file.
    let tmp = target.with_extension(format!("tmp.{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(path = %path.display(), error = %e, "--metrics-file not written");
    }
}

async fn backfill(name: &str, store: &StoreArgs, from: &str, to: &str) -> Result<i32, Error> {
    once::check_name(name).map_err(runner_error)?;
    let now_ms = idem_store::system_time_to_millis(std::time::SystemTime::now());
    let parse = |flag, value| once::parse_time(flag, value, now_ms, true).map_err(runner_error);
    let (from_ms, to_ms) = (parse("--from", from)?, parse("--to", to)?);
    let ledger = store.open_existing(name).await?;
    let who = once::who();
    let result = on_ledger!(&ledger, s => once::backfill(s, name, from_ms, to_ms, &who).await);
    ledger.close().await;
    let Some(b) = result.map_err(runner_error)? else { return Err(store.no_job(name)) };
    let mut text = match (b.requested.first(), b.requested.last()) {
        (Some(first), Some(last)) => format!(
            "job {name}: requested {} ({first} to {last}): the job's next invocations run them, oldest first, each once\n",
            crate::error::count(b.requested.len() as u64, "slot", "slots")
        ),
        _ => format!("job {name}: no slot requested\n"),
    };
    let mut why: Vec<(&str, usize)> = Vec::new();
    for (_, w) in &b.not_requested {
        match why.iter_mut().find(|(x, _)| x == w) {
            Some((_, n)) => *n += 1,
            None => why.push((w, 1)),
        }
    }
    for (w, n) in why {
        text.push_str(&format!("job {name}: not requested: {} {w}\n", crate::error::count(n as u64, "slot", "slots")));
    }
    if let Some(newest) = &b.clamped_to {
        text.push_str(&format!(
            "job {name}: --to is after the job's newest slot {newest}: later slots are its invocations'\n"
        ));
    }
    crate::error::out(&text)?;
    Ok(0)
}

async fn status(name: &str, store: &StoreArgs, format: Format, limit: usize) -> Result<i32, Error> {
    once::check_name(name).map_err(runner_error)?;
    let ledger = store.open_existing(name).await?;
    let result = on_ledger!(&ledger, s => once::history(s, name, limit).await);
    ledger.close().await;
    let Some(history) = result.map_err(runner_error)? else {
        return Err(store.no_job(name));
    };
    match format {
        Format::Text => crate::error::out(&history.render())?,
        Format::Json => {
            crate::error::out(&format!("{}\n", serde_json::to_string_pretty(&history).unwrap_or_default()))?
        }
    }
    Ok(0)
}

async fn pause(name: &str, store: &StoreArgs, until: Option<String>, note: Option<String>) -> Result<i32, Error> {
    once::check_name(name).map_err(runner_error)?;
    let now_ms = idem_store::system_time_to_millis(std::time::SystemTime::now());
    let until_ms =
        until.as_deref().map(|u| once::parse_time("--until", u, now_ms, false)).transpose().map_err(runner_error)?;
    let ledger = store.open_existing(name).await?;
    let who = once::who();
    let result = on_ledger!(&ledger, s => async {
        // A duration counts from the store's now, read once the store answered (a store slow to answer, or
        // locked for a while, must not turn a valid `--until 3s` into a time already past).
        let store_now = idem_runner::once::store_millis(s).await?;
        let until_ms = match until.as_deref() {
            Some(u) => Some(once::parse_time("--until", u, store_now, false)?),
            None => until_ms,
        };
        once::pause(s, name, until_ms, note.clone(), &who).await
    }.await);
    ledger.close().await;
    let Some(p) = result.map_err(runner_error)? else { return Err(store.no_job(name)) };
    let view = once::PauseView::new(&p, p.since_ms);
    crate::error::out(&format!("job {name}: {}\n", view.describe()))?;
    Ok(0)
}

async fn resume(name: &str, store: &StoreArgs) -> Result<i32, Error> {
    use idem_store::Store as _;
    once::check_name(name).map_err(runner_error)?;
    let ledger = store.open_existing(name).await?;
    let who = once::who();
    let result = on_ledger!(&ledger, s => async {
        if s.get(&idem_core::slot::job_key(name)).await?.is_none() {
            return Ok(None);
        }
        once::resume(s, name, &who).await.map(Some)
    }.await);
    ledger.close().await;
    match result.map_err(runner_error)? {
        None => Err(store.no_job(name)),
        Some(None) => {
            crate::error::out(&format!("job {name} is not paused; nothing to resume\n"))?;
            Ok(0)
        }
        Some(Some(_)) => {
            crate::error::out(&format!("job {name} resumed: its next invocation runs its slot\n"))?;
            Ok(0)
        }
    }
}

async fn trigger(name: &str, store: &StoreArgs, id: Option<String>) -> Result<i32, Error> {
    once::check_name(name).map_err(runner_error)?;
    let ledger = store.open_existing(name).await?;
    let who = once::who();
    let result = on_ledger!(&ledger, s => once::trigger(s, name, id.as_deref(), &who).await);
    ledger.close().await;
    let Some(t) = result.map_err(runner_error)? else { return Err(store.no_job(name)) };
    let what = if t.new {
        "requested: the job's next invocation runs it once".to_owned()
    } else {
        format!("requested already (now {}): nothing more requested", t.state)
    };
    crate::error::out(&format!("{}\n", t.id))?;
    let line = format!("idem once: {name} trigger {}: {what}\n", t.id);
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    Ok(0)
}

async fn list(store: &StoreArgs, format: Format) -> Result<i32, Error> {
    let ledger = store.open_existing("*").await?;
    let result = on_ledger!(&ledger, s => once::list(s).await);
    ledger.close().await;
    let jobs = result.map_err(runner_error)?;
    match format {
        Format::Text => crate::error::out(&once::render_list(&jobs))?,
        Format::Json => crate::error::out(&format!("{}\n", serde_json::to_string_pretty(&jobs).unwrap_or_default()))?,
    }
    Ok(0)
}

async fn forget(name: &str, store: &StoreArgs) -> Result<i32, Error> {
    once::check_name(name).map_err(runner_error)?;
    let ledger = store.open_existing(name).await?;
    let result = on_ledger!(&ledger, s => once::forget(s, name).await);
    ledger.close().await;
    match result.map_err(runner_error)? {
        0 => Err(store.no_job(name)),
        n => {
            let records = crate::error::count(n, "record", "records");
            crate::error::out(&format!("forgot job {name} ({records}); its next invocation starts afresh\n"))?;
            Ok(0)
        }
    }
}
