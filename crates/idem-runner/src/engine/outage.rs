//! The run's view of the store's outages ([`Outage`]): when the current one began, and whether one outlasted
//! `--store-outage-limit`, which ends the run. Below the ledger's operations, which report to it, and the
//! run's shared state, which holds it.

use std::sync::Mutex;
use std::time::Duration;

use idem_store::Error as StoreError;
use tokio::time::Instant;

/// The run's view of the store's outages: when the current one began, and whether one outlasted the limit.
#[derive(Debug)]
pub(crate) struct Outage {
    /// `--store-outage-limit`.
    pub(super) limit: Duration,
    /// When the current outage began (when the first operation the store did not take since the last good
    /// answer was sent: a locked SQLite file holds a write for its busy timeout before refusing it), and whether
    /// a write was among those refused; `None` while the store answers.
    since: Mutex<Option<(Instant, bool)>>,
    /// An outage outlasted the limit: the run ends. Never cleared. A watch, so that operations and waits in
    /// flight end at once rather than each waiting out its own timeout (the exit came up to a busy timeout or a
    /// client timeout after the limit, or only when the store answered again).
    exceeded: tokio::sync::watch::Sender<bool>,
}

impl Outage {
    pub(crate) fn new(limit: Duration) -> Self {
        Self { limit, since: Mutex::new(None), exceeded: tokio::sync::watch::channel(false).0 }
    }

    /// True once an outage outlasted the limit: nothing new starts, and the run ends.
    pub(crate) fn exceeded(&self) -> bool {
        *self.exceeded.borrow()
    }

    /// Resolves once an outage outlasted the limit (at once if one did).
    pub(crate) async fn until_exceeded(&self) {
        let mut exceeded = self.exceeded.subscribe();
        // The sender lives in `self`: `wait_for` cannot fail while this borrow lasts.
        let _ = exceeded.wait_for(|e| *e).await;
    }

    /// True while the store is not taking operations (an outage began and has not ended).
    pub(crate) fn ongoing(&self) -> bool {
        self.since.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// When an operation sent at `sent` counts as unanswered: a limit after the current outage began, or after
    /// `sent` when none is ongoing. An operation retried during an outage must not get a whole limit of its
    /// own: with a limit longer than the client's own response timeout (10 s for Redis), the retry sent after
    /// the first timeout waited out a second one, and the run ended up to twice the limit into the outage.
    pub(super) fn deadline(&self, sent: Instant) -> Instant {
        let since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        since.map_or(sent, |(began, _)| began.min(sent)) + self.limit
    }

    /// A lease renewal sent at `sent` was accepted: a write the store took, so an outage that began before it
    /// was sent is over. (The keeper's renewals do not go through the ledger's retries; without this, an outage begun by
    /// a renewal that failed would stay open while only renewals were answered, and a later operation would be
    /// given up at once, its deadline counted from that old beginning.)
    pub(super) fn renewal_answered(&self, sent: Instant) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((began, _)) = *since
            && began <= sent
        {
            *since = None;
            tracing::warn!("the ledger store answers again after {:.1}s", began.elapsed().as_secs_f64());
        }
    }

    /// The store answered an operation (a `write` or a read). True when that ended an outage. A read does not
    /// end an outage in which a write was refused: a SQLite file locked by another connection still serves reads
    /// (WAL mode) while every write waits, and the limit must still apply to that.
    pub(super) fn answered(&self, write: bool) -> bool {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        match *since {
            Some((began, writes_refused)) if write || !writes_refused => {
                *since = None;
                tracing::warn!("the ledger store answers again after {:.1}s", began.elapsed().as_secs_f64());
                true
            }
            _ => false,
        }
    }

    /// The store did not take an operation (`e`, a `write` or a read) sent at `sent`: true while the outage is
    /// within the limit (wait and try again), false once it outlasted it (give up).
    pub(super) fn unavailable(&self, e: &StoreError, sent: Instant, write: bool) -> bool {
        if self.exceeded() {
            return false;
        }
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        let (began, writes_refused) = since.get_or_insert_with(|| {
            tracing::warn!(
                "the ledger store is unavailable ({}); waiting for it up to --store-outage-limit {}: nothing new \
                 is claimed, running commands go on while their leases last, finished items are recorded once \
                 it is back",
                idem_store::error_chain(e),
                humanize(self.limit)
            );
            (sent, false)
        });
        *began = (*began).min(sent);
        *writes_refused |= write;
        if began.elapsed() < self.limit {
            return true;
        }
        if !self.exceeded.send_replace(true) {
            tracing::error!(
                "the ledger store has been unavailable for longer than --store-outage-limit {}: ending the run; \
                 items not finished are not done (run again once the store is back)",
                humanize(self.limit)
            );
        }
        false
    }
}

/// `d` as the flag would be written (`90s`, `5m`).
pub(super) fn humanize(d: Duration) -> String {
    if d.as_secs() >= 60 && d.as_secs().is_multiple_of(60) && d.subsec_nanos() == 0 {
        format!("{}m", d.as_secs() / 60)
    } else {
        format!("{}s", d.as_secs_f64())
    }
}
