//! The run itself: stream items, judge each against the ledger and its output, claim, run, verify, rename.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use idem_core::{Entry, FailureVerdict, Held, ItemClaim, ItemKeys, Plan, RetryLimit, Write, WriteOp};
use idem_store::{Error as StoreError, Generation, Store, system_time_to_millis};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::heartbeat::Heartbeat;
use crate::output::{self, Checks, Digest256, Invalid};
use crate::progress::{Counters, Progress};
use crate::report::{ItemReport, Report};
use crate::watchdog::Watchdog;
use crate::{CheckedConfig, Error, Item, ItemReader, OnPoison, RunConfig, job_id};

/// Asks a running [`run`] to stop: the first request stops claiming (running items finish), the second kills
/// the children and releases their leases. Cheap to clone; all clones share one state.
#[derive(Clone, Debug)]
pub struct Stop {
    tx: Arc<watch::Sender<u8>>,
}

impl Default for Stop {
    fn default() -> Self {
        Self::new()
    }
}

impl Stop {
    /// A stop that has not been requested.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::Sender::new(0)) }
    }

    /// Requests the next stop level and returns it (1: drain, 2: abort).
    pub fn request(&self) -> u8 {
        let mut level = 0;
        self.tx.send_modify(|l| {
            *l = l.saturating_add(1).min(2);
            level = *l;
        });
        level
    }

    /// The level requested so far (0: none).
    pub fn level(&self) -> u8 {
        *self.tx.borrow()
    }

    fn subscribe(&self) -> watch::Receiver<u8> {
        self.tx.subscribe()
    }
}

/// How a run ended, in order of precedence; [`RunStatus::exit_code`] is the process exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStatus {
    /// Every item is done (or, for a dry run, the listing finished).
    AllDone,
    /// Some item is not done: it failed every attempt, or the ledger failed.
    Failed,
    /// A poison item stopped the run, or was skipped.
    Poison,
    /// Ctrl-C (or SIGTERM) stopped the run before every item was done.
    Interrupted,
}

impl RunStatus {
    /// 0 all done, 1 failures, 3 poison, 130 interrupted (2 is kept for bad usage).
    pub fn exit_code(self) -> i32 {
        match self {
            RunStatus::AllDone => 0,
            RunStatus::Failed => 1,
            RunStatus::Poison => 3,
            RunStatus::Interrupted => 130,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Items in the file.
    pub total: u64,
    /// Items this run executed to done.
    pub done: u64,
    /// Items skipped because the ledger says done and the output still matches.
    pub skipped: u64,
    /// Items whose verified output was found in place without a ledger entry and recorded as done.
    pub adopted: u64,
    /// Items that used every attempt without succeeding (or whose ledger writes failed).
    pub failed: u64,
    /// The items among `failed` that used every attempt they were allowed.
    pub out_of_attempts: OutOfAttempts,
    /// Poison items: id and error.
    pub poison: Vec<(String, String)>,
    /// Items not started or given up because of a stop request or a poison halt.
    pub not_done: u64,
    /// An item turned poison in this run and `--on-poison halt` stopped it from starting anything new.
    pub halted: bool,
    /// Commands executed (attempts started by this run).
    pub executions: u64,
    /// Items a dry run would execute.
    pub would_run: u64,
    /// A stop was requested.
    pub interrupted: bool,
    /// Was this a dry run.
    pub dry_run: bool,
    /// Wall time.
    pub elapsed: Duration,
    /// The run's `--retries`.
    pub retries: u32,
    /// The run's output template, which names the job (`idem runs forget --output`).
    pub output: String,
}

/// Items out of attempts: each used every attempt it was allowed (`--retries` + 1 in all, counted across runs),
/// or more, when an earlier run allowed more.
#[derive(Clone, Debug, Default)]
pub struct OutOfAttempts {
    /// How many.
    pub count: u64,
    /// The most attempts one of them used: a rerun with `--retries` this high gives each at least one more.
    pub most_attempts: u32,
    /// The first [`OutOfAttempts::SHOWN`] of them in the items file, in its order.
    pub first: Vec<FailedItem>,
}

/// An item out of attempts, as the summary names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedItem {
    /// Its 1-based line in the items file.
    pub line: u64,
    /// Its id.
    pub id: String,
    /// The attempts it used, counted across runs.
    pub attempts: u32,
    /// The last attempt's error.
    pub error: String,
}

impl OutOfAttempts {
    /// How many of them [`OutOfAttempts::first`] keeps (the report has them all).
    pub const SHOWN: usize = 10;

    fn add(&mut self, item: FailedItem) {
        self.count += 1;
        self.most_attempts = self.most_attempts.max(item.attempts);
        // Items end in whatever order their commands finish; kept by line, the summary reads the same every run.
        let at = self.first.partition_point(|f| f.line < item.line);
        if at < Self::SHOWN {
            self.first.insert(at, item);
            self.first.truncate(Self::SHOWN);
        }
    }
}

impl Summary {
    /// How the run ended.
    pub fn status(&self) -> RunStatus {
        if self.interrupted && (self.not_done > 0 || self.done + self.skipped + self.adopted < self.total) {
            RunStatus::Interrupted
        } else if !self.poison.is_empty() {
            RunStatus::Poison
        } else if self.dry_run {
            RunStatus::AllDone
        } else if self.failed > 0 || self.not_done > 0 || self.done + self.skipped + self.adopted < self.total {
            RunStatus::Failed
        } else {
            RunStatus::AllDone
        }
    }

    /// `idem runs forget` for this job and `ids` (all of them when `complete`, else the placeholder), quoted
    /// for a POSIX shell.
    fn forget_command<'a>(&self, ids: impl Iterator<Item = &'a str>, complete: bool) -> String {
        let quote = |w: &str| shlex::try_quote(w).map(|q| q.into_owned());
        let ids: Result<Vec<String>, _> = if complete { ids.map(quote).collect() } else { Ok(Vec::new()) };
        let ids = match ids {
            Ok(ids) if !ids.is_empty() => ids.join(" "),
            // Too many to list, or one no shell word can carry (a NUL): the ids are in the report.
            _ => "ID…".to_owned(),
        };
        let output = quote(&self.output).unwrap_or_else(|_| "…".to_owned());
        format!("idem runs forget --output {output} {ids}")
    }

    /// The one-screen summary printed at the end.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let secs = self.elapsed.as_secs_f64();
        if self.dry_run {
            s.push_str(&format!(
                "dry run: {} items, {} would run, {} would be adopted, {} done, {} poison, {} out of attempts\n",
                self.total,
                self.would_run,
                self.adopted,
                self.skipped,
                self.poison.len(),
                self.failed
            ));
            return s;
        }
        if self.executions == 0 && self.done + self.skipped + self.adopted == self.total {
            s.push_str(&format!(
                "nothing to do: all {} items already done ({} adopted), ran 0 commands\n",
                self.total, self.adopted
            ));
        }
        s.push_str(&format!(
            "{} items in {:.1}s: {} done now, {} already done, {} adopted, {} failed, {} poison, {} not done; \
             {} commands ran\n",
            self.total,
            secs,
            self.done,
            self.skipped,
            self.adopted,
            self.failed,
            self.poison.len(),
            self.not_done,
            self.executions
        ));
        let failed = &self.out_of_attempts;
        for FailedItem { id, attempts, error, .. } in &failed.first {
            let plural = if *attempts == 1 { "" } else { "s" };
            s.push_str(&format!("failed item {id} after {attempts} attempt{plural}: {error}\n"));
        }
        let unshown = failed.count.saturating_sub(failed.first.len() as u64);
        if unshown > 0 {
            s.push_str(&format!("… and {unshown} more items out of attempts (see --report)\n"));
        }
        if failed.count > 0 {
            // Attempts are counted across runs and the limit is the current run's: raising it is what gives
            // more (the smallest value that gives every one of them another), forgetting starts from zero.
            s.push_str(&format!(
                "{} items out of attempts (--retries {} allows {} in all, counted across runs): rerun with \
                 --retries {} to give each one more, or start their count afresh with `{}`\n",
                failed.count,
                self.retries,
                self.retries.saturating_add(1),
                failed.most_attempts,
                self.forget_command(failed.first.iter().map(|f| f.id.as_str()), unshown == 0)
            ));
        }
        for (id, error) in self.poison.iter().take(10) {
            s.push_str(&format!("poison item {id}: {error}\n"));
        }
        if self.poison.len() > 10 {
            s.push_str(&format!("… and {} more poison items\n", self.poison.len() - 10));
        }
        if !self.poison.is_empty() {
            // Poison stays in the ledger across runs (neither a fixed command nor --retries revives it): say how.
            let complete = self.poison.len() <= 10;
            s.push_str(&format!(
                "poison items (the same error twice) are not run again: once the cause is fixed, `{}` retries \
                 them\n",
                self.forget_command(self.poison.iter().take(10).map(|(id, _)| id.as_str()), complete)
            ));
        }
        if self.halted && self.not_done > 0 {
            s.push_str(&format!(
                "the run halted when an item turned poison, leaving {} items not done: run it again to do them \
                 (poison items found earlier are skipped, not halted on), or add --on-poison skip to go on past \
                 new ones\n",
                self.not_done
            ));
        }
        let status = self.status();
        s.push_str(&format!(
            "exit status {} ({})\n",
            status.exit_code(),
            match status {
                RunStatus::AllDone => "every item done",
                RunStatus::Failed => "some items failed",
                RunStatus::Poison => "poison items",
                RunStatus::Interrupted => "interrupted",
            }
        ));
        s
    }
}

/// How one item ended in this run. `Failed`: out of attempts; `Error`: the runner could not judge or record it
/// (the ledger failed), which is not the item's doing.
enum Final {
    Done { attempts: u32, digest: Digest256, duration: Duration },
    Skipped { digest: Digest256 },
    Adopted { digest: Digest256 },
    Failed { attempts: u32, error: String },
    Error { error: String },
    Poison { attempts: u32, error: String },
    NotDone { reason: &'static str },
    WouldRun,
}

struct Ctx<S> {
    store: S,
    cfg: RunConfig,
    job: String,
    owner: String,
    limit: RetryLimit,
    checks: Checks,
    jobs: Semaphore,
    /// Items claimed before a slot is free, at most `--jobs` of them: their claim writes commit while other
    /// commands run, instead of inside the slot.
    ahead: Semaphore,
    stop: Stop,
    halt: AtomicBool,
    counters: Arc<Counters>,
    executions: AtomicU64,
    report: Option<Mutex<Report>>,
    poison: Mutex<Vec<(String, String)>>,
    dry_out: Mutex<std::io::BufWriter<std::io::Stdout>>,
    renamer: Arc<output::Renamer>,
    watchdog: Option<Watchdog>,
    /// The command's program found in `PATH` once for the run; `None` when it is a path already, contains a
    /// placeholder, or was not found (then each spawn looks it up, and fails with the usual error).
    program: Option<PathBuf>,
    /// Set once a command could not start for want of descriptors or processes (warned about once).
    short_of_resources: AtomicBool,
}

impl<S> Ctx<S> {
    /// No new command may start: Ctrl-C was pressed, or a poison item halts the run.
    fn stopping(&self) -> bool {
        self.stop.level() > 0 || self.halt.load(Ordering::SeqCst)
    }
}

/// A token unique to this process start: host, process id and 32 random bits.
pub fn owner_token() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(32).collect();
    let host = if host.is_empty() { "host".to_owned() } else { host };
    format!("{host}-{}-{:08x}", std::process::id(), rand::random::<u32>())
}

/// Looks a bare program name up in `PATH` once, as a shell does, instead of for every item: spawning by bare
/// name tries each `PATH` directory in turn in the child (`posix_spawnp`), nine failed `execve` calls per item
/// for `sh` with this machine's `PATH`.
///
/// `None` as well when `PATH` is not [`searchable`].
fn resolve_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') || name.contains('{') || !searchable() {
        return None;
    }
    which::which(name).ok()
}

/// `PATH` is set, not empty, and has no entry starting with `~`, which `which` expands and `execvp` and the
/// shells do not: only then does a lookup here find what the spawn would.
fn searchable() -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        !path.is_empty()
            && !std::env::split_paths(&path).any(|dir| dir.as_os_str().as_encoded_bytes().starts_with(b"~"))
    })
}

/// Refuses a program that cannot start before anything runs: a typo in the command is the operator's error,
/// and as an item failure it would make the first items poison, for good. A name with a placeholder is
/// checked per item when it runs.
pub(crate) fn check_program(name: &str) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt as _;
    if name.contains('{') {
        return Ok(());
    }
    if !name.contains('/') {
        // Where the lookup cannot tell (an unusual PATH), the spawn decides.
        if !searchable() || resolve_program(name).is_some() {
            return Ok(());
        }
        return Err(Error::Config(format!("cannot start {name}: not found in PATH")));
    }
    match std::fs::metadata(name) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok(()),
        Ok(_) => Err(Error::Config(format!("cannot start {name}: not an executable file"))),
        Err(e) => Err(Error::Config(format!("cannot start {name}: {e}"))),
    }
}

fn now_ms() -> u64 {
    system_time_to_millis(SystemTime::now())
}

/// Performs a ledger write; returns the new generation of a put.
pub(crate) async fn apply<S: Store>(store: &S, write: Write) -> Result<Option<Generation>, StoreError> {
    match write.op {
        WriteOp::Put { value, ttl } => {
            store.put(&write.key, value, write.precondition, ttl).await.map(|w| Some(w.generation()))
        }
        WriteOp::Delete => store.delete(&write.key, write.precondition).await.map(|_| None),
    }
}

/// Checks every item (ids, duplicate outputs) before anything runs; returns how many there are.
pub(crate) fn precheck(cfg: &RunConfig) -> Result<u64, Error> {
    use sha2::Digest as _;
    let mut seen: std::collections::HashMap<u128, u64> = std::collections::HashMap::new();
    let mut total = 0;
    for item in ItemReader::open(&cfg.items, cfg.format, cfg.id_field.as_deref())? {
        let item = item?;
        total += 1;
        let output = cfg.output_path(&item.id);
        // 128 bits of SHA-256 per path instead of the path itself keeps a million items in ~40 MiB; two paths
        // colliding by chance is far less likely than a disk error.
        let digest = sha2::Sha256::digest(output.as_os_str().as_encoded_bytes());
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        if let Some(first) = seen.insert(u128::from_le_bytes(key), item.line) {
            return Err(Error::DuplicateOutput {
                path: cfg.items.clone(),
                first,
                second: item.line,
                output: output.display().to_string(),
            });
        }
    }
    Ok(total)
}

/// Runs `cfg` against the ledger in `store` until every item is done, a poison item halts it, or `stop` is
/// requested.
///
/// Items are streamed: at most a few hundred are in flight at once whatever the file's size.
///
/// # Panics
/// On a current-thread tokio runtime: reading the items file uses `block_in_place`, which needs the
/// multi-thread runtime.
///
/// # Errors
/// Refusals before anything runs ([`Error::Config`], [`Error::BadItem`], [`Error::DuplicateOutput`],
/// [`Error::ReadItems`]) and report write failures. Failures of single items are counted in the [`Summary`].
pub async fn run<S: Store + Clone>(store: S, cfg: RunConfig, stop: Stop) -> Result<Summary, Error> {
    let checked = tokio::task::block_in_place(|| cfg.checked())?;
    run_checked(store, checked, stop).await
}

/// [`run`] with a configuration checked already ([`RunConfig::checked`]): a caller that checks before it opens
/// or creates the ledger leaves none behind when the run is refused.
///
/// # Errors
/// [`Error::ReadItems`] when the items file went away since it was checked, and report write failures.
pub async fn run_checked<S: Store + Clone>(store: S, checked: CheckedConfig, stop: Stop) -> Result<Summary, Error> {
    let CheckedConfig { mut cfg, total } = checked;
    if !cfg.dry_run {
        cfg.jobs = jobs_within_descriptor_limit(cfg.jobs);
    }
    let program = resolve_program(&cfg.command[0]);
    let started = Instant::now();
    let report = match &cfg.report {
        Some(path) => Some(Mutex::new(Report::create(path)?)),
        None => None,
    };
    let counters = Arc::new(Counters::default());
    let progress = Progress::start(cfg.progress, total, counters.clone(), cfg.dry_run);
    let ctx = Arc::new(Ctx {
        job: job_id(&cfg.output),
        owner: owner_token(),
        limit: RetryLimit { max_attempts: cfg.retries.saturating_add(1) },
        checks: Checks { json: cfg.output.ends_with(".json"), expect_fields: cfg.expect_fields.clone() },
        jobs: Semaphore::new(cfg.jobs),
        ahead: Semaphore::new(cfg.jobs),
        halt: AtomicBool::new(false),
        counters: counters.clone(),
        executions: AtomicU64::new(0),
        report,
        poison: Mutex::new(Vec::new()),
        dry_out: Mutex::new(std::io::BufWriter::new(std::io::stdout())),
        renamer: Arc::new(output::Renamer::default()),
        watchdog: if cfg.dry_run { None } else { Watchdog::start() },
        program,
        short_of_resources: AtomicBool::new(false),
        store,
        cfg,
        stop,
    });
    // Enough items in flight to keep the ledger busy while `jobs` commands run, few enough to stay small.
    let window = (ctx.cfg.jobs * 4).max(256);
    let mut set = JoinSet::new();
    let mut summary = Summary {
        total,
        dry_run: ctx.cfg.dry_run,
        retries: ctx.cfg.retries,
        output: ctx.cfg.output.clone(),
        ..Summary::default()
    };
    let mut reader = ItemReader::open(&ctx.cfg.items, ctx.cfg.format, ctx.cfg.id_field.as_deref())?;
    let mut seen = 0u64;
    let mut chunk: Vec<Item> = Vec::with_capacity(CHUNK);
    let mut more = true;
    while more {
        if ctx.stopping() {
            break;
        }
        // Read inline: the reader refills a 256 KiB buffer once per few thousand items, far cheaper than
        // handing this thread's work elsewhere for every line.
        while chunk.len() < CHUNK {
            match reader.next() {
                Some(item) => chunk.push(item?),
                None => {
                    more = false;
                    break;
                }
            }
        }
        seen += chunk.len() as u64;
        let (settled, prefetched) = settle_done(&ctx, &chunk).await;
        for ((item, done), prefetched) in chunk.drain(..).zip(settled).zip(prefetched) {
            if let Some(digest) = done {
                record_final(&ctx, &mut summary, &item, Final::Skipped { digest })?;
                continue;
            }
            while set.len() >= window {
                if let Some(joined) = set.join_next().await {
                    record(&ctx, &mut summary, joined)?;
                }
            }
            let ctx = ctx.clone();
            set.spawn(async move {
                let result = process(&ctx, &item, prefetched).await;
                (item, result)
            });
        }
    }
    while let Some(joined) = set.join_next().await {
        record(&ctx, &mut summary, joined)?;
    }
    // Lines appended to the items file during the run are seen but were not counted up front.
    summary.not_done += total.saturating_sub(seen);
    summary.interrupted = ctx.stop.level() > 0;
    summary.halted = ctx.halt.load(Ordering::SeqCst);
    summary.executions = ctx.executions.load(Ordering::SeqCst);
    summary.poison = std::mem::take(&mut *ctx.poison.lock().unwrap_or_else(|p| p.into_inner()));
    summary.elapsed = started.elapsed();
    progress.finish().await;
    if let Some(watchdog) = &ctx.watchdog {
        watchdog.finish();
    }
    if let Ok(mut out) = ctx.dry_out.lock() {
        let _ = out.flush();
    }
    if let Some(report) = &ctx.report {
        report.lock().unwrap_or_else(|p| p.into_inner()).finish(&summary)?;
    }
    Ok(summary)
}

fn record(
    ctx: &Ctx<impl Store>,
    summary: &mut Summary,
    joined: Result<(Item, Result<Final, String>), tokio::task::JoinError>,
) -> Result<(), Error> {
    let (item, result) = match joined {
        Ok(r) => r,
        Err(e) => {
            // A panicking item task is a bug; count it as not done rather than losing the run.
            tracing::error!("item task failed: {e}");
            summary.failed += 1;
            return Ok(());
        }
    };
    let fin = result.unwrap_or_else(|error| Final::Error { error });
    record_final(ctx, summary, &item, fin)
}

fn record_final(ctx: &Ctx<impl Store>, summary: &mut Summary, item: &Item, fin: Final) -> Result<(), Error> {
    let c = &ctx.counters;
    let (status, attempts, error, digest, duration) = match &fin {
        Final::Done { attempts, digest, duration } => {
            summary.done += 1;
            c.done.fetch_add(1, Ordering::Relaxed);
            ("done", *attempts, None, Some(digest), Some(*duration))
        }
        Final::Skipped { digest } => {
            summary.skipped += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("skipped", 0, None, Some(digest), None)
        }
        Final::Adopted { digest } => {
            summary.adopted += 1;
            c.skipped.fetch_add(1, Ordering::Relaxed);
            ("adopted", 0, None, Some(digest), None)
        }
        Final::Failed { attempts, error } => {
            summary.failed += 1;
            summary.out_of_attempts.add(FailedItem {
                line: item.line,
                id: item.id.clone(),
                attempts: *attempts,
                error: error.clone(),
            });
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("failed", *attempts, Some(error.clone()), None, None)
        }
        Final::Error { error } => {
            summary.failed += 1;
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("failed", 0, Some(error.clone()), None, None)
        }
        Final::Poison { attempts, error } => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            ("poison", *attempts, Some(error.clone()), None, None)
        }
        Final::NotDone { reason } => {
            summary.not_done += 1;
            (*reason, 0, None, None, None)
        }
        Final::WouldRun => {
            summary.would_run += 1;
            c.done.fetch_add(1, Ordering::Relaxed);
            ("would_run", 0, None, None, None)
        }
    };
    if let Some(report) = &ctx.report {
        let output = ctx.cfg.output_path(&item.id);
        report.lock().unwrap_or_else(|p| p.into_inner()).item(&ItemReport {
            id: &item.id,
            line: item.line,
            status,
            attempts,
            last_error: error.as_deref(),
            sha256: digest.map(|d| d.sha256.as_str()),
            duration_ms: duration.map(|d| d.as_millis() as u64),
            output: &output.display().to_string(),
        })?;
    }
    Ok(())
}

/// Items judged together: one ledger read and one trip to the blocking pool per chunk.
const CHUNK: usize = 128;

/// Finds the items of `chunk` that are done (ledger entry done, output with the recorded digest) in one
/// `get_many` and one batch of file checks, so a resume pass over finished work costs no task per item. The
/// rest (`None`) go through [`process`], which judges them again one by one, starting from the entries read
/// here.
async fn settle_done<S: Store>(ctx: &Ctx<S>, chunk: &[Item]) -> (Vec<Option<Digest256>>, Vec<Prefetched>) {
    let keys: Vec<String> = chunk.iter().map(|i| ItemKeys::new(&ctx.job, &i.id).entry().to_owned()).collect();
    let Ok(values) = ctx.store.get_many(&keys).await else {
        return (vec![None; chunk.len()], vec![None; chunk.len()]);
    };
    let done = check_done(ctx, chunk, &values).await;
    (done, values.into_iter().map(Some).collect())
}

/// An entry read ahead for an item: `Some(read)` saves [`process`] its first ledger read.
type Prefetched = Option<Option<idem_store::Versioned>>;

async fn check_done<S: Store>(
    ctx: &Ctx<S>,
    chunk: &[Item],
    values: &[Option<idem_store::Versioned>],
) -> Vec<Option<Digest256>> {
    let none = || vec![None; chunk.len()];
    let checks: Vec<Option<(std::path::PathBuf, Digest256)>> = values
        .iter()
        .zip(chunk)
        .map(|(value, item)| match Entry::decode(value.as_ref()?.value()).ok()? {
            Entry::Done { sha256, size, .. } => Some((ctx.cfg.output_path(&item.id), Digest256 { sha256, size })),
            _ => None,
        })
        .collect();
    if checks.iter().all(Option::is_none) {
        return none();
    }
    tokio::task::spawn_blocking(move || {
        checks
            .into_iter()
            .map(|check| {
                let (path, digest) = check?;
                output::matches(&path, &digest).ok().map(|()| digest)
            })
            .collect()
    })
    .await
    .unwrap_or_else(|_| none())
}

/// Why a dry run would execute an item, or `None` when it would not.
fn dry_reason(entry: Option<&Entry>, plan: &Plan, output: &Result<(), Invalid>, held: bool) -> Option<String> {
    match (plan, entry) {
        (Plan::New, _) => Some(match output {
            Err(Invalid::Missing) => "new".to_owned(),
            Err(why) => format!("partial output at the final path ({why})"),
            Ok(()) => return None,
        }),
        (Plan::CheckDone { .. }, _) => output.as_ref().err().map(|why| format!("done, but the output changed: {why}")),
        (Plan::Retry { attempts }, Some(Entry::Running { owner, .. })) if held => {
            Some(format!("claimed by {owner} (attempt {attempts}), runs once its lease lapses"))
        }
        (Plan::Retry { attempts }, Some(Entry::Running { owner, .. })) => {
            Some(format!("abandoned by {owner} during attempt {attempts} (no live lease): runs again"))
        }
        // Said whatever the file at the final path looks like: the interrupted command may have written it.
        (Plan::Retry { .. }, Some(Entry::Interrupted { owner, attempt, .. })) => Some(format!(
            "attempt {attempt} interrupted (run by {owner}; not counted, and a file at the final path is not \
             adopted): runs again"
        )),
        (Plan::Retry { attempts }, e) => {
            Some(format!("failed {attempts} time(s): {}", e.and_then(Entry::last_error).unwrap_or("unknown error")))
        }
        (Plan::Poison { .. } | Plan::Exhausted { .. }, _) => None,
    }
}

async fn process<S: Store>(ctx: &Ctx<S>, item: &Item, mut prefetched: Prefetched) -> Result<Final, String> {
    let keys = ItemKeys::new(&ctx.job, &item.id);
    let output = ctx.cfg.output_path(&item.id);
    let mut waiting = false;
    let mut permit = None;
    let result = loop {
        let read = match prefetched.take() {
            Some(read) => read,
            None => ctx.store.get(keys.entry()).await.map_err(|e| format!("ledger read failed: {e}"))?,
        };
        let (generation, entry) = match read {
            Some(v) => {
                let entry = Entry::decode(v.value()).map_err(|e| format!("ledger entry unreadable: {e}"))?;
                (Some(v.generation()), Some(entry))
            }
            None => (None, None),
        };
        let plan = idem_core::plan(entry.as_ref(), ctx.limit);
        // Its last allowed attempt may still be running in another runner: "out of attempts" only once that
        // runner's lease is gone (it crashed), else wait for its result like any held item.
        if matches!(plan, Plan::Exhausted { .. })
            && matches!(entry, Some(Entry::Running { .. }))
            && !ctx.cfg.dry_run
            && ctx.store.get(keys.lease()).await.map_err(|e| format!("ledger read failed: {e}"))?.is_some()
        {
            if wait_for_holder(ctx, &mut waiting).await {
                break Final::NotDone { reason: "interrupted" };
            }
            continue;
        }
        // What the output at its final path says, where the plan depends on it.
        let out_state = match &plan {
            Plan::New => {
                let (path, checks) = (output.clone(), ctx.checks.clone());
                match tokio::task::spawn_blocking(move || output::verify(&path, &checks)).await {
                    Ok(Ok(digest)) => match verify_cmd(ctx, &output).await {
                        Ok(()) => Some(Ok(digest)),
                        Err(_) => Some(Err(Invalid::Unreadable("--verify refused it".into()))),
                    },
                    Ok(Err(why)) => Some(Err(why)),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Plan::CheckDone { sha256, size } => {
                let expected = Digest256 { sha256: sha256.clone(), size: *size };
                let path = output.clone();
                let got = tokio::task::spawn_blocking(move || output::matches(&path, &expected).map(|()| expected))
                    .await
                    .map_err(|e| e.to_string())?;
                Some(got)
            }
            _ => None,
        };
        if ctx.cfg.dry_run {
            let unit = out_state.as_ref().map(|r| r.as_ref().map(|_| ()).map_err(Clone::clone));
            // A running entry is only held while its lease lives: a crashed or interrupted holder's is not.
            let held = matches!(entry, Some(Entry::Running { .. }))
                && ctx.store.get(keys.lease()).await.map_err(|e| format!("ledger read failed: {e}"))?.is_some();
            if let Some(reason) = dry_reason(entry.as_ref(), &plan, &unit.unwrap_or(Ok(())), held) {
                if let Ok(mut out) = ctx.dry_out.lock() {
                    let _ = writeln!(out, "{}\t{}", item.id, reason);
                }
                break Final::WouldRun;
            }
        }
        match (&plan, out_state) {
            (Plan::New, Some(Ok(digest))) => {
                if ctx.cfg.dry_run {
                    if let Ok(mut out) = ctx.dry_out.lock() {
                        let _ = writeln!(out, "{}\tadopt: a verified output without a ledger entry", item.id);
                    }
                    break Final::Adopted { digest };
                }
                // A verified output nobody recorded (a lost ledger, or a run killed between rename and record).
                let write = idem_core::adopt(&keys, &digest.sha256, digest.size, now_ms());
                match apply(&ctx.store, write).await {
                    Ok(_) => break Final::Adopted { digest },
                    Err(e) if e.is_precondition_failed() => continue,
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
            }
            (Plan::CheckDone { .. }, Some(Ok(digest))) => break Final::Skipped { digest },
            (Plan::Poison { last_error }, _) => {
                break poisoned(ctx, item, entry.as_ref().map_or(0, Entry::attempts), last_error.clone());
            }
            (Plan::Exhausted { attempts, last_error }, _) => {
                break Final::Failed { attempts: *attempts, error: last_error.clone() };
            }
            _ => {}
        }
        if ctx.cfg.dry_run {
            break Final::WouldRun;
        }
        // It needs running. Claim it first and then wait for a slot: the claim's two commits (each waiting for
        // an fsync) then overlap the commands running, rather than keeping a slot idle (on a VM whose fsyncs
        // slowed down, claiming inside the slot cut the throughput by a third). At most `--jobs` items wait
        // claimed. A retry keeps the slot it had, so a failing item is retried (and found poison) before
        // other items start.
        let ahead = if permit.is_none() {
            match ctx.ahead.acquire().await {
                Ok(p) => Some(p),
                Err(_) => break Final::NotDone { reason: "not_started" },
            }
        } else {
            None
        };
        if ctx.stopping() {
            break Final::NotDone { reason: "not_started" };
        }
        let prev = match (generation, entry) {
            (Some(g), Some(e)) => Some((g, e)),
            _ => None,
        };
        let claim = ItemClaim::new(keys.clone(), &ctx.owner, now_ms(), ctx.cfg.lease, prev);
        let lease_sent = Instant::now();
        let lease_gen = match apply(&ctx.store, claim.lease_write()).await {
            Ok(Some(g)) => g,
            Ok(None) => return Err("ledger put returned no generation".into()),
            Err(e) if e.is_precondition_failed() => {
                // Another runner holds it: look again after a while (it may finish, or its lease may lapse).
                permit = None;
                drop(ahead);
                if wait_for_holder(ctx, &mut waiting).await {
                    break Final::NotDone { reason: "interrupted" };
                }
                continue;
            }
            Err(e) => return Err(format!("ledger write failed: {e}")),
        };
        let entry_gen = match apply(&ctx.store, claim.entry_write()).await {
            Ok(Some(g)) => g,
            Ok(None) => return Err("ledger put returned no generation".into()),
            Err(e) => {
                // Someone changed the entry between our read and our claim: give the lease back, judge again.
                let _ = apply(&ctx.store, claim.lease_release(lease_gen)).await;
                if e.is_precondition_failed() {
                    continue;
                }
                return Err(format!("ledger write failed: {e}"));
            }
        };
        if waiting {
            waiting = false;
            ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let previous = claim.previous_attempt();
        let mut held = claim.acquired(lease_gen, entry_gen);
        let mut heartbeat = Heartbeat::new(&ctx.store, ctx.cfg.lease, lease_sent);
        if permit.is_none() {
            match wait_for_slot(ctx, &mut held, &mut heartbeat).await {
                Ok(p) => permit = Some(p),
                Err(()) => {
                    // Stopping, or the claim was lost while it waited: it never started, so its attempt is
                    // given back (the undo is fenced on the claim's entry generation, so it changes nothing
                    // if another runner has claimed the item since).
                    heartbeat.settle(&mut held).await;
                    let _ = unclaim(ctx, &held).await;
                    drop(ahead);
                    if ctx.stopping() {
                        break Final::NotDone { reason: "not_started" };
                    }
                    continue;
                }
            }
            drop(ahead);
        }
        if let Some((owner, attempt)) = previous {
            // The previous holder crashed, lost its lease or was interrupted: its temporary file is ours to remove.
            let _ = tokio::fs::remove_file(output::temp_path(&output, &owner, attempt)).await;
        }
        ctx.executions.fetch_add(1, Ordering::Relaxed);
        ctx.counters.running.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let outcome = attempt(ctx, &mut held, &mut heartbeat, item, &output, &mut permit).await;
        ctx.counters.running.fetch_sub(1, Ordering::Relaxed);
        // A renewal still in flight is answered first: the release below is fenced on its generation.
        heartbeat.settle(&mut held).await;
        match outcome {
            Attempt::Ok(digest) => {
                let duration = started.elapsed();
                let write = held.done(&digest.sha256, digest.size, now_ms(), duration.as_millis() as u64);
                // Both fenced and independent, so they share one commit. If the done write is refused, giving
                // back the lease is still right: it was ours until now.
                let (done, _) = tokio::join!(apply(&ctx.store, write), apply(&ctx.store, held.release()));
                match done {
                    Ok(_) => break Final::Done { attempts: held.attempt(), digest, duration },
                    Err(e) if e.is_precondition_failed() => {
                        tracing::warn!(item = %item.id, "taken over before recording done; judging again");
                        continue;
                    }
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
            }
            Attempt::Failed { ending, stderr, message } => {
                ctx.counters.attempts_failed.fetch_add(1, Ordering::Relaxed);
                let fingerprint = idem_core::error_fingerprint(&ending, &stderr);
                let (write, verdict) = held.failed(&fingerprint, &message, now_ms(), ctx.limit);
                match apply(&ctx.store, write).await {
                    Ok(_) => {}
                    Err(e) if e.is_precondition_failed() => continue,
                    Err(e) => return Err(format!("ledger write failed: {e}")),
                }
                let _ = apply(&ctx.store, held.release()).await;
                match verdict {
                    FailureVerdict::Retry => continue,
                    FailureVerdict::Poison => {
                        // It turned poison now: with --on-poison halt nothing new starts. One found poison by an
                        // earlier run (`Plan::Poison` above) halts nothing: it is a known fact, not a new failure,
                        // and halting every rerun before it ran anything would leave the rest undone for good.
                        if ctx.cfg.on_poison == OnPoison::Halt {
                            ctx.halt.store(true, Ordering::SeqCst);
                        }
                        break poisoned(ctx, item, held.attempt(), message);
                    }
                    FailureVerdict::Exhausted => break Final::Failed { attempts: held.attempt(), error: message },
                }
            }
            Attempt::Lost => {
                tracing::warn!(item = %item.id, "lease lost; the result of this attempt is discarded");
                continue;
            }
            Attempt::NotStarted => {
                // Stopped while it waited to start (the runner short of resources): nothing ran, so the claim is
                // undone as if it had never been made.
                let _ = unclaim(ctx, &held).await;
                break Final::NotDone { reason: "interrupted" };
            }
            Attempt::Interrupted => {
                // Killed by the operator (a second Ctrl-C, or SIGTERM), not by its own fault: the attempt is not
                // counted, so interrupting a run never uses up an item's retries (with `--retries 0` it would be
                // failed for good). But the entry says it was interrupted rather than going back to what it was:
                // the command may have written the final path itself, and with no entry that file would be
                // adopted as done. A crash still counts its attempts: the item may be what crashes the runner.
                let _ = apply(&ctx.store, held.interrupted(now_ms())).await;
                let _ = apply(&ctx.store, held.release()).await;
                break Final::NotDone { reason: "interrupted" };
            }
        }
    };
    if waiting {
        ctx.counters.waiting.fetch_sub(1, Ordering::Relaxed);
    }
    Ok(result)
}

/// Waits for a free slot while holding a claim made ahead, its lease renewed beside the wait (a slow command can
/// keep every slot for longer than a lease). `Err` when the run is stopping or the lease was lost (taken over,
/// or the ledger unreachable until it lapsed): the caller gives the claim back.
async fn wait_for_slot<'a, S: Store>(
    ctx: &'a Ctx<S>,
    held: &mut Held,
    heartbeat: &mut Heartbeat<'_, S>,
) -> Result<tokio::sync::SemaphorePermit<'a>, ()> {
    let permit = tokio::select! {
        p = ctx.jobs.acquire() => p.map_err(|_| ())?,
        () = heartbeat.until_lost(held) => return Err(()),
    };
    if ctx.stopping() {
        return Err(());
    }
    // The fence before the command starts: a lease set more than a third of its length ago is renewed first,
    // so a runner that was taken over meanwhile never starts the command.
    if !heartbeat.fence(held).await {
        return Err(());
    }
    Ok(permit)
}

/// Gives back a claim whose command never started: the entry as it was, then the lease. (One whose command
/// started is given back with [`Held::interrupted`] instead.)
async fn unclaim<S: Store>(ctx: &Ctx<S>, held: &Held) -> Result<(), StoreError> {
    apply(&ctx.store, held.unclaim()).await?;
    apply(&ctx.store, held.release()).await.map(|_| ())
}

/// Another runner holds the item: counts this one as waiting (once) and pauses a quarter lease (0.1..=2 s)
/// before the item is judged again. True when the run was interrupted meanwhile.
async fn wait_for_holder<S>(ctx: &Ctx<S>, waiting: &mut bool) -> bool {
    if !*waiting {
        *waiting = true;
        ctx.counters.waiting.fetch_add(1, Ordering::Relaxed);
    }
    let pause = (ctx.cfg.lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut stop = ctx.stop.subscribe();
    tokio::select! {
        () = tokio::time::sleep(pause) => false,
        () = stopped(&mut stop, 1) => true,
    }
}

/// Resolves once the stop level reaches `level` (never, if the stop handle is gone).
async fn stopped(rx: &mut watch::Receiver<u8>, level: u8) {
    if rx.wait_for(|l| *l >= level).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Records a poison item: one that turned poison in this run, or one an earlier run found poison, which is not
/// run again (only the first halts the run: see the `FailureVerdict::Poison` arm of [`process`]).
fn poisoned<S>(ctx: &Ctx<S>, item: &Item, attempts: u32, error: String) -> Final {
    ctx.poison.lock().unwrap_or_else(|p| p.into_inner()).push((item.id.clone(), error.clone()));
    Final::Poison { attempts, error }
}

enum Attempt {
    Ok(Digest256),
    Failed {
        ending: String,
        stderr: Vec<u8>,
        message: String,
    },
    Lost,
    /// The run stopped before the command could start: nothing ran.
    NotStarted,
    /// The command ran and was killed by a second Ctrl-C or SIGTERM: it may have written anything.
    Interrupted,
}

fn failed(ending: impl Into<String>, stderr: Vec<u8>) -> Attempt {
    let ending = ending.into();
    let text = String::from_utf8_lossy(&stderr);
    let last = text.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("");
    let message = if last.is_empty() { ending.clone() } else { format!("{ending}: {last}") };
    Attempt::Failed { ending, stderr, message }
}

/// Kills the command and everything it started (its process group), then reaps it.
/// A command's process group as the watchdog knows it: listed when made, unlisted when dropped.
struct Watched<'a> {
    watchdog: Option<&'a Watchdog>,
    pgid: Option<u32>,
}

impl<'a> Watched<'a> {
    fn new(watchdog: Option<&'a Watchdog>, pgid: Option<u32>) -> Self {
        if let (Some(w), Some(p)) = (watchdog, pgid) {
            w.started(p);
        }
        Self { watchdog, pgid }
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        if let (Some(w), Some(p)) = (self.watchdog, self.pgid) {
            w.ended(p);
        }
    }
}

async fn kill_group(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        // The child leads its own group (`process_group(0)`), so this also reaches the shell's children,
        // which would otherwise outlive it and keep writing.
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    let _ = child.kill().await;
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "unknown ending".into(),
    }
}

/// Descriptors the runner keeps for itself (ledger connections, runtime, watchdog, standard streams).
const RUNNER_FDS: u64 = 48;
/// Descriptors one running command can take at once: its pipes and pidfd, the spawn's own pipe, the output
/// opened to verify and fsync it, its directory.
const FDS_PER_JOB: u64 = 8;

/// `--jobs`, lowered (with a warning) to what the open-file limit (`ulimit -n`) leaves room for, as GNU
/// parallel does: past it, spawns, output checks and ledger reopenings fail with EMFILE, which must not be
/// blamed on items.
fn jobs_within_descriptor_limit(jobs: usize) -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
    let room = usize::try_from(limit.saturating_sub(RUNNER_FDS) / FDS_PER_JOB).unwrap_or(usize::MAX).max(1);
    if jobs > room {
        tracing::warn!(
            "only enough file descriptors (ulimit -n {limit}) for {room} command(s) at once: running {room}, \
             not {jobs}"
        );
        return room;
    }
    jobs
}

/// How long an attempt keeps trying to start its command while the runner is short of file descriptors or
/// processes, before it counts as the item's failure (a limit too low for even one command must end the run).
const SPAWN_PATIENCE: Duration = Duration::from_secs(30);

/// A spawn that failed for want of the runner's resources (descriptors, processes, memory), not the command's.
fn runner_short_of_resources(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e).is_some_and(|n| [Errno::MFILE, Errno::NFILE, Errno::AGAIN, Errno::NOMEM].contains(&n))
}

/// Keeps only the tail of a child's standard error: the last line is what the fingerprint needs.
const STDERR_TAIL: usize = 8 * 1024;

/// Keeps the last bytes of a command's standard error in `tail` (shared, so they can be taken before EOF).
async fn read_tail(mut stderr: tokio::process::ChildStderr, tail: Arc<std::sync::Mutex<Vec<u8>>>) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = stderr.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        tail.extend_from_slice(&buf[..n]);
        if tail.len() > 2 * STDERR_TAIL {
            let excess = tail.len() - STDERR_TAIL;
            tail.drain(..excess);
        }
    }
}

/// How long standard error may stay open after the command exited: a background process it started can hold
/// the pipe for ever, and the runner must not wait on it outside its timeout and heartbeat.
const STDERR_GRACE: Duration = Duration::from_millis(500);

fn substitute(arg: &str, id: &str, out: &Path, item: &str) -> String {
    if !arg.contains('{') {
        return arg.to_owned();
    }
    arg.replace("{id}", id).replace("{out}", &out.display().to_string()).replace("{item}", item)
}

/// One attempt at one held item: spawn, wait, verify, then rename into place while still holding the lease,
/// which `heartbeat` renews beside each of those steps.
async fn attempt<S: Store>(
    ctx: &Ctx<S>,
    held: &mut Held,
    heartbeat: &mut Heartbeat<'_, S>,
    item: &Item,
    output: &Path,
    permit: &mut Option<tokio::sync::SemaphorePermit<'_>>,
) -> Attempt {
    let temp = output::temp_path(output, &ctx.owner, held.attempt());
    // Inline, not on the blocking pool: a stat of an existing directory and a lookup of a file that is
    // usually absent take microseconds, less than the thread hand-off would.
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty())
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return failed("cannot create the output directory", e.to_string().into_bytes());
    }
    // The temporary path is unique to this process start and attempt, so it is almost never there: look
    // before unlinking, as an unlink takes the directory's lock even for a missing name (perf showed the
    // runner spinning on it while commands created files in the same directory).
    if std::fs::symlink_metadata(&temp).is_ok() {
        let _ = std::fs::remove_file(&temp);
    }
    let key = match idem_core::derive_key(&ctx.cfg.key_prefix, &item.id, item.raw.as_bytes()) {
        Ok(k) => k,
        Err(e) => return failed("cannot derive the idempotency key", e.to_string().into_bytes()),
    };
    let argv: Vec<String> = ctx.cfg.command.iter().map(|a| substitute(a, &item.id, &temp, &item.raw)).collect();
    let lease = held.lease();
    let (token, attempt_no) = (held.fencing_token().to_string(), held.attempt().to_string());
    let command = |program: Option<&Path>| {
        let mut cmd = match program {
            Some(path) => {
                let mut cmd = tokio::process::Command::new(path);
                cmd.arg0(&argv[0]);
                cmd
            }
            None => tokio::process::Command::new(&argv[0]),
        };
        cmd.args(&argv[1..])
            .env("IDEM_ITEM_ID", &item.id)
            .env("IDEM_OUTPUT", &temp)
            .env("IDEM_FENCING_TOKEN", &token)
            .env("IDEM_IDEMPOTENCY_KEY", key.as_str())
            .env("IDEM_ATTEMPT", &attempt_no)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own process group: a terminal's Ctrl-C reaches the runner only, which decides what to do.
            .process_group(0)
            .kill_on_drop(true);
        cmd
    };
    let mut cmd = command(ctx.program.as_deref());
    let mut stop = ctx.stop.subscribe();
    let mut backoff = Duration::from_millis(20);
    let patience = Instant::now() + SPAWN_PATIENCE;
    let mut child = loop {
        match cmd.spawn() {
            Ok(c) => break c,
            // The runner is short of file descriptors or processes (other commands hold them): not the item's
            // fault, so it must not count towards poison. Keep the slot (which also keeps one command fewer
            // running) and the claim, and try again as commands finish.
            Err(e) if runner_short_of_resources(&e) && Instant::now() < patience => {
                if !ctx.short_of_resources.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "cannot start {}: {e}; waiting for running commands to finish (lower --jobs or raise \
                         `ulimit -n` / `ulimit -u`)",
                        argv[0]
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopped(&mut stop, 1) => return Attempt::NotStarted,
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                if !heartbeat.fence(held).await {
                    return Attempt::Lost;
                }
            }
            // The program found at the start of the run is gone or changed: look it up again, as a shell would.
            Err(e) if ctx.program.is_some() && !runner_short_of_resources(&e) => {
                tracing::debug!("cannot start {}: {e}; looking it up in PATH again", argv[0]);
                cmd = command(None);
                match cmd.spawn() {
                    Ok(c) => break c,
                    Err(e) => return failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()),
                }
            }
            Err(e) => return failed(format!("cannot start {}", argv[0]), e.to_string().into_bytes()),
        }
    };
    // Listed with the watchdog from now until this attempt returns, on every path.
    let _watched = Watched::new(ctx.watchdog.as_ref(), child.id());
    if let Some(mut stdin) = child.stdin.take() {
        let mut input = item.raw.clone().into_bytes();
        input.push(b'\n');
        // A command that never reads its input closes the pipe; that is not an error.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await;
        });
    }
    let tail = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stderr_task = child.stderr.take().map(|s| tokio::spawn(read_tail(s, Arc::clone(&tail))));
    let stderr = || async {
        if let Some(mut task) = stderr_task
            && tokio::time::timeout(STDERR_GRACE, &mut task).await.is_err()
        {
            task.abort();
        }
        std::mem::take(&mut *tail.lock().unwrap_or_else(|p| p.into_inner()))
    };
    let deadline = ctx.cfg.timeout.map(|t| tokio::time::Instant::now() + t);
    // The lease is renewed beside the wait (not inside an arm of it), so a slow ledger never delays noticing
    // the command's exit, its timeout or a second Ctrl-C.
    let status = tokio::select! {
        status = child.wait() => status,
        () = heartbeat.until_lost(held) => {
            // Taken over, or the ledger unreachable until the lease lapsed: the item is no longer ours.
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Lost;
        }
        () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return failed("timeout", Vec::new());
        }
        () = stopped(&mut stop, 2) => {
            kill_group(&mut child).await;
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Interrupted;
        }
    };
    let stderr = stderr().await;
    let status = match status {
        Ok(s) => s,
        Err(e) => return failed("cannot wait for the command", e.to_string().into_bytes()),
    };
    if !status.success() {
        let _ = tokio::fs::remove_file(&temp).await;
        return failed(describe(status), stderr);
    }
    // The command is over: its slot goes to the next item while this output is verified, fsynced and renamed
    // (`--jobs` counts running commands, as GNU parallel's does). A failed command keeps its slot above, so a
    // failing item is retried, and found poison, before others start.
    *permit = None;
    // Without `--verify`, verifying, fsyncing and renaming take one trip to the blocking pool instead of two,
    // as long as the fence below holds when the rename comes (a lease set less than a third of its length ago).
    let fence_until = ctx.cfg.verify.is_none().then(|| heartbeat.sent() + lease / 3);
    let (path, checks, to, renamer) = (temp.clone(), ctx.checks.clone(), output.to_owned(), Arc::clone(&ctx.renamer));
    let mut finishing = tokio::task::spawn_blocking(move || {
        let digest =
            output::verify(&path, &checks).map_err(|why| Finish::Verify(format!("{why}: {}", why.remedy())))?;
        output::sync_file(&path).map_err(|e| Finish::Verify(format!("cannot fsync the output: {e}")))?;
        match fence_until {
            Some(until) if Instant::now() < until => {
                renamer.rename_into_place(&path, &to).map_err(|e| Finish::Rename(e.to_string()))?;
                Ok((digest, true))
            }
            _ => Ok((digest, false)),
        }
    });
    // Heartbeats go on while the output is read, digested and fsynced: a large output on a slow disk takes
    // longer than a short lease, and losing it there would discard every attempt. The blocking work cannot be
    // called off: a lease lost meanwhile is left to the fence before the rename, which then refuses.
    let finished = tokio::select! {
        done = &mut finishing => done,
        () = heartbeat.until_lost(held) => finishing.await,
    }
    .unwrap_or_else(|e| Err(Finish::Verify(e.to_string())));
    let digest = match finished {
        Ok((digest, true)) => return Attempt::Ok(digest),
        Ok((digest, false)) => digest,
        Err(Finish::Verify(why)) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed(format!("verify: {why}"), Vec::new());
        }
        Err(Finish::Rename(e)) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed("cannot rename the output into place", e.into_bytes());
        }
    };
    // `--verify` runs beside the heartbeat too; a lease lost meanwhile ends it (killed on drop).
    let verified = tokio::select! {
        verified = verify_cmd(ctx, &temp) => Some(verified),
        () = heartbeat.until_lost(held) => None,
    };
    match verified {
        Some(Ok(())) => {}
        Some(Err((ending, stderr))) => {
            let _ = tokio::fs::remove_file(&temp).await;
            return failed(ending, stderr);
        }
        None => {
            let _ = tokio::fs::remove_file(&temp).await;
            return Attempt::Lost;
        }
    }
    // The fence, checked right before the rename: the lease must have at least two thirds of its length left.
    // A lease set less than a third of its length ago certainly has (short commands need no extra write);
    // otherwise renew it, and a holder that was taken over (its renewal refused) never puts its output in
    // place. Only a pause of a whole lease between this check and the rename, a few instructions later, could
    // slip through; the done write is fenced as well, and the next run would see the digest differ.
    if !heartbeat.fence(held).await {
        let _ = tokio::fs::remove_file(&temp).await;
        return Attempt::Lost;
    }
    let (from, to, renamer) = (temp.clone(), output.to_owned(), Arc::clone(&ctx.renamer));
    let why = match tokio::task::spawn_blocking(move || renamer.rename_into_place(&from, &to)).await {
        Ok(Ok(())) => return Attempt::Ok(digest),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    // A rename that failed (the final path is a directory, say) must not leave the temporary file behind.
    let _ = tokio::fs::remove_file(&temp).await;
    failed("cannot rename the output into place", why.into_bytes())
}

/// Why finishing an output failed on the blocking pool.
enum Finish {
    /// It did not verify or could not be fsynced: the temporary file is removed.
    Verify(String),
    /// The rename failed.
    Rename(String),
}

/// Runs `--verify` on `path`; `Err` carries the ending and standard error when it refuses.
async fn verify_cmd<S>(ctx: &Ctx<S>, path: &Path) -> Result<(), (String, Vec<u8>)> {
    let Some(script) = &ctx.cfg.verify else { return Ok(()) };
    // Quoted for the shell: an output path is built from item text, which must never run as code.
    let quoted = format!("'{}'", path.display().to_string().replace('\'', "'\\''"));
    let script = script.replace("{out}", &quoted);
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("IDEM_OUTPUT", path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ("verify: cannot start sh".to_owned(), e.to_string().into_bytes()))?;
    if out.status.success() { Ok(()) } else { Err((format!("verify {}", describe(out.status)), out.stderr)) }
}
