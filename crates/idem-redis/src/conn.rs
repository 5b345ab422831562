//! The connection a store sends its commands on, whichever way the URL reaches Redis: one server through the
//! redis crate's auto-reconnecting [`ConnectionManager`], a Cluster through its cluster client (which follows
//! `MOVED`/`ASK` redirections and learns the new slot map after a failover), or the master a Sentinel names.

use std::sync::Arc;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisFuture, Value};

/// One of the three; cheap to clone (clones share the connections).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Sentinel(SentinelConn),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The master a Sentinel names, connected on first use and asked for again after a connection error or a
/// `READONLY` answer (the node was demoted to a replica): the failing request gets the error (503 upstream),
/// the next one connects to whichever master the Sentinels name then. The redis crate's Sentinel client
/// finds the master (and checks its `ROLE`) but does not reconnect by itself.
#[derive(Clone)]
pub(crate) struct SentinelConn {
    shared: Arc<SentinelShared>,
}

struct SentinelShared {
    client: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
    db: i64,
    /// The connection in use and its number, so a failure drops only the connection that failed, not a newer
    /// one another request already made.
    current: std::sync::Mutex<(u64, Option<MultiplexedConnection>)>,
}

/// Whether `e` says the connection should be dropped and the master asked for again.
fn lost_master(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

impl SentinelConn {
    /// Connects to the master `client` finds, now (so start-up fails when there is none).
    pub(crate) async fn connect(
        mut client: SentinelClient,
        config: AsyncConnectionConfig,
        db: i64,
    ) -> redis::RedisResult<Self> {
        let conn = client.get_async_connection_with_config(&config).await?;
        let shared = SentinelShared {
            client: tokio::sync::Mutex::new(client),
            config,
            db,
            current: std::sync::Mutex::new((0, Some(conn))),
        };
        Ok(Self { shared: Arc::new(shared) })
    }

    async fn get(&self) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        if let (n, Some(c)) = &*self.lock() {
            return Ok((*n, c.clone()));
        }
        // One request at a time asks the Sentinels; the others wait and take its connection.
        let mut client = self.shared.client.lock().await;
        if let (n, Some(c)) = &*self.lock() {
            return Ok((*n, c.clone()));
        }
        let conn = client.get_async_connection_with_config(&self.shared.config).await?;
        let mut current = self.lock();
        current.0 += 1;
        current.1 = Some(conn.clone());
        Ok((current.0, conn))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Option<MultiplexedConnection>)> {
        self.shared.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self, n: u64, e: &redis::RedisError) {
        if lost_master(e) {
            let mut current = self.lock();
            if current.0 == n {
                current.1 = None;
            }
        }
    }
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (n, mut c) = self.get().await?;
            let r = c.req_packed_command(cmd).await;
            if let Err(e) = &r {
                self.failed(n, e);
            }
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (n, mut c) = self.get().await?;
            let r = c.req_packed_commands(pipeline, offset, count).await;
            if let Err(e) = &r {
                self.failed(n, e);
            }
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}
