//! TLS as libpq's `sslmode` says, against a throw-away cluster with `ssl=on` (idem-testkit: its own CA, a
//! certificate for localhost/127.0.0.1, started on a free port and stopped when the last test using it ends).
//! The conformance suite passes under `sslmode=verify-full`; each mode encrypts exactly when libpq would; a
//! wrong CA, a host name the certificate does not carry and a server without TLS fail with a cause that says
//! so. Skips when the PostgreSQL programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use std::sync::{Arc, Mutex, Weak};

use idem_postgres::{Error, PostgresStore};
use idem_store::Limits;
use idem_store::error_chain;
use idem_testkit::Postgres;

static CLUSTER: Mutex<Weak<Postgres>> = Mutex::new(Weak::new());

fn cluster() -> Option<Arc<Postgres>> {
    idem_testkit::shared(&CLUSTER, Postgres::start)
}

fn schema() -> String {
    format!("idem_test_{:016x}", rand::random::<u64>())
}

async fn verify_full_store() -> Option<(PostgresStore, Arc<Postgres>)> {
    let pg = cluster()?;
    let url = pg.url("localhost", &format!("sslmode=verify-full&sslrootcert={}", pg.pki.ca.display()));
    let store = PostgresStore::connect(&url, &schema(), Limits::default()).await.expect("connect over TLS");
    Some((store, pg))
}

mod verify_full {
    idem_store::conformance_tests!(super::verify_full_store);
}

/// Whether the store's one pooled connection (the one that migrated) is encrypted, from pg_stat_ssl.
async fn encrypted(pg: &Postgres, application_name: &str) -> Vec<bool> {
    let (client, conn) =
        tokio_postgres::connect(&pg.url("127.0.0.1", "sslmode=disable"), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let rows = client
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1",
            &[&application_name],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_encrypts_as_libpq_does() {
    let Some(pg) = cluster() else { return };
    let ca = pg.pki.ca.display().to_string();
    for (query, tls) in [
        ("sslmode=disable".to_owned(), false),
        // libpq's default: TLS when the server offers it, here it does.
        (String::new(), true),
        ("sslmode=prefer".to_owned(), true),
        // Encrypted, certificate not checked: the test CA is in no trust store.
        ("sslmode=require".to_owned(), true),
        (format!("sslmode=require&sslrootcert={ca}"), true),
        (format!("sslmode=verify-ca&sslrootcert={ca}"), true),
        (format!("sslmode=verify-full&sslrootcert={ca}"), true),
    ] {
        let app = format!("idem_tls_{:016x}", rand::random::<u64>());
        let sep = if query.is_empty() { "" } else { "&" };
        let url = pg.url("localhost", &format!("{query}{sep}application_name={app}"));
        let store = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_or_else(|e| {
            panic!("{query}: {}", error_chain(&e));
        });
        assert_eq!(encrypted(&pg, &app).await, vec![tls], "{query}");
        drop(store);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_with_the_cause() {
    let Some(pg) = cluster() else { return };
    let other = pg.pki.other_ca.display().to_string();
    // `require` with a root file verifies the chain as `verify-ca` does (libpq's compatibility rule).
    for mode in ["verify-full", "verify-ca", "require", "prefer"] {
        let url = pg.url("localhost", &format!("sslmode={mode}&sslrootcert={other}"));
        let err = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_err();
        let msg = error_chain(&err);
        assert!(matches!(err, Error::Handshake(_)), "{mode}: {msg}");
        assert_eq!(
            err.to_string(),
            "TLS to the PostgreSQL server failed: certificate verify failed: unknown issuer: the PostgreSQL \
             server's certificate is not signed by a trusted CA (sslrootcert=FILE names the CA to trust), or the \
             PostgreSQL server sends it without its intermediate CA certificates (its certificate file must hold the chain)",
            "{mode}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let Some(pg) = cluster() else { return };
    let ca = pg.pki.ca.display().to_string();
    // Connect to 127.0.0.1 but call it a name the certificate does not carry (it names localhost, 127.0.0.1).
    let url = |mode: &str| pg.url("wrong.invalid", &format!("hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={ca}"));
    let err = PostgresStore::connect(&url("verify-full"), &schema(), Limits::default()).await.unwrap_err();
    let msg = error_chain(&err);
    assert!(
        msg.contains(
            "host name mismatch: the PostgreSQL server's certificate is for localhost, 127.0.0.1, not wrong.invalid"
        ),
        "{msg}"
    );
    PostgresStore::connect(&url("verify-ca"), &schema(), Limits::default()).await.expect("verify-ca ignores the name");
    // An IP address is checked against the certificate's IP entries.
    let by_ip = pg.url("127.0.0.1", &format!("sslmode=verify-full&sslrootcert={ca}"));
    PostgresStore::connect(&by_ip, &schema(), Limits::default()).await.expect("127.0.0.1 is in the certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_server_certificate_fails_with_its_date() {
    // A TLS server that answers the SSLRequest and presents a certificate (signed by the test CA) that expired
    // on 2001-01-01: the chain is trusted, so only the date can fail it.
    let pki = idem_testkit::Pki::new();
    let port = idem_testkit::tls_server_presenting(&pki.expired_cert, &pki.expired_key, true);
    for mode in ["verify-full", "verify-ca"] {
        let url =
            format!("postgres://postgres@localhost:{port}/postgres?sslmode={mode}&sslrootcert={}", pki.ca.display());
        let err = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "TLS to the PostgreSQL server failed: certificate verify failed: expired: the PostgreSQL server's \
                 certificate was valid until 2001-01-01T00:00:00Z, it is now 20"
            ),
            "{mode}: {msg}"
        );
    }
}

/// A server that answers PostgreSQL's SSLRequest with `N` (no TLS), as one with `ssl=off` does.
async fn server_without_tls() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 8];
                if s.read_exact(&mut request).await.is_ok() && request == [0, 0, 0, 8, 4, 210, 22, 47] {
                    let _ = s.write_all(b"N").await;
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest).await;
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_required_of_a_server_without_it_fails() {
    let port = server_without_tls().await;
    for mode in ["require", "verify-ca", "verify-full"] {
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode={mode}");
        let err = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_err();
        let msg = error_chain(&err);
        assert!(msg.contains("server does not support TLS"), "{mode}: {msg}");
    }
}

#[tokio::test]
async fn bad_tls_parameters_are_refused_before_connecting() {
    // Port 1: nothing listens; each error must come before any connection attempt.
    let err = PostgresStore::connect("postgres://u@127.0.0.1:1/db?sslmode=allow", "idem", Limits::default())
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "invalid sslmode \"allow\": use disable, prefer, require, verify-ca or verify-full");
    let err = PostgresStore::connect(
        "postgres://u@127.0.0.1:1/db?sslmode=verify-full&sslcert=/c.pem",
        "idem",
        Limits::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sslcert: client certificates to PostgreSQL are not supported by idem; use password or trust authentication"
    );
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem").display().to_string();
    let url = format!("postgres://u@127.0.0.1:1/db?sslmode=verify-full&sslrootcert={missing}");
    let err = PostgresStore::connect(&url, "idem", Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::TlsFiles(_)), "{}", error_chain(&err));
    assert!(err.to_string().starts_with(&format!("cannot read sslrootcert {missing}: No such file")), "{err}");
    // A file that is there but holds no certificate.
    let not_pem = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let url = format!("postgres://u@127.0.0.1:1/db?sslmode=verify-full&sslrootcert={}", not_pem.display());
    let err = PostgresStore::connect(&url, "idem", Limits::default()).await.unwrap_err();
    assert!(err.to_string().ends_with("holds no PEM certificate (-----BEGIN CERTIFICATE-----)"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_is_named_after_five_seconds() {
    // Accepts and holds connections, answering nothing (a port some other program listens on).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable");
    let err = PostgresStore::connect(&url, &schema(), Limits::default()).await.unwrap_err();
    assert!(matches!(err, Error::ConnectTimeout(t) if t == std::time::Duration::from_secs(5)), "{}", error_chain(&err));
    assert_eq!(
        err.to_string(),
        "no answer within 5s (connect_timeout): is PostgreSQL listening on this host and port?"
    );
}
