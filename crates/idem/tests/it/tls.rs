//! HTTPS end to end with real processes: `idem serve --tls-cert/--tls-key` (main and admin listener), the
//! clients with `--cacert`, certificates refused for each reason, plaintext and TLS crossed, client
//! certificates (`--tls-client-ca`), rotation on SIGHUP under load, and the non-loopback rule. Certificates
//! are made here with rcgen: a private CA, a server certificate for localhost and 127.0.0.1, a client
//! certificate, an expired one, one for another host name.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use crate::common::{self, Server, idem, start_upstream};

/// A CA that signs certificates into `dir`.
pub(crate) struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate's PEM file.
    pub(crate) pem: PathBuf,
}

impl Ca {
    pub(crate) fn new(dir: &Path, name: &str) -> Ca {
        Self::with_key(dir, name, KeyPair::generate().unwrap())
    }

    /// A CA named as [`Ca::new`] names it, on `key` (another key type, say).
    pub(crate) fn with_key(dir: &Path, name: &str, key: KeyPair) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, format!("idem test CA {name}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, key).unwrap();
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, issuer.pem()).unwrap();
        Ca { issuer, pem }
    }

    /// A leaf for `names` (IP addresses become IP SANs), written as `{file}.pem` and `{file}.key`; `client`
    /// makes it a client certificate, `expired` one that expired in 2001.
    pub(crate) fn leaf(
        &self,
        dir: &Path,
        file: &str,
        names: &[&str],
        client: bool,
        expired: bool,
    ) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages =
            vec![if client { ExtendedKeyUsagePurpose::ClientAuth } else { ExtendedKeyUsagePurpose::ServerAuth }];
        if expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (cert_path, key_path) = (dir.join(format!("{file}.pem")), dir.join(format!("{file}.key")));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }
}

pub(crate) fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `idem serve` (KV API, SQLite store in `dir`) over TLS with `cert`/`key`, plus `extra` flags.
fn tls_server(dir: &Path, cert: &Path, key: &Path, extra: &[&str]) -> Server {
    let store = format!("sqlite:{}", dir.join("idem.db").display());
    let mut args = vec!["--store", &store, "--tls-cert", s(cert), "--tls-key", s(key)];
    args.extend_from_slice(extra);
    Server::start(&args, &[])
}

fn one_line(err: &str) -> &str {
    assert_eq!(err.lines().count(), 1, "not one line: {err:?}");
    err.trim_end()
}

#[tokio::test(flavor = "multi_thread")]
async fn kv_and_send_over_https_with_cacert_replay_as_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let (up, counts) = start_upstream().await;
    let server = common::proxy(&dir, &up, &["--tls-cert", s(&cert), "--tls-key", s(&key)]);
    assert!(server.url.starts_with("https://127.0.0.1:"), "{}", server.url);
    assert!(server.admin.starts_with("https://127.0.0.1:"), "{}", server.admin);

    // idem kv against the admin listener, by IP address and by name.
    let admin = server.admin.clone();
    let by_name = admin.replace("127.0.0.1", "localhost");
    let (code, out, err) = idem(&["kv", "--url", &admin, "--cacert", s(&ca.pem), "put", "k", "v1"], &[]);
    assert_eq!((code, out.trim()), (0, "1"), "{err}");
    let (code, out, err) = idem(&["kv", "--url", &by_name, "--cacert", s(&ca.pem), "get", "k"], &[]);
    assert_eq!((code, out.as_str()), (0, "v1"), "{err}");
    let (code, _, err) = idem(&["kv", "get", "missing"], &[("IDEM_URL", &admin), ("IDEM_CACERT", s(&ca.pem))]);
    assert_eq!(code, 3, "{err}");

    // idem send through the proxy: the retry under the same key is a replay, executed upstream once.
    let send = |n: &str| {
        idem(
            &["send", "POST", &format!("{}/orders", server.url), "--json", r#"{"order":1}"#, "--key", n, "--cacert"]
                .into_iter()
                .chain([s(&ca.pem)])
                .collect::<Vec<_>>(),
            &[],
        )
    };
    let (code, first, err1) = send("order-1");
    assert_eq!(code, 0, "{err1}");
    assert!(err1.contains("201") && !err1.contains("replayed"), "{err1}");
    let (code, second, err2) = send("order-1");
    assert_eq!(code, 0, "{err2}");
    assert!(err2.contains("201") && err2.contains("replayed"), "{err2}");
    assert_eq!(first, second, "the replay is byte-exact");
    assert_eq!(counts.executions(), 1);
}

/// Each way a server certificate is refused: one line naming the cause, exit 1 from both clients, and
/// nothing sent (the upstream executed nothing; the store holds nothing).
#[tokio::test(flavor = "multi_thread")]
async fn refused_certificates_name_the_cause_exit_1_and_send_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let other_ca = Ca::new(dir.path(), "other-ca");
    // The CA made again under the same name: the same key type, and another one.
    let (again, again_other_type) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ca_again = Ca::new(again.path(), "ca");
    let ca_again_ed25519 =
        Ca::with_key(again_other_type.path(), "ca", KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap());
    let good = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let expired = ca.leaf(dir.path(), "expired", &["localhost", "127.0.0.1"], false, true);
    let elsewhere = ca.leaf(dir.path(), "elsewhere", &["other.example"], false, false);
    let (up, counts) = start_upstream().await;
    for (case, (cert, key), trusted, needle) in [
        ("wrong CA", &good, &other_ca.pem, "certificate verify failed: unknown issuer"),
        ("expired", &expired, &ca.pem, "certificate verify failed: expired"),
        ("host name", &elsewhere, &ca.pem, "certificate verify failed: host name mismatch"),
        ("CA made again", &good, &ca_again.pem, "was the CA made again under the same name?"),
        ("CA made again, other key type", &good, &ca_again_ed25519.pem, "was the CA made again under the same name"),
    ] {
        let case_dir = tempfile::tempdir().unwrap();
        let server = common::proxy(&case_dir, &up, &["--tls-cert", s(cert), "--tls-key", s(key)]);
        let (code, out, err) = idem(&["kv", "--url", &server.admin, "--cacert", s(trusted), "put", "k", "v"], &[]);
        assert_eq!((code, out.as_str()), (1, ""), "{case}: {err}");
        let line = one_line(&err);
        assert!(line.starts_with("idem: request failed: ") && line.contains(needle), "{case}: {line}");
        if case == "host name" {
            assert!(line.contains("127.0.0.1") && line.contains("other.example"), "{case}: {line}");
        }
        let url = format!("{}/orders", server.url);
        let (code, out, err) =
            idem(&["send", "POST", &url, "--json", "{}", "--key", "k1", "--cacert", s(trusted)], &[]);
        assert_eq!((code, out.as_str()), (1, ""), "{case}: {err}");
        assert!(one_line(&err).contains(needle), "{case}: {err}");
        assert_eq!(counts.executions(), 0, "{case}: the write reached the upstream");
        // The KV write did not happen either: the same store, served again in plain HTTP, has no key.
        drop(server);
        let plain = Server::start(&["--store", &format!("sqlite:{}", case_dir.path().join("idem.db").display())], &[]);
        let (code, _, err) = idem(&["kv", "--url", &plain.url, "get", "k"], &[]);
        assert_eq!(code, 3, "{case}: {err}");
    }
}

#[test]
fn plaintext_and_tls_crossed_fail_clearly_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let tls = tls_server(dir.path(), &cert, &key, &[]);
    // http:// to the TLS listener: a 400 problem telling to use https://.
    let plain_url = tls.url.replace("https://", "http://");
    let (code, _, err) = idem(&["kv", "--url", &plain_url, "put", "k", "v"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(one_line(&err).contains("400 Bad Request: this listener speaks HTTPS only: use https://"), "{err}");
    tls.wait_for_log("plain HTTP on the TLS listener", 1, Duration::from_secs(10));

    // https:// to a plaintext listener: the client says the server did not answer in TLS, the server logs it.
    let plain = Server::start(&["--store", "memory:"], &[]);
    let tls_url = plain.url.replace("http://", "https://");
    let (code, _, err) = idem(&["kv", "--url", &tls_url, "--cacert", s(&ca.pem), "put", "k", "v"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(one_line(&err).contains("the server did not answer in TLS (is it plain HTTP? then use http://)"), "{err}");
    plain.wait_for_log("TLS handshake on a plain-HTTP listener", 1, Duration::from_secs(10));
    let (code, _, err) =
        idem(&["send", "POST", &format!("{tls_url}/x"), "--json", "{}", "--key", "k", "--cacert", s(&ca.pem)], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(one_line(&err).contains("did not answer in TLS"), "{err}");
    // Both servers still serve.
    let (code, _, err) = idem(&["kv", "--url", &tls.url, "--cacert", s(&ca.pem), "put", "k", "v"], &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn client_ca_refuses_clients_without_a_certificate_at_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let other_ca = Ca::new(dir.path(), "other-ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let (client_cert, client_key) = ca.leaf(dir.path(), "client", &["client"], true, false);
    let (stranger_cert, stranger_key) = other_ca.leaf(dir.path(), "stranger", &["client"], true, false);
    let server = tls_server(dir.path(), &cert, &key, &["--tls-client-ca", s(&ca.pem)]);
    let kv = |extra: &[&str]| {
        let mut args = vec!["kv", "--url", &server.url, "--cacert", s(&ca.pem)];
        args.extend_from_slice(extra);
        args.extend(["put", "k", "v"]);
        idem(&args, &[])
    };
    let (code, _, err) = kv(&[]);
    assert_eq!(code, 1, "{err}");
    assert!(one_line(&err).contains("the server requires a client certificate (--cert FILE --cert-key FILE)"), "{err}");
    let (code, _, err) = kv(&["--cert", s(&stranger_cert), "--cert-key", s(&stranger_key)]);
    assert_eq!(code, 1, "{err}");
    assert!(
        one_line(&err).contains(
            "the server refused the client certificate: it is not issued by a CA the server trusts (its \
             --tls-client-ca)"
        ),
        "{err}"
    );
    let log = server.wait_for_log("TLS handshake failed", 2, Duration::from_secs(10));
    assert!(log.contains("the client presented no certificate, which --tls-client-ca requires"), "{log}");
    assert!(log.contains("unknown issuer: the client's certificate is not signed by a trusted CA"), "{log}");
    let (code, out, err) = kv(&["--cert", s(&client_cert), "--cert-key", s(&client_key)]);
    assert_eq!((code, out.trim()), (0, "1"), "{err}");
    // Certificate and key in one file, as curl's --cert takes them; and idem send with it.
    let both = dir.path().join("client-both.pem");
    std::fs::write(&both, [std::fs::read(&client_cert).unwrap(), std::fs::read(&client_key).unwrap()].concat())
        .unwrap();
    let (code, out, err) = kv(&["--cert", s(&both)]);
    assert_eq!((code, out.trim()), (0, "2"), "{err}");
    let url = format!("{}/v1/kv/sent", server.url);
    let (code, _, err) =
        idem(&["send", "PUT", &url, "--data", "x", "--key", "k1", "--cacert", s(&ca.pem), "--cert", s(&both)], &[]);
    assert_eq!(code, 0, "{err}");
    // --cert without its key, --cert-key without --cert, an unreadable file: bad usage, named.
    let (code, _, err) = kv(&["--cert", s(&client_cert)]);
    assert_eq!(code, 2, "{err}");
    assert!(
        one_line(&err).contains(&format!(
            "--cert {}: holds no PEM private key (-----BEGIN PRIVATE KEY-----); give its key with --cert-key FILE",
            client_cert.display()
        )),
        "{err}"
    );
    // A key that is not the certificate's (the stranger's): both files named, before any connection.
    let (code, _, err) = kv(&["--cert", s(&client_cert), "--cert-key", s(&stranger_key)]);
    assert_eq!(code, 2, "{err}");
    assert!(one_line(&err).contains("does not belong to the first certificate in --cert"), "{err}");
    let (code, _, err) = kv(&["--cert-key", s(&client_key)]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = kv(&["--cert", s(&client_cert), "--cert-key", "/nonexistent/client.key"]);
    assert_eq!(code, 2, "{err}");
    assert!(one_line(&err).contains("cannot read --cert-key /nonexistent/client.key"), "{err}");
}

/// A client for the rotation test: trusts both CAs; `fresh` opens a new connection for every request.
fn rotation_client(cas: &[&Path], fresh: bool) -> reqwest::Client {
    let mut builder = idem_client::client_builder()
        .timeout(Duration::from_secs(30))
        .tls_certs_only(cas.iter().map(|p| reqwest::Certificate::from_pem(&std::fs::read(p).unwrap()).unwrap()));
    if fresh {
        builder = builder.pool_max_idle_per_host(0);
    }
    builder.build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sighup_rotates_the_certificate_under_load_without_a_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = Ca::new(dir.path(), "old-ca");
    let new_ca = Ca::new(dir.path(), "new-ca");
    let (cert, key) = old_ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let server = tls_server(dir.path(), &cert, &key, &[]);
    let pid = server.pid().to_string();

    // 16 writers, half on kept-alive connections and half opening a connection per request.
    let reloaded = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut writers = Vec::new();
    for w in 0..16 {
        let http = rotation_client(&[&old_ca.pem, &new_ca.pem], w % 2 == 1);
        let (url, reloaded, ok, failed) = (server.url.clone(), reloaded.clone(), ok.clone(), failed.clone());
        writers.push(tokio::spawn(async move {
            let (mut sent, mut after_reload) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_secs(60);
            // Until 20 requests of this writer began after the reload was logged (bounded by the deadline).
            while after_reload < 20 && Instant::now() < deadline {
                let seen = reloaded.load(Ordering::SeqCst);
                sent += 1;
                let r = http.put(format!("{url}/v1/kv/w{w}")).body(sent.to_string()).send().await;
                match r {
                    Ok(resp) if resp.status().is_success() => ok.fetch_add(1, Ordering::SeqCst),
                    Ok(resp) => panic!("writer {w}: {}", resp.status()),
                    Err(e) => {
                        eprintln!("writer {w}: {}", idem_client::tls_failure(&e).unwrap_or_else(|| e.to_string()));
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
                if seen {
                    after_reload += 1;
                }
            }
            sent
        }));
    }
    // Let every writer get going on the old certificate first.
    while ok.load(Ordering::SeqCst) < 64 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Replace both files (a new CA's certificate), then SIGHUP.
    new_ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    server.wait_for_log("TLS certificate reloaded", 1, Duration::from_secs(10));
    reloaded.store(true, Ordering::SeqCst);
    let mut sent = 0;
    for w in writers {
        sent += w.await.unwrap();
    }
    eprintln!("rotation: {sent} requests from 16 writers, {} failed", failed.load(Ordering::SeqCst));
    assert_eq!(failed.load(Ordering::SeqCst), 0, "failed requests during the rotation");
    assert_eq!(ok.load(Ordering::SeqCst), sent);

    // New connections see the new certificate: only the new CA is trusted now.
    let put = |ca: &Path| idem(&["kv", "--url", &server.url, "--cacert", s(ca), "put", "after", "x"], &[]);
    let (code, _, err) = put(&new_ca.pem);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = put(&old_ca.pem);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("unknown issuer"), "{err}");

    // A bad file on SIGHUP: the error names it, the previous certificate goes on serving.
    std::fs::write(&cert, "not a certificate\n").unwrap();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    let log = server.wait_for_log("TLS reload failed", 1, Duration::from_secs(10));
    assert!(log.contains(&format!("--tls-cert {}", cert.display())), "{log}");
    let (code, _, err) = put(&new_ca.pem);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn non_loopback_needs_tls_or_insecure_and_the_kv_api_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let token = dir.path().join("token");
    std::fs::write(&token, "t0k3n\n").unwrap();
    let tls = ["--tls-cert", s(&cert), "--tls-key", s(&key)];
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--listen", "0.0.0.0:0", "--store", "memory:"];
        args.extend_from_slice(extra);
        idem(&args, &[])
    };
    // A token without TLS: the traffic (and the token) would cross the network in clear.
    let (code, _, err) = serve(&["--auth-token-file", s(&token)]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        one_line(&err),
        "idem: refusing to serve plain HTTP on non-loopback 0.0.0.0:0: give --tls-cert FILE --tls-key FILE, or \
         --insecure if TLS is terminated in front of idem"
    );
    // TLS without authentication of the KV API.
    let (code, _, err) = serve(&tls);
    assert_eq!(code, 2, "{err}");
    assert!(one_line(&err).contains("without --auth-token-file or --tls-client-ca; pass --insecure"), "{err}");
    // The proxy's admin listener is held to the same rule.
    let (code, _, err) = idem(
        &["serve", "--upstream", "127.0.0.1:9", "--admin-listen", "0.0.0.0:0", "--store", "memory:"],
        &[("IDEM_AUTH_TOKEN_FILE", s(&token))],
    );
    assert_eq!(code, 2, "{err}");
    assert!(one_line(&err).contains("plain HTTP on non-loopback 0.0.0.0:0"), "{err}");
    // Each of these starts.
    for extra in [
        vec!["--insecure"],
        [&tls[..], &["--auth-token-file", s(&token)]].concat(),
        [&tls[..], &["--tls-client-ca", s(&ca.pem)]].concat(),
    ] {
        let insecure = extra == ["--insecure"];
        let mut args = vec!["--listen", "0.0.0.0:0", "--store", "memory:"];
        args.extend(extra);
        let server = Server::start(&args, &[]);
        assert!(server.url.contains("0.0.0.0"), "{}", server.url);
        if insecure {
            // What --insecure allowed is said where the operator looks.
            let log = server.wait_for_log("answers anyone who can reach it", 1, Duration::from_secs(10));
            assert!(log.contains("WARN"), "{log}");
            assert!(log.contains("serving plain HTTP on non-loopback 0.0.0.0:0 (--insecure)"), "{log}");
        }
    }
    // Half a pair, and bad files: one line naming the flag and the file, exit 2.
    let encrypted = dir.path().join("encrypted.key");
    std::fs::write(&encrypted, "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
        .unwrap();
    for (args, needle) in [
        (vec!["--tls-cert", s(&cert)], "--tls-cert needs --tls-key".to_owned()),
        (vec!["--tls-key", s(&key)], "--tls-key needs --tls-cert".to_owned()),
        (vec!["--tls-client-ca", s(&ca.pem)], "--tls-client-ca needs --tls-cert and --tls-key".to_owned()),
        (
            vec!["--tls-cert", "/nonexistent/c.pem", "--tls-key", s(&key)],
            "cannot read --tls-cert /nonexistent/c.pem".into(),
        ),
        (
            vec!["--tls-cert", s(&key), "--tls-key", s(&key)],
            format!("--tls-cert {}: holds no PEM certificate", key.display()),
        ),
        (
            vec!["--tls-cert", s(&cert), "--tls-key", s(&cert)],
            format!("--tls-key {}: holds no PEM private key", cert.display()),
        ),
        (
            vec!["--tls-cert", s(&ca.pem), "--tls-key", s(&key)],
            format!("the private key in --tls-key {} does not belong to the first certificate in", key.display()),
        ),
        (
            vec!["--tls-cert", s(&cert), "--tls-key", s(&encrypted)],
            format!(
                "--tls-key {}: the private key is encrypted; idem reads unencrypted keys only",
                encrypted.display()
            ),
        ),
    ] {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0", "--store", "memory:"];
        all.extend(&args);
        let (code, _, err) = idem(&all, &[]);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(one_line(&err).contains(&needle), "{args:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_to_a_server_without_tls_is_logged_not_fatal() {
    // SIGHUP's default action ended the process at once (exit 129), losing a memory store and the requests in
    // flight, when a reload was sent to every instance and this one had no certificate to re-read.
    let server = Server::start(&["--store", "memory:"], &[]);
    let status = std::process::Command::new("kill").args(["-HUP", &server.pid().to_string()]).status().unwrap();
    assert!(status.success());
    server.wait_for_log("no TLS certificate to reload", 1, Duration::from_secs(5));
    let health = common::client().get(format!("{}/healthz", server.url)).send().await.unwrap();
    assert!(health.status().is_success(), "{}", health.status());
}

#[test]
fn a_cacert_that_is_not_a_certificate_is_bad_usage_named_with_its_cause() {
    // A PEM block that parses as PEM but holds no certificate: `idem kv` said only "builder error", exit 1.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.pem");
    std::fs::write(&bad, "-----BEGIN CERTIFICATE-----\nAAAAbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n").unwrap();
    let (code, _, err) = idem(&["kv", "--url", "https://127.0.0.1:1", "--cacert", s(&bad), "get", "k"], &[]);
    assert_eq!(code, 2, "{err}");
    let line = one_line(&err);
    assert!(line.contains("cannot build the HTTP client") && line.contains("BadEncoding"), "{line}");
}

#[test]
fn a_certificate_clients_will_refuse_is_served_with_a_warning_at_start_and_reload() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (expired, expired_key) = ca.leaf(dir.path(), "expired", &["localhost", "127.0.0.1"], false, true);
    let server = tls_server(dir.path(), &expired, &expired_key, &[]);
    let log = server.wait_for_log("the certificate expired on", 1, Duration::from_secs(10));
    let line = log.lines().find(|l| l.contains("the certificate expired on")).unwrap();
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains(&format!("--tls-cert {}: the certificate expired on 2001-01-01T00:00:00Z", expired.display())),
        "{line}"
    );
    // A client says the same from its side, with the date.
    let (code, _, err) = idem(&["kv", "--url", &server.url, "--cacert", s(&ca.pem), "get", "k"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        one_line(&err).contains(
            "certificate verify failed: expired: the server's certificate was valid until 2001-01-01T00:00:00Z"
        ),
        "{err}"
    );
    // The files are looked at again on SIGHUP.
    std::process::Command::new("kill").args(["-HUP", &server.pid().to_string()]).status().unwrap();
    server.wait_for_log("the certificate expired on", 2, Duration::from_secs(10));
}

/// `curl --http2` against `url` (ALPN `h2`): the status line's version, the status and the body.
fn curl_h2(ca: &Path, args: &[&str]) -> (String, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--http2", "--cacert", s(ca), "-w", "\n%{http_version} %{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    assert!(out.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, tail) = text.rsplit_once('\n').unwrap();
    (tail.to_owned(), body.to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn http2_over_tls_gets_the_same_idempotency_and_kv_answers() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "ca");
    let (cert, key) = ca.leaf(dir.path(), "server", &["localhost", "127.0.0.1"], false, false);
    let (up, counts) = start_upstream().await;
    let server = common::proxy(&dir, &up, &["--tls-cert", s(&cert), "--tls-key", s(&key)]);
    let orders = format!("{}/orders", server.url);
    let post = ["-X", "POST", "-H", "Idempotency-Key: h2-order-1", "-H", "content-type: application/json"];
    let (first_status, first) = curl_h2(&ca.pem, &[&post[..], &["--data", r#"{"n":1}"#, &orders]].concat());
    let (again_status, again) = curl_h2(&ca.pem, &[&post[..], &["--data", r#"{"n":1}"#, &orders]].concat());
    assert_eq!(first_status, "2 201", "{first}");
    assert_eq!(again_status, "2 201", "{again}");
    assert_eq!(first, again, "the retry is a replay of the first answer");
    assert_eq!(counts.executions_of("h2-order-1"), 1);
    // Another body under the same key: 422, over HTTP/2 as over HTTP/1.1.
    let (status, body) = curl_h2(&ca.pem, &[&post[..], &["--data", r#"{"n":2}"#, &orders]].concat());
    assert_eq!(status, "2 422", "{body}");
    // The KV API on the admin listener, with a precondition.
    let kv = format!("{}/v1/kv/h2", server.admin);
    let (status, body) = curl_h2(&ca.pem, &["-X", "PUT", "-H", "If-None-Match: *", "--data", "v", &kv]);
    assert_eq!(status, "2 201", "{body}");
    let (status, _) = curl_h2(&ca.pem, &["-X", "PUT", "-H", "If-None-Match: *", "--data", "v", &kv]);
    assert_eq!(status, "2 412");
}

#[test]
fn an_x509_v1_certificate_is_refused_at_start_up_in_one_line() {
    // `openssl x509 -req` without -extfile makes a v1 certificate; webpki (rustls) takes only v3.
    let dir = tempfile::tempdir().unwrap();
    let sh = |script: &str| {
        let out = std::process::Command::new("sh").arg("-c").arg(script).current_dir(dir.path()).output().unwrap();
        assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    };
    sh("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=v1-ca \
        -keyout ca.key -out ca.pem 2>/dev/null");
    sh("openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost -keyout v1.key \
        -out v1.csr 2>/dev/null");
    sh("openssl x509 -req -in v1.csr -CA ca.pem -CAkey ca.key -days 2 -out v1.pem 2>/dev/null");
    let cert = dir.path().join("v1.pem");
    let key = dir.path().join("v1.key");
    let (code, _, err) = idem(
        &["serve", "--listen", "127.0.0.1:0", "--store", "memory:", "--tls-cert", s(&cert), "--tls-key", s(&key)],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        one_line(&err),
        format!(
            "idem: --tls-cert {}: the host's certificate is X.509 v1; only v3 certificates are accepted (issue it \
             with extensions: subjectAltName and basicConstraints)",
            cert.display()
        )
    );
}
