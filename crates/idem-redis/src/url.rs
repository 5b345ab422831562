//! Redis URLs: one server (`redis://`, `rediss://`), a master found through Sentinels (`redis+sentinel://`,
//! `rediss+sentinel://`) and a Cluster (`redis+cluster://`, `rediss+cluster://`), with idem's own query
//! parameters (`cacert`, `wait_replicas`, `wait_timeout_ms`, `sentinel_username`, `sentinel_password`) taken out
//! before the redis crate sees the rest.

use std::time::Duration;

use percent_encoding::percent_decode_str;

use crate::Error;
use crate::topology::{Replicas, Wait};

/// The default Sentinel port (`redis-sentinel`'s).
const SENTINEL_PORT: u16 = 26379;
/// The default Redis port.
const REDIS_PORT: u16 = 6379;
/// How long `WAIT` may block when `wait_replicas` is given without `wait_timeout_ms`.
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the store's data lives, parsed from its URL.
pub(crate) enum Target {
    /// One server: the redis crate's client for it.
    Single(redis::Client),
    /// A master named by Sentinels, the database number, and a client for each Sentinel (asked for the
    /// master's replicas) with the master's name.
    Sentinel(Box<redis::sentinel::SentinelClientBuilder>, i64, crate::topology::Sentinels),
    /// A Cluster, from its seed nodes.
    Cluster(ClusterSpec),
}

/// What a Cluster client is built from; [`ClusterSpec::builder`] makes as many builders as needed (the
/// store keeps two clients, one that retries and one that does not).
pub(crate) struct ClusterSpec {
    nodes: Vec<redis::ConnectionInfo>,
    user: Option<String>,
    password: Option<String>,
    tls_mode: Option<redis::TlsMode>,
    certs: Option<redis::TlsCertificates>,
    protocol: redis::ProtocolVersion,
}

impl ClusterSpec {
    /// The seed nodes' addresses.
    pub(crate) fn addrs(&self) -> Vec<redis::ConnectionAddr> {
        self.nodes.iter().map(|n| n.addr().clone()).collect()
    }

    pub(crate) fn builder(&self) -> redis::cluster::ClusterClientBuilder {
        let mut b = redis::cluster::ClusterClientBuilder::new(self.nodes.clone()).use_protocol(self.protocol);
        if let Some(u) = &self.user {
            b = b.username(u);
        }
        if let Some(p) = &self.password {
            b = b.password(p);
        }
        if let Some(mode) = self.tls_mode {
            b = b.tls(mode);
            if let Some(certs) = &self.certs {
                b = b.certs(certs.clone());
            }
        }
        b
    }
}

/// A parsed URL.
pub(crate) struct Parsed {
    pub(crate) target: Target,
    pub(crate) tls: bool,
    pub(crate) wait: Option<Wait>,
}

/// Splits `host:port,host:port` (IPv6 in brackets) into pairs, `default` where a port is missing.
fn hosts(list: &str, default: u16) -> Result<Vec<(String, u16)>, Error> {
    list.split(',')
        .map(|h| {
            let bad = || Error::InvalidHost(h.to_owned());
            let (host, port) = match h.strip_prefix('[') {
                Some(v6) => {
                    let (host, after) = v6.split_once(']').ok_or_else(bad)?;
                    (host, after.strip_prefix(':'))
                }
                None => match h.rsplit_once(':') {
                    Some((host, port)) => (host, Some(port)),
                    None => (h, None),
                },
            };
            let port = match port {
                Some(p) => p.parse::<u16>().map_err(|_| bad())?,
                None => default,
            };
            if host.is_empty() {
                return Err(bad());
            }
            Ok((host.to_owned(), port))
        })
        .collect()
}

/// The user and password of `user:password@` (percent-decoded), either empty when absent.
fn userinfo(info: Option<&str>) -> (Option<String>, Option<String>) {
    let decode = |s: &str| percent_decode_str(s).decode_utf8_lossy().into_owned();
    match info {
        None => (None, None),
        Some(info) => match info.split_once(':') {
            Some((u, p)) => ((!u.is_empty()).then(|| decode(u)), (!p.is_empty()).then(|| decode(p))),
            None => ((!info.is_empty()).then(|| decode(info)), None),
        },
    }
}

/// Parses `url`.
///
/// # Errors
/// [`Error::Insecure`], [`Error::UnknownParameter`], [`Error::InvalidParameter`], [`Error::CaCert`],
/// [`Error::CaCertWithoutTls`], [`Error::InvalidHost`], [`Error::NoMasterName`], [`Error::InvalidUrl`].
pub(crate) fn parse(url: &str) -> Result<Parsed, Error> {
    // The redis crate's build picks rustls's process-wide provider; name ring (the only one compiled in) so
    // that holds even if another crate ever brings a second provider. Already set is fine.
    idem_tls::install_default_provider();
    let (without_fragment, fragment) = match url.split_once('#') {
        Some((u, f)) => (u, Some(f)),
        None => (url, None),
    };
    // `#insecure` is the redis crate's switch for unverified TLS; idem has none.
    if fragment == Some("insecure") {
        return Err(Error::Insecure);
    }
    let (scheme, _) = without_fragment.split_once("://").unwrap_or(("", ""));
    let (kind, tls) = scheme_kind(url, scheme)?;
    let (base, query) = without_fragment.split_once('?').unwrap_or((without_fragment, ""));
    let query = Query::parse(query, kind)?;
    let root_cert = read_cacert(query.cacert.clone(), tls)?;
    let certificates = || redis::TlsCertificates { client_tls: None, root_cert: root_cert.clone() };
    let protocol = match query.rest.iter().find(|(p, _)| p.starts_with("protocol")).map(|(_, v)| v.as_str()) {
        None | Some("resp2") => redis::ProtocolVersion::RESP2,
        Some("resp3") => redis::ProtocolVersion::RESP3,
        Some(_) => return Err(Error::InvalidParameter { name: "protocol".into(), why: "resp2 or resp3" }),
    };
    let target = match kind {
        Kind::Single => {
            let kept: Vec<&str> = query.rest.iter().map(|(p, _)| *p).collect();
            let fragment = fragment.map(|f| format!("#{f}")).unwrap_or_default();
            let url = if kept.is_empty() {
                format!("{base}{fragment}")
            } else {
                format!("{base}?{}{fragment}", kept.join("&"))
            };
            let client = match &root_cert {
                None => redis::Client::open(url.as_str()),
                Some(_) => redis::Client::build_with_tls(url.as_str(), certificates()),
            };
            Target::Single(client.map_err(Error::InvalidUrl)?)
        }
        Kind::Sentinel | Kind::Cluster => {
            if let Some(f) = fragment {
                return Err(Error::UnknownParameter(format!("#{f}")));
            }
            let rest_of_url = &base[scheme.len() + 3..];
            let (authority, path) = rest_of_url.split_once('/').unwrap_or((rest_of_url, ""));
            let (info, host_list) = match authority.rsplit_once('@') {
                Some((info, hosts)) => (Some(info), hosts),
                None => (None, authority),
            };
            let (user, password) = userinfo(info);
            let tls_mode = tls.then_some(redis::TlsMode::Secure);
            let addr = |(host, port): (String, u16)| match tls {
                true => redis::ConnectionAddr::TcpTls { host, port, insecure: false, tls_params: None },
                false => redis::ConnectionAddr::Tcp(host, port),
            };
            let certs = root_cert.as_ref().map(|_| certificates());
            if kind == Kind::Sentinel {
                let sentinels: Vec<_> = hosts(host_list, SENTINEL_PORT)?.into_iter().map(addr).collect();
                let auth = SentinelAuth {
                    user,
                    password,
                    sentinel_user: query.sentinel_user,
                    sentinel_password: query.sentinel_password,
                };
                sentinel_target(sentinels, path, auth, tls_mode, certs, protocol)?
            } else {
                if !path.is_empty() {
                    // A Cluster has database 0 only.
                    return Err(Error::InvalidHost(format!("/{path}: a Redis Cluster has no database numbers")));
                }
                let nodes: Vec<redis::ConnectionInfo> = hosts(host_list, REDIS_PORT)?
                    .into_iter()
                    .map(|h| redis::IntoConnectionInfo::into_connection_info(addr(h)))
                    .collect::<Result<_, _>>()
                    .map_err(Error::InvalidUrl)?;
                Target::Cluster(ClusterSpec { nodes, user, password, tls_mode, certs, protocol })
            }
        }
    };
    Ok(Parsed { target, tls, wait: query.wait })
}

/// The kind of deployment and whether it speaks TLS, from the URL's scheme.
fn scheme_kind(url: &str, scheme: &str) -> Result<(Kind, bool), Error> {
    Ok(match scheme {
        "redis" | "valkey" => (Kind::Single, false),
        "rediss" | "valkeys" => (Kind::Single, true),
        "redis+sentinel" => (Kind::Sentinel, false),
        "rediss+sentinel" => (Kind::Sentinel, true),
        "redis+cluster" => (Kind::Cluster, false),
        "rediss+cluster" => (Kind::Cluster, true),
        // The redis crate names what it does not know; what it knows beyond these (`unix:`) idem does not take.
        _ => {
            let e = redis::Client::open(url).err().unwrap_or_else(|| {
                redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "idem takes redis://, rediss://, redis+sentinel://, rediss+sentinel://, redis+cluster:// and \
                     rediss+cluster:// URLs",
                ))
            });
            return Err(Error::InvalidUrl(e));
        }
    })
}

/// The query parameters: idem's own taken out, the redis crate's (`protocol`) kept in `rest`.
struct Query<'a> {
    cacert: Option<String>,
    wait: Option<Wait>,
    sentinel_user: Option<String>,
    sentinel_password: Option<String>,
    /// `(param as written, decoded value)`.
    rest: Vec<(&'a str, String)>,
}

impl<'a> Query<'a> {
    fn parse(query: &'a str, kind: Kind) -> Result<Self, Error> {
        let mut q = Query { cacert: None, wait: None, sentinel_user: None, sentinel_password: None, rest: Vec::new() };
        let (mut replicas, mut timeout) = (None, None);
        let mut seen = Vec::new();
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = param.split_once('=').unwrap_or((param, ""));
            // Judged decoded, as reported: `c%61cert` is `cacert`.
            let name = percent_decode_str(name).decode_utf8_lossy();
            let value = percent_decode_str(value).decode_utf8_lossy().into_owned();
            let invalid = |why: &'static str| Error::InvalidParameter { name: name.clone().into_owned(), why };
            match name.as_ref() {
                "cacert" => q.cacert = Some(value),
                // Given twice, which one applies would be a guess: refused.
                "wait_replicas" | "wait_timeout_ms" if seen.contains(&name) => {
                    return Err(invalid("a single value (it was given twice)"));
                }
                "wait_replicas" => {
                    seen.push(name.clone());
                    replicas = Some(match value.as_str() {
                        "all" if kind == Kind::Single => {
                            return Err(invalid(
                                "a number of replicas on a redis:// URL (all needs redis+sentinel:// or \
                                 redis+cluster://, whose Sentinels or Cluster know every replica)",
                            ));
                        }
                        "all" => Replicas::All,
                        n => match n.parse::<u32>() {
                            Ok(n) => Replicas::Count(n),
                            Err(_) => return Err(invalid("all, or a number of replicas, 0 or more")),
                        },
                    });
                }
                "wait_timeout_ms" => {
                    seen.push(name.clone());
                    let ms = value.parse::<u64>().ok().filter(|ms| *ms > 0);
                    timeout = Some(Duration::from_millis(ms.ok_or_else(|| invalid("milliseconds, 1 or more"))?));
                }
                "sentinel_username" if kind == Kind::Sentinel => q.sentinel_user = Some(value),
                "sentinel_password" if kind == Kind::Sentinel => q.sentinel_password = Some(value),
                // The only one the redis crate reads from a TCP URL's query; `db`, `user` and `pass` it reads for
                // `redis+unix:` only, which idem does not take, and ignores here.
                "protocol" => q.rest.push((param, value)),
                _ => return Err(Error::UnknownParameter(name.into_owned())),
            }
        }
        if timeout.is_some() && replicas.is_none() {
            return Err(Error::InvalidParameter { name: "wait_timeout_ms".into(), why: "needs wait_replicas" });
        }
        q.wait = replicas
            .filter(|r| *r != Replicas::Count(0))
            .map(|replicas| Wait { replicas, timeout: timeout.unwrap_or(DEFAULT_WAIT_TIMEOUT) });
        Ok(q)
    }
}

/// The PEM bytes of `cacert=PATH`, checked now (a clear error at start-up, not a failed handshake later).
fn read_cacert(cacert: Option<String>, tls: bool) -> Result<Option<Vec<u8>>, Error> {
    match cacert {
        None => Ok(None),
        Some(_) if !tls => Err(Error::CaCertWithoutTls),
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            idem_tls::read_roots("cacert", &path).map_err(Error::CaCert)?;
            // The redis crate wants the PEM bytes.
            Ok(Some(std::fs::read(&path).map_err(|source| {
                Error::CaCert(idem_tls::Error::Read { flag: "cacert".into(), path: path.clone(), source })
            })?))
        }
    }
}

/// The credentials of a Sentinel URL: the userinfo for the master, the parameters for the Sentinels.
struct SentinelAuth {
    user: Option<String>,
    password: Option<String>,
    sentinel_user: Option<String>,
    sentinel_password: Option<String>,
}

/// The redis crate's Sentinel client for `path` (`/master[/db]`) and idem's own view of the Sentinels.
fn sentinel_target(
    sentinels: Vec<redis::ConnectionAddr>,
    path: &str,
    auth: SentinelAuth,
    tls_mode: Option<redis::TlsMode>,
    certs: Option<redis::TlsCertificates>,
    protocol: redis::ProtocolVersion,
) -> Result<Target, Error> {
    let mut segments = path.split('/').filter(|s| !s.is_empty());
    let master = segments.next().ok_or(Error::NoMasterName)?;
    let master = percent_decode_str(master).decode_utf8_lossy().into_owned();
    let db = match segments.next() {
        None => 0,
        Some(db) => db.parse::<i64>().map_err(|_| Error::InvalidHost(format!("/{db}")))?,
    };
    let topology = crate::topology::Sentinels::new(
        &sentinels,
        &master,
        (auth.sentinel_user.as_deref(), auth.sentinel_password.as_deref()),
        certs.clone(),
        protocol,
    )
    .map_err(Error::InvalidUrl)?;
    let mut b =
        redis::sentinel::SentinelClientBuilder::new(sentinels, master, redis::sentinel::SentinelServerType::Master)
            .map_err(Error::InvalidUrl)?
            .set_client_to_redis_db(db)
            .set_client_to_redis_protocol(protocol);
    if let Some(u) = auth.user {
        b = b.set_client_to_redis_username(u);
    }
    if let Some(p) = auth.password {
        b = b.set_client_to_redis_password(p);
    }
    if let Some(u) = auth.sentinel_user {
        b = b.set_client_to_sentinel_username(u);
    }
    if let Some(p) = auth.sentinel_password {
        b = b.set_client_to_sentinel_password(p);
    }
    if let Some(mode) = tls_mode {
        b = b.set_client_to_redis_tls_mode(mode).set_client_to_sentinel_tls_mode(mode);
        if let Some(certs) = certs {
            b = b.set_client_to_redis_certificates(certs.clone()).set_client_to_sentinel_certificates(certs);
        }
    }
    Ok(Target::Sentinel(Box::new(b), db, topology))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Single,
    Sentinel,
    Cluster,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn host_lists_take_default_ports_and_brackets() {
        assert_eq!(
            hosts("a:1,b,[::1]:3,[::2]", 9).unwrap(),
            vec![("a".into(), 1), ("b".into(), 9), ("::1".into(), 3), ("::2".into(), 9)]
        );
        assert!(matches!(hosts("a:x", 9), Err(Error::InvalidHost(h)) if h == "a:x"));
        assert!(matches!(hosts("a,,b", 9), Err(Error::InvalidHost(_))));
    }

    #[test]
    fn wait_parameters_are_checked() {
        let p = parse("redis://h:1?wait_replicas=1").unwrap();
        assert_eq!(p.wait, Some(Wait { replicas: Replicas::Count(1), timeout: DEFAULT_WAIT_TIMEOUT }));
        let p = parse("redis+cluster://h:1,h:2?wait_replicas=2&wait_timeout_ms=250").unwrap();
        assert_eq!(p.wait, Some(Wait { replicas: Replicas::Count(2), timeout: Duration::from_millis(250) }));
        assert_eq!(parse("redis://h:1?wait_replicas=0").unwrap().wait, None);
        let p = parse("redis+sentinel://s:1/m?wait_replicas=all").unwrap();
        assert_eq!(p.wait, Some(Wait { replicas: Replicas::All, timeout: DEFAULT_WAIT_TIMEOUT }));
        assert_eq!(
            parse("redis+cluster://h:1?wait_replicas=all").unwrap().wait.map(|w| w.replicas),
            Some(Replicas::All)
        );
        for (url, name) in [
            ("redis://h:1?wait_replicas=-1", "wait_replicas"),
            ("redis://h:1?wait_replicas=all", "wait_replicas"),
            ("redis+sentinel://s:1/m?wait_replicas=every", "wait_replicas"),
            ("redis+cluster://h:1?wait_replicas=1&wait_replicas=2", "wait_replicas"),
            ("redis+cluster://h:1?wait_replicas=1&wait_timeout_ms=5&wait_timeout_ms=6", "wait_timeout_ms"),
            ("redis://h:1?wait_replicas=1&wait_timeout_ms=0", "wait_timeout_ms"),
            ("redis://h:1?wait_timeout_ms=5", "wait_timeout_ms"),
        ] {
            assert!(matches!(parse(url), Err(Error::InvalidParameter { name: n, .. }) if n == name), "{url}");
        }
    }

    #[test]
    fn sentinel_and_cluster_urls_parse() {
        let p = parse("redis+sentinel://:pw@s1:1,s2/mymaster/2?sentinel_password=x").unwrap();
        assert!(matches!(p.target, Target::Sentinel(_, 2, _)) && !p.tls);
        assert!(parse("rediss+sentinel://s1/m").unwrap().tls);
        assert!(matches!(parse("redis+sentinel://s1:1"), Err(Error::NoMasterName)));
        assert!(matches!(parse("redis+cluster://a:1,b:2").unwrap().target, Target::Cluster(_)));
        // A Sentinel's password parameter means nothing to a Cluster.
        let e = parse("redis+cluster://a:1?sentinel_password=x").err().unwrap();
        assert!(matches!(e, Error::UnknownParameter(n) if n == "sentinel_password"));
        assert!(matches!(parse("redis+cluster://a:1/3"), Err(Error::InvalidHost(_))));
    }
}
