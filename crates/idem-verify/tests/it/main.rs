//! The harness in CI: a short run of every workload on every backend under faults finds nothing, and each
//! planted bug is caught. One test binary with a test runner of its own (`libtest-mimic`: the same names,
//! filters, `--list` and output as cargo's) so that it runs [`TEST_THREADS`] tests at once unless
//! `--test-threads` says otherwise: a run mostly waits (on a failover manager's timers, a lease, a paused
//! process; the machine was 85 to 95% idle with two at once), and cargo's own runner would run as many as there
//! are cores. At most [`MAX_RUNS`] runs are under way at once, planted-bug seeds included ([`RUNS`]; each run
//! starts its own servers and idem processes): more would stretch the timings the faults are planned around.
//!
//! PostgreSQL and Redis runs start throw-away servers (`idem-testkit`) and skip with a printed reason when
//! their programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set. The `idem` binary must be built
//! (`cargo test --workspace` builds it; alone: `cargo build -p idem --bin idem` first). The planted-bug tests
//! build their own `idem` with the test-only feature `planted-bugs` (`planted::idem_with_planted_bugs`), in a
//! target directory of its own: nothing in the workspace's own build turns that feature on.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod failover;
mod once_bugs;
mod planted;
mod workloads;

use std::process::ExitCode;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use idem_verify::{Backend, Error, HaFault, Lax, Options, Summary, Workload};
use libtest_mimic::{Arguments, Trial};

/// Each test by its path, as cargo's runner names them (`workloads::kv_sqlite`).
macro_rules! trials {
    ($($module:ident :: $test:ident),* $(,)?) => {
        vec![$(Trial::test(concat!(stringify!($module), "::", stringify!($test)), || {
            $module::$test();
            Ok(())
        })),*]
    };
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    if args.test_threads == Some(0) {
        // libtest-mimic would start no thread and wait for ever; cargo's runner refuses it too.
        eprintln!("error: --test-threads must be at least 1");
        return ExitCode::from(101);
    }
    if args.test_threads.is_none() {
        // libtest-mimic reads only the flag; cargo's runner reads the variable too (0 there: the default). The
        // variable is set for every test binary (`.ci/run`: eight): here it may lower the count, not raise it,
        // since the tests beside the four checker runs start servers and processes of their own.
        let from_env = std::env::var("RUST_TEST_THREADS").ok().and_then(|n| n.parse().ok()).filter(|&n| n > 0);
        args.test_threads = Some(from_env.unwrap_or(TEST_THREADS).min(TEST_THREADS));
    }
    let mut trials = trials![
        failover::proxy_redis_sentinel_failover_with_wait_loses_nothing,
        failover::kv_redis_sentinel_switchover_with_wait_all_loses_nothing,
        failover::proxy_postgres_ha_replica_lag_loses_nothing,
        failover::kv_redis_cluster_replica_stop_loses_nothing,
        failover::kv_postgres_ha_partition_loses_nothing,
        failover::kv_redis_sentinel_partition_seed_1_loses_nothing,
        failover::proxy_redis_sentinel_switchover_executes_nothing_twice,
        failover::kv_redis_cluster_partition_loses_nothing,
        once_bugs::an_invocation_on_a_sqlite_store_locked_past_its_busy_timeout_exits_75_not_2,
        once_bugs::an_invocation_whose_postgres_closes_the_connection_at_login_exits_75_not_2,
        once_bugs::pause_until_a_duration_on_a_store_slow_to_answer_is_not_bad_usage,
        once_bugs::an_invocation_whose_redis_never_answers_the_tls_handshake_exits_75_not_2,
        planted::kv_precondition_is_caught,
        planted::proxy_completion_is_caught,
        planted::runner_fence_is_caught,
        planted::proxy_fingerprint_is_caught,
        planted::runner_lapse_by_clock_is_caught,
        planted::once_missed_overwrite_is_caught,
        planted::once_overlap_is_caught,
        planted::once_trigger_overwrite_is_caught,
        workloads::kv_sqlite,
        workloads::kv_postgres,
        workloads::kv_redis,
        workloads::runner_sqlite,
        workloads::runner_postgres,
        workloads::runner_redis,
        workloads::once_sqlite,
        workloads::once_postgres,
        workloads::once_redis,
        workloads::proxy_sqlite_fresh_seed,
        workloads::proxy_postgres_fresh_seed,
        workloads::proxy_redis_fresh_seed,
        workloads::proxy_postgres_seed_that_executed_a_reused_key,
        workloads::proxy_redis_seed_that_executed_a_reused_key,
        workloads::faults_the_workload_never_injects_are_refused,
    ];
    let listed: Vec<String> = trials.iter().map(|t| t.name().to_owned()).collect();
    trials.push(Trial::test("harness::every_test_function_is_listed", move || every_test_is_listed(&listed)));
    libtest_mimic::run(&args, trials).exit_code()
}

/// A test is a `pub(crate) fn name() {` of a module file beside this one; one missing from [`main`]'s list
/// would never run, and nothing else would say so. Nor would a `#[test]` (or `#[tokio::test]`) function, which
/// this runner does not see: both fail here.
fn every_test_is_listed(listed: &[String]) -> Result<(), libtest_mimic::Failed> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it");
    // Spelt in two parts so that this file does not match itself.
    let attribute = ["test", "]"].concat();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let Some(module) =
            path.file_stem().and_then(|m| m.to_str()).filter(|_| path.extension() == Some("rs".as_ref()))
        else {
            continue;
        };
        let source = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
        for (n, line) in source.lines().enumerate() {
            let line = line.trim();
            if line.starts_with("#[") && line.ends_with(&attribute) {
                missing.push(format!("{module}.rs:{}: {line} (this runner lists tests; write `pub(crate) fn`)", n + 1));
            }
            let Some(name) = line.strip_prefix("pub(crate) fn ").and_then(|l| l.strip_suffix("() {")) else { continue };
            if module != "main" && !listed.iter().any(|t| *t == format!("{module}::{name}")) {
                missing.push(format!("{module}::{name}"));
            }
        }
    }
    if missing.is_empty() { Ok(()) } else { Err(format!("never run: {missing:?}").into()) }
}

/// Runs under way in this binary, at most [`MAX_RUNS`]; [`Turn`] waits for a place.
static RUNS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());
/// How many runs may be under way at once.
const MAX_RUNS: usize = 4;
/// How many tests run at once when `--test-threads` does not say (`RUST_TEST_THREADS` may say fewer).
const TEST_THREADS: usize = 4;

/// A place among the [`MAX_RUNS`] runs, given back on drop.
struct Turn;

impl Turn {
    fn take() -> Self {
        let (count, freed) = &RUNS;
        let mut n = count.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while *n >= MAX_RUNS {
            n = freed.wait(n).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *n += 1;
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let (count, freed) = &RUNS;
        *count.lock().unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
        freed.notify_one();
    }
}

/// Runs `workload` on `backend` for `seconds` with faults (and `planted`, a planted bug), on a runtime of its
/// own; `None` when the backend's server programs are missing (skipped with a printed reason). The history,
/// logs and failure page are in the returned directory, removed when it drops (`keep()` it to look).
fn run(
    backend: Backend,
    workload: Workload,
    seconds: u64,
    seed: u64,
    planted: Option<&str>,
) -> Option<(Summary, tempfile::TempDir)> {
    run_durable(backend, workload, seconds, seed, planted, true)
}

/// [`run`], with or without the durable setting of a highly available backend (`Options::durable`).
fn run_durable(
    backend: Backend,
    workload: Workload,
    seconds: u64,
    seed: u64,
    planted: Option<&str>,
    durable: bool,
) -> Option<(Summary, tempfile::TempDir)> {
    run_ha(backend, workload, seconds, seed, planted, durable, None)
}

/// [`run_durable`] with the fault of a highly available backend named (`Options::ha_fault`).
fn run_ha(
    backend: Backend,
    workload: Workload,
    seconds: u64,
    seed: u64,
    planted: Option<&str>,
    durable: bool,
    ha_fault: Option<HaFault>,
) -> Option<(Summary, tempfile::TempDir)> {
    run_with(backend, workload, seconds, seed, planted, |opts| {
        opts.durable = durable;
        opts.ha_fault = ha_fault;
    })
}

/// [`run`] with the options `tweak` changes.
fn run_with(
    backend: Backend,
    workload: Workload,
    seconds: u64,
    seed: u64,
    planted: Option<&str>,
    tweak: impl FnOnce(&mut Options),
) -> Option<(Summary, tempfile::TempDir)> {
    // Built before taking a place: the first planted-bug test may build that idem for minutes.
    let idem = match planted {
        Some(_) => planted::idem_with_planted_bugs(),
        None => idem_verify::procs::idem_next_to_me().unwrap_or_else(|e| panic!("{e}")),
    };
    let _turn = Turn::take();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let mut opts = Options {
        backend,
        workload,
        seed,
        duration: Duration::from_secs(seconds),
        faults: true,
        idem,
        harness: env!("CARGO_BIN_EXE_idem-verify").into(),
        out: out.join(format!("{}-{}", format!("{workload:?}").to_lowercase(), backend.name())),
        planted_bug: planted.map(str::to_owned),
        clients: match workload {
            Workload::Kv => 8,
            Workload::Proxy => 6,
            Workload::Runner => 24,
            Workload::Once => 3,
        },
        durable: true,
        lax: Lax::One,
        ha_fault: None,
        failover_at: None,
        only_faults: Vec::new(),
    };
    tweak(&mut opts);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    match rt.block_on(idem_verify::run(&opts)) {
        Ok(summary) => {
            eprintln!("{}", summary.line());
            Some((summary, dir))
        }
        Err(Error::Setup(why)) if std::env::var_os("IDEM_TEST_REQUIRE_BACKENDS").is_none() => {
            eprintln!("skipped: {why}");
            None
        }
        Err(e) => panic!("{workload:?} on {backend:?} could not be set up: {e}"),
    }
}
