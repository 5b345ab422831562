//! A command supervised under a lease, the one home of what `idem run` ([`crate::engine`]) and `idem once`
//! ([`crate::once`]) do to the processes they start: spawn a command leading a process group of its own, list
//! it with the [`Watchdog`] (so it dies with a killed runner, and is stopped while the runner is paused), stop
//! and continue it as its lease is in doubt and renewed, kill the group, keep its output's tail
//! ([`Bytes`], [`Lines`]), and find its program in `PATH` ([`check_program`]) under this process's
//! [`owner_token`].
//!
//! It knows leases only as an [`idem_store::LeaseKeeper`] over any [`Renewable`]: what the lease guards (a
//! ledger item, a cron slot) and what a loss means for it stay with the caller, which [`Group::watch`] hands
//! every event it cannot decide alone.

mod program;
mod tail;
mod watchdog;

use std::future::Future;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_store::{LeaseKeeper, Lost, Renewable, Store};
use rustix::process::Signal;
use tokio::time::Instant;

pub use program::owner_token;
pub(crate) use program::{check_program, host_name, jobs_within_descriptor_limit, owner_host};
pub(crate) use tail::{Bytes, Lines};
pub(crate) use watchdog::Watchdog;

/// A command's child leading its own process group, listed with the watchdog from its start until dropped.
pub(crate) struct Group<'w> {
    child: tokio::process::Child,
    /// Kept: once the command has been reaped, `child.id()` is gone, but its group may live on.
    pgid: Option<u32>,
    watchdog: Option<&'w Watchdog>,
    /// The watchdog's word that the runner ran again after a pause ([`Watchdog::resumed`]).
    resumed: Option<tokio::sync::watch::Receiver<u64>>,
    /// Stopped (SIGSTOP) for its lease, by [`OnLapse::Freeze`].
    frozen: bool,
    /// When to continue the group once more after a pause (see [`Group::watch`]).
    cont_again: Option<Instant>,
}

impl<'w> Group<'w> {
    /// Spawns `cmd` leading a process group of its own (a terminal's Ctrl-C reaches the runner only, which
    /// decides; a kill of the group reaches what the command started), killed if dropped, and lists it with
    /// `watchdog`.
    ///
    /// # Errors
    /// The spawn's error (program not found, out of descriptors or processes).
    pub(crate) fn spawn(cmd: &mut tokio::process::Command, watchdog: Option<&'w Watchdog>) -> std::io::Result<Self> {
        let child = cmd.process_group(0).kill_on_drop(true).spawn()?;
        let pgid = child.id();
        if let (Some(w), Some(p)) = (watchdog, pgid) {
            w.started(p);
        }
        let resumed = watchdog.map(Watchdog::resumed);
        Ok(Self { child, pgid, watchdog, resumed, frozen: false, cont_again: None })
    }

    /// The child, for its pipes.
    pub(crate) fn child(&mut self) -> &mut tokio::process::Child {
        &mut self.child
    }

    /// Whether the command has exited 0 already (without waiting).
    pub(crate) fn exited_ok(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(s)) if s.success())
    }

    /// Kills the command and everything it started (its process group), then reaps it.
    pub(crate) async fn kill(&mut self) {
        // The child leads its own group, so this also reaches the shell's children, which would otherwise
        // outlive it and keep writing.
        self.signal(Signal::KILL);
        let _ = self.child.kill().await;
    }

    /// Sends `signal` to the command's process group.
    fn signal(&self, signal: Signal) {
        signal_group(self.pgid, signal);
    }

    /// Stops the group for its lease (SIGSTOP), counting it in `stopped`.
    fn freeze(&mut self, stopped: &AtomicU64) {
        stopped.fetch_add(1, Ordering::Relaxed);
        self.signal(Signal::STOP);
        self.frozen = true;
    }

    /// Waits for the command beside its lease, its `deadline` and an interrupt, until something happens that
    /// the caller decides ([`Event`]); called again after a [`Event::Lost`] the caller repaired.
    ///
    /// The watchdog stops the command when this runner stops beating (paused): when it beats again, the command
    /// goes on (SIGCONT) if its lease is still valid (else it stays stopped, and the lapse is handled as any
    /// other). The watchdog may act on ticks it read just before the heartbeat that ended the pause, so the
    /// SIGCONT is sent again a quiet limit later.
    ///
    /// The lease is renewed beside the wait (not inside an arm of it), so a slow store never delays noticing
    /// the command's exit, its deadline or an interrupt. When the lease is in doubt is read from the keeper's
    /// latest accepted renewal each turn: renewals are accepted inside `until_lost`, which does not resolve
    /// on them, so an instant worked out once goes stale.
    pub(crate) async fn watch<S: Store + Sync, R: Renewable>(
        &mut self,
        keeper: &mut LeaseKeeper<'_, S>,
        held: &mut R,
        watch: &mut Watch<'_, impl Future<Output = ()> + Unpin>,
    ) -> Event {
        let lease = keeper.length();
        let quiet = watchdog::quiet_for(lease);
        let freeze = match &watch.on_lapse {
            OnLapse::Freeze(freeze) => Some(freeze),
            OnLapse::Run => None,
        };
        let margin = freeze.map_or(Duration::ZERO, |f| f.margin);
        let notice_loss = freeze.is_none_or(|f| f.notice_loss);
        // Past this instant with no renewal accepted, another runner may take the item over once the lease
        // lapses: a frozen command must not run beside its successor.
        let doubtful = |sent: Instant| sent + lease - margin;
        loop {
            if let Some(f) = freeze
                && self.frozen
                && (f.give_up)()
            {
                self.kill().await;
                return Event::GaveUp;
            }
            let due = doubtful(keeper.sent());
            if self.frozen && Instant::now() < due {
                tracing::warn!(item = %watch.label, "lease renewed: the command goes on (SIGCONT)");
                self.signal(Signal::CONT);
                self.frozen = false;
            }
            if let Some(at) = self.cont_again
                && Instant::now() >= at
            {
                self.cont_again = None;
                if !self.frozen && Instant::now() < due {
                    self.signal(Signal::CONT);
                }
            }
            // Frozen, look every 50 ms whether a renewal was accepted meanwhile.
            let wake = match freeze {
                Some(_) if self.frozen => Some(Instant::now() + Duration::from_millis(50)),
                Some(_) => Some(due),
                None => None,
            };
            let wake = match (wake, self.cont_again) {
                (Some(w), Some(at)) => Some(w.min(at)),
                (w, at) => w.or(at),
            };
            tokio::select! {
                // The command's exit first: a lease loss seen in the same round must not hide that it finished.
                biased;
                status = self.child.wait() => {
                    // What it left running in its group (a background child, one that ignored SIGTERM) dies
                    // with it, as systemd's control group and a Kubernetes pod end: the attempt is recorded and
                    // its lease given back next, and nothing of it may go on writing beside the next holder or
                    // the next slot. (A process meant to outlive it leaves the group: setsid.)
                    self.signal(Signal::KILL);
                    return Event::Exited(status);
                }
                why = keeper.until_lost(held), if notice_loss => {
                    // No renewal accepted for a whole lease (the store unavailable, or this runner paused), or a
                    // renewal refused. Frozen, the command stays stopped until the lease is ours again, if nobody
                    // took it over meanwhile.
                    if let Some(f) = freeze
                        && !self.frozen
                    {
                        self.freeze(f.stopped);
                    }
                    return Event::Lost(why);
                }
                () = changed(&mut self.resumed) => {
                    if !self.frozen && Instant::now() < doubtful(keeper.sent()) {
                        tracing::debug!(item = %watch.label, "the runner beats again: the command goes on (SIGCONT)");
                        self.signal(Signal::CONT);
                        self.cont_again = Some(Instant::now() + quiet);
                    }
                }
                () = sleep_until(wake) => {
                    if let Some(f) = freeze
                        && !self.frozen
                        && Instant::now() >= doubtful(keeper.sent())
                    {
                        tracing::warn!(
                            item = %watch.label,
                            "no lease renewal accepted for {:.1}s of a {:.0}s lease: the command is stopped \
                             (SIGSTOP) until one is",
                            keeper.sent().elapsed().as_secs_f64(),
                            lease.as_secs_f64()
                        );
                        self.freeze(f.stopped);
                    }
                }
                () = sleep_until(watch.deadline) => {
                    self.kill().await;
                    return Event::TimedOut;
                }
                () = &mut watch.interrupt => {
                    self.kill().await;
                    return Event::Interrupted;
                }
            }
        }
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        if let (Some(w), Some(p)) = (self.watchdog, self.pgid) {
            w.ended(p);
        }
    }
}

/// What [`Group::watch`] watches besides the command's exit.
pub(crate) struct Watch<'a, I> {
    /// What the log lines name (the item's id).
    pub(crate) label: &'a str,
    /// What a lease in doubt does to the command.
    pub(crate) on_lapse: OnLapse<'a>,
    /// When the command is killed for taking too long (`--timeout`).
    pub(crate) deadline: Option<Instant>,
    /// Resolves when the command must be killed because the runner stops (a signal).
    pub(crate) interrupt: I,
}

/// What a lease in doubt does to the command.
pub(crate) enum OnLapse<'a> {
    /// It runs until the lease is lost (`idem once`: the caller then kills it).
    Run,
    /// It is stopped before the lease could lapse, and continued once a renewal is accepted (`idem run`).
    Freeze(Freeze<'a>),
}

/// [`OnLapse::Freeze`]'s settings.
pub(crate) struct Freeze<'a> {
    /// The command is stopped this long before its lease would lapse with no renewal accepted.
    pub(crate) margin: Duration,
    /// Counts every stop (the summary's "stopped").
    pub(crate) stopped: &'a AtomicU64,
    /// Asked while the command is stopped: true kills it ([`Event::GaveUp`]), e.g. the store stayed
    /// unavailable past its limit.
    pub(crate) give_up: &'a (dyn Fn() -> bool + Sync),
    /// Whether a lost lease is noticed at all while the command runs (false only for a planted bug).
    pub(crate) notice_loss: bool,
}

/// What [`Group::watch`] hands to its caller.
#[derive(Debug)]
pub(crate) enum Event {
    /// The command exited (or could not be waited for).
    Exited(std::io::Result<ExitStatus>),
    /// The lease was lost. Under [`OnLapse::Freeze`] the command is stopped (take the lease again and watch on,
    /// or kill it); under [`OnLapse::Run`] it still runs.
    Lost(Lost),
    /// The deadline passed: the command was killed.
    TimedOut,
    /// The interrupt resolved: the command was killed.
    Interrupted,
    /// [`Freeze::give_up`] said so while the command was stopped: it was killed.
    GaveUp,
}

/// Resolves when `rx` sees a new value; never without a watchdog (or once it is gone).
async fn changed(rx: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(rx) = rx
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// Sends `signal` to the process group `pgid` (a [`Group`]'s: its command's pid, which leads it; `None`: nothing),
/// for a caller that asks a command to stop from outside its watch (`idem once`'s `cancel-other`: SIGTERM
/// first). The one place the runner signals a group.
pub(crate) fn signal_group(pgid: Option<u32>, signal: Signal) {
    if let Some(pid) = pgid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Sleeps until `at`; never without it.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
