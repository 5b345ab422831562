//! `idem run --items amqp://…?queue=Q` against the machine's RabbitMQ.
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::{QueueJob, WRITE_JSON, broker_url, exit_within, ids, unique, wait_for, with_duplicates};

/// A queue of this test's own, with a dead-letter queue behind it (`Q.dead`, through the default exchange);
/// both expire 10 minutes after their last use should the test die before deleting them.
struct Rabbit {
    url: String,
    _conn: Connection,
    channel: Channel,
    queue: String,
    dead: String,
}

impl Rabbit {
    async fn new(url: &str) -> Rabbit {
        let conn = Connection::connect(url, ConnectionProperties::default()).await.unwrap();
        let channel = conn.create_channel().await.unwrap();
        let queue = unique("idem-test-");
        let dead = format!("{queue}.dead");
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        channel.queue_declare(dead.as_str().into(), durable, args.clone()).await.unwrap();
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
        args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(dead.as_str().into()));
        channel.queue_declare(queue.as_str().into(), durable, args).await.unwrap();
        Rabbit { url: url.to_owned(), _conn: conn, channel, queue, dead }
    }

    /// `--items` for this queue.
    fn items(&self) -> String {
        format!("{}?queue={}", self.url, self.queue)
    }

    /// Publishes one persistent message per id, the id as its message-id; every body is the same, so the
    /// items' ids can only come from the message-ids.
    async fn publish(&self, ids: &[String]) {
        for id in ids {
            let props = BasicProperties::default().with_message_id(id.as_str().into()).with_delivery_mode(2);
            self.channel
                .basic_publish("".into(), self.queue.as_str().into(), BasicPublishOptions::default(), b"work", props)
                .await
                .unwrap();
        }
    }

    /// Publishes one persistent message per (message-id, body).
    async fn publish_bodies(&self, messages: &[(&str, &str)]) {
        for (id, body) in messages {
            let props = BasicProperties::default().with_message_id((*id).into()).with_delivery_mode(2);
            self.channel
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    props,
                )
                .await
                .unwrap();
        }
    }

    /// Messages ready in `queue` (unacknowledged ones of a closed channel are back among them).
    async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        self.channel.queue_declare(queue.into(), passive, FieldTable::default()).await.unwrap().message_count()
    }

    async fn delete(self) {
        for q in [&self.queue, &self.dead] {
            self.channel.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_messages_a_fifth_published_twice_execute_800_times_and_are_all_acknowledged() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    let ids = ids(800);
    let messages = with_duplicates(&ids);
    assert_eq!(messages.len(), 1000);
    rabbit.publish(&messages).await;
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
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
    // Every message acknowledged: the consumer's channel is closed, so an unacknowledged one would be ready again.
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_consumers_killed_mid_item_has_its_messages_redelivered_and_finished_once() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    let ids = ids(60);
    rabbit.publish(&ids).await;
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
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
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_9_the_dead_consumers_redeliveries_do_not_hold_up_the_other_messages() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    let ids = ids(40);
    rabbit.publish(&ids).await;
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
    // Two jobs: a prefetch of four, two running and two claimed ahead, each under a 20 s lease (renewed every
    // 6.7 s, so it lives at least 13 s after the kill).
    let args = ["--until-empty", "--jobs", "2", "--lease", "20s"];
    let mut victim = job.spawn(&args, &[("SLEEP", "60")], "victim");
    let victim_pid = victim.id();
    tokio::task::block_in_place(|| {
        wait_for("the victim to start two items", Duration::from_secs(30), || {
            job.log().iter().filter(|(_, pid)| *pid == victim_pid).count() >= 2
        })
    });
    // Its two items claimed ahead are claimed right after the first two started.
    tokio::time::sleep(Duration::from_millis(500)).await;
    victim.kill().unwrap();
    victim.wait().unwrap();
    // The broker hands the victim's four messages back at the head of the queue: the next consumer's prefetch
    // fills with them, their items leased by the dead runner for 13 to 20 s more.
    let started = std::time::Instant::now();
    let mut next = job.spawn(&args, &[("SLEEP", "0.05")], "next");
    let next_pid = next.id();
    let victims: Vec<String> = job.log().iter().map(|(id, _)| id.clone()).collect();
    tokio::task::block_in_place(|| {
        wait_for("the next consumer to run 5 items while the dead one's leases live", Duration::from_secs(10), || {
            job.log().iter().filter(|(id, pid)| *pid == next_pid && !victims.contains(id)).count() >= 5
        })
    });
    eprintln!("5 other items ran {:?} after the next consumer started", started.elapsed());
    let code = tokio::task::block_in_place(|| exit_within(&mut next, Duration::from_secs(120), "next", &job));
    assert_eq!(code, 0, "{}", job.stderr_of("next"));
    job.assert_outputs_valid(&ids);
    let log = job.log();
    for id in &ids {
        let killed = log.iter().filter(|(i, pid)| i == id && *pid == victim_pid).count();
        let all = log.iter().filter(|(i, _)| i == id).count();
        assert!(all <= 1 + killed, "{id}: {all} executions, {killed} of them by the killed consumer");
    }
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_fails_twice_then_sits_in_the_dead_letter_queue_and_the_others_complete() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    let mut ids = ids(20);
    ids.insert(10, "job-poison".into());
    rabbit.publish(&ids).await;
    // The same error with another number each time (the shell's pid): one fingerprint, so poison at the second.
    let script = format!(
        "if [ \"$1\" = job-poison ]; then echo \"cannot parse item at offset $$\" >&2; exit 3; fi\n{WRITE_JSON}"
    );
    let job = QueueJob::new(rabbit.items(), &script);
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty", "--jobs", "2", "--on-poison", "skip"]));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("poison item job-poison: exit 3: cannot parse item at offset "), "{err}");
    // `idem runs forget` alone would not run it again: its message is in the dead-letter queue.
    assert!(err.contains("job-poison`, then publish the messages again"), "{err}");
    let runs = job.executions_per_item();
    assert_eq!(runs.get("job-poison"), Some(&2), "two identical failures, then no more");
    assert_eq!(runs.values().filter(|&&n| n == 1).count(), 20);
    ids.retain(|i| i != "job-poison");
    job.assert_outputs_valid(&ids);
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 1));
    rabbit.delete().await;
}

/// Closes, from the broker's side, every connection whose client named it `name`: (how many were closed).
fn close_connections_named(name: &str) -> usize {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "--no-table-headers", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut closed = 0;
    for line in text.lines() {
        // RabbitMQ 3.10 lists the client's connection_name among its client properties only.
        if let Some((connection, properties)) = line.split_once('\t')
            && properties.contains(&format!("{{\"connection_name\",\"{name}\"}}"))
        {
            let status = std::process::Command::new("rabbitmqctl")
                .args(["close_connection", connection.trim(), "closed by an idem test"])
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap();
            assert!(status.success());
            closed += 1;
        }
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_whose_connections_the_broker_closes_reconnect_and_finish() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    if std::process::Command::new("rabbitmqctl").arg("help").output().is_err() {
        assert!(std::env::var("IDEM_TEST_REQUIRE_BACKENDS").is_err(), "rabbitmqctl is missing");
        eprintln!("skipped: rabbitmqctl is not installed");
        return;
    }
    let rabbit = Rabbit::new(&url).await;
    let ids = ids(300);
    rabbit.publish(&ids).await;
    // Executions after the 40th wait for a gate the test opens once it closed the connections: both consumers
    // are mid-run when their connections close, however slow `rabbitmqctl` is on a loaded machine (without the
    // gate the 300 items could all be done before the close).
    let gated = format!(
        "if [ \"$(wc -l < \"$(dirname \"$0\")/log\")\" -gt 40 ]; then\n  \
         while [ ! -e \"$(dirname \"$0\")/gate\" ]; do sleep 0.05; done\nfi\n{WRITE_JSON}"
    );
    let job = QueueJob::new(rabbit.items(), &gated);
    let args = ["--until-empty", "--jobs", "4"];
    let slow = [("SLEEP", "0.05")];
    let mut consumers: Vec<_> = (0..2).map(|i| job.spawn(&args, &slow, &format!("c{i}"))).collect();
    tokio::task::block_in_place(|| wait_for("40 executions", Duration::from_secs(60), || job.log().len() >= 40));
    let closed = tokio::task::block_in_place(|| close_connections_named(&format!("idem run {}", rabbit.queue)));
    std::fs::write(job.path("gate"), "").unwrap();
    assert_eq!(closed, 2, "one connection per consumer: {}\n{}", job.stderr_of("c0"), job.stderr_of("c1"));
    for (i, c) in consumers.iter_mut().enumerate() {
        let name = format!("c{i}");
        let code = tokio::task::block_in_place(|| exit_within(c, Duration::from_secs(120), &name, &job));
        let err = job.stderr_of(&name);
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("reconnected to amqp://"), "{err}");
    }
    let runs = job.executions_per_item();
    assert_eq!(runs.len(), 300);
    assert!(
        runs.values().all(|&n| n == 1),
        "a dropped connection made an item run twice: {runs:?}\n{}\n{}",
        job.stderr_of("c0"),
        job.stderr_of("c1")
    );
    job.assert_outputs_valid(&ids);
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_lets_running_items_finish_and_hands_the_other_messages_back() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    rabbit.publish(&ids(20)).await;
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
    let handle = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        super::ctrl_c_finishes_running_items_and_hands_the_rest_back(&job, || {
            // The two done are acknowledged, the rest are ready again (none left unacknowledged).
            assert_eq!(handle.block_on(rabbit.ready(&rabbit.queue)), 18);
        })
    });
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}

/// A port on this machine nothing listens on (bound, then let go).
pub(super) fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn a_broker_that_cannot_be_reached_refuses_the_run_and_leaves_no_ledger() {
    let job = QueueJob::new(format!("amqp://guest:guest@127.0.0.1:{}/%2f?queue=q", closed_port()), WRITE_JSON);
    let (code, err) = job.run(&["--until-empty"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("Connection refused") || err.contains("connection refused"), "{err}");
    assert!(!job.path("out/.idem").exists(), "a refused run made a ledger: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_reused_with_another_body_is_dead_lettered_not_taken_for_done() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    rabbit.publish_bodies(&[("job-same", "the first body"), ("job-same", "another body"), ("job-other", "x")]).await;
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("id reused with another body: the ledger has job-same recorded for another item text"),
        "{err}"
    );
    assert!(err.contains(": 2 done now, 0 already done, 0 adopted, 1 failed"), "{err}");
    let runs = job.executions_per_item();
    assert_eq!(runs, [("job-other".to_owned(), 1), ("job-same".to_owned(), 1)].into(), "{err}");
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 1));
    // Both again (either may have won the first run, the two being in flight at once): the one recorded is a
    // duplicate, acknowledged as done without running; the other is dead-lettered again.
    rabbit.publish_bodies(&[("job-same", "the first body"), ("job-same", "another body")]).await;
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(": 0 done now, 1 already done, 0 adopted, 1 failed"), "{err}");
    assert_eq!(job.log().len(), 2, "{err}");
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 2));
    rabbit.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_is_no_item_is_named_by_its_id_tag_and_body_and_an_empty_queue_is_said_empty() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    rabbit.publish_bodies(&[("m-empty", "  ")]).await;
    let props = BasicProperties::default().with_delivery_mode(2);
    rabbit
        .channel
        .basic_publish("".into(), rabbit.queue.as_str().into(), BasicPublishOptions::default(), b"\xff\xfeab", props)
        .await
        .unwrap();
    let job = QueueJob::new(rabbit.items(), WRITE_JSON);
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("the message body is empty; message-id \"m-empty\", delivery tag 1, body \"  \" (2 bytes)"),
        "{err}"
    );
    assert!(
        err.contains("the message body is not UTF-8; no message-id, delivery tag 2, body \"\\xff\\xfeab\" (4 bytes)"),
        "{err}"
    );
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 2));
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
    assert_eq!(code, 0, "{err}");
    assert!(err.starts_with("nothing to do: the queue was empty\n"), "{err}");
    rabbit.delete().await;
}

/// Forwards every connection to `port` to the broker at `to`, from now on (threads, one pair per connection).
fn forward(port: u16, to: std::net::SocketAddr) {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(broker) = std::net::TcpStream::connect(to) else { return };
            for (mut from, mut into) in [(client.try_clone().unwrap(), broker.try_clone().unwrap()), (broker, client)] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut into);
                    let _ = into.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_started_before_its_broker_is_reachable_waits_for_it_and_a_cron_run_is_refused() {
    let Some(url) = broker_url("IDEM_TEST_AMQP_URL") else { return };
    let rabbit = Rabbit::new(&url).await;
    rabbit.publish(&ids(3)).await;
    let broker: std::net::SocketAddr = {
        let authority = url.split_once('@').map_or(url.as_str(), |(_, a)| a);
        authority.split('/').next().unwrap().parse().unwrap()
    };
    let port = closed_port();
    let items =
        format!("{}?queue={}", url.replacen(&broker.to_string(), &format!("127.0.0.1:{port}"), 1), rabbit.queue);
    let job = QueueJob::new(items, WRITE_JSON);
    // A cron run does not wait: nothing to consume is a refusal.
    let (code, err) = tokio::task::block_in_place(|| job.run(&["--until-empty"]));
    assert_eq!(code, 2, "{err}");
    let mut service = job.spawn(&[], &[], "service");
    tokio::task::block_in_place(|| {
        wait_for("two connection attempts", Duration::from_secs(30), || {
            job.stderr_of("service").matches("Connection refused").count() >= 2
        });
        assert!(!job.path("out/.idem").exists(), "a ledger before the queue was reached");
        forward(port, broker);
        wait_for("the three items", Duration::from_secs(60), || job.log().len() == 3);
    });
    super::signal(service.id(), "INT");
    let code = tokio::task::block_in_place(|| exit_within(&mut service, Duration::from_secs(30), "service", &job));
    let err = job.stderr_of("service");
    // Every item was done when the Ctrl-C came: nothing interrupted.
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("trying again in") && err.contains(" attempts"), "{err}");
    job.assert_outputs_valid(&ids(3));
    assert_eq!((rabbit.ready(&rabbit.queue).await, rabbit.ready(&rabbit.dead).await), (0, 0));
    rabbit.delete().await;
}
