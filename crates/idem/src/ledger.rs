//! The store `idem run`'s ledger and `idem once`'s slots live in, opened by URL: a `sqlite:` file is
//! `idem_sqlite::SharedSqlite`, shared by the processes of one machine by taking turns; any other URL is an
//! `AnyStore`.

use std::time::Duration;

use idem_backends::{AnyStore, StoreUrl};
use idem_sqlite::SharedSqlite;
use idem_store::{Jitter, Limits, RetryPolicy};

use crate::error::Error;

/// The ledger store, opened by URL; SQLite files are shared between processes by taking turns.
#[derive(Clone, Debug)]
pub(crate) enum Ledger {
    Sqlite(SharedSqlite),
    Other(AnyStore),
}

impl Ledger {
    /// Opens `url`; `namespace` names the PostgreSQL schema or the Redis key prefix.
    pub(crate) async fn open(url: &str, namespace: &str) -> Result<Self, Error> {
        match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(path) => SharedSqlite::open(&path, Limits::default())
                .await
                .map(Ledger::Sqlite)
                .map_err(|e| Error::OpenStore { url: url.to_owned(), source: Box::new(e) }),
            other => Ok(Ledger::Other(AnyStore::open(&other, namespace, Limits::default()).await?)),
        }
    }

    /// As [`Ledger::open`], but a store that is down or unreachable for now
    /// ([`idem_backends::Error::is_unavailable`]) is [`Error::Unavailable`] (exit status 75), not
    /// [`Error::OpenStore`] (2): for `idem once`, whose next invocation tries again, a monitor must tell an
    /// outage from a bad URL or a refused login.
    pub(crate) async fn open_or_unavailable(url: &str, namespace: &str) -> Result<Self, Error> {
        match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(path) => open_sqlite_or_unavailable(url, &path).await,
            other => match AnyStore::open(&other, namespace, Limits::default()).await {
                Ok(store) => Ok(Ledger::Other(store)),
                Err(e) => Err(unavailable_or(e)),
            },
        }
    }

    /// As [`Ledger::open`], but `None` when `url` is PostgreSQL and the `namespace` schema does not exist
    /// (nothing is created); SQLite and Redis open as by `open`. A store down or unreachable for now is
    /// [`Error::Unavailable`] (exit status 75), as for [`Ledger::open_or_unavailable`].
    pub(crate) async fn open_existing(url: &str, namespace: &str) -> Result<Option<Self>, Error> {
        match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(path) => open_sqlite_or_unavailable(url, &path).await.map(Some),
            other => match AnyStore::open_existing(&other, namespace, Limits::default()).await {
                Ok(store) => Ok(store.map(Ledger::Other)),
                Err(e) => Err(unavailable_or(e)),
            },
        }
    }

    /// Opens `url` as [`Ledger::open`] does, riding out a store that is down or unreachable for now (refused,
    /// reset, no answer: [`idem_backends::Error::is_unavailable`]) for at most `limit`: tries again after a pause
    /// that doubles from 100 ms up to 2 s, each drawn between half and all of it (runners started together do
    /// not come back at the store in one burst). `Ok(None)` once `limit` has passed with the store still
    /// unavailable. Other errors (a bad URL, a login or TLS handshake refused) are returned at once.
    pub(crate) async fn open_within(url: &str, namespace: &str, limit: Duration) -> Result<Option<Self>, Error> {
        let parsed = StoreUrl::parse(url)?;
        if let StoreUrl::Sqlite(_) = parsed {
            return Self::open(url, namespace).await.map(Some);
        }
        let start = tokio::time::Instant::now();
        let retries = RetryPolicy::new()
            .with_base_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(2))
            .with_jitter(Jitter::Equal);
        let mut failures = 0;
        let mut said = false;
        loop {
            match AnyStore::open(&parsed, namespace, Limits::default()).await {
                Ok(store) => {
                    if said {
                        crate::error::sayln!("idem run: the ledger store is back");
                    }
                    return Ok(Some(Ledger::Other(store)));
                }
                Err(e) if e.is_unavailable() => {
                    if start.elapsed() >= limit {
                        return Ok(None);
                    }
                    if !said {
                        crate::error::sayln!(
                            "idem run: the ledger store is unavailable ({}); trying again for up to {} \
                             (--store-outage-limit)",
                            idem_store::error_chain(&e),
                            humantime::format_duration(limit)
                        );
                        said = true;
                    }
                    let left = limit.saturating_sub(start.elapsed());
                    failures += 1;
                    tokio::time::sleep(retries.pause_after(failures).min(left)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Commits what is queued and gives the store up.
    pub(crate) async fn close(&self) {
        match self {
            Ledger::Sqlite(s) => s.close().await,
            Ledger::Other(s) => s.close().await,
        }
    }
}

/// Opens a SQLite file shared by taking turns; a file another process keeps to itself (`idem serve`), did
/// not give up for a minute or holds locked past SQLite's busy timeout is [`Error::Unavailable`] (exit status
/// 75), not a wait for ever or bad usage ([`idem_sqlite::Error::is_unavailable`]).
async fn open_sqlite_or_unavailable(url: &str, path: &std::path::Path) -> Result<Ledger, Error> {
    match SharedSqlite::open(path, Limits::default()).await {
        Ok(store) => Ok(Ledger::Sqlite(store)),
        Err(e) if e.is_unavailable() => Err(Error::Unavailable(idem_store::error_chain(&e))),
        Err(e) => Err(Error::OpenStore { url: url.to_owned(), source: Box::new(e) }),
    }
}

/// [`Error::Unavailable`] for a store down or unreachable for now, else the error as [`Error::OpenStore`] or
/// [`Error::Config`].
fn unavailable_or(e: idem_backends::Error) -> Error {
    if e.is_unavailable() { Error::Unavailable(idem_store::error_chain(&e)) } else { e.into() }
}

/// Runs `$body` with `$s` bound to the ledger's concrete store (the engines are generic over `Store`).
macro_rules! on_ledger {
    ($ledger:expr, $s:ident => $body:expr) => {
        match $ledger {
            $crate::ledger::Ledger::Sqlite($s) => $body,
            $crate::ledger::Ledger::Other($s) => $body,
        }
    };
}
pub(crate) use on_ledger;
