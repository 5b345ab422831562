//! A NATS JetStream durable pull consumer as an item source (async-nats). Messages are pulled in requests of
//! at most the run's free room, so no more are taken ahead than the prefetch; the client reconnects by itself
//! (each disconnect and reconnect logged), and a pull that fails is made again with backoff.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures_util::StreamExt as _;

use super::{Ack, Delivery, Next, QueueUrl, SourceConfig, backoff};
use crate::error::Error;
use crate::items::parse_item;
use crate::shown::count;

/// How long one pull request waits for messages: also how long a consumer with nothing in flight waits
/// before asking whether the stream is drained (`--until-empty`).
const PULL_EXPIRES: Duration = Duration::from_millis(500);

/// A connected pull consumer.
pub(crate) struct Consumer {
    shown: String,
    client: async_nats::Client,
    consumer: PullConsumer,
    cfg: SourceConfig,
    /// A pull request being made, on a task of its own: once sent, the server delivers to its inbox whether
    /// or not anyone reads it, so it must never be dropped half made (the run may stop at any moment).
    request: Option<tokio::task::JoinHandle<Result<pull::Batch, pull::BatchError>>>,
    /// The pull request being read.
    batch: Option<pull::Batch>,
    /// Messages the current pull request brought so far.
    in_batch: usize,
    /// Pull requests that failed in a row (for the backoff).
    failures: u32,
    /// The consumer's ack wait: a message held longer is delivered again.
    ack_wait: Duration,
    received: u64,
}

impl Consumer {
    pub(super) async fn connect(
        shown: &QueueUrl,
        url: &str,
        stream: &str,
        consumer: &str,
        cfg: SourceConfig,
    ) -> Result<Self, Error> {
        let shown = shown.redacted();
        let refuse = |e: &dyn std::fmt::Display| Error::Queue(format!("{shown}: {e}"));
        // The client says Connected on its first connection too; only the later ones are reconnects.
        let connected_before = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut attempt = 0;
        let client = loop {
            let logged = shown.clone();
            let connected_before = std::sync::Arc::clone(&connected_before);
            let made = async_nats::ConnectOptions::new()
                .name("idem run")
                .connection_timeout(Duration::from_secs(5))
                .event_callback(move |event| {
                    let shown = logged.clone();
                    let again =
                        matches!(event, async_nats::Event::Connected) && connected_before.swap(true, Ordering::SeqCst);
                    async move {
                        match event {
                            async_nats::Event::Connected if again => tracing::warn!("reconnected to {shown}"),
                            async_nats::Event::Disconnected => {
                                tracing::warn!("connection to {shown} lost; reconnecting")
                            }
                            other => tracing::debug!("{shown}: {other}"),
                        }
                    }
                })
                .connect(url)
                .await;
            let e = match made {
                Ok(client) => break client,
                Err(e) => e,
            };
            // The client's own word for nothing answering is a bare "timed out".
            let why = match e.kind() {
                async_nats::ConnectErrorKind::TimedOut => {
                    format!("no NATS server answered at {} within 5 s", super::host_port(url, 4222))
                }
                _ => e.to_string(),
            };
            // A service waits for a server that is not up yet, as for one that went away; a cron run
            // (`--until-empty`) and every other refusal (login, TLS, URL) end the run at once.
            let unreachable =
                matches!(e.kind(), async_nats::ConnectErrorKind::Io | async_nats::ConnectErrorKind::TimedOut);
            if cfg.until_empty || !unreachable {
                return Err(refuse(&why));
            }
            tracing::warn!("connecting to {shown}: {why}; trying again in {:?}", backoff(attempt));
            tokio::time::sleep(backoff(attempt)).await;
            attempt += 1;
        };
        if attempt > 0 {
            tracing::warn!("connected to {shown} after {}", count(attempt + 1, "attempt", "attempts"));
        }
        let js = async_nats::jetstream::new(client.clone());
        let mut s = js.get_stream(stream).await.map_err(|e| refuse(&format_args!("stream {stream}: {e}")))?;
        let config = pull::Config {
            durable_name: Some(consumer.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ..pull::Config::default()
        };
        let pulled: PullConsumer = match s.get_or_create_consumer(consumer, config).await {
            Ok(c) => c,
            // Another consumer starting at the same moment may have made it between the look-up and the create.
            Err(e) => s.get_consumer(consumer).await.map_err(|_| refuse(&format_args!("consumer {consumer}: {e}")))?,
        };
        let policy = pulled.cached_info().config.ack_policy;
        if policy != AckPolicy::Explicit {
            // Under `none` the server counts a message done once sent, under `all` an acknowledgement covers
            // every earlier message too: either way a runner killed mid-item loses messages.
            return Err(refuse(&format_args!(
                "consumer {consumer} of stream {stream} has ack policy {}; idem needs AckPolicy::Explicit (each \
                 message acknowledged once its item is done): delete it (nats consumer rm {stream} {consumer}) \
                 or name another consumer (consumer=NAME), which idem then makes",
                match policy {
                    AckPolicy::None => "none",
                    AckPolicy::All => "all",
                    AckPolicy::Explicit => "explicit",
                }
            )));
        }
        let _ = s.info().await;
        let ack_wait = pulled.cached_info().config.ack_wait;
        Ok(Self {
            shown,
            client,
            consumer: pulled,
            cfg,
            request: None,
            batch: None,
            in_batch: 0,
            failures: 0,
            ack_wait: if ack_wait.is_zero() { Duration::from_secs(30) } else { ack_wait },
            received: 0,
        })
    }

    pub(super) async fn next(&mut self, room: usize, idle: bool) -> Next {
        loop {
            if let Some(batch) = self.batch.as_mut() {
                match batch.next().await {
                    Some(Ok(message)) => {
                        self.in_batch += 1;
                        self.failures = 0;
                        return Next::Message(self.delivery(message));
                    }
                    Some(Err(e)) => {
                        tracing::warn!("pulling from {}: {e}; pulling again", self.shown);
                        self.batch = None;
                        tokio::time::sleep(backoff(self.failures)).await;
                        self.failures += 1;
                        continue;
                    }
                    None => {
                        // The request expired or brought all it asked for.
                        self.batch = None;
                        if self.in_batch == 0 && self.cfg.until_empty {
                            if !idle {
                                return Next::Idle;
                            }
                            if self.drained().await {
                                return Next::Drained;
                            }
                        }
                    }
                }
            }
            let request = match self.request.as_mut() {
                Some(pending) => pending,
                None => {
                    let consumer = self.consumer.clone();
                    let size = room.max(1);
                    self.request.insert(tokio::spawn(async move {
                        consumer.batch().max_messages(size).expires(PULL_EXPIRES).messages().await
                    }))
                }
            };
            // Awaiting the task's handle is cancel-safe: a request the run stops waiting for is kept for close.
            let made = request.await;
            self.request = None;
            match made.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
                Ok(batch) => {
                    self.batch = Some(batch);
                    self.in_batch = 0;
                }
                Err(e) => {
                    tracing::warn!("pulling from {}: {e}; trying again in {:?}", self.shown, backoff(self.failures));
                    tokio::time::sleep(backoff(self.failures)).await;
                    self.failures += 1;
                }
            }
        }
    }

    /// True when the consumer has nothing left to deliver and nothing delivered awaits an acknowledgement
    /// (a message another consumer holds may still come back to this one).
    async fn drained(&mut self) -> bool {
        match self.consumer.info().await {
            Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
            Err(e) => {
                tracing::warn!("asking {} for its pending messages: {e}", self.shown);
                false
            }
        }
    }

    fn delivery(&mut self, message: async_nats::jetstream::Message) -> Delivery {
        self.received += 1;
        let id = message.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).map(|v| v.as_str().to_owned());
        let item =
            parse_item(self.received, &message.payload, id.as_deref(), self.cfg.format, self.cfg.id_field.as_deref())
                .map_err(|reason| {
                    let from = match message.info() {
                        Ok(info) => format!("stream sequence {}", info.stream_sequence),
                        Err(_) => "stream sequence unknown".to_owned(),
                    };
                    super::not_an_item(reason, &from, &message.payload)
                });
        // A third of the ack wait, so two reminders may be lost before the server gives the message to another.
        Delivery { item, ack: Ack::Nats(Box::new(message)), keep_alive: Some(self.ack_wait / 3) }
    }

    pub(super) async fn close(mut self) {
        // Messages the server sends for the last pull request but the run never took are handed back at once
        // (else they would wait out the ack wait); those the run took it has settled already. A request
        // expires within PULL_EXPIRES, so this ends.
        if let Some(request) = self.request.take()
            && let Ok(Ok(batch)) = request.await
        {
            self.batch = Some(batch);
        }
        if let Some(batch) = self.batch.as_mut() {
            while let Ok(Some(Ok(message))) = tokio::time::timeout(2 * PULL_EXPIRES, batch.next()).await {
                let _ = message.ack_with(async_nats::jetstream::AckKind::Nak(None)).await;
            }
        }
        // Flush, so the last acknowledgements reach the server before the connection closes.
        let _ = self.client.flush().await;
        drop(self.client);
    }
}
