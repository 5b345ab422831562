//! A small tool for the README's and the benchmarks' queues, on the URLs `idem run --items` takes
//! (`amqp://…?queue=Q`, `nats://…?stream=S&consumer=C`):
//!
//! ```text
//! queue declare URL          AMQP: a durable queue Q whose rejected messages go to Q.dead; NATS: a stream S on
//!                            the subject S (its consumer C is made by the first `idem run`)
//! queue publish URL [--ids]  one persistent message per line of standard input; with --ids the line is also
//!                            its message id (AMQP message-id, NATS Nats-Msg-Id)
//! queue count URL            AMQP: `Q: N ready, D dead-lettered`; NATS: `S: N pending, A unacknowledged`
//! queue delete URL           the queue and its dead-letter queue, or the stream
//! queue consume URL -- CMD…  a plain consumer for comparison: runs CMD with `{}` replaced by the body for each
//!                            message and acknowledges it, no ledger; --jobs N at once; until the queue is empty
//! ```
#![allow(clippy::unwrap_used)] // an example: failures end it with a message

use std::io::BufRead as _;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use idem_runner::QueueUrl;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(verb), Some(url)) = (args.first(), args.get(1)) else {
        eprintln!("usage: queue declare|publish|count|delete|consume URL [--ids] [--jobs N] [-- CMD…]");
        std::process::exit(2);
    };
    let url = QueueUrl::parse(url)?.ok_or("not an amqp:// or nats:// URL")?;
    let rest = &args[2..];
    match url {
        QueueUrl::Amqp { url, queue } => amqp(verb, &url, &queue, rest).await,
        QueueUrl::Nats { url, stream, consumer } => nats(verb, &url, &stream, &consumer, rest).await,
    }
}

fn stdin_lines() -> Vec<String> {
    std::io::stdin().lock().lines().map_while(Result::ok).filter(|l| !l.trim().is_empty()).collect()
}

fn jobs(rest: &[String]) -> usize {
    rest.iter().position(|a| a == "--jobs").and_then(|i| rest.get(i + 1)).and_then(|n| n.parse().ok()).unwrap_or(1)
}

fn command(rest: &[String]) -> Vec<String> {
    rest.iter().position(|a| a == "--").map(|i| rest[i + 1..].to_vec()).unwrap_or_default()
}

/// Runs the consumer's command for one message body; true when it exited 0.
async fn execute(cmd: &[String], body: &str) -> bool {
    let argv: Vec<String> = cmd.iter().map(|a| a.replace("{}", body)).collect();
    tokio::process::Command::new(&argv[0]).args(&argv[1..]).status().await.is_ok_and(|s| s.success())
}

async fn ready(channel: &Channel, queue: &str) -> Res<u32> {
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    Ok(channel.queue_declare(queue.into(), passive, FieldTable::default()).await?.message_count())
}

async fn amqp(verb: &str, url: &str, queue: &str, rest: &[String]) -> Res<()> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    let dead = format!("{queue}.dead");
    match verb {
        "declare" => {
            let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
            channel.queue_declare(dead.as_str().into(), durable, FieldTable::default()).await?;
            let mut args = FieldTable::default();
            args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
            args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(dead.as_str().into()));
            channel.queue_declare(queue.into(), durable, args).await?;
        }
        "publish" => {
            let ids = rest.iter().any(|a| a == "--ids");
            for line in stdin_lines() {
                let mut props = BasicProperties::default().with_delivery_mode(2);
                if ids {
                    props = props.with_message_id(line.as_str().into());
                }
                channel
                    .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), line.as_bytes(), props)
                    .await?;
            }
        }
        "count" => println!(
            "{queue}: {} ready, {} dead-lettered",
            ready(&channel, queue).await?,
            ready(&channel, &dead).await?
        ),
        "delete" => {
            for q in [queue, dead.as_str()] {
                channel.queue_delete(q.into(), QueueDeleteOptions::default()).await?;
            }
        }
        "consume" => amqp_consume(&channel, queue, jobs(rest), &command(rest)).await?,
        other => return Err(format!("unknown verb {other}").into()),
    }
    let _ = channel.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

async fn amqp_consume(channel: &Channel, queue: &str, jobs: usize, cmd: &[String]) -> Res<()> {
    channel.basic_qos(u16::try_from(jobs * 2)?, BasicQosOptions::default()).await?;
    let mut consumer =
        channel.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let slots = Arc::new(tokio::sync::Semaphore::new(jobs));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let next = tokio::time::timeout(Duration::from_millis(250), consumer.next()).await;
        let Ok(Some(delivery)) = next else {
            if tasks.is_empty() && ready(channel, queue).await? == 0 {
                break;
            }
            while tasks.try_join_next().is_some() {}
            continue;
        };
        let delivery = delivery?;
        let (slots, cmd) = (Arc::clone(&slots), cmd.to_vec());
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await.unwrap();
            if cmd.is_empty() || execute(&cmd, &String::from_utf8_lossy(&delivery.data)).await {
                delivery.acker.ack(BasicAckOptions::default()).await.unwrap();
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    Ok(())
}

async fn nats(verb: &str, url: &str, stream: &str, consumer: &str, rest: &[String]) -> Res<()> {
    use async_nats::jetstream::{self, consumer::PullConsumer};
    let client = async_nats::connect(url).await?;
    let js = jetstream::new(client.clone());
    match verb {
        "declare" => {
            let config = jetstream::stream::Config {
                name: stream.to_owned(),
                subjects: vec![stream.to_owned()],
                ..jetstream::stream::Config::default()
            };
            js.get_or_create_stream(config).await?;
        }
        "publish" => {
            let ids = rest.iter().any(|a| a == "--ids");
            for line in stdin_lines() {
                let ack = if ids {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", line.as_str());
                    js.publish_with_headers(stream.to_owned(), headers, line.into()).await?
                } else {
                    js.publish(stream.to_owned(), line.into()).await?
                };
                ack.await?;
            }
        }
        "count" => {
            let s = js.get_stream(stream).await?;
            let mut c: PullConsumer = s.get_consumer(consumer).await?;
            let info = c.info().await?;
            println!("{stream}: {} pending, {} unacknowledged", info.num_pending, info.num_ack_pending);
        }
        "delete" => {
            js.delete_stream(stream).await?;
        }
        "consume" => {
            let s = js.get_stream(stream).await?;
            let config = jetstream::consumer::pull::Config {
                durable_name: Some(consumer.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            };
            let c: PullConsumer = s.get_or_create_consumer(consumer, config).await?;
            let (jobs, cmd) = (jobs(rest), command(rest));
            let slots = Arc::new(tokio::sync::Semaphore::new(jobs));
            let mut tasks = tokio::task::JoinSet::new();
            loop {
                while tasks.len() >= jobs * 2 {
                    tasks.join_next().await;
                }
                let mut batch = c.batch().max_messages(jobs * 2).expires(Duration::from_millis(250)).messages().await?;
                let mut got = 0;
                while let Some(message) = batch.next().await {
                    let message = message?;
                    got += 1;
                    let (slots, cmd) = (Arc::clone(&slots), cmd.clone());
                    tasks.spawn(async move {
                        let _slot = slots.acquire_owned().await.unwrap();
                        if cmd.is_empty() || execute(&cmd, &String::from_utf8_lossy(&message.payload)).await {
                            message.ack().await.unwrap();
                        }
                    });
                }
                while tasks.try_join_next().is_some() {}
                if got == 0 && tasks.is_empty() {
                    break;
                }
            }
        }
        other => return Err(format!("unknown verb {other}").into()),
    }
    client.flush().await?;
    Ok(())
}
