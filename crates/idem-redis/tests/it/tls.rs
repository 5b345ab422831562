//! `rediss://` against a throw-away `redis-server --tls-port` (idem-testkit: its own CA, a certificate for
//! localhost/127.0.0.1, started on a free port and stopped when the last test using it ends). The conformance
//! suite passes with the CA given as `cacert=PATH`; a wrong CA, a host name the certificate does not carry and
//! a `redis://` URL to the TLS port fail with a cause that says so. Skips when `redis-server` is missing,
//! unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex, Weak};

use idem_redis::{Error, RedisStore};
use idem_store::{Limits, Precondition, Store, Ttl};
use idem_testkit::{Redis, chain};

static SERVER: Mutex<Weak<Redis>> = Mutex::new(Weak::new());

fn server() -> Option<Arc<Redis>> {
    idem_testkit::shared(&SERVER, Redis::start)
}

fn prefix() -> String {
    format!("idem-test:{:016x}:", rand::random::<u64>())
}

async fn tls_store() -> Option<(RedisStore, Arc<Redis>)> {
    let server = server()?;
    let url = server.url("localhost", &format!("cacert={}", server.pki.ca.display()));
    let store = RedisStore::connect(&url, &prefix(), Limits::default()).await.expect("connect over TLS");
    Some((store, server))
}

mod rediss {
    idem_store::conformance_tests!(super::tls_store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ca_is_checked_and_other_query_parameters_kept() {
    let Some(server) = server() else { return };
    // `protocol=resp3` stays in the URL the redis crate parses, before and after `cacert`.
    let ca = server.pki.ca.display().to_string();
    for query in [format!("protocol=resp3&cacert={ca}"), format!("cacert={ca}&protocol=resp3")] {
        let store = RedisStore::connect(&server.url("127.0.0.1", &query), &prefix(), Limits::default())
            .await
            .unwrap_or_else(|e| panic!("{query}: {}", chain(&e)));
        let g = store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation();
        assert_eq!(store.get("k").await.unwrap().unwrap().generation(), g);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_with_the_cause() {
    let Some(server) = server() else { return };
    let url = server.url("localhost", &format!("cacert={}", server.pki.other_ca.display()));
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    let msg = chain(&err);
    assert!(matches!(err, Error::Connect(_)), "{msg}");
    assert!(msg.contains("invalid peer certificate: UnknownIssuer"), "{msg}");
    // Without cacert the platform store is used, which does not hold the test CA either.
    let err = RedisStore::connect(&server.url("localhost", ""), &prefix(), Limits::default()).await.unwrap_err();
    assert!(chain(&err).contains("invalid peer certificate: UnknownIssuer"), "{}", chain(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_name_is_checked() {
    let Some(server) = server() else { return };
    // The server listens on 127.0.0.2 too, which the certificate (localhost, 127.0.0.1) does not name.
    let url = server.url("127.0.0.2", &format!("cacert={}", server.pki.ca.display()));
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    let msg = chain(&err);
    assert!(msg.contains("certificate not valid for name \"127.0.0.2\""), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_redis_to_the_tls_port_fails() {
    let Some(server) = server() else { return };
    let url = format!("redis://127.0.0.1:{}", server.port);
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::Connect(_)), "{}", chain(&err));
}

#[tokio::test]
async fn bad_cacert_is_refused_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    // Port 1: nothing listens; each error must come before any connection attempt.
    let err =
        RedisStore::connect(&format!("rediss://127.0.0.1:1?cacert={}", missing.display()), "p:", Limits::default())
            .await
            .unwrap_err();
    assert!(matches!(err, Error::CaCert { .. }), "{}", chain(&err));
    assert!(err.to_string().starts_with(&format!("cacert {}: No such file", missing.display())), "{err}");
    let not_pem = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let err =
        RedisStore::connect(&format!("rediss://127.0.0.1:1?cacert={}", not_pem.display()), "p:", Limits::default())
            .await
            .unwrap_err();
    assert_eq!(err.to_string(), format!("cacert {}: holds no PEM certificate", not_pem.display()));
    let err =
        RedisStore::connect(&format!("redis://127.0.0.1:1?cacert={}", not_pem.display()), "p:", Limits::default())
            .await
            .unwrap_err();
    assert!(matches!(err, Error::CaCertWithoutTls), "{}", chain(&err));
}
