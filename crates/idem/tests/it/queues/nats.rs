//! `idem run --items nats://…?stream=S&consumer=C` against the machine's NATS JetStream, and a throw-away
//! `nats-server` of the test's own for the restart.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt as _;

use super::{QueueJob, WRITE_JSON, broker_url, exit_within, ids, unique, wait_for, with_duplicates};

/// A stream of this test's own (subject `idemtest.NAME`, messages kept 10 minutes at most should the test die
/// before deleting it) and the name of its durable consumer.
struct Js {
    url: String,
    client: async_nats::Client,
    js: jetstream::Context,
    stream: String,
    consumer: String,
}

impl Js {
    /// The stream; with `ack_wait`, its consumer made ahead with that ack wait (else idem makes it).
    async fn new(url: &str, ack_wait: Option<Duration>) -> Js {
        let client = async_nats::connect(url).await.unwrap();
        let js = jetstream::new(client.clone());
        let name = unique("IDEMTEST");
        let config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("idemtest.{name}")],
            max_age: Duration::from_secs(600),
            ..stream::Config::default()
        };
        let s = js.create_stream(config).await.unwrap();
        if let Some(ack_wait) = ack_wait {
            let config = pull::Config {
                durable_name: Some("workers".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                ..pull::Config::default()
            };
            s.create_consumer(config).await.unwrap();
        }
        Js { url: url.to_owned(), client, js, stream: name, consumer: "workers".into() }
    }

    fn items(&self) -> String {
        format!("{}?stream={}&consumer={}", self.url, self.stream, self.consumer)
    }

    /// Publishes each body; with `msg_ids`, the i-th message carries `Nats-Msg-Id: msg_ids[i]`.
    async fn publish(&self, bodies: &[String], msg_ids: Option<&[String]>) {
        let subject = format!("idemtest.{}", self.stream);
        for (i, body) in bodies.iter().enumerate() {
            let ack = match msg_ids {
                Some(ids) => {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", ids[i].as_str());
                    self.js.publish_with_headers(subject.clone(), headers, body.clone().into()).await.unwrap()
                }
                None => self.js.publish(subject.clone(), body.clone().into()).await.unwrap(),
            };
            ack.await.unwrap();
        }
    }

    /// The consumer's (messages not yet delivered, delivered and not acknowledged).
    async fn pending(&self) -> (u64, usize) {
        let mut s = self.js.get_stream(&self.stream).await.unwrap();
        let _ = s.info().await;
        let mut c: jetstream::consumer::PullConsumer = s.get_consumer(&self.consumer).await.unwrap();
        let info = c.info().await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_messages_a_fifth_published_twice_execute_800_times_and_are_all_acknowledged() {
    let Some(url) = broker_url("IDEM_TEST_NATS_URL") else { return };
    let js = Js::new(&url, None).await;
    let ids = ids(800);
    // No Nats-Msg-Id here: JetStream would drop the second copy itself. The id comes from the body.
    js.publish(&with_duplicates(&ids), None).await;
    let job = QueueJob::new(js.items(), WRITE_JSON);
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty", "--jobs", "8"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("1000 items in ")
            && err.contains(
                ": 800 done now, 200 already done, 0 adopted, 0 failed, 0 poison, 0 not done; 800 commands ran"
            ),
        "{err}"
    );
    let runs = job.executions_per_item();
    assert_eq!(runs.len(), 800);
    assert!(runs.values().all(|&n| n == 1), "an item ran twice: {runs:?}");
    job.assert_outputs_valid(&ids);
    assert_eq!(js.pending().await, (0, 0), "every message delivered and acknowledged");
    js.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_consumers_killed_mid_item_has_its_messages_redelivered_and_finished_once() {
    let Some(url) = broker_url("IDEM_TEST_NATS_URL") else { return };
    // A short ack wait: the killed consumer's messages come back after 3 s instead of 30.
    let js = Js::new(&url, Some(Duration::from_secs(3))).await;
    let ids = ids(60);
    js.publish(&ids, None).await;
    let job = QueueJob::new(js.items(), WRITE_JSON);
    let args = ["--until-empty", "--jobs", "2", "--lease", "2s"];
    let slow = [("SLEEP", "0.3")];
    let mut victim = job.spawn(&args, &slow, "victim");
    let victim_pid = victim.id();
    let mut others: Vec<_> = (0..2).map(|i| job.spawn(&args, &slow, &format!("c{i}"))).collect();
    tokio::task::block_in_place(|| {
        wait_for("the victim to start two items", Duration::from_secs(30), || {
            job.log().iter().filter(|(_, pid)| *pid == victim_pid).count() >= 2
        })
    });
    victim.kill().unwrap();
    victim.wait().unwrap();
    for (i, c) in others.iter_mut().enumerate() {
        let name = format!("c{i}");
        let code = tokio::task::block_in_place(|| exit_within(c, Duration::from_secs(120), &name, &job));
        assert_eq!(code, 0, "{}", job.stderr_of(&name));
    }
    job.assert_outputs_valid(&ids);
    let log = job.log();
    let mut redelivered = 0;
    for id in &ids {
        let killed = log.iter().filter(|(i, pid)| i == id && *pid == victim_pid).count();
        let all = log.iter().filter(|(i, _)| i == id).count();
        assert!(all <= 1 + killed, "{id}: {all} executions, {killed} of them by the killed consumer");
        if killed > 0 && all > killed {
            redelivered += 1;
        }
    }
    assert!(redelivered >= 1, "the killed consumer's items in flight were run again by the others: {log:?}");
    assert_eq!(js.pending().await, (0, 0));
    js.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_fails_twice_then_is_terminated_with_its_advisory_and_the_others_complete() {
    let Some(url) = broker_url("IDEM_TEST_NATS_URL") else { return };
    let js = Js::new(&url, None).await;
    let mut ids = ids(20);
    ids.insert(10, "job-poison".into());
    let mut advisories = js
        .client
        .subscribe(format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.{}", js.stream, js.consumer))
        .await
        .unwrap();
    // One body for all: the ids can only come from the Nats-Msg-Id headers.
    js.publish(&vec!["work".to_owned(); ids.len()], Some(&ids)).await;
    let script = format!(
        "if [ \"$1\" = job-poison ]; then echo \"cannot parse item at offset $$\" >&2; exit 3; fi\n{WRITE_JSON}"
    );
    let job = QueueJob::new(js.items(), &script);
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty", "--jobs", "2", "--on-poison", "skip"]));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("poison item job-poison: exit 3: cannot parse item at offset "), "{err}");
    let runs = job.executions_per_item();
    assert_eq!(runs.get("job-poison"), Some(&2), "two identical failures, then no more");
    assert_eq!(runs.values().filter(|&&n| n == 1).count(), 20);
    ids.retain(|i| i != "job-poison");
    job.assert_outputs_valid(&ids);
    let advisory = tokio::time::timeout(Duration::from_secs(5), advisories.next()).await.unwrap().unwrap();
    let advisory: serde_json::Value = serde_json::from_slice(&advisory.payload).unwrap();
    assert_eq!(advisory["type"], "io.nats.jetstream.advisory.v1.terminated", "{advisory}");
    assert!(
        tokio::time::timeout(Duration::from_millis(500), advisories.next()).await.is_err(),
        "one message terminated"
    );
    assert_eq!(js.pending().await, (0, 0));
    js.delete().await;
}

/// A `nats-server -js` of the test's own on `port`, storing in `dir`; killed on drop.
struct ThrowAwayNats(Child);

impl ThrowAwayNats {
    fn start(port: u16, dir: &std::path::Path) -> ThrowAwayNats {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server");
        wait_for("nats-server to listen", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        ThrowAwayNats(child)
    }
}

impl Drop for ThrowAwayNats {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_reconnect_after_their_nats_server_restarts_and_finish() {
    // Only the machine's NATS URL decides whether broker tests run; this one starts a server of its own.
    if broker_url("IDEM_TEST_NATS_URL").is_none() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = tokio::task::block_in_place(|| ThrowAwayNats::start(port, store.path()));
    let url = format!("nats://127.0.0.1:{port}");
    let js = Js::new(&url, None).await;
    let ids = ids(300);
    js.publish(&ids, None).await;
    let job = QueueJob::new(js.items(), WRITE_JSON);
    let args = ["--until-empty", "--jobs", "4"];
    let slow = [("SLEEP", "0.05")];
    let mut consumers: Vec<_> = (0..2).map(|i| job.spawn(&args, &slow, &format!("c{i}"))).collect();
    tokio::task::block_in_place(|| wait_for("40 executions", Duration::from_secs(60), || job.log().len() >= 40));
    drop(server);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _server = tokio::task::block_in_place(|| ThrowAwayNats::start(port, store.path()));
    for (i, c) in consumers.iter_mut().enumerate() {
        let name = format!("c{i}");
        let code = tokio::task::block_in_place(|| exit_within(c, Duration::from_secs(120), &name, &job));
        let err = job.stderr_of(&name);
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("reconnected to nats://"), "{err}");
    }
    let runs = job.executions_per_item();
    assert_eq!(runs.len(), 300);
    assert!(runs.values().all(|&n| n == 1), "a restart made an item run twice: {runs:?}");
    job.assert_outputs_valid(&ids);
    assert_eq!(js.pending().await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_lets_running_items_finish_and_hands_the_other_messages_back() {
    let Some(url) = broker_url("IDEM_TEST_NATS_URL") else { return };
    // An ack wait longer than the test: a message the stopped consumer kept without a Nak would never come back
    // in time, and the second consumer would never find the stream drained.
    let js = Js::new(&url, Some(Duration::from_secs(600))).await;
    js.publish(&ids(20), None).await;
    let job = QueueJob::new(js.items(), WRITE_JSON);
    tokio::task::block_in_place(|| super::ctrl_c_finishes_running_items_and_hands_the_rest_back(&job, || {}));
    assert_eq!(js.pending().await, (0, 0));
    js.delete().await;
}

/// A consumer told to stop while its NATS server is down ends within the close limit (5 s) instead of waiting
/// for the server to come back (async-nats answers a flush only after reconnecting); its items were done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_told_to_stop_ends_while_its_server_is_down() {
    if broker_url("IDEM_TEST_NATS_URL").is_none() {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = tokio::task::block_in_place(|| ThrowAwayNats::start(port, store.path()));
    let url = format!("nats://127.0.0.1:{port}");
    let js = Js::new(&url, None).await;
    let ids = ids(10);
    js.publish(&ids, None).await;
    let job = QueueJob::new(js.items(), WRITE_JSON);
    let mut consumer = job.spawn(&["--jobs", "2"], &[], "service");
    tokio::task::block_in_place(|| wait_for("10 executions", Duration::from_secs(60), || job.log().len() >= 10));
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(server);
    tokio::time::sleep(Duration::from_millis(500)).await;
    super::signal(consumer.id(), "INT");
    let started = std::time::Instant::now();
    tokio::task::block_in_place(|| exit_within(&mut consumer, Duration::from_secs(20), "service", &job));
    assert!(started.elapsed() < Duration::from_secs(15), "it took {:?} to stop", started.elapsed());
    job.assert_outputs_valid(&ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_consumer_that_does_not_acknowledge_each_message_is_refused_and_nothing_runs() {
    let Some(url) = broker_url("IDEM_TEST_NATS_URL") else { return };
    for (policy, shown) in [(AckPolicy::None, "none"), (AckPolicy::All, "all")] {
        let js = Js::new(&url, None).await;
        let s = js.js.get_stream(&js.stream).await.unwrap();
        let config = pull::Config { durable_name: Some(js.consumer.clone()), ack_policy: policy, ..Default::default() };
        s.create_consumer(config).await.unwrap();
        js.publish(&ids(3), None).await;
        let job = QueueJob::new(js.items(), WRITE_JSON);
        let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains(&format!("consumer workers of stream {} has ack policy {shown}", js.stream))
                && err.contains("idem needs AckPolicy::Explicit"),
            "{err}"
        );
        assert!(job.log().is_empty(), "an item ran");
        assert!(!job.path("out/.idem").exists(), "a refused run made a ledger: {err}");
        assert_eq!(js.pending().await, (3, 0), "no message taken");
        js.delete().await;
    }
}
