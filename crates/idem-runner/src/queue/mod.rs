//! Message queues as item sources: a RabbitMQ queue (AMQP 0-9-1, [`amqp`]) or a NATS JetStream pull consumer
//! ([`nats`]). Each message is an item; its acknowledgement is decided by how the item ended
//! ([`Disposition`]): acknowledged once its output is durable and the ledger says done (or it was done
//! already), rejected without requeue (to the dead-letter exchange; JetStream: terminated) when it is poison,
//! out of attempts or no item at all, handed back when the run stops before finishing it.

// Without a broker's client, the helpers only it uses are left unused.
#![cfg_attr(not(all(feature = "amqp", feature = "nats")), allow(dead_code))]

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "nats")]
mod nats;

use std::time::Duration;

use idem_store::{Jitter, RetryPolicy};

use crate::error::Error;
use crate::items::{Item, ItemFormat};
pub use crate::queue_url::QueueUrl;

/// `HOST:PORT` of a broker URL (`default_port` when it names none), for messages.
pub(crate) fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    // A port follows the last colon, unless that colon is inside an IPv6 literal's brackets.
    match host.rsplit_once(':') {
        Some((_, port)) if !port.contains(']') => host.to_owned(),
        _ => format!("{host}:{default_port}"),
    }
}

/// What becomes of a message once its item ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Done (now or before): acknowledged, gone from the queue.
    Ack,
    /// Poison, out of attempts, or not an item: rejected without requeue, so the broker dead-letters it
    /// (AMQP: to the queue's dead-letter exchange, if it has one; JetStream: terminated, with its advisory).
    DeadLetter,
    /// Not finished in this run (stopped, the ledger failed): handed back for another delivery.
    Requeue,
}

/// The handle that settles one message.
pub(crate) enum Ack {
    /// An AMQP delivery's acknowledgement, valid on the channel it came on.
    #[cfg(feature = "amqp")]
    Amqp(lapin::Acker),
    /// A JetStream message (its reply subject is its acknowledgement).
    #[cfg(feature = "nats")]
    Nats(Box<async_nats::jetstream::Message>),
    /// Built without either broker client: no message is ever taken.
    #[cfg(not(any(feature = "amqp", feature = "nats")))]
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

impl Ack {
    /// Settles the message. A failure means the broker has already taken it back (the connection it came on
    /// is gone): it will be delivered again, and its item judged again, which the ledger makes harmless.
    pub(crate) async fn settle(&self, disposition: Disposition) -> Result<(), String> {
        match self {
            #[cfg(feature = "amqp")]
            Ack::Amqp(acker) => {
                use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
                match disposition {
                    Disposition::Ack => acker.ack(BasicAckOptions::default()).await,
                    Disposition::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await,
                    Disposition::Requeue => acker.nack(BasicNackOptions { requeue: true, multiple: false }).await,
                }
                .map(|_| ())
                .map_err(|e| e.to_string())
            }
            #[cfg(feature = "nats")]
            Ack::Nats(message) => {
                use async_nats::jetstream::AckKind;
                let kind = match disposition {
                    Disposition::Ack => AckKind::Ack,
                    Disposition::DeadLetter => AckKind::Term,
                    Disposition::Requeue => AckKind::Nak(None),
                };
                message.ack_with(kind).await.map_err(|e| e.to_string())
            }
            #[cfg(not(any(feature = "amqp", feature = "nats")))]
            Ack::None(never) => {
                let _ = disposition;
                match *never {}
            }
        }
    }

    /// Tells the broker the message is still being worked on (JetStream: `+WPI`, which restarts its ack wait);
    /// nothing for AMQP, whose deliveries wait for their acknowledgement as long as the channel lives.
    pub(crate) async fn in_progress(&self) {
        #[cfg(feature = "nats")]
        #[allow(irrefutable_let_patterns)] // the only variant when built without `amqp`
        if let Ack::Nats(message) = self {
            let _ = message.ack_with(async_nats::jetstream::AckKind::Progress).await;
        }
    }
}

/// One message taken from the queue.
pub(crate) struct Delivery {
    /// Its item, or why it is none (not UTF-8, empty, no usable id).
    pub(crate) item: Result<Item, String>,
    /// How to settle it.
    pub(crate) ack: Ack,
    /// How often to tell the broker it is still being worked on, for brokers that redeliver a message held
    /// too long (JetStream's ack wait).
    pub(crate) keep_alive: Option<Duration>,
}

/// What [`Source::next`] got.
pub(crate) enum Next {
    /// A message.
    Message(Delivery),
    /// `--until-empty`: the queue has nothing left for this consumer.
    Drained,
    /// `--until-empty`: nothing came for a while, but the run had items in flight: ask again with what is in
    /// flight now.
    Idle,
}

/// A connected queue consumer.
pub(crate) enum Source {
    /// RabbitMQ (each boxed: hundreds of bytes of client state, made once per run).
    #[cfg(feature = "amqp")]
    Amqp(Box<amqp::Consumer>),
    /// NATS JetStream.
    #[cfg(feature = "nats")]
    Nats(Box<nats::Consumer>),
    /// Built without either broker client: [`Source::connect`] refuses every queue.
    #[cfg(not(any(feature = "amqp", feature = "nats")))]
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

/// How the engine reads a queue.
#[derive(Clone, Debug)]
pub(crate) struct SourceConfig {
    /// Messages taken ahead at most (AMQP prefetch; JetStream: the largest pull request).
    pub(crate) prefetch: usize,
    /// End once the queue is drained, instead of waiting for more.
    pub(crate) until_empty: bool,
    /// How message bodies are read.
    pub(crate) format: ItemFormat,
    /// The JSON field holding each item's id.
    pub(crate) id_field: Option<String>,
}

impl std::fmt::Debug for Source {
    // Without a broker client there is no `Source` to show: the body is unreachable.
    #[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(unreachable_code, unused_variables))]
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            #[cfg(feature = "amqp")]
            Source::Amqp(_) => "Source::Amqp",
            #[cfg(feature = "nats")]
            Source::Nats(_) => "Source::Nats",
            #[cfg(not(any(feature = "amqp", feature = "nats")))]
            Source::None(never) => match *never {},
        };
        f.write_str(name)
    }
}

impl Source {
    /// Connects and starts consuming.
    ///
    /// # Errors
    /// [`Error::Queue`] when the broker cannot be reached or the queue (stream) does not exist: at start-up
    /// that is a refusal; later the connection is retried instead. [`Error::Config`] when this build has no
    /// client for the broker (the cargo feature `amqp` or `nats` is off).
    pub(crate) async fn connect(url: &QueueUrl, cfg: SourceConfig) -> Result<Self, Error> {
        match url {
            #[cfg(feature = "amqp")]
            QueueUrl::Amqp { url: u, queue } => {
                amqp::Consumer::connect(url, u, queue, cfg).await.map(|c| Source::Amqp(Box::new(c)))
            }
            #[cfg(feature = "nats")]
            QueueUrl::Nats { url: u, stream, consumer } => {
                nats::Consumer::connect(url, u, stream, consumer, cfg).await.map(|c| Source::Nats(Box::new(c)))
            }
            #[allow(unreachable_patterns)]
            other => {
                let _ = cfg;
                Err(Error::Config(format!(
                    "--items {}: this build has no {} client (cargo feature `{}` of idem-runner)",
                    other.redacted(),
                    other.broker(),
                    other.feature()
                )))
            }
        }
    }

    /// The next message: waits for one, reconnecting (with backoff, each reconnect logged) when the broker
    /// goes away. `room`: how many more messages the run takes now (at least 1); `idle`: nothing of this run
    /// is in flight, so an empty queue means drained under `--until-empty`. Cancel-safe.
    pub(crate) async fn next(&mut self, room: usize, idle: bool) -> Next {
        let _ = (room, idle);
        match self {
            #[cfg(feature = "amqp")]
            Source::Amqp(c) => c.next(idle).await,
            #[cfg(feature = "nats")]
            Source::Nats(c) => c.next(room, idle).await,
            #[cfg(not(any(feature = "amqp", feature = "nats")))]
            Source::None(never) => match *never {},
        }
    }

    /// Asks the broker to deliver up to `prefetch` messages unacknowledged (AMQP `basic.qos`; kept for the
    /// reconnects). Nothing for JetStream, whose pulls ask for what the run has room for. A failure is left to
    /// the next delivery, which finds the connection gone and reconnects.
    pub(crate) async fn set_prefetch(&mut self, prefetch: usize) {
        let _ = prefetch;
        #[cfg(feature = "amqp")]
        #[allow(irrefutable_let_patterns)]
        if let Source::Amqp(c) = self {
            c.set_prefetch(prefetch).await;
        }
    }

    /// Stops consuming and closes the connection; the broker takes back every message not settled. Gives up
    /// after [`CLOSE_LIMIT`]: with the broker unreachable, async-nats answers a flush (and a pull request) only
    /// once it has reconnected, so a run told to stop waited for the server to come back (found by a break-it
    /// review; test `queues::nats::a_run_told_to_stop_ends_while_its_server_is_down`). What was not handed
    /// back is redelivered by the broker anyway, after its ack wait.
    pub(crate) async fn close(self) {
        let close = async {
            match self {
                #[cfg(feature = "amqp")]
                Source::Amqp(c) => (*c).close().await,
                #[cfg(feature = "nats")]
                Source::Nats(c) => (*c).close().await,
                #[cfg(not(any(feature = "amqp", feature = "nats")))]
                Source::None(never) => match never {},
            }
        };
        if tokio::time::timeout(CLOSE_LIMIT, close).await.is_err() {
            tracing::warn!("the broker did not answer the close within {CLOSE_LIMIT:?}: leaving the connection");
        }
    }
}

/// How long closing a consumer may take (handing back unsettled messages, flushing acknowledgements).
pub(crate) const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// Where a message that is no item came from and how its body begins, for the warning that rejects it:
/// `reason; <from>, body "<first 60 bytes, escaped>"`.
pub(crate) fn not_an_item(reason: String, from: &str, body: &[u8]) -> String {
    const EXCERPT: usize = 60;
    let shown = body[..body.len().min(EXCERPT)].escape_ascii().to_string();
    let more = if body.len() > EXCERPT { "…" } else { "" };
    format!("{reason}; {from}, body \"{shown}\"{more} ({} bytes)", body.len())
}

/// The pause before reconnect attempt `n` (0-based): 100 ms doubling up to 5 s.
pub(crate) fn backoff(n: u32) -> Duration {
    RetryPolicy::new()
        .with_base_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter(Jitter::None)
        .pause_after(n.saturating_add(1))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn queue_urls_name_their_queue_and_keep_the_rest() {
        let q = QueueUrl::parse("amqp://guest:secret@127.0.0.1:5672/%2f?queue=jobs&heartbeat=10").unwrap();
        assert_eq!(
            q,
            Some(QueueUrl::Amqp {
                url: "amqp://guest:secret@127.0.0.1:5672/%2f?heartbeat=10".into(),
                queue: "jobs".into()
            })
        );
        assert_eq!(q.unwrap().redacted(), "amqp://guest:***@127.0.0.1:5672/%2f?heartbeat=10 (queue jobs)");
        let n = QueueUrl::parse("nats://127.0.0.1:4222?stream=S&consumer=c%201").unwrap();
        assert_eq!(
            n,
            Some(QueueUrl::Nats { url: "nats://127.0.0.1:4222".into(), stream: "S".into(), consumer: "c 1".into() })
        );
        assert_eq!(QueueUrl::parse("items.txt").unwrap(), None);
        assert_eq!(QueueUrl::parse("-").unwrap(), None);
        assert_eq!(QueueUrl::parse("./http://x").unwrap(), None);
    }

    #[test]
    fn queue_urls_without_their_queue_are_refused_with_the_password_hidden() {
        let e = QueueUrl::parse("amqp://u:pw@h/v").unwrap_err().to_string();
        assert_eq!(e, "--items amqp://u:***@h/v: name the queue (…?queue=NAME)");
        let e = QueueUrl::parse("nats://h:4222?stream=S").unwrap_err().to_string();
        assert_eq!(e, "--items nats://h:4222?stream=S: name the consumer (…?consumer=NAME)");
        let e = QueueUrl::parse("nats://h?stream=S&consumer=C&queue=x").unwrap_err().to_string();
        assert!(e.contains("unknown parameter \"queue\""), "{e}");
        // AMQP: a misspelt lapin parameter is refused; an encoded value is handed on as written.
        let e = QueueUrl::parse("amqp://h/%2f?queue=q&hearbeat=5").unwrap_err().to_string();
        assert!(e.contains("unknown parameter \"hearbeat\""), "{e}");
        let q = QueueUrl::parse("amqp://h/%2f?queue=a%26b&auth_mechanism=a%26b").unwrap().unwrap();
        assert_eq!(q, QueueUrl::Amqp { url: "amqp://h/%2f?auth_mechanism=a%26b".into(), queue: "a&b".into() });
        let e = QueueUrl::parse("amqp://h?queue=a&queue=b").unwrap_err().to_string();
        assert!(e.contains("queue= is given twice"), "{e}");
    }

    #[test]
    fn host_and_port_are_named_with_the_default_port_filled_in() {
        assert_eq!(host_port("amqp://u:p@h:1234/%2f?x=1", 5672), "h:1234");
        assert_eq!(host_port("amqp://h/v", 5672), "h:5672");
        assert_eq!(host_port("nats://[::1]", 4222), "[::1]:4222");
        assert_eq!(host_port("nats://[::1]:9", 4222), "[::1]:9");
    }

    #[test]
    fn a_message_that_is_no_item_is_named_with_an_escaped_excerpt_of_its_body() {
        let long = [b'a'; 70];
        assert_eq!(
            not_an_item("the message body is empty".into(), "delivery tag 3", b""),
            "the message body is empty; delivery tag 3, body \"\" (0 bytes)"
        );
        assert_eq!(
            not_an_item("not UTF-8".into(), "stream sequence 9", b"\xff\"x\n"),
            "not UTF-8; stream sequence 9, body \"\\xff\\\"x\\n\" (4 bytes)"
        );
        assert!(not_an_item("r".into(), "f", &long).ends_with(&format!("\"{}\"… (70 bytes)", "a".repeat(60))));
    }

    #[test]
    fn reconnects_back_off_to_five_seconds() {
        let pauses: Vec<u64> = (0..9).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }
}
