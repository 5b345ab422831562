//! `rediss://` against a throw-away `redis-server --tls-port` (idem-testkit: its own CA, a certificate for
//! localhost/127.0.0.1, started on a free port and stopped when the last test using it ends). The conformance
//! suite passes with the CA given as `cacert=PATH`; a wrong CA, a host name the certificate does not carry and
//! a `redis://` URL to the TLS port fail with a cause that says so. Skips when `redis-server` is missing,
//! unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex, Weak};

use idem_redis::{Error, RedisStore};
use idem_store::error_chain;
use idem_store::{Limits, Precondition, Store, Ttl};
use idem_testkit::Redis;

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
            .unwrap_or_else(|e| panic!("{query}: {}", error_chain(&e)));
        let g = store.put("k", "v".into(), Precondition::Absent, Ttl::Keep).await.unwrap().generation();
        assert_eq!(store.get("k").await.unwrap().unwrap().generation(), g);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_with_the_cause() {
    let Some(server) = server() else { return };
    let url = server.url("localhost", &format!("cacert={}", server.pki.other_ca.display()));
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    let msg = error_chain(&err);
    assert!(matches!(err, Error::Handshake(_)), "{msg}");
    let unknown = "TLS to the Redis server failed: certificate verify failed: unknown issuer: the Redis server's \
                   certificate is not signed by a trusted CA (cacert=FILE in the URL names the CA to trust), \
                   or the Redis server sends it without its intermediate CA certificates (its certificate file must \
                   hold the chain)";
    assert_eq!(msg, unknown);
    // Without cacert the platform store is used, which does not hold the test CA either.
    let err = RedisStore::connect(&server.url("localhost", ""), &prefix(), Limits::default()).await.unwrap_err();
    assert_eq!(error_chain(&err), unknown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_name_is_checked() {
    let Some(server) = server() else { return };
    // The server listens on 127.0.0.2 too, which the certificate (localhost, 127.0.0.1) does not name.
    let url = server.url("127.0.0.2", &format!("cacert={}", server.pki.ca.display()));
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    let msg = error_chain(&err);
    assert!(
        msg.ends_with("host name mismatch: the Redis server's certificate is for localhost, 127.0.0.1, not 127.0.0.2"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_redis_to_the_tls_port_fails() {
    let Some(server) = server() else { return };
    let url = format!("redis://127.0.0.1:{}", server.port);
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    assert_eq!(
        error_chain(&err),
        "TLS to the Redis server failed: the server reset the connection: is this a TLS port? then use rediss:// \
         (with cacert=FILE for a private CA)"
    );
}

/// The same mistake in a Sentinel or Cluster URL, and the other way round (`rediss+cluster://` to a plain port,
/// the machine's Redis), are usage mistakes too, not outages: the Cluster client's error hides its cause
/// ("Failed to create initial connections"), so its seed nodes are asked. Before, both Cluster cases were
/// taken for an unavailable store (`idem once` exit 75 instead of 2; found by a review on 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_and_cluster_urls_to_the_wrong_kind_of_port_are_usage_mistakes() {
    let Some(server) = server() else { return };
    let port = server.port;
    for url in [format!("redis+sentinel://127.0.0.1:{port}/mymaster"), format!("redis+cluster://127.0.0.1:{port}")] {
        let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
        assert!(matches!(err, Error::Handshake(_)) && !err.is_unavailable(), "{url}: {}", error_chain(&err));
        assert!(error_chain(&err).contains("is this a TLS port?"), "{url}: {}", error_chain(&err));
    }
    let Ok(plain) = std::env::var("IDEM_TEST_REDIS_URL") else { return };
    let plain = plain.trim_start_matches("redis://").trim_end_matches('/').to_owned();
    let url = format!("rediss+cluster://{plain}?cacert={}", server.pki.ca.display());
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::Handshake(_)) && !err.is_unavailable(), "{url}: {}", error_chain(&err));
    assert!(error_chain(&err).contains("is this a plain Redis port?"), "{url}: {}", error_chain(&err));
}

/// A server that accepts a connection, reads the first byte of the command and closes it (a proxy in front of a
/// Redis that is down, a failover in progress): the unread rest makes the close a reset, as a TLS port's is. It
/// is an outage (`is_unavailable`: `idem once` exits 75), not a TLS port: it was taken for one (exit 2) whenever
/// the command arrived before the close, which `once::an_unreachable_store_is_exit_75_and_a_bad_url_or_login_exit_2`
/// met in CI on 2026-12-06.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_resets_connections_is_unavailable_not_a_tls_port() {
    let url = format!("redis://127.0.0.1:{}", resetting_server());
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::Connect(_)), "{}", error_chain(&err));
    assert!(err.is_unavailable(), "{}", error_chain(&err));
}

/// The same for Sentinels and a Cluster's seed nodes that reset every connection: an outage, not a TLS port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_or_cluster_nodes_that_reset_connections_are_unavailable_not_tls_ports() {
    let (a, b) = (resetting_server(), resetting_server());
    for url in [
        format!("redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/mymaster"),
        format!("redis+cluster://127.0.0.1:{a},127.0.0.1:{b}"),
    ] {
        let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
        assert!(!matches!(err, Error::Handshake(_)), "{url}: {}", error_chain(&err));
        assert!(err.is_unavailable(), "{url}: {}", error_chain(&err));
    }
}

/// A plain server on a free port that accepts every connection and closes it after reading one byte, the
/// rest of the command unread (which makes the close a reset): a proxy in front of a Redis that is down.
fn resetting_server() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut first = [0u8; 1];
            let _ = std::io::Read::read_exact(&mut conn, &mut first);
            drop(conn);
        }
    });
    port
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
    assert!(matches!(err, Error::CaCert(_)), "{}", error_chain(&err));
    assert!(err.to_string().starts_with(&format!("cannot read cacert {}: No such file", missing.display())), "{err}");
    let not_pem = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let err =
        RedisStore::connect(&format!("rediss://127.0.0.1:1?cacert={}", not_pem.display()), "p:", Limits::default())
            .await
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("cacert {}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)", not_pem.display())
    );
    let err =
        RedisStore::connect(&format!("redis://127.0.0.1:1?cacert={}", not_pem.display()), "p:", Limits::default())
            .await
            .unwrap_err();
    assert!(matches!(err, Error::CaCertWithoutTls), "{}", error_chain(&err));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_server_certificate_fails_with_its_date() {
    let pki = idem_testkit::Pki::new();
    let port = idem_testkit::tls_server_presenting(&pki.expired_cert, &pki.expired_key, false);
    let url = format!("rediss://localhost:{port}?cacert={}", pki.ca.display());
    let err = RedisStore::connect(&url, &prefix(), Limits::default()).await.unwrap_err();
    let msg = error_chain(&err);
    assert!(
        msg.starts_with(
            "TLS to the Redis server failed: certificate verify failed: expired: the Redis server's certificate \
             was valid until 2001-01-01T00:00:00Z, it is now 20"
        ),
        "{msg}"
    );
}

#[tokio::test]
async fn unknown_url_parameters_are_refused_before_connecting() {
    // Port 1: nothing listens. redis-py's spelling must not be taken for a setting idem applies.
    let err =
        RedisStore::connect("rediss://127.0.0.1:1/0?ssl_cert_reqs=none", "p:", Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::UnknownParameter(ref p) if p == "ssl_cert_reqs"), "{}", error_chain(&err));
    assert!(err.to_string().starts_with("unknown Redis URL parameter \"ssl_cert_reqs\": idem knows cacert=FILE"));
    // The redis crate would ignore these on a TCP URL: the data would land in database 0, unauthenticated.
    for (url, name) in [
        ("redis://127.0.0.1:1/?db=5", "db"),
        ("redis://127.0.0.1:1?user=nobody&pass=secret", "user"),
        ("redis://127.0.0.1:1?c%61cert2=/x", "cacert2"),
    ] {
        let err = RedisStore::connect(url, "p:", Limits::default()).await.unwrap_err();
        assert!(matches!(err, Error::UnknownParameter(ref p) if p == name), "{url}: {}", error_chain(&err));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_to_a_plain_redis_port_says_so() {
    // The machine's plain Redis: it reads the TLS hello as an inline command and waits for an end of line.
    let Ok(plain) = std::env::var("IDEM_TEST_REDIS_URL") else {
        assert!(
            std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
            "IDEM_TEST_REDIS_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
        );
        eprintln!("skipped: IDEM_TEST_REDIS_URL is unset (e.g. redis://127.0.0.1:6379)");
        return;
    };
    let url = plain.replacen("redis://", "rediss://", 1);
    let err = RedisStore::connect(&url, "p:", Limits::default()).await.unwrap_err();
    assert_eq!(
        error_chain(&err),
        "TLS to the Redis server failed: no TLS answer within 5s: is this a plain Redis port? (it never answers a \
         TLS handshake; use redis:// or the server's tls-port)"
    );
}

#[tokio::test]
async fn insecure_is_refused_in_idems_words() {
    let err = RedisStore::connect("rediss://127.0.0.1:1/0#insecure", "p:", Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::Insecure), "{}", error_chain(&err));
    assert_eq!(
        err.to_string(),
        "#insecure would turn certificate checks off, which idem does not do; give cacert=FILE for a private CA"
    );
}
