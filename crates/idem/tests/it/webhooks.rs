//! Webhook routes of `idem serve --upstream` (`[[route]]`, README "Webhooks"), end to end: a real proxy process
//! in front of the example upstream, which counts executions per delivery (`webhook-id`). Each test runs on the
//! embedded SQLite store and on PostgreSQL (IDEM_TEST_POSTGRES_URL; skipped with a printed reason when unset,
//! a failure under IDEM_TEST_REQUIRE_BACKENDS).
//!
//! Deliveries are signed by the real `standardwebhooks` Python package where the test is about a third
//! party's signatures (IDEM_TEST_WEBHOOK_PEERS, installed by scripts/webhook-peers.sh), and by HMAC-SHA256 in
//! this file elsewhere.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use hmac::{KeyInit, Mac};
use reqwest::StatusCode;

use crate::common::upstream::Counts;
use crate::common::{Server, client, idem, start_upstream};

pub(crate) const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_c2VjcmV0LW9uZS10d28tdGhyZWU=";
const BODY: &str = r#"{"type":"invoice.paid","data":{"amount":1200}}"#;
const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const STRIPE_SECRET: &str = "whsec_stripe_route_test";
const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const SHOPIFY_SECRET: &str = "shpss_route_test";

/// Where records live: the embedded store in a temporary directory, or a throw-away PostgreSQL schema.
enum Backend {
    Sqlite,
    Postgres(String),
}

impl Backend {
    fn all() -> Vec<Backend> {
        let mut all = vec![Backend::Sqlite];
        match std::env::var("IDEM_TEST_POSTGRES_URL") {
            Ok(url) => all.push(Backend::Postgres(url)),
            Err(_) => {
                assert!(
                    std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
                    "IDEM_TEST_POSTGRES_URL is unset but IDEM_TEST_REQUIRE_BACKENDS is set"
                );
                eprintln!("skipped on PostgreSQL: IDEM_TEST_POSTGRES_URL is unset");
            }
        }
        all
    }
}

/// A proxy with webhook routes over one backend, and what it takes to clean up after it.
struct Hooks {
    server: Server,
    counts: Arc<Counts>,
    _dir: tempfile::TempDir,
    postgres: Option<(String, String)>,
}

impl Hooks {
    /// Routes: `/orders` and `/slow` (Standard Webhooks preset, each its own route), `/fail-first` (the preset),
    /// `/status` (signed, keyed by `webhook-id`, ignoring `/attempts`), `/headers` (GitHub preset), `/big`
    /// (Stripe preset), `/status/200/slack` and `/status/200/shopify` (those presets), `/status/201/shopify`
    /// (the Shopify preset keyed on `X-Shopify-Webhook-Id` instead: once per subscription).
    async fn start(backend: &Backend) -> Hooks {
        let (up, counts) = start_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        let mut config = String::new();
        for (name, path) in [("orders", "/orders"), ("slow", "/slow"), ("fail", "/fail-first")] {
            config.push_str(&format!(
                "[[route]]\npath = {path:?}\nname = {name:?}\npreset = \"standard-webhooks\"\nsecret_file = {secret:?}\n"
            ));
        }
        config.push_str(&format!(
            "[[route]]\npath = \"/status\"\nname = \"ignoring\"\nsignature = \"standard-webhooks\"\nsecret_file = \
             {secret:?}\nkey = [\"header:webhook-id\"]\nignore = [\"json:/attempts\"]\n"
        ));
        for (path, preset, secret) in [
            ("/headers", "github", GITHUB_SECRET),
            ("/big", "stripe", STRIPE_SECRET),
            ("/status/200/slack", "slack", SLACK_SECRET),
            ("/status/200/shopify", "shopify", SHOPIFY_SECRET),
        ] {
            let file = dir.path().join(preset);
            std::fs::write(&file, format!("{secret}\n")).unwrap();
            config.push_str(&format!("[[route]]\npath = {path:?}\npreset = {preset:?}\nsecret_file = {file:?}\n"));
        }
        config.push_str(&format!(
            "[[route]]\npath = \"/status/201/shopify\"\nname = \"shopify-each\"\npreset = \"shopify\"\nsecret_file = \
             {:?}\nkey = [\"header:x-shopify-webhook-id\"]\n",
            dir.path().join("shopify")
        ));
        let config_file = dir.path().join("idem.toml");
        std::fs::write(&config_file, config).unwrap();
        let (store, postgres) = match backend {
            Backend::Sqlite => (format!("sqlite:{}", dir.path().join("idem.db").display()), None),
            Backend::Postgres(url) => {
                (url.clone(), Some((url.clone(), format!("idem_webhooks_{:012x}", rand::random::<u64>() >> 16))))
            }
        };
        let mut args = vec![
            "--upstream".to_owned(),
            up,
            "--admin-listen".into(),
            "127.0.0.1:0".into(),
            "--store".into(),
            store,
            "--config".into(),
            config_file.display().to_string(),
        ];
        if let Some((_, ns)) = &postgres {
            args.extend(["--namespace".into(), ns.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = Server::start(&args, &[]);
        Hooks { server, counts, _dir: dir, postgres }
    }

    async fn send(&self, path: &str, headers: &[(String, String)], body: &str) -> reqwest::Response {
        let mut request =
            client().post(format!("{}{path}", self.server.url)).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(name, value);
        }
        request.body(body.to_owned()).send().await.unwrap()
    }

    /// Idempotency records of every route, via the admin listener's KV API.
    async fn route_records(&self) -> usize {
        let page: serde_json::Value = client()
            .get(format!("{}/v1/kv?prefix=idempotency/route/", self.server.admin))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        page["items"].as_array().map_or(0, Vec::len)
    }

    /// The admin URL of a route's record for a delivery sent to `path` without a credential header: the scope
    /// is 32 hex digits of SHA-256 over `idem scope`, NUL, `idem route scope`, NUL, the path, NUL.
    fn route_record_url(&self, route: &str, path: &str, id: &str) -> String {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(format!("idem scope\0idem route scope\0{path}\0").as_bytes());
        let scope: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}/v1/idempotency/route/{route}/{scope}/{id}", self.server.admin)
    }

    /// The value of the counter `name` whose labels include every `k="v"` of `labels`, from `/metrics`.
    async fn metric(&self, name: &str, labels: &[&str]) -> u64 {
        let text = client().get(format!("{}/metrics", self.server.admin)).send().await.unwrap().text().await.unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|label| l.contains(label)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
    }

    async fn finish(self) {
        drop(self.server);
        if let Some((url, ns)) = self.postgres {
            let (pg, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            pg.batch_execute(&format!("DROP SCHEMA IF EXISTS {ns} CASCADE")).await.unwrap();
        }
    }
}

pub(crate) fn now() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()).unwrap()
}

fn delivery_id() -> String {
    format!("msg_{:016x}", rand::random::<u64>())
}

/// Standard Webhooks headers, signed here: `v1,` + base64 HMAC-SHA256(id.timestamp.body) under the secret's
/// decoded bytes.
pub(crate) fn signed(secret: &str, id: &str, timestamp: i64, body: &str) -> Vec<(String, String)> {
    let key = base64::engine::general_purpose::STANDARD.decode(secret.trim_start_matches("whsec_")).unwrap();
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    vec![
        ("webhook-id".into(), id.into()),
        ("webhook-timestamp".into(), timestamp.to_string()),
        ("webhook-signature".into(), format!("v1,{signature}")),
    ]
}

fn hmac_hex(secret: &str, parts: &[&str]) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    for part in parts {
        mac.update(part.as_bytes());
    }
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// A GitHub delivery's headers: `X-Hub-Signature-256: sha256=` hex HMAC-SHA256 of the body under the secret.
fn github(hook: &str, guid: &str, body: &str) -> Vec<(String, String)> {
    vec![
        ("x-github-hook-id".into(), hook.into()),
        ("x-github-delivery".into(), guid.into()),
        ("x-github-event".into(), "push".into()),
        ("x-hub-signature-256".into(), format!("sha256={}", hmac_hex(GITHUB_SECRET, &[body]))),
    ]
}

/// A Stripe delivery's `Stripe-Signature`: `t=`, `v1=` hex HMAC-SHA256 of `t.body` under the `whsec_` text.
fn stripe(timestamp: i64, body: &str) -> Vec<(String, String)> {
    let t = timestamp.to_string();
    vec![("stripe-signature".into(), format!("t={t},v1={}", hmac_hex(STRIPE_SECRET, &[&t, ".", body])))]
}

/// A Shopify delivery's headers without an event id (`orders/create`): `X-Shopify-Hmac-Sha256`, base64
/// HMAC-SHA256 of the body under the secret.
fn shopify(id: &str, secret: &str, body: &str) -> Vec<(String, String)> {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    vec![
        ("x-shopify-webhook-id".into(), id.into()),
        ("x-shopify-topic".into(), "orders/create".into()),
        ("x-shopify-hmac-sha256".into(), base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())),
    ]
}

/// A Shopify delivery of event `event` on `topic` as webhook `id`, signed with the route's secret.
fn shopify_event(event: &str, topic: &str, id: &str, body: &str) -> Vec<(String, String)> {
    let mut headers = shopify(id, SHOPIFY_SECRET, body);
    headers.retain(|(name, _)| name != "x-shopify-topic");
    headers.push(("x-shopify-topic".into(), topic.into()));
    headers.push(("x-shopify-event-id".into(), event.into()));
    headers
}

fn shopify_id() -> String {
    format!("b54557e4-bdd9-4b37-8a5f-{:012x}", rand::random::<u64>() >> 16)
}

/// Slack's `X-Slack-Request-Timestamp` and `X-Slack-Signature`, made by `slack_sdk`'s `SignatureVerifier`.
fn signed_by_slack(python: &PathBuf, secret: &str, timestamp: i64, body: &str) -> Vec<(String, String)> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/slack_sign.py");
    let mut child = Command::new(python).arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let request = serde_json::json!({ "secret": secret, "timestamp": timestamp, "body": body });
    child.stdin.take().unwrap().write_all(request.to_string().as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "the Python signer failed");
    let headers: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap();
    headers.into_iter().map(|(k, v)| (k, v.as_str().unwrap().to_owned())).collect()
}

/// The Python interpreter of the installed peers, or `None` (skipped with a reason; a failure in CI).
pub(crate) fn python_peer() -> Option<PathBuf> {
    let python = std::env::var("IDEM_TEST_WEBHOOK_PEERS").ok().map(|dir| PathBuf::from(dir).join("venv/bin/python"));
    match python {
        Some(python) if python.exists() => Some(python),
        _ => {
            assert!(
                std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(),
                "IDEM_TEST_WEBHOOK_PEERS names no installed peers (run scripts/webhook-peers.sh DIR) but \
                 IDEM_TEST_REQUIRE_BACKENDS is set"
            );
            eprintln!("skipped: IDEM_TEST_WEBHOOK_PEERS is unset or not installed (scripts/webhook-peers.sh DIR)");
            None
        }
    }
}

/// Standard Webhooks headers signed by the `standardwebhooks` Python package.
pub(crate) fn signed_by_python(python: &PathBuf, id: &str, timestamp: i64, body: &str) -> Vec<(String, String)> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/webhook_sign.py");
    let mut child = Command::new(python).arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let request = serde_json::json!({ "secret": SECRET, "id": id, "timestamp": timestamp, "body": body });
    child.stdin.take().unwrap().write_all(request.to_string().as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "the Python signer failed");
    let headers: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap();
    headers.into_iter().map(|(k, v)| (k, v.as_str().unwrap().to_owned())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delivery_signed_by_standardwebhooks_and_sent_three_times_executes_once() {
    let Some(python) = python_peer() else { return };
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let id = delivery_id();
        let t = now();
        let mut answers = Vec::new();
        // Each redelivery carries a new timestamp and so a new signature, as senders make them.
        for timestamp in [t - 20, t - 10, t] {
            let headers = signed_by_python(&python, &id, timestamp, BODY);
            let answer = hooks.send("/orders", &headers, BODY).await;
            let replayed = answer.headers().get("idempotent-replayed").is_some();
            answers.push((answer.status(), replayed, answer.bytes().await.unwrap()));
        }
        assert_eq!(hooks.counts.executions_of(&id), 1, "executions of the delivery");
        assert_eq!(hooks.counts.executions(), 1, "executions in all");
        assert_eq!(answers[0].0, StatusCode::CREATED);
        assert!(!answers[0].1, "the first answer is the execution's");
        for (status, replayed, body) in &answers[1..] {
            assert_eq!((*status, *replayed, body), (StatusCode::CREATED, true, &answers[0].2));
        }
        assert_eq!(hooks.route_records().await, 1);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn forged_stale_and_missing_signatures_claim_nothing_then_the_genuine_delivery_executes() {
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let id = delivery_id();
        let forged = signed(OTHER_SECRET, &id, now(), BODY);
        let stale = signed(SECRET, &id, now() - 301, BODY);
        let missing: Vec<(String, String)> = signed(SECRET, &id, now(), BODY).into_iter().take(2).collect();
        let mut tampered = signed(SECRET, &id, now(), BODY);
        tampered[1].1 = (now() - 1).to_string();
        for (what, headers, reason) in [
            ("forged", forged, "no signature matches"),
            ("stale", stale, "outside the 300 s tolerance"),
            ("missing", missing, "no webhook-signature"),
        ]
        .into_iter()
        .chain([("tampered timestamp", tampered, "no signature matches")])
        {
            let answer = hooks.send("/orders", &headers, BODY).await;
            assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{what}");
            assert_eq!(answer.headers()["www-authenticate"], "Webhook-Signature scheme=\"standard-webhooks\"");
            assert_eq!(answer.headers()["content-type"], "application/problem+json");
            let problem: serde_json::Value = answer.json().await.unwrap();
            assert_eq!(problem["type"], "urn:idem:problem:webhook-signature-invalid", "{what}");
            assert!(problem["detail"].as_str().unwrap().contains(reason), "{what}: {problem}");
        }
        assert_eq!(hooks.counts.executions(), 0, "nothing forwarded");
        assert_eq!(hooks.route_records().await, 0, "nothing claimed or stored");
        let record = hooks.route_record_url("orders", "/orders", &id);
        assert_eq!(client().get(&record).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        let genuine = hooks.send("/orders", &signed(SECRET, &id, now(), BODY), BODY).await;
        assert_eq!(genuine.status(), StatusCode::CREATED);
        assert_eq!(hooks.counts.executions_of(&id), 1);
        assert_eq!(hooks.route_records().await, 1);
        // The operator's view of the route's record, and its removal: the next delivery executes again.
        let view: serde_json::Value = client().get(&record).send().await.unwrap().json().await.unwrap();
        assert_eq!((view["state"].as_str(), view["status"].as_u64()), (Some("completed"), Some(201)), "{view}");
        // A webhook route keeps its records for at least Stripe's 3 days of redeliveries (the proxy's 24 h
        // would let a day-2 redelivery execute again).
        let expires: SystemTime = humantime::parse_rfc3339(view["expires_at"].as_str().unwrap()).unwrap();
        let kept = expires.duration_since(SystemTime::now()).unwrap();
        assert!(kept > std::time::Duration::from_secs(71 * 3600), "kept {kept:?}");
        // The short form computes the scope from the request path (here spelled another way).
        let short = format!("{}/v1/idempotency/route/orders/{id}?path=/Orders/", hooks.server.admin);
        let same: serde_json::Value = client().get(&short).send().await.unwrap().json().await.unwrap();
        assert_eq!(same, view);
        let elsewhere = format!("{}/v1/idempotency/route/orders/{id}?path=/orders/x", hooks.server.admin);
        assert_eq!(client().get(&elsewhere).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        let relative = format!("{}/v1/idempotency/route/orders/{id}?path=orders", hooks.server.admin);
        assert_eq!(client().get(&relative).send().await.unwrap().status(), StatusCode::BAD_REQUEST);
        assert_eq!(client().delete(&record).send().await.unwrap().status(), StatusCode::NO_CONTENT);
        assert_eq!(client().get(&record).send().await.unwrap().status(), StatusCode::NOT_FOUND);
        let after_delete = hooks.send("/orders", &signed(SECRET, &id, now(), BODY), BODY).await;
        assert_eq!(after_delete.status(), StatusCode::CREATED);
        assert!(after_delete.headers().get("idempotent-replayed").is_none());
        assert_eq!(hooks.counts.executions_of(&id), 2);
        let refusals = "idem_route_signature_refusals_total";
        for (reason, n) in [("mismatch", 2), ("stale", 1), ("missing", 1), ("malformed", 0)] {
            let labels = ["route=\"orders\"", &format!("reason=\"{reason}\"")];
            assert_eq!(hooks.metric(refusals, &labels).await, n, "{reason}");
        }
        assert_eq!(hooks.metric("idem_route_deliveries_total", &["route=\"orders\""]).await, 2);
        assert_eq!(hooks.metric("idem_route_executions_total", &["route=\"orders\""]).await, 2);
        let log = hooks.server.log.0.lock().unwrap().clone();
        assert!(!log.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "the secret never reaches the log");
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_first_processing_is_executed_again_and_never_after_the_first_2xx() {
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let id = delivery_id();
        let t = now();
        let first = hooks.send("/fail-first/1", &signed(SECRET, &id, t - 30, BODY), BODY).await;
        assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR, "the upstream's own 500 reaches the sender");
        assert!(first.headers().get("idempotent-replayed").is_none());
        assert_eq!(first.headers()["stripe-should-retry"], "true", "a released failure is worth retrying");
        assert_eq!(first.headers()["x-should-retry"], "true");
        assert_eq!(hooks.route_records().await, 0, "the failure was released, not stored");
        let second = hooks.send("/fail-first/1", &signed(SECRET, &id, t - 20, BODY), BODY).await;
        assert_eq!(second.status(), StatusCode::CREATED, "the redelivery executed");
        let body = second.bytes().await.unwrap();
        for step in 0..5 {
            let again = hooks.send("/fail-first/1", &signed(SECRET, &id, t - 10 + step, BODY), BODY).await;
            assert_eq!(again.status(), StatusCode::CREATED);
            assert_eq!(again.headers()["idempotent-replayed"], "true");
            assert_eq!(again.bytes().await.unwrap(), body);
        }
        assert_eq!(hooks.counts.executions_of(&id), 2, "the failed execution and the successful one");
        let route = ["route=\"fail\""];
        assert_eq!(hooks.metric("idem_route_released_failures_total", &route).await, 1);
        assert_eq!(hooks.metric("idem_route_executions_total", &route).await, 2);
        assert_eq!(hooks.metric("idem_route_duplicates_replayed_total", &route).await, 5);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn twelve_concurrent_copies_against_a_slow_upstream_execute_once_and_all_get_2xx() {
    for backend in Backend::all() {
        let hooks = Arc::new(Hooks::start(&backend).await);
        let id = delivery_id();
        let headers = signed(SECRET, &id, now(), BODY);
        let mut copies = Vec::new();
        for _ in 0..12 {
            let (hooks, headers) = (Arc::clone(&hooks), headers.clone());
            copies.push(tokio::spawn(async move {
                let answer = hooks.send("/slow/1000", &headers, BODY).await;
                (answer.status(), answer.bytes().await.unwrap())
            }));
        }
        let mut answers = Vec::new();
        for copy in copies {
            answers.push(copy.await.unwrap());
        }
        assert_eq!(hooks.counts.executions_of(&id), 1, "one execution for 12 copies");
        assert_eq!(answers.iter().filter(|(status, _)| *status == StatusCode::CREATED).count(), 12, "{answers:?}");
        assert!(answers.iter().all(|(_, body)| *body == answers[0].1), "every copy got the first answer");
        let route = ["route=\"slow\""];
        assert_eq!(hooks.metric("idem_route_deliveries_total", &route).await, 12);
        assert_eq!(hooks.metric("idem_route_executions_total", &route).await, 1);
        // Most copies arrive while the first executes and wait; one delayed past its end is replayed at once.
        let waited = hooks.metric("idem_route_duplicates_waited_total", &route).await;
        let replayed = hooks.metric("idem_route_duplicates_replayed_total", &route).await;
        assert_eq!(waited + replayed, 11, "{waited} waited, {replayed} replayed");
        assert!(waited >= 1, "at least one copy waited for the first answer");
        let Ok(hooks) = Arc::try_unwrap(hooks) else { panic!("a copy still holds the proxy") };
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_delivery_id_on_two_routes_is_two_deliveries_and_ignored_fields_are_not_compared() {
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let id = delivery_id();
        // The same id at two routes: each executes once, neither is a 422.
        for _ in 0..2 {
            assert_eq!(hooks.send("/orders", &signed(SECRET, &id, now(), BODY), BODY).await.status(), 201);
            assert_eq!(hooks.send("/slow/1", &signed(SECRET, &id, now(), BODY), BODY).await.status(), 201);
        }
        assert_eq!(hooks.counts.executions_of(&id), 2);
        // A redelivery whose only change is the ignored attempt counter is replayed; another change is a 422.
        let other = delivery_id();
        let attempt = |n: u32| format!(r#"{{"id":"evt_1","attempts":{n},"amount":5}}"#);
        let first = hooks.send("/status/201", &signed(SECRET, &other, now(), &attempt(1)), &attempt(1)).await;
        assert_eq!(first.status(), StatusCode::CREATED);
        let second = hooks.send("/status/201", &signed(SECRET, &other, now(), &attempt(2)), &attempt(2)).await;
        assert_eq!(second.status(), StatusCode::CREATED);
        assert_eq!(second.headers()["idempotent-replayed"], "true");
        let changed = r#"{"id":"evt_1","attempts":3,"amount":6}"#;
        let third = hooks.send("/status/201", &signed(SECRET, &other, now(), changed), changed).await;
        assert_eq!(third.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(hooks.counts.executions_of(&other), 1);
        assert_eq!(hooks.metric("idem_route_mismatches_total", &["route=\"ignoring\""]).await, 1);
        // A request on a route without any of its key sources is refused before anything is claimed.
        let keyless = hooks.send("/orders", &[], BODY).await;
        assert_eq!(keyless.status(), StatusCode::UNAUTHORIZED, "the signature is checked first");
        assert_eq!(hooks.route_records().await, 3);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_rotate_on_sighup_and_a_broken_file_keeps_the_previous_ones() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!("[[route]]\npath = \"/orders\"\npreset = \"standard-webhooks\"\nsecret_file = {secret:?}\n"),
    )
    .unwrap();
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let config_arg = config.display().to_string();
    let server = Server::start(
        &["--upstream", &up, "--admin-listen", "127.0.0.1:0", "--store", &store, "--config", &config_arg],
        &[],
    );
    let deliver = |secret: &'static str| {
        let url = format!("{}/orders", server.url);
        async move {
            let id = delivery_id();
            let request = client().post(url).header("content-type", "application/json");
            let request = signed(secret, &id, now(), BODY).into_iter().fold(request, |r, (k, v)| r.header(k, v));
            request.body(BODY).send().await.unwrap().status()
        }
    };
    let hup = |reloads: usize, needle: &str| {
        let status = Command::new("kill").args(["-HUP", &server.pid().to_string()]).status().unwrap();
        assert!(status.success());
        server.wait_for_log(needle, reloads, std::time::Duration::from_secs(10));
    };
    assert_eq!(deliver(OTHER_SECRET).await, StatusCode::UNAUTHORIZED, "not yet a secret of the route");
    // Rotation: the new secret added beside the old one, then the old one removed.
    std::fs::write(&secret, format!("{SECRET}\n{OTHER_SECRET}\n")).unwrap();
    hup(1, "webhook secrets reloaded");
    assert_eq!(deliver(SECRET).await, StatusCode::CREATED);
    assert_eq!(deliver(OTHER_SECRET).await, StatusCode::CREATED);
    std::fs::write(&secret, format!("{OTHER_SECRET}\n")).unwrap();
    hup(2, "webhook secrets reloaded");
    assert_eq!(deliver(SECRET).await, StatusCode::UNAUTHORIZED, "the removed secret no longer verifies");
    assert_eq!(deliver(OTHER_SECRET).await, StatusCode::CREATED);
    // A file broken on reload keeps what the route had.
    std::fs::write(&secret, "\n").unwrap();
    let log = {
        hup(1, "webhook secret reload failed");
        server.log.0.lock().unwrap().clone()
    };
    assert_eq!(deliver(OTHER_SECRET).await, StatusCode::CREATED);
    assert_eq!(counts.executions(), 4, "each accepted delivery executed once");
    for text in ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "c2VjcmV0LW9uZS10d28tdGhyZWU"] {
        assert!(!log.contains(text), "a secret reached the log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_github_delivery_at_two_hooks_executes_once_at_each() {
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        // GitHub signs the body only: start-up says the delivery id headers can be made up.
        let needle = "route \"github\": its github signature does not cover key source parts header:x-github-hook-id and header:x-github-delivery";
        let log = hooks.server.wait_for_log(needle, 1, std::time::Duration::from_secs(10));
        assert!(!log.contains("route \"orders\": its"), "Standard Webhooks signs webhook-id:\n{log}");
        assert!(!log.contains("route \"stripe\": its"), "Stripe signs the body's id:\n{log}");
        assert!(log.contains("secret_file") && log.contains("is readable by every user"), "{log}");
        let guid = format!("{:08x}-0000-4000-8000-000000000000", rand::random::<u32>());
        let body = r#"{"ref":"refs/heads/main","after":"abc"}"#;
        // GitHub sends one delivery GUID to every hook the event reaches; a redelivery keeps it.
        for _ in 0..2 {
            for hook in ["101", "202"] {
                let answer = hooks.send("/headers", &github(hook, &guid, body), body).await;
                assert_eq!(answer.status(), StatusCode::OK, "hook {hook}");
            }
        }
        assert_eq!(hooks.counts.executions_of(&format!("101+{guid}")), 1);
        assert_eq!(hooks.counts.executions_of(&format!("202+{guid}")), 1);
        assert_eq!(hooks.counts.executions(), 2);
        let forged = hooks.send("/headers", &github("303", &guid, "{}"), body).await;
        assert_eq!(forged.status(), StatusCode::UNAUTHORIZED, "a signature over another body");
        assert_eq!(hooks.counts.executions(), 2);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stripe_event_redelivered_with_fewer_pending_webhooks_is_replayed() {
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let id = format!("evt_{:016x}", rand::random::<u64>());
        let event = |pending: u32, amount: u32| {
            format!(r#"{{"id":"{id}","object":"event","pending_webhooks":{pending},"data":{{"amount":{amount}}}}}"#)
        };
        let first = hooks.send("/big/16", &stripe(now() - 10, &event(2, 5)), &event(2, 5)).await;
        assert_eq!(first.status(), StatusCode::OK);
        let again = hooks.send("/big/16", &stripe(now(), &event(1, 5)), &event(1, 5)).await;
        assert_eq!(again.status(), StatusCode::OK);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(hooks.counts.executions(), 1, "pending_webhooks is not compared");
        let changed = hooks.send("/big/16", &stripe(now(), &event(1, 6)), &event(1, 6)).await;
        assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY, "another amount is another event");
        let stale = hooks.send("/big/16", &stripe(now() - 301, &event(1, 5)), &event(1, 5)).await;
        assert_eq!(stale.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(hooks.counts.executions(), 1);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stripe_sdk_does_not_retry_a_replayed_stored_error() {
    let Some(python) = python_peer() else { return };
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = crate::common::proxy(&dir, &up, &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/stripe_client.py");
    let api_base = format!("{}/status/500", server.url);
    // The SDK would retry a 500 twice (max_network_retries=2); the stored 500 says Stripe-Should-Retry: false.
    for attempt in 0..2 {
        let output = tokio::task::block_in_place(|| {
            Command::new(&python).args([script, &api_base, "cus-create-1"]).output().unwrap()
        });
        let outcome: serde_json::Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&output.stderr)));
        assert_eq!(outcome, serde_json::json!({"outcome": "error", "status": 500}), "attempt {attempt}");
    }
    assert_eq!(counts.executions(), 1, "executed once");
    // Without the proxy's hint the same SDK call is sent three times: the 500 alone says "retry".
    let direct = format!("{up}/status/500");
    let output =
        tokio::task::block_in_place(|| Command::new(&python).args([script, &direct, "cus-create-2"]).output().unwrap());
    assert!(String::from_utf8_lossy(&output.stdout).contains("500"));
    assert_eq!(counts.executions(), 4, "the SDK's own retries reach an upstream without the hint");
    let metrics = client().get(format!("{}/metrics", server.admin)).send().await.unwrap().text().await.unwrap();
    let replays = metrics.lines().find(|l| l.starts_with("idem_idempotency_replays_total")).unwrap();
    assert_eq!(replays.split_whitespace().last(), Some("1"), "one replay: the second run's one request; no SDK retry");
}

#[test]
fn route_mistakes_are_start_up_errors() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "not base64 at all!\n").unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n\n").unwrap();
    let cases = [
        ("path = \"/a\"".to_owned(), "no key"),
        ("path = \"/a\"\npreset = \"mux\"".into(), "unknown preset"),
        ("path = \"/a\"\nkey = [\"json:id\"]".into(), "RFC 6901"),
        ("path = \"/a/../b\"\nkey = [\"json:/id\"]".into(), "route path"),
        ("path = \"/a\"\nkey = [\"json:/id\"]\nsignature = \"github\"".into(), "need secret_file"),
        (format!("path = \"/a\"\nkey = [\"json:/id\"]\nsignature = \"github\"\nsecret_file = {empty:?}"), "no secret"),
        (
            format!(
                "path = \"/a\"\nkey = [\"json:/id\"]\nsignature = \"github\"\nsecret_file = {secret:?}\ntolerance = \"1m\""
            ),
            "carry no timestamp",
        ),
        (
            format!("path = \"/a\"\nkey = [\"json:/id\"]\nsignature = \"standard-webhooks\"\nsecret_file = {secret:?}"),
            "not base64",
        ),
        (format!("path = \"/a\"\nkey = [\"json:/id\"]\nsecret_file = {secret:?}"), "without a signature scheme"),
        ("path = \"/a\"\nkey = [\"json:/id\"]\non_failure = \"retry\"".into(), "expected release or store"),
        (
            "path = \"/a\"\nkey = [\"json:/id\"]\n[[route]]\npath = \"/A/\"\nname = \"b\"\nkey = [\"json:/id\"]".into(),
            "same path",
        ),
        // The secret itself where a file name or a table belongs (break-it review: both were echoed).
        (
            "path = \"/a\"\nkey = [\"json:/id\"]\nsignature = \"github\"\nsecret_file = \"not base64 at all!\"".into(),
            "secret_file cannot be read",
        ),
        ("path = \"/a\"\nkey = [\"json:/id\"]\nsecret = \"not base64 at all!\"".into(), "unknown field"),
    ];
    for (table, expected) in cases {
        let config = dir.path().join("idem.toml");
        std::fs::write(&config, format!("upstream = \"127.0.0.1:9\"\n[[route]]\n{table}\n")).unwrap();
        let store = format!("sqlite:{}", dir.path().join("idem.db").display());
        let (code, _, stderr) = idem(&["serve", "--config", config.to_str().unwrap(), "--store", &store], &[]);
        assert_eq!(code, 2, "{table}: {stderr}");
        assert!(stderr.contains(expected), "{table}: {stderr}");
        assert!(!stderr.contains("not base64 at all"), "a secret never reaches a message: {stderr}");
    }
    // Routes belong to the proxy.
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, "[[route]]\npath = \"/a\"\nkey = [\"json:/id\"]\n").unwrap();
    let (code, _, stderr) = idem(&["serve", "--config", config.to_str().unwrap()], &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("[[route]] applies to the proxy only"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn slack_retries_and_shopify_redeliveries_execute_once_and_unsigned_ones_never() {
    let Some(python) = python_peer() else { return };
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let event = format!("Ev{:010X}", rand::random::<u32>());
        let body = format!(r#"{{"type":"event_callback","event_id":"{event}","event":{{"type":"app_mention"}}}}"#);
        // Slack retries a delivery with X-Slack-Retry-Num and a new timestamp and signature each time.
        for retry in 0..3 {
            let mut headers = signed_by_slack(&python, SLACK_SECRET, now() - retry, &body);
            if retry > 0 {
                headers.push(("x-slack-retry-num".into(), retry.to_string()));
                headers.push(("x-slack-retry-reason".into(), "http_timeout".into()));
            }
            let answer = hooks.send("/status/200/slack", &headers, &body).await;
            assert_eq!(answer.status(), StatusCode::OK, "retry {retry}");
            assert_eq!(answer.headers().contains_key("idempotent-replayed"), retry > 0, "retry {retry}");
        }
        assert_eq!(hooks.counts.executions_of(&event), 1);
        // The url_verification challenge is signed and carries no event_id: the preset passes it through.
        let before = hooks.counts.executions();
        let challenge =
            r#"{"type":"url_verification","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}"#;
        for _ in 0..2 {
            let headers = signed_by_slack(&python, SLACK_SECRET, now(), challenge);
            let answer = hooks.send("/status/200/slack", &headers, challenge).await;
            assert_eq!(answer.status(), StatusCode::OK);
            assert!(!answer.headers().contains_key("idempotent-replayed"));
        }
        assert_eq!(hooks.counts.executions(), before + 2, "each challenge reaches the app");
        // Unsigned, signed with another secret, or 301 s old: 401, nothing executed or recorded.
        let records = hooks.route_records().await;
        let other = format!(r#"{{"type":"event_callback","event_id":"{event}x"}}"#);
        let forged = signed_by_slack(&python, "another-signing-secret", now(), &other);
        let stale = signed_by_slack(&python, SLACK_SECRET, now() - 301, &other);
        for headers in [vec![], forged, stale] {
            let answer = hooks.send("/status/200/slack", &headers, &other).await;
            assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
        }
        assert_eq!(hooks.counts.executions(), before + 2);
        assert_eq!(hooks.route_records().await, records);

        // Without X-Shopify-Event-Id the preset keys on X-Shopify-Webhook-Id, kept across a delivery's attempts.
        let id = shopify_id();
        let order = r#"{"id":820982911946154508,"email":"jon@example.com","total_price":"9.00"}"#;
        for _ in 0..3 {
            let answer = hooks.send("/status/200/shopify", &shopify(&id, SHOPIFY_SECRET, order), order).await;
            assert_eq!(answer.status(), StatusCode::OK);
        }
        assert_eq!(hooks.counts.executions_of(&id), 1);
        let forged = hooks.send("/status/200/shopify", &shopify(&id, "not-the-secret", order), order).await;
        assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(hooks.counts.executions_of(&id), 1);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_shopify_event_under_new_webhook_ids_executes_once_and_the_copies_are_replays() {
    // Shopify's guide to ignoring duplicates: the same X-Shopify-Event-Id on more than one webhook is a duplicate.
    // A retry sent under a new X-Shopify-Webhook-Id and the delivery to a second subscription of the topic both
    // carry the event's id under a webhook id of their own.
    for backend in Backend::all() {
        let hooks = Hooks::start(&backend).await;
        let event = shopify_id();
        let order = r#"{"id":820982911946154508,"email":"jon@example.com","total_price":"9.00"}"#;
        let (first, retry, second_subscription) = (shopify_id(), shopify_id(), shopify_id());
        for (n, id) in [&first, &retry, &second_subscription].into_iter().enumerate() {
            let headers = shopify_event(&event, "orders/create", id, order);
            let answer = hooks.send("/status/200/shopify", &headers, order).await;
            assert_eq!(answer.status(), StatusCode::OK, "delivery {n}");
            let replayed = answer.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_owned());
            assert_eq!(replayed.as_deref(), (n > 0).then_some("true"), "delivery {n}");
        }
        assert_eq!(hooks.counts.executions_of(&event), 1);
        assert_eq!(hooks.metric("idem_route_duplicates_replayed_total", &["route=\"shopify\""]).await, 2);
        // The same event id under another topic is another delivery, not a 422.
        let refund = r#"{"id":509562969,"order_id":820982911946154508}"#;
        let headers = shopify_event(&event, "refunds/create", &shopify_id(), refund);
        let answer = hooks.send("/status/200/shopify", &headers, refund).await;
        assert_eq!(answer.status(), StatusCode::OK);
        assert!(!answer.headers().contains_key("idempotent-replayed"));
        assert_eq!(hooks.counts.executions_of(&event), 2);
        // A subscription asking for other fields sends another body under the event's id: 422, not executed.
        let fewer = r#"{"id":820982911946154508}"#;
        let headers = shopify_event(&event, "orders/create", &shopify_id(), fewer);
        let answer = hooks.send("/status/200/shopify", &headers, fewer).await;
        assert_eq!(answer.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(hooks.counts.executions_of(&event), 2);
        // A route keyed on X-Shopify-Webhook-Id runs once per subscription and replays each one's attempts.
        for (n, id) in [&first, &second_subscription, &second_subscription].into_iter().enumerate() {
            let headers = shopify_event(&event, "orders/create", id, order);
            let answer = hooks.send("/status/201/shopify", &headers, order).await;
            assert_eq!(answer.status(), StatusCode::CREATED, "delivery {n}");
            assert_eq!(answer.headers().contains_key("idempotent-replayed"), n == 2, "delivery {n}");
        }
        assert_eq!(hooks.counts.executions_of(&event), 4);
        hooks.finish().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_outcome_on_a_webhook_route_is_released_unless_the_route_keeps_it() {
    // The upstream answers after 1.5 s, past a 1 s upstream timeout: the outcome is unknown. On a webhook route
    // the redelivery executes (the sender would otherwise get 502 for days and the event never be processed);
    // a route with on_unknown = "keep" answers 502 instead, as the proxy does by default.
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let mut config = String::from("upstream_timeout = \"1s\"\n");
    for (path, name, unknown) in [("/slow/1500", "released", ""), ("/slow/1501", "kept", "on_unknown = \"keep\"\n")] {
        config.push_str(&format!(
            "[[route]]\npath = {path:?}\nname = {name:?}\npreset = \"standard-webhooks\"\nsecret_file = {secret:?}\n{unknown}"
        ));
    }
    let config_file = dir.path().join("idem.toml");
    std::fs::write(&config_file, config).unwrap();
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let args = ["--upstream", &up, "--admin-listen", "127.0.0.1:0", "--store", &store, "--config"];
    let mut args: Vec<&str> = args.to_vec();
    let config_path = config_file.display().to_string();
    args.push(&config_path);
    let server = Server::start(&args, &[]);
    let send = |path: &'static str, id: String| {
        let url = format!("{}{path}", server.url);
        async move {
            let mut request = client().post(url).header("content-type", "application/json");
            for (name, value) in signed(SECRET, &id, now(), BODY) {
                request = request.header(name, value);
            }
            request.body(BODY).send().await.unwrap().status()
        }
    };
    // Released: the redelivery executes (and times out again); kept: 502 outcome-unknown, not executed.
    for (path, retry_status, executions) in
        [("/slow/1500", StatusCode::GATEWAY_TIMEOUT, 2), ("/slow/1501", StatusCode::BAD_GATEWAY, 1)]
    {
        let id = delivery_id();
        assert_eq!(send(path, id.clone()).await, StatusCode::GATEWAY_TIMEOUT, "{path}");
        // The first execution ends upstream before the redelivery comes.
        tokio::time::sleep(std::time::Duration::from_millis(800)).await;
        assert_eq!(send(path, id.clone()).await, retry_status, "{path}");
        assert_eq!(counts.executions_of(&id), executions, "{path}");
    }
    drop(server);
}
