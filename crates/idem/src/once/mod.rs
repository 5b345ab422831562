//! `idem once` (each scheduled slot of a cron job runs once across machines) and `idem once status|forget`.

use std::time::Duration;

use idem_backends::StoreUrl;
use idem_runner::once::{self, OnceConfig, Schedule};

use crate::error::Error;
use crate::ledger::{Ledger, on_ledger};

mod control;

const ONCE_AFTER_HELP: &str = "\
Run it from cron or a timer on every machine, as often as you like (every minute for a daily job runs a slot \
missed while every machine was down as soon as one is back): the slot is the latest scheduled time at or before \
now by the store's clock, and only the first invocation in a slot runs the command. The command gets IDEM_NAME, \
IDEM_SLOT (the slot's time, RFC 3339), IDEM_ATTEMPT and IDEM_FENCING_TOKEN; its output is passed through and its \
last lines kept for `idem once status`.

Exit status:
  0    the slot is done: ran now, or ran already (here or elsewhere; the message says where and when); also held
       by another invocation, or an earlier slot running with --no-overlap (without --fail-if-held)
  1    the command ran here and failed; the next invocation in this slot retries it (attempts remain)
  2    nothing ran: bad usage, a schedule other than the one the job is recorded with, a store that cannot be
       opened (a bad URL, a refused login or TLS handshake) or failed before the claim
  3    the slot failed for good: every attempt allowed (--retries + 1) failed; nothing more runs in it
  4    the slot is missed: not started within --starting-deadline (recorded now or before), or behind: older
       than the newest slot the job has seen (this clock is behind the one that saw it); nothing ran
  5    with --fail-if-held: another invocation holds the slot (or, with --no-overlap, an earlier one runs)
  6    the lease was lost while the command ran (this invocation was paused past it and the slot taken over, or
       the store did not answer for a whole lease), or before it started (it was not started), or the store
       failed on every try of the outcome write for 60s (or --lease if longer): its outcome is not recorded
  75   nothing ran: the store is down or unreachable (connection refused or reset, no answer in time, a server
       starting or shutting down), at the start or before the claim; not waited for: the next invocation tries
       again (EX_TEMPFAIL, as `idem run` exits when its store stays unavailable)
  130  SIGINT, SIGTERM or SIGHUP: the command was killed; its attempt counts toward --retries (status: failed, ending
       interrupted). Under `timeout`, give --preserve-status to see 130: plain `timeout` exits 124
When the invocation also ran requested slots (a backfill's, a catch-up's) or triggered runs, the worst of
theirs wins over the slot's own 0, 1 or 3: 1 (one failed), 3 (one failed for good), 6, 130. A triggered run's
command gets IDEM_TRIGGER_ID (its id) and, as IDEM_SLOT, the time it was requested.";

/// Arguments of `idem once`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true, after_help = ONCE_AFTER_HELP)]
#[command(group(clap::ArgGroup::new("schedule").required(true).args(["every", "cron"])))]
pub struct OnceArgs {
    #[command(subcommand)]
    command: Option<OnceCommand>,
    /// The job's name: with the slot's time, the key of each run (letters, digits, '.', '_', '-').
    #[arg(long, required = true)]
    name: Option<String>,
    /// Slots every DURATION (whole seconds, 1s up to 366 days), aligned to the Unix epoch: --every 1h has a
    /// slot at each full hour UTC, --every 1w one each Thursday 00:00 UTC (1970-01-01 was a Thursday). Months
    /// and years are refused: a calendar schedule is --cron.
    #[arg(long, value_name = "DURATION")]
    every: Option<String>,
    /// Slots where a five-field cron expression matches (minute hour day-of-month month day-of-week; L, W, #,
    /// @daily…), Vixie cron's rules at daylight-saving changes.
    #[arg(long, value_name = "EXPR")]
    cron: Option<String>,
    /// The IANA time zone of --cron (default UTC, so every machine computes the same slots whatever its own
    /// zone). Refused with --every, whose slots are aligned to the Unix epoch.
    #[arg(long, value_name = "ZONE")]
    tz: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
    /// Retries after the first attempt, per slot, counted across invocations and machines (a crashed one's
    /// too): a failed slot is retried by the next invocation in the slot.
    #[arg(long, value_name = "N", default_value_t = 3)]
    retries: u32,
    /// Lease length; renewed every third of it while the command runs. A crashed holder's slot is taken over
    /// by the first invocation after it lapses. 1s to 365 days.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    lease: Duration,
    /// A slot not started within DURATION after its scheduled time is recorded missed instead of run (exit 4);
    /// Kubernetes' startingDeadlineSeconds (at most 366 days). Retries of a started slot are not bounded by it.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    starting_deadline: Option<Duration>,
    /// While an earlier slot of the job still runs: allow (run beside it; Kubernetes Allow), skip (do not
    /// start: exit as held, a later invocation in the slot starts it once the earlier run ended; Kubernetes
    /// Forbid), buffer-one (wait, holding only this slot's lease, until it ended, then run; a slot coming while
    /// one already waits is recorded skipped), buffer-all (every slot waits its turn, in slot order),
    /// cancel-other (the running slot's command is stopped on whatever machine runs it: SIGTERM, SIGKILL a lease
    /// later; recorded replaced; then this slot runs; Kubernetes Replace), terminate-other (the same with SIGKILL
    /// at once). Kept in the job record: another policy is refused (exit 2).
    #[arg(long, value_name = "POLICY", value_parser = parse_overlap, default_value = "allow")]
    overlap: once::Overlap,
    /// The same as --overlap skip.
    #[arg(long, conflicts_with = "overlap")]
    no_overlap: bool,
    /// Exit 5 instead of 0 when another invocation holds the slot (or an earlier one runs, with --overlap skip).
    #[arg(long)]
    fail_if_held: bool,
    /// Longest one attempt may run (e.g. 30m; at most 366 days): the command's process group is then killed,
    /// the attempt fails.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    timeout: Option<Duration>,
    /// Slots that passed unseen within DURATION before this invocation (no invocation reached the store: every
    /// machine down, the store down) are run, oldest first, before this slot, instead of being recorded missed
    /// (Temporal's catch-up window; at most 366 days, and the newest 100 slots of a gap). Without it they are
    /// recorded missed; `idem once backfill` runs them later.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    catchup_window: Option<Duration>,
    /// Start each slot up to DURATION after its time (and before the next slot): an offset every machine
    /// computes alike from --name and the slot, so jobs sharing a schedule spread out and each slot is still
    /// run once. The invocation waits for it.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    jitter: Option<Duration>,
    /// After the invocation, write the job's state to PATH in the Prometheus text format (atomically: a
    /// file beside it, then renamed), for node_exporter's textfile collector: last success time, newest slot
    /// and its state, slots missed, slots run more than once (must stay 0), paused, this exit status.
    #[arg(long, value_name = "PATH")]
    metrics_file: Option<std::path::PathBuf>,
    /// A message only for a change of state or trouble: a failed attempt, a slot recorded missed (by the
    /// invocation that records it), a lost lease, a clock behind the job's. Nothing on success, or when the
    /// slot is done, held, or found failed for good or missed already (cron mails any output; the exit
    /// status still says it).
    #[arg(long)]
    quiet: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command_line: Vec<String>,
}

/// Where the job's records are.
#[derive(Debug, Clone, clap::Args)]
struct StoreArgs {
    /// The store: sqlite:PATH (one machine; default: $XDG_STATE_HOME/idem/once.db, else
    /// ~/.local/state/idem/once.db), postgres://… or redis://… (several machines).
    #[arg(long, env = "IDEM_ONCE_STORE")]
    store: Option<String>,
    /// PostgreSQL schema / Redis key prefix.
    #[arg(long, env = "IDEM_NAMESPACE", default_value = "idem")]
    namespace: String,
}

impl StoreArgs {
    /// The store's URL; `memory:` is refused (exit 2): it keeps nothing past the invocation, so every
    /// invocation would find its slot new and run it.
    fn url(&self) -> Result<String, Error> {
        let url = match &self.store {
            Some(u) => u.clone(),
            None => format!("sqlite:{}", once::default_store_path().map_err(runner_error)?.display()),
        };
        if matches!(StoreUrl::parse(&url), Ok(StoreUrl::Memory)) || url == "memory" {
            return Err(Error::Config(
                "--store memory: keeps nothing past one invocation, so every invocation would run its slot; give \
                 sqlite:PATH (one machine), postgres://… or redis://… (several)"
                    .into(),
            ));
        }
        Ok(url)
    }

    /// The store, refusing a SQLite file that does not exist, the default one or one named (status and
    /// forget only read what invocations wrote: a typo must not answer from a file made for it).
    /// A PostgreSQL namespace that does not exist is `None` likewise, with nothing created.
    async fn open_existing(&self, name: &str) -> Result<Ledger, Error> {
        let url = self.url()?;
        if let Ok(StoreUrl::Sqlite(path)) = StoreUrl::parse(&url)
            && !path.exists()
        {
            return Err(Error::NotFound(format!(
                "no store at {}: nothing has run with idem once there (or its store is elsewhere: --store)",
                path.display()
            )));
        }
        Ledger::open_existing(&url, &self.namespace).await?.ok_or_else(|| self.no_job(name))
    }

    /// The error for a job the store does not have (exit 3), naming the store and the namespace.
    fn no_job(&self, name: &str) -> Error {
        let url = self.url().unwrap_or_default();
        // A SQLite file has no namespaces; PostgreSQL and Redis do, and a wrong one is the likely mistake.
        let namespace = match StoreUrl::parse(&url) {
            Ok(StoreUrl::Sqlite(_)) => String::new(),
            _ => format!(" (namespace {})", self.namespace),
        };
        Error::NotFound(format!("no job {name} in {}{namespace}", idem_core::redact_url(&url)))
    }
}

#[derive(Debug, clap::Subcommand)]
enum OnceCommand {
    /// The job's recent slots: state (done, failed, replaced, running, crashed, given_back, waiting, paused,
    /// skipped, requested, missed),
    /// machine, attempts, start, duration, exit status, the last lines of output, and how many slots ran more than once (must
    /// be 0). Exit 3 when the store has no such job.
    Status {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
        /// `text` (a table) or `json`.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// How many of the newest slots to show (the newest 100 are kept, and up to 100 older ones that ran when
        /// missed slots are among those).
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Pause the job: every invocation from now on records its slot `paused` and runs nothing (a running
    /// slot goes on); `status` and `list` show who paused it, why and until when. Exit 3 when the store has no
    /// such job.
    Pause {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
        /// When the pause ends by itself: RFC 3339 (2026-12-05T18:00:00Z) or a duration from now (2h).
        #[arg(long, value_name = "TIME")]
        until: Option<String>,
        /// Why, for whoever reads `status`.
        #[arg(long, value_name = "TEXT")]
        note: Option<String>,
    },
    /// End the job's pause now. Exit 3 when the store has no such job; says so when it was not paused.
    Resume {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Request a run of the job outside its schedule: the job's next invocation, on any machine, runs it once
    /// after its own slot. Prints the id; the same --id again requests nothing more. Exit 3 when the store has
    /// no such job.
    Trigger {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
        /// The request's key (1 to 100 letters, digits, '.', '_', '-'); default: a new one.
        #[arg(long)]
        id: Option<String>,
    },
    /// Every job in the store: schedule, overlap policy, last slot and its state, next slot, paused or not.
    List {
        #[command(flatten)]
        store: StoreArgs,
        /// `text` (a table) or `json`.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Request every slot of the job from --from to --to that is not done yet (missed, paused, skipped, failed
    /// with attempts left, or never recorded): the job's next invocations, on any machine, run them oldest
    /// first, each once, after their own slot and under the job's overlap policy; a run killed halfway is taken
    /// up by the next invocation. At most 10,000 slots. Exit 3 when the store has no such job.
    Backfill {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
        /// The range's first time: RFC 3339 (2026-12-01T00:00:00Z) or a duration ago (3d).
        #[arg(long, value_name = "TIME")]
        from: String,
        /// The range's last time (included): RFC 3339 or a duration ago (0s: now).
        #[arg(long, value_name = "TIME")]
        to: String,
    },
    /// Delete every record of the job (its history too), so that its next invocation starts afresh with the
    /// schedule it gives. Refused while a slot of it runs. Exit 3 when the store has no such job.
    Forget {
        /// The job's name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    Text,
    Json,
}

fn runner_error(e: idem_runner::Error) -> Error {
    match e {
        idem_runner::Error::Config(_) => Error::Config(idem_store::error_chain(&e)),
        // The store went away after it was opened, before anything was claimed (a claim is judged, then the
        // command runs under its lease: failures from there on are outcomes, not errors).
        idem_runner::Error::Store(ref s) if s.is_unavailable() => {
            unavailable_message(Error::Unavailable(idem_store::error_chain(&e)))
        }
        // The store failed before anything was claimed: nothing ran, as for a store that cannot be opened.
        other => Error::Config(format!("{}; nothing ran", idem_store::error_chain(&other))),
    }
}

/// An [`Error::Unavailable`] said as what it means for the slot (exit 75); other errors as they are.
fn unavailable_message(e: Error) -> Error {
    match e {
        Error::Unavailable(why) => Error::Unavailable(format!(
            "the store is unavailable ({why}): nothing ran; the next invocation in the slot runs it once the store \
             is back (exit 75: a temporary failure, unlike 2 for bad usage, a bad URL or a refused login)"
        )),
        other => other,
    }
}

impl OnceArgs {
    /// The default log level: `error` with --quiet, whose promise is that only a change of state or trouble
    /// is printed (a store blip that recovers logs WARN lines, e.g. a lease renewal retried), `warn` otherwise.
    pub fn log_level(&self) -> &'static str {
        if self.quiet && self.command.is_none() { "error" } else { "warn" }
    }
}

/// Runs `idem once …`; returns the exit status.
///
/// # Errors
/// Refusals before anything ran (exit status 2), a job not in the store (3).
pub async fn run(args: OnceArgs) -> Result<i32, Error> {
    if let Some(command) = args.command {
        return control::run(command).await;
    }
    let name = args.name.unwrap_or_default();
    if args.tz.is_some() && args.cron.is_none() {
        return Err(Error::Config(
            "--tz applies to --cron only: --every slots are aligned to the Unix epoch, the same in every zone".into(),
        ));
    }
    let schedule = match (&args.every, &args.cron) {
        (Some(every), None) => Schedule::every(parse_every(every)?),
        (None, Some(cron)) => Schedule::cron(cron, args.tz.as_deref().unwrap_or("UTC")),
        _ => return Err(Error::Config("give one of --every DURATION and --cron EXPR".into())),
    }
    .map_err(runner_error)?;
    let mut cfg = OnceConfig::new(name, schedule, args.command_line);
    cfg.retries = args.retries;
    cfg.lease = args.lease;
    cfg.starting_deadline = args.starting_deadline;
    cfg.overlap = if args.no_overlap { once::Overlap::Skip } else { args.overlap };
    cfg.timeout = args.timeout;
    cfg.catchup_window = args.catchup_window;
    cfg.jitter = args.jitter;
    // Everything that can refuse the invocation is checked before the store is opened (or created).
    tokio::task::block_in_place(|| cfg.check()).map_err(runner_error)?;
    let url = args.store.url()?;
    // A named SQLite file's directory must exist: a typo in --store would otherwise make a new directory and
    // an empty store there, and every machine's job would run in its own. The default store's directory
    // (~/.local/state/idem) is made when missing.
    if args.store.store.is_some()
        && let Ok(StoreUrl::Sqlite(path)) = StoreUrl::parse(&url)
        && let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(Error::Config(format!(
            "--store {}: directory {} does not exist (create it first); nothing ran",
            idem_core::redact_url(&url),
            dir.display()
        )));
    }
    // The handlers are installed before the store is opened: a signal while connecting (a store that does not
    // answer) stops the invocation as one before the claim (130, nothing ran), not with the default action.
    let mut interrupt = std::pin::pin!(signalled());
    // An unreachable store is exit 75 at once, not waited for: the next invocation (cron's next firing) tries
    // again, and a wait could run into it.
    let ledger = tokio::select! {
        ledger = Ledger::open_or_unavailable(&url, &args.store.namespace) => match ledger {
            Ok(ledger) => ledger,
            Err(e) => {
                let e = unavailable_message(e);
                if let Some(path) = &args.metrics_file {
                    control::write_invocation_only(&cfg.name, e.exit_code(), path);
                }
                return Err(e);
            }
        },
        () = interrupt.as_mut() => {
            let line = format!("idem once: {}: interrupted while connecting to the store: nothing ran\n", cfg.name);
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            return Ok(130);
        }
    };
    let result = on_ledger!(&ledger, s => once::once(s, &cfg, interrupt.as_mut()).await);
    let code = match &result {
        Ok(r) => r.exit_code(args.fail_if_held),
        Err(idem_runner::Error::Store(s)) if s.is_unavailable() => Error::Unavailable(String::new()).exit_code(),
        Err(_) => Error::Config(String::new()).exit_code(),
    };
    if let Some(path) = &args.metrics_file {
        control::write_metrics(&ledger, &cfg.name, code, path).await;
    }
    ledger.close().await;
    let report = result.map_err(runner_error)?;
    if !args.quiet || report.changed_state() {
        let mut text = report.render();
        // --quiet prints a change of state only: the missed slots recorded, not a routine "done" beside them.
        if args.quiet
            && !report.outcome_changed_state()
            && let Some((_, missed)) = text.split_once('\n')
        {
            text = missed.to_owned();
        }
        let line = format!("{text}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    }
    Ok(code)
}

/// `--every`'s value: a duration with units (`90s`, `15m`, `1h`, `7d`); one line when it is not one (not
/// the list of every unit humantime knows: only whole seconds are taken). Months and years are refused:
/// humantime reads them as 30.44 and 365.25 days from the epoch, never the first of a month or a year; a
/// calendar schedule is `--cron`'s.
fn parse_every(value: &str) -> Result<Duration, Error> {
    let calendar = value
        .split(|c: char| !c.is_ascii_alphabetic())
        .any(|unit| matches!(unit, "M" | "month" | "months" | "y" | "year" | "years"));
    if calendar {
        return Err(Error::Config(format!(
            "--every {value:?}: months and years are not fixed lengths; give --cron (e.g. '0 0 1 * *' monthly, \
             '0 0 1 1 *' yearly)"
        )));
    }
    humantime::parse_duration(value).map_err(|_| {
        Error::Config(format!(
            "--every {value:?}: not a duration; give whole seconds with a unit: 90s, 15m, 1h, 7d (a calendar \
             schedule is --cron)"
        ))
    })
}

/// Resolves on SIGINT, SIGTERM or SIGHUP (never, if they cannot be watched; SIGHUP not if it was ignored at
/// start, as under `nohup`): a closed terminal stops the
/// invocation as Ctrl-C does (the command killed, its attempt recorded interrupted), not by the default action
/// that would leave the slot to look crashed. The handlers are installed now, not when
/// the future is first polled: a signal while the invocation claims its slot must not kill it with the claim
/// made (the attempt would count as a crash); `once` sees it before the start and gives the claim back.
fn signalled() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Under `nohup` SIGHUP stays ignored: a handler would undo what the user asked for.
    let hup = (!idem_store::stop::hangup_ignored()).then(|| signal(SignalKind::hangup()));
    let handlers = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), hup.transpose());
    async move {
        let (Ok(mut int), Ok(mut term), Ok(mut hup)) = handlers else {
            return std::future::pending().await;
        };
        let hung_up = async {
            match hup.as_mut() {
                Some(hup) => hup.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
            _ = hung_up => {}
        }
    }
}

/// `--overlap`'s value, one line naming the policies when it is none of them.
fn parse_overlap(value: &str) -> Result<once::Overlap, String> {
    once::Overlap::parse(value).ok_or_else(|| {
        let names: Vec<&str> = once::Overlap::ALL.iter().map(|p| p.name()).collect();
        format!("not a policy; give one of {}", names.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Months and years are refused with a pointer to --cron; fixed units, weeks included, are taken.
    #[test]
    fn every_refuses_calendar_units() {
        for value in ["1M", "1month", "2months", "1y", "1year", "3years", "1d 1M"] {
            let Err(Error::Config(msg)) = parse_every(value) else { panic!("{value} was taken") };
            assert!(msg.contains("--cron"), "{msg}");
        }
        for (value, secs) in [("90s", 90), ("15m", 900), ("1h", 3600), ("7d", 604_800), ("1w", 604_800)] {
            assert_eq!(parse_every(value).ok(), Some(Duration::from_secs(secs)), "{value}");
        }
    }

    /// With --quiet the log level is error: a transient WARN (a lease renewal retried) is not printed.
    #[test]
    fn quiet_raises_the_log_level() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            once: OnceArgs,
        }
        let parse = |extra: &[&str]| {
            let mut args = vec!["idem", "--name", "j", "--every", "1h"];
            args.extend_from_slice(extra);
            args.extend_from_slice(&["--", "true"]);
            Cli::parse_from(args).once
        };
        assert_eq!(parse(&["--quiet"]).log_level(), "error");
        assert_eq!(parse(&[]).log_level(), "warn");
    }
}
