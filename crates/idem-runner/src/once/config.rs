//! What one `idem once` invocation is given, checked before the store is opened.

use std::path::PathBuf;
use std::time::Duration;

use idem_core::slot::Overlap;

use super::Schedule;
use crate::error::Error;

/// The longest `--timeout` and `--starting-deadline`: the longest `--every` period.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// Everything one invocation needs. Build with [`OnceConfig::new`] and set the rest.
#[derive(Clone, Debug)]
pub struct OnceConfig {
    /// The job's name ([`check_name`]): with the slot's time, the key of each run.
    pub name: String,
    /// When its slots are.
    pub schedule: Schedule,
    /// The command and its arguments (no placeholders: the slot is in the environment).
    pub command: Vec<String>,
    /// Attempts after the first, per slot, counted across invocations and machines (a crashed one's too).
    pub retries: u32,
    /// Lease length; renewed every third of it while the command runs. At least 1 s.
    pub lease: Duration,
    /// A slot not started within this time after its scheduled time is recorded missed instead of run
    /// (Kubernetes' `startingDeadlineSeconds`).
    pub starting_deadline: Option<Duration>,
    /// What a slot does while an earlier slot of the job still runs ([`Overlap`]; `--no-overlap` is
    /// [`Overlap::Skip`]). Kept in the job record: an invocation with another is refused.
    pub overlap: Overlap,
    /// Longest one attempt may run; the command's process group is then killed and the attempt fails.
    pub timeout: Option<Duration>,
    /// Slots that passed unseen (no invocation reached the store) within this time before the invocation are
    /// run, oldest first, before its own slot, instead of being recorded missed (Temporal's catch-up window).
    pub catchup_window: Option<Duration>,
    /// Each slot starts this much after its time at most: an offset every machine computes alike from the
    /// job's name and the slot ([`Schedule::jitter_offset`]), so jobs sharing a schedule spread out.
    pub jitter: Option<Duration>,
}

impl OnceConfig {
    /// A job `name` on `schedule` running `command`, with the defaults: 3 retries, a 10 s lease, no starting
    /// deadline, overlap allowed, no timeout, no catch-up, no jitter.
    pub fn new(name: impl Into<String>, schedule: Schedule, command: Vec<String>) -> Self {
        Self {
            name: name.into(),
            schedule,
            command,
            retries: 3,
            lease: Duration::from_secs(10),
            starting_deadline: None,
            overlap: Overlap::Allow,
            timeout: None,
            catchup_window: None,
            jitter: None,
        }
    }

    /// Checks the name, the command and the durations, and finds the program in `PATH` (a typo must not be
    /// recorded as the slot's failure).
    ///
    /// # Errors
    /// [`Error::Config`] naming what is wrong: a `lease` outside 1 s..=365 days (the store's TTL range), a
    /// `timeout`, `starting_deadline`, `catchup_window` or `jitter` of 0 or over 366 days.
    pub fn check(&self) -> Result<(), Error> {
        check_name(&self.name)?;
        let Some(program) = self.command.first() else {
            return Err(Error::Config("no command: give it after --".into()));
        };
        crate::supervise::check_program(program)?;
        if self.lease < idem_store::MIN_TTL || self.lease > idem_store::MAX_TTL {
            return Err(Error::Config("--lease must be from 1s to 365 days (it is a store TTL)".into()));
        }
        if self.starting_deadline.is_some_and(|d| d.is_zero() || d > MAX_DURATION) {
            return Err(Error::Config("--starting-deadline must be more than 0s and at most 366 days".into()));
        }
        // Bounded so the deadline (now + timeout) cannot overflow the clock: refused here, before the store
        // is opened, not after the claim.
        if self.timeout.is_some_and(|d| d.is_zero() || d > MAX_DURATION) {
            return Err(Error::Config("--timeout must be more than 0s and at most 366 days".into()));
        }
        if self.catchup_window.is_some_and(|d| d.is_zero() || d > MAX_DURATION) {
            return Err(Error::Config("--catchup-window must be more than 0s and at most 366 days".into()));
        }
        if self.jitter.is_some_and(|d| d < Duration::from_millis(1) || d > MAX_DURATION) {
            return Err(Error::Config("--jitter must be at least 1ms and at most 366 days".into()));
        }
        Ok(())
    }
}

pub use crate::config::check_name;

/// The default store of `idem once`: the SQLite file `idem/once.db` in the user's state directory
/// (`$XDG_STATE_HOME`, else `$HOME/.local/state`, as the XDG base directory specification says), so every
/// invocation of a job by one user on one machine finds the same file wherever cron starts it. Several
/// machines share PostgreSQL or Redis instead (`--store`).
///
/// # Errors
/// [`Error::Config`] when neither variable is set to an absolute path (a service without a home: give
/// `--store`).
pub fn default_store_path() -> Result<PathBuf, Error> {
    let absolute = |var: &str| std::env::var_os(var).map(PathBuf::from).filter(|p| p.is_absolute());
    if let Some(state) = absolute("XDG_STATE_HOME") {
        return Ok(state.join("idem").join("once.db"));
    }
    if let Some(home) = absolute("HOME") {
        return Ok(home.join(".local").join("state").join("idem").join("once.db"));
    }
    Err(Error::Config("no default store: neither XDG_STATE_HOME nor HOME is set; give --store".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_duration_is_bounded_before_the_store_is_opened() {
        let cfg = || OnceConfig::new("j", Schedule::every(Duration::from_secs(60)).unwrap(), vec!["true".into()]);
        assert!(cfg().check().is_ok());
        let year = Duration::from_secs(366 * 86_400);
        let huge = Duration::from_secs(u64::MAX);
        for (lease, ok) in [(Duration::from_millis(999), false), (idem_store::MAX_TTL, true), (year, false)] {
            let c = OnceConfig { lease, ..cfg() };
            assert_eq!(c.check().is_ok(), ok, "--lease {lease:?}");
        }
        for (d, ok) in [(Duration::ZERO, false), (year, true), (year + Duration::from_secs(1), false), (huge, false)] {
            let timeout = OnceConfig { timeout: Some(d), ..cfg() };
            assert_eq!(timeout.check().is_ok(), ok, "--timeout {d:?}");
            let deadline = OnceConfig { starting_deadline: Some(d), ..cfg() };
            assert_eq!(deadline.check().is_ok(), ok, "--starting-deadline {d:?}");
        }
        let e = OnceConfig { timeout: Some(huge), ..cfg() }.check().unwrap_err().to_string();
        assert!(e.contains("--timeout must be more than 0s and at most 366 days"), "{e}");
    }

    #[test]
    fn names_are_safe_in_keys_and_messages() {
        for good in ["nightly", "report.daily", "a_b-c", "9"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", ".hidden", "-x", "a/b", "a b", "é", &"x".repeat(101)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
