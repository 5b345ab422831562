//! [`StoreUrl`]: a store URL parsed by scheme, and [`redact`] for printing any URL.

use std::path::PathBuf;

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
    /// `redis://…` or `rediss://…`, as given.
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
        if url.starts_with("redis://") || url.starts_with("rediss://") {
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

/// Hides passwords in a URL for messages: the userinfo's (`scheme://user:secret@host` → `user:***@host`, the
/// last `@` ending it, as passwords may contain `@`) and any `password=` query parameter.
pub fn redact(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority, tail) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if let Some((userinfo, host)) = authority.rsplit_once('@')
            && let Some((user, _)) = userinfo.split_once(':')
        {
            out = format!("{scheme}://{user}:***@{host}{tail}");
        }
    }
    if let Some((base, query)) = out.clone().split_once('?') {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        out = format!("{base}?{}", params.join("&"));
    }
    out
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
        let e = StoreUrl::parse("mysql://u:secret@h/db").unwrap_err().to_string();
        assert!(e.starts_with("store URL \"mysql://u:***@h/db\" has an unknown scheme"), "{e}");
    }
}
