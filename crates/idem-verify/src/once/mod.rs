//! The once workload: a few cron jobs (`--every 2s`), each invoked over and over by several concurrent
//! `idem once` processes sharing one store, each job under an overlap policy drawn from the seed (and, drawn
//! too, `--catchup-window` and `--jitter`); on PostgreSQL and Redis one invoker of each job runs under
//! libfaketime with its clock seconds off. A controller mixes in `idem once pause` (until a time, or resumed),
//! `trigger` (each id sent several times) and `backfill`. Every slot's command is `idem-verify exec-slot`,
//! which logs its start, its ticks and its end. The nemesis kills (kill -9) and pauses (SIGSTOP) invocations,
//! half the pauses aimed at the one whose command started last, and takes the store away (outages, restarts,
//! a broken or slow link; a failover on the highly available backends). At the end every job is resumed, the
//! invocations still going finish, one more invocation per job runs what was left pending, and
//! `idem once status` and `list` are read; then [`check`].

pub mod check;
pub mod exec_slot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::backend::StoreEnv;
use crate::faults::{self, Kind, Runners, Targets};
use crate::history::{Clock, Micros};
use crate::{Backend, Error, Options, Summary};

/// The lease of every invocation; pauses last four to seven times as long.
pub const LEASE: Duration = Duration::from_secs(1);
/// The schedule's period (`--every`); commands take [`MIN_MS`] to [`MAX_MS`], some longer than it, so the
/// overlap policies have runs to judge.
pub const PERIOD_S: u64 = 2;
/// The shortest command, in milliseconds.
pub const MIN_MS: u64 = 300;
/// The longest command, in milliseconds.
pub const MAX_MS: u64 = 2800;
/// Concurrent invokers of each job.
const INVOKERS: usize = 3;
/// The namespace of every invocation: `b0`, as the runner's first batch, so a Cluster's failover strikes the
/// master serving the workload's hash tag (`{b0:}`).
const NAMESPACE: &str = "b0";
/// The overlap policies a job draws from.
pub const POLICIES: [&str; 6] = ["allow", "skip", "buffer-one", "buffer-all", "cancel-other", "terminate-other"];
/// Where libfaketime may be.
const FAKETIME_LIBS: [&str; 2] =
    ["/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"];

/// One job of the run and how it is invoked.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobPlan {
    /// Its name.
    pub name: String,
    /// `--overlap`.
    pub policy: String,
    /// `--catchup-window`, when drawn.
    pub catchup: Option<String>,
    /// `--jitter`, when drawn.
    pub jitter: Option<String>,
    /// Per invoker, the offset of its clock in seconds (libfaketime), 0 for none.
    pub skew_s: Vec<i64>,
}

/// One `idem once` process (an invocation of a job's slot).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Invocation {
    /// The job.
    pub job: String,
    /// Its label, with its pid (the nemesis names its target so).
    pub label: String,
    /// Its process id.
    pub pid: u32,
    /// The offset of its clock (libfaketime), in seconds.
    pub skew_s: i64,
    /// When it was started and when it ended.
    pub start_us: Micros,
    /// When it ended.
    pub end_us: Micros,
    /// Its exit code; `None` when a signal killed it.
    pub code: Option<i32>,
    /// One of the final rounds, after the faults.
    pub drain: bool,
}

/// One `idem once pause|resume|trigger|backfill`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Control {
    /// The job.
    pub job: String,
    /// `pause`, `resume`, `trigger` or `backfill`.
    pub what: String,
    /// The trigger's id.
    pub id: Option<String>,
    /// When it was started.
    pub start_us: Micros,
    /// When it ended.
    pub end_us: Micros,
    /// Its exit code.
    pub code: Option<i32>,
    /// What it printed (standard output, then standard error).
    pub out: String,
}

/// Everything a run recorded, for [`check`].
#[derive(Debug, Default)]
pub struct Record {
    /// The jobs.
    pub jobs: Vec<JobPlan>,
    /// The executions log.
    pub log: PathBuf,
    /// `/proc/uptime` at the run's start, in microseconds: the executions' times less this are the run's.
    pub uptime0_us: u64,
    /// Every invocation.
    pub invocations: Vec<Invocation>,
    /// Every control command.
    pub controls: Vec<Control>,
    /// `idem once status --format json` of each job, at the end.
    pub status: BTreeMap<String, serde_json::Value>,
    /// `idem once list --format json`, at the end.
    pub list: serde_json::Value,
}

/// What the invokers and the controller share.
#[derive(Clone)]
struct Shared {
    opts: Options,
    clock: Clock,
    store_url: String,
    log: PathBuf,
    runners: Runners,
    invocations: Arc<Mutex<Vec<Invocation>>>,
    controls: Arc<Mutex<Vec<Control>>>,
    faketime: Option<PathBuf>,
}

/// Runs the once workload on `opts.backend` and checks it.
///
/// # Errors
/// When the store cannot be started or an invocation cannot be spawned.
pub async fn run(opts: &Options) -> Result<Summary, Error> {
    let clock = Clock::new();
    let uptime0_us = exec_slot::uptime_us().ok_or_else(|| Error::Setup("cannot read /proc/uptime".into()))?;
    let store = StoreEnv::start(opts.backend, false, opts.durable, opts.lax).await?;
    let store_url = store.url("once");
    let store = Arc::new(tokio::sync::Mutex::new(store));
    let runners: Runners = Arc::default();
    {
        let mut set = runners.lock().unwrap_or_else(|e| e.into_inner());
        set.log = Some(opts.out.join("executions.jsonl"));
    }
    let faketime = FAKETIME_LIBS.iter().map(PathBuf::from).find(|p| p.is_file());
    let jobs = plan_jobs(opts.seed, opts.clients, opts.backend != Backend::Sqlite && faketime.is_some());
    let shared = Shared {
        opts: opts.clone(),
        clock: clock.clone(),
        store_url,
        log: opts.out.join("executions.jsonl"),
        runners: Arc::clone(&runners),
        invocations: Arc::default(),
        controls: Arc::default(),
        faketime,
    };
    let kinds = if opts.faults { fault_kinds(opts.backend) } else { Vec::new() };
    let targets =
        Targets { serves: Vec::new(), store: Arc::clone(&store), upstream: None, runners: Some(runners), lease: LEASE };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let gap = (Duration::from_millis(700), Duration::from_millis(2000));
    let nemesis = faults::spawn(opts, kinds, targets, clock.clone(), gap, stopped.clone())?;
    let mut tasks = Vec::new();
    for job in &jobs {
        for i in 0..INVOKERS {
            let (shared, job, stopped) = (shared.clone(), job.clone(), stopped.clone());
            tasks.push(tokio::spawn(async move { invoker(&shared, &job, i, stopped).await }));
        }
    }
    let controller = tokio::spawn(controller(shared.clone(), jobs.clone(), stopped));
    tokio::time::sleep(opts.duration).await;
    let _ = stop.send(true);
    let _ = nemesis.await;
    let _ = controller.await;
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            return Err(e);
        }
    }
    finish(&shared, &jobs).await?;
    let record = Record {
        status: read_status(&shared, &jobs).await,
        list: read_json(&shared, &["once".into(), "list".into(), "--format".into(), "json".into()]).await,
        jobs,
        log: shared.log.clone(),
        uptime0_us,
        invocations: std::mem::take(&mut *shared.invocations.lock().unwrap_or_else(|e| e.into_inner())),
        controls: std::mem::take(&mut *shared.controls.lock().unwrap_or_else(|e| e.into_inner())),
    };
    drop(store);
    Ok(check::summarize(opts, &clock, &record))
}

/// The jobs (`clients` of them, at least 2), each with a policy, catch-up window and jitter drawn from the seed;
/// the first job's policy is one that forbids overlap (`skip`, `buffer-one`, `buffer-all`), so every run checks
/// it. With `skew`, the last invoker of each job gets a clock offset drawn from -3, +2, +4 and +8 s.
pub fn plan_jobs(seed: u64, clients: usize, skew: bool) -> Vec<JobPlan> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6f6e_6365_6a6f_6273);
    (0..clients.max(2))
        .map(|j| {
            let policy = if j == 0 { POLICIES[rng.random_range(1..4)] } else { POLICIES[rng.random_range(0..6)] };
            let mut skew_s = vec![0; INVOKERS];
            if skew {
                skew_s[INVOKERS - 1] = [-3, 2, 4, 8][rng.random_range(0..4)];
            }
            JobPlan {
                name: format!("j{j}"),
                policy: policy.into(),
                catchup: rng.random_bool(0.5).then(|| "6s".to_owned()),
                jitter: rng.random_bool(0.3).then(|| "700ms".to_owned()),
                skew_s,
            }
        })
        .collect()
}

fn fault_kinds(backend: Backend) -> Vec<Kind> {
    // Pauses and kills of invocations holding a slot put the leases, the watchdog and the fences to the test;
    // store outages on every backend (a locked SQLite file, a stopped server).
    let mut kinds = vec![Kind::PauseRunner, Kind::PauseRunner, Kind::PauseRunner, Kind::Kill9Runner, Kind::Kill9Runner];
    kinds.push(Kind::StoreOutage);
    if backend != Backend::Sqlite {
        kinds.extend([Kind::StoreRestart, Kind::StoreNetDrop, Kind::StoreNetDelay]);
    }
    kinds
}

/// The arguments of one invocation of `job`.
fn once_args(s: &Shared, job: &JobPlan) -> Vec<String> {
    let mut args: Vec<String> =
        ["once", "--name", &job.name, "--every", &format!("{PERIOD_S}s")].iter().map(|a| (*a).to_owned()).collect();
    args.extend(["--lease".into(), format!("{}s", LEASE.as_secs()), "--retries".into(), "8".into()]);
    args.extend(["--overlap".into(), job.policy.clone(), "--store".into(), s.store_url.clone()]);
    args.extend(["--namespace".into(), NAMESPACE.into()]);
    if let Some(w) = &job.catchup {
        args.extend(["--catchup-window".into(), w.clone()]);
    }
    if let Some(j) = &job.jitter {
        args.extend(["--jitter".into(), j.clone()]);
    }
    args.extend(["--".into(), s.opts.harness.display().to_string(), "exec-slot".into()]);
    args.extend(["--log".into(), s.log.display().to_string(), "--job".into(), job.name.clone()]);
    args.extend(["--seed".into(), s.opts.seed.to_string(), "--min".into(), MIN_MS.to_string()]);
    args.extend(["--max".into(), MAX_MS.to_string()]);
    args
}

/// A command for an idem process of the run: the planted bug (if any) in its environment, the clock offset
/// `skew_s` through libfaketime (the monotonic clock left alone: a holder measures its lease by it).
fn idem_command(s: &Shared, args: &[String], skew_s: i64) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&s.opts.idem);
    cmd.args(args).env_remove(crate::procs::PLANTED_BUG_VAR).envs(crate::idem_env(&s.opts)).stdin(Stdio::null());
    if let (Some(lib), true) = (&s.faketime, skew_s != 0) {
        cmd.env("LD_PRELOAD", lib).env("FAKETIME", format!("{skew_s:+}")).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    cmd.kill_on_drop(true);
    cmd
}

/// One invoker of `job`: invokes it again and again (as cron on one machine, only more often) until `stop`.
async fn invoker(s: &Shared, job: &JobPlan, i: usize, stop: tokio::sync::watch::Receiver<bool>) -> Result<(), Error> {
    let mut rng = StdRng::seed_from_u64(s.opts.seed ^ (i as u64 + 1) << 8 ^ job.name.len() as u64);
    let args = once_args(s, job);
    let log = s.opts.out.join(format!("invoker-{}-{i}.log", job.name));
    // Started apart, so the first invocations do not all come at once.
    tokio::time::sleep(Duration::from_millis(150 * i as u64)).await;
    while !*stop.borrow() {
        let label = format!("idem once {} #{i}", job.name);
        invoke(s, job, &args, &log, &label, job.skew_s[i], false).await?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..700))).await;
    }
    Ok(())
}

/// Runs one invocation to its end and records it.
async fn invoke(
    s: &Shared,
    job: &JobPlan,
    args: &[String],
    log: &Path,
    label: &str,
    skew_s: i64,
    drain: bool,
) -> Result<(), Error> {
    let stderr = std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| Error::io("log", e))?;
    let mut child = idem_command(s, args, skew_s)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| Error::io("starting idem once", e))?;
    let pid = child.id().unwrap_or(0);
    let start_us = s.clock.now();
    let label = format!("{label} (pid {pid})");
    if !drain {
        s.runners.lock().unwrap_or_else(|e| e.into_inner()).alive.push((label.clone(), pid));
    }
    let status = child.wait().await.map_err(|e| Error::io("waiting for idem once", e))?;
    s.runners.lock().unwrap_or_else(|e| e.into_inner()).alive.retain(|(_, p)| *p != pid);
    let inv = Invocation {
        job: job.name.clone(),
        label,
        pid,
        skew_s,
        start_us,
        end_us: s.clock.now(),
        code: status.code(),
        drain,
    };
    s.invocations.lock().unwrap_or_else(|e| e.into_inner()).push(inv);
    Ok(())
}

/// Runs `idem ARGS` to its end (30 s at most) and records it as a control command of `job`.
async fn control(s: &Shared, job: &str, what: &str, id: Option<&str>, args: &[String]) {
    let start_us = s.clock.now();
    let out = tokio::time::timeout(Duration::from_secs(30), idem_command(s, args, 0).output()).await;
    let (code, text) = match out {
        Ok(Ok(o)) => {
            (o.status.code(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
        }
        Ok(Err(e)) => (None, format!("cannot run idem: {e}")),
        Err(_) => (None, "no answer within 30 s".to_owned()),
    };
    let c = Control {
        job: job.to_owned(),
        what: what.to_owned(),
        id: id.map(str::to_owned),
        start_us,
        end_us: s.clock.now(),
        code,
        out: text,
    };
    s.controls.lock().unwrap_or_else(|e| e.into_inner()).push(c);
}

/// `idem once WHAT --name JOB --store … --namespace …` and `extra`.
fn control_args(s: &Shared, what: &str, job: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec!["once".into(), what.into(), "--name".into(), job.into()];
    args.extend(["--store".into(), s.store_url.clone(), "--namespace".into(), NAMESPACE.into()]);
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args
}

/// Mixes pauses, resumes, triggers (each id sent four times, the last a few seconds later) and backfills in,
/// one every 1.2 to 2.5 s, until `stop`; returns once the triggers' repeats are sent.
async fn controller(s: Shared, jobs: Vec<JobPlan>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut rng = StdRng::seed_from_u64(s.opts.seed ^ 0x636f_6e74_726f_6c00);
    let mut repeats = Vec::new();
    // The jobs exist once their first invocations came.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for n in 0.. {
        let wait = Duration::from_millis(rng.random_range(1200..2500));
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let job = jobs[rng.random_range(0..jobs.len())].name.clone();
        // The first one a trigger: every run sends one id again after its run began.
        match if n == 0 { 0 } else { rng.random_range(0..5) } {
            0 | 1 => {
                let id = format!("tr-{n}");
                let args = control_args(&s, "trigger", &job, &["--id", &id]);
                let s = s.clone();
                repeats.push(tokio::spawn(async move {
                    for wait_ms in [0, 300, 1200, 3000] {
                        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                        control(&s, &job, "trigger", Some(&id), &args).await;
                    }
                }));
            }
            2 => {
                let note = format!("verify-{n}");
                control(&s, &job, "pause", None, &control_args(&s, "pause", &job, &["--until", "3s", "--note", &note]))
                    .await;
            }
            3 => {
                control(&s, &job, "pause", None, &control_args(&s, "pause", &job, &[])).await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(800..2500))).await;
                control(&s, &job, "resume", None, &control_args(&s, "resume", &job, &[])).await;
            }
            _ => {
                let args = control_args(&s, "backfill", &job, &["--from", "14s", "--to", "4s"]);
                control(&s, &job, "backfill", None, &args).await;
            }
        }
    }
    for r in repeats {
        let _ = r.await;
    }
}

/// After the faults: every job resumed, the leases of killed holders left to lapse, then one invocation per
/// job (it runs its slot, then what was requested and left pending).
async fn finish(s: &Shared, jobs: &[JobPlan]) -> Result<(), Error> {
    for job in jobs {
        control(s, &job.name, "resume", None, &control_args(s, "resume", &job.name, &[])).await;
    }
    tokio::time::sleep(LEASE * 2).await;
    // The jobs side by side (they share nothing). One round: with every lease of a killed holder lapsed and no
    // other invocation, each runs its slot, then every requested slot and triggered run left pending.
    for round in 0..1 {
        let mut all = Vec::new();
        for job in jobs {
            let (s, job) = (s.clone(), job.clone());
            all.push(tokio::spawn(async move {
                let log = s.opts.out.join(format!("drain-{}.log", job.name));
                let label = format!("idem once {} drain {round}", job.name);
                invoke(&s, &job, &once_args(&s, &job), &log, &label, 0, true).await
            }));
        }
        for r in all {
            r.await.map_err(|e| Error::Start(format!("a final invocation's task failed: {e}")))??;
        }
    }
    Ok(())
}

/// `idem once status --format json` of each job (`null` when it could not be read).
async fn read_status(s: &Shared, jobs: &[JobPlan]) -> BTreeMap<String, serde_json::Value> {
    let mut all = BTreeMap::new();
    for job in jobs {
        let args = control_args(s, "status", &job.name, &["--format", "json", "--limit", "100"]);
        all.insert(job.name.clone(), read_json(s, &args).await);
    }
    all
}

/// The JSON `idem ARGS` prints (`null` when it exits otherwise than 0 or prints something else); `once list`
/// gets the store's flags.
async fn read_json(s: &Shared, args: &[String]) -> serde_json::Value {
    let mut args = args.to_vec();
    if args.get(1).map(String::as_str) == Some("list") {
        args.extend(["--store".into(), s.store_url.clone(), "--namespace".into(), NAMESPACE.into()]);
    }
    match idem_command(s, &args, 0).output().await {
        Ok(o) if o.status.success() => serde_json::from_slice(&o.stdout).unwrap_or_default(),
        Ok(o) => {
            eprintln!(
                "idem-verify: idem {} exited {:?}: {}",
                args.join(" "),
                o.status.code(),
                String::from_utf8_lossy(&o.stderr)
            );
            serde_json::Value::Null
        }
        Err(e) => {
            eprintln!("idem-verify: idem {}: {e}", args.join(" "));
            serde_json::Value::Null
        }
    }
}
