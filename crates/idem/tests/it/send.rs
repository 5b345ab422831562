//! The client half: `idem-client` and `idem send` against a real `idem serve --upstream`, a counting upstream,
//! and a link that loses every second connection's answer after the request was processed.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::common::{Server, idem, start_upstream};
use idem_client::{Client, Error, Generation, Precondition, RetryPolicy, SetChange, WriteRequest, derive_key};
use reqwest::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn proxy(dir: &tempfile::TempDir, upstream: &str) -> Server {
    common::proxy(dir, upstream, &[])
}

/// A TCP relay to `target` that, on every second connection, forwards the request, waits for the first
/// bytes of the answer (so the write was processed), then closes the client's side without passing them on.
async fn lossy_link(target: String) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let dropped = Arc::new(AtomicU64::new(0));
    let dropped_count = Arc::clone(&dropped);
    tokio::spawn(async move {
        let mut n = 0u64;
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            n += 1;
            let lose = n.is_multiple_of(2);
            let target = target.clone();
            let dropped = Arc::clone(&dropped_count);
            tokio::spawn(async move {
                let mut server = tokio::net::TcpStream::connect(target.trim_start_matches("http://")).await.unwrap();
                if !lose {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                let (mut client_read, _client_write) = client.split();
                let (mut server_read, mut server_write) = server.split();
                let mut buf = [0u8; 16 * 1024];
                tokio::select! {
                    _ = async {
                        loop {
                            let n = client_read.read(&mut buf).await.unwrap_or(0);
                            if n == 0 || server_write.write_all(&buf[..n]).await.is_err() { break; }
                        }
                    } => {}
                    answered = async {
                        let mut first = [0u8; 1];
                        server_read.read(&mut first).await
                    } => {
                        if matches!(answered, Ok(1)) {
                            dropped.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                // Both sockets close here: the client never sees the answer.
            });
        }
    });
    (url, dropped)
}

fn fast_retries(attempts: u32) -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(attempts)
        .with_base_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(200))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_writes_over_a_lossy_link_execute_exactly_two_hundred_times() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up);
    let (link, dropped) = lossy_link(server.url.clone()).await;
    // No connection reuse: every attempt is a new connection, so every second one loses its answer.
    let http = idem_client::client_builder().pool_max_idle_per_host(0).build().unwrap();
    let client = Client::with_http(http).retry_policy(fast_retries(8));
    let mut tasks = Vec::new();
    let mut replays = 0;
    for i in 0..200 {
        let client = client.clone();
        let url = format!("{link}/orders");
        tasks.push(tokio::spawn(async move {
            let payload = serde_json::json!({ "order": i, "qty": 1 });
            let key = derive_key("orders", &i.to_string(), &serde_json::to_vec(&payload).unwrap()).unwrap();
            let request = WriteRequest::json(Method::POST, &url, key, &payload).unwrap();
            client.send(&request).await.unwrap()
        }));
        if i % 8 == 7 {
            // Eight writes in flight at a time.
            for task in tasks.drain(..) {
                let response = task.await.unwrap();
                assert_eq!(response.status(), 201);
                replays_and_attempts(&response);
                replays += u64::from(response.replayed());
            }
        }
    }
    assert_eq!(counts.executions(), 200, "every write executed exactly once");
    let lost = dropped.load(Ordering::SeqCst);
    assert!(lost >= 50, "the link dropped only {lost} answers");
    assert!(replays >= 50 && replays <= lost, "{replays} replays for {lost} lost answers");
    eprintln!("{lost} answers lost on the link, {replays} replays, 200 writes, 200 executions");
}

fn replays_and_attempts(response: &idem_client::Response) {
    // The link loses answers only after the write was processed, so a write that needed more than one
    // attempt executed on its first and must come back as a replay; one that did not must not.
    assert_eq!(response.replayed(), response.attempts() >= 2, "attempts {}", response.attempts());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_reused_with_another_payload_stops_at_once_with_422() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up);
    let client = Client::new().retry_policy(fast_retries(8));
    let key = idem_client::IdempotencyKey::new("fixed-key").unwrap();
    let url = format!("{}/orders", server.url);
    let first = WriteRequest::json(Method::POST, &url, key.clone(), &serde_json::json!({"a": 1})).unwrap();
    assert_eq!(client.send(&first).await.unwrap().status(), 201);
    let other = WriteRequest::json(Method::POST, &url, key, &serde_json::json!({"a": 2})).unwrap();
    let err = client.send(&other).await.unwrap_err();
    assert!(matches!(err, Error::KeyReused { .. }), "{err}");
    let metrics = common::client().get(format!("{}/metrics", server.admin)).send().await.unwrap().text().await.unwrap();
    let mismatches = metrics
        .lines()
        .find(|l| l.starts_with("idem_idempotency_mismatches_total"))
        .and_then(|l| l.split_whitespace().last())
        .unwrap();
    assert_eq!(mismatches, "1", "the 422 was not retried");
    assert_eq!(counts.executions(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn attempts_run_out_with_a_typed_error_naming_the_count() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let client = Client::new().retry_policy(fast_retries(3));
    let key = idem_client::IdempotencyKey::new("k").unwrap();
    let request = WriteRequest::json(Method::POST, &format!("http://127.0.0.1:{port}/x"), key, &1).unwrap();
    match client.send(&request).await {
        Err(Error::AttemptsExhausted { attempts, last }) => {
            assert_eq!(attempts, 3);
            assert!(last.contains("connect") || last.contains("refused"), "{last}");
        }
        other => panic!("expected AttemptsExhausted, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_while_in_flight_waits_out_409_and_gets_the_replay() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up);
    let client = Client::new().retry_policy(fast_retries(20));
    let key = idem_client::IdempotencyKey::new("slow-key").unwrap();
    let request = WriteRequest::json(Method::POST, &format!("{}/slow/1500", server.url), key, &1).unwrap();
    let first = {
        let (client, request) = (client.clone(), request.clone());
        tokio::spawn(async move { client.send(&request).await.unwrap() })
    };
    while counts.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = client.send(&request).await.unwrap();
    assert_eq!(second.status(), 201);
    assert!(second.replayed() && second.attempts() >= 2, "it retried the 409s, then got the replay");
    assert!(!first.await.unwrap().replayed());
    assert_eq!(counts.executions(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_409_without_retry_after_is_a_stop_signal() {
    let (up, _counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("idem.db").display());
    let server = Server::start(
        &["--upstream", &up, "--admin-listen", "127.0.0.1:0", "--store", &store, "--max-stored-body", "100"],
        &[],
    );
    let client = Client::new().retry_policy(fast_retries(8));
    let key = idem_client::IdempotencyKey::new("big").unwrap();
    let request = WriteRequest::json(Method::POST, &format!("{}/big/1000", server.url), key, &1).unwrap();
    assert_eq!(client.send(&request).await.unwrap().body().len(), 1000);
    let err = client.send(&request).await.unwrap_err();
    assert!(matches!(err, Error::Conflict { ref detail } if detail.contains("100-byte")), "{err}");
}

#[test]
fn idem_send_derives_the_same_key_in_every_process_and_exits_by_outcome() {
    let key = |json: &str| {
        let (code, out, err) = idem(
            &[
                "send",
                "POST",
                "http://127.0.0.1:1/x",
                "--json",
                json,
                "--key-prefix",
                "inv",
                "--id",
                "42",
                "--print-key",
            ],
            &[],
        );
        assert_eq!(code, 0, "{err}");
        out.trim().to_owned()
    };
    assert_eq!(key(r#"{"a":1,"b":2}"#), key(r#"{ "b": 2, "a": 1 }"#));
    assert_ne!(key(r#"{"a":1,"b":2}"#), key(r#"{"a":1,"b":3}"#));
    assert!(key("{}").starts_with("inv:42:"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (code, _, err) = idem(
        &["send", "POST", &format!("http://127.0.0.1:{port}/x"), "--json", "{}", "--key", "k", "--attempts", "2"],
        &[],
    );
    assert_eq!(code, 6, "{err}");
    assert!(err.starts_with("idem: gave up after 2 attempts"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idem_send_prints_the_body_and_exits_5_on_422() {
    let (up, counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up);
    let url = format!("{}/orders", server.url);
    let send = |json: &'static str| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || idem(&["send", "POST", &url, "--json", json, "--key", "cli-key"], &[]))
    };
    let (code, out, err) = send(r#"{"n":1}"#).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"order\":1"), "{out}");
    let (code, again, err) = send(r#"{ "n": 1 }"#).await.unwrap();
    assert_eq!((code, again.as_str()), (0, out.as_str()));
    assert!(err.contains("replayed"), "{err}");
    let (code, _, err) = send(r#"{"n":2}"#).await.unwrap();
    assert_eq!(code, 5, "{err}");
    assert!(err.starts_with("idem: idempotency key reused with another payload (422)"), "{err}");
    assert_eq!(counts.executions(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn read_back_fails_when_a_replayed_201_points_at_a_deleted_object() {
    let (up, _counts) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let server = proxy(&dir, &up);
    let client = Client::new().retry_policy(fast_retries(3)).read_back(true);
    let key = idem_client::IdempotencyKey::new("rb").unwrap();
    let request = WriteRequest::json(Method::POST, &format!("{}/orders", server.url), key, &1).unwrap();
    assert!(!client.send(&request).await.unwrap().replayed());
    assert!(client.send(&request).await.unwrap().replayed(), "replayed, and /orders/1 still exists");
    let deleted = common::client().delete(format!("{}/orders/1", server.url)).send().await.unwrap();
    assert_eq!(deleted.status(), 204);
    match client.send(&request).await {
        Err(Error::ReadBackGone { location, status }) => {
            assert!(location.ends_with("/orders/1"), "{location}");
            assert_eq!(status, 404);
        }
        other => panic!("expected ReadBackGone, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kv_helpers_update_without_losing_writes_and_dedupe_counters_and_set_changes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::sqlite(&dir.path().join("kv.db"));
    let kv = idem_client::KvClient::new(idem_client::client_builder().build().unwrap(), server.url.clone());
    let policy = RetryPolicy::new().with_max_attempts(64).with_base_delay(Duration::from_millis(1));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (kv, policy) = (kv.clone(), policy.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                kv.update("count", &policy, |current| {
                    let n: u64 = current.map_or(Ok(0), serde_json::from_slice)?;
                    Ok(Some(serde_json::to_vec(&(n + 1))?.into()))
                })
                .await
                .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (value, _) = kv.get("count").await.unwrap().unwrap();
    assert_eq!(value, "320", "16 writers x 20 updates, none lost");
    let first = kv.counter_add("hits", 5, Some("req-1")).await.unwrap();
    let again = kv.counter_add("hits", 5, Some("req-1")).await.unwrap();
    assert_eq!((first.value, first.applied, again.value, again.applied), (5, true, 5, false));
    let set = kv.set_change("tags", &SetChange { add: vec!["a".into(), "b".into()], ..SetChange::default() }).await;
    let set = set.unwrap();
    assert_eq!((set.members, set.added, set.applied), (2, 2, true));
    // A set change under a dedupe id, sent again as after a lost answer: applied once, the first outcome twice.
    let remove_a = SetChange { remove: vec!["a".into()], dedupe_id: Some("untag-1".into()), ..SetChange::default() };
    let first = kv.set_change("tags", &remove_a).await.unwrap();
    let again = kv.set_change("tags", &remove_a).await.unwrap();
    assert_eq!((first.members, first.removed, first.applied), (1, 1, true));
    assert_eq!((again.members, again.removed, again.applied, again.generation), (1, 1, false, first.generation));
    let (value, generation) = kv.get("tags").await.unwrap().unwrap();
    assert_eq!((value.as_ref(), Some(generation)), (&b"[\"b\"]"[..], first.generation), "removed once, nothing else");
    // The same id for another change is refused, not applied.
    let other = SetChange { add: vec!["c".into()], dedupe_id: Some("untag-1".into()), ..SetChange::default() };
    let err = kv.set_change("tags", &other).await.unwrap_err();
    assert!(matches!(&err, Error::DedupeIdReused { key, .. } if key == "tags"), "{err}");
    assert_eq!(kv.get("tags").await.unwrap().unwrap().0, "[\"b\"]");
    let err = kv.counter_add("hits", 6, Some("req-1")).await.unwrap_err();
    assert!(matches!(&err, Error::DedupeIdReused { key, .. } if key == "hits"), "{err}");
    // A malformed id is another refusal (not a reuse), and so is a counter change on a set.
    let err = kv.counter_add("hits", 1, Some("")).await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 422, .. }), "{err}");
    let err = kv.counter_add("tags", 1, None).await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 409, .. }), "{err}");
    assert_eq!(kv.counter_add("hits", 0, None).await.unwrap().value, 5);
    let err = kv.put("count", "x", Precondition::Generation(Generation::new(1))).await.unwrap_err();
    assert!(matches!(err, Error::PreconditionFailed { current: Some(_), .. }), "{err}");
}

/// A server with odd answers: a 302 to a GET-able page, and a 409 whose Retry-After is an HTTP-date.
async fn odd_server() -> String {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    let busy = Arc::new(AtomicU64::new(0));
    let app = axum::Router::new()
        .route("/redirect", post(|| async { (StatusCode::FOUND, [(header::LOCATION, "/final")]) }))
        .route("/final", get(|| async { (StatusCode::CREATED, "not the write\n") }))
        .route(
            "/busy",
            post(move || {
                let busy = Arc::clone(&busy);
                async move {
                    if busy.fetch_add(1, Ordering::SeqCst) == 0 {
                        let soon = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(2));
                        (StatusCode::CONFLICT, [(header::RETRY_AFTER, soon)], "in flight\n").into_response()
                    } else {
                        (StatusCode::CREATED, "done\n").into_response()
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test(flavor = "multi_thread")]
async fn a_302_is_not_a_success_and_an_http_date_retry_after_is_waited_for() {
    let url = odd_server().await;
    let client = Client::new().retry_policy(fast_retries(4));
    let key = idem_client::IdempotencyKey::new("r").unwrap();
    let redirect = WriteRequest::json(Method::POST, &format!("{url}/redirect"), key.clone(), &1).unwrap();
    match client.send(&redirect).await {
        Err(Error::Status { status: 302, .. }) => {}
        other => panic!("a 302 must not turn the write into a GET of another page: {other:?}"),
    }
    let busy = WriteRequest::json(Method::POST, &format!("{url}/busy"), key, &1).unwrap();
    let started = std::time::Instant::now();
    let answer = client.send(&busy).await.unwrap();
    assert_eq!((answer.status().as_u16(), answer.attempts()), (201, 2));
    assert!(started.elapsed() >= Duration::from_millis(500), "the Retry-After date was waited for");
    let url2 = url.clone();
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        idem(&["send", "POST", &format!("{url2}/redirect"), "--json", "{}", "--key", "k"], &[])
    })
    .await
    .unwrap();
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        idem(&["send", "POST", &format!("{url}/busy"), "--json", "{}", "--key", "k", "-H", "Idempotency-Key: x"], &[])
    })
    .await
    .unwrap();
    assert_eq!(code, 2, "a second key header is a usage error: {err}");
}

/// `idem send DELETE URL --key K` needs no --json or --data: the request goes out without a body and without a
/// Content-Type (nothing to describe), with its key, and a 204 is a success.
#[tokio::test(flavor = "multi_thread")]
async fn idem_send_sends_a_delete_without_a_body() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders/7", listener.local_addr().unwrap());
    let seen = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request ended before its head did");
            head.extend_from_slice(&buf[..n]);
        }
        conn.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n").await.unwrap();
        String::from_utf8(head).unwrap().to_ascii_lowercase()
    });
    let (code, out, err) =
        tokio::task::spawn_blocking(move || idem(&["send", "DELETE", &url, "--key", "delete-7"], &[])).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "");
    assert!(err.contains("204"), "{err}");
    let head = seen.await.unwrap();
    assert!(head.starts_with("delete /orders/7 http/1.1\r\n"), "{head}");
    assert!(head.contains("idempotency-key: \"delete-7\"\r\n"), "{head}");
    assert!(!head.contains("content-type"), "{head}");
    assert!(!head.contains("content-length") || head.contains("content-length: 0\r\n"), "{head}");
    assert!(head.ends_with("\r\n\r\n"), "nothing after the head: {head}");
}
