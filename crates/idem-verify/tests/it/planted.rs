//! Each planted bug (through `IDEM_PLANTED_BUG`, in an `idem` built with the test-only feature `planted-bugs`)
//! is reported by the checker of the workload it breaks, with a failure page. Whether a short run meets the
//! bug's window depends on the schedule, so each gets up to three seeds (all at once); a checker that never
//! reports it fails the test.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use idem_verify::{Backend, Workload};

use crate::run;

/// The `idem` binary built with the feature `planted-bugs`, once per test run: `cargo build` into
/// `<target>/planted`, beside the workspace's own build (whose `idem` must ignore `IDEM_PLANTED_BUG`, so the
/// feature cannot be on there; a target directory of its own keeps the two builds from replacing each other's
/// binary and from waiting on each other's lock).
pub(crate) fn idem_with_planted_bugs() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let workspace_idem = idem_verify::procs::idem_next_to_me().unwrap_or_else(|e| panic!("{e}"));
            // `<target>/debug/idem` -> `<target>/planted`.
            let target = workspace_idem.parent().and_then(|debug| debug.parent()).expect("a target directory");
            let target = target.join("planted");
            let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.toml");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let status = Command::new(cargo)
                .args(["build", "--locked", "--quiet", "-p", "idem", "--bin", "idem", "--features", "planted-bugs"])
                .arg("--manifest-path")
                .arg(manifest)
                .env("CARGO_TARGET_DIR", &target)
                .status()
                .expect("running cargo build");
            assert!(status.success(), "cargo build -p idem --features planted-bugs failed: {status}");
            target.join("debug").join("idem")
        })
        .clone()
}

fn caught(backend: Backend, workload: Workload, bug: &str, seconds: u64) {
    caught_within(backend, workload, bug, seconds, &[1, 2, 3]);
}

/// [`caught`] with the seeds to try, three at a time (at once), in order, until one reports the bug.
fn caught_within(backend: Backend, workload: Workload, bug: &str, seconds: u64, seeds: &[u64]) {
    for pair in seeds.chunks(3) {
        let runs = std::thread::scope(|scope| {
            let runs: Vec<_> = pair
                .iter()
                .map(|&seed| scope.spawn(move || run(backend, workload, seconds, seed, Some(bug))))
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).collect::<Vec<_>>()
        });
        for (seed, r) in pair.iter().zip(runs) {
            let Some((s, _dir)) = r else { return };
            if !s.anomalies.is_empty() {
                let page = s.failure_page.expect("an anomaly comes with a failure page");
                assert!(page.is_file(), "no failure page at {}", page.display());
                let html = std::fs::read_to_string(&page).unwrap();
                assert!(html.contains(&s.anomalies[0].subject), "the page does not show {}", s.anomalies[0].subject);
                return;
            }
            eprintln!("seed {seed}: {bug} not met in {seconds} s; another seed");
        }
    }
    panic!("the planted bug {bug} was not reported by the {workload:?} checker on {backend:?} in {} runs", seeds.len());
}

/// The compare-and-swap skipped: a conditional put overwrites a newer version.
pub(crate) fn kv_precondition_is_caught() {
    caught(Backend::Sqlite, Workload::Kv, "kv-precondition", 5);
}

/// The completion written without its fence: a proxy paused past its lease overwrites the record of the
/// execution that took over. 20 s a seed: since a holder is judged dead only after a whole lease of
/// observation, a takeover needs a longer pause than before, and 12 s schedules (seeds 1-3) no longer met it.
/// Whether a pause lands while a proxy holds a key is timing: seeds 1-3 all missed it once in CI (2026-12-05,
/// a loaded machine; they had caught it the run before), so up to six are tried.
pub(crate) fn proxy_completion_is_caught() {
    caught_within(Backend::Sqlite, Workload::Proxy, "proxy-completion", 20, &[1, 2, 3, 4, 5, 6]);
}

/// The fence not checked before the rename: a runner paused past its lease puts its output over the output
/// of the runner that took over.
pub(crate) fn runner_fence_is_caught() {
    caught(Backend::Redis, Workload::Runner, "runner-fence", 10);
}

/// The body left out of the fingerprint: a reused key with another body is answered from the record instead
/// of 422 (the proxy workload's reused-key probe; found missing by a break-it review).
pub(crate) fn proxy_fingerprint_is_caught() {
    caught(Backend::Sqlite, Workload::Proxy, "proxy-fingerprint", 8);
}

/// A lapsed lease judged by the store's clock alone (the claim gate's watching skipped): after a store outage
/// or a pause longer than a lease, runners claim over each other's items whose holders are alive and take them
/// again, so items run twice and the shared ledger's work is multiplied. 20 s a seed: the schedule must draw a
/// store outage or a pause (seeds 1 and 2 on SQLite do), and a runner must be mid-item when it lapses, which
/// timing decides: one seed in two or three catches it, and three seeds all missed it in two runs in a row
/// (2026-12-05, the same binary catching it on the next try), so up to six are tried.
pub(crate) fn runner_lapse_by_clock_is_caught() {
    caught_within(Backend::Sqlite, Workload::Runner, "runner-lapse-by-clock", 20, &[1, 2, 3, 4, 5, 6]);
}

/// Slots passed over recorded missed without the create-only precondition: the slot before each new one, done,
/// is overwritten `missed` (the once checker's "missed but ran").
pub(crate) fn once_missed_overwrite_is_caught() {
    caught(Backend::Sqlite, Workload::Once, "once-missed-overwrite", 6);
}

/// The earlier slots' live leases not looked at under a policy other than allow: a slot starts beside a
/// longer one before it (the first job's policy is skip or a buffer one, its commands up to 2.8 s on a 2 s
/// schedule).
pub(crate) fn once_overlap_is_caught() {
    caught(Backend::Sqlite, Workload::Once, "once-overlap", 8);
}

/// A trigger's request written over whatever the id holds: the same id sent again after its run started
/// requests it again, and it runs twice.
pub(crate) fn once_trigger_overwrite_is_caught() {
    caught(Backend::Redis, Workload::Once, "once-trigger-overwrite", 10);
}
