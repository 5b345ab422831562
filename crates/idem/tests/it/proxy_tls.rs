//! `idem serve --upstream https://…`: the proxy in front of an HTTPS upstream (the example upstream served
//! over rustls in this process), with `--upstream-cacert` and a client certificate. Idempotency is unchanged:
//! a retry storm executes each key once; a failed TLS handshake means nothing was sent, so the key is
//! released and the retry executes once the proxy trusts the upstream.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::common::upstream::{self, Counts};
use crate::common::{client, proxy};
use crate::tls::{Ca, s};

/// The example upstream over TLS on a free port of 127.0.0.1 with `cert`/`key` (ALPN `h2` and `http/1.1`, as
/// `idem serve` offers), requiring a client certificate from `client_ca` when given: its `https://localhost`
/// URL and its execution counts.
async fn https_upstream(cert: &Path, key: &Path, client_ca: Option<&Path>) -> (String, Arc<Counts>) {
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<_, _>>().unwrap();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(cert.unwrap()).unwrap();
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build().unwrap();
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // By name, so that the proxy sends SNI and checks the certificate's DNS name.
    let url = format!("https://localhost:{}", listener.local_addr().unwrap().port());
    let counts = Arc::new(Counts::default());
    let app = upstream::router(Arc::clone(&counts));
    let slot = idem_server::TlsConfigSlot::new(Arc::new(config));
    tokio::spawn(idem_server::serve_tls(
        app,
        listener,
        slot,
        idem_server::DEFAULT_CLIENT_IDLE_TIMEOUT,
        std::future::pending(),
    ));
    (url, counts)
}

async fn post(url: &str, path: &str, key: &str, body: &str) -> reqwest::Response {
    client()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

/// Idempotency records in the store, via the admin listener's KV API.
async fn stored_records(admin: &str) -> usize {
    let page: serde_json::Value =
        client().get(format!("{admin}/v1/kv?prefix=idempotency/")).send().await.unwrap().json().await.unwrap();
    page["items"].as_array().map_or(0, Vec::len)
}

/// The value of the Prometheus sample `name` (with its labels, as printed) on the admin listener.
async fn metric(admin: &str, sample: &str) -> f64 {
    let text = client().get(format!("{admin}/metrics")).send().await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.starts_with(sample)).unwrap_or_else(|| panic!("no {sample} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_storm_through_an_https_upstream_executes_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "upstream", &["localhost"], false, false);
    let (up, counts) = https_upstream(&cert, &key, None).await;
    let server = proxy(&dir, &up, &["--upstream-cacert", s(&ca.pem)]);

    // 10 keys, 50 identical requests each, all at once; the upstream takes 200 ms per execution.
    let mut tasks = Vec::new();
    for k in 0..10 {
        for _ in 0..50 {
            let url = server.url.clone();
            tasks.push(tokio::spawn(async move {
                let resp = post(&url, "/slow/200", &format!("order-{k}"), &format!(r#"{{"order":{k}}}"#)).await;
                (k, resp.status())
            }));
        }
    }
    let mut created = [0u32; 10];
    for task in tasks {
        match task.await.unwrap() {
            (k, StatusCode::CREATED) => created[k] += 1,
            (_, StatusCode::CONFLICT) => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    for (k, answered) in created.iter().enumerate() {
        assert_eq!(counts.executions_of(&format!("order-{k}")), 1, "order-{k}");
        assert!(*answered >= 1, "order-{k} was never answered by its execution");
    }
    assert_eq!(counts.executions(), 10);

    // Replays, after the pooled TLS connections sat idle past the 50 ms peek threshold: the session tickets a
    // TLS 1.3 server sends after the handshake were read with the first response, so the peek finds nothing
    // and no request is refused or sent twice.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for k in 0..10 {
        let replay = post(&server.url, "/slow/200", &format!("order-{k}"), &format!(r#"{{"order":{k}}}"#)).await;
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
    }
    // A new key over a pooled connection idle for 200 ms: executed once, no retry on a new connection.
    assert_eq!(post(&server.url, "/orders", "fresh", "{}").await.status(), StatusCode::CREATED);
    assert_eq!(counts.executions(), 11);
    assert_eq!(metric(&server.admin, "idem_upstream_retries_total{reason=\"not_written\"}").await, 0.0);
    for kind in ["connect", "unread", "failed", "timeout"] {
        assert_eq!(metric(&server.admin, &format!("idem_upstream_errors_total{{kind=\"{kind}\"}}")).await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_certificate_from_another_ca_sends_nothing_and_releases_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let other = Ca::new(dir.path(), "other");
    let (cert, key) = other.leaf(dir.path(), "upstream", &["localhost"], false, false);
    let (up, counts) = https_upstream(&cert, &key, None).await;

    let server = proxy(&dir, &up, &["--upstream-cacert", s(&ca.pem)]);
    let refused = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    assert_eq!(refused.status(), StatusCode::BAD_GATEWAY);
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:upstream-unreachable", "{problem}");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("certificate verify failed: unknown issuer"), "{detail}");
    assert!(detail.contains("the request was not sent"), "{detail}");
    server.wait_for_log("certificate verify failed", 1, Duration::from_secs(5));
    assert_eq!(counts.executions(), 0, "the upstream saw nothing");
    assert_eq!(stored_records(&server.admin).await, 0, "the key was released");
    drop(server);

    // The same store, the proxy now trusting the upstream's CA: the same key executes, once.
    let server = proxy(&dir, &up, &["--upstream-cacert", s(&other.pem)]);
    let created = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let replay = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(counts.executions_of("order-1"), 1);
    assert_eq!(counts.executions(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_requiring_a_client_certificate_gets_it_and_without_one_nothing_is_executed() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let clients = Ca::new(dir.path(), "clients");
    let (cert, key) = ca.leaf(dir.path(), "upstream", &["localhost"], false, false);
    let (client_cert, client_key) = clients.leaf(dir.path(), "proxy-client", &["idem-proxy"], true, false);
    let (up, counts) = https_upstream(&cert, &key, Some(&clients.pem)).await;

    // Without a client certificate: the upstream aborts the handshake (TLS 1.3: after the client's Finished,
    // when the request's records may already be on the wire, but never decrypted): not sent, key released.
    let server = proxy(&dir, &up, &["--upstream-cacert", s(&ca.pem)]);
    let refused = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    let status = refused.status();
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{problem}");
    assert_eq!(problem["type"], "urn:idem:problem:upstream-unreachable", "{problem}\n{}", server.log.0.lock().unwrap());
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("client certificate"), "{detail}");
    assert_eq!(counts.executions(), 0, "the upstream executed nothing");
    assert_eq!(stored_records(&server.admin).await, 0, "the key was released");
    drop(server);

    let server = proxy(
        &dir,
        &up,
        &["--upstream-cacert", s(&ca.pem), "--upstream-cert", s(&client_cert), "--upstream-cert-key", s(&client_key)],
    );
    let created = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let replay = post(&server.url, "/orders", "order-1", r#"{"order":1}"#).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(counts.executions_of("order-1"), 1);
}

/// The upstream TLS flags refused with one line and exit 2, before anything listens: for an `http` upstream,
/// a certificate without its key, an unreadable or certificate-less CA file.
#[test]
fn upstream_tls_flags_are_checked_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, _) = ca.leaf(dir.path(), "client", &["idem-proxy"], true, false);
    let missing = dir.path().join("missing.pem");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let serve = |upstream: &str, extra: &[&str]| {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--store", "memory:"];
        args.extend_from_slice(&["--upstream", upstream]);
        args.extend_from_slice(extra);
        crate::common::idem(&args, &[])
    };
    for (upstream, extra, expected) in [
        (
            "http://127.0.0.1:9",
            vec!["--upstream-cacert", s(&ca.pem)],
            "--upstream-cacert applies to an https upstream only",
        ),
        ("https://localhost:9", vec!["--upstream-cert", s(&cert)], "--upstream-cert needs --upstream-cert-key"),
        ("https://localhost:9", vec!["--upstream-cacert", s(&missing)], "cannot read --upstream-cacert"),
        ("https://localhost:9", vec!["--upstream-cacert", s(&not_pem)], "holds no PEM certificate"),
    ] {
        let (code, _, err) = serve(upstream, &extra);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(expected), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

/// Requests per Idempotency-Key that an upstream received.
type Received = Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>;

/// A bare HTTP/1.1-over-TLS upstream that answers `201` to every request and closes a connection idle for
/// `idle` the way a TLS server does: a `close_notify` alert, then its FIN. Its URL and the requests it received.
async fn closing_https_upstream(cert: &Path, key: &Path, idle: Duration) -> (String, Received) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<_, _>>().unwrap();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://localhost:{}", listener.local_addr().unwrap().port());
    let received: Received = Arc::default();
    let seen = Arc::clone(&received);
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, seen) = (acceptor.clone(), Arc::clone(&seen));
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut buf = Vec::new();
                loop {
                    // One request: its head, then Content-Length bytes of body.
                    let request = async {
                        loop {
                            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                                let length: usize = head
                                    .lines()
                                    .find_map(|l| l.strip_prefix("content-length:"))
                                    .map_or(0, |v| v.trim().parse().unwrap());
                                if buf.len() >= end + 4 + length {
                                    buf.drain(..end + 4 + length);
                                    return Some(head);
                                }
                            }
                            let mut chunk = [0u8; 4096];
                            match tls.read(&mut chunk).await {
                                Ok(0) | Err(_) => return None,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                    };
                    let head = match tokio::time::timeout(idle, request).await {
                        Ok(Some(head)) => head,
                        Ok(None) => return,
                        Err(_) => {
                            // close_notify, then FIN.
                            let _ = tls.shutdown().await;
                            return;
                        }
                    };
                    let key = head
                        .lines()
                        .find_map(|l| l.strip_prefix("idempotency-key:"))
                        .map(|v| v.trim().to_owned())
                        .unwrap_or_default();
                    *seen.lock().unwrap().entry(key).or_default() += 1;
                    let answer = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
                    if tls.write_all(answer).await.is_err() || tls.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, received)
}

/// An HTTPS upstream closing idle connections with `close_notify` at 300 ms, requests after idle gaps swept
/// past it (310-350 ms) with a pool that would keep connections for 10 s: every request executes exactly once
/// and none ends as an unknown outcome (the alert on an idle connection is an end of stream to hyper, or
/// unrequested bytes to the peek; either way the request goes on a new connection, unwritten). In the runs so
/// far hyper read every alert first (`idem_upstream_retries_total` stayed 0): the peek is for the instant
/// between the pool handing out a connection and the request's first record, which a sweep rarely hits.
/// Gaps just under 300 ms are not swept: there the request and the upstream's close cross on the wire, the
/// keep-alive race no client can see coming (1 in 41 under load with 280-320 ms); `--upstream-idle-timeout`
/// below the upstream's own keeps a proxy out of it (docs/DESIGN.md, "Upstream connections").
#[tokio::test(flavor = "multi_thread")]
async fn an_https_upstream_closing_idle_connections_with_close_notify_never_leaves_an_unknown_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "upstream", &["localhost"], false, false);
    let (up, received) = closing_https_upstream(&cert, &key, Duration::from_millis(300)).await;
    let server = proxy(&dir, &up, &["--upstream-cacert", s(&ca.pem), "--upstream-idle-timeout", "10s"]);
    assert_eq!(post(&server.url, "/orders", "warm-up", "{}").await.status(), StatusCode::CREATED);
    let requests = 41;
    for i in 0..requests {
        tokio::time::sleep(Duration::from_millis(310 + i)).await;
        let resp = post(&server.url, "/orders", &format!("k{i}"), "{}").await;
        let status = resp.status();
        assert_eq!(status, StatusCode::CREATED, "gap {} ms: {}", 310 + i, resp.text().await.unwrap());
    }
    let received = received.lock().unwrap().clone();
    for i in 0..requests {
        assert_eq!(received.get(&format!("k{i}")), Some(&1), "k{i}: {received:?}");
    }
    assert_eq!(received.len() as u64, requests + 1);
}
