//! A server that answers a connection with "not now" (SQLSTATE 57P03: starting up, in recovery, shutting
//! down) is unavailable for a while, not misconfigured: `idem run` waits for it as for a refused connection.
//! Before, opening the store during a restart's recovery exited 2 ("the database system is not yet accepting
//! connections"), which the runner workload of `scripts/verify.sh` caught on a PostgreSQL restart.

use idem_postgres::PostgresStore;
use idem_store::Limits;
use idem_testkit::Postgres;

#[tokio::test]
async fn a_server_shutting_down_is_unavailable_not_a_bad_url() {
    let Some(mut pg) = Postgres::start() else { return };
    let url = pg.url("127.0.0.1", "sslmode=disable");
    // A session of our own keeps the smart shutdown waiting: meanwhile every new connection is refused 57P03.
    let held = crate::connect(&url).await;
    pg.begin_smart_shutdown();
    let mut refused = None;
    for _ in 0..50 {
        match PostgresStore::connect(&url, "shutdown_test", Limits::default()).await {
            Err(e) if e.to_string().contains("cannot connect") => {
                refused = Some(e);
                break;
            }
            Err(e) => panic!("unexpected error: {e:?}"),
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
    let e = refused.expect("the server kept accepting connections during its shutdown");
    let chain = format!("{e:?}");
    assert!(chain.contains("57P03") || chain.contains("shutting down"), "{chain}");
    assert!(e.is_unavailable(), "a server shutting down must be unavailable for now: {chain}");
    // A bad login is not.
    drop(held);
    pg.stop();
    pg.start_again();
    let bad = format!("postgres://nobody@127.0.0.1:{}/postgres?sslmode=disable", pg.port);
    if let Err(e) = PostgresStore::connect(&bad, "shutdown_test", Limits::default()).await {
        assert!(!e.is_unavailable(), "a refused login is not unavailable: {e:?}");
    }
}
