//! A held item's lease, kept beside the work: renewals are polled together with what they guard, never
//! awaited inside one of its `select!` arms.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use idem_core::Held;
use idem_store::{Error as StoreError, Generation, Store};

use idem_store::StoreExt;

/// How soon a renewal that failed (not refused: the ledger did not answer or erred) is tried again, at most; a
/// third of the lease when that is shorter.
const RETRY: Duration = Duration::from_millis(200);

/// A renewal on its way to the store.
type Renewal<'a> = Pin<Box<dyn Future<Output = Result<Option<Generation>, StoreError>> + Send + 'a>>;

/// Renews a held item's lease every third of its length while the item waits for a slot, its command runs and
/// its output is checked.
///
/// A renewal is sent and awaited *beside* that work: [`Heartbeat::until_lost`] is one more future in the
/// `select!` that waits for the command's exit, its timeout and a second Ctrl-C, and a renewal in flight is
/// kept here across the rounds that did not finish it. Awaited inside a `select!` arm instead, a slow or
/// hanging ledger held up all of those (the command's exit went unnoticed, and its slot taken, until the
/// ledger answered). The answer still fences the attempt: a refused renewal, or none accepted for a whole
/// lease, ends `until_lost`, and the caller stops the command.
pub(crate) struct Heartbeat<'a, S> {
    store: &'a S,
    lease: Duration,
    /// When the write that last set the lease was sent: the store started the lease's time no earlier, so until
    /// a whole lease has passed on this machine's monotonic clock it is still ours (the usual lease assumption
    /// that clocks run at about the same rate; no clock sync is assumed).
    sent: Instant,
    /// When the next renewal is due.
    due: tokio::time::Instant,
    /// The renewal in flight and when it was sent.
    in_flight: Option<(Instant, Renewal<'a>)>,
    /// A renewal was refused, or none was accepted for a whole lease.
    lost: bool,
}

impl<'a, S: Store> Heartbeat<'a, S> {
    /// The heartbeat of a lease last set by a write sent at `sent` (a claim made ahead may be a while old).
    pub(crate) fn new(store: &'a S, lease: Duration, sent: Instant) -> Self {
        let due = tokio::time::Instant::from_std(sent) + lease / 3;
        Self { store, lease, sent, due, in_flight: None, lost: false }
    }

    /// When the write that last set the lease was sent.
    pub(crate) fn sent(&self) -> Instant {
        self.sent
    }

    /// Renews the lease whenever due and records each accepted renewal in `held`; resolves only once the lease
    /// is lost (a renewal refused: taken over; or none accepted for a whole lease: the ledger unreachable).
    ///
    /// Cancel-safe: dropped while a renewal is in flight, it keeps it for the next call, [`Heartbeat::settle`]
    /// or [`Heartbeat::fence`], one of which must come before any other ledger operation of the caller: a
    /// renewal left unpolled holds whatever the store gave it (a lock, a connection) meanwhile.
    pub(crate) async fn until_lost(&mut self, held: &mut Held) {
        while !self.lost {
            if self.in_flight.is_none() {
                tokio::time::sleep_until(self.due).await;
                self.in_flight = Some((Instant::now(), Box::pin(self.store.apply(held.renew()))));
            }
            self.answer(held).await;
        }
    }

    /// Waits for the renewal in flight, if any, and records its answer, so the lease generation in `held` is
    /// current before a write fenced on it (a release, or a renewal of its own). False when the lease is lost.
    pub(crate) async fn settle(&mut self, held: &mut Held) -> bool {
        self.answer(held).await;
        !self.lost
    }

    /// The fence before a step that needs the lease (starting the command, renaming the output into place):
    /// settles a renewal in flight, then renews now unless the lease was set less than a third of its length
    /// ago. False when the lease is lost or this renewal failed: the caller no longer holds the item.
    pub(crate) async fn fence(&mut self, held: &mut Held) -> bool {
        if planted("runner-fence") {
            // The planted bug "runner-fence": the fence not checked.
            return true;
        }
        if !self.settle(held).await {
            return false;
        }
        if self.sent.elapsed() < self.lease / 3 {
            return true;
        }
        let sent = Instant::now();
        match self.store.apply(held.renew()).await {
            Ok(Some(g)) => {
                self.renewed(held, sent, g);
                true
            }
            _ => false,
        }
    }

    /// Waits for the renewal in flight (if any) until the lease would lapse, and records its answer.
    async fn answer(&mut self, held: &mut Held) {
        if planted("runner-fence") {
            // The planted bug "runner-fence", its other half: a lost lease never noticed.
            if let Some((_, renewal)) = self.in_flight.take() {
                let _ = renewal.await;
            }
            self.due = tokio::time::Instant::now() + self.lease / 3;
            return;
        }
        let Some((sent, renewal)) = self.in_flight.as_mut() else { return };
        let lapses = tokio::time::Instant::from_std(self.sent + self.lease);
        let result = tokio::select! {
            result = renewal => result,
            () = tokio::time::sleep_until(lapses) => {
                // No answer before the lease lapsed: it is gone whatever the answer will be. The renewal is
                // dropped, not kept: left unpolled while the caller goes on to other ledger writes, it would
                // hold what it holds (the shared SQLite ledger's read guard, behind which that ledger's turn
                // taking, and then every later operation of the process, queue: a deadlock).
                self.in_flight = None;
                self.lost = true;
                return;
            }
        };
        let sent = *sent;
        self.in_flight = None;
        match result {
            Ok(Some(g)) => self.renewed(held, sent, g),
            Err(e) if e.is_precondition_failed() => self.lost = true,
            _ if self.sent.elapsed() >= self.lease => self.lost = true,
            // The ledger did not answer well: try again shortly, while the lease lasts.
            _ => self.due = tokio::time::Instant::now() + RETRY.min(self.lease / 3),
        }
    }

    fn renewed(&mut self, held: &mut Held, sent: Instant, generation: Generation) {
        held.renewed(generation);
        self.sent = sent;
        self.due = tokio::time::Instant::from_std(sent) + self.lease / 3;
    }
}

/// Test-only: whether `idem-verify` planted `bug` through `IDEM_PLANTED_BUG`, to show its checker catches it.
/// Compiled to `false` without debug assertions, so a release build can never carry a planted bug.
#[cfg(debug_assertions)]
fn planted(bug: &str) -> bool {
    std::env::var("IDEM_PLANTED_BUG").is_ok_and(|v| v == bug)
}

/// Release builds: never.
#[cfg(not(debug_assertions))]
fn planted(_bug: &str) -> bool {
    false
}
