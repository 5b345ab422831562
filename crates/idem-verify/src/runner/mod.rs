//! The runner workload: overlapping `idem run` processes on one item list, sharing a ledger (an SQLite file, or
//! the PostgreSQL or Redis server), each item's command logging its execution; the nemesis pauses runners
//! beyond the lease and kills them (a killed runner is replaced; one that exits is not: its exit is a
//! finding), makes the store unavailable for seconds (every backend), and on PostgreSQL and Redis also restarts
//! the server and breaks the link. A watcher reads the final outputs as they appear. Batch after batch (a fresh job
//! each) until the run's time is up; then [`check`].

pub mod check;
pub mod exec_item;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backend::StoreEnv;
use crate::faults::{self, Kind, Runners, Targets};
use crate::history::{Clock, Micros};
use crate::{Backend, Error, Options, Summary};

/// The lease of every runner; pauses last two to four times as long.
pub const LEASE: Duration = Duration::from_secs(1);
/// Runners per batch.
const RUNNERS: usize = 3;

/// One batch: a job of its own (output template, items, execution log).
#[derive(Debug)]
pub struct Batch {
    /// Its number.
    pub n: usize,
    /// The items' ids.
    pub items: Vec<String>,
    /// The output directory (`{id}.json` files).
    pub out: PathBuf,
    /// The executions logged by the items' commands.
    pub log: PathBuf,
    /// How each runner process ended: label, pid, exit code (`None`: killed by a signal), and when it started
    /// and ended.
    pub exits: Vec<Exit>,
    /// Token changes seen at a final path, in order: (item, token, µs).
    pub seen: Vec<(String, u64, Micros)>,
    /// What `idem run --dry-run` listed afterwards (items that would still run), and its exit code.
    pub dry_run: (String, Option<i32>),
    /// Whether the runners had not finished the batch within [`BATCH_LIMIT`] (they were killed).
    pub timed_out: bool,
}

/// How long a batch may take: its commands take 2 to 3.5 s each, a few at a time; anything near this is a
/// runner that does not finish. A batch of many items gets [`batch_limit`].
pub const BATCH_LIMIT: Duration = Duration::from_secs(90);

/// How long a batch of `items` may take: [`BATCH_LIMIT`], or twice what its commands take back to back on the
/// runners' 12 slots (3 runners, 4 jobs each), 3.5 s each at most, when that is longer (500 items: 292 s).
pub fn batch_limit(items: usize) -> Duration {
    let slots = u64::try_from(RUNNERS * JOBS).unwrap_or(12);
    let ms = u64::try_from(items).unwrap_or(u64::MAX).saturating_mul(3500 * 2) / slots;
    BATCH_LIMIT.max(Duration::from_millis(ms))
}

/// Jobs (`--jobs`) of each runner.
const JOBS: usize = 4;

/// How one `idem run` process ended.
#[derive(Clone, Debug)]
pub struct Exit {
    /// Its label (slot, batch, pid).
    pub label: String,
    /// Its exit code; `None` when a signal killed it.
    pub code: Option<i32>,
    /// When it started.
    pub start_us: Micros,
    /// When it ended.
    pub end_us: Micros,
}

/// Runs the runner workload on `opts.backend` and checks it.
///
/// # Errors
/// When the store cannot be started or a runner cannot be spawned.
pub async fn run(opts: &Options) -> Result<Summary, Error> {
    let clock = Clock::new();
    let wall0 = wall_ms();
    let store = StoreEnv::start(opts.backend, false, opts.durable, opts.lax).await?;
    let ledger = store.url("ledger");
    let store = Arc::new(tokio::sync::Mutex::new(store));
    let runners: Runners = Arc::default();
    let kinds = if opts.faults { fault_kinds(opts.backend) } else { Vec::new() };
    let targets = Targets {
        serves: Vec::new(),
        store: Arc::clone(&store),
        upstream: None,
        runners: Some(Arc::clone(&runners)),
        lease: LEASE,
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let gap = (Duration::from_millis(700), Duration::from_millis(2000));
    let nemesis = faults::spawn(opts, kinds, targets, clock.clone(), gap, stopped)?;
    let me = opts.harness.clone();
    let deadline = Instant::now() + opts.duration;
    let mut batches = Vec::new();
    loop {
        let n = batches.len();
        let batch = run_batch(opts, &clock, &me, &ledger, &runners, n).await?;
        batches.push(batch);
        if Instant::now() >= deadline {
            break;
        }
    }
    let _ = stop.send(true);
    let _ = nemesis.await;
    Ok(check::summarize(opts, &clock, wall0, &batches))
}

fn fault_kinds(backend: Backend) -> Vec<Kind> {
    // Pauses beyond the lease put the fences to the test: weighted up.
    // Store outages (a stopped PostgreSQL, a killed Redis, a locked SQLite ledger) on every backend: a runner
    // must wait them out, neither exiting nor failing an item.
    let mut kinds = vec![
        Kind::PauseRunner,
        Kind::PauseRunner,
        Kind::PauseRunner,
        Kind::PauseRunner,
        Kind::Kill9Runner,
        Kind::StoreOutage,
    ];
    // (The highly available backends' one fault is the failover: `faults::spawn`.)
    if backend != Backend::Sqlite {
        kinds.extend([Kind::StoreRestart, Kind::StoreNetDrop, Kind::StoreNetDelay]);
    }
    kinds
}

/// Milliseconds since the Unix epoch.
pub fn wall_ms() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(0)
}

/// The arguments of `idem run` for batch `n`.
fn run_args(me: &Path, ledger: &str, dir: &Path, n: usize) -> Vec<String> {
    let s = |p: PathBuf| p.display().to_string();
    let mut args: Vec<String> = vec![
        "run".into(),
        "--items".into(),
        s(dir.join("items.txt")),
        "--output".into(),
        s(dir.join("out/{id}.json")),
        "--store".into(),
        ledger.into(),
        "--namespace".into(),
        format!("b{n}"),
        "--lease".into(),
        format!("{}s", LEASE.as_secs()),
        "--jobs".into(),
        JOBS.to_string(),
        "--retries".into(),
        "1000".into(),
        "--".into(),
        s(me.to_owned()),
        "exec-item".into(),
        "--log".into(),
        s(dir.join("executions.jsonl")),
        "--id".into(),
        "{id}".into(),
        "--out".into(),
        "{out}".into(),
        "--ms".into(),
    ];
    // Commands of 1.5 to 3 s: longer than the lease, so a runner paused mid-command is taken over while its
    // command still runs, and its output arrives after the takeover.
    args.push("{id}".into());
    args
}

/// Runs one batch: writes its items, starts the runners (replacing killed ones) until one of them finishes
/// the list and none is left running, watches the outputs meanwhile, then dry-runs the job once more.
async fn run_batch(
    opts: &Options,
    clock: &Clock,
    me: &Path,
    ledger: &str,
    runners: &Runners,
    n: usize,
) -> Result<Batch, Error> {
    let dir = opts.out.join(format!("batch-{n}"));
    std::fs::create_dir_all(dir.join("out")).map_err(|e| Error::io("making a batch directory", e))?;
    // The id doubles as the command's duration in ms (the last argument is `{id}`): 2000..3500.
    let items: Vec<String> = (0..opts.clients).map(|i| format!("{}", 2000 + (i * 997 + n * 131) % 1500)).collect();
    let mut unique = items.clone();
    unique.sort();
    unique.dedup();
    std::fs::write(dir.join("items.txt"), unique.join("\n") + "\n").map_err(|e| Error::io("writing items", e))?;
    let args = run_args(me, ledger, &dir, n);
    {
        let mut set = runners.lock().unwrap_or_else(|e| e.into_inner());
        set.log = Some(dir.join("executions.jsonl"));
        set.batch = n;
    }
    let watching = Arc::new(Mutex::new(Vec::new()));
    let (stop_watch, watch_rx) = tokio::sync::watch::channel(false);
    let watcher = tokio::spawn(watch(dir.join("out"), clock.clone(), Arc::clone(&watching), watch_rx));
    let exits = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut slots = Vec::new();
    for r in 0..RUNNERS {
        let (opts, args, runners, exits, done) =
            (opts.clone(), args.clone(), Arc::clone(runners), Arc::clone(&exits), Arc::clone(&done));
        let clock = clock.clone();
        let log = dir.join(format!("runner-{r}.log"));
        slots.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300 * r as u64)).await;
            let label = format!("idem run #{r} of batch {n}");
            slot(clock, &opts, &args, &runners, &exits, &done, &log, r, label).await
        }));
    }
    let all = async {
        for s in &mut slots {
            let _ = s.await;
        }
    };
    let timed_out = tokio::time::timeout(batch_limit(unique.len()), all).await.is_err();
    if timed_out {
        // Runners that never finish are a finding, not a reason to hang: stop them and every slot.
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let alive = runners.lock().unwrap_or_else(|e| e.into_inner()).alive.clone();
        for (_, pid) in alive {
            crate::procs::signal(pid, "KILL").await;
        }
        for s in slots {
            let _ = s.await;
        }
    }
    let _ = stop_watch.send(true);
    let _ = watcher.await;
    let dry_run = dry_run(opts, &args).await?;
    let exits = std::mem::take(&mut *exits.lock().unwrap_or_else(|e| e.into_inner()));
    let seen = std::mem::take(&mut *watching.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Batch {
        n,
        items: unique,
        out: dir.join("out"),
        log: dir.join("executions.jsonl"),
        exits,
        seen,
        dry_run,
        timed_out,
    })
}

/// One runner slot: runs `idem run` again after each kill, until a run of it (or of another slot) ended with
/// every item done, or it exited with another status (not replaced: see [`check`]). Each run writes its report
/// to `report-<slot>-<start>.json` beside the slot's log.
#[allow(clippy::too_many_arguments)] // the batch's shared state, each piece used once
async fn slot(
    clock: Clock,
    opts: &Options,
    args: &[String],
    runners: &Runners,
    exits: &Mutex<Vec<Exit>>,
    done: &std::sync::atomic::AtomicBool,
    log: &Path,
    slot_no: usize,
    label: String,
) -> Result<(), Error> {
    use std::sync::atomic::Ordering;
    for start in 0.. {
        if done.load(Ordering::SeqCst) {
            return Ok(());
        }
        let stderr =
            std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| Error::io("runner log", e))?;
        // Its report names each item's status: an item failed (its command never fails) is a finding.
        let report = log.with_file_name(format!("report-{slot_no}-{start}.json"));
        let mut args = args.to_vec();
        args.splice(1..1, ["--report".to_owned(), report.display().to_string()]);
        let mut child = tokio::process::Command::new(&opts.idem)
            .args(&args)
            .env_remove(crate::procs::PLANTED_BUG_VAR)
            .envs(crate::idem_env(opts))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("starting idem run", e))?;
        let pid = child.id().unwrap_or(0);
        let start_us = opts_clock_now(&clock);
        let name = format!("{label} (pid {pid})");
        runners.lock().unwrap_or_else(|e| e.into_inner()).alive.push((name.clone(), pid));
        let status = child.wait().await.map_err(|e| Error::io("waiting for idem run", e))?;
        runners.lock().unwrap_or_else(|e| e.into_inner()).alive.retain(|(_, p)| *p != pid);
        let exit = Exit { label: name, code: status.code(), start_us, end_us: opts_clock_now(&clock) };
        exits.lock().unwrap_or_else(|e| e.into_inner()).push(exit);
        match status.code() {
            Some(0) => {
                done.store(true, Ordering::SeqCst);
                return Ok(());
            }
            // Killed by the nemesis: start another, as a supervisor would. One that keeps dying must not spin.
            None if start < 20 => tokio::time::sleep(Duration::from_millis(200)).await,
            // A runner that exited (a store outage must not end it) is not replaced: the checker reports it,
            // and the batch is finished by the other slots or found not done.
            _ => return Ok(()),
        }
    }
    Ok(())
}

fn opts_clock_now(clock: &Clock) -> Micros {
    clock.now()
}

/// Reads every final output every 20 ms and records each change of the fencing token found there.
async fn watch(
    out: PathBuf,
    clock: Clock,
    seen: Arc<Mutex<Vec<(String, u64, Micros)>>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        if let Ok(entries) = std::fs::read_dir(&out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(id) = name.strip_suffix(".json").filter(|n| !n.starts_with('.')) else { continue };
                let Ok(bytes) = std::fs::read(e.path()) else { continue };
                let Ok(output) = serde_json::from_slice::<exec_item::Output>(&bytes) else { continue };
                if last.get(id) != Some(&output.token) {
                    last.insert(id.to_owned(), output.token);
                    seen.lock().unwrap_or_else(|e| e.into_inner()).push((id.to_owned(), output.token, clock.now()));
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// `idem run --dry-run` with the batch's arguments: what would still run (nothing, when every item is done
/// and its output has the recorded digest).
async fn dry_run(opts: &Options, args: &[String]) -> Result<(String, Option<i32>), Error> {
    let mut dry: Vec<String> = args.to_vec();
    dry.insert(1, "--dry-run".into());
    let out = tokio::process::Command::new(&opts.idem)
        .args(&dry)
        .env_remove(crate::procs::PLANTED_BUG_VAR)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| Error::io("idem run --dry-run", e))?;
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), out.status.code()))
}
