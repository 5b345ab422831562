//! The harness in CI: a short run of every workload on every backend under faults finds nothing, and each
//! planted bug is caught. One test binary; at most two runs at a time ([`RUNS`]; each starts its own servers
//! and idem processes). A run mostly waits (on a failover manager's timers, a lease, a paused process), so two
//! at once halve the binary's time; more would stretch the timings the faults are planned around on 2 cores.
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

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use idem_verify::{Backend, Error, HaFault, Lax, Options, Summary, Workload};

/// Runs under way in this binary, at most [`MAX_RUNS`]; [`Turn`] waits for a place.
static RUNS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());
/// How many runs may be under way at once.
const MAX_RUNS: usize = 2;

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
    // Built before taking a place: the first planted-bug test may build that idem for minutes.
    let idem = match planted {
        Some(_) => planted::idem_with_planted_bugs(),
        None => idem_verify::procs::idem_next_to_me().unwrap_or_else(|e| panic!("{e}")),
    };
    let _turn = Turn::take();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let opts = Options {
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
        durable,
        lax: Lax::One,
        ha_fault,
        failover_at: None,
    };
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
