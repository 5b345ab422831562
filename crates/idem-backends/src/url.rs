//! [`StoreUrl`]: a store URL parsed by scheme.

use std::path::PathBuf;

use idem_core::redact_url as redact;

use crate::Error;

/// A parsed store URL; [`StoreUrl::redacted`] is the form to print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory:`.
    Memory,
    /// `sqlite:PATH`: the file.
    Sqlite(PathBuf),
    /// `postgres://…`, as given (the backend reads its parameters).
    Postgres(String),
    /// `redis://…`, `rediss://…`, or a Sentinel (`redis+sentinel://…`, `rediss+sentinel://…`) or Cluster
    /// (`redis+cluster://…`, `rediss+cluster://…`) URL, as given.
    Redis(String),
}

impl StoreUrl {
    /// Parses `url` by its scheme; the rest is the backend's to judge when it opens.
    ///
    /// # Errors
    /// [`Error::UnknownScheme`], [`Error::NoPath`] (names the URL with passwords hidden).
    pub fn parse(url: &str) -> Result<Self, Error> {
        if url == "memory:" || url == "memory://" {
            return Ok(StoreUrl::Memory);
        }
        if let Some(path) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
            if path.is_empty() {
                return Err(Error::NoPath(url.to_owned()));
            }
            return Ok(StoreUrl::Sqlite(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(StoreUrl::Postgres(url.to_owned()));
        }
        const REDIS: &[&str] = &[
            "redis://",
            "rediss://",
            "redis+sentinel://",
            "rediss+sentinel://",
            "redis+cluster://",
            "rediss+cluster://",
        ];
        if REDIS.iter().any(|scheme| url.starts_with(scheme)) {
            return Ok(StoreUrl::Redis(url.to_owned()));
        }
        Err(Error::UnknownScheme(redact(url)))
    }

    /// Whether the store is this process's alone (`sqlite:`, whose lock file keeps other processes out, and
    /// `memory:`), so nothing else changes its records.
    pub fn is_exclusive(&self) -> bool {
        matches!(self, StoreUrl::Memory | StoreUrl::Sqlite(_))
    }

    /// The URL with passwords hidden, for messages.
    pub fn redacted(&self) -> String {
        match self {
            StoreUrl::Memory => "memory:".to_owned(),
            StoreUrl::Sqlite(path) => format!("sqlite:{}", path.display()),
            StoreUrl::Postgres(url) | StoreUrl::Redis(url) => redact(url),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn urls_parse_by_scheme_and_print_without_passwords() {
        assert_eq!(StoreUrl::parse("memory:").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("sqlite:a/b.db").unwrap(), StoreUrl::Sqlite("a/b.db".into()));
        assert_eq!(StoreUrl::parse("sqlite:///tmp/x.db").unwrap(), StoreUrl::Sqlite("/tmp/x.db".into()));
        assert!(StoreUrl::parse("sqlite:x").unwrap().is_exclusive());
        let pg = StoreUrl::parse("postgres://u:secret@h/db?password=also").unwrap();
        assert!(!pg.is_exclusive());
        assert_eq!(pg.redacted(), "postgres://u:***@h/db?password=***");
        assert!(matches!(StoreUrl::parse("sqlite:"), Err(Error::NoPath(_))));
        let sentinel = StoreUrl::parse("redis+sentinel://:pw@s1:26379,s2:26379/m?sentinel_password=sp").unwrap();
        assert_eq!(sentinel.redacted(), "redis+sentinel://:***@s1:26379,s2:26379/m?sentinel_password=***");
        let cluster = StoreUrl::parse("rediss+cluster://u:pw@a:1,b:2?wait_replicas=1").unwrap();
        assert_eq!(cluster.redacted(), "rediss+cluster://u:***@a:1,b:2?wait_replicas=1");
        let pg = StoreUrl::parse("postgres://u:pw@h1:5432,h2:5432/db?target_session_attrs=read-write").unwrap();
        assert_eq!(pg.redacted(), "postgres://u:***@h1:5432,h2:5432/db?target_session_attrs=read-write");
        let e = StoreUrl::parse("mysql://u:secret@h/db").unwrap_err().to_string();
        assert!(e.starts_with("store URL \"mysql://u:***@h/db\" has an unknown scheme"), "{e}");
    }
}
