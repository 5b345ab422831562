//! `idem serve` with its store over TLS, against throw-away servers (idem-testkit: a private CA, a PostgreSQL
//! cluster with `ssl=on`, a `redis-server --tls-port`): with the right CA it serves; a wrong CA, or TLS
//! required of a server without it, is one line on stderr naming the cause, password hidden, exit status 2.
//! Skips when the server programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set.

use crate::common::{Server, client, idem};
use idem_testkit::{Postgres, Redis};

/// Starting with `store` is refused: exit 2, one line containing `needle`, the password nowhere.
fn refused(store: &str, needle: &str) {
    let (code, _, err) = idem(&["serve", "--listen", "127.0.0.1:0", "--store", store], &[]);
    assert_eq!(code, 2, "{store}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{store}: not one line: {err}");
    assert!(err.contains(needle), "{store}: {err}");
    assert!(err.contains(":***@"), "{store}: {err}");
    assert!(!err.contains("hunter2"), "password leaked: {err}");
}

/// A PUT then a GET through the server: the store answers over TLS.
async fn serves(server: &Server) {
    let c = client();
    let put = c.put(format!("{}/v1/kv/tls", server.url)).body("over TLS").send().await.unwrap();
    assert_eq!(put.status().as_u16(), 201);
    let got = c.get(format!("{}/v1/kv/tls", server.url)).send().await.unwrap();
    assert_eq!(got.text().await.unwrap(), "over TLS");
}

#[tokio::test]
async fn postgres_verify_full() {
    let Some(pg) = Postgres::start() else { return };
    // Trust authentication: the password is not needed, only never printed.
    let url = |ca: &std::path::Path| {
        format!(
            "postgres://postgres:hunter2@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
            pg.port,
            ca.display()
        )
    };
    let server = Server::start(&["--store", &url(&pg.pki.ca)], &[]);
    serves(&server).await;
    refused(
        &url(&pg.pki.other_ca),
        "TLS to the PostgreSQL server failed: certificate verify failed: unknown issuer: the PostgreSQL server's \
         certificate is not signed by a trusted CA (sslrootcert=FILE names the CA to trust), or the \
             PostgreSQL server sends it without its intermediate CA certificates (its certificate file must hold the chain)",
    );
}

#[tokio::test]
async fn postgres_require_of_a_server_without_tls() {
    // A server that answers PostgreSQL's SSLRequest with `N`, as one with `ssl=off` does.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut s in listener.incoming().map_while(Result::ok) {
            let mut request = [0u8; 8];
            if s.read_exact(&mut request).is_ok() {
                let _ = s.write_all(b"N");
            }
        }
    });
    refused(&format!("postgres://alice:hunter2@127.0.0.1:{port}/db?sslmode=require"), "server does not support TLS");
}

#[tokio::test]
async fn rediss_with_cacert() {
    let Some(redis) = Redis::start() else { return };
    let url = |ca: &std::path::Path| format!("rediss://:hunter2@localhost:{}?cacert={}", redis.port, ca.display());
    // The throw-away server asks for no password; Redis 7 takes AUTH with one as an error, so serve without.
    let open = format!("rediss://localhost:{}?cacert={}", redis.port, redis.pki.ca.display());
    let server = Server::start(&["--store", &open], &[]);
    serves(&server).await;
    refused(
        &url(&redis.pki.other_ca),
        "TLS to the Redis server failed: certificate verify failed: unknown issuer: the Redis server's \
         certificate is not signed by a trusted CA (cacert=FILE in the URL names the CA to trust), or the \
         Redis server sends it without its intermediate CA certificates (its certificate file must hold the chain)",
    );
}
