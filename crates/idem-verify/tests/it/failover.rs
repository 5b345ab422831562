//! The failover fault through the checker (CI-sized): the proxy workload on a Redis primary and two replicas
//! under three Sentinels, with `wait_replicas=all`, the master killed (SIGKILL) mid-run and a replica elected
//! in its place. Every acknowledged claim and outcome survives, so nothing may be found and nothing counted lost;
//! requests during the switch are answered 503 and then served. (That a loss is reported as an anomaly and
//! counted is proven on planted histories: `idem-verify`'s `proxy::check` tests. RELIABILITY.md has the
//! longer runs of all three setups, with and without the durable setting.)

use idem_verify::{Backend, HaFault, Workload};

use crate::run_ha;

#[test]
fn proxy_redis_sentinel_failover_with_wait_loses_nothing() {
    let Some((s, dir)) = run_ha(Backend::RedisSentinel, Workload::Proxy, 10, 7, None, true, Some(HaFault::Failover))
    else {
        return;
    };
    if !s.anomalies.is_empty() {
        let _ = dir.keep();
    }
    assert_eq!(s.setting.as_deref(), Some("wait_replicas=all"), "{}", s.line());
    assert_eq!(s.faults.get("failover"), Some(&1), "{}: no failover was injected", s.line());
    let history = std::fs::read_to_string(&s.history).unwrap();
    assert!(!history.contains("\"detail\":\"failed"), "the failover itself failed: {}", s.history.display());
    assert!(s.histories > 0 && s.operations > 0, "{}: nothing was checked", s.line());
    // The switch was seen under load: the store refused while the Sentinels elected the replica and the old
    // master came back as its replica (WAIT 1 cannot be met before), and the requests were served after it.
    assert!(s.notes.get("503 answers").copied().unwrap_or(0) > 0, "{}: no request saw the switch", s.line());
    assert!(
        s.anomalies.is_empty(),
        "{}\n{:#?}\nfailure page: {:?}\nhistory: {}",
        s.line(),
        s.anomalies,
        s.failure_page,
        s.history.display()
    );
    assert_eq!(
        (s.losses.get("executions repeated"), s.losses.get("acknowledged writes missing")),
        (Some(&0), Some(&0)),
        "{}",
        s.line()
    );
}
