//! A stop asked for in two steps, shared by everything that must stop together: the first request drains (no
//! new work is taken; work under way finishes), the second aborts (work under way is ended now), as a second
//! Ctrl-C means "now" to nginx and most servers. `idem serve`'s shutdown and `idem run`'s Ctrl-C are both this
//! one handle; [`Stop::on_signals`] turns SIGINT and SIGTERM into its requests.

use std::sync::Arc;

use tokio::sync::watch;

/// The level of a [`Stop`] once draining was asked for: nothing new is taken, work under way finishes.
pub const DRAIN: u8 = 1;
/// The level of a [`Stop`] once aborting was asked for: work under way is ended now.
pub const ABORT: u8 = 2;

/// A two-level stop handle: level 0 running, [`DRAIN`] (1), [`ABORT`] (2); a level never goes down. Cheap to
/// clone; all clones share one level, and every wait on it ([`Stop::reached`]) sees each request.
#[derive(Clone, Debug)]
pub struct Stop {
    tx: Arc<watch::Sender<u8>>,
}

impl Default for Stop {
    fn default() -> Self {
        Self::new()
    }
}

/// What SIGTERM asks of [`Stop::on_signals`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sigterm {
    /// The next level, as SIGINT does: a server drains on the first (what service managers send before their
    /// SIGKILL) and aborts on a second.
    LikeSigint,
    /// [`ABORT`] at once: a runner ends its commands (each attempt recorded as interrupted) and releases their
    /// leases, since a SIGTERM is not waited out by whoever sent it. SIGHUP (the terminal closed) aborts too,
    /// where the default action would end the process with its leases held and its attempts looking crashed;
    /// unless SIGHUP was ignored when the process started (`nohup`), which then keeps ignoring it.
    Aborts,
}

impl Stop {
    /// A stop not asked for yet (level 0).
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::Sender::new(0)) }
    }

    /// Asks for the next level and returns it: [`DRAIN`] the first time, [`ABORT`] after.
    pub fn request(&self) -> u8 {
        let mut level = 0;
        self.tx.send_modify(|l| {
            *l = l.saturating_add(1).min(ABORT);
            level = *l;
        });
        level
    }

    /// Asks for draining: level [`DRAIN`] unless it is higher already (so calling it again changes nothing).
    pub fn drain(&self) {
        self.tx.send_if_modified(|l| std::mem::replace(l, (*l).max(DRAIN)) != *l);
    }

    /// Asks for aborting: level [`ABORT`] (draining is implied).
    pub fn abort(&self) {
        self.tx.send_replace(ABORT);
    }

    /// The level asked for so far: 0 (none), [`DRAIN`] or [`ABORT`].
    pub fn level(&self) -> u8 {
        *self.tx.borrow()
    }

    /// Resolves once the level is `level` or higher (at once if it is already).
    pub async fn reached(&self, level: u8) {
        let mut rx = self.tx.subscribe();
        // The sender lives as long as `self`, so the wait ends only by the level.
        let _ = rx.wait_for(|l| *l >= level).await;
    }

    /// Turns signals into requests until the level is [`ABORT`]: each SIGINT asks for the next level, SIGTERM
    /// (and, for [`Sigterm::Aborts`], SIGHUP) as `sigterm` says. `said` is called with the new level before
    /// each request a signal makes (so what the request sets off is logged after it), to tell the operator what
    /// happens now (and how to make it happen sooner). A level reached otherwise ([`Stop::drain`] from the
    /// program) counts: the next signal then aborts.
    ///
    /// The handlers are installed by this call, not when the returned watch is first polled: a signal that
    /// comes between the call and the watch's first turn (a service manager stopping a process that just said it
    /// listens) is a request, not the default action that would end the process unflushed. Spawn the watch.
    ///
    /// # Errors
    /// The signal handlers cannot be installed (the process then stops only when killed); nothing was asked.
    pub fn on_signals<F: FnMut(u8)>(
        &self,
        sigterm: Sigterm,
        mut said: F,
    ) -> std::io::Result<impl std::future::Future<Output = ()> + use<F>> {
        use tokio::signal::unix::{SignalKind, signal};
        // Taken even when ignored at start (as a shell without job control starts `cmd &`): a script that sends
        // SIGINT to a background run asks it to drain, the documented way to stop a consumer gently.
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        // A server keeps SIGHUP for reloading (its own handler); `nohup` asked for a hang-up to be ignored.
        let mut hup = match sigterm {
            Sigterm::Aborts if !hangup_ignored() => Some(signal(SignalKind::hangup())?),
            _ => None,
        };
        let stop = self.clone();
        Ok(async move {
            while stop.level() < ABORT {
                // Whether the signal aborts at once; otherwise it asks for the next level.
                let aborts = tokio::select! {
                    _ = int.recv() => false,
                    _ = received(hup.as_mut()) => true,
                    _ = term.recv() => sigterm == Sigterm::Aborts,
                    () = stop.reached(ABORT) => break,
                };
                let level = if aborts || stop.level() >= DRAIN { ABORT } else { DRAIN };
                // Said before it is asked for: what the stop makes happen (a server saying which requests it
                // closed) is then logged after the operator was told why.
                said(level);
                if level == ABORT {
                    stop.abort();
                } else {
                    stop.drain();
                }
            }
        })
    }
}

/// The next delivery of a signal listened for; never when it is not (`None`).
async fn received(signal: Option<&mut tokio::signal::unix::Signal>) -> Option<()> {
    match signal {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

/// Whether SIGHUP was ignored when this process started, as `nohup` and `setsid`-style launchers leave it: a
/// handler installed for it would undo that choice (a closed terminal would then stop a run its user meant to
/// outlive the terminal). Read from the `SigIgn` mask in `/proc/self/status` (Linux; elsewhere `false`, so a
/// hang-up is handled): the mask is the one place that says it without `unsafe` code.
pub fn hangup_ignored() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| ignored_in(&status, 1))
}

/// Whether signal `number` (1-based) is set in the `SigIgn:` hexadecimal mask of a `/proc/PID/status` text.
fn ignored_in(status: &str, number: u32) -> bool {
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| (1..=64).contains(&number) && mask & (1 << (number - 1)) != 0)
}

#[cfg(test)]
mod tests {
    use super::{ABORT, DRAIN, Sigterm, Stop, ignored_in};

    #[test]
    fn the_ignored_mask_is_read_by_signal_number() {
        let status = "Name:\tidem\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000001001\nSigCgt:\t0\n";
        assert!(ignored_in(status, 1), "SIGHUP is bit 0");
        assert!(ignored_in(status, 13), "SIGPIPE is bit 12");
        assert!(!ignored_in(status, 2));
        assert!(!ignored_in(status, 0));
        assert!(!ignored_in("SigIgn:\tzz\n", 1));
        assert!(!ignored_in("", 1));
    }

    #[tokio::test]
    async fn levels_only_go_up_and_every_clone_sees_them() {
        let stop = Stop::new();
        let other = stop.clone();
        assert_eq!(stop.level(), 0);
        stop.drain();
        stop.drain();
        assert_eq!(other.level(), DRAIN);
        other.reached(DRAIN).await;
        assert_eq!(other.request(), ABORT);
        stop.drain();
        assert_eq!(stop.level(), ABORT, "draining after an abort leaves it aborted");
        assert_eq!(stop.request(), ABORT);
        stop.reached(ABORT).await;

        let fresh = Stop::new();
        fresh.abort();
        fresh.reached(DRAIN).await;
        assert_eq!(fresh.level(), ABORT);
    }

    #[tokio::test]
    async fn a_program_abort_ends_the_signal_watch() {
        let stop = Stop::new();
        let watch = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut said = Vec::new();
                let watch = stop.on_signals(Sigterm::LikeSigint, |level| said.push(level))?;
                watch.await;
                Ok::<_, std::io::Error>(said)
            }
        });
        stop.drain();
        stop.abort();
        let said = watch.await.expect("the watch ends").expect("signal handlers installed");
        assert!(said.is_empty(), "no signal came: {said:?}");
    }
}
