//! A primary with two streaming standbys (idem-testkit's [`PostgresHa`]): `synchronous_standbys=all` refuses a
//! primary whose commits wait for one standby of two (`synchronous_standby_names = '*'`, which is `FIRST 1`:
//! once that standby is promoted with the old primary still running, the other one acknowledges commits that
//! are then lost), and under `ANY 2` a switchover with the old primary still taking commits loses no
//! acknowledged write. Skips when the PostgreSQL programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is
//! set.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_postgres::PostgresStore;
use idem_store::conformance::writes_through_failover;
use idem_store::{Limits, error_chain};
use idem_testkit::{PostgresHa, Replication};

fn schema() -> String {
    format!("idem_test_{:016x}", rand::random::<u64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_standbys_all_refuses_a_primary_that_waits_for_one_of_two_standbys() {
    let Some(ha) = PostgresHa::start_with(Replication::Synchronous, 2) else { return };
    let err =
        PostgresStore::connect(&ha.url("synchronous_standbys=all"), &schema(), Limits::default()).await.unwrap_err();
    let chain = error_chain(&err);
    assert!(matches!(err, idem_postgres::Error::NotSynchronous { standbys: 2, waited: 1, .. }), "{chain}");
    assert!(chain.contains("synchronous_standby_names='*'") && chain.contains("ANY 2"), "{chain}");
    assert!(!err.is_unavailable());
    // Without the parameter the same primary is served (with a warning and the gauge).
    PostgresStore::connect(&ha.url(""), &schema(), Limits::default()).await.expect("served, with a warning");
    let err =
        PostgresStore::connect(&ha.url("synchronous_standbys=some"), &schema(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, idem_postgres::Error::InvalidSynchronous(_)), "{}", error_chain(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_with_the_old_primary_running_loses_no_write_when_every_standby_is_synchronous() {
    let Some(ha) = PostgresHa::start_with(Replication::AllStandbys, 2) else { return };
    let store =
        PostgresStore::connect(&ha.url("connect_timeout=2&synchronous_standbys=all"), &schema(), Limits::default())
            .await
            .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    let promoted = ha.standby_ports[0];
    let ha = Arc::new(Mutex::new(ha));
    let set = Arc::clone(&ha);
    // The operator promotes a standby and fences the old primary a second later; meanwhile the old primary
    // takes commits, which wait for a standby that no longer follows it.
    let tally = writes_through_failover(&store, 8, move || {
        set.lock().unwrap().switchover(promoted, Duration::from_secs(1));
    })
    .await;
    eprintln!("{tally:?}");
    assert_eq!(ha.lock().unwrap().primary_now(), promoted);
    assert_eq!(
        (tally.present, tally.lost.len()),
        (tally.acknowledged, 0),
        "acknowledged writes lost: {:?}",
        tally.lost
    );
}
