//! The replicas of the store's master that a failover could promote, as the failover manager knows them: the
//! Sentinels' list for the master (`SENTINEL REPLICAS`), the Cluster's node table (`CLUSTER NODES`, the
//! replicas of the master serving the store's slot), and on one server, which has no failover manager, the
//! replicas it has connected (`INFO replication`).
//!
//! Why the failover manager's list and not the master's connected replicas: a replica cut off from the master
//! (a partition between the two) can still be promoted, and a write it never acknowledged is then lost.
//! `wait_replicas=all` waits for every replica of that list, so a write acknowledged to idem is on whichever
//! replica is promoted, through a crash, a switchover with the old master alive (`SENTINEL FAILOVER`,
//! `CLUSTER FAILOVER [FORCE|TAKEOVER]`) or a partition: a replica promoted stops acknowledging the old master,
//! so every write the old master takes after that is refused (503), never acknowledged.
//!
//! A replica the failover manager judges down (the Sentinels' `s_down`, the Cluster's `fail`) is counted
//! too: a replica that was only frozen comes back, and a Sentinel promotes it after a crash of the master if
//! its `replica-priority` ranks it first, whatever it missed (a break-it round lost 19,862 of 45,502
//! acknowledged writes when down replicas were left out). So writes are refused while any listed replica cannot
//! acknowledge them, until it is back or removed from the list (`SENTINEL RESET`, `CLUSTER FORGET`): after a
//! crash failover under Sentinel that includes the dead master, which the Sentinels keep as a replica of the
//! new one. Durability chosen over availability, as PostgreSQL's synchronous replication chooses.
//!
//! The count is read every [`EVERY`] (every 10 s when only the warning needs it) and kept between reads; a
//! read that fails keeps the last count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::aio::MultiplexedConnection;
use redis::{ConnectionAddr, IntoConnectionInfo, RedisResult, Value};

use crate::conn::Conn;

/// Durable claims on replicated Redis: each write is followed by `WAIT replicas timeout`, and fewer
/// acknowledgements than `replicas` fail the operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wait {
    pub(crate) replicas: Replicas,
    pub(crate) timeout: Duration,
}

/// How many replicas a write waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Replicas {
    /// `wait_replicas=N`, N > 0.
    Count(u32),
    /// `wait_replicas=all`: every replica the Sentinels or the Cluster know for the store's master, down or
    /// cut off ones included (this module counts them).
    All,
}

/// How often the replicas are counted again.
pub(crate) const EVERY: Duration = Duration::from_secs(1);
/// How long one Sentinel or node may take to answer a count.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for each Sentinel of a `redis+sentinel://` URL (with its connection once made), and the master's
/// name.
pub(crate) struct Sentinels {
    clients: Vec<(redis::Client, Option<MultiplexedConnection>)>,
    master: String,
}

impl Sentinels {
    /// Clients for `addrs` with the Sentinels' own credentials (`sentinel_username`, `sentinel_password`) and
    /// TLS settings.
    pub(crate) fn new(
        addrs: &[ConnectionAddr],
        master: &str,
        (user, password): (Option<&str>, Option<&str>),
        certificates: Option<redis::TlsCertificates>,
        protocol: redis::ProtocolVersion,
    ) -> RedisResult<Self> {
        let clients = addrs
            .iter()
            .map(|addr| {
                let mut settings = redis::RedisConnectionInfo::default().set_protocol(protocol);
                if let Some(u) = user {
                    settings = settings.set_username(u);
                }
                if let Some(p) = password {
                    settings = settings.set_password(p);
                }
                let info = addr.clone().into_connection_info()?.set_redis_settings(settings);
                let client = match &certificates {
                    Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
                    None => redis::Client::open(info),
                };
                client.map(|c| (c, None))
            })
            .collect::<RedisResult<_>>()?;
        Ok(Self { clients, master: master.to_owned() })
    }

    /// The Sentinels' addresses.
    pub(crate) fn addrs(&self) -> Vec<ConnectionAddr> {
        self.clients.iter().map(|(c, _)| c.get_connection_info().addr().clone()).collect()
    }

    /// The master's name.
    pub(crate) fn master(&self) -> &str {
        &self.master
    }

    /// The address (`host:port`) the first Sentinel that answers gives for the master, or `None` when none
    /// answered or none names one.
    pub(crate) async fn master_addr(&mut self) -> Option<String> {
        for (client, cached) in &mut self.clients {
            let cmd = redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg(&self.master).clone();
            if let Ok(Value::Array(parts)) = ask(client, cached, &cmd).await
                && let [host, port] = parts.as_slice()
            {
                let text = |v: &Value| match v {
                    Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                    Value::SimpleString(s) => Some(s.clone()),
                    _ => None,
                };
                if let (Some(host), Some(port)) = (text(host), text(port)) {
                    return Some(format!("{host}:{port}"));
                }
            }
        }
        None
    }

    /// Whether the Sentinels monitor a master of this name: `Some(false)` when every Sentinel that answered
    /// said it has no such master, `None` when none answered.
    pub(crate) async fn knows_master(&mut self) -> Option<bool> {
        let mut known = None;
        for (client, cached) in &mut self.clients {
            match ask(client, cached, redis::cmd("SENTINEL").arg("MASTER").arg(&self.master)).await {
                Ok(_) => return Some(true),
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) => {
                    known = Some(false)
                }
                Err(_) => {}
            }
        }
        known
    }

    /// The most replicas any Sentinel that answers lists for the master, down ones included (Sentinels may
    /// differ for a moment after a change; the larger view is the safe one). `None` when none answers.
    async fn count(&mut self) -> Option<u32> {
        let mut most = None;
        for (client, cached) in &mut self.clients {
            if let Ok(Value::Array(replicas)) =
                ask(client, cached, redis::cmd("SENTINEL").arg("REPLICAS").arg(&self.master)).await
            {
                let n = u32::try_from(replicas.len()).unwrap_or(u32::MAX);
                most = Some(most.map_or(n, |m: u32| m.max(n)));
            }
        }
        most
    }
}

/// `cmd` to one Sentinel within twice [`ASK_TIMEOUT`], on its `cached` connection or a new one. A connection
/// that answered, even with an error, is kept for the next question; one that failed is made anew.
async fn ask(
    client: &redis::Client,
    cached: &mut Option<MultiplexedConnection>,
    cmd: &redis::Cmd,
) -> RedisResult<Value> {
    let asked = async {
        let mut conn = match cached.take() {
            Some(c) => c,
            None => client.get_multiplexed_async_connection_with_config(&ask_config()).await?,
        };
        let r = cmd.query_async::<Value>(&mut conn).await;
        if r.as_ref().map_or_else(|e| matches!(e.kind(), redis::ErrorKind::Server(_)), |_| true) {
            *cached = Some(conn);
        }
        r
    };
    tokio::time::timeout(ASK_TIMEOUT * 2, asked)
        .await
        .unwrap_or_else(|_| Err(redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))))
}

/// One Sentinel's or node's connection: an answer within [`ASK_TIMEOUT`].
fn ask_config() -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(ASK_TIMEOUT))
        .set_response_timeout(Some(ASK_TIMEOUT))
}

/// Where the count comes from.
pub(crate) enum Source {
    /// One server: the replicas it has connected.
    Single,
    /// The Sentinels' list.
    Sentinel(Sentinels),
    /// The Cluster's node table, for the master serving `slot`.
    Cluster { slot: u16 },
}

/// The replicas counted, shared by the store's writes and the task that keeps the count.
#[derive(Clone)]
pub(crate) struct Topology {
    known: Arc<AtomicU32>,
}

impl Topology {
    /// Counts once now (a store that waits for every replica cannot write before it knows them), then keeps
    /// counting every [`EVERY`] on a task of its own, which ends when the returned value's last clone is dropped.
    /// `conn` reaches the master (Sentinel, one server) or any node (Cluster).
    pub(crate) async fn start(source: Source, conn: Conn, wait: Option<Wait>) -> RedisResult<Self> {
        let (mut source, mut conn) = (source, conn);
        let first = count(&mut source, &mut conn).await?;
        let topology = Self { known: Arc::new(AtomicU32::new(first)) };
        judge(first, None, wait);
        let mut master = match &mut source {
            Source::Sentinel(sentinels) => sentinels.master_addr().await,
            _ => None,
        };
        let weak = Arc::downgrade(&topology.known);
        // Only `wait_replicas=all` needs a fresh count; for the warning a slower one will do.
        let every = if wait.is_some_and(|w| w.replicas == Replicas::All) { EVERY } else { EVERY * 10 };
        tokio::spawn(async move {
            let mut last = first;
            loop {
                tokio::time::sleep(every).await;
                let Some(known) = weak.upgrade() else { return };
                // A count that failed keeps the last one: the replicas did not go away because a Sentinel
                // did not answer.
                if let Ok(n) = count(&mut source, &mut conn).await {
                    known.store(n, Ordering::Relaxed);
                    // Set at each count, not only on a change: a recorder installed after the first still shows it.
                    gauge(n, wait);
                    if n != last {
                        judge(n, Some(last), wait);
                        last = n;
                    }
                }
                // Said once per change: after a failover the only other trace is the requests that met the
                // old master's closed connection.
                if let Source::Sentinel(sentinels) = &mut source
                    && let Some(now) = sentinels.master_addr().await
                    && master.as_ref() != Some(&now)
                {
                    tracing::info!(
                        master = %now,
                        before = master.as_deref().unwrap_or("none"),
                        "the Sentinels name another master (a failover or switchover): writes go to it"
                    );
                    master = Some(now);
                }
            }
        });
        Ok(topology)
    }

    /// The replicas a write waits for under `wait`: the number asked for, or every replica known.
    pub(crate) fn waited(&self, wait: Wait) -> u32 {
        match wait.replicas {
            Replicas::Count(n) => n,
            Replicas::All => self.known.load(Ordering::Relaxed),
        }
    }
}

/// Logs the count, warns when writes are acknowledged without some replica (a failover to it can lose them),
/// and sets the `idem_store_replicas_unwaited` gauge to how many replicas a write does not wait for.
fn judge(known: u32, before: Option<u32>, wait: Option<Wait>) {
    let (waited, unwaited) = gauge(known, wait);
    match before {
        Some(before) => tracing::info!(replicas = known, before, waited, "the Redis master's replicas changed"),
        // Said at start-up whatever the setting, so the log shows what a write waits for from the first one.
        None if known > 0 || wait.is_some() => {
            tracing::info!(
                replicas = known,
                waited,
                "the Redis master has {known} replicas; a write waits for {waited}"
            )
        }
        None => {}
    }
    if let Some(Replicas::Count(n)) = wait.map(|w| w.replicas)
        && n > known
    {
        tracing::warn!(
            replicas = known,
            waited = n,
            "a write waits for {n} replicas (wait_replicas) and the Redis master has {known}: every write fails \
             with 503 until more replicas are attached; wait_replicas=all waits for the replicas there are"
        );
    }
    if unwaited > 0 && wait.is_none() {
        tracing::warn!(
            replicas = known,
            "the Redis master has {known} replicas and a write waits for none of them (no wait_replicas in the \
             URL): a failover to a replica that lacks a write loses it, a switchover with the old master alive \
             (SENTINEL FAILOVER, CLUSTER FAILOVER) included; wait_replicas=all waits for every replica"
        );
    } else if unwaited > 0 {
        tracing::warn!(
            replicas = known,
            waited,
            "the Redis master has {known} replicas and a write waits for {waited} (wait_replicas): a failover to a \
             replica that lacks a write loses it, a switchover with the old master alive (SENTINEL FAILOVER, \
             CLUSTER FAILOVER) included; wait_replicas=all waits for every replica"
        );
    }
}

/// Sets the `idem_store_replicas_unwaited` gauge for `known` replicas; the replicas a write waits for and
/// those it does not.
fn gauge(known: u32, wait: Option<Wait>) -> (u32, u32) {
    let waited = match wait.map(|w| w.replicas) {
        None => 0,
        Some(Replicas::Count(n)) => n,
        Some(Replicas::All) => known,
    };
    let unwaited = known.saturating_sub(waited);
    metrics::gauge!("idem_store_replicas_unwaited").set(f64::from(unwaited));
    (waited, unwaited)
}

/// The replicas of the master, by `source`.
async fn count(source: &mut Source, conn: &mut Conn) -> RedisResult<u32> {
    match source {
        Source::Single => connected(conn).await,
        Source::Sentinel(sentinels) => sentinels.count().await.ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "no Sentinel answered SENTINEL REPLICAS",
            ))
        }),
        Source::Cluster { slot } => {
            let nodes: String =
                tokio::time::timeout(ASK_TIMEOUT * 2, redis::cmd("CLUSTER").arg("NODES").query_async(conn))
                    .await
                    .map_err(|_| redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)))??;
            Ok(cluster_replicas(&nodes, *slot))
        }
    }
}

/// `connected_slaves` of the master's `INFO replication`.
async fn connected<C: ConnectionLike>(conn: &mut C) -> RedisResult<u32> {
    let info: String = tokio::time::timeout(ASK_TIMEOUT * 2, redis::cmd("INFO").arg("replication").query_async(conn))
        .await
        .map_err(|_| redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)))??;
    Ok(info.lines().find_map(|l| l.trim().strip_prefix("connected_slaves:")).and_then(|n| n.parse().ok()).unwrap_or(0))
}

/// The replicas `CLUSTER NODES` lists for the master that serves `slot`, failed ones included. 0 when no
/// master serves it (mid-failover: the next count finds the new one).
fn cluster_replicas(nodes: &str, slot: u16) -> u32 {
    // <id> <ip:port@bus> <flags> <master id or -> <ping> <pong> <epoch> <link> <slot ranges…>
    let rows: Vec<Vec<&str>> =
        nodes.lines().map(|l| l.split_whitespace().collect()).filter(|f: &Vec<&str>| f.len() >= 8).collect();
    let serves = |f: &Vec<&str>| {
        f.iter().skip(8).any(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
        })
    };
    let Some(master) = rows.iter().find(|f| f[2].contains("master") && serves(f)).map(|f| f[0]) else {
        return 0;
    };
    let n = rows.iter().filter(|f| f[3] == master).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_replicas_are_those_of_the_slots_master_failed_ones_included() {
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
a2 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
r1 127.0.0.1:7003@17003 slave a1 0 0 1 connected
r2 127.0.0.1:7004@17004 slave,fail? a1 0 0 1 disconnected
r3 127.0.0.1:7005@17005 slave a2 0 0 2 connected
r4 127.0.0.1:7007@17007 slave,fail a1 0 0 1 disconnected
old 127.0.0.1:7006@17006 master,fail - 0 0 0 disconnected
";
        assert_eq!(cluster_replicas(nodes, 0), 3);
        assert_eq!(cluster_replicas(nodes, 5460), 3);
        assert_eq!(cluster_replicas(nodes, 6000), 1);
        assert_eq!(cluster_replicas(nodes, 16000), 0);
    }
}
