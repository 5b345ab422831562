//! `idem run` (the idempotent work runner) and `idem runs status|forget` (its ledger).

use std::path::PathBuf;
use std::time::Duration;

use idem_runner::{ItemFormat, OnPoison, ProgressMode, QueueUrl, RunConfig, Stop};
use idem_store::Store;

use crate::error::Error;
use crate::ledger::{Ledger, on_ledger};

const RUN_AFTER_HELP: &str = "\
Placeholders in COMMAND: {id} the item's id, {out} the temporary file to write (renamed into place once \
verified; needs --output), {key} the item's idempotency key, {item} the item as read; in --check: {id}, {key}. \
Any other {word} (letters, digits, '_'; none too, as {}) is refused (exit 2); ${VAR} is left to the shell, and so is \
anything else in braces ('{print $1}', '{a: .b}'). For a literal {word} or {}, double its braces: {{}} passes {}, \
{{id}} passes {id}, awk '{{print}}' runs awk '{print}'. The \
item is also on standard input, and in the environment: IDEM_ITEM_ID, IDEM_OUTPUT (= {out}; empty without --output), \
IDEM_KEY (= {key}), IDEM_FENCING_TOKEN (grows with every new holder), IDEM_IDEMPOTENCY_KEY \
(PREFIX:ID:HASH: PREFIX is --key-prefix, else the job's --name, so it equals IDEM_KEY, else `run`), IDEM_ATTEMPT.

{key} / IDEM_KEY is JOB:ID:HASH: the job's name (--name, else the 12-hex-digit hash of --output), the item's \
id, and the first 16 hex digits of the SHA-256 of the item's canonical text (as `idem key` derives it). It is \
the same for every attempt, in every process and on every machine: a sink that dedupes on it (`idem send \
--key \"$IDEM_KEY\"` behind `idem serve --upstream`, a unique column) sees one effect per item even when a \
runner dies after the effect and before the ledger records it, the one window in which an item runs again.

Without --output an item is done once its command exited 0 and the ledger recorded it; no file is looked at. \
The ledger is a SQLite file next to the outputs (<output root>/.idem/ledger.db; without --output, \
./.idem/ledger.db) unless --store names another store; several runners on one PostgreSQL or Redis store (or one \
SQLite file on one machine) share the work.

From a queue each message is an item (its id: --id-field, else the message id, else what a line of the same \
text gets: a safe plain body is its own id, anything else a short hash); it is acknowledged once its output is durable and the ledger says done, rejected without requeue (to the \
dead-letter exchange; JetStream: terminated) when poison or out of attempts, handed back when the run stops \
first. --until-empty exits once the queue is drained; otherwise the run waits for more and reconnects.

Ctrl-C once: stop claiming, let running items finish. Twice, SIGTERM or SIGHUP (a closed terminal; not under \
nohup): kill the commands, release leases.

Attempts are counted across runs: an item out of attempts runs again when a rerun raises --retries, or after \
`idem runs forget --output … ID…` starts its count afresh; the summary names such items and both commands. A \
poison item runs again only after `idem runs forget`; a rerun skips it, runs the rest and exits 3.

Exit status:
  0    every item is done
  1    some items are not done: they failed every attempt (see --report), or the ledger failed
  2    bad usage: nothing ran, no ledger made (bad flags, malformed items, two items with one output path, a
       queue that cannot be consumed); or, reading a pipe, such an item came: the items before it ran
  3    a poison item (the same error on two attempts --retry-delay apart, unless it looks transient: exit 75,
       or a last stderr line such as 'Connection refused', 'timed out', '503'; those only spend retries): one
       that turned poison in this run halted it (or was skipped, with --on-poison skip), or one found poison
       by an earlier run was skipped while the rest ran
  75   the ledger store was unavailable for longer than --store-outage-limit: the items not finished are not
       done (none failed for it); run again once the store is back (EX_TEMPFAIL)
  130  interrupted before every item was done";

/// Arguments of `idem run`.
#[derive(Debug, clap::Args)]
#[command(after_help = RUN_AFTER_HELP)]
pub struct RunArgs {
    /// The work items: a file of JSON Lines or plain lines; `-` (standard input), a pipe or a FIFO, read once
    /// as they come; or a queue, one item per message: amqp://USER:PASS@HOST:PORT/VHOST?queue=NAME (RabbitMQ)
    /// or nats://HOST:PORT?stream=S&consumer=C (a JetStream durable pull consumer).
    #[arg(long)]
    items: String,
    /// With a queue: exit once it is drained (for cron), instead of running as a service that waits for more.
    #[arg(long)]
    until_empty: bool,
    /// The job's name in the ledger (as `idem once --name`: 1 to 100 letters, digits, '.', '_', '-'): two jobs with different names
    /// never share ledger entries, whatever their outputs. Default: a hash of --output, the name jobs had
    /// before names could be given, so their ledgers keep working. A rerun under one name whose --output or
    /// command changed says so.
    #[arg(long)]
    name: Option<String>,
    /// Where each item's output goes; must contain {id}. A `.json` output must parse as JSON. Without it the
    /// command's effect is elsewhere (an email, an API call, a row): an item is done once its command exited 0
    /// and the ledger recorded it, and no file is looked at; dedupe at the sink on {key} / IDEM_KEY.
    #[arg(long)]
    output: Option<String>,
    /// Commands running at once. Items start in input order (with 1, one after another in it), as GNU
    /// parallel's do; a retry keeps its item's place.
    #[arg(long, short = 'j', default_value_t = 1)]
    jobs: usize,
    /// The ledger store: sqlite:PATH, postgres://…, redis://…, rediss://…, redis+sentinel://…, redis+cluster://… or memory: (default: next to the outputs).
    #[arg(long, env = "IDEM_RUN_STORE")]
    store: Option<String>,
    /// PostgreSQL schema / Redis key prefix of the ledger.
    #[arg(long, env = "IDEM_NAMESPACE", default_value = "idem")]
    namespace: String,
    /// Retries after the first attempt: an item gets at most N+1 attempts in all, counted across runs (a
    /// crashed runner's too), so a rerun with a higher N gives items out of attempts more.
    #[arg(long, value_name = "N", default_value_t = 3)]
    retries: u32,
    /// Pause before an item's first retry (e.g. 500ms, 1s, 1m; 0: at once), doubled for each later one up to 5
    /// minutes (or this, when longer), each drawn between all of it and half again (never shorter), as
    /// Airflow's retry_delay with retry_exponential_backoff: a failure (a sink restarting, a 503) is not met
    /// again within milliseconds, and two attempts that make an item poison are at least this far apart (a
    /// rerun right after a failure waits out the rest). The item keeps its slot meanwhile.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "1s")]
    retry_delay: Duration,
    /// What an item that turns poison in this run (same error fingerprint twice) does: halt the run (nothing new
    /// starts; a rerun skips it and does the rest), or skip it. Poison items from earlier runs are always skipped.
    #[arg(long, value_enum, default_value_t = PoisonArg::Halt)]
    on_poison: PoisonArg,
    /// Top-level fields a JSON output must have, comma-separated.
    #[arg(long, value_delimiter = ',')]
    expect_fields: Vec<String>,
    /// Shell command that must exit 0 for an output to count ({out} or $IDEM_OUTPUT names the file).
    #[arg(long)]
    verify: Option<String>,
    /// Without --output: a shell command that exits 0 when an item's effect is there (a row in a table, an
    /// object in a bucket); run before the command (exit 0: the command is skipped, the item recorded done) and
    /// after it (the command's success counts only if it passes then). {id}, {key}, $IDEM_ITEM_ID and $IDEM_KEY
    /// name the item.
    #[arg(long, value_name = "CMD")]
    check: Option<String>,
    /// Write a JSON report (per item: status, attempts, last error, output digest, duration).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Longest one attempt may run (e.g. 30s, 5m); the command is then killed and the attempt fails.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Lease length; renewed every third of it while a command runs. At least 1s.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    lease: Duration,
    /// How long the ledger store may stay unavailable (down, restarting, locked, full) before the run gives up
    /// with exit status 75. Until then nothing new is claimed, running commands go on while their leases last
    /// (then wait, stopped, for the store), and finished items are recorded once it is back. At least 1s.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "5m")]
    store_outage_limit: Duration,
    /// JSON field holding each item's id (default: a short hash of the canonical item).
    #[arg(long)]
    id_field: Option<String>,
    /// How to read --items.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
    /// Prefix of IDEM_IDEMPOTENCY_KEY. Default: the job's name with --name (IDEM_IDEMPOTENCY_KEY is then
    /// IDEM_KEY), else `run`.
    #[arg(long)]
    key_prefix: Option<String>,
    /// Judge every done item by its output on this machine, even one another host recorded done (each machine
    /// needs its own copy). Without it, with a shared --store, an item another host recorded done is skipped
    /// and counted "done elsewhere (HOST)": its output is on that host, which alone verifies it. The host is
    /// IDEM_HOST when set, else the machine's host name.
    #[arg(long)]
    require_local_output: bool,
    /// List what would run and why; run nothing. Refused for a queue (taking messages changes it).
    #[arg(long)]
    dry_run: bool,
    /// No progress display (the summary is still printed).
    #[arg(long)]
    quiet: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PoisonArg {
    Halt,
    Skip,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum FormatArg {
    Auto,
    Jsonl,
    Lines,
}

/// Arguments of `idem runs`.
#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    #[command(subcommand)]
    command: RunsCommand,
}

#[derive(Debug, clap::Subcommand)]
enum RunsCommand {
    /// Summarise the ledger of the job named by --name (or writing --output). Exit status 3 when the store has
    /// no such job (nothing is created).
    Status {
        #[command(flatten)]
        ledger: LedgerArgs,
        /// `text` (lines for people) or `json` (one object: job, done, done_by_host, running, interrupted,
        /// failed, poison, problems as [{id, error}]).
        #[arg(long, value_enum, default_value_t = StatusFormat::Text)]
        format: StatusFormat,
    },
    /// Forget items so the next run executes them again: their ledger entries, and their outputs under --output
    /// (only then: without it no file is deleted). Exit status 3 when the store has no such job, or an id is not
    /// in the job's ledger (the others are forgotten).
    Forget {
        #[command(flatten)]
        ledger: LedgerArgs,
        /// Item ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StatusFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("job").required(true).multiple(true).args(["name", "output"])))]
struct LedgerArgs {
    /// The job's name, as given to `idem run --name`.
    #[arg(long)]
    name: Option<String>,
    /// The job's output template, as given to `idem run` (it names the job when --name does not, and the
    /// default ledger; `forget` removes the forgotten items' outputs from it, and deletes none without it).
    #[arg(long)]
    output: Option<String>,
    /// The ledger store (default: next to the outputs).
    #[arg(long, env = "IDEM_RUN_STORE")]
    store: Option<String>,
    /// PostgreSQL schema / Redis key prefix of the ledger.
    #[arg(long, env = "IDEM_NAMESPACE", default_value = "idem")]
    namespace: String,
}

fn runner_error(e: idem_runner::Error) -> Error {
    match e {
        idem_runner::Error::Config(_)
        | idem_runner::Error::BadItem { .. }
        | idem_runner::Error::DuplicateOutput { .. }
        | idem_runner::Error::OutputsOfAnother { .. }
        | idem_runner::Error::ReadItems { .. }
        | idem_runner::Error::Queue(_) => Error::Config(idem_store::error_chain(&e)),
        other => Error::Failed(idem_store::error_chain(&other)),
    }
}

/// Runs `idem run`; returns the exit status.
///
/// # Errors
/// Refusals before anything ran (exit status 2) and ledger failures.
pub async fn run(args: RunArgs) -> Result<i32, Error> {
    let queue = QueueUrl::parse(&args.items).map_err(runner_error)?;
    let output = args.output.unwrap_or_default();
    let mut cfg = RunConfig::new(PathBuf::from(&args.items), &output, args.command);
    cfg.name = args.name;
    cfg.queue = queue;
    cfg.until_empty = args.until_empty;
    cfg.jobs = args.jobs;
    cfg.retries = args.retries;
    cfg.retry_delay = args.retry_delay;
    cfg.on_poison = match args.on_poison {
        PoisonArg::Halt => OnPoison::Halt,
        PoisonArg::Skip => OnPoison::Skip,
    };
    cfg.expect_fields = args.expect_fields;
    cfg.verify = args.verify;
    cfg.check = args.check;
    cfg.report = args.report;
    cfg.timeout = args.timeout;
    cfg.lease = args.lease;
    cfg.store_outage_limit = args.store_outage_limit;
    cfg.id_field = args.id_field;
    cfg.format = match args.format {
        FormatArg::Auto => ItemFormat::Auto,
        FormatArg::Jsonl => ItemFormat::JsonLines,
        FormatArg::Lines => ItemFormat::Lines,
    };
    cfg.key_prefix = args.key_prefix;
    cfg.dry_run = args.dry_run;
    cfg.require_local_output = args.require_local_output;
    cfg.progress = if args.quiet { ProgressMode::Off } else { ProgressMode::Auto };
    // Everything that can refuse the run (flags, the command, every item) is checked before the ledger is opened:
    // a refused run must leave no ledger, which `idem runs status` would report as a run with nothing in it.
    let mut checked = tokio::task::block_in_place(|| cfg.checked()).map_err(runner_error)?;
    // So is the queue: a broker that cannot be reached, refuses the login or lacks the queue refuses the run
    // here, and the run consumes on this connection.
    checked.connect().await.map_err(runner_error)?;
    // A store that is down or unreachable when the run starts is waited for as one met later would be: a
    // runner started during an outage (or together with its store) must not fail where one started a moment
    // earlier rides it out.
    let url = idem_runner::ledger_url(args.store.as_deref(), &output);
    if args.store.is_none()
        && let Some(name) = &checked.config().name
        && let Some(notice) = idem_runner::new_default_ledger_notice(name, &output)
    {
        crate::error::sayln!("idem run: {notice}");
    }
    let Some(ledger) = Ledger::open_within(&url, &args.namespace, checked.config().store_outage_limit).await? else {
        crate::error::sayln!(
            "idem run: the ledger store was unavailable for longer than --store-outage-limit ({}): nothing ran; \
             run again once it is back",
            humantime::format_duration(checked.config().store_outage_limit)
        );
        return Ok(idem_runner::RunStatus::StoreUnavailable.exit_code());
    };
    // Only for the refusal and the warnings: a store that does not answer at once (down at the start, which the
    // run rides out) must neither stop nor delay the run, so they are skipped then.
    let admitted = tokio::time::timeout(Duration::from_secs(2), async {
        on_ledger!(&ledger, s => idem_runner::admit(s, checked.config()).await)
    })
    .await;
    match admitted {
        Ok(Ok(changes)) => changes.iter().for_each(|change| crate::error::sayln!("idem run: {change}")),
        Ok(Err(e @ idem_runner::Error::OutputsOfAnother { .. })) => {
            ledger.close().await;
            return Err(runner_error(e));
        }
        Ok(Err(e)) => tracing::debug!("the job's record was not read or written: {}", idem_store::error_chain(&e)),
        Err(_) => tracing::debug!("the job's record was not read or written: the store did not answer in 2s"),
    }
    let stop = Stop::new();
    let signals = tokio::spawn(watch_signals(&stop));
    let result = match &ledger {
        Ledger::Sqlite(s) => idem_runner::run_checked(s.clone(), checked, stop).await,
        Ledger::Other(s) => idem_runner::run_checked(s.clone(), checked, stop).await,
    };
    signals.abort();
    if result.as_ref().is_ok_and(|s| s.store_unavailable) {
        // The store stayed unavailable past the limit: closing it (a Redis connection's last commands, a
        // SQLite checkpoint behind another connection's lock) would wait out the client's own timeout for
        // nothing, as every write the run depends on was answered or given up already.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), ledger.close()).await;
    } else {
        ledger.close().await;
    }
    let summary = result.map_err(runner_error)?;
    if let Some(why) = &summary.refused {
        crate::error::sayln!("idem: {why}");
    }
    crate::error::say(&summary.render());
    Ok(summary.status().exit_code())
}

/// First Ctrl-C: drain; second Ctrl-C, SIGTERM or SIGHUP (a closed terminal; not under `nohup`): abort. The handlers are installed by this call, before the
/// run starts; the returned watch turns signals into requests.
fn watch_signals(stop: &Stop) -> impl std::future::Future<Output = ()> + use<> {
    // Without handlers the default actions stay: SIGINT and SIGTERM end the process (and the commands in its
    // group) at once, leaving their leases to lapse.
    let watch = stop.on_signals(idem_store::stop::Sigterm::Aborts, |level| {
        if level == idem_store::stop::DRAIN {
            crate::error::sayln!("idem run: stopping: no new items; running ones finish (Ctrl-C again to kill them)");
        } else {
            crate::error::sayln!("idem run: killing running commands and releasing their leases");
        }
    });
    async move {
        if let Ok(watch) = watch {
            watch.await;
        }
    }
}

/// Runs `idem runs …`; returns the exit status.
///
/// # Errors
/// The store cannot be opened or read.
pub async fn runs(args: RunsArgs) -> Result<i32, Error> {
    let ledger_args = match &args.command {
        RunsCommand::Status { ledger: l, .. } | RunsCommand::Forget { ledger: l, .. } => l,
    };
    if let Some(name) = &ledger_args.name {
        idem_runner::check_job_name(name).map_err(runner_error)?;
    }
    let template = ledger_args.output.as_deref().unwrap_or("");
    let url = idem_runner::ledger_url(ledger_args.store.as_deref(), template);
    let job = match &ledger_args.name {
        Some(name) => name.clone(),
        None => idem_runner::job_id(template),
    };
    // Status and forget only read what runs wrote: a missing ledger (a SQLite file, a PostgreSQL schema) or a
    // job it does not know means nothing ran with these flags (a typo, say), which must be said (exit 3, as
    // `idem once status`) rather than answered with zeros from a store made for it.
    let of_job = || match &ledger_args.name {
        Some(name) => format!("job {name}"),
        None => format!("--output {template:?}"),
    };
    if let Ok(idem_backends::StoreUrl::Sqlite(path)) = idem_backends::StoreUrl::parse(&url)
        && !path.exists()
    {
        let elsewhere = if ledger_args.store.is_none() { " (or its ledger is elsewhere: --store)" } else { "" };
        return Err(Error::NotFound(format!(
            "no ledger at {}: nothing has run with {}{elsewhere}",
            path.display(),
            of_job()
        )));
    }
    let no_job = || {
        let namespace = match idem_backends::StoreUrl::parse(&url) {
            Ok(idem_backends::StoreUrl::Sqlite(_)) => String::new(),
            _ => format!(" (namespace {})", ledger_args.namespace),
        };
        Error::NotFound(format!("no {} in {}{namespace}", of_job(), idem_core::redact_url(&url)))
    };
    let Some(ledger) = Ledger::open_existing(&url, &ledger_args.namespace).await? else {
        return Err(no_job());
    };
    match on_ledger!(&ledger, s => idem_runner::job_exists(s, &job).await) {
        Ok(true) => {}
        Ok(false) => {
            ledger.close().await;
            return Err(no_job());
        }
        Err(e) => {
            ledger.close().await;
            return Err(runner_error(e));
        }
    }
    let result = match &args.command {
        RunsCommand::Status { format, .. } => status(&ledger, &job, *format).await,
        RunsCommand::Forget { ids, .. } => {
            forget(&ledger, &job, ledger_args.name.is_some(), ledger_args.output.as_deref(), ids).await
        }
    };
    ledger.close().await;
    result
}

async fn on<S: Store + Clone>(store: &S, job: &str) -> Result<idem_runner::LedgerStatus, Error> {
    idem_runner::status(store, job).await.map_err(runner_error)
}

async fn status(ledger: &Ledger, job: &str, format: StatusFormat) -> Result<i32, Error> {
    let st = match ledger {
        Ledger::Sqlite(s) => on(s, job).await?,
        Ledger::Other(s) => on(s, job).await?,
    };
    if let StatusFormat::Json = format {
        let problems: Vec<_> =
            st.problems.iter().map(|(id, error)| serde_json::json!({ "id": id, "error": error })).collect();
        let json = serde_json::json!({
            "job": job,
            "done": st.done,
            "done_by_host": st.done_by_host,
            "running": st.running,
            "interrupted": st.interrupted,
            "failed": st.failed,
            "poison": st.poison,
            "problems": problems,
        });
        crate::error::out(&format!("{}\n", serde_json::to_string_pretty(&json).unwrap_or_default()))?;
        return Ok(0);
    }
    let mut text = format!(
        "job {job}: {} done, {} running or abandoned, {} failed, {} poison, {} interrupted\n",
        st.done, st.running, st.failed, st.poison, st.interrupted
    );
    let mut hosts: Vec<_> = st.done_by_host.iter().collect();
    hosts.sort_by(|a, b| idem_runner::natural_cmp(a.0, b.0));
    for (host, n) in hosts {
        if host == "adopted" {
            // Outputs found in place without running: their entries name no host.
            text.push_str(&format!("adopted (found in place; no host recorded): {n}\n"));
        } else {
            text.push_str(&format!("done on {host}: {n}\n"));
        }
    }
    for (id, error) in &st.problems {
        text.push_str(&format!("{id}\t{error}\n"));
    }
    crate::error::out(&text)?;
    Ok(0)
}

async fn forget(ledger: &Ledger, job: &str, named: bool, output: Option<&str>, ids: &[String]) -> Result<i32, Error> {
    // Outputs are removed only from the --output given here. The job's recorded template is only read to say
    // what was kept: it may be relative to another directory (or machine), and resolved against this one it
    // names some other file, which must never be deleted.
    let recorded = match output {
        Some(_) => None,
        None => on_ledger!(ledger, s => idem_runner::job_record(s, job).await).map_err(runner_error)?,
    };
    let unknown = on_ledger!(ledger, s => idem_runner::forget(s, job, output, ids).await).map_err(runner_error)?;
    let given = ids.iter().collect::<std::collections::HashSet<_>>().len();
    let forgotten = given - unknown.len();
    if forgotten > 0 {
        // What the next run does depends on what was deleted: with outputs kept, it adopts each one it finds
        // (and runs only the items whose output is gone), so "executes them again" is said only when true.
        let again = "the next run executes them again".to_owned();
        let (what, next) = match (output.filter(|o| !o.is_empty()), recorded.as_ref().map(|r| r.output.as_str())) {
            (Some(_), _) => ("entries and outputs".to_owned(), again),
            (None, Some(t)) if !t.is_empty() => (
                "ledger entries only; no output deleted".to_owned(),
                format!(
                    "the next run adopts each output it finds in place and executes only the items whose output is \
                     gone (give --output {t:?} here, where the job runs, to delete the outputs and execute them all \
                     again)"
                ),
            ),
            (None, Some(_)) => ("ledger entries; the job writes no outputs".to_owned(), again),
            (None, None) => (
                "ledger entries only; no output deleted".to_owned(),
                "the next run adopts each output it finds in place and executes the others again (give --output to \
                 delete the outputs too)"
                    .to_owned(),
            ),
        };
        let given = crate::error::count(given, "item", "items");
        crate::error::out(&format!("forgot {forgotten} of {given} ({what}); {next}\n"))?;
    }
    if !unknown.is_empty() {
        // A typo in an id or in --output (another job's ledger) must not pass for done: say which, exit 3.
        let (these, them) = if unknown.len() == 1 { ("id", "it") } else { ("ids", "them") };
        let (of, flag) = match (named, output) {
            (false, Some(output)) => (format!("--output {output:?}"), "--output"),
            _ => (format!("job {job}"), "--name"),
        };
        return Err(Error::NotFound(format!(
            "{these} {} in the ledger of {of} (nothing done for {them}); check the {these} (as the run's summary or \
             --report gives {them}) and {flag}",
            unknown.join(", ")
        )));
    }
    Ok(0)
}
