//! The harness in CI: a short run of every workload on every backend under faults finds nothing, and each
//! planted bug is caught. One test binary; the runs take turns (each starts its own servers and idem
//! processes, and two at once on 2 cores would stretch the timings the faults are planned around).
//!
//! PostgreSQL and Redis runs start throw-away servers (`idem-testkit`) and skip with a printed reason when
//! their programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set. The `idem` binary must be built
//! (`cargo test --workspace` builds it; alone: `cargo build -p idem --bin idem` first). The planted-bug tests
//! build their own `idem` with the test-only feature `planted-bugs` (`planted::idem_with_planted_bugs`), in a
//! target directory of its own: nothing in the workspace's own build turns that feature on.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod failover;
mod planted;
mod workloads;

use std::sync::Mutex;
use std::time::Duration;

use idem_verify::{Backend, Error, HaFault, Lax, Options, Summary, Workload};

/// One run at a time in this binary.
static TURN: Mutex<()> = Mutex::new(());

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
    let _turn = TURN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let idem = match planted {
        Some(_) => planted::idem_with_planted_bugs(),
        None => idem_verify::procs::idem_next_to_me().unwrap_or_else(|e| panic!("{e}")),
    };
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
