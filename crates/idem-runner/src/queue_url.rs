//! Where `idem run --items` takes its items from when it is a message queue: the URL, parsed and checked
//! before anything connects ([`QueueUrl`]). Below the queue consumers and the configuration alike.

use idem_core::redact_url as redact;
use percent_encoding::percent_decode_str;

use crate::error::Error;

/// A queue to consume, from `--items amqp://…?queue=Q` or `--items nats://…?stream=S&consumer=C`.
#[derive(Clone, PartialEq, Eq)]
pub enum QueueUrl {
    /// A RabbitMQ queue: `amqp://USER:PASS@HOST:PORT/VHOST?queue=NAME` (or `amqps://`).
    Amqp {
        /// The URL without its `queue` parameter, as lapin reads it (it takes `heartbeat`, `frame_max`,
        /// `channel_max`, `connection_timeout`).
        url: String,
        /// The queue's name.
        queue: String,
    },
    /// A JetStream stream and its durable pull consumer: `nats://HOST:PORT?stream=S&consumer=C` (or `tls://`).
    Nats {
        /// The server URL without the query.
        url: String,
        /// The stream's name.
        stream: String,
        /// The durable consumer's name; created (explicit acknowledgement, the server's defaults otherwise)
        /// when the stream has none of that name.
        consumer: String,
    },
}

impl std::fmt::Debug for QueueUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl QueueUrl {
    /// The queue named by `items`, or `None` when it is no queue URL (a path, or `-`).
    ///
    /// # Errors
    /// [`Error::Config`] for a queue URL without its queue (or stream and consumer), or with a parameter that
    /// is given twice.
    pub fn parse(items: &str) -> Result<Option<Self>, Error> {
        let Some((scheme, _)) = items.split_once("://") else { return Ok(None) };
        let scheme = scheme.to_ascii_lowercase();
        if !["amqp", "amqps", "nats", "tls"].contains(&scheme.as_str()) {
            return Ok(None);
        }
        let (base, query) = items.split_once('?').unwrap_or((items, ""));
        let mut kept = Vec::new();
        let take = |name: &str, pairs: &mut Vec<(String, String)>| -> Result<Option<String>, Error> {
            let found: Vec<String> = pairs.iter().filter(|(k, _)| k == name).map(|(_, v)| v.clone()).collect();
            pairs.retain(|(k, _)| k != name);
            match found.as_slice() {
                [] => Ok(None),
                [one] if !one.is_empty() => Ok(Some(one.clone())),
                [_] => Err(Error::Config(format!("--items {}: {name}= is empty", redact(items)))),
                _ => Err(Error::Config(format!("--items {}: {name}= is given twice", redact(items)))),
            }
        };
        // Values decoded for idem's own parameters; lapin's are handed on as written (decoding then joining
        // them again would turn an encoded `&` into a new parameter).
        let raw: Vec<(&str, &str)> =
            query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, ""))).collect();
        let mut pairs: Vec<(String, String)> = raw
            .iter()
            .map(|(k, v)| ((*k).to_owned(), percent_decode_str(v).decode_utf8_lossy().into_owned()))
            .collect();
        let missing = |what: &str| Error::Config(format!("--items {}: name the {what} (…?{what}=NAME)", redact(items)));
        let url = if scheme.starts_with("amqp") {
            let queue = take("queue", &mut pairs)?.ok_or_else(|| missing("queue"))?;
            // A misspelt parameter (`hearbeat`) would otherwise be ignored by lapin without a word.
            if let Some((k, _)) = raw.iter().find(|(k, _)| *k != "queue" && !AMQP_PARAMETERS.contains(k)) {
                return Err(Error::Config(format!(
                    "--items {}: unknown parameter {k:?} (an AMQP URL takes queue= and lapin's {})",
                    redact(items),
                    AMQP_PARAMETERS.join("=, ") + "="
                )));
            }
            kept.extend(raw.iter().filter(|(k, _)| *k != "queue").map(|(k, v)| format!("{k}={v}")));
            let url = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
            QueueUrl::Amqp { url, queue }
        } else {
            let stream = take("stream", &mut pairs)?.ok_or_else(|| missing("stream"))?;
            let consumer = take("consumer", &mut pairs)?.ok_or_else(|| missing("consumer"))?;
            if let Some((k, _)) = pairs.first() {
                return Err(Error::Config(format!(
                    "--items {}: unknown parameter {k:?} (a NATS URL takes stream= and consumer=)",
                    redact(items)
                )));
            }
            QueueUrl::Nats { url: base.to_owned(), stream, consumer }
        };
        Ok(Some(url))
    }

    /// The broker's name, for messages.
    pub(crate) fn broker(&self) -> &'static str {
        match self {
            QueueUrl::Amqp { .. } => "AMQP (RabbitMQ)",
            QueueUrl::Nats { .. } => "NATS JetStream",
        }
    }

    /// The cargo feature that brings this broker's client.
    pub(crate) fn feature(&self) -> &'static str {
        match self {
            QueueUrl::Amqp { .. } => "amqp",
            QueueUrl::Nats { .. } => "nats",
        }
    }

    /// The URL with its password hidden, for messages.
    pub fn redacted(&self) -> String {
        match self {
            QueueUrl::Amqp { url, queue } => format!("{} (queue {queue})", redact(url)),
            QueueUrl::Nats { url, stream, consumer } => {
                format!("{} (stream {stream}, consumer {consumer})", redact(url))
            }
        }
    }
}

/// The query parameters lapin reads from an AMQP URL (amq-protocol-uri).
pub(crate) const AMQP_PARAMETERS: [&str; 5] =
    ["heartbeat", "frame_max", "channel_max", "connection_timeout", "auth_mechanism"];
