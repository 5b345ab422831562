//! `idem check`: against `idem serve --upstream` every probe passes; against the bare example upstream the
//! probes that need idempotency fail, each with its observation; against naive services with one flaw each,
//! exactly the probe for that flaw flags it. Requests are counted at the server: a dry run sends none.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

mod naive;

use std::collections::BTreeMap;

use crate::common::{idem, proxy, start_upstream};
use naive::Flaws;

/// `idem check` with `args`, run off the runtime's threads (the servers under test run on them): exit status,
/// standard output, standard error.
async fn check(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let mut all = vec!["check"];
        all.extend(args.iter().map(String::as_str));
        idem(&all, &[])
    })
    .await
    .unwrap()
}

/// Every flag a full run takes, against the API at `base` (the example upstream's routes), JSON report.
fn full_flags(base: &str) -> Vec<String> {
    [
        &format!("{base}/orders"),
        "--credential",
        "Authorization: Bearer alice",
        "--second-credential",
        "Authorization: Bearer bob",
        "--slow-url",
        &format!("{base}/slow/2000"),
        "--error-url",
        &format!("{base}/status/503"),
        "--other-url",
        &format!("{base}/status/201"),
        "--yes",
        "--format",
        "json",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Runs a full check and returns its exit status, the JSON report and each probe's result.
async fn full_check(base: &str, extra: &[&str]) -> (i32, serde_json::Value, BTreeMap<String, String>) {
    let mut args = full_flags(base);
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let (code, out, err) = check(args).await;
    let report: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}\nstderr: {err}"));
    let results = report["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["probe"].as_str().unwrap().to_owned(), p["result"].as_str().unwrap().to_owned()))
        .collect();
    (code, report, results)
}

/// The observation of `probe` in `report`.
fn observed<'r>(report: &'r serde_json::Value, probe: &str) -> &'r str {
    let probes = report["probes"].as_array().unwrap();
    probes.iter().find(|p| p["probe"] == probe).unwrap()["observed"].as_str().unwrap()
}

/// Results for the ten probes, in the order they run.
fn results(list: [&str; 10]) -> BTreeMap<String, String> {
    let names = [
        "missing-key",
        "replay",
        "concurrent",
        "mismatch",
        "other-target",
        "malformed",
        "scope",
        "in-flight",
        "errors",
        "expiry",
    ];
    names.iter().zip(list).map(|(n, r)| ((*n).to_owned(), r.to_owned())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn idem_serve_over_the_example_upstream_passes_every_probe() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up, &["--require-key", "--retention", "2s", "--lease", "1s"]);
    let (code, report, results) = full_check(&server.url, &["--key-required", "--retention-probe", "3s"]).await;
    assert_eq!(results, self::results(["PASS"; 10]), "{report:#}");
    assert_eq!(code, 0);
    assert_eq!(report["requests_sent"], 37);
    assert_eq!(report["requests_answered"], 37);
    // Executed upstream: one each for replay, concurrent, mismatch, other-target and in-flight; two for scope
    // (two credentials), errors (a 503 releases the key) and expiry (after the retention). Nothing for the
    // missing and malformed keys.
    assert_eq!(counts.executions(), 11);
    assert_eq!(
        observed(&report, "missing-key"),
        "400 Bad Request (urn:idem:problem:idempotency-key-missing): the API requires a key"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_bare_example_upstream_fails_the_probes_that_need_idempotency_with_what_it_did() {
    let (up, counts) = start_upstream().await;
    let (code, report, results) = full_check(&up, &["--key-required", "--retention-probe", "1s"]).await;
    let expected = self::results(["FAIL", "FAIL", "FAIL", "FAIL", "PASS", "FAIL", "PASS", "FAIL", "PASS", "PASS"]);
    assert_eq!(results, expected, "{report:#}");
    assert_eq!(code, 1);
    // Every request executed, and each probe's orders are numbered in turn.
    assert_eq!(report["requests_sent"], 37);
    assert_eq!(counts.executions(), 37);
    assert_eq!(
        observed(&report, "missing-key"),
        "201 Created, Location /orders/1: passed through, executed without a key, not 400"
    );
    assert_eq!(
        observed(&report, "replay"),
        r#"the retry got another answer: Location /orders/2 then /orders/3; body {"order":2,"received_bytes":2} then {"order":3,"received_bytes":2}; no replay marker"#
    );
    let concurrent = observed(&report, "concurrent");
    assert!(concurrent.starts_with("16 at once, 16 distinct outcomes: 201 Created, Location /orders/"), "{concurrent}");
    assert!(concurrent.ends_with(" and 13 more; 0 × 409"), "{concurrent}");
    assert_eq!(
        observed(&report, "mismatch"),
        "the other body executed under the same key: 201 Created, Location /orders/21"
    );
    assert_eq!(
        observed(&report, "malformed"),
        "empty → 201 Created; 256 characters → 201 Created; a tab → 201 Created; two field lines → 201 Created: 4 of \
         4 accepted"
    );
    assert_eq!(
        observed(&report, "in-flight"),
        "the duplicate executed too: 201 Created, Location /orders/33 while the first got 201 Created, Location /orders/32"
    );
}

/// Each naive service with one flaw is flagged by exactly the probe for it; the one without flaws passes.
#[tokio::test(flavor = "multi_thread")]
async fn naive_services_are_flagged_by_exactly_the_probe_for_their_flaw() {
    // missing-key reports only and expiry needs --retention-probe: N/A for all of them.
    let clean = ["N/A", "PASS", "PASS", "PASS", "PASS", "PASS", "PASS", "PASS", "PASS", "N/A"];
    let with = |changes: &[(usize, &'static str)]| {
        let mut r = clean;
        for &(i, result) in changes {
            r[i] = result;
        }
        results(r)
    };
    let cases = [
        ("no flaw", Flaws::default(), with(&[]), 0, None),
        (
            "the body left out of the fingerprint",
            Flaws { body_not_fingerprinted: true, ..Flaws::default() },
            with(&[(3, "FAIL")]),
            1,
            Some(("mismatch", "the other body got the first answer back: 201 Created, Location /orders/")),
        ),
        (
            "no fingerprint at all",
            Flaws { no_fingerprint: true, ..Flaws::default() },
            with(&[(3, "FAIL"), (4, "FAIL")]),
            1,
            Some(("other-target", "got the first answer back: PATCH /orders: 201 Created, Location /orders/")),
        ),
        (
            "keys shared between credentials",
            Flaws { unscoped: true, ..Flaws::default() },
            with(&[(6, "FAIL")]),
            1,
            Some(("scope", "the second caller got the first caller's answer: 201 Created, Location /orders/")),
        ),
        (
            "Set-Cookie replayed",
            Flaws { replays_set_cookie: true, ..Flaws::default() },
            with(&[(6, "FAIL")]),
            1,
            Some(("scope", "the replay to the first caller carried the first answer's Set-Cookie \"session=")),
        ),
        (
            "a 503 stored",
            Flaws { stores_503: true, ..Flaws::default() },
            with(&[(8, "WARN")]),
            0,
            Some((
                "errors",
                "503 Service Unavailable pinned to the key: the retry got it replayed (Idempotent-Replayed: true)",
            )),
        ),
    ];
    for (name, flaws, expected, expected_code, observation) in cases {
        let url = naive::start(flaws).await;
        let (code, report, results) = full_check(&url, &[]).await;
        assert_eq!(results, expected, "{name}: {report:#}");
        assert_eq!(code, expected_code, "{name}");
        assert_eq!(report["requests_sent"], 35, "{name}");
        if let Some((probe, start)) = observation {
            let seen = observed(&report, probe);
            assert!(seen.starts_with(start), "{name}: {probe} observed {seen:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dry_run_prints_every_request_and_sends_none() {
    let (up, counts) = start_upstream().await;
    let mut args = full_flags(&up);
    args.retain(|a| a != "--yes");
    args.extend(["--dry-run".to_owned(), "--retention-probe".to_owned(), "1s".to_owned()]);
    let (code, out, err) = check(args.clone()).await;
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["dry_run"], true);
    // 37 and the control requests of replay, concurrent, mismatch, other-target, in-flight, errors, expiry.
    assert_eq!(report["requests_planned"], 44);
    let listed: usize =
        report["probes"].as_array().unwrap().iter().map(|p| p["requests"].as_array().unwrap().len()).sum();
    assert_eq!(listed, 44);
    // As a table: a heading, then one line per request; credential values are not printed.
    args.retain(|a| a != "json" && a != "--format");
    let (code, out, _) = check(args).await;
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("idem check --dry-run: 44 requests planned, none sent; keys start with idem-check-"));
    assert_eq!(lines.len(), 1 + 44, "{out}");
    assert!(!out.contains("alice") && !out.contains("bob"), "{out}");
    assert!(out.contains("authorization: *** (second credential)"), "{out}");
    assert_eq!(counts.executions(), 0, "a dry run sends nothing");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_yes_and_without_a_terminal_it_refuses_and_sends_nothing() {
    let (up, counts) = start_upstream().await;
    let (code, out, err) = check(vec![format!("{up}/orders")]).await;
    assert_eq!(code, 2);
    assert_eq!(out, "");
    assert_eq!(
        err,
        "idem: standard input is not a terminal: give --yes to send 33 requests, or --dry-run to list them\n"
    );
    assert_eq!(counts.executions(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_usage_exits_2_with_one_line_and_sends_nothing() {
    let (up, counts) = start_upstream().await;
    let url = format!("{up}/orders");
    let cases: [(&[&str], &str); 8] = [
        (&["--json", "{"], "idem: --json is not valid JSON: "),
        (&["-H", "Idempotency-Key: x"], "idem: --header idempotency-key is set by idem check itself"),
        (&["--concurrency", "1"], "idem: --concurrency 1 is outside 2..=64"),
        (&["--retention-probe", "2h"], "idem: --retention-probe 2h is over 1h"),
        (
            &["--credential", "Authorization: a", "--second-credential", "Authorization: a"],
            "idem: --second-credential is the same as --credential",
        ),
        (
            &["--credential", "Authorization: a", "-H", "Authorization: b"],
            "idem: --credential names authorization, which --header sets too",
        ),
        (
            &["--slow-url", "ftp://127.0.0.1/x"],
            "idem: --slow-url \"ftp://127.0.0.1/x\" has the scheme ftp, not http or https",
        ),
        (&["--method", "BAD METHOD"], "idem: --method \"BAD METHOD\" is not an HTTP method"),
    ];
    for (flags, message) in cases {
        let mut args = vec![url.clone(), "--yes".to_owned()];
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let (code, _, err) = check(args).await;
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.starts_with(message), "{flags:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{flags:?}: {err}");
    }
    // Usage clap refuses: an unknown probe, two bodies.
    for flags in [&["--only", "replay,nonsense"][..], &["--json", "{}", "--data", "x"]] {
        let mut args = vec![url.clone(), "--yes".to_owned()];
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let (code, _, err) = check(args).await;
        assert_eq!(code, 2, "{flags:?}: {err}");
    }
    assert_eq!(counts.executions(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_json_report_names_each_probe_its_requests_and_their_answers() {
    let (up, _counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up, &[]);
    let args = [&format!("{}/orders", server.url), "--only", "malformed,replay", "--format", "json", "--yes"];
    let (code, out, err) = check(args.map(str::to_owned).to_vec()).await;
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["target"], format!("POST {}/orders", server.url));
    let prefix = report["key_prefix"].as_str().unwrap();
    assert!(prefix.len() == "idem-check-".len() + 9 && prefix.starts_with("idem-check-") && prefix.ends_with('-'));
    assert_eq!((report["requests_sent"].as_u64(), report["requests_answered"].as_u64()), (Some(6), Some(6)));
    assert_eq!(report["counts"], serde_json::json!({"pass": 2, "fail": 0, "warn": 0, "n/a": 0}));
    assert_eq!(report["exit_status"], 0);
    let probes = report["probes"].as_array().unwrap();
    let names: Vec<&str> = probes.iter().map(|p| p["probe"].as_str().unwrap()).collect();
    assert_eq!(names, ["replay", "malformed"], "in the order they run");
    let replay = &probes[0];
    for field in ["title", "spec", "expected", "observed"] {
        assert!(replay[field].as_str().is_some_and(|s| !s.is_empty()), "{field}: {replay:#}");
    }
    assert_eq!(replay["spec"], "draft §2.6");
    assert_eq!(replay["result"], "PASS");
    let requests = replay["requests"].as_array().unwrap();
    // The control request was not sent: the retry was marked as a replay.
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[2]["answer"], serde_json::Value::Null);
    assert_eq!(requests[0]["method"], "POST");
    assert_eq!(requests[0]["caller"], "first");
    assert_eq!(requests[0]["body"], "main");
    assert_eq!(requests[0]["idempotency_key"], serde_json::json!([format!("\"{prefix}replay\"")]));
    assert_eq!(requests[0]["answer"], serde_json::json!({"status": 201, "replayed": false, "location": "/orders/1"}));
    assert_eq!(requests[1]["answer"], serde_json::json!({"status": 201, "replayed": true, "location": "/orders/1"}));
    let malformed: Vec<u64> =
        probes[1]["requests"].as_array().unwrap().iter().map(|r| r["answer"]["status"].as_u64().unwrap()).collect();
    assert_eq!(malformed, [400, 400, 400, 400]);
    // Every key but the empty one carries the run's prefix; a second run has another.
    for request in probes[1]["requests"].as_array().unwrap() {
        for key in request["idempotency_key"].as_array().unwrap() {
            let key = key.as_str().unwrap();
            assert!(key.is_empty() || key.starts_with(&format!("\"{prefix}")), "{key}");
        }
    }
    let (_, again, _) = check(args.map(str::to_owned).to_vec()).await;
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_ne!(again["key_prefix"].as_str().unwrap(), prefix);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_table_has_a_row_per_probe_and_a_summary() {
    let (up, _counts) = start_upstream().await;
    let args = [&format!("{up}/orders"), "--only", "replay,expiry", "--yes"];
    let (code, out, err) = check(args.map(str::to_owned).to_vec()).await;
    assert_eq!(code, 1, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), ["PROBE", "RESULT", "EXPECTED", "OBSERVED", "SPEC"]);
    let rows: Vec<&str> = lines.iter().filter(|l| !l.starts_with(' ')).copied().collect();
    assert!(rows[1].starts_with("replay        FAIL    the first answer again:"), "{out}");
    assert!(rows[2].starts_with("expiry        N/A     the key executes again"), "{out}");
    assert!(
        lines.last().unwrap().starts_with("0 PASS, 1 FAIL, 0 WARN, 1 N/A; 2 requests sent, keys idem-check-"),
        "{out}"
    );
    assert!(
        err.starts_with("idem check: 2 probes, up to 3 requests (real writes), every key starting with idem-check-"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_api_that_does_not_answer_stops_the_run_with_exit_1() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (code, out, err) = check(vec![format!("http://127.0.0.1:{port}/orders"), "--yes".to_owned()]).await;
    assert_eq!(code, 1, "{err}");
    assert_eq!(out, "");
    let last = err.lines().last().unwrap();
    assert!(last.starts_with(&format!("idem: no answer from http://127.0.0.1:{port}/orders (1 sent): POST ")), "{err}");
    assert!(last.contains("could not connect"), "{err}");
}

/// `idem check` on a terminal (util-linux `script` gives it one) with `answer` typed: exit status and what the
/// terminal showed. `None` when `script` is missing.
async fn check_on_a_terminal(url: String, answer: &'static str) -> Option<(i32, String)> {
    tokio::task::spawn_blocking(move || {
        let command = format!("'{}' check '{url}' --only replay", crate::common::BIN);
        let mut child = match std::process::Command::new("script")
            .args(["-qec", &command, "/dev/null"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                eprintln!("skipped: cannot run `script` (util-linux) for a terminal: {e}");
                return None;
            }
        };
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), answer.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        Some((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned()))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn on_a_terminal_it_prints_the_plan_and_sends_only_after_a_yes() {
    let (up, counts) = start_upstream().await;
    let Some((code, shown)) = check_on_a_terminal(format!("{up}/orders"), "n\n").await else { return };
    assert_eq!(code, 2, "{shown}");
    assert!(shown.contains("idem check: 1 probe, up to 3 requests (real writes)"), "{shown}");
    assert!(shown.contains("Send these 3 requests? [y/N] idem: not confirmed: nothing sent"), "{shown}");
    assert_eq!(counts.executions(), 0);
    let Some((code, shown)) = check_on_a_terminal(format!("{up}/orders"), "y\n").await else { return };
    assert_eq!(code, 1, "the bare upstream fails the replay probe: {shown}");
    assert!(shown.contains("0 PASS, 1 FAIL, 0 WARN, 0 N/A; 2 requests sent"), "{shown}");
    assert_eq!(counts.executions(), 2);
}

/// An API that ignores the key and always answers `201 {}` executes every request: no probe may call its
/// identical answers replays (PASS, or a FAIL for "the first answer back"); each says it cannot tell.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_whose_answers_never_differ_gets_warn_not_pass() {
    let (url, executed) = naive::start_constant().await;
    let mut args = full_flags(&url);
    for (flag, path) in [("--slow-url", "slow"), ("--error-url", "error"), ("--other-url", "other")] {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1] = format!("{url}/{path}");
    }
    args.extend(["--retention-probe".to_owned(), "1s".to_owned()]);
    let (code, out, err) = check(args).await;
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    let results: BTreeMap<String, String> = report["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["probe"].as_str().unwrap().to_owned(), p["result"].as_str().unwrap().to_owned()))
        .collect();
    // malformed: the keys were accepted (true whatever the answers); scope: the same answer for both callers.
    let expected = self::results(["N/A", "WARN", "WARN", "WARN", "WARN", "FAIL", "WARN", "WARN", "WARN", "WARN"]);
    assert_eq!(results, expected, "{report:#}");
    assert_eq!(code, 1);
    // Every probe's control request was sent: 1 + 3 + 17 + 3 + 4 + 4 + 3 + 3 + 3 + 3, all executed.
    assert_eq!(report["requests_sent"], 44);
    assert_eq!(executed.load(std::sync::atomic::Ordering::SeqCst), 44);
    let why = "answers of two separate executions are identical: cannot tell a replay from a re-execution; make the \
               API echo something per execution, e.g. an id";
    for probe in ["replay", "concurrent", "mismatch", "other-target", "in-flight", "errors", "expiry"] {
        let seen = observed(&report, probe);
        assert!(seen.ends_with(why), "{probe}: {seen}");
        assert!(!seen.contains("got the first answer back"), "{probe}: {seen}");
    }
    assert_eq!(
        observed(&report, "replay"),
        format!(
            "201 Created twice with identical bodies (2 bytes), no replay marker; a second execution under another key got the same: {why}"
        )
    );
    assert_eq!(
        observed(&report, "errors"),
        format!(
            "503 Service Unavailable twice with identical bodies, no replay marker; a second execution under another key got the same: {why}"
        )
    );
}

/// A proxy named in the environment is not used: the check contacts only the URLs given, so neither the
/// requests nor the credential reach the proxy.
#[tokio::test(flavor = "multi_thread")]
async fn proxy_variables_in_the_environment_are_not_used() {
    let (up, counts) = start_upstream().await;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&reached);
    tokio::spawn(async move {
        while let Ok((stream, _)) = proxy.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    let url = format!("{up}/orders");
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        let args = ["check", &url, "--only", "replay", "--credential", "Authorization: Bearer alice", "--yes"];
        let envs =
            [("HTTP_PROXY", proxy_url.as_str()), ("http_proxy", proxy_url.as_str()), ("ALL_PROXY", proxy_url.as_str())];
        idem(&args, &envs)
    })
    .await
    .unwrap();
    // The bare upstream executes the retry: the replay probe fails, with answers (no "no answer from").
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("no answer"), "{err}");
    assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 0, "connections to the proxy");
    assert_eq!(counts.executions(), 2, "the replay probe's two requests reached the API");
}

/// A TLS file that cannot be read is refused before the plan is printed, the prompt shown or anything sent,
/// also with --dry-run.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_tls_file_is_refused_before_the_plan() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem").display().to_string();
    let url = format!("{up}/orders");
    for flags in [
        vec!["--cacert", &missing, "--yes"],
        vec!["--cacert", &missing, "--dry-run"],
        vec!["--cert", &missing, "--yes"],
        vec!["--cert", &missing, "--cert-key", &missing, "--dry-run"],
    ] {
        let mut args = vec![url.clone()];
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let (code, out, err) = check(args).await;
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert_eq!(out, "", "{flags:?}");
        assert_eq!(err.lines().count(), 1, "{flags:?}: {err}");
        assert!(err.starts_with("idem: ") && err.contains("missing.pem"), "{flags:?}: {err}");
    }
    assert_eq!(counts.executions(), 0);
}

/// A password in the URL's userinfo is hidden wherever the URL is printed: the plan, --dry-run (table and
/// JSON) and the report.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_in_the_url_is_never_printed() {
    let (up, _counts) = start_upstream().await;
    let url = up.replace("http://", "http://user:secret@") + "/orders";
    let runs: [&[&str]; 3] =
        [&["--dry-run"], &["--dry-run", "--format", "json"], &["--only", "replay", "--yes", "--format", "json"]];
    for flags in runs {
        let mut args = vec![url.clone()];
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let (_, out, err) = check(args).await;
        assert!(!out.contains("secret") && !err.contains("secret"), "{flags:?}: {out}{err}");
        assert!(out.contains("http://user:***@127.0.0.1:"), "{flags:?}: {out}");
    }
}

/// A URL that is not an API's full URL is refused before anything is sent: exit 2, one line.
#[tokio::test(flavor = "multi_thread")]
async fn a_url_that_is_not_an_apis_is_refused() {
    let (up, counts) = start_upstream().await;
    let cases: [(Vec<String>, &str); 5] = [
        (vec!["http://127.0.0.1:0/orders".into()], "idem: URL \"http://127.0.0.1:0/orders\" has port 0;"),
        (vec!["/orders".into()], "idem: URL \"/orders\" is a relative URL;"),
        (vec!["orders".into()], "idem: URL \"orders\" is a relative URL (no host with a dot or a port);"),
        (vec!["mailto:x@y".into()], "idem: URL \"mailto:x@y\" has the scheme mailto, not http or https;"),
        (
            vec![format!("{up}/orders"), "--other-url".into(), "orders".into()],
            "idem: --other-url \"orders\" is a relative URL",
        ),
    ];
    for (mut args, message) in cases {
        args.push("--yes".into());
        let (code, out, err) = check(args.clone()).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(out, "");
        assert!(err.starts_with(message), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
    // What the clients take stays accepted: HOST:PORT without a scheme.
    let bare = up.trim_start_matches("http://").to_owned() + "/orders";
    let (code, out, err) = check(vec![bare, "--dry-run".into(), "--only".into(), "replay".into()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("idem check --dry-run: 3 requests planned"), "{out}");
    assert_eq!(counts.executions(), 0);
}

/// Bodies are read to the end but kept only to 1 MiB: a 3 MiB body is compared by length and SHA-256 (and the
/// observation says so), and a body that never ends stops at --timeout with a report, memory bounded.
#[tokio::test(flavor = "multi_thread")]
async fn long_and_endless_bodies_are_read_within_a_bound() {
    let (url, _executed) = naive::start_constant().await;
    let args = [&format!("{url}/big"), "--only", "replay", "--yes", "--format", "json"];
    let (code, out, err) = check(args.map(str::to_owned).to_vec()).await;
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let seen = observed(&report, "replay");
    assert!(
        seen.starts_with(
            "201 Created twice with identical bodies (3145728 bytes, over the 1 MiB kept: compared by length and \
             SHA-256), no replay marker"
        ),
        "{seen}"
    );
    let args = [&format!("{url}/endless"), "--only", "replay", "--yes", "--timeout", "2s"];
    let started = std::time::Instant::now();
    let (code, out, err) = check(args.map(str::to_owned).to_vec()).await;
    assert_eq!(code, 1, "{out}{err}");
    let last = err.lines().last().unwrap();
    assert!(last.starts_with(&format!("idem: no answer from {url}/endless (1 sent): POST ")), "{err}");
    assert!(last.contains("timed out"), "{err}");
    // The whole run ended: one request, cut by its --timeout (generous bound for a busy machine).
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}", started.elapsed());
}
