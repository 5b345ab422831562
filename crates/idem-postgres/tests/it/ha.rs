//! A primary with a streaming standby (idem-testkit's [`PostgresHa`], on free ports), reached through libpq's
//! multi-host URL form: the conformance suite passes on it, and a failover (the primary killed with SIGKILL, the
//! standby promoted) in the middle of concurrent writes loses no acknowledged write under synchronous
//! replication; requests during the switch fail as unavailable (503), then the store serves again by itself.
//! Skips when the PostgreSQL programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_postgres::PostgresStore;
use idem_store::conformance::writes_through_failover;
use idem_store::error_chain;
use idem_store::{Limits, Precondition, Store, Ttl};
use idem_testkit::{PostgresHa, Replication};

static PAIR: Mutex<Weak<PostgresHa>> = Mutex::new(Weak::new());

fn schema() -> String {
    format!("idem_test_{:016x}", rand::random::<u64>())
}

async fn multi_host_store() -> Option<(PostgresStore, Arc<PostgresHa>)> {
    let ha = idem_testkit::shared(&PAIR, || PostgresHa::start(Replication::Synchronous))?;
    let store = PostgresStore::connect(&ha.url("connect_timeout=2"), &schema(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect to the primary through the multi-host URL: {}", error_chain(&e)));
    Some((store, ha))
}

mod multi_host {
    idem_store::conformance_tests!(super::multi_host_store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_listed_first_is_passed_over_for_the_primary() {
    let Some(ha) = idem_testkit::shared(&PAIR, || PostgresHa::start(Replication::Synchronous)) else { return };
    // The standby first: a read-write session is found on the second host.
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?connect_timeout=2",
        ha.standby_port, ha.primary_port
    );
    let store = PostgresStore::connect(&url, &schema(), Limits::default()).await.expect("connect");
    store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.expect("a write lands on the primary");
    // Only the standby: no host takes writes, said at start-up.
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=2", ha.standby_port);
    let err = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, idem_postgres::Error::Server(_)), "{}", error_chain(&err));
    assert!(error_chain(&err).contains("does not allow writes"), "{}", error_chain(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_listed_first_is_passed_over_for_the_promoted_standby() {
    // Review finding: a first host that accepts connections and never answers (a frozen machine) held every
    // new connection until the pool gave up; the promoted standby listed second was never tried.
    let Some(mut ha) = PostgresHa::start(Replication::Asynchronous) else { return };
    ha.freeze_primary();
    ha.promote();
    // Without the per-host timeout this is a connect timeout: the frozen host held the whole attempt.
    let store = PostgresStore::connect(&ha.url("connect_timeout=2"), &schema(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect past the frozen primary: {}", error_chain(&e)));
    store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.expect("a write lands on the promoted standby");
    ha.thaw_primary();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_synchronous_replication_loses_no_acknowledged_write() {
    let Some(ha) = PostgresHa::start(Replication::Synchronous) else { return };
    let store = PostgresStore::connect(&ha.url("connect_timeout=2"), &schema(), Limits::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {}", error_chain(&e)));
    let ha = Arc::new(Mutex::new(ha));
    let pair = Arc::clone(&ha);
    // In the middle of the writes the primary's machine dies; an operator (or Patroni) promotes the standby.
    let tally = writes_through_failover(&store, 8, move || {
        let mut ha = pair.lock().unwrap();
        ha.kill_primary();
        std::thread::sleep(Duration::from_millis(300));
        ha.promote();
        // The promoted standby asks for a synchronous standby of its own (the setting is the same on every
        // server): its commits wait until the old primary is rebuilt as one, as an operator would.
        ha.rejoin();
    })
    .await;
    eprintln!("{tally:?}");
    assert!(tally.unavailable > 0, "no write saw the switch: the failover did not happen under load");
    assert_eq!((tally.present, tally.lost.len()), (tally.acknowledged, 0), "acknowledged writes lost");
}

/// Only standbys answering (every host read-only: a failover between the old primary's demotion and the new
/// one's promotion) is an outage, not a bad URL: `is_unavailable`, so `idem run` waits and `idem once` exits 75
/// instead of 2 (the checker's postgres-ha replica-lag run, seed 217997855, met it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_standbys_answering_is_unavailable() {
    let Some(ha) = idem_testkit::shared(&PAIR, || PostgresHa::start(Replication::Synchronous)) else { return };
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        ha.standby_port
    );
    let Err(e) = PostgresStore::connect(&url, &schema(), Limits::default()).await else {
        panic!("a standby alone opened as a read-write store");
    };
    assert!(e.is_unavailable(), "a standby alone is not unavailable: {}", error_chain(&e));
}
