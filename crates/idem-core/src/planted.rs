//! Test-only: the bugs `idem-verify` plants (through `IDEM_PLANTED_BUG`) to show that its checkers catch them.
//! One switch for the server, the layer and the runner, compiled in only with the cargo feature
//! `planted-bugs`, which only the verification harness enables: without it no environment variable can switch
//! off a fingerprint, a fence or a precondition in a program that embeds these crates.

/// Whether `idem-verify` planted `bug` (`kv-precondition`, `proxy-completion`, `proxy-fingerprint`,
/// `runner-fence`, `runner-lapse-by-clock`, `once-overlap`, `once-missed-overwrite`, `once-trigger-overwrite`): the environment variable `IDEM_PLANTED_BUG` names it. Only with the feature `planted-bugs`.
#[doc(hidden)]
#[cfg(feature = "planted-bugs")]
pub fn planted(bug: &str) -> bool {
    std::env::var("IDEM_PLANTED_BUG").is_ok_and(|v| v == bug)
}

/// Without the feature `planted-bugs`: never, whatever the environment says.
#[doc(hidden)]
#[cfg(not(feature = "planted-bugs"))]
#[inline(always)]
pub const fn planted(_bug: &str) -> bool {
    false
}

/// `write` with its precondition dropped when `bug` is planted ([`planted`]): a create-only or fenced write made
/// unconditional, so a planted bug in a caller stays a one-line change.
#[doc(hidden)]
pub fn unconditional(bug: &str, write: crate::Write) -> crate::Write {
    if planted(bug) { crate::Write { precondition: idem_store::Precondition::Any, ..write } } else { write }
}
