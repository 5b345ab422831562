//! A short run of each workload on each backend, faults on: histories recorded, faults injected, nothing
//! found. (`scripts/verify.sh` runs the same for longer; RELIABILITY.md has its figures.)

use idem_verify::{Backend, Workload};

use crate::run;

/// Seconds of client activity per run: enough for several faults of each kind the workload draws.
const SECONDS: u64 = 8;

fn clean(backend: Backend, workload: Workload) {
    let Some((s, dir)) = run(backend, workload, SECONDS, 7, None) else { return };
    if !s.anomalies.is_empty() {
        // Kept for a look: the failure page and the history are named in the message below.
        let _ = dir.keep();
    }
    assert!(s.operations > 0, "{}: nothing was recorded", s.line());
    assert!(s.histories > 0, "{}: nothing was checked", s.line());
    assert!(s.faults.values().sum::<usize>() > 0, "{}: no fault was injected", s.line());
    assert!(
        s.anomalies.is_empty(),
        "{}\n{:#?}\nfailure page: {:?}\nhistory: {}",
        s.line(),
        s.anomalies,
        s.failure_page,
        s.history.display()
    );
}

#[test]
fn kv_sqlite() {
    clean(Backend::Sqlite, Workload::Kv);
}

#[test]
fn kv_postgres() {
    clean(Backend::Postgres, Workload::Kv);
}

#[test]
fn kv_redis() {
    clean(Backend::Redis, Workload::Kv);
}

#[test]
fn proxy_sqlite() {
    clean(Backend::Sqlite, Workload::Proxy);
}

#[test]
fn proxy_postgres() {
    clean(Backend::Postgres, Workload::Proxy);
}

#[test]
fn proxy_redis() {
    clean(Backend::Redis, Workload::Proxy);
}

#[test]
fn runner_sqlite() {
    clean(Backend::Sqlite, Workload::Runner);
}

#[test]
fn runner_postgres() {
    clean(Backend::Postgres, Workload::Runner);
}

#[test]
fn runner_redis() {
    clean(Backend::Redis, Workload::Runner);
}
