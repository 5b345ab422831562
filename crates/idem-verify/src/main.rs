//! `idem-verify`: runs workloads against real idem processes under injected faults and checks their histories
//! (see the crate's documentation). Exit status: 0 nothing found, 1 an anomaly was found
//! (the failure page's path is printed), 2 bad usage or a run that could not be set up.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idem_verify::{Backend, FaultClass, HaFault, Lax, Options, Workload};

/// Record histories of real concurrent operations against idem under injected faults, and check them.
#[derive(Parser, Debug)]
#[command(name = "idem-verify")]
struct Cli {
    /// Backends to run on (repeatable; default sqlite, postgres and redis). The highly available ones
    /// (postgres-ha, redis-sentinel, redis-cluster: a primary and two replicas or standbys) run with one
    /// fault of theirs (--ha-fault).
    #[arg(long, value_enum)]
    backend: Vec<Backend>,
    /// Workloads to run (repeatable; default all four).
    #[arg(long, value_enum)]
    workload: Vec<Workload>,
    /// Seed for the clients' choices and the fault schedule (default: from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// How long each workload's clients run, e.g. `20s`, `5m`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    duration: Duration,
    /// Run without faults.
    #[arg(long)]
    no_faults: bool,
    /// On the highly available backends: without the durable setting (every standby synchronous on
    /// postgres-ha, wait_replicas=all on Redis), but with one (`one`, the default: FIRST 1 '*' on postgres-ha,
    /// wait_replicas=1 on Redis) or none (`none`: asynchronous, no wait_replicas). What the fault loses is
    /// then counted as losses (and anomalies).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "one")]
    no_durable: Option<Lax>,
    /// On the highly available backends: the fault (default: drawn from the seed and the workload):
    /// failover (primary killed), switchover (by command, old primary alive), replica-lag (a replica frozen,
    /// then a failover), replica-stop (a replica stopped, then a switchover), partition (old primary and one
    /// replica cut off from the rest: the other replica and the Sentinels, or on redis-cluster the other
    /// masters).
    #[arg(long, value_enum)]
    ha_fault: Option<HaFault>,
    /// On the highly available backends: when the fault starts, e.g. `20s` (default: drawn from the seed
    /// between a quarter and half of --duration).
    #[arg(long, value_parser = humantime::parse_duration)]
    failover_at: Option<Duration>,
    /// Off the highly available backends: draw faults from these classes only (comma-separated or repeated;
    /// default: every class the workload injects), e.g. `--faults store-outage,pause`. A class the workload
    /// never injects is refused (exit 2).
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<FaultClass>,
    /// Concurrent clients (KV, proxy), items (runner) or jobs (once); default 8, 6, 24 and 3.
    #[arg(long)]
    clients: Option<usize>,
    /// The idem binary (default: next to this one).
    #[arg(long)]
    idem: Option<PathBuf>,
    /// Where histories, logs and failure pages go (default: a new directory under the system's temporary one).
    /// A workload's directory left by an earlier run there is replaced.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Plant a bug in idem (builds with the feature planted-bugs only): kv-precondition, proxy-completion, proxy-fingerprint, runner-fence, runner-lapse-by-clock, once-overlap, once-missed-overwrite or once-trigger-overwrite.
    #[arg(long)]
    planted_bug: Option<String>,
}

fn main() -> ExitCode {
    // The runner workload's item command: `idem-verify exec-item ...` (not for people).
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("exec-item") {
        return idem_verify::runner::exec_item::main(&args[2..]);
    }
    // The once workload's slot command: `idem-verify exec-slot ...`.
    if args.get(1).map(String::as_str) == Some("exec-slot") {
        return idem_verify::once::exec_slot::main(&args[2..]);
    }
    match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => {
            let cli = Cli::parse();
            // Ctrl-C drops the run: the idem processes are killed on drop, the throw-away servers stopped and
            // the tmpfs unmounted by their owners' `Drop` (a kill -9 of the harness leaves them behind).
            let code = rt.block_on(async {
                tokio::select! {
                    code = verify(cli) => code,
                    _ = tokio::signal::ctrl_c() => {
                        eprintln!("idem-verify: interrupted; stopping the processes and servers it started");
                        ExitCode::from(130)
                    }
                    () = terminated() => {
                        eprintln!("idem-verify: terminated; stopping the processes and servers it started");
                        ExitCode::from(143)
                    }
                }
            });
            rt.shutdown_timeout(std::time::Duration::from_secs(10));
            code
        }
        Err(e) => {
            eprintln!("idem-verify: cannot start the runtime: {e}");
            ExitCode::from(2)
        }
    }
}

/// The faults a history records, one line each: kind, span (seconds into the run) and what was done with its
/// timings; so the report names the fault of a highly available run without opening the history.
fn ha_faults(history: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(history).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("type").and_then(|t| t.as_str()) == Some("fault"))
        .map(|v| {
            let s = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
            let us = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0) as f64 / 1e6;
            format!("{} {:.1}..{:.1} s: {}", s("kind"), us("start_us"), us("end_us"), s("detail"))
        })
        .collect()
}

/// SIGTERM (`timeout`, a CI runner giving up); never, where it cannot be watched.
async fn terminated() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            term.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

/// The bugs idem built with the feature planted-bugs can plant (`idem_core::planted`); another name would plant nothing and pass.
const PLANTED_BUGS: [&str; 8] = [
    "kv-precondition",
    "proxy-completion",
    "proxy-fingerprint",
    "runner-fence",
    "runner-lapse-by-clock",
    "once-overlap",
    "once-missed-overwrite",
    "once-trigger-overwrite",
];

async fn verify(cli: Cli) -> ExitCode {
    if let Some(bug) = &cli.planted_bug
        && !PLANTED_BUGS.contains(&bug.as_str())
    {
        eprintln!("idem-verify: no planted bug is called {bug}: one of {}", PLANTED_BUGS.join(", "));
        return ExitCode::from(2);
    }
    let idem = match cli.idem.clone().map(Ok).unwrap_or_else(idem_verify::procs::idem_next_to_me) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idem-verify: {e}");
            return ExitCode::from(2);
        }
    };
    let harness = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idem-verify: cannot find this executable: {e}");
            return ExitCode::from(2);
        }
    };
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1)
    });
    let out = cli.out.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("idem-verify-{seed}")));
    let backends = if cli.backend.is_empty() {
        vec![Backend::Sqlite, Backend::Postgres, Backend::Redis]
    } else {
        cli.backend.clone()
    };
    let workloads = if cli.workload.is_empty() {
        vec![Workload::Kv, Workload::Proxy, Workload::Runner, Workload::Once]
    } else {
        cli.workload.clone()
    };
    println!("idem-verify: seed {seed}, output in {}", out.display());
    let mut found = false;
    for &backend in &backends {
        for &workload in &workloads {
            let default_clients = match workload {
                Workload::Kv => 8,
                Workload::Proxy => 6,
                Workload::Runner => 24,
                Workload::Once => 3,
            };
            let opts = Options {
                backend,
                workload,
                seed,
                duration: cli.duration,
                faults: !cli.no_faults,
                idem: idem.clone(),
                harness: harness.clone(),
                out: out.join(format!("{}-{}", format!("{workload:?}").to_lowercase(), backend.name())),
                planted_bug: cli.planted_bug.clone(),
                clients: cli.clients.unwrap_or(default_clients),
                durable: cli.no_durable.is_none(),
                lax: cli.no_durable.unwrap_or_default(),
                ha_fault: cli.ha_fault,
                failover_at: cli.failover_at,
                only_faults: cli.faults.clone(),
            };
            match idem_verify::run(&opts).await {
                Ok(summary) if summary.histories == 0 => {
                    // Exit 0 says "nothing found"; a run that checked nothing must not say it.
                    eprintln!("idem-verify: {}: nothing was recorded to check (is --duration 0?)", summary.line());
                    return ExitCode::from(2);
                }
                Ok(summary) => {
                    println!("{}", summary.line());
                    if backend.is_ha() {
                        for fault in ha_faults(&summary.history) {
                            println!("  FAULT {fault}");
                        }
                    }
                    if !summary.losses.is_empty() {
                        let losses: Vec<String> = summary.losses.iter().map(|(k, n)| format!("{k} {n}")).collect();
                        println!("  LOSSES ({}): {}", summary.setting.as_deref().unwrap_or(""), losses.join(", "));
                    }
                    for a in summary.anomalies.iter().take(10) {
                        println!("  ANOMALY {}: {}: {}", a.kind, a.subject, a.detail);
                    }
                    if let Some(page) = &summary.failure_page {
                        println!("  failure page: {}", page.display());
                        println!("  history: {}", summary.history.display());
                        found = true;
                    }
                }
                Err(e) => {
                    eprintln!("idem-verify: {workload:?} on {backend:?}: {e}");
                    return ExitCode::from(2);
                }
            }
        }
    }
    if found { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
