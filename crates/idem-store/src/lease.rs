//! Keeping a lease: the one renewal loop behind the layer's record lease and the runner's item claim.
//!
//! A lease is a record written with a TTL (its length) whose every later write is conditioned on the
//! generation of the holder's last accepted write, its fencing token. The holder renews it every third of its
//! length, *beside* the work it guards, and stops when a renewal is refused (another holder took over) or when
//! none was accepted for a whole lease (the store did not answer: the lease lapsed). What the lease is (the
//! record's value, its key) belongs to the state machine that made it; this module only keeps it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Error, Generation, StoreExt, Versioned, Write};

/// How soon a renewal that failed (not refused: the store did not answer well) is tried again, at most; a third
/// of the lease when that is shorter.
const RETRY: Duration = Duration::from_millis(200);

/// A lease as its keeper sees it: how to renew it and where to record an accepted renewal's generation.
/// Implemented by the holders of `idem-core`'s state machines: `record::Held` (an idempotency record),
/// `ledger::Held` (a work item of `idem run`) and `slot::Held` (a slot of `idem once`).
pub trait Renewable {
    /// The lease length: the TTL each renewal sets.
    fn length(&self) -> Duration;
    /// The renewal write, conditioned on the current fencing token.
    fn renewal(&self) -> Write;
    /// Records the generation the store gave an accepted renewal: the new fencing token.
    fn renewed(&mut self, generation: Generation);
    /// Whether `current`, the value under the lease's key, is this holder's own lease: a renewal whose answer
    /// was lost landed, and its generation is the holder's to adopt. Must never be true of another holder's
    /// lease (compare an owner id unique to this holder), or adopting would defeat the fence.
    fn is_mine(&self, current: &Versioned) -> bool;
}

/// Why a lease is no longer held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lost {
    /// A renewal's precondition failed: the lease lapsed and another holder claimed it, or it was released.
    Refused,
    /// No renewal was accepted for a whole lease (the store did not answer, or erred): it has lapsed, whether or
    /// not someone else holds it now.
    Lapsed,
}

/// A renewal on its way to the store.
type Renewal<'a> = Pin<Box<dyn Future<Output = Result<Option<Generation>, Error>> + Send + 'a>>;

/// Renews a lease every third of its length while its holder works, and says when it is lost.
///
/// A renewal is sent and awaited *beside* the work: [`LeaseKeeper::until_lost`] is one more future in the
/// holder's `select!`, and a renewal in flight is kept here across the rounds that did not finish it. Awaited
/// inside a `select!` arm instead, a slow or hanging store would hold up everything else the holder waits for
/// (a command's exit, a response body). The keeper never stops the work; the holder decides what a loss means
/// (the runner stops the command, the layer lets the call finish and its final write fail the fence).
///
/// Time is tokio's, so tests with paused time drive it.
pub struct LeaseKeeper<'a, S> {
    store: &'a S,
    length: Duration,
    /// When the write that last set the lease was sent: the store started the lease's time no earlier, so until
    /// a whole lease has passed on this machine's monotonic clock it is still ours (the usual lease assumption
    /// that clocks run at about the same rate; no clock synchronisation is assumed).
    sent: Instant,
    /// When the next renewal is due.
    due: Instant,
    /// The renewal in flight and when it was sent.
    in_flight: Option<(Instant, Renewal<'a>)>,
    lost: Option<Lost>,
    /// When the first renewal the store did not take (unavailable) since the last accepted one was sent.
    failing_since: Option<Instant>,
    /// A renewal still unanswered when the lease lapses is kept for the next [`LeaseKeeper::await_renewal`] instead of
    /// dropped ([`LeaseKeeper::keeping_late_answers`]).
    keep_late: bool,
}

impl<'a, S: crate::Store + Sync> LeaseKeeper<'a, S> {
    /// The keeper of a lease of `length` last set by a write sent at `sent` (a claim made ahead may be a while
    /// old: its first renewal is due a third of the lease after `sent`, not after now).
    pub fn new(store: &'a S, length: Duration, sent: Instant) -> Self {
        Self {
            store,
            length,
            sent,
            due: sent + length / 3,
            in_flight: None,
            lost: None,
            failing_since: None,
            keep_late: false,
        }
    }

    /// This keeper keeps a renewal that is still unanswered when the lease lapses: the loss is reported
    /// ([`Lost::Lapsed`]) as before, but the next [`LeaseKeeper::await_renewal`] (or [`LeaseKeeper::fence`]) waits for
    /// that answer, however long it takes, and the holder must call one of them before any other store
    /// operation of its own (the renewal holds what the store gave it meanwhile). The renewal is conditional on
    /// the holder's generation, so a late acceptance means nobody took over: the lease was the holder's all
    /// along (a store that took its time, or another process holding a shared SQLite file), `await_renewal` returns
    /// true, and the keeper goes on keeping it; the holder's work need not be discarded.
    #[must_use]
    pub fn keeping_late_answers(mut self) -> Self {
        self.keep_late = true;
        self
    }

    /// When the write that last set the lease was sent.
    pub fn sent(&self) -> Instant {
        self.sent
    }

    /// When the renewal in flight was sent, or `None` when none is: a holder that bounds its waits by a time
    /// of its own counts from here.
    pub fn renewal_sent(&self) -> Option<Instant> {
        self.in_flight.as_ref().map(|(sent, _)| *sent)
    }

    /// When the first renewal the store did not take since the last accepted one was sent (an
    /// [`Error::is_unavailable`] answer, the client's own timeout included), or `None`: a holder that bounds
    /// its waits for the store counts the outage from there, not from when that answer came.
    pub fn unavailable_since(&self) -> Option<Instant> {
        self.failing_since
    }

    /// Why the lease is lost, or `None` while it is held.
    pub fn lost(&self) -> Option<Lost> {
        self.lost
    }

    /// The length of the lease kept.
    pub fn length(&self) -> Duration {
        self.length
    }

    /// The holder set the lease again itself after it was lost (it retook a lapsed lease that nobody had taken
    /// over, with a write sent at `sent` whose generation it recorded in its lease): keep it from there. A
    /// renewal still in flight is dropped (it is conditioned on a generation the new write replaced, so it can
    /// only be refused).
    pub fn restart(&mut self, sent: Instant) {
        self.in_flight = None;
        self.lost = None;
        self.failing_since = None;
        self.sent = sent;
        self.due = sent + self.length / 3;
    }

    /// Renews the lease whenever due and records each accepted renewal in `lease`; resolves only once the lease
    /// is lost, saying why.
    ///
    /// Cancel-safe: dropped while a renewal is in flight, it keeps it for the next call,
    /// [`LeaseKeeper::await_renewal`] or [`LeaseKeeper::fence`], one of which must come before any other store write
    /// of the holder fenced on the same token: a renewal left unpolled holds whatever the store gave it (a
    /// lock, a connection) meanwhile.
    pub async fn until_lost<R: Renewable>(&mut self, lease: &mut R) -> Lost {
        loop {
            if let Some(lost) = self.lost {
                return lost;
            }
            if self.in_flight.is_none() {
                tokio::time::sleep_until(self.due).await;
                self.in_flight = Some((Instant::now(), Box::pin(self.store.apply(lease.renewal()))));
            }
            self.answer(lease).await;
        }
    }

    /// Runs `work` to its end while keeping the lease, and returns its output. A loss does not stop the work;
    /// `on_lost` is called once, when it happens. A renewal still in flight when the work ends stays here:
    /// [`LeaseKeeper::await_renewal`] it before the next fenced write, or drop the keeper without waiting (the renewal
    /// may still land; the next fenced write then fails its precondition against the holder's own record,
    /// which the holder must recognise, as the layer's takeover check does).
    pub async fn during<R: Renewable, F: Future>(
        &mut self,
        lease: &mut R,
        work: F,
        on_lost: impl FnOnce(Lost),
    ) -> F::Output {
        tokio::pin!(work);
        if self.lost.is_none() {
            tokio::select! {
                biased;
                out = &mut work => return out,
                lost = self.until_lost(lease) => on_lost(lost),
            }
        }
        work.await
    }

    /// Waits for the renewal in flight, if any, and records its answer, so the token in `lease` is current
    /// before a write fenced on it (a release, a completion, or a renewal of its own). False when the lease is
    /// lost.
    pub async fn await_renewal<R: Renewable>(&mut self, lease: &mut R) -> bool {
        self.answer(lease).await;
        self.lost.is_none()
    }

    /// The fence before a step that needs the lease (starting a command, renaming an output into place):
    /// waits for a renewal in flight to be answered, then renews now unless the lease was set less than a third of its length
    /// ago. False when the lease is lost or this renewal failed: the caller no longer holds it.
    pub async fn fence<R: Renewable>(&mut self, lease: &mut R) -> bool {
        if !self.await_renewal(lease).await {
            return false;
        }
        if self.sent.elapsed() < self.length / 3 {
            return true;
        }
        for _ in 0..2 {
            let sent = Instant::now();
            match self.store.apply(lease.renewal()).await {
                Ok(Some(g)) => {
                    self.renewed(lease, sent, g);
                    return true;
                }
                // Our own earlier renewal landed unanswered: adopt its generation and renew once more, so the
                // lease is fresh when the caller goes on.
                Err(e) if e.is_precondition_failed() && self.adopt(lease, &e).await => continue,
                Err(e) if e.is_precondition_failed() => {
                    self.lost = Some(Lost::Refused);
                    return false;
                }
                Err(e) => {
                    self.failed(sent, &e);
                    return false;
                }
                Ok(None) => return false,
            }
        }
        false
    }

    /// After a refused renewal: if the lease under the key is still this holder's own (a renewal whose answer
    /// was lost landed and moved the generation past what the holder knew), adopt that generation and renew
    /// again at once. Its time still counts from the last *answered* write: the one that landed was sent no
    /// earlier. False when the key is absent, another holder's, or unreadable.
    async fn adopt<R: Renewable>(&mut self, lease: &mut R, refused: &Error) -> bool {
        if !matches!(refused.current_generation(), Some(Some(_))) {
            return false;
        }
        match self.store.get(&lease.renewal().key).await {
            Ok(Some(current)) if lease.is_mine(&current) => {
                lease.renewed(current.generation());
                self.due = Instant::now();
                true
            }
            _ => false,
        }
    }

    /// Waits for the renewal in flight (if any) until the lease would lapse, and records its answer.
    async fn answer<R: Renewable>(&mut self, lease: &mut R) {
        let Some((sent, renewal)) = self.in_flight.as_mut() else { return };
        let lapses = self.sent + self.length;
        // Kept past the lapse (`keeping_late_answers`): its answer decides.
        let late = self.lost == Some(Lost::Lapsed);
        let result = tokio::select! {
            result = renewal => result,
            () = tokio::time::sleep_until(lapses), if !late => {
                // No answer before the lease lapsed: as far as this holder can tell it is gone. The renewal is
                // dropped, not kept: left unpolled while the holder goes on to other writes, it would hold what
                // it holds (the shared SQLite ledger's read guard, behind which that ledger's turn taking, and
                // then every later operation of the process, queue: a deadlock). If it still lands, the holder's
                // next fenced write fails and it may recognise its own record (the layer's `adopt`). A keeper
                // `keeping_late_answers` keeps it instead, for its holder to wait for at once (`await_renewal`).
                if !self.keep_late {
                    self.in_flight = None;
                }
                self.lost = Some(Lost::Lapsed);
                return;
            }
        };
        let sent = *sent;
        self.in_flight = None;
        if late && matches!(&result, Ok(Some(_))) {
            self.lost = None;
        }
        match result {
            Ok(Some(g)) => self.renewed(lease, sent, g),
            // A renewal is a put: it always gives a generation. Treat anything else as not accepted.
            Ok(None) => self.retry_or_lapse(),
            Err(e) if e.is_precondition_failed() => {
                if !self.adopt(lease, &e).await {
                    self.lost = Some(Lost::Refused);
                } else if late {
                    // Its own earlier renewal landed unanswered: held after all, and renewed at once.
                    self.lost = None;
                }
            }
            Err(e) => {
                tracing::warn!(key = %lease.renewal().key, error = %e, "lease renewal failed; retrying while the lease lasts");
                self.failed(sent, &e);
                self.retry_or_lapse();
            }
        }
    }

    fn retry_or_lapse(&mut self) {
        if self.sent.elapsed() >= self.length {
            self.lost = Some(Lost::Lapsed);
        } else {
            self.due = Instant::now() + RETRY.min(self.length / 3);
        }
    }

    /// A renewal sent at `sent` was answered with `e`: an outage of the store began no later than `sent`.
    fn failed(&mut self, sent: Instant, e: &Error) {
        if e.is_unavailable() {
            self.failing_since.get_or_insert(sent);
        }
    }

    fn renewed<R: Renewable>(&mut self, lease: &mut R, sent: Instant, generation: Generation) {
        self.failing_since = None;
        lease.renewed(generation);
        self.sent = sent;
        self.due = sent + self.length / 3;
    }
}
