//! Idempotency records as the operator sees them: a filtered, cursor-paged list, one record's detail, and
//! the release action (delete the record, so the next retry of its key executes) and the resolve action (an
//! unknown outcome found to have taken effect: retries are told so, never executed).
//!
//! Record keys are `{prefix}{scope}/{key}` and, for a webhook route, `{prefix}route/{name}/{scope}/{key}`
//! (`idem_core::record::RecordKey`); the scope is `anonymous` or a hash of the caller's credential, never the
//! credential itself.

use std::time::Duration;

use idem_core::record::{Outcome, Record};
use idem_store::{Precondition, Store, Versioned};
use serde::Serialize;

use crate::Error;
use crate::scan::{self, Step};

/// Largest body [`detail`] shows when asked for it, in bytes; a longer body is cut there and says so.
pub const BODY_SHOWN: usize = 64 * 1024;

/// A record's state, as the filters and pages name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Executing under a lease (or left by a holder that died, until a retry takes it over).
    InFlight,
    /// Finished with a stored answer, replayed to retries.
    Completed,
    /// Finished with an answer too large to store: neither replayed nor executed again.
    TooLarge,
    /// Sent, but no complete answer came back: neither replayed nor executed again until released.
    Unknown,
    /// An unknown outcome an operator resolved as taken effect: retries get 409 `outcome-resolved`.
    Resolved,
}

impl State {
    /// The name in URLs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Completed => "completed",
            State::TooLarge => "too_large",
            State::Unknown => "unknown",
            State::Resolved => "resolved",
        }
    }

    /// Reads [`State::as_str`]'s names.
    ///
    /// # Errors
    /// [`Error::BadRequest`] for another name.
    pub fn parse(s: &str) -> Result<Self, Error> {
        Ok(match s {
            "in_flight" => State::InFlight,
            "completed" => State::Completed,
            "too_large" => State::TooLarge,
            "unknown" => State::Unknown,
            "resolved" => State::Resolved,
            _ => return Err(Error::BadRequest("state: in_flight, completed, too_large, unknown or resolved".into())),
        })
    }

    fn of(record: &Record) -> Self {
        match record {
            Record::InProgress { .. } => State::InFlight,
            Record::Finished { outcome: Outcome::Response(_), .. } => State::Completed,
            Record::Finished { outcome: Outcome::TooLarge { .. }, .. } => State::TooLarge,
            Record::Finished { outcome: Outcome::Unknown { .. }, .. } => State::Unknown,
            Record::Finished { outcome: Outcome::Resolved { .. }, .. } => State::Resolved,
        }
    }
}

/// Which records a list shows. Every field narrows; the default shows all.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only records in this state.
    pub state: Option<State>,
    /// `None`: every record; `Some("")`: only records of no route; `Some(name)`: only route `name`'s.
    pub route: Option<String>,
    /// Only this scope (`anonymous` or 32 hex digits).
    pub scope: Option<String>,
    /// Only keys starting with this.
    pub key_prefix: String,
    /// Only records started or finished at least this long ago.
    pub older_than: Option<Duration>,
    /// Only records started or finished at most this long ago.
    pub newer_than: Option<Duration>,
}

/// Where a store key sits: its route (if any), scope and idempotency key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Located {
    /// The store key.
    pub store_key: String,
    /// The webhook route whose record it is.
    pub route: Option<String>,
    /// `anonymous` or the hash of the caller's credential.
    pub scope: String,
    /// The Idempotency-Key.
    pub key: String,
}

/// Splits a store key under `prefix` into route, scope and key; `None` for a key not shaped as a record's.
pub fn locate(prefix: &str, store_key: &str) -> Option<Located> {
    let rest = store_key.strip_prefix(prefix)?;
    let (route, rest) = match rest.strip_prefix("route/") {
        Some(routed) => {
            let (name, rest) = routed.split_once('/')?;
            (Some(name.to_owned()), rest)
        }
        None => (None, rest),
    };
    let (scope, key) = rest.split_once('/')?;
    Some(Located { store_key: store_key.to_owned(), route, scope: scope.to_owned(), key: key.to_owned() })
}

/// One line of the records list.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Where the record is.
    #[serde(flatten)]
    pub at: Located,
    /// Its state.
    pub state: State,
    /// The stored answer's status (completed, too large).
    pub status: Option<u16>,
    /// When it started (in flight) or finished, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The lease holder of a record in flight.
    pub holder: Option<String>,
    /// The record's generation: the fencing token of its holder, and what a release is conditioned on.
    pub generation: u64,
}

/// One page of the records list.
#[derive(Debug, Serialize)]
pub struct RecordPage {
    /// The records, in store key order.
    pub rows: Vec<Row>,
    /// Pass as `cursor` for the next page; `None` when there is none.
    pub next_cursor: Option<String>,
    /// Store keys this page read (at most [`scan::SCAN_BUDGET`]).
    pub scanned: usize,
}

fn decode(key: &str, value: &Versioned) -> Result<Record, Error> {
    Record::decode(value.value()).map_err(|e| Error::Unreadable { key: key.to_owned(), reason: e.to_string() })
}

fn at_ms(record: &Record) -> u64 {
    match record {
        Record::InProgress { started_at_ms, .. } => *started_at_ms,
        Record::Finished { finished_at_ms, .. } => *finished_at_ms,
    }
}

/// The store prefix a filter can list under: its route and scope and, with a scope, the key prefix; the rest
/// of the filter is judged record by record.
fn list_prefix(prefix: &str, filter: &Filter) -> Result<String, Error> {
    let mut out = prefix.to_owned();
    if let Some(route) = filter.route.as_deref().filter(|r| !r.is_empty()) {
        if route.contains('/') {
            return Err(Error::BadRequest("route: a route name has no '/'".into()));
        }
        out.push_str(&format!("route/{route}/"));
    }
    if let Some(scope) = &filter.scope {
        if idem_core::Scope::parse(scope).is_err() {
            return Err(Error::BadRequest("scope: 'anonymous' or 32 hex digits".into()));
        }
        out.push_str(&format!("{scope}/{}", filter.key_prefix));
    }
    Ok(out)
}

/// Lists the records under `prefix` that `filter` keeps, at most `limit`, after `cursor` (a previous page's
/// `next_cursor`); `now_ms` (the store's clock) is what the age filters count from.
///
/// # Errors
/// [`Error::BadRequest`] for a malformed filter or cursor; [`Error::Store`].
pub async fn list<S: Store>(
    store: &S,
    prefix: &str,
    filter: &Filter,
    cursor: Option<&str>,
    limit: usize,
    now_ms: u64,
) -> Result<RecordPage, Error> {
    let under = list_prefix(prefix, filter)?;
    let cursor = cursor.map(scan::decode_cursor).transpose()?;
    let routes = format!("{prefix}route/");
    let only_unrouted = filter.route.as_deref() == Some("");
    let scanned = scan::scan(store, &under, cursor, limit, |key, value| {
        if only_unrouted && key.starts_with(&routes) {
            return Ok(Step::JumpPast(scan::past(&routes)));
        }
        let Some(at) = locate(prefix, key) else { return Ok(Step::Skip) };
        if !at.key.starts_with(&filter.key_prefix) {
            return Ok(Step::Skip);
        }
        let record = decode(key, value)?;
        let state = State::of(&record);
        let when = at_ms(&record);
        let age = now_ms.saturating_sub(when);
        let keep = filter.state.is_none_or(|s| s == state)
            && filter.older_than.is_none_or(|d| age >= d.as_millis() as u64)
            && filter.newer_than.is_none_or(|d| age <= d.as_millis() as u64);
        if !keep {
            return Ok(Step::Skip);
        }
        let (status, holder) = match &record {
            Record::InProgress { owner, .. } => (None, Some(owner.clone())),
            Record::Finished { outcome: Outcome::Response(r), .. } => (Some(r.status), None),
            Record::Finished { outcome: Outcome::TooLarge { status, .. }, .. } => (Some(*status), None),
            Record::Finished { .. } => (None, None),
        };
        Ok(Step::Keep(Row { at, state, status, at_ms: when, holder, generation: value.generation().get() }))
    })
    .await?;
    Ok(RecordPage { rows: scanned.rows, next_cursor: scanned.next_cursor, scanned: scanned.scanned })
}

/// Everything the store knows about one record: the data of its page and of `idem explain`.
#[derive(Clone, Debug, Serialize)]
pub struct Detail {
    /// Where the record is.
    #[serde(flatten)]
    pub at: Located,
    /// Its state.
    pub state: State,
    /// Hex SHA-256 fingerprint of the request that claimed it (method, path, body).
    pub fingerprint: String,
    /// The record's generation: for a record in flight, its holder's fencing token.
    pub generation: u64,
    /// When the store drops the record (RFC 3339), if it expires.
    pub expires_at: Option<String>,
    /// The lease holder's owner id (in flight).
    pub holder: Option<String>,
    /// The holder's lease length in milliseconds (in flight).
    pub lease_ms: Option<u64>,
    /// When the request was claimed (in flight), RFC 3339.
    pub started_at: Option<String>,
    /// When it finished, RFC 3339.
    pub finished_at: Option<String>,
    /// The stored answer's status (completed, too large).
    pub status: Option<u16>,
    /// The stored answer's headers, as replayed.
    pub headers: Vec<(String, String)>,
    /// The stored body's length (completed), or the bytes seen before giving up (too large).
    pub body_bytes: Option<u64>,
    /// The body, lossily decoded as UTF-8 and cut at [`BODY_SHOWN`] bytes, when asked for.
    pub body: Option<String>,
    /// Whether [`Detail::body`] was cut.
    pub body_truncated: bool,
    /// Why the outcome is (or was, when resolved) unknown.
    pub reason: Option<String>,
    /// Who resolved an unknown outcome, what they found and when (RFC 3339).
    pub resolved: Option<Resolution>,
}

/// An operator's resolution of an unknown outcome.
#[derive(Clone, Debug, Serialize)]
pub struct Resolution {
    /// Who: the admin guard's actor (a client certificate's subject, or `token`, or the shell user).
    pub by: String,
    /// What they found, in their words.
    pub note: String,
    /// When, RFC 3339.
    pub at: String,
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(idem_store::millis_to_system_time(ms)).to_string()
}

/// Checks that `store_key` is a record's key under `prefix` (the pages and actions take nothing else: a
/// release must never delete a KV key or a ledger entry).
///
/// # Errors
/// [`Error::BadRequest`].
pub fn check_key(prefix: &str, store_key: &str) -> Result<Located, Error> {
    locate(prefix, store_key)
        .filter(|l| !l.key.is_empty() && idem_core::Scope::parse(&l.scope).is_ok())
        .ok_or_else(|| Error::BadRequest(format!("not an idempotency record key (they start with {prefix})")))
}

/// Reads the record under `store_key`, with its body when `with_body`.
///
/// # Errors
/// [`Error::BadRequest`] for a key that is not a record's; [`Error::NotFound`]; [`Error::Unreadable`];
/// [`Error::Store`].
pub async fn detail<S: Store>(store: &S, prefix: &str, store_key: &str, with_body: bool) -> Result<Detail, Error> {
    let at = check_key(prefix, store_key)?;
    let value = store.get(store_key).await?.ok_or_else(|| Error::NotFound(format!("no record {store_key}")))?;
    let record = decode(store_key, &value)?;
    let mut d = Detail {
        at,
        state: State::of(&record),
        fingerprint: record.fingerprint().to_hex(),
        generation: value.generation().get(),
        expires_at: value.expires_at().map(|t| humantime::format_rfc3339_millis(t).to_string()),
        holder: None,
        lease_ms: None,
        started_at: None,
        finished_at: None,
        status: None,
        headers: Vec::new(),
        body_bytes: None,
        body: None,
        body_truncated: false,
        reason: None,
        resolved: None,
    };
    match record {
        Record::InProgress { owner, started_at_ms, lease_ms, .. } => {
            (d.holder, d.lease_ms, d.started_at) = (Some(owner), Some(lease_ms), Some(rfc3339(started_at_ms)));
        }
        Record::Finished { outcome, finished_at_ms, .. } => {
            d.finished_at = Some(rfc3339(finished_at_ms));
            match outcome {
                Outcome::Response(r) => {
                    (d.status, d.headers, d.body_bytes) = (Some(r.status), r.headers, Some(r.body.len() as u64));
                    if with_body {
                        let shown = &r.body[..r.body.len().min(BODY_SHOWN)];
                        d.body = Some(String::from_utf8_lossy(shown).into_owned());
                        d.body_truncated = r.body.len() > BODY_SHOWN;
                    }
                }
                Outcome::TooLarge { status, size, .. } => (d.status, d.body_bytes) = (Some(status), Some(size)),
                Outcome::Unknown { reason } => d.reason = Some(reason),
                Outcome::Resolved { reason, by, note, resolved_at_ms } => {
                    d.reason = Some(reason);
                    d.resolved = Some(Resolution { by, note, at: rfc3339(resolved_at_ms) });
                }
            }
        }
    }
    Ok(d)
}

/// Releases the record under `store_key`: deletes it, so the next request with its key executes as new. With
/// `generation` (the one the operator saw), only if the record is still that one: a record that moved on (a
/// retry took it over, it completed) is not released blind. `actor` is logged.
///
/// # Errors
/// [`Error::BadRequest`] for a key that is not a record's; [`Error::NotFound`]; [`Error::Conflict`] when the
/// record changed; [`Error::Store`].
pub async fn release<S: Store>(
    store: &S,
    prefix: &str,
    store_key: &str,
    generation: Option<u64>,
    actor: &str,
) -> Result<(), Error> {
    check_key(prefix, store_key)?;
    let precondition =
        generation.map_or(Precondition::Any, |g| Precondition::Generation(idem_store::Generation::new(g)));
    match store.delete(store_key, precondition).await {
        Ok(Some(_)) => {
            tracing::info!(actor, key = store_key, ?generation, "admin: record released");
            Ok(())
        }
        Ok(None) => Err(Error::NotFound(format!("no record {store_key}"))),
        Err(idem_store::Error::PreconditionFailed { current: None }) => {
            Err(Error::NotFound(format!("no record {store_key}")))
        }
        Err(idem_store::Error::PreconditionFailed { current: Some(now) }) => Err(Error::Conflict(format!(
            "the record changed since it was shown (generation {now} now): look again before releasing it"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// Longest note a resolution keeps, in bytes (it is answered to every retry of the key).
pub const NOTE_LIMIT: usize = 1024;

/// Resolves the unknown outcome of the record under `store_key` as taken effect: from now on a retry of its key
/// gets 409 `outcome-resolved` with `note` (a webhook route's sender gets 200) and is never executed. With
/// `generation` (the one the operator saw), only if the record is still that one. `actor` is kept in the
/// record and logged.
///
/// # Errors
/// [`Error::BadRequest`] for a key that is not a record's or a note over [`NOTE_LIMIT`] bytes;
/// [`Error::NotFound`]; [`Error::Conflict`] when the record changed or its outcome is not unknown (in flight,
/// answered, resolved already); [`Error::Unreadable`]; [`Error::Store`].
pub async fn resolve<S: Store>(
    store: &S,
    prefix: &str,
    store_key: &str,
    generation: Option<u64>,
    note: &str,
    actor: &str,
) -> Result<(), Error> {
    check_key(prefix, store_key)?;
    if note.len() > NOTE_LIMIT {
        return Err(Error::BadRequest(format!("note: at most {NOTE_LIMIT} bytes ({} given)", note.len())));
    }
    let value = store.get(store_key).await?.ok_or_else(|| Error::NotFound(format!("no record {store_key}")))?;
    if generation.is_some_and(|g| g != value.generation().get()) {
        return Err(Error::Conflict(format!(
            "the record changed since it was shown (generation {} now): look again before resolving it",
            value.generation().get()
        )));
    }
    let record = decode(store_key, &value)?;
    let now_ms = idem_store::system_time_to_millis(store.now().await?);
    let Some(resolved) = record.resolved(actor, note, now_ms) else {
        return Err(Error::Conflict(format!(
            "the record's outcome is not unknown (it is {}): only an unknown outcome is resolved",
            State::of(&record).as_str()
        )));
    };
    // Kept as long as the unknown outcome would have been (Ttl::Keep: the same expiry).
    let written =
        store.put(store_key, resolved.encode(), Precondition::Generation(value.generation()), idem_store::Ttl::Keep);
    match written.await {
        Ok(_) => {
            tracing::info!(
                actor,
                key = store_key,
                generation = value.generation().get(),
                "admin: unknown outcome resolved"
            );
            Ok(())
        }
        Err(idem_store::Error::PreconditionFailed { current: None }) => {
            Err(Error::NotFound(format!("no record {store_key}")))
        }
        Err(idem_store::Error::PreconditionFailed { current: Some(now) }) => Err(Error::Conflict(format!(
            "the record changed since it was shown (generation {now} now): look again before resolving it"
        ))),
        Err(e) => Err(e.into()),
    }
}
