//! Connections for a multi-host URL (`postgres://h1:5432,h2:5432/db`), one host at a time, each attempt bounded
//! whole by `connect_timeout`.
//!
//! tokio-postgres tries the hosts in order too, but its `connect_timeout` bounds only the TCP connect: a host
//! that accepts the connection and never answers the start-up (a frozen machine, a SIGSTOPped postmaster, a
//! network that drops packets after the handshake) holds the attempt until the pool gives up, and the next host
//! is never tried (review finding: a failover to the standby never happened while the old primary hung). Here
//! each host gets a configuration of its own and the whole attempt (connect, TLS, start-up, the read-write
//! check) its own timeout, as libpq's `connect_timeout` does.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use deadpool_postgres::Connect;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

/// Tries each host's configuration in turn, each within `per_host`.
pub(crate) struct PerHost {
    pub(crate) hosts: Vec<Config>,
    pub(crate) tls: MakeRustlsConnect,
    pub(crate) per_host: Duration,
}

impl Connect for PerHost {
    fn connect(
        &self,
        _all: &Config,
    ) -> Pin<Box<dyn Future<Output = Result<(Client, JoinHandle<()>), tokio_postgres::Error>> + Send + '_>> {
        Box::pin(async move {
            let mut last = None;
            for config in &self.hosts {
                match tokio::time::timeout(self.per_host, config.connect(self.tls.clone())).await {
                    Ok(Ok((client, connection))) => {
                        let task = tokio::spawn(async move {
                            if let Err(e) = connection.await {
                                tracing::warn!(error = %idem_store::error_chain(&e), "PostgreSQL connection ended");
                            }
                        });
                        return Ok((client, task));
                    }
                    Ok(Err(e)) => last = Some(e),
                    Err(_) => tracing::warn!(
                        host = ?config.get_hosts().first(),
                        port = ?config.get_ports().first(),
                        "no answer from this PostgreSQL host within connect_timeout; trying the next"
                    ),
                }
            }
            match last {
                Some(e) => Err(e),
                // Every host timed out: the pool's create timeout (per host times hosts) ends the wait and says
                // so (`Error::ConnectTimeout`); tokio-postgres has no public constructor for a timeout error.
                None => std::future::pending().await,
            }
        })
    }
}

/// The URL once per host, when `url` is a `postgres://` URL naming several: the same user, database and
/// parameters with one host (and its port) each. `None` for one host or the `key=value` form (tokio-postgres's
/// own order then applies).
pub(crate) fn per_host_urls(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<&str> = hosts.split(',').collect();
    if hosts.len() < 2 || hosts.iter().any(|h| h.is_empty()) {
        return None;
    }
    Some(hosts.iter().map(|host| format!("{scheme}://{userinfo}{host}{tail}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_host_url_is_split_per_host() {
        assert_eq!(
            per_host_urls("postgres://u:p@h1:5432,h2:5433/db?connect_timeout=2").unwrap(),
            ["postgres://u:p@h1:5432/db?connect_timeout=2", "postgres://u:p@h2:5433/db?connect_timeout=2"]
        );
        assert_eq!(
            per_host_urls("postgresql://h1,[::1]:5/db").unwrap(),
            ["postgresql://h1/db", "postgresql://[::1]:5/db"]
        );
        assert_eq!(per_host_urls("postgres://h1,h2").unwrap(), ["postgres://h1", "postgres://h2"]);
        assert!(per_host_urls("postgres://u@h1:5432/db").is_none());
        assert!(per_host_urls("host=h1,h2 dbname=db").is_none());
        assert!(per_host_urls("postgres://h1,/db").is_none(), "an empty host is left to the parser's error");
    }
}
