//! A run's job before its items: where its ledger lives unless told, the files it writes, and its record in
//! the ledger (its outputs claimed on this host, what changed since its last run). The binary parses flags,
//! calls these and prints what they return.

use std::path::PathBuf;

use idem_store::Store;

use crate::admin::{JobRecord, claim_outputs, note_job};
use crate::config::{RunConfig, default_ledger_path};
use crate::error::Error;

/// The URL of a run's ledger store: `store` when one was given, else the SQLite file next to the outputs of
/// the template `output` ([`default_ledger_path`]; `./.idem/ledger.db` for a job without outputs).
pub fn ledger_url(store: Option<&str>, output: &str) -> String {
    match store {
        Some(u) => u.to_owned(),
        None => format!("sqlite:{}", default_ledger_path(output).display()),
    }
}

/// What to tell the operator of named job `name` on the default ledger whose `--output` was added (or
/// moved): that ledger is next to the outputs, so a new one is started and every item runs again. Said when
/// this directory's own default ledger (runs without `--output`), where such a job's entries would be, is
/// there; `None` otherwise.
pub fn new_default_ledger_notice(name: &str, output: &str) -> Option<String> {
    if output.is_empty() {
        return None;
    }
    let (chosen, plain) = (default_ledger_path(output), default_ledger_path(""));
    (!chosen.exists() && plain.exists() && chosen != plain).then(|| {
        format!(
            "job {name}: a new ledger at {} (the default, next to --output); the ledger at {} (this directory's, \
             for runs without --output) is not read, so items done there run again; give --store sqlite:{} to \
             go on with it",
            chosen.display(),
            plain.display(),
            plain.display()
        )
    })
}

/// The output template made absolute in the current directory (`./` components dropped, as
/// [`job_id`](crate::job_id) normalises them), which with the host names the files a job writes; empty
/// without `--output`.
pub fn absolute_template(output: &str) -> String {
    if output.is_empty() {
        return String::new();
    }
    let path = std::env::current_dir().unwrap_or_default().join(output);
    let normal: PathBuf = path.components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect();
    normal.display().to_string()
}

/// Enters the job of `cfg` in the ledger `store` before its items run: a named job claims its outputs on this
/// host ([`claim_outputs`]: an unnamed job is named by its template, so it never meets another over one set
/// of files), and the job's record is written ([`note_job`]; neither is written in a dry run). Returns what
/// changed since the job's last run, one sentence each.
///
/// # Errors
/// [`Error::OutputsOfAnother`] when another job still has this job's files on this host (nothing may run);
/// [`Error::Store`].
pub async fn admit<S: Store>(store: &S, cfg: &RunConfig) -> Result<Vec<String>, Error> {
    let job = cfg.job();
    let output_path = absolute_template(&cfg.output);
    if cfg.name.is_some()
        && let Some(other) = claim_outputs(store, &job, &output_path, cfg.dry_run).await?
    {
        return Err(Error::OutputsOfAnother { job, other, output_path });
    }
    let record =
        JobRecord { output: cfg.output.clone(), command: cfg.command.clone(), output_path, ..JobRecord::default() };
    note_job(store, &job, &record, cfg.dry_run).await
}

#[cfg(test)]
mod tests {
    use idem_store::MemoryStore;

    use super::*;

    fn named(name: &str, output: &str) -> RunConfig {
        let mut cfg = RunConfig::new("items", output, vec!["true".into()]);
        cfg.name = Some(name.to_owned());
        cfg
    }

    /// Two named jobs with one output template in one directory: the second is refused while the first's
    /// record still names those files; an unnamed job never is; a changed command is said on the next run.
    #[tokio::test]
    async fn a_named_job_is_refused_the_outputs_another_job_writes_here() {
        let store = MemoryStore::new();
        assert_eq!(admit(&store, &named("a", "out/{id}.json")).await.expect("first"), Vec::<String>::new());
        match admit(&store, &named("b", "out/{id}.json")).await {
            Err(Error::OutputsOfAnother { job, other, output_path }) => {
                assert_eq!((job.as_str(), other.as_str()), ("b", "a"));
                assert_eq!(output_path, absolute_template("out/{id}.json"));
            }
            other => panic!("{other:?}"),
        }
        assert!(admit(&store, &RunConfig::new("items", "out/{id}.json", vec!["true".into()])).await.is_ok());
        let mut changed = named("a", "out/{id}.json");
        changed.command = vec!["false".into()];
        let said = admit(&store, &changed).await.expect("same job again");
        assert_eq!(said.len(), 1, "{said:?}");
    }

    #[test]
    fn the_default_ledger_is_next_to_the_outputs() {
        assert_eq!(ledger_url(None, "out/{id}.json"), "sqlite:out/.idem/ledger.db");
        assert_eq!(ledger_url(None, ""), "sqlite:./.idem/ledger.db");
        assert_eq!(ledger_url(Some("redis://h"), "out/{id}.json"), "redis://h");
        assert_eq!(absolute_template(""), "");
        assert!(absolute_template("./out/{id}.json").ends_with("/out/{id}.json"));
    }
}
