//! A RabbitMQ queue as an item source (lapin): one connection and channel, `basic.qos` prefetch, a consumer
//! with manual acknowledgement; reconnects with backoff when the connection drops.

use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

use super::{Ack, Delivery, Next, QueueUrl, SourceConfig, backoff};
use crate::error::Error;
use crate::items::parse_item;
use crate::shown::count;

/// The prefetch is the channel's (`global`: RabbitMQ's per-channel limit), not the consumer's: RabbitMQ fixes a
/// consumer's limit when it starts consuming, while a channel's may be raised at any time, which the run does
/// for messages set aside (the consume loop's `follow_aside`). The channel has this one consumer, so the two are the same.
const QOS: BasicQosOptions = BasicQosOptions { global: true };

/// How long a consumer with nothing in flight waits for a delivery before asking whether the queue is
/// drained (`--until-empty`).
const IDLE: Duration = Duration::from_millis(250);

/// A connected consumer of one queue.
pub(crate) struct Consumer {
    /// The URL as given (password hidden in logs).
    shown: String,
    /// The URL lapin connects to.
    url: String,
    queue: String,
    cfg: SourceConfig,
    /// The live connection, its channel and consumer; `None` between a drop and the reconnect.
    live: Option<(Connection, Channel, lapin::Consumer)>,
    /// `--until-empty` found the queue drained and cancelled the consumer: what was already delivered still
    /// comes, then the stream ends.
    cancelled: bool,
    /// Messages received so far (the items' numbers).
    received: u64,
    /// The prefetch asked for: `cfg.prefetch`, raised by the messages set aside.
    prefetch: usize,
}

impl Consumer {
    pub(super) async fn connect(shown: &QueueUrl, url: &str, queue: &str, cfg: SourceConfig) -> Result<Self, Error> {
        let mut c = Self {
            shown: shown.redacted(),
            url: url.to_owned(),
            queue: queue.to_owned(),
            live: None,
            cancelled: false,
            received: 0,
            prefetch: cfg.prefetch,
            cfg,
        };
        let mut attempt = 0;
        let live = loop {
            match c.open().await {
                Ok(live) => break live,
                // A service waits for a broker that is not up yet, as for one that went away; a cron run
                // (`--until-empty`) and every other refusal (login, vhost, queue, URL) end the run at once.
                Err(e) if !c.cfg.until_empty && unreachable(&e) => {
                    tracing::warn!("connecting to {}: {e}; trying again in {:?}", c.shown, backoff(attempt));
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(Error::Queue(format!("{}: {}", c.shown, refusal(&c.url, &e)))),
            }
        };
        if attempt > 0 {
            tracing::warn!("connected to {} after {}", c.shown, count(attempt + 1, "attempt", "attempts"));
        }
        c.live = Some(live);
        Ok(c)
    }

    /// A connection named after the queue (so an operator can tell idem's connections apart), a channel with
    /// the prefetch, and a consumer that acknowledges by hand.
    async fn open(&self) -> Result<(Connection, Channel, lapin::Consumer), lapin::Error> {
        let props = ConnectionProperties::default().with_connection_name(format!("idem run {}", self.queue).into());
        let conn = Connection::connect(&self.url, props).await?;
        let channel = conn.create_channel().await?;
        let prefetch = u16::try_from(self.prefetch).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, QOS).await?;
        let consumer = channel
            .basic_consume(self.queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await?;
        Ok((conn, channel, consumer))
    }

    /// Sets the channel's prefetch (`basic.qos`) to `prefetch`, and that of every reconnect.
    pub(super) async fn set_prefetch(&mut self, prefetch: usize) {
        self.prefetch = prefetch;
        if let Some((_, channel, _)) = &self.live {
            let n = u16::try_from(prefetch).unwrap_or(u16::MAX);
            if let Err(e) = channel.basic_qos(n, QOS).await {
                tracing::debug!("setting the prefetch of {} to {prefetch} failed: {e}", self.shown);
            }
        }
    }

    /// Reconnects until it succeeds, pausing with backoff between attempts; logs each outcome.
    async fn reconnect(&mut self) {
        let mut attempt = 0;
        loop {
            tokio::time::sleep(backoff(attempt)).await;
            match self.open().await {
                Ok(live) => {
                    tracing::warn!("reconnected to {} after {}", self.shown, count(attempt + 1, "attempt", "attempts"));
                    self.live = Some(live);
                    return;
                }
                Err(e) => {
                    tracing::warn!("reconnecting to {}: {e}; trying again in {:?}", self.shown, backoff(attempt + 1));
                    attempt += 1;
                }
            }
        }
    }

    pub(super) async fn next(&mut self, idle: bool) -> Next {
        loop {
            let Some((_, channel, consumer)) = self.live.as_mut() else {
                if self.cancelled {
                    return Next::Drained;
                }
                self.reconnect().await;
                continue;
            };
            let wait_idle = self.cfg.until_empty && !self.cancelled;
            let got = if wait_idle {
                match tokio::time::timeout(IDLE, consumer.next()).await {
                    Ok(got) => got,
                    Err(_) if !idle => return Next::Idle,
                    Err(_) => {
                        // Nothing came and nothing is in flight: is the queue drained?
                        match drained(channel, &self.queue).await {
                            Ok(true) => {
                                let tag = consumer.tag();
                                if channel.basic_cancel(tag, BasicCancelOptions::default()).await.is_err() {
                                    self.live = None;
                                }
                                self.cancelled = true;
                            }
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!("connection to {} lost: {e}; reconnecting", self.shown);
                                self.live = None;
                            }
                        }
                        continue;
                    }
                }
            } else {
                consumer.next().await
            };
            match got {
                Some(Ok(delivery)) => return Next::Message(self.delivery(delivery)),
                _ if self.cancelled => return Next::Drained,
                Some(Err(e)) => tracing::warn!("connection to {} lost: {e}; reconnecting", self.shown),
                None => tracing::warn!("the broker cancelled the consumer of {}; consuming again", self.shown),
            }
            // The broker has taken back every message of the dead channel; it delivers them again.
            self.live = None;
        }
    }

    fn delivery(&mut self, delivery: lapin::message::Delivery) -> Delivery {
        self.received += 1;
        let id = delivery.properties.message_id().as_ref().map(|m| m.as_str().to_owned());
        let item =
            parse_item(self.received, &delivery.data, id.as_deref(), self.cfg.format, self.cfg.id_field.as_deref())
                .map_err(|reason| {
                    let from = match &id {
                        Some(id) => format!("message-id {id:?}, delivery tag {}", delivery.delivery_tag),
                        None => format!("no message-id, delivery tag {}", delivery.delivery_tag),
                    };
                    super::not_an_item(reason, &from, &delivery.data)
                });
        Delivery { item, ack: Ack::Amqp(delivery.acker), keep_alive: None }
    }

    pub(super) async fn close(self) {
        if let Some((conn, channel, _)) = self.live {
            // Closing the channel hands every unacknowledged delivery back to the queue.
            let _ = channel.close(200, "idem run stopped".into()).await;
            let _ = conn.close(200, "idem run stopped".into()).await;
        }
    }
}

/// True when the queue has no message ready (a passive declare answers its count).
async fn drained(channel: &Channel, queue: &str) -> Result<bool, lapin::Error> {
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    let q = channel.queue_declare(queue.into(), opts, FieldTable::default()).await?;
    Ok(q.message_count() == 0)
}

/// Why the first connection failed, in words: lapin's own for most, but a server that is no AMQP broker
/// shows as a parser's internals, and an empty vhost (`…:5672/?queue=q`) as "vhost  not found".
fn refusal(url: &str, e: &lapin::Error) -> String {
    use lapin::ErrorKind;
    let port = if url.starts_with("amqps") { 5671 } else { 5672 };
    match e.kind() {
        ErrorKind::ParsingError(_) | ErrorKind::InvalidProtocolVersion(_) => {
            format!("the server at {} did not answer as an AMQP 0-9-1 broker", super::host_port(url, port))
        }
        ErrorKind::ProtocolError(_) if empty_vhost(url) => format!("{e} (the default vhost is written %2f)"),
        _ => e.to_string(),
    }
}

/// True when the URL's path is a lone `/`: the empty vhost, not the default one (`/`, written `%2f`).
fn empty_vhost(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    path.split('?').next() == Some("/")
}

/// True when no broker answered (refused, reset, timed out, unreachable): worth waiting for.
fn unreachable(e: &lapin::Error) -> bool {
    use std::io::ErrorKind as Io;
    match e.kind() {
        lapin::ErrorKind::IOError(io) => matches!(
            io.kind(),
            Io::ConnectionRefused
                | Io::ConnectionReset
                | Io::ConnectionAborted
                | Io::TimedOut
                | Io::HostUnreachable
                | Io::NetworkUnreachable
        ),
        _ => false,
    }
}
