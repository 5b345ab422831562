//! A replication setting that can lose acknowledged writes in a failover is said at start-up: `idem serve` on a
//! Sentinel set with two replicas and `wait_replicas=1`, or on a PostgreSQL primary whose commits wait for one
//! standby of two, logs a warning naming the durable setting and reports the replicas a write does not wait for
//! in the `idem_store_replicas_unwaited` gauge; with the durable setting the gauge is 0 and nothing is logged.

use std::time::Duration;

use idem_testkit::{PostgresHa, RedisSentinel, Replication};

use crate::common::{Server, client};

/// The gauge's value on `/metrics` of the server at `url`.
async fn unwaited(url: &str) -> String {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("idem_store_replicas_unwaited "))
        .unwrap_or_else(|| panic!("no idem_store_replicas_unwaited in:\n{text}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_below_the_replica_count_is_warned_about_and_gauged() {
    let Some(set) = RedisSentinel::start_with_replicas(2) else { return };
    let weak = Server::start(&["--store", &set.url("wait_replicas=1")], &[]);
    let log = weak.wait_for_log("has 2 replicas and a write waits for 1", 1, Duration::from_secs(10));
    assert!(log.contains("wait_replicas=all"), "{log}");
    assert_eq!(unwaited(&weak.url).await, "1");
    let durable = Server::start(&["--store", &set.url("wait_replicas=all")], &[]);
    assert_eq!(unwaited(&durable.url).await, "0");
    let put = client().put(format!("{}/v1/kv/k", durable.url)).body("v").send().await.unwrap();
    assert_eq!(put.status(), 201);
    // Said at start-up (INFO), and no warning: both warnings name "(wait_replicas)".
    let log = durable.wait_for_log("has 2 replicas; a write waits for 2", 1, Duration::from_secs(10));
    assert!(!log.contains("(wait_replicas)"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_waiting_for_one_standby_of_two_is_warned_about_and_gauged() {
    let Some(ha) = PostgresHa::start_with(Replication::Synchronous, 2) else { return };
    let s = Server::start(&["--store", &ha.url("")], &[]);
    let log = s.wait_for_log("a commit waits for 1 of 2 PostgreSQL standbys", 1, Duration::from_secs(10));
    assert!(log.contains("ANY 2"), "{log}");
    assert_eq!(unwaited(&s.url).await, "1");
    let (code, _, err) =
        crate::common::idem(&["serve", "--listen", "127.0.0.1:0", "--store", &ha.url("synchronous_standbys=all")], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("synchronous_standbys=all: a commit waits for 1 of 2 standbys"), "{err}");
}

/// `synchronous_standby_names` naming no connected standby (the names must be the standbys'
/// `application_name`; `pg_basebackup -R` writes none, so every standby calls itself `walreceiver`): every
/// commit waits for ever, and idem says so at start-up instead of hanging without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_names_that_match_no_standby_are_said_at_start_up() {
    let Some(ha) = PostgresHa::start_with(Replication::AllStandbys, 2) else { return };
    let url = ha.url("");
    // The schema exists first (migrating it would wait too, after the warning).
    drop(Server::start(&["--store", &url], &[]));
    let primary = format!("postgres://postgres@127.0.0.1:{}/postgres", ha.primary_port);
    let (admin, connection) = tokio_postgres::connect(&primary, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    admin.batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'ANY 2 (nosuch1, nosuch2)'").await.unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    // The reload is asynchronous: wait until the primary counts no standby as synchronous.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let sql = "SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')";
    while admin.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) > 0 {
        assert!(std::time::Instant::now() < deadline, "the new synchronous_standby_names never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = Server::start(&["--store", &url], &[]);
    let log = s.wait_for_log("commits wait", 1, Duration::from_secs(10));
    assert!(log.contains("asks for 2 standbys and 0 connected standbys count as synchronous"), "{log}");
    assert!(log.contains("s1, s2"), "the connected standbys' names: {log}");
}
