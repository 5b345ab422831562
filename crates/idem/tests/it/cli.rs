//! The `idem` command as a user runs it: serve flags and config, refusals, graceful shutdown, the kv client,
//! and the README's examples (`readme/mod.rs`).
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use crate::common;

use std::process::Command;
use std::time::Duration;

use crate::common::{BIN, Server, client, idem};

#[test]
fn refuses_non_loopback_without_token_unless_insecure() {
    let (code, _, err) = idem(&["serve", "--listen", "0.0.0.0:0", "--store", "memory:"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--insecure") && err.contains("0.0.0.0"), "{err}");
    let s = Server::start(&["--listen", "0.0.0.0:0", "--store", "memory:", "--insecure"], &[]);
    assert!(s.url.contains("0.0.0.0"));
    let s = Server::start(&["--listen", "0.0.0.0:0", "--store", "memory:"], &[("IDEM_INSECURE", "1")]);
    assert!(s.url.contains("0.0.0.0"));
    let (code, _, _) = idem(&["serve", "--listen", "0.0.0.0:0", "--store", "memory:"], &[("IDEM_INSECURE", "0")]);
    assert_eq!(code, 2, "IDEM_INSECURE=0 must not allow it");
    // A token alone no longer suffices there (it would cross the network in clear): tls.rs tests TLS with a
    // token or a client CA, and this refusal's message.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0k3n\n").unwrap();
    let (code, _, err) = idem(
        &["serve", "--listen", "0.0.0.0:0", "--store", "memory:", "--auth-token-file", token.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tls-cert") && err.contains("--insecure"), "{err}");
}

#[test]
fn bad_store_urls_and_flags_exit_2_with_one_line() {
    // A port already taken, to prove a refused start creates no database.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().to_string();
    for (args, needle) in [
        // Refused settings (an unreachable store is an outage, answered 503: `an_unreachable_store_is_served_as_503`).
        (
            vec!["--store", "postgres://alice:hunter2@127.0.0.1:1/db?sslmode=verify"],
            "postgres://alice:***@127.0.0.1:1/db",
        ),
        (vec!["--store", "postgres://alice:hunter2@127.0.0.1:5432/db?sslmode=nonsense"], "alice:***@"),
        (vec!["--store", "redis://:hunter2@127.0.0.1:1?wait_replicas=x"], "redis://:***@127.0.0.1:1"),
        // A password holding `@`, and one in the query string.
        (
            vec!["--store", "postgres://alice:hun@ter2hunter2@127.0.0.1:1/db?target_session_attrs=any"],
            "postgres://alice:***@127.0.0.1:1/db",
        ),
        (vec!["--store", "postgres://alice@127.0.0.1:1/db?sslmode=allow&password=hunter2"], "password=***"),
        (vec!["--store", "redis://alice:hunter2@[::1"], "cannot open store"),
        (vec!["--store", "ftp://x"], "unknown scheme"),
        (vec!["--store", "sqlite:"], "names no file"),
        (vec!["--listen", "localhost"], "not an IP:PORT"),
        (vec!["--max-value-bytes", "0"], "at least 1"),
        (vec!["--auth-token-file", "/nonexistent/token"], "cannot read --auth-token-file"),
        (vec!["--store", "sqlite:/proc/forbidden/idem.db"], "cannot"),
        (vec!["--listen", busy.as_str(), "--store", "sqlite:/tmp/idem-never-created/x.db"], "cannot listen"),
    ] {
        let mut all = vec!["serve"];
        if !args.contains(&"--listen") {
            all.extend(["--listen", "127.0.0.1:0"]);
        }
        all.extend(&args);
        let (code, _, err) = idem(&all, &[]);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("hunter2"), "password leaked: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: not one line: {err}");
        assert!(!std::path::Path::new("/tmp/idem-never-created").exists(), "a refused start created its database");
    }
}

/// A store that cannot be reached when `idem serve` starts is an outage, not a mistake: the server listens and
/// answers 503 with `Retry-After` until it opens (it exited 2 before, and a server started during a failover
/// stayed down), and its log names the store with the password hidden.
#[tokio::test]
async fn an_unreachable_store_is_served_as_503() {
    for store in ["redis://:hunter2@127.0.0.1:1", "postgres://alice:hunter2@127.0.0.1:1/db"] {
        let s = Server::start(&["--listen", "127.0.0.1:0", "--store", store], &[]);
        let r = client().put(format!("{}/v1/kv/k", s.url)).body("v").send().await.unwrap();
        assert_eq!(r.status(), 503, "{store}");
        assert!(r.headers().contains_key("retry-after"), "{store}: {:?}", r.headers());
        let log = s.wait_for_log("answering 503 until it opens", 1, Duration::from_secs(10));
        assert!(log.contains(":***@127.0.0.1:1") && !log.contains("hunter2"), "{log}");
        // A stop asked for drains as usual with the store never opened.
        std::process::Command::new("kill").args(["-TERM", &s.pid().to_string()]).status().unwrap();
        assert_eq!(s.terminate_wait().code(), Some(0), "{store}");
    }
}

#[tokio::test]
async fn flags_beat_environment_beat_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("idem.toml");
    std::fs::write(&cfg, "store = \"memory:\"\nmax_value_bytes = 10\n").unwrap();
    let put = |url: String, n: usize| async move {
        client().put(format!("{url}/v1/kv/k")).body("x".repeat(n)).send().await.unwrap().status().as_u16()
    };
    let cfg_s = cfg.to_str().unwrap();
    let s = Server::start(&["--config", cfg_s], &[]);
    assert_eq!((put(s.url.clone(), 10).await, put(s.url.clone(), 11).await), (201, 413));
    let s = Server::start(&["--config", cfg_s], &[("IDEM_MAX_VALUE_BYTES", "20")]);
    assert_eq!((put(s.url.clone(), 20).await, put(s.url.clone(), 21).await), (201, 413));
    let s = Server::start(&["--config", cfg_s, "--max-value-bytes", "30"], &[("IDEM_MAX_VALUE_BYTES", "20")]);
    assert_eq!((put(s.url.clone(), 30).await, put(s.url.clone(), 31).await), (201, 413));
    std::fs::write(&cfg, "stor = \"memory:\"\n").unwrap();
    let (code, _, err) = idem(&["serve", "--config", cfg_s], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown field"), "{err}");
}

#[tokio::test]
async fn sigterm_finishes_in_flight_requests_then_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let server = Server::sqlite(&db);
    let url = server.url.clone();
    // A request whose body arrives slowly is in flight when SIGTERM lands; it must still be answered and stored.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
    let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
    let slow = tokio::spawn(client().put(format!("{url}/v1/kv/slow")).body(body).send());
    tx.send(Ok(b"first half ".to_vec())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = server.pid();
    let term = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(term.success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New connections are refused while the old request is still running.
    assert!(client().get(format!("{url}/healthz")).send().await.is_err(), "still accepting after SIGTERM");
    tx.send(Ok(b"second half".to_vec())).await.unwrap();
    drop(tx);
    let resp = slow.await.unwrap().unwrap();
    assert_eq!(resp.status(), 201);
    let status = server.terminate_wait();
    assert!(status.success(), "exit status {status:?}");
    let server = Server::sqlite(&db);
    let got = client().get(format!("{}/v1/kv/slow", server.url)).send().await.unwrap().text().await.unwrap();
    assert_eq!(got, "first half second half");
}

/// `idem --help` says what every command is for in its description, not only the KV store's, and lists each;
/// `idem check --help` lists its probes once (not again as the possible values of --only).
#[test]
fn help_describes_every_command_and_check_lists_its_probes_once() {
    let (code, out, err) = idem(&["--help"], &[]);
    assert_eq!(code, 0, "{err}");
    let (about, rest) = out.split_once("Usage:").unwrap();
    let words: Vec<&str> = about.split(|c: char| !(c.is_alphanumeric() || c == '-')).collect();
    let commands = rest.split_once("Commands:").unwrap().1;
    for command in ["serve", "send", "key", "run", "runs", "once", "check", "kv", "bench"] {
        assert!(words.contains(&command), "the description leaves out {command}:\n{about}");
        assert!(commands.lines().any(|l| l.trim_start().starts_with(&format!("{command} "))), "{command}:\n{out}");
    }
    let (code, out, err) = idem(&["check", "--help"], &[]);
    assert_eq!(code, 0, "{err}");
    let probes = ["missing-key", "replay", "concurrent", "mismatch", "other-target", "malformed", "scope", "in-flight"];
    for probe in probes.into_iter().chain(["errors", "expiry"]) {
        let listed = out.lines().filter(|l| l.trim_start().starts_with(probe)).count();
        assert_eq!(listed, 1, "{probe} listed {listed} times:\n{out}");
        assert_eq!(out.matches(&format!("{probe}:")).count(), 0, "{probe} in a list of possible values:\n{out}");
    }
}

/// `idem send --help` lists its own options (`--read-back` among them) under Options, and only the TLS flags
/// under Connection.
#[test]
fn send_help_lists_read_back_among_its_options_not_under_connection() {
    let (code, out, err) = idem(&["send", "--help"], &[]);
    assert_eq!(code, 0, "{err}");
    let (own, connection) = out.split_once("Options:").unwrap().1.split_once("\nConnection:\n").unwrap();
    for flag in ["--read-back", "--attempts", "--print-key", "--key-prefix"] {
        assert!(own.contains(flag), "{flag} is not among the options:\n{out}");
    }
    let flags: Vec<&str> =
        connection.lines().filter_map(|l| l.trim_start().strip_prefix("--").and(l.split_whitespace().next())).collect();
    assert_eq!(flags, ["--cacert", "--cert", "--cert-key"], "{out}");
}

/// `idem kv`'s KEY and VALUE say what they take.
#[test]
fn kv_arguments_have_help() {
    for command in ["get", "put", "delete", "counter", "set", "update"] {
        let (code, out, err) = idem(&["kv", command, "-h"], &[]);
        assert_eq!(code, 0, "{err}");
        let arguments = out.split_once("Arguments:").unwrap_or_else(|| panic!("kv {command}:\n{out}")).1;
        let arguments = arguments.split_once("Options:").unwrap().0;
        for line in arguments.lines().filter(|l| l.trim_start().starts_with('<') || l.trim_start().starts_with('[')) {
            let (name, help) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
            assert!(!help.trim().is_empty(), "kv {command}: {name} has no help:\n{out}");
        }
        // The command's own options first, the connection flags shared by every command apart after them.
        let (own, shared) = out.split_once("Options:").unwrap().1.split_once("\nConnection:\n").unwrap();
        assert!(!own.contains("--url") && !own.contains("--cacert"), "kv {command}:\n{out}");
        assert!(shared.contains("--url") && shared.contains("--token-file") && shared.contains("--cert-key"));
    }
}

/// Each server says where it listens once: the line on standard output (which scripts read), not again in
/// its log.
#[test]
fn each_server_prints_its_listening_line_once() {
    let dir = tempfile::tempdir().unwrap();
    let kv = Server::sqlite(&dir.path().join("kv.db"));
    let proxy = common::proxy(&dir, "http://127.0.0.1:9", &[]);
    for server in [kv, proxy] {
        let pid = server.pid().to_string();
        assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let log = server.wait_for_log("bye", 1, Duration::from_secs(10));
        assert!(server.terminate_wait().success());
        assert!(!log.contains("listening"), "the log repeats the listening line:\n{log}");
    }
}

/// A second SIGTERM during the grace closes what is still in flight at once (nginx's and most servers' "now"),
/// instead of waiting out the 30 s grace for a client that stalls mid-body.
#[tokio::test]
async fn a_second_sigterm_ends_the_grace_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let server = Server::sqlite(&db);
    let url = server.url.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
    let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
    let stalled = tokio::spawn(client().put(format!("{url}/v1/kv/stalled")).body(body).send());
    tx.send(Ok(b"half of it ".to_vec())).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = server.pid().to_string();
    let kill = |signal: &str| std::process::Command::new("kill").args([signal, &pid]).status().unwrap();
    assert!(kill("-TERM").success());
    server.wait_for_log("shutting down", 1, Duration::from_secs(5));
    let second = std::time::Instant::now();
    assert!(kill("-TERM").success());
    // The log says that requests were cut; a stop asked for still exits 0 (as service managers expect).
    let log =
        server.wait_for_log("requests still in flight were closed at the second signal", 1, Duration::from_secs(5));
    // Why comes before what it did (the warning was logged after the requests were closed, now and then).
    let why = log.find("second signal: closing the requests still in flight now");
    let what = log.find("requests still in flight were closed at the second signal");
    assert!(why.is_some() && why < what, "the log says what the second signal did before it came:\n{log}");
    let status = server.terminate_wait();
    assert!(second.elapsed() < Duration::from_secs(5), "waited {:?} after the second signal", second.elapsed());
    assert!(status.success(), "exit status {status:?}");
    assert!(stalled.await.unwrap().is_err(), "the stalled request was closed, not answered");
    drop(tx);
    // The store was closed cleanly: it opens, and the unfinished write is not in it.
    let server = Server::sqlite(&db);
    let got = client().get(format!("{}/v1/kv/stalled", server.url)).send().await.unwrap();
    assert_eq!(got.status(), 404);
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_core::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn kv_client_commands_and_exit_codes() {
    let server = Server::start(&["--store", "memory:"], &[]);
    let env = [("IDEM_URL", server.url.as_str())];
    let run = |args: &[&str]| idem(&[&["kv"], args].concat(), &env);
    assert_eq!(run(&["put", "a/b", "hello"]), (0, "1\n".into(), String::new()));
    // --url may follow the subcommand; keys that look like path navigation get a clear usage error.
    assert_eq!(idem(&["kv", "put", ".x", "dots", "--url", &server.url], &[]).0, 0);
    assert_eq!(idem(&["kv", "get", ".x", "--url", &server.url], &[]).1, "dots");
    for key in [".", ".."] {
        let (code, _, err) = idem(&["kv", "put", key, "v", "--url", &server.url], &[]);
        assert_eq!(code, 2, "put {key}: {err}");
        assert!(err.contains("dot-segments"), "{err}");
    }
    assert_eq!(idem(&["kv", "delete", ".x", "--url", &server.url], &[]).0, 0);
    let (code, out, err) = run(&["get", "a/b"]);
    assert_eq!((code, out.as_str()), (0, "hello"));
    assert!(err.contains("generation: 1"));
    let (code, _, err) = run(&["put", "a/b", "x", "--if-absent"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("precondition failed"), "{err}");
    assert_eq!(run(&["put", "a/b", "x", "--if-match", "99"]).0, 4);
    assert_eq!(run(&["put", "a/b", "world", "--if-match", "1", "--ttl", "1h"]).0, 0);
    assert_eq!(run(&["get", "missing"]).0, 3);
    assert_eq!(run(&["update", "set", "--set-add", "x", "--set-add", "y"]).0, 0);
    assert_eq!(run(&["update", "set", "--set-add", "y", "--set-add", "z"]).0, 0);
    assert_eq!(run(&["get", "set"]).1, r#"["x","y","z"]"#);
    let (code, out, _) = run(&["list", "--page-size", "1"]);
    assert_eq!(code, 0);
    let keys: Vec<&str> = out.lines().map(|l| l.split('\t').next().unwrap()).collect();
    assert_eq!(keys, vec!["a/b", "set"]);
    assert_eq!(run(&["delete", "a/b", "--if-match", "1"]).0, 4);
    assert_eq!(run(&["delete", "a/b"]).0, 0);
    assert_eq!(run(&["get", "a/b"]).0, 3);
    let (code, _, err) = idem(&["kv", "--url", "http://127.0.0.1:1", "get", "k"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("request failed") && err.contains("is `idem serve` running"), "{err}");
    let _ = BIN;
}

/// `idem kv counter` and `idem kv set` use the server's atomic operations: a counter add (negative too) with a
/// dedupe id applied once, set members added and removed in one step.
#[tokio::test]
async fn kv_counter_and_set_commands() {
    let server = Server::start(&["--store", "memory:"], &[]);
    let env = [("IDEM_URL", server.url.as_str())];
    let run = |args: &[&str]| idem(&[&["kv"], args].concat(), &env);
    let (code, out, err) = run(&["counter", "balance", "5", "--dedupe-id", "pay-1"]);
    assert_eq!((code, out.as_str()), (0, "5\n"), "{err}");
    assert!(err.starts_with("generation: ") && !err.contains("not applied"), "{err}");
    let (code, out, err) = run(&["counter", "balance", "5", "--dedupe-id", "pay-1"]);
    assert_eq!((code, out.as_str()), (0, "5\n"), "a repeat under the same id adds nothing: {err}");
    assert!(err.contains("not applied: dedupe id seen before"), "{err}");
    assert_eq!(run(&["counter", "balance", "-7"]).1, "-2\n");
    let (code, _, err) = run(&["counter", "balance", "9", "--dedupe-id", "pay-1"]);
    assert_eq!(code, 1, "another delta under a used id is refused: {err}");
    assert!(err.contains("422") && err.contains("pay-1"), "{err}");
    assert_eq!(run(&["get", "balance"]).1, "-2");

    let (code, out, err) = run(&["set", "tags", "--add", "b", "--add", "a", "--add", "c"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.trim().parse::<u64>().unwrap() > 0, "{out}");
    assert_eq!(err, "3 added, 0 removed, 3 members\n");
    let (code, _, err) = run(&["set", "tags", "--remove", "a", "--remove", "b", "--remove", "x"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err, "0 added, 2 removed, 1 member\n");
    assert_eq!(run(&["get", "tags"]).1, r#"["c"]"#);
    let (code, out, err) = run(&["set", "tags", "--remove", "c"]);
    assert_eq!((code, out.as_str(), err.as_str()), (0, "0\n", "0 added, 1 removed, 0 members\n"));
    assert_eq!(run(&["get", "tags"]).0, 3, "a set left empty is deleted");
    let (code, _, err) = run(&["set", "balance", "--add", "x"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("409"), "{err}");
    let (code, _, err) = run(&["set", "tags"]);
    assert_eq!(code, 2, "a set change needs --add or --remove: {err}");
    assert!(err.contains("--add <MEMBER>|--remove <MEMBER>"), "the error names both ways: {err}");
    // What the server would refuse is bad usage, said before anything is sent (exit 2, one line).
    for (args, said) in [
        (&["counter", "balance", "1", "--dedupe-id", ""][..], "invalid dedupe id"),
        (&["set", "tags", "--add", ""][..], "invalid set member"),
        (&["set", "tags", "--add", "a", "--dedupe-id", &"i".repeat(256)][..], "invalid dedupe id"),
        (&["update", "tags", "--set-add", ""][..], "invalid set member"),
        (&["update", "tags", "--set-add", "a", "--set-add", &"m".repeat(256)][..], "invalid set member"),
        (&["get", ""][..], "key"),
        (&["put", &"k".repeat(1025), "v"][..], "key"),
    ] {
        let (code, _, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(said) && err.trim_end().lines().count() == 1, "{args:?}: {err}");
    }
    assert_eq!(run(&["get", "balance"]).1, "-2", "a refused command changed the counter");
    // A TAB is a key's own byte (only NUL is refused, as `kv get --help` says).
    assert_eq!(run(&["put", "a\tb", "tab"]).0, 0);
    assert_eq!(run(&["get", "a\tb"]).1, "tab");
}

#[tokio::test]
async fn server_urls_without_a_scheme_mean_http_as_in_curl_and_bad_ones_name_the_flag() {
    let server = Server::start(&["--store", "memory:"], &[]);
    let hostport = server.url.strip_prefix("http://").unwrap().to_owned();
    assert_eq!(idem(&["kv", "put", "a", "v", "--url", &hostport], &[]), (0, "1\n".into(), String::new()));
    // Parsed as it is, `localhost:PORT` is a URL whose scheme is "localhost": it too means http://.
    let localhost = hostport.replace("127.0.0.1", "localhost");
    assert_eq!(idem(&["kv", "get", "a"], &[("IDEM_URL", localhost.as_str())]).1, "v");
    let (code, _, err) = idem(&["send", "PUT", &format!("{hostport}/v1/kv/sent"), "--data", "hi", "--key", "k1"], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(idem(&["kv", "get", "sent", "--url", &hostport], &[]).1, "hi");
    // The proxy's --upstream, the same way.
    let dir = tempfile::tempdir().unwrap();
    let proxy = common::proxy(&dir, &hostport, &[]);
    let got = client().get(format!("{}/v1/kv/a", proxy.url)).send().await.unwrap();
    assert_eq!(got.text().await.unwrap(), "v");
    for (args, needle) in [
        (vec!["kv", "get", "a", "--url", "ftp://127.0.0.1:1"], r#"--url "ftp://127.0.0.1:1" has the scheme ftp, not"#),
        (vec!["kv", "get", "a", "--url", "127.0.0.1:99999"], r#"--url "127.0.0.1:99999" is not a URL: invalid port"#),
        (vec!["kv", "get", "a", "--url", "http://"], r#"--url "http://" is not a URL: empty host"#),
        (vec!["send", "POST", "http://u:hunter2@[::1", "--json", "{}", "--key", "k"], r#"URL "http://u:***@[::1" is"#),
    ] {
        let (code, _, err) = idem(&args, &[]);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle) && err.contains("; give http://HOST:PORT (or HOST:PORT)"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: not one line: {err}");
        assert!(!err.contains("hunter2"), "password leaked: {err}");
    }
}

#[test]
fn a_401_says_how_to_present_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0k3n\n").unwrap();
    let token = token.to_str().unwrap();
    let s = Server::start(&["--store", "memory:", "--auth-token-file", token], &[]);
    let (code, _, err) = idem(&["kv", "get", "k", "--url", &s.url], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("401 Unauthorized: this server requires Authorization: Bearer <token>"), "{err}");
    assert!(err.contains("`idem kv` sends it with --token-file FILE or IDEM_AUTH_TOKEN_FILE"), "{err}");
    // Doing what it says works: the key is simply not there (exit 3).
    assert_eq!(idem(&["kv", "get", "k", "--url", &s.url, "--token-file", token], &[]).0, 3);
    assert_eq!(idem(&["kv", "get", "k", "--url", &s.url], &[("IDEM_AUTH_TOKEN_FILE", token)]).0, 3);
}

#[test]
fn idem_key_is_deterministic_and_refuses_what_would_make_a_bad_key() {
    let (code, a, _) = idem(&["key", "--prefix", "orders", "--id", "123", "--json", r#"{"b": [1, 2], "a": 1}"#], &[]);
    assert_eq!(code, 0);
    let (_, b, _) = idem(&["key", "--prefix", "orders", "--id", "123", "--json", r#"{"a":1,"b":[1,2]}"#], &[]);
    assert_eq!(a, b, "key order and whitespace do not change the key");
    assert!(a.starts_with("orders:123:") && a.trim_end().len() == "orders:123:".len() + 16, "{a}");
    let (_, c, _) = idem(&["key", "--prefix", "orders", "--id", "123", "--json", r#"{"a":1,"b":[2,1]}"#], &[]);
    assert_ne!(a, c, "array order is content");
    let (_, quoted, _) = idem(&["key", "--prefix", "o", "--id", "a b", "--no-payload", "--header"], &[]);
    assert!(quoted.starts_with("\"o:a b:"), "{quoted}");
    for bad in [
        vec!["key", "--prefix", "orders", "--id", "1"],
        vec!["key", "--prefix", "a:b", "--id", "1", "--no-payload"],
        vec!["key", "--prefix", "o", "--id", "1", "--json", "{x"],
        vec!["key", "--prefix", "o", "--id", "caf\u{e9}", "--no-payload"],
    ] {
        let (code, _, err) = idem(&bad, &[]);
        assert_eq!(code, 2, "{bad:?}: {err}");
        assert!(err.contains("--"), "the error names the flag: {err}");
    }
}

#[test]
fn proxy_flags_without_an_upstream_are_refused() {
    let (code, _, err) = idem(&["serve", "--listen", "127.0.0.1:0", "--store", "memory:", "--require-key"], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("--require-key applies to the proxy only"), "{err}");
    let (code, _, err) =
        // Its own admin port: the default 8081 may be taken by another test or program on the machine.
        idem(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--store",
                "memory:",
                "--upstream",
                "ftp://example.com",
            ],
            &[],
        );
    assert_eq!(code, 2);
    assert!(err.contains("the scheme must be http or https"), "{err}");
    // The replay cache needs a store no other proxy writes: refused with a shared one, before connecting.
    let (code, _, err) = idem(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "redis://:hunter2@127.0.0.1:1",
            "--upstream",
            "http://127.0.0.1:1",
            "--replay-cache",
            "1048576",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--replay-cache needs the embedded store") && !err.contains("hunter2"), "{err}");
}

/// The planted-bug switch of the verification harness is compiled in only with the test-only feature
/// `planted-bugs`: this build of `idem` (the workspace's own, as users build it) must ignore the variable, so
/// the compare-and-swap it names still refuses a write with the wrong generation.
#[tokio::test]
async fn the_planted_bug_variable_switches_nothing_off_in_a_normal_build() {
    let s =
        Server::start(&["--listen", "127.0.0.1:0", "--store", "memory:"], &[("IDEM_PLANTED_BUG", "kv-precondition")]);
    let c = client();
    let url = format!("{}/v1/kv/k", s.url);
    assert_eq!(c.put(&url).body("a").send().await.unwrap().status(), 201);
    let stale = c.put(&url).header("If-Match", "\"99\"").body("b").send().await.unwrap();
    assert_eq!(stale.status(), 412, "a planted bug was switched on by the environment in a normal build");
    assert_eq!(c.get(&url).send().await.unwrap().text().await.unwrap(), "a");
}

/// SIGTERM the moment the listening line is out (as a service manager may send it) drains and flushes the
/// store ("bye", exit 0), every time: the handlers are installed before that line. They were installed after
/// it, and 2 to 3 of 30 such stops died of the signal (exit 143, no drain, no flush).
#[test]
fn a_sigterm_right_after_the_listening_line_drains_and_flushes() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..15 {
        let server = Server::sqlite(&dir.path().join(format!("kv{i}.db")));
        let pid = server.pid().to_string();
        assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        server.wait_for_log("bye", 1, Duration::from_secs(5));
        assert!(server.terminate_wait().success(), "stop {i}");
    }
}

/// `idem explain` and `idem admin` on a `sqlite:` file that does not exist (a typo) say so, exit 3, and create
/// nothing: before, they made the file (and five beside it) and answered "no record" from it (found by a
/// new user's review, 2026-12-06).
#[test]
fn explain_and_admin_on_a_missing_sqlite_file_say_so_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("typo.db").display());
    for args in [
        vec!["explain", "key", "order-1", "--store", &store],
        vec!["admin", "resolve", "idempotency/anonymous/order-1", "--store", &store],
        vec!["admin", "release", "idempotency/anonymous/order-1", "--store", &store],
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {stderr}");
        assert!(stderr.contains("no store at ") && stderr.contains("typo.db"), "{args:?}: {stderr}");
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "files created: {left:?}");
}
