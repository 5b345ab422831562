//! The store's commands on the wire: a write sent once (with `WAIT` in its pipeline under `wait_replicas`), a
//! read on the read connection (confirmed like a write under `wait_replicas`), and a Cluster's refusals that
//! ran nothing followed where they point.

use std::time::Duration;

use idem_store::Error as StoreError;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::{Cmd, Script, Value};

use super::{RedisStore, int, unexpected};
use crate::conn::Conn;
use crate::error::{ReplicasMissing, ran_nothing, redis_err};

/// What [`RedisStore::send`] sends: a write, or a read confirmed by a write to the barrier key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sent {
    Write,
    Read,
}

/// How often a write refused by a Cluster without running is sent again (50 ms, 100 ms, … apart: 2.75 s in all).
const REFUSALS: u64 = 10;

impl RedisStore {
    /// Runs the write `cmd` (an `EVALSHA` of `script` from [`evalsha`](super::evalsha)), loading the script first where the
    /// server does not know it (a new master after a failover has an empty script cache). With `wait_replicas`
    /// the `WAIT` goes in the same pipeline, on the same connection, so it counts the replicas that have this
    /// write: fewer than asked for within the timeout is an error, not a success.
    pub(super) async fn write(&self, script: &Script, cmd: &Cmd) -> Result<Value, StoreError> {
        self.send(script, cmd, Sent::Write).await
    }

    /// Runs the read `cmd` (an `EVALSHA` of `script`). Under `wait_replicas` a read is confirmed as a write is:
    /// a write to the store's barrier key (`INCR`) follows it in the pipeline, then `WAIT`, so the replicas have
    /// everything the master held when it read, and a read never returns a write the replicas lack (one that
    /// got 503 for want of replicas stays on the master until a switchover discards it: a reader shown it
    /// would see a value that then vanishes). Without `wait_replicas`, one command on the read connection.
    pub(super) async fn read(&self, script: &Script, cmd: &Cmd) -> Result<Value, StoreError> {
        if self.inner.wait.is_some_and(|w| self.inner.topology.waited(w) > 0) {
            return self.send(script, cmd, Sent::Read).await;
        }
        match cmd.query_async::<Value>(&mut self.conn()).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(&mut self.conn()).await.map_err(redis_err)?;
                cmd.query_async::<Value>(&mut self.conn()).await.map_err(redis_err)
            }
            other => other.map_err(redis_err),
        }
    }

    async fn send(&self, script: &Script, cmd: &Cmd, sent: Sent) -> Result<Value, StoreError> {
        let mut conn = self.writes();
        let mut loaded = false;
        let mut refusals = 0;
        let mut redirect: Redirect = None;
        loop {
            let asking = redirect.as_ref().is_some_and(|(_, _, ask)| *ask);
            // Read at each send: a replica added or a failover since the last try changes it.
            let wait = self.inner.wait.map(|w| (w, self.inner.topology.waited(w))).filter(|(_, n)| *n > 0);
            if sent == Sent::Write && wait.is_none() && redirect.is_none() {
                // The write alone: sent as one command, not a pipeline of one (a pipeline's encoding and reply
                // handling cost a first execution on Redis about 8% more instructions). The same connection,
                // sent once, the same errors.
                match cmd.query_async::<Value>(&mut conn).await {
                    Err(e) if !loaded && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                        script.load_async(&mut conn).await.map_err(redis_err)?;
                        loaded = true;
                        continue;
                    }
                    Err(e) if refusals < REFUSALS && ran_nothing(&e) => {
                        refusals += 1;
                        self.refused(&mut conn, &e, refusals, &mut redirect).await;
                        continue;
                    }
                    other => return other.map_err(redis_err),
                }
            }
            let mut p = redis::pipe();
            if asking {
                p.cmd("ASKING");
            }
            p.add_command(cmd.clone());
            if sent == Sent::Read {
                p.cmd("INCR").arg(format!("{}barrier", self.inner.prefix));
            }
            if let Some((w, n)) = wait {
                p.cmd("WAIT").arg(n).arg(u64::try_from(w.timeout.as_millis()).unwrap_or(u64::MAX));
            }
            let replies = match (&redirect, &mut conn) {
                (Some((host, port, _)), Conn::Cluster(c)) => {
                    let count = p.cmd_iter().count();
                    let route = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port };
                    c.route_pipeline(p, 0, count, route).await
                }
                _ => p.query_async::<Vec<Value>>(&mut conn).await,
            }
            .and_then(|v| Value::Array(v).extract_error());
            match replies {
                Err(e) if !loaded && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    script.load_async(&mut conn).await.map_err(redis_err)?;
                    loaded = true;
                }
                // Only a Cluster answers these, and they ran nothing: the slot moved or is moving (sent again
                // where the answer says, as the client library would), or a failover is in progress (sent
                // again shortly; the client has begun refreshing its slot map).
                Err(e) if refusals < REFUSALS && ran_nothing(&e) => {
                    refusals += 1;
                    self.refused(&mut conn, &e, refusals, &mut redirect).await;
                }
                Err(e) => return Err(redis_err(e)),
                Ok(Value::Array(replies)) => {
                    let mut replies = replies.into_iter().skip(usize::from(asking));
                    let reply = replies.next().ok_or_else(|| unexpected("no reply to a write"))?;
                    if sent == Sent::Read {
                        replies.next().ok_or_else(|| unexpected("no reply to the read barrier"))?;
                    }
                    if let Some((w, wanted)) = wait {
                        let acked = int(&replies.next().ok_or_else(|| unexpected("no reply to WAIT"))?)?;
                        if acked < i64::from(wanted) {
                            return Err(StoreError::unavailable(ReplicasMissing { wanted, acked, timeout: w.timeout }));
                        }
                    }
                    return Ok(reply);
                }
                Ok(other) => return Err(unexpected(&format!("{other:?} where pipeline replies were expected"))),
            }
        }
    }

    /// After a refusal that ran nothing (a Cluster's `MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, the
    /// `refusals`th in a row): where to send the write again (`redirect`), or a pause before it is; a fresh
    /// connection when the slot map is stale.
    async fn refused(&self, conn: &mut Conn, e: &redis::RedisError, refusals: u64, redirect: &mut Redirect) {
        let stale = e.kind() == redis::ErrorKind::ClusterConnectionNotFound || refusals > 2;
        if let (true, Some(client)) = (stale, &self.inner.cluster_writes) {
            // The slot map names a node this connection never reached, or keeps sending us to the wrong one: a
            // fresh connection reads the map anew.
            if let Ok(fresh) = client.get_async_connection().await {
                *conn = Conn::Cluster(fresh);
                *self.inner.writes.lock().unwrap_or_else(|e| e.into_inner()) = conn.clone();
            }
        }
        *redirect = e.redirect_node().and_then(|(addr, _slot)| {
            let (host, port) = addr.rsplit_once(':')?;
            let ask = e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask);
            Some((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port.parse().ok()?, ask))
        });
        if redirect.is_none() {
            tokio::time::sleep(Duration::from_millis(50 * refusals)).await;
        }
    }
}

/// Where a Cluster said a write's slot is (`MOVED`) or is moving to (`ASK`: the bool), if it did.
type Redirect = Option<(String, u16, bool)>;
